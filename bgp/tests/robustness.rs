//! A peer that sends malformed messages gets the right NOTIFICATION while the daemon keeps
//! serving its other peers; SIGTERM keeps routes only with graceful restart; metrics.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use common::*;
use juneau_bgp::wire::{self, Capabilities, Message, Open};
use juneau_control::model::PeerConfig;
use juneau_tests::netns::{veth, Netns};

const UP: Duration = Duration::from_secs(60);

/// Runs `f` on a thread that has entered the network namespace `ns`.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::scope(|s| {
        s.spawn(move || {
            let fd = File::open(&path).with_context(|| format!("opening {path}"))?;
            // SAFETY: setns on a namespace fd we own; it only changes this thread's
            // network namespace, and the thread ends when `f` returns.
            let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                bail!("setns({path}): {}", std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .expect("netns thread panicked")
    })
}

/// Reads one whole BGP message.
fn read_msg(s: &mut TcpStream) -> Result<Vec<u8>> {
    let mut hdr = [0u8; 19];
    s.read_exact(&mut hdr).context("reading a BGP header")?;
    let len = u16::from_be_bytes([hdr[16], hdr[17]]) as usize;
    let mut msg = hdr.to_vec();
    msg.resize(len, 0);
    s.read_exact(&mut msg[19..]).context("reading a BGP body")?;
    Ok(msg)
}

const BAD_ASN: u32 = 65099;

