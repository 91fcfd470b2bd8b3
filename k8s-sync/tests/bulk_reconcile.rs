//! Which AddressPool changes make the controller reconcile every Service, against a real
//! kube-apiserver with the real controller binary (3 000 Services created at
//! once never all got their VIP).
//!
//! The controller writes each AddressPool's status (addresses allocated) after every
//! burst of allocations. That status write must not reconcile every Service: it did, so
//! N Services created at once cost O(N²) reconciles, ~1 000 of them in flight, an
//! apiserver answering in tens of seconds, and Services backed off for minutes. A change
//! of the pool's spec must still reach every Service.

mod common;

use anyhow::{ensure, Result};
use common::*;

/// Services created at once: enough that one bulk reconcile stands out from the few
/// reconciles one new Service costs.
const N: usize = 40;

fn reconciles(port: u16) -> Result<f64> {
    let (code, page) = http_get(port, "/metrics")?;
    ensure!(code == 200, "/metrics answered {code}");
    sample(&page, "juneau_controller_reconciles_total")
        .ok_or_else(|| anyhow::anyhow!("no juneau_controller_reconciles_total"))
}

/// GETs of Leases the apiserver has served so far (its own `apiserver_request_total`).
fn lease_reads(env: &Env) -> Result<u64> {
    let page = env.kubectl(&["get", "--raw", "/metrics"])?;
    Ok(page
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("resource=\"leases\"")
                && l.contains("verb=\"GET\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

fn allocated(env: &Env) -> Result<u64> {
    Ok(env
        .get("addresspool", "public-v4", None)?
        .and_then(|p| p["status"]["addressesAllocated"].as_u64())
        .unwrap_or(0))
}

/// Waits until the controller's reconcile count has not moved for 2 s; returns it.
fn settled(port: u16) -> Result<f64> {
    let mut last = reconciles(port)?;
    eventually("the controller to settle (no reconcile for 2 s)", || {
        std::thread::sleep(std::time::Duration::from_secs(2));
        let now = reconciles(port)?;
        let quiet = now == last;
        last = now;
        Ok(quiet.then_some(now))
    })
}

#[test]
fn pool_status_writes_do_not_reconcile_every_service_but_spec_changes_do() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.71.1")])?;
    env.apply(SEED_NETWORK)?;
    let mut ctl = env.controller("c1")?;
    eventually("the controller leads", || {
        Ok(env
            .get("lease", "juneau-controller", Some("juneau-system"))?
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(|_| ())))
    })?;
    let reads0 = lease_reads(&env)?;

    let all: Vec<String> = (0..N)
        .map(|i| service(&format!("s{i:02}"), &[], ""))
        .collect();
    env.apply(&all.join("---\n"))?;
    eventually(
        &format!("{N} Services hold a VIP and the pool counts them"),
        || {
            ctl.check_running()?;
            Ok((allocated(&env)? == N as u64).then_some(()))
        },
    )?;
    let mut vips = std::collections::HashSet::new();
    for i in 0..N {
        let vip = eventually("every Service shows its VIP", || {
            ingress_ip(&env, &format!("s{i:02}"))
        })?;
        // Up to RECONCILE_CONCURRENCY allocations run at once: never the same VIP twice.
        ensure!(vips.insert(vip.clone()), "VIP {vip} shown by two Services");
    }
    let r0 = settled(ctl.metrics_port)?;
    // A new Service's writes need one Lease check (fencing), not one before each
    // write, and the checks of the reconciles in flight share their GETs: fewer than
    // two GETs per new Service, lease renewals included (two per Service once, 80 here
    // without the renewals).
    let reads = lease_reads(&env)? - reads0;
    ensure!(
        reads < 2 * N as u64,
        "{N} new Services cost {reads} Lease GETs (lease renewals included): two \
         fencing checks per new Service, or checks that do not share their GET"
    );
    eprintln!("{N} new Services: {reads} Lease GETs (lease renewals included)");

    // One more Service: its allocation rewrites the pool's status.
    env.apply(&service("late", &[], ""))?;
    eventually("the late Service shows its VIP", || {
        ingress_ip(&env, "late")
    })?;
    eventually("the pool's status counts the late Service", || {
        Ok((allocated(&env)? == N as u64 + 1).then_some(()))
    })?;
    let r1 = settled(ctl.metrics_port)?;
    let late_cost = r1 - r0;
    ensure!(
        late_cost < (N / 2) as f64,
        "one new Service cost {late_cost} reconciles with {N} Services present: \
         the pool's status write reconciled every Service\ncontroller log:\n{}",
        tail(&ctl.log_text(), 40)
    );

    // A spec change of the pool (one more range) reaches every Service.
    env.apply(&SEED_NETWORK.replace(
        "    - 203.0.113.0/24\n",
        "    - 203.0.113.0/24\n    - 198.51.100.0/28\n",
    ))?;
    eventually("the pool's status counts the new range", || {
        Ok(env
            .get("addresspool", "public-v4", None)?
            .filter(|p| p["status"]["addressesTotal"].as_u64() == Some(254 + 14))
            .map(|_| ()))
    })?;
    let r2 = settled(ctl.metrics_port)?;
    ensure!(
        r2 - r1 >= (N + 1) as f64,
        "a spec change of the pool reconciled {} Services, not all {}",
        r2 - r1,
        N + 1
    );
    ctl.check_running()?;
    Ok(())
}
