//! IPv6 redirects between engines standing for nodes: the question, the owner serving
//! it, the notice, the record and the packets following it uncharged; a SYN handed on;
//! refusals by name. The frames between the nodes are the real wire bytes.

use super::*;
use crate::engine::EngineConfig;
use crate::flow::FlowState;
use crate::neigh::{Iface, Route, Route6};
use crate::packet::MacAddr;
use crate::packet6::parse6;
use crate::packet6::tests::{frame, upper};
use crate::redirect::{Notice, RedirectConfig, Redirector, DEFAULT_PORT};
use crate::services6::{Backend6, Service6, Services6};

const NODES: [u32; 3] = [0x0a01_0001, 0x0a01_0002, 0x0a01_0003];
const SYN: u8 = tcp_flags::SYN;
const ACK: u8 = tcp_flags::ACK;

fn ip(s: &str) -> [u8; 16] {
    s.parse::<std::net::Ipv6Addr>().unwrap().octets()
}
fn vip() -> [u8; 16] {
    ip("2001:db8:71::10")
}
fn client() -> [u8; 16] {
    ip("2001:db8:c::42")
}
/// Node `i`'s Pod.
fn pod(i: usize) -> [u8; 16] {
    let mut a = ip("fd00:10::");
    a[5] = i as u8 + 1;
    a[15] = 2;
    a
}

fn nb() -> Neighbours {
    let up = Iface {
        ifindex: 2,
        mac: MacAddr([0xa; 6]),
    };
    let pods = Iface {
        ifindex: 5,
        mac: MacAddr([0xb; 6]),
    };
    let mut n = Neighbours::new(up, vec![pods]);
    n.add_route(Route {
        prefix: 0x0a01_0000,
        len: 16,
        gateway: None,
        ifindex: 2,
    });
    for (i, a) in NODES.iter().enumerate() {
        n.add_neighbour(*a, 2, MacAddr([4, 0, 0, 0, 0, i as u8]));
    }
    n.add_route6(Route6 {
        prefix: 0,
        len: 0,
        gateway: Some(u128::from_be_bytes(ip("fe80::1"))),
        ifindex: 2,
    });
    n.add_neighbour6(ip("fe80::1"), 2, MacAddr([1; 6]));
    n.add_route6(Route6 {
        prefix: u128::from_be_bytes(ip("fd00:10::")),
        len: 32,
        gateway: None,
        ifindex: 5,
    });
    for i in 0..3 {
        n.add_neighbour6(pod(i), 5, MacAddr([6, 0, 0, 0, 0, i as u8]));
    }
    n
}

/// Node `i` of two: the IPv6 VIP's TCP/80 and UDP/53 with its own Pod as backend
/// (`has_backend`), handing flows on (`hand_off`); redirects to the other nodes with
/// `rate` tokens per second (and as burst) for unknown flows.
fn node(i: usize, has_backend: bool, hand_off: bool, rate: u32) -> Engine {
    node_of(i, 2, has_backend, hand_off, rate)
}

/// As [`node`], one of `n` nodes.
fn node_of(i: usize, n: usize, has_backend: bool, hand_off: bool, rate: u32) -> Engine {
    let mut e = Engine::new(EngineConfig {
        flow_capacity: 64,
        flow6_capacity: 64,
        ..Default::default()
    });
    let service = |proto, port| Service6 {
        vip: vip(),
        proto,
        port,
        backends: if has_backend {
            vec![Backend6 {
                ip: pod(i),
                port: 8080,
            }]
        } else {
            vec![]
        },
        ready: usize::from(has_backend),
        maglev: vec![if has_backend { 0 } else { u16::MAX }; 251],
        source_ranges: vec![],
        client_ip_affinity_ms: None,
        hand_off,
    };
    e.set_services6(Services6::new(
        1,
        vec![service(IPPROTO_TCP, 80), service(IPPROTO_UDP, 53)],
    ));
    e.set_redirect(Redirector::new(RedirectConfig {
        node: NODES[i],
        port: DEFAULT_PORT,
        peers: NODES[..n].to_vec(),
        rate_per_s: rate,
        burst: rate,
        prefix_rate_per_s: rate,
        prefix_burst: rate,
        node_from_state: false,
    }));
    e
}