/// Connects as a BGP peer, completes the OPEN exchange, then sends `bad` and returns the
/// NOTIFICATION (code, subcode) the daemon answers with.
fn misbehave(
    node: Ipv4Addr,
    bad: &[u8],
    until_established: &(dyn Fn() -> bool + Sync),
) -> Result<(u8, u8)> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::from((node, 179)), Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let open = Open {
        asn: BAD_ASN,
        hold_time: 90,
        router_id: Ipv4Addr::new(10, 0, 9, 1),
        capabilities: Capabilities {
            four_octet_as: Some(BAD_ASN),
            multiprotocol: juneau_bgp::wire::Families::IPV4,
            any: true,
            ..Default::default()
        },
    };
    s.write_all(&wire::encode(&Message::Open(open))?)?;
    let their_open = wire::decode(&read_msg(&mut s)?, Default::default())?;
    assert!(
        matches!(their_open, Message::Open(ref o) if o.asn == NODE_ASN),
        "{their_open:?}"
    );
    s.write_all(&wire::encode(&Message::Keepalive)?)?;
    let start = Instant::now();
    while !until_established() {
        if start.elapsed() > Duration::from_secs(10) {
            bail!("session with the misbehaving peer did not reach Established");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    s.write_all(bad)?;
    loop {
        let m = read_msg(&mut s)?;
        match wire::decode(&m, Default::default())? {
            Message::Notification(n) => {
                // The daemon closes the connection after the NOTIFICATION.
                let mut rest = [0u8; 64];
                let n_read = s.read(&mut rest).unwrap_or(0);
                assert_eq!(n_read, 0, "connection still open after the NOTIFICATION");
                return Ok((n.code, n.subcode));
            }
            // KEEPALIVEs, End-of-RIB, UPDATEs: keep reading.
            _ => continue,
        }
    }
}

#[test]
fn malformed_messages_get_a_notification_and_other_peers_are_unaffected() -> Result<()> {
    let topo = Topo::new("mal", 1)?;
    // The misbehaving peer lives in its own namespace, wired to the node.
    let evil = Netns::new(format!("{}x", topo.prefix))?;
    veth(&evil, "uplink", &topo.nodes[0], "side")?;
    evil.addr("uplink", "10.0.9.1/24")?;
    topo.nodes[0].addr("side", "10.0.9.2/24")?;

    let router = Router::start(
        &topo,
        RouterKind::Bird,
        &[Neighbor {
            node: 0,
            password: None,
        }],
    )?;
    let mut bad_peer =
        PeerConfig::new("misbehaving", Ipv4Addr::new(10, 0, 9, 1), BAD_ASN, NODE_ASN);
    bad_peer.passive = true;
    let mut n0 = Speaker::start_with_peers(
        &topo,
        0,
        vec![Speaker::peer_config(0, &NodePeering::default()), bad_peer],
    )?;
    n0.wait_established("router", UP)?;
    n0.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0)], Duration::from_secs(30))?;

    let marker = [0xffu8; 16];
    let msg = |len: u16, ty: u8, body: &[u8]| {
        let mut v = marker.to_vec();
        v.extend_from_slice(&len.to_be_bytes());
        v.push(ty);
        v.extend_from_slice(body);
        v
    };
    let mut not_synced = msg(19, 4, &[]);
    not_synced[0] = 0;
    let cases: Vec<(&str, Vec<u8>, (u8, u8))> = vec![
        ("marker not all ones", not_synced, (1, 1)),
        ("unknown message type", msg(19, 42, &[]), (1, 3)),
        ("KEEPALIVE with a body", msg(20, 4, &[0]), (1, 2)),
        (
            "UPDATE withdrawn length overruns",
            msg(23, 2, &[0, 200, 0, 0]),
            (3, 1),
        ),
        (
            "UPDATE NLRI prefix length 40",
            msg(28, 2, &[0, 0, 0, 0, 40, 1, 2, 3, 4]),
            (3, 10),
        ),
    ];
    let flaps_before = n0.status()?["peers"]["router"]["session_flaps"].clone();
    for (what, bytes, want) in cases {
        let status_path = n0.status_path.clone();
        let established = move || {
            std::fs::read(&status_path)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .map(|v| v["peers"]["misbehaving"]["state"] == "Established")
                .unwrap_or(false)
        };
        let got = wait_for(&format!("a NOTIFICATION for {what}"), UP, || {
            // The daemon may still be in its idle-hold backoff from the previous case.
            match in_netns(evil.name(), || {
                misbehave(Ipv4Addr::new(10, 0, 9, 2), &bytes, &established)
            }) {
                Ok(v) => Ok(Some(v)),
                Err(e) => Err(e),
            }
        })
        .with_context(|| n0.logs())?;
        assert_eq!(got, want, "{what}");
        println!("{what}: NOTIFICATION {}/{}", got.0, got.1);
        // The router's session and route are untouched.
        assert_eq!(n0.peer_state("router")?, "Established");
        assert_eq!(router.bgp_nexthops(VIP)?, vec![node_addr(0)]);
    }
    assert_eq!(
        n0.status()?["peers"]["router"]["session_flaps"],
        flaps_before
    );
    assert!(n0.status()?["peers"]["misbehaving"]["last_error"]
        .as_str()
        .is_some());

    // Prometheus metrics, as scraped inside the node's namespace.
    let metrics = in_netns(topo.nodes[0].name(), || {
        let mut s = TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], 9179)),
            Duration::from_secs(5),
        )?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    })?;
    for want in [
        "juneau_bgp_peer_up{peer=\"router\"} 1",
        "juneau_bgp_prefixes_announced{peer=\"router\"} 1",
        "juneau_bgp_peer_state{peer=\"router\",state=\"Established\"} 1",
        "juneau_bgp_session_flaps_total{peer=\"router\"} 0",
    ] {
        assert!(metrics.contains(want), "metrics lack {want}:\n{metrics}");
    }

    // And the daemon still reacts to the control state for the good peer.
    n0.publish_vips(&[])?;
    router.wait_nexthops(VIP, &[], Duration::from_secs(30))?;
    Ok(())
}

