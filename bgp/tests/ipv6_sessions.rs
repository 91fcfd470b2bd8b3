//! IPv6 end to end through the node state (issue 28): the real `juneau-bgp`, fed a
//! published node state (layout 9) with an IPv6 peer and IPv6 VIPs and a dataplane
//! status file listing what is programmed, opens a session over IPv6 (from its IPv6
//! source address, with TCP-MD5) to BIRD 2 and to FRR, and the router
//! installs the programmed IPv6 VIP as a /128 via the node. An IPv6 VIP the dataplane
//! has not programmed is not announced until it is; an IPv4-only peer of the same node
//! gets the IPv4 VIP and no IPv6 route.
//!
//! Topology (`common`): node `n0` (`uplink`: 10.0.1.2/24 and 2001:db8:0:1::2/64) wired
//! to the router (`d0`: 10.0.1.1/24 and 2001:db8:0:1::1/64).
//!
//! Needs root and the Debian packages `bird2`, `frr` (tests/setup.sh).

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use common::dataplane::FakeDataplane;
use common::*;
use juneau_control::model::PeerConfig;
use juneau_tests::netns::{ipv6_addresses, route6_next_hops, route_next_hops_via_ipv6};

const UP: Duration = Duration::from_secs(60);
const ROUTER6: Ipv6Addr = router_addr6(0);
const NODE6: Ipv6Addr = node_addr6(0);
/// Programmed in the (stand-in) dataplane.
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);
/// Wanted by the agent, not programmed at first.
const VIP6_HELD: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x11);
const PASSWORD: &str = "v6-md5-secret";

/// [`Topo`] with the IPv6 link added ([`ROUTER6`], [`NODE6`]).
fn topo(tag: &str) -> Result<Topo> {
    let topo = Topo::new(tag, 1)?;
    topo.add_ipv6()?;
    Ok(topo)
}

/// The IPv6 peer as the agent publishes it: source address, fast timers, TCP-MD5 when
/// `password`.
fn peer_v6(password: bool) -> PeerConfig {
    let mut p = PeerConfig::new("router-v6", ROUTER6, ROUTER_ASN, NODE_ASN);
    p.source_address = Some(NODE6.into());
    p.hold_time = 9;
    p.keepalive_time = 3;
    p.connect_retry_time = 1;
    p.md5_password = password.then(|| PASSWORD.into());
    p
}

/// Node 0's speaker with the IPv6 peer and the IPv4 one (`router`, IPv4 only at the
/// router), gated by a stand-in dataplane that programs [`VIP`] and [`VIP6`], announcing
/// those and [`VIP6_HELD`]; listening on `listen`.
fn start_speaker(topo: &Topo, password: bool, listen: &str) -> Result<(Speaker, FakeDataplane)> {
    let v4 = Speaker::peer_config(0, &NodePeering::default());
    let mut s = Speaker::start_with_peers(topo, 0, vec![peer_v6(password), v4])?;
    s.kill();
    s.listen = listen.into();
    s.gate_args = vec!["--dataplane-heartbeat-timeout-ms".into(), "500".into()];
    let dp = FakeDataplane::start(&s.state_path.with_extension("dataplane"))?;
    dp.program(1, &[IpAddr::from(VIP), IpAddr::from(VIP6)])?;
    s.spawn(&topo.nodes[0])?;
    s.publish_ip_vips(&[VIP.into(), VIP6.into(), VIP6_HELD.into()])?;
    Ok((s, dp))
}

/// The node's addresses the router may use as the next hop of its IPv6 VIPs: its
/// global address on the link or its link-local one.
fn node_next_hops(topo: &Topo) -> Result<Vec<Ipv6Addr>> {
    let mut v = vec![NODE6];
    v.extend(ipv6_addresses(topo.nodes[0].name(), "uplink", "link")?);
    Ok(v)
}

/// Waits until the router's kernel routes `prefix` via one address of the node.
fn wait_v6_route(topo: &Topo, router: &Router, prefix: Ipv6Addr) -> Result<Ipv6Addr> {
    let node = node_next_hops(topo)?;
    wait_for(
        &format!("the router's kernel route to {prefix}/128"),
        UP,
        || {
            let hops = route6_next_hops(topo.router.name(), prefix)?;
            Ok(match hops[..] {
                [h] if node.contains(&h) => Some(h),
                _ => None,
            })
        },
    )
    .with_context(|| router.logs())
}

