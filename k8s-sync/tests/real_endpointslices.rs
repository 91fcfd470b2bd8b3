//! The seed guide with Kubernetes' own EndpointSlice controller (kube-controller-manager)
//! making the slices from Pods, as in a real cluster: Pods on node-a, node-a and node-c
//! with a named container port; the test plays the kubelet by writing Pod status.

mod common;

use anyhow::{Context, Result};
use common::*;

fn pod(name: &str, node: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
  labels: {{app: nginx}}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 30
  containers:
    - name: nginx
      image: nginx:1.27
      ports:
        - containerPort: 8080
          name: http
"
    )
}

/// What a kubelet would report: Running, the Pod IP, Ready or not.
fn set_pod_status(env: &Env, name: &str, ip: &str, ready: bool) -> Result<()> {
    let r = if ready { "True" } else { "False" };
    env.kubectl(&[
        "patch",
        "pod",
        name,
        "-n",
        "default",
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!(
            r#"{{"status":{{"phase":"Running","podIP":"{ip}","podIPs":[{{"ip":"{ip}"}}],"conditions":[{{"type":"Ready","status":"{r}"}},{{"type":"ContainersReady","status":"{r}"}}]}}}}"#
        ),
    ])?;
    Ok(())
}

#[test]
fn seed_guide_with_the_real_endpointslice_controller() -> Result<()> {
    let mut env = Env::start()?;
    env.k.start_controller_manager()?;
    env.nodes(&[("node-a", "192.168.70.1"), ("node-c", "192.168.70.3")])?;
    let _controller = env.controller("kcm-test")?;
    env.apply(SEED_NETWORK)?;
    env.apply(&service("nginx", &[], ""))?;
    for (name, node, ip) in [
        ("nginx-1", "node-a", "10.244.1.10"),
        ("nginx-2", "node-a", "10.244.1.11"),
        ("nginx-3", "node-c", "10.244.3.10"),
    ] {
        env.apply(&pod(name, node))?;
        set_pod_status(&env, name, ip, true)?;
    }

    let st = eventually("nginx Ready from controller-made EndpointSlices", || {
        Ok(slb_status(&env, "nginx")?
            .filter(|s| s["phase"] == "Ready" && s["backendSummary"]["totalReady"] == 3))
    })?;
    assert_eq!(strs(&st["advertisingNodes"]), ["node-a", "node-c"]);
    assert_eq!(st["backendSummary"]["localReadyNodes"], 2);
    assert_eq!(st["addressPool"], "public-v4");
    let vip = st["vip"].as_str().context("vip")?.to_string();
    assert_eq!(eventually("ingress", || ingress_ip(&env, "nginx"))?, vip);
    // The slices really are the EndpointSlice controller's, with the named port resolved.
    let slices = env.json(&[
        "get",
        "endpointslices",
        "-n",
        "default",
        "-l",
        "kubernetes.io/service-name=nginx",
    ])?;
    let items = slices["items"].as_array().context("items")?;
    assert!(items.iter().all(|s| s["metadata"]["labels"]
        ["endpointslice.kubernetes.io/managed-by"]
        == "endpointslice-controller.k8s.io"));
    assert!(
        items.iter().any(|s| s["ports"][0]["port"] == 8080),
        "{slices}"
    );

    // `kubectl juneau describe` shows the target port the Pods' named port resolves to.
    let out = kubectl_juneau(&env, &["describe", "loadbalancer", "nginx"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    assert!(
        text.starts_with(&format!(
            "ServiceLoadBalancer  default/nginx  (vip: {vip}, phase: Ready)\n"
        )),
        "{text}"
    );
    assert!(text.contains("│   └── TCP/80  ->  8080\n"), "{text}");
    assert!(
        text.ends_with("└── Backends  totalReady=3  localReadyNodes=2\n"),
        "{text}"
    );

    // A Pod turns unready: node-c stops advertising.
    set_pod_status(&env, "nginx-3", "10.244.3.10", false)?;
    eventually("node-c withdrawn", || {
        Ok(slb_status(&env, "nginx")?.filter(|s| {
            strs(&s["advertisingNodes"]) == ["node-a"] && s["backendSummary"]["totalReady"] == 2
        }))
    })?;
    // Pods being deleted (no kubelet finishes them: they stay terminating): node-a too.
    env.kubectl(&[
        "delete",
        "pod",
        "nginx-1",
        "nginx-2",
        "-n",
        "default",
        "--wait=false",
    ])?;
    let st = eventually("terminating Pods advertise nothing", || {
        Ok(slb_status(&env, "nginx")?.filter(|s| strs(&s["advertisingNodes"]).is_empty()))
    })?;
    assert_eq!(st["phase"], "Pending");
    assert_eq!(st["vip"], vip.as_str());
    // node-c's Pod comes back.
    set_pod_status(&env, "nginx-3", "10.244.3.10", true)?;
    eventually("node-c advertises again", || {
        Ok(slb_status(&env, "nginx")?
            .filter(|s| strs(&s["advertisingNodes"]) == ["node-c"] && s["phase"] == "Ready"))
    })?;
    Ok(())
}
