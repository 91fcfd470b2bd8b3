//! iBGP and eBGP multihop against FRR and GoBGP (BIRD is covered in bird_features.rs):
//! iBGP carries LOCAL_PREF and an empty AS_PATH; eBGP multihop reaches a router one
//! forwarding hop away from a loopback source address.

mod common;

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::Result;
use common::*;
use juneau_control::model::{AdvertisedVip, PeerConfig};
use juneau_tests::netns::{veth, Netns};

const UP: Duration = Duration::from_secs(60);

fn vip_with_local_pref(n0: &mut Speaker) -> Result<()> {
    let mut st = n0.state.clone();
    st.advertised = vec![AdvertisedVip {
        vip: VIP.into(),
        communities: vec![],
        large_communities: vec![],
        local_pref: Some(250),
        peers: vec![],
        weight: None,
    }];
    n0.publish_state(&st)
}

fn ibgp_peer(router: Ipv4Addr) -> PeerConfig {
    let mut pc = PeerConfig::new("router", router, NODE_ASN, NODE_ASN);
    pc.hold_time = 9;
    pc.keepalive_time = 3;
    pc.connect_retry_time = 1;
    pc
}

#[test]
fn ibgp_with_frr_sends_local_pref_and_an_empty_as_path() -> Result<()> {
    let topo = Topo::new("ibf", 1)?;
    let (r, n) = (router_addr(0), node_addr(0));
    let router = Router::start_frr_with_config(
        &topo,
        &format!(
            "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {NODE_ASN}\n \
             bgp router-id {r}\n neighbor {n} remote-as {NODE_ASN}\n neighbor {n} timers 3 9\n \
             neighbor {n} timers connect 1\n!\n"
        ),
        None,
    )?;
    let mut n0 = Speaker::start_with_peers(&topo, 0, vec![ibgp_peer(r)])?;
    n0.wait_established("router", UP)?;
    vip_with_local_pref(&mut n0)?;
    router.wait_nexthops(VIP, &[n], UP)?;
    let v: serde_json::Value = serde_json::from_str(&router.route_text(VIP)?)?;
    let path = &v["paths"][0];
    assert_eq!(path["locPrf"], 250, "{path}");
    assert_eq!(path["aspath"]["length"], 0, "{path}");
    Ok(())
}

#[test]
fn ibgp_with_gobgp_sends_local_pref_and_an_empty_as_path() -> Result<()> {
    let topo = Topo::new("ibg", 1)?;
    let (r, n) = (router_addr(0), node_addr(0));
    let router = Router::start_gobgp_with_config(
        &topo,
        &format!(
            "[global.config]\n  as = {NODE_ASN}\n  router-id = \"{r}\"\n  port = 179\n\
             [[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{n}\"\n    peer-as = {NODE_ASN}\n\
             [neighbors.timers.config]\n    hold-time = 9\n    keepalive-interval = 3\n    connect-retry = 1\n"
        ),
    )?;
    let mut n0 = Speaker::start_with_peers(&topo, 0, vec![ibgp_peer(r)])?;
    n0.wait_established("router", UP)?;
    vip_with_local_pref(&mut n0)?;
    router.wait_nexthops(VIP, &[n], UP)?;
    let text = router.route_text(VIP)?;
    assert!(
        text.contains("{\"type\":5,\"value\":250}"),
        "LOCAL_PREF 250 in {text}"
    );
    assert!(
        !text.contains("\"asns\":[6"),
        "no AS in the AS_PATH of an iBGP route: {text}"
    );
    Ok(())
}

/// node (10.0.1.2, BGP source 10.255.0.2 on lo) -- mid (forwarding) -- router (10.0.2.2).
struct Multihop {
    topo: Topo,
    router_topo: Topo,
}