fn tcp(cport: u16, flags: u8) -> Vec<u8> {
    frame(
        client(),
        vip(),
        &[],
        IPPROTO_TCP,
        &crate::packet6::tests::upper(IPPROTO_TCP, cport, 80, flags, b"hello"),
    )
}

fn udp(cport: u16) -> Vec<u8> {
    frame(
        client(),
        vip(),
        &[],
        IPPROTO_UDP,
        &upper(IPPROTO_UDP, cport, 53, 0, b"query"),
    )
}

/// What happened to a frame sent into the nodes at node `at`.
#[derive(Debug, Default)]
struct Trip {
    /// The node that sent it to its Pod.
    served_by: Option<usize>,
    /// Frames between nodes (questions passed on).
    between: usize,
    /// Notices sent, to which node.
    notices: Vec<usize>,
    /// The verdict that ended it.
    last: Option<Verdict>,
}

/// The I/O loop between engines standing for nodes: verdicts followed, redirected
/// packets encapsulated (MTU `mtu`), notices built and delivered.
fn send(nodes: &mut [Engine], at: usize, mut f: Vec<u8>, mtu: usize) -> Trip {
    let nb = nb();
    let original = f[14..].to_vec();
    let mut cur = at;
    let mut trip = Trip::default();
    loop {
        let v = nodes[cur].process(&mut f, Side::Uplink, &nb, 1_000);
        let notices: Vec<Notice> = nodes[cur]
            .redirect_mut()
            .map(|r| r.take_notices().collect())
            .unwrap_or_default();
        for n in notices {
            let mut buf = vec![0u8; 256];
            let len = wire::build_notice(
                &mut buf,
                &n.macs,
                NODES[cur],
                n.to,
                DEFAULT_PORT,
                n.key,
                n.cookie,
                None,
            )
            .unwrap();
            buf.truncate(len);
            let to = NODES.iter().position(|x| *x == n.to).unwrap();
            trip.notices.push(to);
            let nv = nodes[to].process(&mut buf, Side::Uplink, &nb, 1_000);
            assert_eq!(nv, Verdict::Consumed, "the notice taken by node {to}");
        }
        match v {
            Verdict::Tx(Side::Pod(_)) => {
                trip.served_by = Some(cur);
                trip.last = Some(v);
                return trip;
            }
            Verdict::TxResized(Side::Pod(_), n) => {
                f.truncate(usize::from(n));
                let p = parse6(&f).unwrap();
                assert_eq!(p.dst, pod(cur), "DNAT to the serving node's Pod");
                assert_eq!(&f[12..14], &[0x86, 0xdd]);
                assert_eq!(f.len(), 14 + original.len(), "the inner packet whole");
                trip.served_by = Some(cur);
                trip.last = Some(v);
                return trip;
            }
            Verdict::Redirect => {
                let out = nodes[cur].take_redirect().unwrap();
                let mut buf = f.clone();
                buf.resize(4096, 0);
                let Some(len) =
                    wire::encapsulate(&mut buf, &out, NODES[cur], DEFAULT_PORT, mtu, None)
                else {
                    trip.last = Some(Verdict::Drop(DropReason::RedirectTooBig));
                    return trip;
                };
                buf.truncate(len);
                // The inner packet is the client's, unchanged.
                let rx = wire::parse(&buf).unwrap();
                assert!(wire::inner_is_ipv6(&buf, &rx));
                assert_eq!(&buf[rx.body..rx.body + rx.body_len], &original[..]);
                f = buf;
                trip.between += 1;
                cur = NODES.iter().position(|x| *x == out.peer).unwrap();
            }
            other => {
                trip.last = Some(other);
                return trip;
            }
        }
    }
}

/// The IPv6 redirect record node `n` holds for client port `cport`, TCP: its owner.
fn record_owner(e: &mut Engine, cport: u16, proto: u8) -> Option<u32> {
    let k = Flow6Key {
        src: client(),
        dst: vip(),
        src_port: cport,
        dst_port: if proto == IPPROTO_TCP { 80 } else { 53 },
        proto,
    };
    let mut t = e.flows6_mut();
    let (id, _) = t.lookup(&k, 1_000)?;
    t.get(id)?.redirect_owner()
}