/// SIGTERM: with graceful restart negotiated the daemon closes without a NOTIFICATION and
/// the router keeps the route; without it, it sends Cease and the route goes.
#[test]
fn sigterm_keeps_routes_only_with_graceful_restart() -> Result<()> {
    let topo = Topo::new("trm", 2)?;
    let router = Router::start(
        &topo,
        RouterKind::Bird,
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
    let mut gr = Speaker::start(&topo, 0, &NodePeering::default())?;
    let mut plain = Speaker::start(
        &topo,
        1,
        &NodePeering {
            graceful_restart: false,
            ..Default::default()
        },
    )?;
    gr.wait_established("router", UP)?;
    plain.wait_established("router", UP)?;
    gr.publish_vips(&[VIP])?;
    plain.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0), node_addr(1)], Duration::from_secs(30))?;
    gr.terminate()?;
    plain.terminate()?;
    router.wait_nexthops(VIP, &[node_addr(0)], Duration::from_secs(30))?;
    for _ in 0..20 {
        assert_eq!(
            router.bgp_nexthops(VIP)?,
            vec![node_addr(0)],
            "graceful-restart route lost after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let bird_log = router.full_log();
    assert!(
        bird_log.contains("node1: Received: Administrative shutdown"),
        "{bird_log}"
    );
    assert!(!bird_log.contains("node0: Received:"), "{bird_log}");
    Ok(())
}

/// The speaker's own reaction time: from publishing the control state to the UPDATE
/// arriving at a peer (the test is the peer, so no router processing is included).
#[test]
fn reaction_time_from_publish_to_update_on_the_wire() -> Result<()> {
    let topo = Topo::new("rt", 1)?;
    let evil = Netns::new(format!("{}x", topo.prefix))?;
    veth(&evil, "uplink", &topo.nodes[0], "side")?;
    evil.addr("uplink", "10.0.9.1/24")?;
    topo.nodes[0].addr("side", "10.0.9.2/24")?;
    let mut peer = PeerConfig::new("probe", Ipv4Addr::new(10, 0, 9, 1), BAD_ASN, NODE_ASN);
    peer.passive = true;
    let mut n0 = Speaker::start_with_peers(&topo, 0, vec![peer])?;
    let status_path = n0.status_path.clone();
    let established = move || {
        std::fs::read(&status_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .map(|v| v["peers"]["probe"]["state"] == "Established")
            .unwrap_or(false)
    };
    // Connect as the peer (retrying until the daemon listens), then publish from this
    // thread while the peer thread times the UPDATEs.
    let (got_tx, got_rx) = std::sync::mpsc::channel::<(usize, usize, Instant)>();
    let evil_name = evil.name().to_string();
    let peer_thread = std::thread::spawn(move || -> Result<()> {
        in_netns(&evil_name, || {
            let mut s = wait_for("the daemon to accept", UP, || {
                Ok(TcpStream::connect_timeout(
                    &SocketAddr::from(([10, 0, 9, 2], 179)),
                    Duration::from_secs(2),
                )
                .ok())
            })?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            let open = Open {
                asn: BAD_ASN,
                hold_time: 90,
                router_id: Ipv4Addr::new(10, 0, 9, 1),
                capabilities: Capabilities {
                    four_octet_as: Some(BAD_ASN),
                    multiprotocol: juneau_bgp::wire::Families::IPV4,
                    any: true,
                    ..Default::default()
                },
            };
            s.write_all(&wire::encode(&Message::Open(open))?)?;
            read_msg(&mut s)?;
            s.write_all(&wire::encode(&Message::Keepalive)?)?;
            for _ in 0..2 {
                loop {
                    let m = read_msg(&mut s)?;
                    if let Message::Update(u) = wire::decode(&m, Default::default())? {
                        if !u.is_end_of_rib() {
                            got_tx.send((u.announced.len(), u.withdrawn.len(), Instant::now()))?;
                            break;
                        }
                    }
                }
            }
            Ok(())
        })
    });
    wait_for("the probe session", UP, || Ok(established().then_some(())))?;
    // Timed from the start of publish() (which also builds the Maglev tables and wakes
    // readers before it returns) to arrival at the peer.
    let t0 = Instant::now();
    n0.publish_vips(&[VIP])?;
    let p0 = t0.elapsed();
    let (ann, _, t1) = got_rx.recv_timeout(Duration::from_secs(30))?;
    assert_eq!(ann, 1);
    let t2 = Instant::now();
    n0.publish_vips(&[])?;
    let p2 = t2.elapsed();
    let (_, wd, t3) = got_rx.recv_timeout(Duration::from_secs(30))?;
    assert_eq!(wd, 1);
    peer_thread.join().expect("peer thread")?;
    println!(
        "publish start -> UPDATE on the wire: announce {:?} (publish() itself {p0:?}), withdraw {:?} (publish() itself {p2:?})",
        t1 - t0,
        t3 - t2
    );
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bgp-convergence.tsv");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(
            f,
            "speaker\tannounce (publish start to UPDATE on the wire)\t{:.1}",
            (t1 - t0).as_secs_f64() * 1e3
        );
        let _ = writeln!(
            f,
            "speaker\twithdraw (publish start to UPDATE on the wire)\t{:.1}",
            (t3 - t2).as_secs_f64() * 1e3
        );
    }
    Ok(())
}
