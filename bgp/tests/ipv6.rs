//! MP-BGP over IPv4 sessions against real routers: which address families a session
//! negotiates, End-of-RIB per negotiated family, graceful restart towards an IPv4-only
//! router when the speaker offers IPv6 too (the Cilium#30367 trap), IPv6 VIPs over the
//! IPv4 session with the node's IPv6 next hop (BIRD, FRR, GoBGP; attributes and graceful
//! maintenance as for IPv4), and what happens when the link has no IPv6 address.
//! Sessions over IPv6 and RFC 8950: `ipv6_sessions.rs`.
//!
//! Needs root and the Debian packages `bird2`, `frr`, `gobgpd` (tests/setup.sh).

mod common;

use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use common::*;
use juneau_control::model::DrainSettings;
use juneau_tests::bird::{BgpNeighbor, BirdConfig};
use juneau_tests::netns::route6_next_hops;

const UP: Duration = Duration::from_secs(60);

fn families(s: &Speaker) -> Result<serde_json::Value> {
    Ok(s.status()?["peers"]["router"]["families"].clone())
}

fn wait_families(s: &Speaker, want: &[&str]) -> Result<()> {
    let want = serde_json::json!(want);
    wait_for("the negotiated families in the status", UP, || {
        Ok((families(s)? == want).then_some(()))
    })
}