#[test]
fn a_moved_connection_is_asked_about_served_by_its_owner_and_then_followed_uncharged() {
    // One token per second for unknown flows: the question takes it.
    let mut nodes = vec![node(0, true, false, 1), node(1, true, false, 1)];
    // Opened on node 0.
    assert_eq!(
        send(&mut nodes, 0, tcp(40000, SYN), 1600).served_by,
        Some(0)
    );
    assert_eq!(
        send(&mut nodes, 0, tcp(40000, ACK), 1600).served_by,
        Some(0)
    );
    // The router moves it to node 1, which never saw it: asks node 0, which serves it
    // (its own Pod) and tells node 1.
    let t = send(&mut nodes, 1, tcp(40000, ACK), 1600);
    assert_eq!((t.served_by, t.between), (Some(0), 1), "{t:?}");
    assert_eq!(t.notices, vec![1], "the owner told the node that asked");
    assert_eq!(
        record_owner(&mut nodes[1], 40000, IPPROTO_TCP),
        Some(NODES[0])
    );
    let peer = |e: &Engine, p: u32| {
        e.redirect()
            .unwrap()
            .peer_counters()
            .find(|c| c.0 == p)
            .unwrap()
            .1
    };
    assert_eq!(peer(&nodes[1], NODES[0]).notices_received, 1);
    assert_eq!(peer(&nodes[0], NODES[1]).received_from, 1);
    // Later packets follow the record without a question and without a token (the
    // bucket is empty: an unknown flow is refused meanwhile).
    for _ in 0..5 {
        let t = send(&mut nodes, 1, tcp(40000, ACK), 1600);
        assert_eq!((t.served_by, t.notices.len()), (Some(0), 0), "{t:?}");
    }
    let t = send(&mut nodes, 1, tcp(40001, ACK), 1600);
    assert!(
        matches!(
            t.last,
            Some(Verdict::Drop(
                DropReason::RedirectPrefixRateLimited | DropReason::RedirectRateLimited
            ))
        ),
        "{t:?}"
    );
    assert_eq!(peer(&nodes[1], NODES[0]).redirected_to, 6);
    // The flow stays node 0's: its backend never moved, nothing was opened on node 1.
    assert_eq!(nodes[1].service_counters6()[0].new_flows, 0);
}

#[test]
fn a_syn_finding_a_record_is_a_new_connection_served_here() {
    let mut nodes = vec![node(0, true, false, 10), node(1, true, false, 10)];
    send(&mut nodes, 0, tcp(40000, SYN), 1600);
    send(&mut nodes, 1, tcp(40000, ACK), 1600);
    assert_eq!(
        record_owner(&mut nodes[1], 40000, IPPROTO_TCP),
        Some(NODES[0])
    );
    let t = send(&mut nodes, 1, tcp(40000, SYN), 1600);
    assert_eq!((t.served_by, t.between), (Some(1), 0), "{t:?}");
    assert_eq!(record_owner(&mut nodes[1], 40000, IPPROTO_TCP), None);
}

#[test]
fn a_segment_no_node_holds_is_dropped_by_name_after_every_peer() {
    let mut nodes: Vec<Engine> = (0..3).map(|i| node_of(i, 3, true, false, 10)).collect();
    let t = send(&mut nodes, 0, tcp(40000, ACK), 1600);
    assert_eq!(t.between, 2, "both peers asked: {t:?}");
    assert_eq!(t.last, Some(Verdict::Drop(DropReason::RedirectNoPeer)));
    // Redirects off: the old name.
    let mut alone = node(0, true, false, 10);
    alone.redirect = None;
    let mut f = tcp(40000, ACK);
    assert_eq!(
        alone.process(&mut f, Side::Uplink, &nb(), 1_000),
        Verdict::Drop(DropReason::NonSynWithoutFlow)
    );
}

#[test]
fn a_packet_too_big_once_encapsulated_is_refused() {
    let mut nodes = vec![node(0, true, false, 10), node(1, true, false, 10)];
    send(&mut nodes, 0, tcp(40000, SYN), 1600);
    // The IPv6 packet, then the outer IPv4 + UDP, the header and one hop.
    let fits = tcp(40000, ACK).len() - 14 + wire::OUTER + wire::FIXED + 4;
    let t = send(&mut nodes, 1, tcp(40000, ACK), fits - 1);
    assert_eq!(t.last, Some(Verdict::Drop(DropReason::RedirectTooBig)));
    assert_eq!(
        send(&mut nodes, 1, tcp(40000, ACK), fits).served_by,
        Some(0)
    );
}