fn multihop_topology(tag: &str) -> Result<Multihop> {
    let topo = Topo::new(tag, 1)?;
    let mid = &topo.router;
    let bgp_router = Netns::new(format!("{}b", topo.prefix))?;
    veth(mid, "far", &bgp_router, "near")?;
    mid.addr("far", "10.0.2.1/24")?;
    bgp_router.addr("near", "10.0.2.2/24")?;
    mid.exec(&["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])?;
    topo.nodes[0].exec(&["ip", "route", "add", "10.0.2.0/24", "via", "10.0.1.1"])?;
    bgp_router.exec(&["ip", "route", "add", "10.0.1.0/24", "via", "10.0.2.1"])?;
    topo.nodes[0].exec(&["ip", "addr", "add", "10.255.0.2/32", "dev", "lo"])?;
    mid.exec(&["ip", "route", "add", "10.255.0.2/32", "via", "10.0.1.2"])?;
    bgp_router.exec(&["ip", "route", "add", "10.255.0.2/32", "via", "10.0.2.1"])?;
    let router_topo = Topo {
        prefix: topo.prefix.clone(),
        router: bgp_router,
        nodes: vec![],
        dir: tempfile::tempdir()?,
    };
    Ok(Multihop { topo, router_topo })
}

fn multihop_peer() -> PeerConfig {
    let mut pc = PeerConfig::new("router", Ipv4Addr::new(10, 0, 2, 2), ROUTER_ASN, NODE_ASN);
    pc.hold_time = 9;
    pc.keepalive_time = 3;
    pc.connect_retry_time = 1;
    pc.source_address = Some(Ipv4Addr::new(10, 255, 0, 2).into());
    pc.ebgp_multihop = Some(2);
    pc
}

#[test]
fn ebgp_multihop_with_frr() -> Result<()> {
    let m = multihop_topology("mhf")?;
    let router = Router::start_frr_with_config(
        &m.router_topo,
        &format!(
            "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
             bgp router-id 10.0.2.2\n no bgp ebgp-requires-policy\n neighbor 10.255.0.2 remote-as {NODE_ASN}\n \
             neighbor 10.255.0.2 ebgp-multihop 2\n neighbor 10.255.0.2 timers 3 9\n \
             neighbor 10.255.0.2 timers connect 1\n!\n"
        ),
        None,
    )?;
    let mut n0 = Speaker::start_with_peers(&m.topo, 0, vec![multihop_peer()])?;
    n0.wait_established("router", UP)?;
    n0.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[Ipv4Addr::new(10, 255, 0, 2)], UP)?;
    Ok(())
}

#[test]
fn ebgp_multihop_with_gobgp() -> Result<()> {
    let m = multihop_topology("mhg")?;
    let router = Router::start_gobgp_with_config(
        &m.router_topo,
        &format!(
            "[global.config]\n  as = {ROUTER_ASN}\n  router-id = \"10.0.2.2\"\n  port = 179\n\
             [[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"10.255.0.2\"\n    peer-as = {NODE_ASN}\n\
             [neighbors.timers.config]\n    hold-time = 9\n    keepalive-interval = 3\n    connect-retry = 1\n\
             [neighbors.ebgp-multihop.config]\n    enabled = true\n    multihop-ttl = 2\n"
        ),
    )?;
    let mut n0 = Speaker::start_with_peers(&m.topo, 0, vec![multihop_peer()])?;
    n0.wait_established("router", UP)?;
    n0.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[Ipv4Addr::new(10, 255, 0, 2)], UP)?;
    Ok(())
}

/// Multihop BFD (RFC 5883, UDP 4784) with FRR's bfdd on the eBGP multihop session.
#[test]
fn multihop_bfd_with_frr_comes_up() -> Result<()> {
    let m = multihop_topology("mbf")?;
    let router = Router::start_frr_with_config(
        &m.router_topo,
        &format!(
            "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
             bgp router-id 10.0.2.2\n no bgp ebgp-requires-policy\n neighbor 10.255.0.2 remote-as {NODE_ASN}\n \
             neighbor 10.255.0.2 ebgp-multihop 2\n neighbor 10.255.0.2 update-source 10.0.2.2\n \
             neighbor 10.255.0.2 timers 3 9\n neighbor 10.255.0.2 timers connect 1\n \
             neighbor 10.255.0.2 bfd profile fast\n!\n"
        ),
        Some(
            "hostname router\nlog stdout debugging\n!\nbfd\n profile fast\n  receive-interval 300\n  \
             transmit-interval 300\n  detect-multiplier 3\n !\n!\n",
        ),
    )?;
    let mut pc = multihop_peer();
    pc.bfd = Some(juneau_control::model::BfdSettings::default());
    let n0 = Speaker::start_with_peers(&m.topo, 0, vec![pc])?;
    n0.wait_established("router", UP)?;
    wait_for("our multihop BFD session Up", UP, || {
        Ok((n0.status()?["peers"]["router"]["bfd"]["state"] == "Up").then_some(()))
    })
    .map_err(|e| e.context(router.vtysh("show bfd peers").unwrap_or_default()))?;
    let out = router.vtysh("show bfd peers json")?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let p = v
        .as_array()
        .and_then(|a| a.iter().find(|p| p["peer"] == "10.255.0.2").cloned())
        .unwrap_or_default();
    assert_eq!(p["status"], "up", "{out}");
    assert_eq!(p["multihop"], true, "{out}");
    Ok(())
}
