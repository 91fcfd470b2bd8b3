//! `juneau-bgp` against real BIRD 2, FRR and GoBGP daemons, in network namespaces.
//!
//! Needs root and the Debian packages `bird2`, `frr`, `gobgpd` (tests/setup.sh).

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use common::*;

const UP: Duration = Duration::from_secs(60);
const ROUTE: Duration = Duration::from_secs(30);

/// Waits until the speaker's status file says it announces `n` prefixes to the router:
/// the file is written just after the UPDATE is sent, so the router may show the route
/// a moment before it.
fn wait_announced(s: &Speaker, n: u64) -> Result<()> {
    wait_for(
        "the speaker's status to show the announcement",
        ROUTE,
        || Ok((s.status()?["peers"]["router"]["prefixes_announced"] == n).then_some(())),
    )
}

/// Session up; VIP appears as /32 via the node; a second node makes it ECMP; the last
/// local backend leaving a node withdraws it there (timed); removing it everywhere
/// withdraws it.
fn announce_withdraw_ecmp(kind: RouterKind) -> Result<()> {
    let topo = Topo::new(&format!("{kind:?}").to_lowercase(), 2)?;
    let router = Router::start(
        &topo,
        kind,
        &[
            Neighbor {
                node: 0,
                password: None,
            },
            Neighbor {
                node: 1,
                password: None,
            },
        ],
    )?;
    let mut n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    let mut n1 = Speaker::start(&topo, 1, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    n1.wait_established("router", UP)?;

    // A VIP with a Ready local backend on node 0 only.
    n0.publish_vips(&[VIP])?;
    let t = router.wait_nexthops(VIP, &[node_addr(0)], ROUTE)?;
    record(kind, "announce (publish to router table)", t);
    wait_announced(&n0, 1)?;
    // ORIGIN, 4-byte AS_PATH, COMMUNITIES and LARGE_COMMUNITIES arrived intact.
    let text = router.route_text(VIP)?;
    for want in router.expected_attribute_texts() {
        assert!(
            text.contains(want),
            "{kind:?} does not show {want} in:\n{text}"
        );
    }

    // Node 1 gets a backend too: two paths.
    n1.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0), node_addr(1)], ROUTE)?;
    if kind != RouterKind::Gobgp {
        // BIRD (merge paths) and FRR (maximum-paths) install an ECMP route in the kernel.
        wait_for("ECMP route in the router's kernel table", ROUTE, || {
            Ok((topo.kernel_nexthops(VIP)? == vec![node_addr(0), node_addr(1)]).then_some(()))
        })
        .map_err(|e| e.context(router.logs()))?;
    }

    // The last local backend on node 0 leaves: node 0 withdraws at once.
    let start = Instant::now();
    n0.publish_vips(&[])?;
    router.wait_nexthops(VIP, &[node_addr(1)], ROUTE)?;
    record(
        kind,
        "withdraw after the last local backend left (publish to router table)",
        start.elapsed(),
    );
    wait_announced(&n0, 0)?;

    n1.publish_vips(&[])?;
    router.wait_nexthops(VIP, &[], ROUTE)?;
    // Sessions stayed up throughout.
    assert_eq!(n0.status()?["peers"]["router"]["session_flaps"], 0);
    assert_eq!(n1.status()?["peers"]["router"]["session_flaps"], 0);
    Ok(())
}