#[test]
fn without_a_local_backend_a_syn_is_handed_to_a_peer_and_its_notice_leaves_a_record() {
    // Node 1 lost its backend (it still receives the VIP's new connections).
    let mut nodes = vec![node(0, true, false, 10), node(1, false, false, 10)];
    let t = send(&mut nodes, 1, tcp(40000, SYN), 1600);
    assert_eq!(
        (t.served_by, t.notices.clone()),
        (Some(0), vec![1]),
        "{t:?}"
    );
    assert_eq!(nodes[0].service_counters6()[0].new_flows, 1);
    // The handshake's next segment follows the record.
    let t = send(&mut nodes, 1, tcp(40000, ACK), 1600);
    assert_eq!((t.served_by, t.notices.len()), (Some(0), 0), "{t:?}");
}

#[test]
fn under_the_cluster_policy_datagrams_are_handed_on_and_follow_the_record() {
    let mut nodes = vec![node(0, true, true, 10), node(1, false, true, 10)];
    let t = send(&mut nodes, 1, udp(5000), 1600);
    assert_eq!(
        (t.served_by, t.notices.clone()),
        (Some(0), vec![1]),
        "{t:?}"
    );
    assert_eq!(
        record_owner(&mut nodes[1], 5000, IPPROTO_UDP),
        Some(NODES[0])
    );
    let t = send(&mut nodes, 1, udp(5000), 1600);
    assert_eq!((t.served_by, t.notices.len()), (Some(0), 0), "{t:?}");
    // Not under it: a datagram without a backend is dropped here.
    let mut local = vec![node(0, true, false, 10), node(1, false, false, 10)];
    let t = send(&mut local, 1, udp(5000), 1600);
    assert_eq!(t.last, Some(Verdict::Drop(DropReason::NoBackend)));
}

#[test]
fn a_notice_without_the_question_or_from_a_stranger_is_refused() {
    let mut e = node_of(1, 3, true, false, 10);
    let key = Flow6Key {
        src: client(),
        dst: vip(),
        src_port: 40000,
        dst_port: 80,
        proto: IPPROTO_TCP,
    };
    let cookie = e.redirect().unwrap().cookie_for6(&key);
    let notice = |from: u32, cookie: u64| {
        let mut buf = vec![0u8; 256];
        let n = wire::build_notice(
            &mut buf,
            &[2; 12],
            from,
            NODES[1],
            DEFAULT_PORT,
            &key,
            cookie,
            None,
        )
        .unwrap();
        buf.truncate(n);
        buf
    };
    let nb = nb();
    let mut f = notice(NODES[0], cookie ^ 1);
    assert_eq!(
        e.process(&mut f, Side::Uplink, &nb, 1_000),
        Verdict::Drop(DropReason::RedirectNoticeRefused)
    );
    let mut f = notice(0x0a01_0009, cookie);
    assert_eq!(
        e.process(&mut f, Side::Uplink, &nb, 1_000),
        Verdict::Drop(DropReason::RedirectNotFromPeer)
    );
    assert_eq!(record_owner(&mut e, 40000, IPPROTO_TCP), None);
    let mut f = notice(NODES[0], cookie);
    assert_eq!(
        e.process(&mut f, Side::Uplink, &nb, 1_000),
        Verdict::Consumed
    );
    assert_eq!(record_owner(&mut e, 40000, IPPROTO_TCP), Some(NODES[0]));
    // A second owner's notice points the record there (the flow moved on).
    let mut f = notice(NODES[2], cookie);
    assert_eq!(
        e.process(&mut f, Side::Uplink, &nb, 1_000),
        Verdict::Consumed
    );
    assert_eq!(record_owner(&mut e, 40000, IPPROTO_TCP), Some(NODES[2]));
    let mut t = e.flows6_mut();
    assert_eq!(t.len(), 1);
    let (id, _) = t.lookup(&key, 1_000).unwrap();
    assert_eq!(t.get(id).unwrap().state, FlowState::Redirect);
}
