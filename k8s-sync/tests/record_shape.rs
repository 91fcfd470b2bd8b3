//! The ServiceLoadBalancer CRD of earlier releases (with a status subresource) still
//! installed under this controller — Helm never upgrades a chart's `crds/` — and then
//! upgraded while it runs: the records are written whole where the CRD allows it and
//! spec and status apart where it does not, found out from the apiserver's answers,
//! nothing lost either way (k8s-sync/src/records.rs). A real kube-apiserver.

mod common;

use anyhow::Result;
use common::*;

fn advertising(env: &Env, name: &str) -> Result<Option<Vec<String>>> {
    Ok(slb_status(env, name)?
        .filter(|s| s["phase"] == "Ready")
        .map(|s| strs(&s["advertisingNodes"])))
}

fn slice(env: &Env, svc: &str, nodes: &[&str]) -> Result<()> {
    let eps: Vec<(String, &str)> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (format!("10.244.{}.10", i + 1), *n))
        .collect();
    let eps: Vec<(&str, &str, bool, bool)> = eps
        .iter()
        .map(|(ip, n)| (ip.as_str(), *n, true, false))
        .collect();
    env.apply(&endpoint_slice(svc, &format!("{svc}-1"), &eps, 8080))?;
    Ok(())
}

fn subresource(env: &Env, add: bool) -> Result<()> {
    let op = match add {
        true => r#"[{"op":"add","path":"/spec/versions/0/subresources","value":{"status":{}}}]"#,
        false => r#"[{"op":"remove","path":"/spec/versions/0/subresources"}]"#,
    };
    env.kubectl(&[
        "patch",
        "crd",
        "serviceloadbalancers.juneau.loutres.me",
        "--type=json",
        "-p",
        op,
    ])?;
    // The apiserver serves the new shape once the CRD is re-established; `/status`
    // answers (or stops answering) only then.
    eventually("the CRD's new shape served", || {
        let r = env.kubectl(&["get", "--raw", "/apis/juneau.loutres.me/v1alpha1"])?;
        Ok((r.contains("serviceloadbalancers/status") == add).then_some(()))
    })
}

#[test]
fn records_are_written_whole_or_apart_as_the_installed_crd_allows() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.50.1"), ("node-c", "192.168.50.3")])?;
    env.apply(SEED_NETWORK)?;
    subresource(&env, true)?;
    let mut controller = env.controller("replica-1")?;

    // The earlier CRD: a new Service's record gets its status through /status.
    env.apply(&service("older", &[], ""))?;
    slice(&env, "older", &["node-a"])?;
    eventually("older Ready from node-a under the earlier CRD", || {
        controller.check_running()?;
        Ok(advertising(&env, "older")?.filter(|n| *n == ["node-a"]))
    })?;
    let vip = slb_status(&env, "older")?.unwrap()["vip"].clone();
    eventually("older's ingress IP", || {
        Ok(ingress_ip(&env, "older")?.filter(|ip| *ip == vip))
    })?;
    // ... and a change of an existing record's status too.
    slice(&env, "older", &["node-a", "node-c"])?;
    eventually("older follows its endpoints under the earlier CRD", || {
        Ok(advertising(&env, "older")?.filter(|n| *n == ["node-a", "node-c"]))
    })?;

    // The CRD upgraded while the controller runs: /status is gone.
    subresource(&env, false)?;
    slice(&env, "older", &["node-c"])?;
    eventually("older follows its endpoints after the upgrade", || {
        controller.check_running()?;
        Ok(advertising(&env, "older")?.filter(|n| *n == ["node-c"]))
    })?;
    env.apply(&service("newer", &[], ""))?;
    slice(&env, "newer", &["node-a"])?;
    eventually("newer Ready after the upgrade", || {
        Ok(advertising(&env, "newer")?.filter(|n| *n == ["node-a"]))
    })?;
    assert_eq!(
        slb_status(&env, "older")?.unwrap()["vip"],
        vip,
        "older kept its VIP through both changes"
    );

    let log = controller.log_text();
    for said in [
        "has a status subresource (an earlier CRD)",
        "has no status subresource",
    ] {
        assert!(
            log.contains(said),
            "the controller did not log {said:?}:\n{}",
            tail(&log, 40)
        );
    }
    assert!(
        !log.contains("reconcile failed"),
        "a reconcile failed:\n{}",
        tail(&log, 40)
    );
    Ok(())
}
