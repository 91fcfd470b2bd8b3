//! Controller crashes, restarts and a second replica, against a real kube-apiserver:
//! one replica acts at a time (Lease), every Service keeps its VIP, no VIP is handed out
//! twice — also when a ServiceLoadBalancer record was lost while no controller ran.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Result};
use common::*;

fn vips(env: &Env, names: &[String]) -> Result<Option<BTreeMap<String, String>>> {
    let mut out = BTreeMap::new();
    for n in names {
        let Some(st) = slb_status(env, n)? else {
            return Ok(None);
        };
        let Some(v) = st["vip"].as_str() else {
            return Ok(None);
        };
        if ingress_ip(env, n)?.as_deref() != Some(v) {
            return Ok(None);
        }
        out.insert(n.clone(), v.to_string());
    }
    Ok(Some(out))
}

fn all_distinct(m: &BTreeMap<String, String>) -> bool {
    let mut v: Vec<_> = m.values().collect();
    v.sort();
    v.dedup();
    v.len() == m.len()
}

fn leader(env: &Env) -> Result<Option<String>> {
    Ok(env
        .get("lease", "juneau-controller", Some("juneau-system"))?
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from)))
}

#[test]
fn vips_survive_crashes_restarts_and_a_second_replica() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.60.1")])?;
    env.apply(SEED_NETWORK)?;
    let mut r1 = env.controller("r1")?;

    let mut names: Vec<String> = (0..5).map(|i| format!("svc-{i}")).collect();
    for n in &names {
        env.apply(&service(n, &[], ""))?;
        env.apply(&endpoint_slice(
            n,
            &format!("{n}-1"),
            &[("10.244.9.1", "node-a", true, false)],
            80,
        ))?;
    }
    let before = eventually("5 VIPs", || vips(&env, &names))?;
    ensure!(all_distinct(&before), "duplicate VIPs: {before:?}");
    assert_eq!(leader(&env)?.as_deref(), Some("r1"));

    // A second replica waits; it does not act while r1 holds the Lease.
    let mut r2 = env.controller("r2")?;
    std::thread::sleep(Duration::from_secs(3));
    r2.check_running()?;
    assert!(
        !r2.log_text().contains("became leader"),
        "r2 acted while r1 led"
    );
    assert_eq!(leader(&env)?.as_deref(), Some("r1"));

    // r1 crashes; a Service arrives meanwhile; r2 takes over.
    r1.kill();
    names.push("svc-5".into());
    env.apply(&service("svc-5", &[], ""))?;
    let after = eventually("r2 took over and served svc-5", || vips(&env, &names))?;
    assert!(r2.log_text().contains("became leader"));
    assert_eq!(leader(&env)?.as_deref(), Some("r2"));
    for (n, v) in &before {
        assert_eq!(after.get(n), Some(v), "{n} changed VIP across the takeover");
    }
    ensure!(all_distinct(&after), "duplicate VIPs: {after:?}");

    // A record lost while the leader runs comes back with the same VIP.
    env.kubectl(&["delete", "serviceloadbalancer", "svc-0", "-n", "default"])?;
    let restored = eventually("svc-0 record recreated", || vips(&env, &names))?;
    assert_eq!(restored, after);

    // r2 crashes too; while no controller runs, svc-1's record is lost. A restarted r1
    // rebuilds from the Service's ingress IP and keeps svc-1's VIP.
    r2.kill();
    env.kubectl(&["delete", "serviceloadbalancer", "svc-1", "-n", "default"])?;
    // Meanwhile svc-2 is deleted: its record is orphaned (no garbage collector here)
    // and must not keep the VIP.
    let freed = after["svc-2"].clone();
    env.kubectl(&[
        "delete",
        "service",
        "svc-2",
        "-n",
        "default",
        "--wait=true",
        "--timeout=60s",
    ])?;
    names.retain(|n| n != "svc-2");
    let mut r1b = env.controller("r1")?;
    names.push("svc-7".into());
    env.apply(&service(
        "svc-7",
        &[("juneau.loutres.me/load-balancer-requested-ip", &freed)],
        "",
    ))?;
    eventually("svc-7 gets the deleted Service's VIP", || {
        Ok(slb_status(&env, "svc-7")?.filter(|s| s["vip"] == freed.as_str()))
    })?;
    names.push("svc-6".into());
    env.apply(&service("svc-6", &[], ""))?;
    let last = eventually("restarted r1 serves svc-6 and svc-7", || vips(&env, &names))?;
    assert_eq!(
        last["svc-7"], freed,
        "the deleted Service's VIP is reusable"
    );
    assert!(
        env.get("serviceloadbalancer", "svc-2", Some("default"))?
            .is_none(),
        "orphan record deleted"
    );
    for (n, v) in after.iter().filter(|(n, _)| *n != "svc-2") {
        assert_eq!(last.get(n), Some(v), "{n} changed VIP across the restart");
    }
    ensure!(all_distinct(&last), "duplicate VIPs: {last:?}");
    r1b.check_running()?;
    Ok(())
}

/// SIGTERM (what the kubelet sends a Pod it stops: a rollout, a drain, `helm upgrade`)
/// makes the leader release its Lease and exit at once, so the standby takes over
/// without waiting for the lease to expire. Before, the controller had no SIGTERM
/// handler: as a container's first process it ignored the signal and was killed after
/// the grace period, leaving the Lease held until it expired.
#[test]
fn a_sigtermed_leader_releases_the_lease_and_exits() -> Result<()> {
    let env = Env::start()?;
    let mut r1 = env.controller("r1")?;
    eventually("r1 holds the Lease", || {
        Ok((leader(&env)?.as_deref() == Some("r1")).then_some(()))
    })?;
    let st = std::process::Command::new("kill")
        .args(["-TERM", &r1.pid().to_string()])
        .status()?;
    ensure!(st.success(), "kill -TERM");
    eventually("r1 exits after SIGTERM", || {
        Ok(r1.check_running().is_err().then_some(()))
    })?;
    // No other replica runs: only r1's release can have cleared the holder.
    ensure!(
        leader(&env)?.is_none(),
        "the Lease is still held by {:?} after r1 exited; r1's log:\n{}",
        leader(&env)?,
        r1.log_text()
    );
    Ok(())
}
