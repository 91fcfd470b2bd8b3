//! The Kubernetes test harness itself: a real etcd + kube-apiserver starts, serves the
//! installed `kubectl`, honours ServiceAccount RBAC, and leaves nothing behind.

use std::path::Path;

use anyhow::Result;
use juneau_tests::kube::KubeCluster;

#[test]
fn cluster_serves_kubectl_and_leaves_nothing_behind() -> Result<()> {
    let (pids, dir) = {
        let k = KubeCluster::start()?;
        k.kubectl(&["create", "namespace", "juneau-harness"])?;
        let ns = k.kubectl(&["get", "ns", "-o", "name"])?;
        assert!(
            ns.lines().any(|l| l == "namespace/juneau-harness"),
            "namespace missing: {ns}"
        );

        // A ServiceAccount allowed only to list namespaces: it can, and nothing more.
        k.apply_yaml(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: lister, namespace: juneau-harness}\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: ns-lister}\n\
             rules: [{apiGroups: [\"\"], resources: [namespaces], verbs: [list]}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: ns-lister}\n\
             roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: ns-lister}\n\
             subjects: [{kind: ServiceAccount, name: lister, namespace: juneau-harness}]\n",
        )?;
        let sa = k.service_account_kubeconfig("juneau-harness", "lister")?;
        let listed = k.kubectl_as(&sa, &["get", "ns", "-o", "name"])?;
        assert!(listed.contains("namespace/juneau-harness"), "{listed}");
        let denied = k
            .kubectl_as(&sa, &["get", "secrets", "-A"])
            .unwrap_err()
            .to_string();
        assert!(
            denied.contains("forbidden"),
            "expected RBAC to forbid secrets: {denied}"
        );

        (k.pids(), k.dir().to_path_buf())
    };
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} still running"
        );
    }
    assert!(!dir.exists(), "{} left behind", dir.display());
    Ok(())
}

#[test]
fn controller_manager_makes_endpointslices() -> Result<()> {
    let mut k = KubeCluster::start()?;
    k.start_controller_manager()?;
    k.apply_yaml(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n\
         spec: {selector: {app: web}, ports: [{port: 80, protocol: TCP}]}\n",
    )?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let out = k.kubectl(&[
            "get",
            "endpointslices",
            "-n",
            "default",
            "-l",
            "kubernetes.io/service-name=web",
            "-o",
            "name",
        ])?;
        if !out.trim().is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no EndpointSlice for Service web within 120 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    Ok(())
}