/// The router's kernel must have no route to `prefix` during all of `for_`.
fn stays_unrouted(topo: &Topo, prefix: Ipv6Addr, for_: Duration, why: &str) -> Result<()> {
    let end = Instant::now() + for_;
    while Instant::now() < end {
        let hops = route6_next_hops(topo.router.name(), prefix)?;
        ensure!(
            hops.is_empty(),
            "{why}: the router routes {prefix} via {hops:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// What both routers must show: the IPv6 session up with IPv6 unicast negotiated, the
/// programmed IPv6 VIP routed via the node, the held one not until it is programmed,
/// the IPv4-only peer with the IPv4 VIP and no IPv6 route, and a withdrawal.
/// `started`: when the speaker was started.
fn check(
    topo: &Topo,
    router: &Router,
    s: &mut Speaker,
    dp: &FakeDataplane,
    started: Instant,
) -> Result<()> {
    s.wait_established("router-v6", UP)?;
    s.wait_established("router", UP)?;
    let hop = wait_v6_route(topo, router, VIP6)?;
    record(
        router.kind,
        "speaker started to IPv6 VIP in the kernel over an IPv6 session",
        started.elapsed(),
    );
    println!("{:?}: {VIP6}/128 via {hop}", router.kind);
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;

    let st = s.status()?;
    let v6 = &st["peers"]["router-v6"];
    assert_eq!(v6["peer_address"], ROUTER6.to_string(), "{st:#}");
    assert!(
        v6["families"]
            .as_array()
            .is_some_and(|f| f.contains(&"ipv6-unicast".into())),
        "{st:#}"
    );
    // The IPv4-only peer: the IPv4 VIP only; both IPv6 VIPs withheld as a family it did
    // not negotiate (the held one is not in the desired set: it is held back).
    let v4 = &st["peers"]["router"];
    assert_eq!(
        v4["families"],
        serde_json::json!(["ipv4-unicast"]),
        "{st:#}"
    );
    assert_eq!(v4["prefixes_announced"], 1, "{st:#}");
    assert_eq!(v4["not_sent"]["family_not_negotiated"], 1, "{st:#}");
    assert!(
        st["held_back"][VIP6_HELD.to_string()]
            .as_str()
            .is_some_and(|r| r.contains("not programmed")),
        "{st:#}"
    );
    stays_unrouted(topo, VIP6_HELD, Duration::from_secs(2), "not programmed")?;

    // Programmed now: announced.
    dp.program(2, &[IpAddr::from(VIP), VIP6.into(), VIP6_HELD.into()])?;
    wait_v6_route(topo, router, VIP6_HELD)?;

    // The agent withdraws the IPv6 VIPs: gone at the router, the IPv4 VIP stays.
    s.publish_vips(&[VIP])?;
    wait_for("the IPv6 VIPs withdrawn at the router", UP, || {
        let gone = route6_next_hops(topo.router.name(), VIP6)?.is_empty()
            && route6_next_hops(topo.router.name(), VIP6_HELD)?.is_empty();
        Ok(gone.then_some(()))
    })?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    Ok(())
}

#[test]
fn bird_learns_ipv6_vips_over_an_ipv6_session_with_tcp_md5() -> Result<()> {
    let topo = topo("v6b")?;
    let (r, n) = (router_addr(0), node_addr(0));
    let cfg = format!(
        "log stderr all;\nrouter id {r};\nprotocol device {{ scan time 10; }}\n\
         protocol kernel {{ ipv4 {{ import none; export all; }}; }}\n\
         protocol kernel {{ ipv6 {{ import none; export all; }}; }}\n\
         protocol bgp node0 {{\n local {r} as {ROUTER_ASN};\n neighbor {n} as {NODE_ASN};\n \
         hold time 9; keepalive time 3; connect delay time 1; connect retry time 2; error wait time 1, 4;\n \
         ipv4 {{ import all; export none; }};\n}}\n\
         protocol bgp node0v6 {{\n local {ROUTER6} as {ROUTER_ASN};\n neighbor {NODE6} as {NODE_ASN};\n \
         hold time 9; keepalive time 3; connect delay time 1; connect retry time 2; error wait time 1, 4;\n \
         password \"{PASSWORD}\";\n ipv6 {{ import all; export none; }};\n}}\n"
    );
    let router = Router::start_bird_with_config(&topo, &cfg)?;
    let started = Instant::now();
    let (mut s, dp) = start_speaker(&topo, true, "[::]:179")?;
    check(&topo, &router, &mut s, &dp, started)?;
    // BIRD's view: the IPv6 session is the one that carried it, over TCP-MD5.
    let info = router.bird_cli(&["show", "protocols", "all", "node0v6"])?;
    assert!(info.contains("Established"), "{info}");
    Ok(())
}

#[test]
fn frr_learns_ipv6_vips_over_an_ipv6_session_with_tcp_md5() -> Result<()> {
    let topo = topo("v6f")?;
    let (rid, n) = (router_addr(0), node_addr(0));
    let cfg = format!(
        "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
         bgp router-id {rid}\n no bgp ebgp-requires-policy\n no bgp default ipv4-unicast\n \
         neighbor {n} remote-as {NODE_ASN}\n neighbor {n} timers 3 9\n neighbor {n} timers connect 1\n \
         neighbor {NODE6} remote-as {NODE_ASN}\n neighbor {NODE6} timers 3 9\n neighbor {NODE6} timers connect 1\n \
         neighbor {NODE6} password {PASSWORD}\n \
         address-family ipv4 unicast\n  neighbor {n} activate\n exit-address-family\n \
         address-family ipv6 unicast\n  neighbor {NODE6} activate\n exit-address-family\n!\n"
    );
    let router = Router::start_frr_with_config(&topo, &cfg, None)?;
    let started = Instant::now();
    // The default IPv4 listener: FRR's own connections are refused, ours go out.
    let (mut s, dp) = start_speaker(&topo, true, "0.0.0.0:179")?;
    check(&topo, &router, &mut s, &dp, started)?;
    let out = router.vtysh(&format!("show bgp neighbors {NODE6} json"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let nb = &v[NODE6.to_string()];
    assert_eq!(nb["bgpState"], "Established", "{nb:#}");
    assert_eq!(
        nb["neighborCapabilities"]["multiprotocolExtensions"]["ipv6Unicast"]
            ["advertisedAndReceived"],
        true,
        "{nb:#}"
    );
    Ok(())
}

/// BFD over IPv6 (RFC 5881 single hop: UDP 3784, hop limit 255) between juneau-bgp and
/// BIRD 2 on the IPv6 session: both sides come Up, and when the link dies (nftables
/// drops every packet of the node) both declare it down within the detection time
/// (300 ms x 3) and BIRD withdraws the IPv6 VIP at once, not after the 9 s hold time.
#[test]
fn bfd_over_ipv6_with_bird_comes_up_and_a_dead_link_withdraws_the_ipv6_vip() -> Result<()> {
    bfd_over_ipv6("v6d", false)
}

/// The same with BFD in its own process, `juneau-bfd`, as `deploy/` runs it: the speaker
/// follows its status file.
#[test]
fn bfd_over_ipv6_in_juneau_bfd_with_bird_withdraws_the_ipv6_vip_on_a_dead_link() -> Result<()> {
    bfd_over_ipv6("v6j", true)
}

/// `separate`: BFD in juneau-bfd, else in juneau-bgp.
fn bfd_over_ipv6(tag: &str, separate: bool) -> Result<()> {
    let topo = topo(tag)?;
    let r = router_addr(0);
    let cfg = format!(
        "log stderr all;\nrouter id {r};\nprotocol device {{ scan time 10; }}\n\
         protocol kernel {{ ipv6 {{ import none; export all; }}; }}\n\
         protocol bfd {{ interface \"d0\" {{ min rx interval 300 ms; min tx interval 300 ms; multiplier 3; }}; }}\n\
         protocol bgp node0v6 {{\n local {ROUTER6} as {ROUTER_ASN};\n neighbor {NODE6} as {NODE_ASN};\n \
         hold time 9; keepalive time 3; connect delay time 1; connect retry time 2; error wait time 1, 4;\n \
         bfd on;\n ipv6 {{ import all; export none; }};\n}}\n"
    );
    let router = Router::start_bird_with_config(&topo, &cfg)?;
    let mut p = peer_v6(false);
    p.bfd = Some(juneau_control::model::BfdSettings {
        min_rx_ms: 300,
        min_tx_ms: 300,
        multiplier: 3,
    });
    let bfd_file = topo.dir.path().join("node0.bfd.json");
    let args: &[&str] = if separate {
        &["--bfd-status-file", bfd_file.to_str().unwrap()]
    } else {
        &[]
    };
    let mut s = Speaker::start_with_args(&topo, 0, vec![p], args)?;
    let bfdd = separate.then(|| s.start_bfd(&topo.nodes[0])).transpose()?;
    s.publish_ip_vips(&[VIP6.into()])?;
    s.wait_established("router-v6", UP)?;
    wait_v6_route(&topo, &router, VIP6)?;
    let ours = |s: &Speaker| -> Result<String> {
        Ok(s.status()?["peers"]["router-v6"]["bfd"]["state"]
            .as_str()
            .unwrap_or("")
            .to_string())
    };
    wait_for("our BFD session over IPv6 Up", UP, || {
        Ok((ours(&s)? == "Up").then_some(()))
    })
    .with_context(|| {
        format!(
            "{}\n{}",
            s.logs(),
            bfdd.as_ref().map(|b| b.logs()).unwrap_or_default()
        )
    })?;
    wait_for(
        "BIRD's BFD session with the node's IPv6 address Up",
        UP,
        || {
            let out = router.bird_cli(&["show", "bfd", "sessions"])?;
            Ok(out
                .lines()
                .any(|l| l.starts_with(&NODE6.to_string()) && l.contains(" Up "))
                .then_some(()))
        },
    )
    .with_context(|| router.logs())?;

    // The link dies for IP; the veth stays up.
    let t0 = Instant::now();
    topo.nodes[0].exec(&["nft", "add", "table", "inet", "juneau_cut"])?;
    for hook in ["input", "output"] {
        topo.nodes[0].exec(&[
            "nft",
            &format!("add chain inet juneau_cut {hook} {{ type filter hook {hook} priority -300; policy drop; }}"),
        ])?;
    }
    let (mut down, mut withdrawn) = (None, None);
    while down.is_none() || withdrawn.is_none() {
        ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "after 15 s: ours down {down:?}, router withdrew {withdrawn:?}\n{}\n{}",
            s.logs(),
            router.logs()
        );
        if down.is_none() && ours(&s)? == "Down" {
            down = Some(t0.elapsed());
        }
        if withdrawn.is_none() && route6_next_hops(topo.router.name(), VIP6)?.is_empty() {
            withdrawn = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (down, withdrawn) = (down.unwrap(), withdrawn.unwrap());
    let who = if separate { "juneau-bfd" } else { "juneau-bgp" };
    record(
        router.kind,
        &format!("bfd over IPv6: link cut -> {who} BFD Down"),
        down,
    );
    record(
        router.kind,
        "bfd over IPv6: link cut -> IPv6 VIP withdrawn",
        withdrawn,
    );
    // 300 ms x 3 plus room for a loaded machine, far below the 9 s hold time.
    let bound = Duration::from_millis(2500);
    ensure!(
        down < bound && withdrawn < bound,
        "down {down:?}, withdrawn {withdrawn:?}"
    );
    Ok(())
}

/// TCP-MD5 is really in force on the IPv6 session: BIRD with another password never
/// sees it come up (the kernels drop the unsigned or wrongly signed segments).
/// The first IPv6 VIP of a session over IPv6 that is already Established reaches BIRD at
/// once: the session's OPEN offered IPv6 unicast from the start, so it is no new family
/// (no "session restarts", no skipped round; the /128 used to wait for the node
/// state's next change, seen in the dual-stack lab).
#[test]
fn the_first_ipv6_vip_of_an_established_ipv6_session_is_sent_at_once() -> Result<()> {
    let topo = topo("v6l")?;
    let r = router_addr(0);
    let cfg = format!(
        "log stderr all;\nrouter id {r};\nprotocol device {{ scan time 10; }}\n\
         protocol kernel {{ ipv6 {{ import none; export all; }}; }}\n\
         protocol bgp node0v6 {{\n local {ROUTER6} as {ROUTER_ASN};\n neighbor {NODE6} as {NODE_ASN};\n \
         hold time 9; keepalive time 3; connect delay time 1; connect retry time 2; error wait time 1, 4;\n \
         ipv6 {{ import all; export none; }};\n}}\n"
    );
    let router = Router::start_bird_with_config(&topo, &cfg)?;
    let mut s = Speaker::start_with_args(&topo, 0, vec![peer_v6(false)], &[])?;
    s.publish_ip_vips(&[])?;
    s.wait_established("router-v6", UP)?;
    s.publish_ip_vips(&[VIP6.into()])?;
    wait_for(
        "the first IPv6 VIP at the router within 10 s",
        Duration::from_secs(10),
        || Ok((!route6_next_hops(topo.router.name(), VIP6)?.is_empty()).then_some(())),
    )
    .with_context(|| format!("{}\n{}", s.logs(), router.logs()))?;
    ensure!(
        !s.logs().contains("offering new address families"),
        "the IPv6 session offered IPv6 again:\n{}",
        s.logs()
    );
    Ok(())
}

#[test]
fn a_wrong_tcp_md5_password_keeps_the_ipv6_session_down() -> Result<()> {
    let topo = topo("v6m")?;
    let r = router_addr(0);
    let cfg = format!(
        "log stderr all;\nrouter id {r};\nprotocol device {{ scan time 10; }}\n\
         protocol bgp node0v6 {{\n local {ROUTER6} as {ROUTER_ASN};\n neighbor {NODE6} as {NODE_ASN};\n \
         hold time 9; keepalive time 3; connect delay time 1; connect retry time 2; error wait time 1, 4;\n \
         password \"not-{PASSWORD}\";\n ipv6 {{ import all; export none; }};\n}}\n"
    );
    let router = Router::start_bird_with_config(&topo, &cfg)?;
    let mut s = Speaker::start_with_peers(&topo, 0, vec![peer_v6(true)])?;
    s.publish_ip_vips(&[VIP6.into()])?;
    wait_for("the speaker's status listing the IPv6 peer", UP, || {
        Ok(s.status()
            .ok()
            .filter(|st| st["peers"]["router-v6"].is_object())
            .map(|_| ()))
    })?;
    let end = Instant::now() + Duration::from_secs(6);
    while Instant::now() < end {
        ensure!(
            s.peer_state("router-v6")? != "Established",
            "established with a wrong password\n{}",
            router.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stays_unrouted(&topo, VIP6, Duration::from_millis(500), "wrong password")?;
    Ok(())
}

/// Waits until the router's kernel routes the IPv4 `prefix` via an IPv6 address of the
/// node (`via inet6`, an RFC 8950 next hop).
fn wait_v4_route_via_v6(topo: &Topo, router: &Router, prefix: Ipv4Addr) -> Result<Ipv6Addr> {
    let node = node_next_hops(topo)?;
    wait_for(
        &format!("the router's kernel route to {prefix}/32 via an IPv6 next hop"),
        UP,
        || {
            let hops = route_next_hops_via_ipv6(topo.router.name(), prefix)?;
            Ok(match hops[..] {
                [h] if node.contains(&h) => Some(h),
                _ => None,
            })
        },
    )
    .with_context(|| router.logs())
}

/// RFC 8950 on an IPv6 session (no IPv4 address given to it): both families
/// negotiated, the extended next hop too; the IPv4 VIP goes in MP_REACH_NLRI with the
/// node's IPv6 next hop and the router's kernel routes it `via inet6`; the IPv6 VIP
/// as usual. Withdrawing the IPv4 VIP removes it. Returns the speaker, still up.
fn ipv4_over_an_ipv6_session(topo: &Topo, router: &Router) -> Result<Speaker> {
    let mut s = Speaker::start_with_peers(topo, 0, vec![peer_v6(false)])?;
    s.publish_ip_vips(&[VIP.into(), VIP6.into()])?;
    s.wait_established("router-v6", UP)?;
    wait_v6_route(topo, router, VIP6)?;
    let hop = wait_v4_route_via_v6(topo, router, VIP)?;
    println!("{:?}: {VIP}/32 via inet6 {hop}", router.kind);
    let st = s.status()?;
    let p = &st["peers"]["router-v6"];
    assert_eq!(
        p["families"],
        serde_json::json!(["ipv4-unicast", "ipv6-unicast"]),
        "{st:#}"
    );
    assert_eq!(p["prefixes_announced"], 2, "{st:#}");
    assert_eq!(
        p["not_sent"],
        serde_json::json!({"family_not_negotiated": 0, "no_next_hop": 0}),
        "{st:#}"
    );
    s.publish_ip_vips(&[VIP6.into()])?;
    wait_for("the IPv4 VIP withdrawn at the router", UP, || {
        Ok(route_next_hops_via_ipv6(topo.router.name(), VIP)?
            .is_empty()
            .then_some(()))
    })?;
    wait_v6_route(topo, router, VIP6)?;
    Ok(s)
}

#[test]
fn bird_learns_an_ipv4_vip_with_an_ipv6_next_hop_over_an_ipv6_session_rfc8950() -> Result<()> {
    let topo = topo("v6x")?;
    let r = router_addr(0);
    let cfg = format!(
        "log stderr all;\nrouter id {r};\nprotocol device {{ scan time 10; }}\n\
         protocol kernel {{ ipv4 {{ import none; export all; }}; }}\n\
         protocol kernel {{ ipv6 {{ import none; export all; }}; }}\n\
         protocol bgp node0v6 {{\n local {ROUTER6} as {ROUTER_ASN};\n neighbor {NODE6} as {NODE_ASN};\n \
         hold time 9; keepalive time 3; connect delay time 1; connect retry time 2; error wait time 1, 4;\n \
         ipv4 {{ import all; export none; extended next hop on; }};\n \
         ipv6 {{ import all; export none; }};\n}}\n"
    );
    let router = Router::start_bird_with_config(&topo, &cfg)?;
    let _s = ipv4_over_an_ipv6_session(&topo, &router)?;
    let info = router.bird_cli(&["show", "protocols", "all", "node0v6"])?;
    assert!(info.contains("Extended next hop"), "{info}");
    Ok(())
}

#[test]
fn frr_learns_an_ipv4_vip_with_an_ipv6_next_hop_over_an_ipv6_session_rfc8950() -> Result<()> {
    let topo = topo("v6y")?;
    let rid = router_addr(0);
    let cfg = format!(
        "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
         bgp router-id {rid}\n no bgp ebgp-requires-policy\n no bgp default ipv4-unicast\n \
         neighbor {NODE6} remote-as {NODE_ASN}\n neighbor {NODE6} timers 3 9\n neighbor {NODE6} timers connect 1\n \
         neighbor {NODE6} capability extended-nexthop\n \
         address-family ipv4 unicast\n  neighbor {NODE6} activate\n exit-address-family\n \
         address-family ipv6 unicast\n  neighbor {NODE6} activate\n exit-address-family\n!\n"
    );
    let router = Router::start_frr_with_config(&topo, &cfg, None)?;
    let _s = ipv4_over_an_ipv6_session(&topo, &router)?;
    let out = router.vtysh(&format!("show bgp neighbors {NODE6} json"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let enh = &v[NODE6.to_string()]["neighborCapabilities"]["extendedNexthop"];
    assert_eq!(enh, "advertisedAndReceived", "{v:#}");
    Ok(())
}

/// GoBGP 3.10 on an IPv6 session: IPv6 unicast negotiated, the IPv6 VIP's /128 in its
/// RIB with the node's IPv6 next hop (GoBGP installs nothing in a kernel: its RIB is
/// what it learnt).
#[test]
fn gobgp_learns_an_ipv6_vip_over_an_ipv6_session() -> Result<()> {
    let topo = topo("v6g")?;
    let cfg = format!(
        "[global.config]\n  as = {ROUTER_ASN}\n  router-id = \"{}\"\n  port = 179\n\
         [[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{NODE6}\"\n    peer-as = {NODE_ASN}\n\
         [neighbors.timers.config]\n    hold-time = 9\n    keepalive-interval = 3\n    connect-retry = 1\n\
         [[neighbors.afi-safis]]\n  [neighbors.afi-safis.config]\n    afi-safi-name = \"ipv6-unicast\"\n",
        router_addr(0)
    );
    let router = Router::start_gobgp_with_config(&topo, &cfg)?;
    let mut s = Speaker::start_with_peers(&topo, 0, vec![peer_v6(false)])?;
    s.publish_ip_vips(&[VIP6.into()])?;
    s.wait_established("router-v6", UP)?;
    let started = Instant::now();
    let hops = wait_for("GoBGP's IPv6 RIB to hold the VIP", UP, || {
        let hops = router.gobgp_nexthops6(VIP6)?;
        Ok((!hops.is_empty()).then_some(hops))
    })
    .with_context(|| router.logs())?;
    record(
        router.kind,
        "established to IPv6 VIP in GoBGP's RIB",
        started.elapsed(),
    );
    assert_eq!(hops, vec![NODE6], "GoBGP's next hop of {VIP6}");
    let st = s.status()?;
    assert!(
        st["peers"]["router-v6"]["families"]
            .as_array()
            .is_some_and(|f| f.contains(&"ipv6-unicast".into())),
        "{st:#}"
    );
    s.publish_ip_vips(&[])?;
    wait_for("GoBGP's IPv6 RIB without the VIP", UP, || {
        Ok(router.gobgp_nexthops6(VIP6)?.is_empty().then_some(()))
    })?;
    Ok(())
}
