//! Session options against BIRD 2: eBGP multihop (TTL) with a source address across a
//! forwarding hop, reconfiguration through the control state, iBGP with LOCAL_PREF,
//! received routes discarded, per-VIP peer selection, and 2000 VIPs.

mod common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::*;
use juneau_control::model::{AdvertisedVip, PeerConfig};
use juneau_tests::bird::{BgpNeighbor, BirdConfig};
use juneau_tests::netns::{veth, Netns};

const UP: Duration = Duration::from_secs(60);

/// node (10.0.1.2, and 10.255.0.2 on lo as the BGP source address) -- mid (10.0.1.1 |
/// 10.0.2.1, forwarding) -- router (10.0.2.2).
#[test]
fn ebgp_multihop_across_a_router_and_ttl_one_never_gets_there() -> Result<()> {
    let topo = Topo::new("mh", 1)?;
    // Re-wire: the router namespace of `topo` becomes the middle hop; a new namespace is
    // the BGP router.
    let mid = &topo.router;
    let bgp_router = Netns::new(format!("{}b", topo.prefix))?;
    veth(mid, "far", &bgp_router, "near")?;
    mid.addr("far", "10.0.2.1/24")?;
    bgp_router.addr("near", "10.0.2.2/24")?;
    mid.exec(&["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])?;
    topo.nodes[0].exec(&["ip", "route", "add", "10.0.2.0/24", "via", "10.0.1.1"])?;
    bgp_router.exec(&["ip", "route", "add", "10.0.1.0/24", "via", "10.0.2.1"])?;
    // The node's BGP source address lives on its loopback.
    topo.nodes[0].exec(&["ip", "addr", "add", "10.255.0.2/32", "dev", "lo"])?;
    mid.exec(&["ip", "route", "add", "10.255.0.2/32", "via", "10.0.1.2"])?;
    bgp_router.exec(&["ip", "route", "add", "10.255.0.2/32", "via", "10.0.2.1"])?;
    bgp_router.exec(&["ping", "-c", "1", "-W", "2", "10.255.0.2"])?;

    let bird_topo = Topo {
        prefix: topo.prefix.clone(),
        router: bgp_router,
        nodes: vec![],
        dir: tempfile::tempdir()?,
    };
    let router = Router::start_bird_with_config(
        &bird_topo,
        &BirdConfig::new(Ipv4Addr::new(10, 0, 2, 2))
            .raw("protocol static { ipv4; route 10.0.1.0/24 via 10.0.2.1; route 10.255.0.2/32 via 10.0.2.1; }")
            .bgp(
                &BgpNeighbor::new("node0", Ipv4Addr::new(10, 0, 2, 2), 65000, Ipv4Addr::new(10, 255, 0, 2), 65001)
                    .extra("multihop 2;"),
            )
            .render(),
    )?;

    let mut pc = PeerConfig::new("router", Ipv4Addr::new(10, 0, 2, 2), ROUTER_ASN, NODE_ASN);
    pc.hold_time = 9;
    pc.keepalive_time = 3;
    pc.connect_retry_time = 1;
    let source = Ipv4Addr::new(10, 255, 0, 2);
    pc.source_address = Some(source.into());
    pc.ebgp_multihop = Some(2);
    let mut n0 = Speaker::start_with_peers(&topo, 0, vec![pc.clone()])?;
    n0.wait_established("router", UP)?;
    n0.publish_vips(&[VIP])?;
    // Next hop = the configured source address, not the address of the outgoing link.
    router.wait_nexthops(VIP, &[source], Duration::from_secs(30))?;

    // Reconfigure through the control state: no multihop, so TTL 1 -- the middle hop drops
    // our packets and the session can never come up.
    pc.ebgp_multihop = None;
    n0.state.peers = vec![pc];
    let st = n0.state.clone();
    n0.publish_state(&st)?;
    // The old session ends with Cease 6/6 and the router withdraws the route.
    router.wait_nexthops(VIP, &[], Duration::from_secs(30))?;
    let log = router.full_log();
    assert!(
        log.contains("Received: Other configuration change"),
        "{log}"
    );
    // The speaker's status file reports the old session's end a moment after BIRD saw
    // the Cease (it is written periodically; read just after the withdrawal it may
    // still say Established): from then on it must never be Established again.
    wait_for("the old session reported down", UP, || {
        Ok((n0.peer_state("router")? != "Established").then_some(()))
    })?;
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        let s = n0.peer_state("router")?;
        // BIRD's own packets (TTL 2) may reach us, so OpenConfirm is possible; ours (TTL 1)
        // never reach BIRD, so the session must never be Established.
        assert_ne!(s, "Established", "TTL 1 across a router got Established");
        let info = router.bird_protocol_info("node0")?;
        assert!(
            !info.contains("Established"),
            "BIRD says: {info}\n{}",
            n0.logs()
        );
        assert!(
            router.bgp_nexthops(VIP)?.is_empty(),
            "route at the router again\n{}",
            n0.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(router);
    drop(bird_topo);
    Ok(())
}

#[test]
fn ibgp_sends_local_pref_and_an_empty_as_path() -> Result<()> {
    let topo = Topo::new("ib", 1)?;
    let router = Router::start_bird_with_config(
        &topo,
        &BirdConfig::new(router_addr(0))
            .bgp(
                &BgpNeighbor::new("node0", router_addr(0), NODE_ASN, node_addr(0), NODE_ASN)
                    .extra("direct;"),
            )
            .render(),
    )?;
    let mut pc = PeerConfig::new("router", router_addr(0), NODE_ASN, NODE_ASN);
    pc.hold_time = 9;
    pc.keepalive_time = 3;
    pc.connect_retry_time = 1;
    let mut n0 = Speaker::start_with_peers(&topo, 0, vec![pc])?;
    n0.wait_established("router", UP)?;
    let mut st = n0.state.clone();
    st.advertised = vec![AdvertisedVip {
        vip: VIP.into(),
        communities: vec![],
        large_communities: vec![],
        local_pref: Some(250),
        peers: vec![],
        weight: None,
    }];
    n0.publish_state(&st)?;
    router.wait_nexthops(VIP, &[node_addr(0)], Duration::from_secs(30))?;
    let text = router.route_text(VIP)?;
    assert!(text.contains("BGP.local_pref: 250"), "{text}");
    assert!(
        text.contains("BGP.as_path: \n")
            || text.contains("BGP.as_path:\n")
            || text.contains("BGP.as_path: \r"),
        "{text}"
    );
    Ok(())
}

/// Routes the router sends are counted and discarded, never installed on the node.
#[test]
fn received_routes_are_counted_and_never_installed() -> Result<()> {
    let topo = Topo::new("rx", 1)?;
    let _router = Router::start_bird_with_config(
        &topo,
        &BirdConfig::new(router_addr(0))
            .raw("protocol static { ipv4; route 198.51.100.0/24 blackhole; route 203.0.113.0/25 blackhole; }")
            .bgp(
                &BgpNeighbor::new("node0", router_addr(0), ROUTER_ASN, node_addr(0), NODE_ASN)
                    .ipv4("import all; export all;"),
            )
            .render(),
    )?;
    let n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    wait_for(
        "the node to count 2 received prefixes",
        Duration::from_secs(30),
        || Ok((n0.status()?["peers"]["router"]["prefixes_received"] == 2).then_some(())),
    )?;
    let routes = topo.nodes[0].exec(&["ip", "-4", "route", "show", "table", "all"])?;
    assert!(
        !routes.contains("198.51.100.0") && !routes.contains("203.0.113.0"),
        "installed: {routes}"
    );
    assert_eq!(n0.peer_state("router")?, "Established");
    Ok(())
}

/// 2000 VIPs go out in a few UPDATEs under the 4096-byte limit and come back out.
#[test]
fn two_thousand_vips_are_announced_and_withdrawn() -> Result<()> {
    let topo = Topo::new("sc", 1)?;
    let router = Router::start(
        &topo,
        RouterKind::Bird,
        &[Neighbor {
            node: 0,
            password: None,
        }],
    )?;
    let mut n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    let vips: Vec<Ipv4Addr> = (0..2000u32)
        .map(|i| Ipv4Addr::from(0xc612_0000 + i))
        .collect(); // 198.18.0.0/21
    let count = |r: &Router| -> Result<Option<u64>> {
        let out = r.bird_cli(&["show", "route", "count", "protocol", "node0"])?;
        // "2000 of 2000 routes for 2000 networks in table master4"
        Ok(out
            .lines()
            .find(|l| l.contains(" routes for "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|w| w.parse().ok()))
    };
    let t = Instant::now();
    n0.publish_vips(&vips)?;
    wait_for("2000 routes at BIRD", Duration::from_secs(60), || {
        Ok((count(&router)? == Some(2000)).then_some(()))
    })?;
    record(
        RouterKind::Bird,
        "2000 VIPs announced (publish to router table)",
        t.elapsed(),
    );
    // The status file is written just after the UPDATEs are sent: it may trail BIRD.
    wait_for(
        "the speaker's status to show 2000",
        Duration::from_secs(10),
        || Ok((n0.status()?["peers"]["router"]["prefixes_announced"] == 2000).then_some(())),
    )?;
    let t = Instant::now();
    n0.publish_vips(&[])?;
    wait_for("0 routes at BIRD", Duration::from_secs(60), || {
        Ok((count(&router)? == Some(0)).then_some(()))
    })?;
    record(
        RouterKind::Bird,
        "2000 VIPs withdrawn (publish to router table)",
        t.elapsed(),
    );
    assert_eq!(n0.peer_state("router")?, "Established");
    Ok(())
}

/// `AdvertisedVip.peers` picks which sessions a VIP goes to: the node has two sessions to
/// BIRD over two links; one VIP per session and one for both.
#[test]
fn vips_go_only_to_the_peers_they_name() -> Result<()> {
    let topo = Topo::new("pp", 1)?;
    veth(&topo.nodes[0], "uplink2", &topo.router, "e0")?;
    topo.nodes[0].addr("uplink2", "10.0.3.2/24")?;
    topo.router.addr("e0", "10.0.3.1/24")?;
    let session = |name: &str, local: [u8; 4], neighbor: [u8; 4]| {
        BgpNeighbor::new(name, local.into(), ROUTER_ASN, neighbor.into(), NODE_ASN)
    };
    let router = Router::start_bird_with_config(
        &topo,
        &BirdConfig::new(router_addr(0))
            .bgp(&session("link_a", [10, 0, 1, 1], [10, 0, 1, 2]))
            .bgp(&session("link_b", [10, 0, 3, 1], [10, 0, 3, 2]))
            .render(),
    )?;
    let peer = |name: &str, addr: Ipv4Addr| {
        let mut pc = PeerConfig::new(name, addr, ROUTER_ASN, NODE_ASN);
        pc.hold_time = 9;
        pc.keepalive_time = 3;
        pc.connect_retry_time = 1;
        pc
    };
    let mut n0 = Speaker::start_with_peers(
        &topo,
        0,
        vec![
            peer("a", Ipv4Addr::new(10, 0, 1, 1)),
            peer("b", Ipv4Addr::new(10, 0, 3, 1)),
        ],
    )?;
    n0.wait_established("a", UP)?;
    n0.wait_established("b", UP)?;
    let (only_a, only_b, both) = (
        Ipv4Addr::new(192, 0, 2, 1),
        Ipv4Addr::new(192, 0, 2, 2),
        Ipv4Addr::new(192, 0, 2, 3),
    );
    let adv = |vip: Ipv4Addr, peers: Vec<u16>| AdvertisedVip {
        vip: vip.into(),
        communities: vec![],
        large_communities: vec![],
        local_pref: None,
        peers,
        weight: None,
    };
    let mut st = n0.state.clone();
    st.advertised = vec![
        adv(only_a, vec![0]),
        adv(only_b, vec![1]),
        adv(both, vec![]),
    ];
    n0.publish_state(&st)?;
    let (via_a, via_b) = (Ipv4Addr::new(10, 0, 1, 2), Ipv4Addr::new(10, 0, 3, 2));
    router.wait_nexthops(both, &[via_a, via_b], Duration::from_secs(30))?;
    router.wait_nexthops(only_a, &[via_a], Duration::from_secs(30))?;
    router.wait_nexthops(only_b, &[via_b], Duration::from_secs(30))?;
    // The status file may trail the routers by a moment.
    wait_for(
        "the speaker's status to show 2 prefixes per peer",
        Duration::from_secs(10),
        || {
            let status = n0.status()?;
            let two = |peer: &str| status["peers"][peer]["prefixes_announced"] == 2;
            Ok((two("a") && two("b")).then_some(()))
        },
    )?;

    // Moving a VIP from one peer to the other withdraws it there and announces it here.
    st.advertised[0].peers = vec![1];
    n0.publish_state(&st)?;
    router.wait_nexthops(only_a, &[via_b], Duration::from_secs(30))?;
    Ok(())
}

/// Reconfiguration through the control state: a new connect-retry time applies in place;
/// a new hold time resets the session (Cease 6/6) and it comes straight back.
#[test]
fn reconfiguration_resets_only_when_the_open_changes() -> Result<()> {
    let topo = Topo::new("rc", 1)?;
    let router = Router::start(
        &topo,
        RouterKind::Bird,
        &[Neighbor {
            node: 0,
            password: None,
        }],
    )?;
    let mut n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    n0.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0)], Duration::from_secs(30))?;

    let mut st = n0.state.clone();
    st.peers[0].connect_retry_time = 7;
    n0.publish_state(&st)?;
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(n0.status()?["peers"]["router"]["session_flaps"], 0);
    assert!(!router
        .full_log()
        .contains("Received: Other configuration change"));
    assert_eq!(router.bgp_nexthops(VIP)?, vec![node_addr(0)]);

    st.peers[0].hold_time = 30;
    n0.publish_state(&st)?;
    wait_for("Cease 6/6 at BIRD", Duration::from_secs(30), || {
        Ok(router
            .full_log()
            .contains("Received: Other configuration change")
            .then_some(()))
    })
    .with_context(|| format!("{}\n{}", n0.logs(), router.logs()))?;
    wait_for("the session to come back", UP, || {
        Ok((n0.status()?["peers"]["router"]["session_flaps"] == 1
            && n0.peer_state("router")? == "Established")
            .then_some(()))
    })?;
    router.wait_nexthops(VIP, &[node_addr(0)], Duration::from_secs(30))?;
    Ok(())
}
