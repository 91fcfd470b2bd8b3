//! `deploy/` against the real kube-apiserver: the kustomization validates with
//! `kubectl apply --dry-run=server -k deploy/`, and once applied, the ServiceAccounts
//! get what the components use and nothing like cluster-admin.

use anyhow::Result;
use juneau_tests::kube::KubeCluster;

fn deploy_dir() -> String {
    let dir = juneau_tests::repo_root().join("deploy");
    dir.canonicalize().unwrap_or(dir).display().to_string()
}

#[test]
fn deploy_kustomization_validates_on_the_server() -> Result<()> {
    let k = KubeCluster::start()?;
    let deploy = deploy_dir();
    // Namespaced objects need their namespace to exist, even for a dry run.
    k.kubectl(&["apply", "-f", &format!("{deploy}/namespace.yaml")])?;
    let out = k.kubectl(&["apply", "--dry-run=server", "-k", &deploy])?;
    for expected in [
        "customresourcedefinition.apiextensions.k8s.io/addresspools.juneau.loutres.me",
        "customresourcedefinition.apiextensions.k8s.io/externalnetworks.juneau.loutres.me",
        "customresourcedefinition.apiextensions.k8s.io/serviceloadbalancers.juneau.loutres.me",
        "customresourcedefinition.apiextensions.k8s.io/bgppeers.juneau.loutres.me",
        "customresourcedefinition.apiextensions.k8s.io/bgpadvertisements.juneau.loutres.me",
        "serviceaccount/juneau-controller",
        "serviceaccount/juneau-node",
        "clusterrole.rbac.authorization.k8s.io/juneau-controller",
        "clusterrole.rbac.authorization.k8s.io/juneau-node",
        "deployment.apps/juneau-controller",
        "daemonset.apps/juneau-node",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(expected) && l.ends_with("(server dry run)")),
            "`kubectl apply --dry-run=server -k deploy/` did not validate {expected}:\n{out}"
        );
    }
    Ok(())
}

#[test]
fn deploy_rbac_is_least_privilege() -> Result<()> {
    let k = KubeCluster::start()?;
    let deploy = deploy_dir();
    k.kubectl(&["apply", "-k", &deploy])?;
    let can = |sa: &str, verb: &str, resource: &str, ns: &str| -> Result<bool> {
        let who = format!("system:serviceaccount:juneau-system:{sa}");
        let out = k.kubectl_output(&["auth", "can-i", verb, resource, "--as", &who, "-n", ns])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
    };
    let controller_may = [
        ("watch", "services", "default"),
        ("patch", "services/status", "default"),
        (
            "create",
            "serviceloadbalancers.juneau.loutres.me",
            "default",
        ),
        (
            "patch",
            "serviceloadbalancers.juneau.loutres.me/status",
            "default",
        ),
        ("list", "endpointslices.discovery.k8s.io", "default"),
        ("watch", "namespaces", "default"),
        ("create", "events.events.k8s.io", "default"),
        ("patch", "leases.coordination.k8s.io", "juneau-system"),
    ];
    for (verb, res, ns) in controller_may {
        assert!(
            can("juneau-controller", verb, res, ns)?,
            "controller cannot {verb} {res} in {ns}"
        );
    }
    let controller_must_not = [
        ("get", "secrets", "default"),
        ("delete", "services", "default"),
        ("create", "pods", "default"),
        ("update", "leases.coordination.k8s.io", "kube-system"),
        ("patch", "nodes", "default"),
        ("update", "services", "default"),
        ("list", "configmaps", "default"),
        ("patch", "namespaces", "default"),
    ];
    for (verb, res, ns) in controller_must_not {
        assert!(
            !can("juneau-controller", verb, res, ns)?,
            "controller may {verb} {res} in {ns}"
        );
    }
    for (verb, res, ns) in [
        ("watch", "serviceloadbalancers.juneau.loutres.me", "default"),
        ("watch", "endpointslices.discovery.k8s.io", "default"),
        ("list", "bgppeers.juneau.loutres.me", "default"),
        ("watch", "secrets", "juneau-system"),
        // the decommission request on the node DaemonSet (helm uninstall)
        ("watch", "daemonsets.apps", "juneau-system"),
    ] {
        assert!(
            can("juneau-node", verb, res, ns)?,
            "node agent cannot {verb} {res} in {ns}"
        );
    }
    for (verb, res, ns) in [
        ("get", "secrets", "default"),
        ("patch", "serviceloadbalancers.juneau.loutres.me", "default"),
        ("patch", "services/status", "default"),
        ("create", "events.events.k8s.io", "default"),
        ("list", "addresspools.juneau.loutres.me", "default"),
        ("patch", "nodes", "default"),
        ("patch", "daemonsets.apps", "juneau-system"),
        ("watch", "daemonsets.apps", "default"),
    ] {
        assert!(
            !can("juneau-node", verb, res, ns)?,
            "node agent may {verb} {res} in {ns}"
        );
    }
    Ok(())
}
