//! One real node of the harness (`juneau_tests::node`): its own containerd and a real
//! kubelet in a network namespace register a Node, run the locally built nginx image in a
//! Pod that becomes Ready by its own HTTP readiness probe on the Pod network (bridge +
//! host-local CNI on `cni0`), serve `kubectl logs`, and stop it through its preStop hook;
//! dropping the node leaves no process, mount, cgroup or directory behind.
//!
//! Needs root and what tests/setup.sh installs (containerd, runc, CNI plugins, kubelet).

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};
use juneau_tests::daemon::wait_for;
use juneau_tests::images::Images;
use juneau_tests::kube::{binaries_dir, ClusterOptions, KubeCluster};
use juneau_tests::netns::{run, unique_prefix, Netns};
use juneau_tests::node::{check_gone, KubeletNode, NodeSpec};

const HOST: Ipv4Addr = Ipv4Addr::new(10, 253, 0, 1);
const NODE: Ipv4Addr = Ipv4Addr::new(10, 253, 0, 2);

#[test]
fn a_real_kubelet_runs_a_ready_pod_and_leaves_nothing() -> Result<()> {
    let p = unique_prefix("kn");
    let netns = Netns::new(format!("{p}n"))?;
    // host <-> node link: the apiserver listens on the host end, the kubelet on the node's.
    let host_if = format!("{p}h");
    run(
        "ip",
        &[
            "link",
            "add",
            &host_if,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns.name(),
        ],
    )?;
    struct Link(String);
    impl Drop for Link {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["link", "del", &self.0]).output();
        }
    }
    let _link = Link(host_if.clone());
    run(
        "ip",
        &["addr", "add", &format!("{HOST}/30"), "dev", &host_if],
    )?;
    run("ip", &["link", "set", &host_if, "up"])?;
    netns.addr("eth0", &format!("{NODE}/30"))?;
    netns.exec(&["ip", "route", "add", "default", "via", &HOST.to_string()])?;
    netns.exec(&["ip", "link", "add", "cni0", "type", "bridge"])?;
    netns.addr("cni0", "10.253.1.1/24")?;

    let k = KubeCluster::start_with(ClusterOptions {
        bind_address: HOST,
        ..Default::default()
    })?;
    let tmp = tempfile::tempdir()?;
    let images = Images::build(&tmp.path().join("images"))?;
    let dir = tmp.path().join("node");
    let cgroup_root = format!("/{p}");
    let name = format!("{p}-node");
    let mut node = KubeletNode::start(
        NodeSpec {
            name: name.clone(),
            netns: netns.name().to_string(),
            node_ip: NODE,
            node_ip6: None,
            pod_subnet: Ipv4Addr::new(10, 253, 1, 0),
            pod_subnet6: None,
            dir: dir.clone(),
            cgroup_root: cgroup_root.clone(),
            kubeconfig: k.kubeconfig().to_path_buf(),
            labels: vec![],
        },
        &images,
        &binaries_dir()?.join("kubelet"),
    )?;
    node.wait_ready(k.kubeconfig(), Duration::from_secs(120))?;

    k.apply_yaml(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: web, namespace: default}}
spec:
  nodeName: {name}
  terminationGracePeriodSeconds: 10
  containers:
    - name: nginx
      image: nginx:1.27
      imagePullPolicy: Never
      ports: [{{containerPort: 80, name: http}}]
      readinessProbe:
        httpGet: {{path: /healthz, port: http}}
        periodSeconds: 1
      lifecycle:
        preStop:
          exec: {{command: ["/bin/drain", "1"]}}
"#
    ))?;
    let ip = wait_for(
        "Pod web Ready",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || {
            let out = k.kubectl(&[
                "get",
                "pod",
                "web",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status} {.status.podIP}",
            ])?;
            let mut it = out.split_whitespace();
            Ok(match (it.next(), it.next()) {
                (Some("True"), Some(ip)) => Some(ip.to_string()),
                _ => None,
            })
        },
    )?;
    assert!(
        ip.starts_with("10.253.1."),
        "Pod IP {ip} not from the node's Pod subnet"
    );
    let page = netns.exec(&["curl", "-sS", "-m", "5", &format!("http://{ip}/")])?;
    assert!(page.contains("Welcome to nginx"), "{page}");
    let log = k.kubectl(&["logs", "web"])?;
    assert!(
        log.contains("10.253.1.1 - - ["),
        "the request from the node is not in kubectl logs: {log}"
    );
    k.kubectl(&["delete", "pod", "web", "--wait=true", "--timeout=60s"])?;

    drop(node);
    check_gone(&dir, &cgroup_root)?;
    let cni = run("ip", &["netns", "list"])?;
    if String::from_utf8_lossy(&cni.stdout).contains("cni-") {
        bail!(
            "a Pod namespace is left: {}",
            String::from_utf8_lossy(&cni.stdout)
        );
    }
    Ok(())
}
