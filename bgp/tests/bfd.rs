//! BFD interop: juneau-bgp's BFD (RFC 5880/5881) against BIRD 2's and FRR's bfdd, in
//! network namespaces. Sessions come up, and when the link dies (nftables drops every
//! packet of the node) both sides declare the session down within the detection time
//! (300 ms x 3) and the router withdraws the node's route at once, instead of after the
//! 9 s hold time. Measurements go to `$CARGO_TARGET_TMPDIR/bgp-convergence.tsv`.

mod common;

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use common::*;
use juneau_control::model::BfdSettings;
use juneau_tests::bird::{BgpNeighbor, BirdConfig};
use juneau_tests::netns::Netns;

const UP: Duration = Duration::from_secs(60);
/// 300 ms x 3, the detection time both sides agree on.
const DETECTION: Duration = Duration::from_millis(900);
/// What a test asserts: the detection time plus generous room for a loaded CI machine,
/// still far below the 9 s hold time that would withdraw the route without BFD.
const BOUND: Duration = Duration::from_millis(2500);

fn bfd_peer(node: usize) -> juneau_control::model::PeerConfig {
    let mut pc = Speaker::peer_config(node, &NodePeering::default());
    pc.bfd = Some(BfdSettings {
        min_rx_ms: 300,
        min_tx_ms: 300,
        multiplier: 3,
    });
    pc
}

/// BIRD with BFD at 300 ms x 3 on its link to node 0 and one neighbour, node 0, as
/// `neighbor` makes it (the caller turns BFD on for the session).
fn bird_bfd_config(neighbor: impl FnOnce(BgpNeighbor) -> BgpNeighbor) -> BirdConfig {
    BirdConfig::new(router_addr(0))
        .bfd("d0", 300, 300, 3)
        .bgp(&neighbor(BgpNeighbor::new(
            "node0",
            router_addr(0),
            ROUTER_ASN,
            node_addr(0),
            NODE_ASN,
        )))
}

/// Drops every packet in and out of the namespace (the link is dead for IP, the veth
/// stays up so nothing but BFD or the hold timer can notice).
pub fn cut(ns: &Netns) -> Result<()> {
    ns.exec(&["nft", "add", "table", "inet", "juneau_cut"])?;
    for hook in ["input", "output"] {
        ns.exec(&[
            "nft",
            &format!("add chain inet juneau_cut {hook} {{ type filter hook {hook} priority -300; policy drop; }}"),
        ])?;
    }
    Ok(())
}

pub fn heal(ns: &Netns) -> Result<()> {
    ns.exec(&["nft", "delete", "table", "inet", "juneau_cut"])?;
    Ok(())
}

fn our_bfd_state(s: &Speaker) -> Result<String> {
    Ok(s.status()?["peers"]["router"]["bfd"]["state"]
        .as_str()
        .unwrap_or("")
        .to_string())
}

/// Waits for BFD Up on both sides.
fn wait_bfd_up(s: &Speaker, router_up: impl Fn() -> Result<bool>) -> Result<()> {
    wait_for("our BFD session Up", UP, || {
        Ok((our_bfd_state(s)? == "Up").then_some(()))
    })
    .map_err(|e| e.context(s.logs()))?;
    wait_for("the router's BFD session Up", UP, || {
        Ok(router_up()?.then_some(()))
    })?;
    Ok(())
}

/// Whether BIRD shows its BFD session with node 0 Up.
fn bird_bfd_up(router: &Router) -> Result<bool> {
    Ok(router
        .bird_cli(&["show", "bfd", "sessions"])?
        .lines()
        .any(|l| l.starts_with(&node_addr(0).to_string()) && l.contains(" Up ")))
}