/// BIRD with only an IPv4 channel and graceful restart; the speaker offers IPv4 and
/// IPv6 (`--offer-ipv6`) and graceful restart for both. The session negotiates IPv4
/// only; after a `kill -9` and a restart BIRD keeps the route throughout, gets the IPv4
/// End-of-RIB and leaves graceful-restart recovery at once, without waiting for an
/// IPv6 End-of-RIB that never comes.
#[test]
fn an_ipv4_only_bird_keeps_its_routes_over_a_restart_of_a_dual_stack_speaker() -> Result<()> {
    let topo = Topo::new("v6gr", 1)?;
    let cfg = BirdConfig::new(router_addr(0)).bgp(
        &BgpNeighbor::new("node0", router_addr(0), ROUTER_ASN, node_addr(0), NODE_ASN)
            .graceful_restart(120)
            .extra("debug { states, events, packets };"),
    );
    let router = Router::start_bird_with_config(&topo, &cfg.render())?;
    let peer = Speaker::peer_config(0, &NodePeering::default());
    let mut s = Speaker::start_with_args(&topo, 0, vec![peer], &["--offer-ipv6"])?;
    s.publish_vips(&[VIP])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    wait_families(&s, &["ipv4-unicast"])?;
    assert_eq!(s.status()?["peers"]["router"]["graceful_restart"], true);
    let eors = |r: &Router| r.full_log().matches("Got END-OF-RIB").count();
    assert_eq!(eors(&router), 1, "one End-of-RIB, IPv4:\n{}", router.logs());

    s.kill();
    let killed = Instant::now();
    let kept = |what: &str, until: &dyn Fn() -> Result<bool>| -> Result<()> {
        loop {
            if router.bgp_nexthops(VIP)? != vec![node_addr(0)] {
                bail!(
                    "{what}: BIRD lost the route after {:?}\n{}",
                    killed.elapsed(),
                    router.logs()
                );
            }
            if until()? {
                return Ok(());
            }
            if killed.elapsed() > UP {
                bail!("{what}: not done after {UP:?}\n{}", router.logs());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    kept("juneau-bgp killed", &|| {
        Ok(killed.elapsed() >= Duration::from_secs(1))
    })?;
    let bird_all = || router.bird_cli(&["show", "protocols", "all", "node0"]);
    const RECOVERING: &str = "Neighbor graceful restart active";
    let info = bird_all()?;
    assert!(info.contains(RECOVERING), "{info}");
    std::fs::remove_file(&s.status_path)?;
    s.spawn(&topo.nodes[0])?;
    let respawned = Instant::now();
    kept("juneau-bgp restarted", &|| Ok(eors(&router) >= 2))?;
    let recovered = respawned.elapsed();
    // Recovery is over: BIRD's channel is no longer waiting for End-of-RIB.
    wait_for("BIRD out of graceful-restart recovery", UP, || {
        let info = bird_all()?;
        Ok((!info.contains(RECOVERING) && info.contains("Established")).then_some(info))
    })
    .map_err(|e| e.context(bird_all().unwrap_or_default()))?;
    let settled = Instant::now();
    kept("after recovery", &|| {
        Ok(settled.elapsed() >= Duration::from_secs(3))
    })?;
    println!(
        "IPv4 End-of-RIB at BIRD {:.0} ms after juneau-bgp was started again",
        recovered.as_secs_f64() * 1e3
    );
    assert_eq!(eors(&router), 2, "{}", router.logs());
    Ok(())
}

/// Whether FRR's or GoBGP's paths to [`VIP`] are marked stale (kept through our
/// restart, RFC 4724); `None`: no path.
fn vip_path_stale(router: &Router) -> Result<Option<bool>> {
    let v: serde_json::Value = serde_json::from_str(&router.route_text(VIP)?)?;
    let paths = match router.kind {
        RouterKind::Frr => &v["paths"],
        RouterKind::Gobgp => &v[&format!("{VIP}/32")],
        RouterKind::Bird => bail!("BIRD shows no stale flag: read its recovery state"),
    };
    Ok(paths
        .as_array()
        .filter(|p| !p.is_empty())
        .map(|p| p.iter().any(|p| p["stale"] == true)))
}

/// An IPv4-only router with graceful restart (FRR or GoBGP) and the speaker offering
/// IPv4 and IPv6 with graceful restart for both: after a `kill -9` the router keeps
/// [`VIP`] as stale, and once the speaker is back it is refreshed (not stale) within
/// seconds, far below the 120 s restart time: no wait for an IPv6 End-of-RIB.
fn ipv4_only_router_keeps_routes_over_a_restart(topo: &Topo, router: &Router) -> Result<()> {
    let peer = Speaker::peer_config(0, &NodePeering::default());
    let mut s = Speaker::start_with_args(topo, 0, vec![peer], &["--offer-ipv6"])?;
    s.publish_vips(&[VIP])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    wait_families(&s, &["ipv4-unicast"])?;
    assert_eq!(s.status()?["peers"]["router"]["graceful_restart"], true);
    ensure!(vip_path_stale(router)? == Some(false));
    s.kill();
    let t0 = Instant::now();
    let until = |what: &str, want: bool| -> Result<std::time::Duration> {
        loop {
            match vip_path_stale(router)? {
                None => bail!(
                    "{what}: route lost after {:?}\n{}",
                    t0.elapsed(),
                    router.logs()
                ),
                Some(stale) if stale == want => return Ok(t0.elapsed()),
                _ if t0.elapsed() > UP => bail!("{what}: not after {UP:?}\n{}", router.logs()),
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    };
    let stale_after = until("kept as stale after the kill", true)?;
    std::thread::sleep(Duration::from_secs(1));
    std::fs::remove_file(&s.status_path)?;
    s.spawn(&topo.nodes[0])?;
    let respawned = t0.elapsed();
    let fresh_after = until("refreshed after the restart", false)? - respawned;
    println!(
        "{:?}: stale {stale_after:?} after the kill, fresh {fresh_after:?} after the restart",
        router.kind
    );
    ensure!(
        fresh_after < Duration::from_secs(30),
        "refreshed only after {fresh_after:?}"
    );
    let settled = Instant::now();
    while settled.elapsed() < Duration::from_secs(3) {
        ensure!(vip_path_stale(router)? == Some(false), "{}", router.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_families(&s, &["ipv4-unicast"])
}

#[test]
fn an_ipv4_only_frr_keeps_its_routes_over_a_restart_of_a_dual_stack_speaker() -> Result<()> {
    let topo = Topo::new("v6grf", 1)?;
    let router = Router::start_frr_with_config(&topo, &frr_config(false), None)?;
    ipv4_only_router_keeps_routes_over_a_restart(&topo, &router)
}

#[test]
fn an_ipv4_only_gobgp_keeps_its_routes_over_a_restart_of_a_dual_stack_speaker() -> Result<()> {
    let topo = Topo::new("v6grg", 1)?;
    let router = Router::start_gobgp_with_config(&topo, &gobgp_config(&["ipv4-unicast"]))?;
    ipv4_only_router_keeps_routes_over_a_restart(&topo, &router)
}

fn frr_config(activate_ipv6: bool) -> String {
    let (rid, na) = (router_addr(0), node_addr(0));
    let mut cfg = format!(
        "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
         bgp router-id {rid}\n no bgp ebgp-requires-policy\n bgp graceful-restart\n \
         neighbor {na} remote-as {NODE_ASN}\n neighbor {na} timers 3 9\n neighbor {na} timers connect 1\n \
         address-family ipv4 unicast\n exit-address-family\n"
    );
    if activate_ipv6 {
        cfg += &format!(
            " address-family ipv6 unicast\n  neighbor {na} activate\n exit-address-family\n"
        );
    }
    cfg + "!\n"
}

fn frr_neighbor(router: &Router) -> Result<serde_json::Value> {
    let na = node_addr(0).to_string();
    let out = router.vtysh(&format!("show bgp neighbors {na} json"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    Ok(v[&na].clone())
}

/// FRR's view of the End-of-RIB of `family` (`ipv4Unicast`, `ipv6Unicast`): received?
fn frr_eor_received(n: &serde_json::Value, family: &str) -> bool {
    n["gracefulRestartInfo"][family]["endOfRibStatus"]["endOfRibRecv"] == true
}

/// Node 0's speaker against `router` (started on `topo`), with `--offer-ipv6` when
/// `offer`, announcing [`VIP`]: returned once the session is up, the route at the router
/// and the families `offer` means negotiated.
fn speaker_offering(topo: &Topo, router: &Router, offer: bool) -> Result<Speaker> {
    let peer = Speaker::peer_config(0, &NodePeering::default());
    let args: &[&str] = if offer { &["--offer-ipv6"] } else { &[] };
    let mut s = Speaker::start_with_args(topo, 0, vec![peer], args)?;
    s.publish_vips(&[VIP])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    let want: &[&str] = if offer {
        &["ipv4-unicast", "ipv6-unicast"]
    } else {
        &["ipv4-unicast"]
    };
    wait_families(&s, want)?;
    Ok(s)
}

/// FRR with IPv4 and IPv6 unicast on an IPv4 session: with `--offer-ipv6` both are
/// negotiated and FRR receives an End-of-RIB for each; without it only IPv4 is, and FRR
/// gets no IPv6 End-of-RIB (nor anything else IPv6).
#[test]
fn frr_negotiates_ipv6_only_when_offered_and_gets_an_end_of_rib_per_family() -> Result<()> {
    for offer in [true, false] {
        let topo = Topo::new(if offer { "v6frr" } else { "v4frr" }, 1)?;
        let router = Router::start_frr_with_config(&topo, &frr_config(true), None)?;
        let s = speaker_offering(&topo, &router, offer)?;
        let n = wait_for("FRR to receive the IPv4 End-of-RIB", UP, || {
            let n = frr_neighbor(&router)?;
            Ok(frr_eor_received(&n, "ipv4Unicast").then_some(n))
        })?;
        // Let any late message arrive before checking what did not.
        std::thread::sleep(Duration::from_secs(1));
        let n = if offer { frr_neighbor(&router)? } else { n };
        let mp = &n["neighborCapabilities"]["multiprotocolExtensions"];
        let both = |f: &str| mp[f]["advertisedAndReceived"] == true;
        assert!(both("ipv4Unicast"), "{n:#}");
        assert_eq!(
            frr_eor_received(&n, "ipv6Unicast"),
            offer,
            "IPv6 End-of-RIB iff negotiated: {n:#}"
        );
        assert_eq!(both("ipv6Unicast"), offer, "{n:#}");
        drop(s);
        drop(router);
    }
    Ok(())
}

/// GoBGP with graceful restart for `families` (`ipv4-unicast`, `ipv6-unicast`).
fn gobgp_config(families: &[&str]) -> String {
    let (rid, na) = (router_addr(0), node_addr(0));
    let mut cfg = format!(
        "[global.config]\n  as = {ROUTER_ASN}\n  router-id = \"{rid}\"\n  port = 179\n\
         [[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{na}\"\n    peer-as = {NODE_ASN}\n\
         [neighbors.timers.config]\n    hold-time = 9\n    keepalive-interval = 3\n    connect-retry = 1\n\
         [neighbors.graceful-restart.config]\n    enabled = true\n    restart-time = 120\n"
    );
    for family in families {
        cfg += &format!(
            "[[neighbors.afi-safis]]\n  [neighbors.afi-safis.config]\n    afi-safi-name = \"{family}\"\n\
             [neighbors.afi-safis.mp-graceful-restart.config]\n    enabled = true\n"
        );
    }
    cfg
}

/// GoBGP's neighbor as JSON (`gobgp neighbor <addr> -j`).
fn gobgp_neighbor(topo: &Topo) -> Result<serde_json::Value> {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            topo.router.name(),
            "gobgp",
            "-u",
            "127.0.0.1",
        ])
        .args(["-p", "50051", "neighbor", &node_addr(0).to_string(), "-j"])
        .output()?;
    if !out.status.success() {
        bail!("gobgp: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// GoBGP's per-family state for AFI `afi` (SAFI 1).
fn gobgp_family(n: &serde_json::Value, afi: u64) -> serde_json::Value {
    n["afi_safis"]
        .as_array()
        .and_then(|fs| fs.iter().find(|f| f["state"]["family"]["afi"] == afi))
        .cloned()
        .unwrap_or_default()
}

/// GoBGP with IPv4 and IPv6 unicast and graceful restart for both, on an IPv4
/// session: with `--offer-ipv6` both families are negotiated, GoBGP sees our graceful
/// restart capability list both and receives an End-of-RIB for each; without it, only
/// IPv4, and no IPv6 End-of-RIB.
#[test]
fn gobgp_negotiates_ipv6_only_when_offered_and_gets_an_end_of_rib_per_family() -> Result<()> {
    for offer in [true, false] {
        let topo = Topo::new(if offer { "v6gobgp" } else { "v4gobgp" }, 1)?;
        let router = Router::start_gobgp_with_config(
            &topo,
            &gobgp_config(&["ipv4-unicast", "ipv6-unicast"]),
        )?;
        let s = speaker_offering(&topo, &router, offer)?;
        let eor = |f: &serde_json::Value| {
            f["mp_graceful_restart"]["state"]["end_of_rib_received"] == true
        };
        let n = wait_for("GoBGP to receive the IPv4 End-of-RIB", UP, || {
            let n = gobgp_neighbor(&topo)?;
            Ok(eor(&gobgp_family(&n, 1)).then_some(n))
        })?;
        std::thread::sleep(Duration::from_secs(1));
        let n = if offer { gobgp_neighbor(&topo)? } else { n };
        let v6 = gobgp_family(&n, 2);
        assert_eq!(eor(&v6), offer, "IPv6 End-of-RIB iff negotiated: {v6:#}");
        assert_eq!(
            v6["mp_graceful_restart"]["state"]["received"] == true,
            offer,
            "our graceful restart lists IPv6 iff offered: {v6:#}"
        );
        drop(s);
        drop(router);
    }
    Ok(())
}

/// The IPv6 VIP announced with the IPv4 one.
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);

/// Node 0's speaker on its IPv4 session (`router`), announcing [`VIP`] and [`VIP6`]
/// (the first IPv6 VIP makes it offer IPv6 unicast: one session reset); returned once
/// the session is up with both families and the IPv4 route at the router.
fn speaker_with_both_vips(topo: &Topo, router: &Router) -> Result<Speaker> {
    let peer = Speaker::peer_config(0, &NodePeering::default());
    let mut s = Speaker::start_with_peers(topo, 0, vec![peer])?;
    s.publish_ip_vips(&[VIP.into(), VIP6.into()])?;
    wait_families(&s, &["ipv4-unicast", "ipv6-unicast"])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    Ok(s)
}

/// IPv6 routes over an IPv4 session (plain MP-BGP, RFC 4760/2545): the router learns
/// [`VIP6`]/128 with the node's global IPv6 address on the link as next hop (16 bytes:
/// no link-local over an IPv4 session), as `next_hops` reads it; withdrawing it removes
/// it, the IPv4 VIP stays.
fn ipv6_vip_over_an_ipv4_session(
    topo: &Topo,
    router: &Router,
    next_hops: &dyn Fn() -> Result<Vec<Ipv6Addr>>,
) -> Result<Speaker> {
    let mut s = speaker_with_both_vips(topo, router)?;
    let want = vec![node_addr6(0)];
    wait_for(
        &format!("{VIP6}/128 via {want:?} at the router"),
        UP,
        || Ok((next_hops()? == want).then_some(())),
    )
    .with_context(|| format!("{}\n{}", router.logs(), s.logs()))?;
    let st = s.status()?;
    let p = &st["peers"]["router"];
    assert_eq!(p["prefixes_announced"], 2, "{st:#}");
    assert_eq!(
        p["not_sent"],
        serde_json::json!({"family_not_negotiated": 0, "no_next_hop": 0}),
        "{st:#}"
    );
    s.publish_vips(&[VIP])?;
    wait_for(&format!("{VIP6}/128 withdrawn at the router"), UP, || {
        Ok(next_hops()?.is_empty().then_some(()))
    })?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    Ok(s)
}

fn kernel_v6_hops(topo: &Topo) -> Result<Vec<Ipv6Addr>> {
    route6_next_hops(topo.router.name(), VIP6)
}

/// Graceful maintenance's wait before the withdrawal.
const DRAIN_WAIT: u16 = 4;
const DRAIN_WAIT_S: Duration = Duration::from_secs(DRAIN_WAIT as u64);

/// BIRD with an `ipv6` channel on the IPv4 session; the IPv6 VIP carries the same
/// attributes as an IPv4 one, and graceful maintenance treats it the same: less
/// preferred (prepended AS_PATH, GRACEFUL_SHUTDOWN) for the wait, then withdrawn.
#[test]
fn bird_learns_an_ipv6_vip_over_an_ipv4_session_and_sees_it_drained() -> Result<()> {
    let topo = Topo::new("v6v4b", 1)?;
    topo.add_ipv6()?;
    let cfg = BirdConfig::new(router_addr(0))
        .raw("protocol kernel { ipv6 { import none; export all; }; }")
        .bgp(
            &BgpNeighbor::new("node0", router_addr(0), ROUTER_ASN, node_addr(0), NODE_ASN)
                .extra("ipv6 { import all; export none; };"),
        );
    let router = Router::start_bird_with_config(&topo, &cfg.render())?;
    let mut s = ipv6_vip_over_an_ipv4_session(&topo, &router, &|| kernel_v6_hops(&topo))?;

    // Announced again, then drained.
    s.publish_ip_vips(&[VIP.into(), VIP6.into()])?;
    wait_for("the IPv6 VIP back", UP, || {
        Ok((kernel_v6_hops(&topo)? == vec![node_addr6(0)]).then_some(()))
    })?;
    let show = || router.bird_cli(&["show", "route", "all", &format!("{VIP6}/128")]);
    let text = show()?;
    for want in router.expected_attribute_texts() {
        assert!(text.contains(want), "no {want} in\n{text}");
    }
    let mut st = s.state.clone();
    st.peers[0].drain = Some(DrainSettings {
        as_path_prepend: 2,
        local_pref: 0,
        wait_seconds: DRAIN_WAIT,
    });
    let t0 = Instant::now();
    s.publish_state(&st)?;
    let text = wait_for("the IPv6 VIP with GRACEFUL_SHUTDOWN at BIRD", UP, || {
        let t = show()?;
        Ok(t.contains("(65535,0)").then_some(t))
    })?;
    assert!(text.contains("65001 65001 65001"), "not prepended:\n{text}");
    assert!(t0.elapsed() < DRAIN_WAIT_S, "{:?}", t0.elapsed());
    wait_for("the drained IPv6 VIP withdrawn", UP, || {
        Ok(kernel_v6_hops(&topo)?.is_empty().then_some(()))
    })?;
    assert!(t0.elapsed() >= DRAIN_WAIT_S, "{:?}", t0.elapsed());
    Ok(())
}

/// FRR with IPv6 unicast activated on the IPv4 neighbour and `capability
/// extended-nexthop` on it (accepted in its configuration): FRR 8.4 sends that capability
/// to IPv6 neighbours only, and we offer it on IPv6 sessions only (IPv4 routes on an
/// IPv4 session have an IPv4 NEXT_HOP), so it is not negotiated; the IPv6 VIP is learnt
/// all the same, with the node's global IPv6 next hop.
#[test]
fn frr_learns_an_ipv6_vip_over_an_ipv4_session() -> Result<()> {
    let topo = Topo::new("v6v4f", 1)?;
    topo.add_ipv6()?;
    let na = node_addr(0);
    let cfg = frr_config(true).replace(
        &format!(" neighbor {na} timers connect 1\n"),
        &format!(" neighbor {na} timers connect 1\n neighbor {na} capability extended-nexthop\n"),
    );
    let router = Router::start_frr_with_config(&topo, &cfg, None)?;
    let _s = ipv6_vip_over_an_ipv4_session(&topo, &router, &|| kernel_v6_hops(&topo))?;
    let running = router.vtysh("show running-config")?;
    assert!(
        running.contains(&format!("neighbor {na} capability extended-nexthop")),
        "{running}"
    );
    let n = frr_neighbor(&router)?;
    let caps = &n["neighborCapabilities"];
    assert_eq!(caps["extendedNexthop"], serde_json::Value::Null, "{n:#}");
    assert_eq!(
        caps["multiprotocolExtensions"]["ipv6Unicast"]["advertisedAndReceived"], true,
        "{n:#}"
    );
    Ok(())
}

#[test]
fn gobgp_learns_an_ipv6_vip_over_an_ipv4_session() -> Result<()> {
    let topo = Topo::new("v6v4g", 1)?;
    topo.add_ipv6()?;
    let router =
        Router::start_gobgp_with_config(&topo, &gobgp_config(&["ipv4-unicast", "ipv6-unicast"]))?;
    ipv6_vip_over_an_ipv4_session(&topo, &router, &|| router.gobgp_nexthops6(VIP6))?;
    Ok(())
}

/// An IPv4 session negotiating IPv6 unicast from a node whose link has no global IPv6
/// address (link-local only): the IPv6 VIP is not sent (no next hop to give), shown as
/// `not_sent.no_next_hop` and logged; the IPv4 VIP is announced as usual. Once the link
/// has a global IPv6 address, the VIP goes out on the same session.
#[test]
fn no_ipv6_address_on_the_link_withholds_the_ipv6_vip_with_a_reason() -> Result<()> {
    let topo = Topo::new("v6nonh", 1)?;
    let router = Router::start_frr_with_config(&topo, &frr_config(true), None)?;
    let s = speaker_with_both_vips(&topo, &router)?;
    let st = wait_for("the IPv6 VIP counted as not sent", UP, || {
        let st = s.status()?;
        Ok((st["peers"]["router"]["not_sent"]["no_next_hop"] == 1).then_some(st))
    })?;
    let p = &st["peers"]["router"];
    assert_eq!(p["prefixes_announced"], 1, "{st:#}");
    assert_eq!(p["not_sent"]["family_not_negotiated"], 0, "{st:#}");
    let log = s.logs();
    assert!(
        log.contains("routes not sent") && log.contains("no address"),
        "no warning in the speaker's log:\n{log}"
    );
    // FRR has nothing IPv6 from us, neither in BGP nor in the kernel.
    std::thread::sleep(Duration::from_secs(1));
    let out = router.vtysh("show bgp ipv6 unicast json")?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert!(
        v["routes"].as_object().is_none_or(|r| r.is_empty()),
        "FRR has IPv6 routes: {v:#}"
    );
    assert!(kernel_v6_hops(&topo)?.is_empty());

    // The link gets its IPv6 addresses: the speaker finds the next hop within its
    // recheck interval (5 s), without a session reset, and sends the VIP.
    let flaps = |s: &Speaker| -> Result<serde_json::Value> {
        Ok(s.status()?["peers"]["router"]["session_flaps"].clone())
    };
    let flaps_before = flaps(&s)?;
    assert!(flaps_before.is_u64(), "no session_flaps in the status");
    topo.add_ipv6()?;
    let t0 = Instant::now();
    wait_for("the IPv6 VIP routed once the link has IPv6", UP, || {
        Ok((kernel_v6_hops(&topo)? == vec![node_addr6(0)]).then_some(()))
    })
    .with_context(|| s.logs())?;
    println!(
        "IPv6 VIP sent {:?} after the address was added",
        t0.elapsed()
    );
    let st = s.status()?;
    assert_eq!(
        st["peers"]["router"]["not_sent"]["no_next_hop"], 0,
        "{st:#}"
    );
    assert_eq!(flaps(&s)?, flaps_before, "the session was reset");
    Ok(())
}
