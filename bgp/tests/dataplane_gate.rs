//! Health-gated announcements against real BIRD 2: `juneau-bgp` announces a VIP only
//! while the dataplane's status file (`juneau_control::dataplane_status`) shows a fresh
//! heartbeat and that VIP programmed.
//!
//! The dataplane side is played by this test through the real `DataplaneStatusWriter`
//! (the file protocol `juneau-dataplane` uses), so the crash is exact: the heartbeat stops
//! and nothing else changes, as after `kill -9`. The end-to-end version with the real
//! dataplane binary is `k8s-sync/tests/static_stability.rs`.
//!
//! Needs root and the Debian package `bird2` (tests/setup.sh).

mod common;

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use common::dataplane::FakeDataplane;
use common::*;

const UP: Duration = Duration::from_secs(60);
const ROUTE: Duration = Duration::from_secs(30);
/// The speaker's heartbeat limit in this test (the default).
const LIMIT_MS: u64 = 500;

fn held_back(n: &Speaker) -> String {
    n.status()
        .map(|s| s["held_back"].to_string())
        .unwrap_or_default()
}

/// BIRD must not have the VIP during all of `for_`.
fn stays_withdrawn(router: &Router, for_: Duration, why: &str) -> Result<()> {
    let end = Instant::now() + for_;
    while Instant::now() < end {
        let hops = router.bgp_nexthops(VIP)?;
        ensure!(hops.is_empty(), "{why}: BIRD has {VIP} via {hops:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

#[test]
fn a_vip_is_announced_only_while_a_live_dataplane_has_it_programmed() -> Result<()> {
    let topo = Topo::new("gate", 1)?;
    let router = Router::start(
        &topo,
        RouterKind::Bird,
        &[Neighbor {
            node: 0,
            password: None,
        }],
    )?;
    // Graceful restart off: a withdrawal must reach BIRD's table at once.
    let peering = NodePeering {
        graceful_restart: false,
        ..Default::default()
    };
    let mut n0 = Speaker::start(&topo, 0, &peering)?;
    // Restart the speaker with the gate on, its status file at the default place next to
    // the state file.
    n0.kill();
    n0.gate_args = vec![
        "--dataplane-heartbeat-timeout-ms".into(),
        LIMIT_MS.to_string(),
    ];
    n0.spawn(&topo.nodes[0])?;
    n0.wait_established("router", UP)?;
    let status_file = n0.state_path.with_extension("dataplane");

    // 1. The agent wants the VIP announced, but no dataplane runs: held back.
    n0.publish_vips(&[VIP])?;
    wait_for("the VIP held back (no dataplane)", ROUTE, || {
        Ok(held_back(&n0).contains("unreadable").then_some(()))
    })
    .with_context(|| n0.logs())?;
    stays_withdrawn(&router, Duration::from_secs(1), "no dataplane")?;
    // Visible in the speaker's metrics: no dataplane alive, the VIP held back and why;
    // no heartbeat age without a status file.
    wait_for("metrics: dataplane not alive", ROUTE, || {
        Ok((n0.metric("juneau_bgp_dataplane_alive")? == Some(0.0)).then_some(()))
    })?;
    let held =
        format!("juneau_bgp_vip_held_back{{vip=\"{VIP}\",reason=\"dataplane_status_unreadable\"}}");
    assert_eq!(n0.metric(&held)?, Some(1.0));
    assert_eq!(n0.metric("juneau_dataplane_heartbeat_age_seconds")?, None);
    assert_eq!(
        n0.http("/readyz")?.0,
        200,
        "the speaker has read the node state"
    );
    assert_eq!(n0.http("/healthz")?.0, 200);

    // 2. A dataplane starts but has not programmed the VIP yet: still held back.
    let dp = FakeDataplane::start(&status_file)?;
    dp.program(1, &[] as &[std::net::Ipv4Addr])?;
    wait_for("the VIP held back (not programmed)", ROUTE, || {
        Ok(held_back(&n0).contains("not programmed").then_some(()))
    })?;
    stays_withdrawn(&router, Duration::from_secs(1), "VIP not programmed")?;
    let held = format!("juneau_bgp_vip_held_back{{vip=\"{VIP}\",reason=\"vip_not_programmed\"}}");
    assert_eq!(n0.metric(&held)?, Some(1.0));
    assert_eq!(n0.metric("juneau_bgp_dataplane_alive")?, Some(1.0));

    // 3. Programmed: announced.
    let programmed = Instant::now();
    dp.program(2, &[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0)], ROUTE)?;
    record(
        RouterKind::Bird,
        "dataplane programmed the VIP -> route at BIRD",
        programmed.elapsed(),
    );
    assert_eq!(n0.status()?["held_back"], serde_json::json!({}));
    let age = n0
        .metric("juneau_dataplane_heartbeat_age_seconds")?
        .context("heartbeat age exported")?;
    assert!(age < 1.0, "a live dataplane's heartbeat is {age} s old");
    assert_eq!(n0.metric(&held)?, None, "nothing held back");
    assert_eq!(
        n0.metric("juneau_bgp_dataplane_programmed_vips")?,
        Some(1.0)
    );

    // 4. The dataplane crashes: withdrawn at BIRD.
    let last_beat = dp.crash();
    let deadline = Instant::now() + ROUTE;
    let gone = loop {
        if router.bgp_nexthops(VIP)?.is_empty() {
            break last_beat.elapsed();
        }
        ensure!(
            Instant::now() < deadline,
            "route still at BIRD {ROUTE:?} after the dataplane stopped beating:\n{}",
            n0.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    record(
        RouterKind::Bird,
        "dataplane crash (last heartbeat) -> route gone at BIRD",
        gone,
    );
    println!(
        "dataplane crash -> withdrawn at BIRD: {} ms (heartbeat limit {LIMIT_MS} ms)",
        gone.as_millis()
    );
    // The target is 1 s; the assertion is generous because a loaded CI machine can
    // delay any of the three processes. The number above is the measurement.
    assert!(
        gone < Duration::from_secs(3),
        "withdrawal took {gone:?} after the last heartbeat"
    );
    assert!(
        held_back(&n0).contains("presumed down"),
        "{}",
        held_back(&n0)
    );
    // The dead dataplane is visible in the speaker's metrics: its heartbeat ages.
    wait_for(
        "metrics: heartbeat age past 1 s, dataplane not alive",
        ROUTE,
        || {
            let age = n0.metric("juneau_dataplane_heartbeat_age_seconds")?;
            let alive = n0.metric("juneau_bgp_dataplane_alive")?;
            Ok((age.is_some_and(|a| a > 1.0) && alive == Some(0.0)).then_some(()))
        },
    )?;
    let stale =
        format!("juneau_bgp_vip_held_back{{vip=\"{VIP}\",reason=\"dataplane_heartbeat_stale\"}}");
    assert_eq!(n0.metric(&stale)?, Some(1.0));
    // The session itself stayed up: only the route went.
    assert_eq!(n0.status()?["peers"]["router"]["session_flaps"], 0);

    // 5. A restarted dataplane: nothing announced until it has the VIP programmed.
    let dp = FakeDataplane::start(&status_file)?;
    stays_withdrawn(&router, Duration::from_secs(1), "restarted, not programmed")?;
    dp.program(3, &[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0)], ROUTE)?;

    // 6. A clean stop withdraws at once (no need to wait for the heartbeat to age).
    drop(dp);
    router.wait_nexthops(VIP, &[], ROUTE)?;
    assert!(held_back(&n0).contains("stopped"), "{}", held_back(&n0));
    Ok(())
}