/// Kill -9 and restart juneau-bgp: with graceful restart the router keeps the route all
/// along and the session comes back.
fn graceful_restart(kind: RouterKind) -> Result<()> {
    let topo = Topo::new(&format!("g{kind:?}").to_lowercase(), 1)?;
    let router = Router::start(
        &topo,
        kind,
        &[Neighbor {
            node: 0,
            password: None,
        }],
    )?;
    let mut n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    assert_eq!(
        n0.status()?["peers"]["router"]["graceful_restart"],
        true,
        "graceful restart not negotiated"
    );
    n0.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0)], ROUTE)?;

    n0.kill();
    let killed = Instant::now();
    // Down for a while; the router must keep the route every time we look.
    let mut looks = 0;
    while killed.elapsed() < Duration::from_secs(3) {
        assert_eq!(
            router.bgp_nexthops(VIP)?,
            vec![node_addr(0)],
            "route lost while juneau-bgp was down"
        );
        looks += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    n0.spawn(&topo.nodes[0])?;
    // Until the new session is up and has sent End-of-RIB, keep looking.
    let back = Instant::now();
    loop {
        assert_eq!(
            router.bgp_nexthops(VIP)?,
            vec![node_addr(0)],
            "route lost during the restart"
        );
        looks += 1;
        if n0.peer_state("router").unwrap_or_default() == "Established" {
            break;
        }
        assert!(
            back.elapsed() < UP,
            "session did not come back:\n{}\n{}",
            n0.logs(),
            router.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // After End-of-RIB the router drops stale routes that were not re-announced; ours was.
    for _ in 0..20 {
        assert_eq!(
            router.bgp_nexthops(VIP)?,
            vec![node_addr(0)],
            "route lost after the restart"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "{kind:?}: route present in all {looks} looks across a {:?} restart",
        killed.elapsed()
    );
    Ok(())
}

/// Control experiment for the graceful-restart test: without the capability, the router
/// drops the route as soon as the daemon dies.
fn crash_without_graceful_restart(kind: RouterKind) -> Result<()> {
    let topo = Topo::new(&format!("c{kind:?}").to_lowercase(), 1)?;
    let router = Router::start(
        &topo,
        kind,
        &[Neighbor {
            node: 0,
            password: None,
        }],
    )?;
    let mut n0 = Speaker::start(
        &topo,
        0,
        &NodePeering {
            graceful_restart: false,
            ..Default::default()
        },
    )?;
    n0.wait_established("router", UP)?;
    assert_eq!(n0.status()?["peers"]["router"]["graceful_restart"], false);
    n0.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0)], ROUTE)?;
    n0.kill();
    let t = router.wait_nexthops(VIP, &[], ROUTE)?;
    record(kind, "withdraw after a crash without graceful restart", t);
    Ok(())
}

/// A node with the router's password establishes; one with a wrong password never does.
fn md5(kind: RouterKind) -> Result<()> {
    let topo = Topo::new(&format!("m{kind:?}").to_lowercase(), 2)?;
    let pw = Some("s3cret-Juneau".to_string());
    let _router = Router::start(
        &topo,
        kind,
        &[
            Neighbor {
                node: 0,
                password: pw.clone(),
            },
            Neighbor {
                node: 1,
                password: pw.clone(),
            },
        ],
    )?;
    let good = Speaker::start(
        &topo,
        0,
        &NodePeering {
            password: pw,
            ..Default::default()
        },
    )?;
    let bad = Speaker::start(
        &topo,
        1,
        &NodePeering {
            password: Some("wrong".into()),
            ..Default::default()
        },
    )?;
    good.wait_established("router", UP)?;
    // Give the wrong one ample time (many connection attempts on both sides).
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        let s = bad.peer_state("router").unwrap_or_default();
        assert!(
            !matches!(s.as_str(), "Established" | "OpenConfirm" | "OpenSent"),
            "wrong password reached {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

macro_rules! router_tests {
    ($($name:ident: $kind:expr,)*) => {$(
        mod $name {
            use super::*;
            #[test]
            fn announce_withdraw_and_ecmp() -> Result<()> { announce_withdraw_ecmp($kind) }
            #[test]
            fn graceful_restart_keeps_the_route() -> Result<()> { graceful_restart($kind) }
            #[test]
            fn crash_without_graceful_restart_withdraws() -> Result<()> { crash_without_graceful_restart($kind) }
            #[test]
            fn md5_matching_establishes_wrong_never_does() -> Result<()> { md5($kind) }
        }
    )*};
}

router_tests! {
    bird: RouterKind::Bird,
    frr: RouterKind::Frr,
    gobgp: RouterKind::Gobgp,
}