/// Cuts the link and measures (ours Down, router withdrew) from the cut.
fn cut_and_measure(
    topo: &Topo,
    s: &Speaker,
    router: &Router,
    kind: RouterKind,
) -> Result<(Duration, Duration)> {
    let t0 = Instant::now();
    cut(&topo.nodes[0])?;
    let (mut ours, mut theirs) = (None, None);
    while ours.is_none() || theirs.is_none() {
        if t0.elapsed() > Duration::from_secs(15) {
            bail!(
                "after 15 s: ours down {ours:?}, router withdrew {theirs:?}\n{}\n{}",
                s.logs(),
                router.logs()
            );
        }
        if ours.is_none() && our_bfd_state(s)? == "Down" {
            ours = Some(t0.elapsed());
        }
        if theirs.is_none() && router.bgp_nexthops(VIP)?.is_empty() {
            theirs = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (ours, theirs) = (ours.unwrap(), theirs.unwrap());
    record(kind, "bfd: link cut -> juneau-bgp BFD Down", ours);
    record(
        kind,
        "bfd: link cut -> route withdrawn by the router",
        theirs,
    );
    // BFD Down tears the BGP session down a moment later, and the status file is
    // written after that: wait for it rather than read it once.
    let torn_down = wait_for(
        "the BGP session torn down by BFD",
        Duration::from_secs(10),
        || {
            let p = s.status()?["peers"]["router"].clone();
            let by_bfd = p["last_error"]
                .as_str()
                .unwrap_or("")
                .contains("BFD session down");
            Ok(by_bfd.then_some(p))
        },
    );
    let p = torn_down.map_err(|e| e.context(s.logs()))?;
    assert_eq!(p["bfd"]["diag"], "control detection time expired", "{p}");
    assert!(
        ours <= BOUND && theirs <= BOUND,
        "{kind:?}: detection {ours:?} / withdrawal {theirs:?}, want about {DETECTION:?}"
    );
    Ok((ours, theirs))
}

#[test]
fn bfd_with_bird_detects_a_dead_link_within_the_detection_time() -> Result<()> {
    let topo = Topo::new("bfdb", 1)?;
    let router =
        Router::start_bird_with_config(&topo, &bird_bfd_config(BgpNeighbor::bfd).render())?;
    let mut s = Speaker::start_with_peers(&topo, 0, vec![bfd_peer(0)])?;
    s.publish_vips(&[VIP])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    wait_bfd_up(&s, || bird_bfd_up(&router))?;
    // It stays Up (no flap once the timers went fast).
    std::thread::sleep(Duration::from_secs(3));
    let st = s.status()?;
    assert_eq!(st["peers"]["router"]["bfd"]["state"], "Up", "{st}");
    assert_eq!(st["peers"]["router"]["bfd"]["down_events"], 0, "{st}");
    assert_eq!(st["peers"]["router"]["bfd"]["detection_time_ms"], 900);

    let (ours, theirs) = cut_and_measure(&topo, &s, &router, RouterKind::Bird)?;
    println!("BIRD: ours {ours:?}, withdrawn {theirs:?}");

    // The path heals: BFD and BGP come back, the route returns.
    heal(&topo.nodes[0])?;
    wait_bfd_up(&s, || {
        Ok(router
            .bird_cli(&["show", "bfd", "sessions"])?
            .contains(" Up "))
    })?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    Ok(())
}

#[test]
fn bfd_with_frr_detects_a_dead_link_within_the_detection_time() -> Result<()> {
    let topo = Topo::new("bfdf", 1)?;
    let rid = router_addr(0);
    let n = node_addr(0);
    let router = Router::start_frr_with_config(
        &topo,
        &format!(
            "frr defaults traditional\nhostname router\nlog stdout debugging\n!\n\
             router bgp {ROUTER_ASN}\n bgp router-id {rid}\n no bgp ebgp-requires-policy\n \
             neighbor {n} remote-as {NODE_ASN}\n neighbor {n} timers 3 9\n neighbor {n} timers connect 1\n \
             neighbor {n} bfd profile fast\n!\n"
        ),
        Some(
            "hostname router\nlog stdout debugging\n!\nbfd\n profile fast\n  receive-interval 300\n  \
             transmit-interval 300\n  detect-multiplier 3\n !\n!\n",
        ),
    )?;
    let mut s = Speaker::start_with_peers(&topo, 0, vec![bfd_peer(0)])?;
    s.publish_vips(&[VIP])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    let frr_up = || -> Result<bool> {
        let out = router.vtysh("show bfd peers json")?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .any(|p| p["peer"] == n.to_string() && p["status"] == "up"))
    };
    wait_bfd_up(&s, frr_up)?;
    let out = router.vtysh("show bfd peers json")?;
    println!("FRR BFD peers: {out}");

    let (ours, theirs) = cut_and_measure(&topo, &s, &router, RouterKind::Frr)?;
    println!("FRR: ours {ours:?}, withdrawn {theirs:?}");

    heal(&topo.nodes[0])?;
    wait_bfd_up(&s, frr_up)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    Ok(())
}

/// The defaults (graceful restart 120 s + BFD 300 ms x 3 run by juneau-bfd, apart from
/// the speaker) against BIRD with `graceful restart on; bfd on;`:
/// 1. `kill -9` of juneau-bgp and a restart 1 s later: BFD stays Up, the router keeps
///    the route the whole time (graceful restart), nothing is withdrawn;
/// 2. juneau-bfd and juneau-bgp stopped with SIGTERM (a pod replaced on upgrade) and
///    started again 2 s later: juneau-bfd held its session, the new one resumes it, BIRD's
///    BFD never goes down and the route stays;
/// 3. the node's link dies: the route is withdrawn within the BFD detection time.
#[test]
fn defaults_keep_routes_over_restarts_and_withdraw_a_dead_node_with_bird() -> Result<()> {
    let topo = Topo::new("bfdgr", 1)?;
    let router = Router::start_bird_with_config(
        &topo,
        &bird_bfd_config(|n| n.graceful_restart(120).bfd().debug_states()).render(),
    )?;
    let bfd_file = topo.dir.path().join("node0.bfd.json");
    let mut s = Speaker::start_with_args(
        &topo,
        0,
        vec![bfd_peer(0)],
        &["--bfd-status-file", bfd_file.to_str().unwrap()],
    )?;
    let bfdd = s.start_bfd(&topo.nodes[0])?;
    s.publish_vips(&[VIP])?;
    s.wait_established("router", UP)?;
    router.wait_nexthops(VIP, &[node_addr(0)], UP)?;
    wait_bfd_up(&s, || bird_bfd_up(&router)).map_err(|e| e.context(bfdd.logs()))?;
    wait_for("graceful restart negotiated", UP, || {
        Ok((s.status()?["peers"]["router"]["graceful_restart"] == true).then_some(()))
    })?;

    // Watches the router's route (and its BFD session) until `until` holds.
    let route_kept_until = |what: &str, until: &dyn Fn() -> Result<bool>| -> Result<()> {
        let t0 = Instant::now();
        loop {
            if router.bgp_nexthops(VIP)? != vec![node_addr(0)] {
                bail!(
                    "{what}: the router lost the route after {:?}\n{}",
                    t0.elapsed(),
                    router.logs()
                );
            }
            if until()? {
                return Ok(());
            }
            if t0.elapsed() > UP {
                bail!("{what}: not back after {UP:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };

    // 1. Speaker crash and restart 1 s later.
    s.kill();
    let killed = Instant::now();
    route_kept_until("juneau-bgp killed", &|| {
        Ok(killed.elapsed() >= Duration::from_secs(1))
    })?;
    assert!(
        bird_bfd_up(&router)?,
        "BFD stayed Up while juneau-bgp was dead"
    );
    std::fs::remove_file(&s.status_path)?;
    s.spawn(&topo.nodes[0])?;
    route_kept_until("juneau-bgp restarted", &|| {
        Ok(s.peer_state("router").unwrap_or_default() == "Established"
            && killed.elapsed() > Duration::from_secs(4))
    })?;
    assert!(bird_bfd_up(&router)?, "BFD never went down");
    let info = router.bird_protocol_info("node0")?;
    assert!(info.contains("Established"), "{info}");

    // 2. Both replaced (SIGTERM, back 2 s later), as on an upgrade of the pod: juneau-bfd
    //    holds its session (slow rate via a Poll), the next one resumes it.
    let mut bfdd = bfdd;
    bfdd.terminate()?;
    s.terminate()?;
    let stopped = Instant::now();
    route_kept_until("juneau-bfd and juneau-bgp stopped", &|| {
        Ok(stopped.elapsed() >= Duration::from_secs(2))
    })?;
    assert!(
        bird_bfd_up(&router)?,
        "BIRD kept the BFD session Up while juneau-bfd was away"
    );
    let bfdd = s.start_bfd(&topo.nodes[0])?;
    std::fs::remove_file(&s.status_path)?;
    s.spawn(&topo.nodes[0])?;
    route_kept_until("juneau-bfd and juneau-bgp restarted", &|| {
        Ok(s.peer_state("router").unwrap_or_default() == "Established"
            && stopped.elapsed() > Duration::from_secs(5))
    })
    .map_err(|e| e.context(bfdd.logs()))?;
    assert!(
        bfdd.logs().contains("resumed after a restart"),
        "{}",
        bfdd.logs()
    );
    assert!(
        !router.full_log().contains("BFD session down"),
        "BIRD never saw BFD go down:\n{}",
        router.logs()
    );
    // The fast rate is back: BIRD's detection time of us is 900 ms again.
    wait_for("BIRD back at the fast rate", UP, || {
        let out = router.bird_cli(&["show", "bfd", "sessions"])?;
        Ok(out.contains("0.300").then_some(()))
    })?;

    // 3. The node dies (its link drops everything): withdrawn within the detection time.
    let t0 = Instant::now();
    cut(&topo.nodes[0])?;
    wait_for(
        "the router to withdraw the dead node",
        Duration::from_secs(15),
        || Ok(router.bgp_nexthops(VIP)?.is_empty().then_some(())),
    )?;
    let took = t0.elapsed();
    record(
        RouterKind::Bird,
        "defaults: node link cut -> route withdrawn",
        took,
    );
    assert!(
        took <= BOUND,
        "withdrawn after {took:?}, want about {DETECTION:?}"
    );
    drop(bfdd);
    Ok(())
}

/// Sends `count` BFD packets from the router's namespace as if from the router (its
/// address, any port) to node 0's single-hop port, with IP TTL `ttl`.
fn inject(topo: &Topo, packet: juneau_bgp::bfd::Packet, ttl: u32, count: usize) {
    let bytes = packet.encode();
    juneau_tests::netns::in_ns(topo.router.name(), move || {
        let s = std::net::UdpSocket::bind((router_addr(0), 0)).expect("bind in the router ns");
        s.set_ttl(ttl).unwrap();
        for _ in 0..count {
            s.send_to(&bytes, (node_addr(0), juneau_bgp::bfd::PORT_SINGLE_HOP))
                .expect("send");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
}

/// Our BFD session stays Up, with no Down in between, for `d`.
fn stays_up(s: &Speaker, d: Duration, what: &str) -> Result<()> {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        let st = s.status()?;
        let bfd = &st["peers"]["router"]["bfd"];
        if bfd["state"] != "Up" || bfd["down_events"] != 0 {
            bail!("{what}: our session {bfd}\n{}", s.logs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Issue #25: spoofed control packets against an Up session with BIRD. A "Down" with Your
/// Discriminator 0 and a made-up My Discriminator (what a spoofer who sees no traffic
/// sends) and a perfect forgery from beyond the link (TTL 64: GTSM) leave it Up; the same
/// forgery with TTL 255 (an attacker on the link who reads the discriminators) takes it
/// down, which shows the packets do reach the session.
#[test]
fn bfd_with_bird_ignores_spoofed_packets() -> Result<()> {
    use juneau_bgp::bfd::{BfdState, Diag, Packet};
    let topo = Topo::new("bfds", 1)?;
    let router =
        Router::start_bird_with_config(&topo, &bird_bfd_config(BgpNeighbor::bfd).render())?;
    let s = Speaker::start_with_peers(&topo, 0, vec![bfd_peer(0)])?;
    s.wait_established("router", UP)?;
    wait_bfd_up(&s, || bird_bfd_up(&router))?;
    stays_up(&s, Duration::from_secs(2), "before any spoofing")?;
    let bfd = s.status()?["peers"]["router"]["bfd"].clone();
    let ours = bfd["local_discriminator"].as_u64().unwrap() as u32;
    let bird = bfd["remote_discriminator"].as_u64().unwrap() as u32;
    let down = |my: u32, your: u32| Packet {
        diag: Diag::None,
        state: BfdState::Down,
        poll: false,
        final_: false,
        control_plane_independent: false,
        demand: false,
        detect_mult: 3,
        my_disc: my,
        your_disc: your,
        desired_min_tx_us: 300_000,
        required_min_rx_us: 300_000,
        required_min_echo_rx_us: 0,
    };

    inject(&topo, down(bird.wrapping_add(7), 0), 255, 10);
    stays_up(
        &s,
        Duration::from_secs(1),
        "Down, your 0, a stranger's discriminator",
    )?;
    inject(&topo, down(bird.wrapping_add(7), ours), 255, 10);
    stays_up(
        &s,
        Duration::from_secs(1),
        "Down, ours, a stranger's discriminator",
    )?;
    inject(&topo, down(bird, ours), 64, 10);
    stays_up(&s, Duration::from_secs(1), "a perfect forgery with TTL 64")?;

    // BIRD may bring the session back Up before a status read sees it Down: the Down is
    // read from the count of Up sessions that went down, and its reason from the log.
    inject(&topo, down(bird, ours), 255, 1);
    wait_for("our session to go Down", Duration::from_secs(5), || {
        let st = s.status()?;
        Ok((st["peers"]["router"]["bfd"]["down_events"] != 0).then_some(()))
    })?;
    let logs = s.logs();
    assert!(
        logs.contains("BFD session down: neighbor signaled session down"),
        "the session went down for another reason:\n{logs}"
    );
    Ok(())
}

// ---- Authentication (RFC 5880 6.7.3/6.7.4) against BIRD 2 ----
//
// Debian's FRR (bfdd 8.4.4) has no BFD authentication, so these run against BIRD only
// (docs/security.md).

/// Key and Key ID both sides use, unless a test says otherwise.
const BFD_KEY: &str = "juneau-bfd-key";
const BFD_KEY_ID: u8 = 7;

fn auth_peer(kind: juneau_control::model::BfdAuthType) -> juneau_control::model::PeerConfig {
    let mut pc = bfd_peer(0);
    pc.bfd_auth = Some(juneau_control::model::BfdAuth {
        auth_type: kind,
        key_id: BFD_KEY_ID,
        key: BFD_KEY.into(),
    });
    pc
}

/// BIRD with authenticated BFD (`authentication [meticulous] keyed sha1`) with `key`.
fn bird_auth_config(meticulous: bool, key: &str) -> String {
    bird_auth_config_with(meticulous, key, |n| n)
}

fn bird_auth_config_with(
    meticulous: bool,
    key: &str,
    neighbor: impl FnOnce(BgpNeighbor) -> BgpNeighbor,
) -> String {
    let mode = if meticulous {
        "meticulous keyed sha1"
    } else {
        "keyed sha1"
    };
    BirdConfig::new(router_addr(0))
        .raw(&format!(
            "protocol bfd {{ interface \"d0\" {{ min rx interval 300 ms; min tx interval 300 ms; multiplier 3; \
             authentication {mode}; password \"{key}\" {{ id {BFD_KEY_ID}; }}; }}; }}"
        ))
        .bgp(&neighbor(
            BgpNeighbor::new("node0", router_addr(0), ROUTER_ASN, node_addr(0), NODE_ASN).bfd(),
        ))
        .render()
}

/// Sends `count` datagrams of `bytes` from the router's address to node 0's single-hop
/// port with TTL 255 (an attacker on the link).
fn inject_bytes(topo: &Topo, bytes: Vec<u8>, count: usize) {
    juneau_tests::netns::in_ns(topo.router.name(), move || {
        let s = std::net::UdpSocket::bind((router_addr(0), 0)).expect("bind in the router ns");
        s.set_ttl(255).unwrap();
        for _ in 0..count {
            s.send_to(&bytes, (node_addr(0), juneau_bgp::bfd::PORT_SINGLE_HOP))
                .expect("send");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
}

fn auth_failures(s: &Speaker) -> Result<u64> {
    Ok(s.status()?["peers"]["router"]["bfd"]["auth_failures"]
        .as_u64()
        .unwrap_or(0))
}

/// Session Up with BIRD under `kind`; then the perfect forgery (both discriminators right,
/// TTL 255: it took an unauthenticated session down in `bfd_with_bird_ignores_spoofed_packets`)
/// without the key, and with a guessed key, leave it Up and are counted.
fn authenticated_session_with_bird(
    name: &str,
    kind: juneau_control::model::BfdAuthType,
) -> Result<()> {
    use juneau_bgp::bfd::{Auth, AuthType, BfdState, Diag, Packet};
    let meticulous = kind == juneau_control::model::BfdAuthType::MeticulousKeyedSha1;
    let topo = Topo::new(name, 1)?;
    let router = Router::start_bird_with_config(&topo, &bird_auth_config(meticulous, BFD_KEY))?;
    let s = Speaker::start_with_peers(&topo, 0, vec![auth_peer(kind)])?;
    s.wait_established("router", UP)?;
    wait_bfd_up(&s, || bird_bfd_up(&router)).map_err(|e| e.context(router.logs()))?;
    stays_up(&s, Duration::from_secs(3), "authenticated, no spoofing")?;
    let bfd = s.status()?["peers"]["router"]["bfd"].clone();
    let want = if meticulous {
        "meticulous keyed SHA1"
    } else {
        "keyed SHA1"
    };
    assert_eq!(bfd["authentication"], want, "{bfd}");
    assert_eq!(bfd["auth_failures"], 0, "{bfd}");
    let ours = bfd["local_discriminator"].as_u64().unwrap() as u32;
    let bird = bfd["remote_discriminator"].as_u64().unwrap() as u32;
    let down = Packet {
        diag: Diag::None,
        state: BfdState::Down,
        poll: false,
        final_: false,
        control_plane_independent: false,
        demand: false,
        detect_mult: 3,
        my_disc: bird,
        your_disc: ours,
        desired_min_tx_us: 300_000,
        required_min_rx_us: 300_000,
        required_min_echo_rx_us: 0,
    };
    inject_bytes(&topo, down.encode().to_vec(), 10);
    stays_up(
        &s,
        Duration::from_secs(1),
        "an unauthenticated perfect forgery",
    )?;
    let auth_type = if meticulous {
        AuthType::MeticulousKeyedSha1
    } else {
        AuthType::KeyedSha1
    };
    let guess = Auth::new(auth_type, BFD_KEY_ID, "guessed-key".into())?;
    for seq in 0..10u32 {
        inject_bytes(&topo, down.encode_sha1(&guess, seq).to_vec(), 1);
    }
    stays_up(&s, Duration::from_secs(2), "a forgery with a guessed key")?;
    wait_for("20 failures counted", Duration::from_secs(5), || {
        Ok((auth_failures(&s)? >= 20).then_some(()))
    })?;
    assert!(bird_bfd_up(&router)?, "BIRD's session stayed Up");
    Ok(())
}

#[test]
fn bfd_keyed_sha1_with_bird() -> Result<()> {
    authenticated_session_with_bird("bfdak", juneau_control::model::BfdAuthType::KeyedSha1)
}

#[test]
fn bfd_meticulous_keyed_sha1_with_bird() -> Result<()> {
    authenticated_session_with_bird(
        "bfdam",
        juneau_control::model::BfdAuthType::MeticulousKeyedSha1,
    )
}

/// BIRD with another key: neither side comes Up, our side counts BIRD's packets as
/// authentication failures; the BGP session itself is unaffected.
#[test]
fn bfd_with_a_wrong_key_stays_down_with_bird() -> Result<()> {
    let topo = Topo::new("bfdaw", 1)?;
    let router = Router::start_bird_with_config(&topo, &bird_auth_config(true, "not-our-key"))?;
    let s = Speaker::start_with_peers(
        &topo,
        0,
        vec![auth_peer(
            juneau_control::model::BfdAuthType::MeticulousKeyedSha1,
        )],
    )?;
    s.wait_established("router", UP)?;
    wait_for("BIRD's packets counted", UP, || {
        Ok((auth_failures(&s)? >= 5).then_some(()))
    })
    .map_err(|e| e.context(s.logs()))?;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        assert_ne!(our_bfd_state(&s)?, "Up");
        assert!(!bird_bfd_up(&router)?, "BIRD's session Up with a wrong key");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        router.full_log().to_lowercase().contains("auth"),
        "BIRD says why:\n{}",
        router.logs()
    );
    Ok(())
}

/// juneau-bfd replaced (SIGTERM, back 2 s later) on a meticulous keyed SHA1 session with
/// BIRD: the held session's next sequence number is in the status file, the new process
/// continues from it, and BIRD (which refuses a number that does not grow) never sees the
/// session go down.
#[test]
fn a_held_meticulous_session_survives_a_juneau_bfd_restart_with_bird() -> Result<()> {
    let topo = Topo::new("bfdar", 1)?;
    let router = Router::start_bird_with_config(
        &topo,
        &bird_auth_config_with(true, BFD_KEY, |n| n.debug_states()),
    )?;
    let bfd_file = topo.dir.path().join("node0.bfd.json");
    let s = Speaker::start_with_args(
        &topo,
        0,
        vec![auth_peer(
            juneau_control::model::BfdAuthType::MeticulousKeyedSha1,
        )],
        &["--bfd-status-file", bfd_file.to_str().unwrap()],
    )?;
    let mut bfdd = s.start_bfd(&topo.nodes[0])?;
    s.wait_established("router", UP)?;
    wait_bfd_up(&s, || bird_bfd_up(&router)).map_err(|e| e.context(bfdd.logs()))?;
    std::thread::sleep(Duration::from_secs(2));
    bfdd.terminate()?;
    let held: serde_json::Value = serde_json::from_slice(&std::fs::read(&bfd_file)?)?;
    assert!(
        held["sessions"]["router"]["next_auth_seq"].is_u64(),
        "{held}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(bird_bfd_up(&router)?, "BIRD held the session");
    let bfdd = s.start_bfd(&topo.nodes[0])?;
    wait_for("the session resumed", UP, || {
        Ok(bfdd
            .logs()
            .contains("resumed after a restart")
            .then_some(()))
    })?;
    // Long enough for BIRD to time out a session whose packets it discards (3 x 300 ms
    // once the fast rate is back, 3 x 20 s before: wait for the fast rate).
    wait_for("BIRD back at the fast rate", UP, || {
        let out = router.bird_cli(&["show", "bfd", "sessions"])?;
        Ok(out.contains("0.300").then_some(()))
    })
    .map_err(|e| e.context(router.logs()))?;
    std::thread::sleep(Duration::from_secs(2));
    assert!(bird_bfd_up(&router)?, "{}", router.logs());
    let log = router.full_log();
    assert!(
        !log.contains("BFD session down"),
        "BIRD saw BFD go down:\n{log}"
    );
    assert!(
        !log.to_lowercase().contains("auth"),
        "BIRD refused a packet:\n{log}"
    );
    let st = s.status()?;
    assert_eq!(st["peers"]["router"]["bfd"]["state"], "Up", "{st}");
    assert_eq!(st["peers"]["router"]["bfd"]["auth_failures"], 0, "{st}");
    drop(bfdd);
    Ok(())
}
