//! A deposed leader's writes are fenced, against a real kube-apiserver with two real
//! controller replicas.
//!
//! r1 leads and gives s1 the first address; r1 is then frozen (SIGSTOP, as a long GC
//! pause, a stalled VM or a partition would); r2 takes the Lease, deletes s1's VIP
//! with s1 and gives that address to s2. When r1 thaws, its watch delivers everything at
//! once while its VIP book still says s1 holds the first address: without a fence it
//! would move s2 to the second address. Every write is checked against the Lease and
//! carries the resourceVersion it was decided from, so s2 keeps its VIP.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use common::*;

const NET: &str = "apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: fence}
spec: {advertiseMode: bgp, addresses: [198.18.7.1-198.18.7.3]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: ExternalNetwork
metadata: {name: fence}
spec: {type: bgp, addressPools: [fence]}
";

fn svc(name: &str) -> String {
    service(name, &[], "").replace(
        "juneau.loutres.me/load-balancer-external-network: public",
        "juneau.loutres.me/load-balancer-external-network: fence",
    )
}

fn holder(env: &Env) -> Result<Option<String>> {
    Ok(env
        .get("lease", "juneau-controller", Some("juneau-system"))?
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from)))
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    let st = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?;
    ensure!(st.success(), "kill {sig} {pid}");
    Ok(())
}

/// Now as a Kubernetes MicroTime.
fn run_date() -> Result<String> {
    let out = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%S.%6NZ"])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn a_deposed_leader_does_not_overwrite_the_new_leaders_decisions() -> Result<()> {
    let env = Env::start()?;
    env.apply(NET)?;
    let r1 = env.controller("r1")?;
    env.apply(&svc("s1"))?;
    let first = eventually("s1 gets the first address", || ingress_ip(&env, "s1"))?;
    assert_eq!(first, "198.18.7.1");
    assert_eq!(holder(&env)?.as_deref(), Some("r1"));

    // r1 freezes; r2 takes over once the Lease (6 s) expires.
    signal(r1.pid(), "-STOP")?;
    let mut r2 = env.controller("r2")?;
    let result = (|| -> Result<()> {
        eventually("r2 holds the Lease", || {
            Ok((holder(&env)?.as_deref() == Some("r2")).then_some(()))
        })?;
        env.kubectl(&[
            "delete",
            "service",
            "s1",
            "-n",
            "default",
            "--wait=true",
            "--timeout=60s",
        ])?;
        env.apply(&svc("s2"))?;
        let got = eventually("r2 gives s2 the freed address", || {
            Ok(slb_status(&env, "s2")?.and_then(|s| s["vip"].as_str().map(String::from)))
        })?;
        assert_eq!(got, first, "r2 hands out the lowest free address");
        eventually("s2 shows it", || {
            Ok((ingress_ip(&env, "s2")?.as_deref() == Some(first.as_str())).then_some(()))
        })?;
        Ok(())
    })();
    // Thaw r1 whatever happened, so it can be killed and reaped.
    signal(r1.pid(), "-CONT")?;
    result?;

    // r1 wakes with a stale book; for 10 s s2's record and Service must not move.
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let rec = slb_status(&env, "s2")?.and_then(|s| s["vip"].as_str().map(String::from));
        let shown = ingress_ip(&env, "s2")?;
        ensure!(
            rec.as_deref() == Some(first.as_str()) && shown.as_deref() == Some(first.as_str()),
            "the deposed leader rewrote s2: record {rec:?}, Service {shown:?}; r1 log:\n{}",
            tail(&r1.log_text(), 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(holder(&env)?.as_deref(), Some("r2"));
    // The record (spec and status in one request: no status subresource) is written
    // under the controller's field manager, created then merge-patched conditioned on
    // the resourceVersion: one `Update` entry of the whole object.
    let with_fields = |kind: &str| -> Result<serde_json::Value> {
        env.json(&["get", kind, "s2", "-n", "default", "--show-managed-fields"])
    };
    let slb = with_fields("serviceloadbalancer")?;
    let managers: Vec<(String, String)> = slb["metadata"]["managedFields"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|m| {
            (
                m["manager"].as_str().unwrap_or_default().to_string(),
                format!(
                    "{}/{}",
                    m["operation"].as_str().unwrap_or_default(),
                    m["subresource"].as_str().unwrap_or_default()
                ),
            )
        })
        .collect();
    ensure!(
        managers == [("juneau-controller".to_string(), "Update/".to_string())],
        "{managers:?}"
    );
    let service = with_fields("service")?;
    let sm: Vec<String> = service["metadata"]["managedFields"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|m| m["subresource"] == "status")
        .map(|m| {
            format!(
                "{}:{}",
                m["manager"].as_str().unwrap_or_default(),
                m["operation"].as_str().unwrap_or_default()
            )
        })
        .collect();
    ensure!(sm == vec!["juneau-controller:Update".to_string()], "{sm:?}");
    r2.check_running()?;

    // Phase 2, deterministic: the Lease is taken from the running leader r2 (as a new
    // leader would take it after a partition), right after r2 renewed it, so r2's lease
    // manager will not notice for seconds. A Service created now must get nothing from
    // r2 while the Lease names someone else: its writes are fenced.
    let renew = |env: &Env| -> Result<String> {
        Ok(env
            .get("lease", "juneau-controller", Some("juneau-system"))?
            .and_then(|l| l["spec"]["renewTime"].as_str().map(String::from))
            .unwrap_or_default())
    };
    let before = renew(&env)?;
    eventually("r2 renews its Lease", || {
        Ok((renew(&env)? != before).then_some(()))
    })?;
    let now = run_date()?;
    env.kubectl(&[
        "patch",
        "lease",
        "juneau-controller",
        "-n",
        "juneau-system",
        "--type=merge",
        "-p",
        &format!(
            r#"{{"spec":{{"holderIdentity":"ghost","leaseDurationSeconds":30,"acquireTime":"{now}","renewTime":"{now}"}}}}"#
        ),
    ])?;
    env.apply(&svc("s3"))?;
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        if holder(&env)?.as_deref() != Some("ghost") {
            break;
        }
        let rec = slb_status(&env, "s3")?;
        let shown = ingress_ip(&env, "s3")?;
        ensure!(
            rec.is_none() && shown.is_none(),
            "r2 wrote s3 while the Lease named another holder: record {rec:?}, Service {shown:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eventually("r2 logs its fenced write", || {
        Ok(r2.log_text().contains("write fenced").then_some(()))
    })?;
    let log = r1.log_text();
    eprintln!(
        "r1 after thawing: fenced writes logged: {}, lost leadership logged: {}",
        log.contains("write fenced"),
        log.contains("lost leadership")
    );
    Ok(())
}
