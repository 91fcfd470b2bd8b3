//! The engine's IPv6 path on frames built byte by byte: DNAT and reverse NAT with valid
//! checksums, every refusal under its name, ICMPv6 errors relayed, the mirror's refusal.

use super::*;
use crate::engine::EngineConfig;
use crate::flow6::Flow6Mirror;
use crate::neigh::{Iface, Route6};
use crate::packet::MacAddr;
use crate::packet6::tests::{checksum_ok, ext, frame, upper};
use crate::packet6::{parse6, IPPROTO_ICMPV6};
use crate::proto::{IPPROTO_TCP, IPPROTO_UDP};
use crate::services6::Service6;

fn ip(s: &str) -> [u8; 16] {
    s.parse::<std::net::Ipv6Addr>().unwrap().octets()
}

const SYN: u8 = tcp_flags::SYN;
const ACK: u8 = tcp_flags::ACK;

fn vip() -> [u8; 16] {
    ip("2001:db8:71::10")
}
fn client() -> [u8; 16] {
    ip("2001:db8:c::42")
}
fn pod(n: u8) -> [u8; 16] {
    let mut a = ip("fd00:10:1::");
    a[15] = n;
    a
}

fn neighbours() -> Neighbours {
    let up = Iface {
        ifindex: 2,
        mac: MacAddr([0xa; 6]),
    };
    let p0 = Iface {
        ifindex: 5,
        mac: MacAddr([0xb; 6]),
    };
    let mut n = Neighbours::new(up, vec![p0]);
    let gw = u128::from_be_bytes(ip("fe80::1"));
    n.add_route6(Route6 {
        prefix: 0,
        len: 0,
        gateway: Some(gw),
        ifindex: 2,
    });
    n.add_route6(Route6 {
        prefix: u128::from_be_bytes(pod(0)),
        len: 64,
        gateway: None,
        ifindex: 5,
    });
    n.add_neighbour6(gw.to_be_bytes(), 2, MacAddr([1; 6]));
    for b in 1..=4 {
        n.add_neighbour6(pod(b), 5, MacAddr([b; 6]));
    }
    n
}

fn service(port: u16, proto: u8, backends: &[u8], ready: usize) -> Service6 {
    let backends: Vec<Backend6> = backends
        .iter()
        .map(|&b| Backend6 {
            ip: pod(b),
            port: 8080,
        })
        .collect();
    Service6 {
        vip: vip(),
        proto,
        port,
        maglev: (0..251)
            .map(|i| {
                if ready == 0 {
                    u16::MAX
                } else {
                    (i % ready) as u16
                }
            })
            .collect(),
        backends,
        ready,
        source_ranges: vec![],
        client_ip_affinity_ms: None,
        hand_off: false,
    }
}

fn engine(services: Vec<Service6>) -> Engine {
    let mut e = Engine::new(EngineConfig {
        flow_capacity: 64,
        flow6_capacity: 64,
        ..Default::default()
    });
    e.set_services6(Services6::new(1, services));
    e
}

fn tcp(src: [u8; 16], dst: [u8; 16], sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    frame(
        src,
        dst,
        &[],
        IPPROTO_TCP,
        &upper(IPPROTO_TCP, sport, dport, flags, b"hello"),
    )
}

fn run(e: &mut Engine, f: &mut [u8], side: Side) -> Verdict {
    e.process(f, side, &neighbours(), 1_000)
}

#[test]
fn a_connection_is_dnated_to_its_backend_and_the_reply_comes_from_the_vip() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1, 2], 2)]);
    let mut f = tcp(client(), vip(), 40000, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    let v = parse6(&f).unwrap();
    assert_eq!(v.src, client(), "the Pod sees the client's own address");
    let backend = v.dst;
    assert!(backend == pod(1) || backend == pod(2));
    assert_eq!((v.l4.unwrap().dst_port, v.hop_limit), (8080, 63));
    assert!(checksum_ok(&f, &v));
    assert_eq!(&f[0..6], &[backend[15]; 6], "the backend's MAC");
    assert_eq!(&f[6..12], &[0xb; 6]);

    let mut r = tcp(backend, client(), 8080, 40000, SYN | ACK);
    assert_eq!(run(&mut e, &mut r, Side::Pod(0)), Verdict::Tx(Side::Uplink));
    let v = parse6(&r).unwrap();
    assert_eq!(
        (v.src, v.dst, v.l4.unwrap().src_port),
        (vip(), client(), 80)
    );
    assert!(checksum_ok(&r, &v));
    assert_eq!(&r[0..6], &[1; 6], "the router's MAC (link-local next hop)");

    // The rest of the connection keeps its backend.
    for _ in 0..3 {
        let mut f = tcp(client(), vip(), 40000, 80, ACK);
        assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
        assert_eq!(parse6(&f).unwrap().dst, backend);
    }
    let c = e.service_counters6()[0];
    assert_eq!((c.new_flows, c.packets_in, c.packets_out), (1, 4, 1));
    // As for IPv4, the worker counts what its TX ring took (`tx_packets`), the engine
    // does not: counted in both, every IPv6 frame was counted twice.
    assert_eq!(e.counters().tx_packets, 0);
}

#[test]
fn a_partial_checksum_from_a_pod_leaves_complete() {
    let mut e = engine(vec![service(53, IPPROTO_UDP, &[1], 1)]);
    let mut f = frame(
        client(),
        vip(),
        &[],
        IPPROTO_UDP,
        &upper(IPPROTO_UDP, 5353, 53, 0, b"q"),
    );
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    let mut r = frame(
        pod(1),
        client(),
        &[],
        IPPROTO_UDP,
        &upper(IPPROTO_UDP, 8080, 5353, 0, b"answer"),
    );
    r[54 + 6..54 + 8].copy_from_slice(&[0x12, 0x34]); // an offload's partial sum
    assert_eq!(run(&mut e, &mut r, Side::Pod(0)), Verdict::Tx(Side::Uplink));
    assert!(checksum_ok(&r, &parse6(&r).unwrap()));
}

#[test]
fn every_refusal_has_its_name() {
    let mut ranged = service(443, IPPROTO_TCP, &[1], 1);
    ranged.source_ranges = vec![(u128::from_be_bytes(ip("2001:db8:ffff::")), 48)];
    let mut e = engine(vec![
        service(80, IPPROTO_TCP, &[1], 1),
        ranged,
        service(81, IPPROTO_TCP, &[], 0),
    ]);
    let cases: Vec<(Vec<u8>, Side, Verdict)> = vec![
        (
            tcp(client(), vip(), 1, 80, ACK),
            Side::Uplink,
            Verdict::Drop(DropReason::NonSynWithoutFlow),
        ),
        (
            tcp(client(), vip(), 1, 22, SYN),
            Side::Uplink,
            Verdict::Drop(DropReason::PortNotExposed),
        ),
        (
            tcp(client(), vip(), 1, 443, SYN),
            Side::Uplink,
            Verdict::Drop(DropReason::SourceRangeDenied),
        ),
        (
            tcp(client(), vip(), 1, 81, SYN),
            Side::Uplink,
            Verdict::Drop(DropReason::NoBackend),
        ),
        (
            tcp(client(), ip("2001:db8::99"), 1, 80, SYN),
            Side::Uplink,
            Verdict::Pass(PassReason::NotForUs),
        ),
        (
            tcp(pod(1), client(), 8080, 1, ACK),
            Side::Pod(0),
            Verdict::Drop(DropReason::NoFlow),
        ),
        (
            frame(client(), vip(), &[], 50, &[0; 16]), // ESP
            Side::Uplink,
            Verdict::Drop(DropReason::Ipv6ExtensionHeader),
        ),
        (
            frame(
                client(),
                vip(),
                &[ext(44, 0, 0, 1)],
                IPPROTO_UDP,
                &upper(IPPROTO_UDP, 1, 80, 0, &[0; 32]),
            ),
            Side::Uplink,
            Verdict::Drop(DropReason::Fragment),
        ),
        (
            frame(
                client(),
                vip(),
                &[],
                IPPROTO_ICMPV6,
                &[128, 0, 0, 0, 0, 1, 0, 1],
            ), // echo
            Side::Uplink,
            Verdict::Drop(DropReason::UnsupportedProtocol),
        ),
        (
            vec![0; 20],
            Side::Uplink,
            Verdict::Pass(PassReason::NotIpv4),
        ),
    ];
    for (i, (mut f, side, want)) in cases.into_iter().enumerate() {
        assert_eq!(run(&mut e, &mut f, side), want, "case {i}");
    }
    let mut f = tcp(client(), vip(), 1, 80, SYN);
    f[14 + 7] = 1; // hop limit 1
    assert_eq!(
        run(&mut e, &mut f, Side::Uplink),
        Verdict::Pass(PassReason::TtlExpired)
    );
    assert!(e.flows6_mut().is_empty());
}

#[test]
fn an_unresolved_backend_is_asked_for_and_counted() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[9], 1)]);
    let mut f = tcp(client(), vip(), 1, 80, SYN);
    assert_eq!(
        run(&mut e, &mut f, Side::Uplink),
        Verdict::Drop(DropReason::NoNeighbour)
    );
    assert_eq!(e.take_missing6().collect::<Vec<_>>(), vec![(pod(9), 5)]);
    assert_eq!(e.service_counters6()[0].drops, 1);
}

#[test]
fn a_new_generation_keeps_draining_backends_and_ends_removed_ones() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    let mut f = tcp(client(), vip(), 7, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    // Pod 1 drains (Ready: pod 2): the connection stays; a new one goes to pod 2.
    e.set_services6(Services6::new(
        2,
        vec![service(80, IPPROTO_TCP, &[2, 1], 1)],
    ));
    let mut f = tcp(client(), vip(), 7, 80, ACK);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    assert_eq!(parse6(&f).unwrap().dst, pod(1));
    let mut f = tcp(client(), vip(), 8, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    assert_eq!(parse6(&f).unwrap().dst, pod(2));
    // Pod 1 gone: its connection ends at its next packet.
    e.set_services6(Services6::new(3, vec![service(80, IPPROTO_TCP, &[2], 1)]));
    let mut f = tcp(client(), vip(), 7, 80, ACK);
    assert_eq!(
        run(&mut e, &mut f, Side::Uplink),
        Verdict::Drop(DropReason::BackendRemoved)
    );
    assert_eq!(e.flows6_mut().len(), 1);
    let c = e.service_counters6()[0];
    assert_eq!(
        (c.new_flows, c.drops),
        (2, 1),
        "a frontend's counters outlive a table"
    );
}

#[test]
fn new_flows_spread_over_the_backends_and_affinity_keeps_a_client_on_one() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1, 2, 3, 4], 4)]);
    let mut seen = [0u32; 5];
    for port in 0..40u16 {
        let mut f = tcp(client(), vip(), 1000 + port, 80, SYN);
        assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
        seen[usize::from(parse6(&f).unwrap().dst[15])] += 1;
        e.flows6_mut().sweep(u64::MAX, 64); // keep the 64-flow table from filling
    }
    assert!(
        seen[1..].iter().all(|&n| n >= 3),
        "every backend gets new flows: {seen:?}"
    );
    let mut sticky = service(80, IPPROTO_TCP, &[1, 2, 3, 4], 4);
    sticky.client_ip_affinity_ms = Some(10_000);
    e.set_services6(Services6::new(2, vec![sticky]));
    let mut picked = std::collections::HashSet::new();
    for port in 0..12u16 {
        // (at most 16 half-open flows in a 64-flow table)
        let mut f = tcp(client(), vip(), 3000 + port, 80, SYN);
        assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
        picked.insert(parse6(&f).unwrap().dst);
    }
    assert_eq!(picked.len(), 1, "one backend per client address");
}

#[test]
fn packet_too_big_about_a_reply_reaches_the_backend_with_its_quote_rewritten() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    let mut f = tcp(client(), vip(), 40000, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    // A router on the way back says the reply (VIP:80 -> client:40000) was too big.
    let reply = tcp(vip(), client(), 80, 40000, ACK);
    let mut body = vec![2, 0, 0, 0, 0, 0, 0x05, 0x00]; // PTB, MTU 1280
    body.extend_from_slice(&reply[14..]);
    let router = ip("2001:db8:ffff::1");
    let mut ptb = frame(router, vip(), &[], IPPROTO_ICMPV6, &body);
    assert_eq!(
        run(&mut e, &mut ptb, Side::Uplink),
        Verdict::Tx(Side::Pod(0))
    );
    let v = parse6(&ptb).unwrap();
    assert_eq!((v.src, v.dst), (router, pod(1)));
    let q = crate::packet6::parse_icmp6_error(&ptb, &v).unwrap();
    assert_eq!(
        (q.inner_src, q.inner_src_port, q.mtu),
        (pod(1), 8080, Some(1280))
    );
    assert!(checksum_ok(&ptb, &v));

    // The backend's own error about the client's packet goes to the client from the VIP.
    let sent = tcp(client(), pod(1), 40000, 8080, ACK);
    let mut body = vec![1, 4, 0, 0, 0, 0, 0, 0]; // port unreachable
    body.extend_from_slice(&sent[14..]);
    let mut un = frame(pod(1), client(), &[], IPPROTO_ICMPV6, &body);
    assert_eq!(
        run(&mut e, &mut un, Side::Pod(0)),
        Verdict::Tx(Side::Uplink)
    );
    let v = parse6(&un).unwrap();
    let q = crate::packet6::parse_icmp6_error(&un, &v).unwrap();
    assert_eq!((v.src, q.inner_dst, q.inner_dst_port), (vip(), vip(), 80));
    assert!(checksum_ok(&un, &v));

    // About no flow: from the uplink a named drop; from a Pod the kernel's.
    let mut stray = frame(router, vip(), &[], IPPROTO_ICMPV6, &{
        let mut b = vec![2, 0, 0, 0, 0, 0, 0x05, 0x00];
        b.extend_from_slice(&tcp(vip(), client(), 80, 1, ACK)[14..]);
        b
    });
    assert_eq!(
        run(&mut e, &mut stray, Side::Uplink),
        Verdict::Drop(DropReason::NoFlow)
    );
}

struct Refuse;
impl Flow6Mirror for Refuse {
    fn publish(&mut self, _: &Flow6Key) -> bool {
        false
    }
    fn withdraw(&mut self, _: &Flow6Key) {}
}

#[test]
fn a_flow_the_steering_map_refuses_is_not_created() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    e.flows6_mut().set_mirror(Box::new(Refuse));
    let mut f = tcp(client(), vip(), 1, 80, SYN);
    assert_eq!(
        run(&mut e, &mut f, Side::Uplink),
        Verdict::Drop(DropReason::FlowNotPublished)
    );
    assert!(e.flows6_mut().is_empty());
}

#[test]
fn workers_sharing_the_table_serve_each_others_replies() {
    let mut a = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    let mut b = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    b.share_flows6(a.flows6_shared());
    let mut f = tcp(client(), vip(), 40000, 80, SYN);
    assert_eq!(run(&mut a, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    // The reply reaches the other worker's socket.
    let mut r = tcp(pod(1), client(), 8080, 40000, SYN | ACK);
    assert_eq!(run(&mut b, &mut r, Side::Pod(0)), Verdict::Tx(Side::Uplink));
    assert_eq!(parse6(&r).unwrap().src, vip());
    assert_eq!(b.flows6_counts(), (1, 64));
}

#[test]
fn a_flow_met_before_the_first_service_table_is_kept_for_it() {
    // A restart: the new process's workers find the previous run's flows before they
    // have read the node state (generation 0).
    let mut old = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    let mut f = tcp(client(), vip(), 40000, 80, SYN);
    assert_eq!(
        run(&mut old, &mut f, Side::Uplink),
        Verdict::Tx(Side::Pod(0))
    );
    let mut new = Engine::new(EngineConfig {
        flow_capacity: 64,
        flow6_capacity: 64,
        ..Default::default()
    });
    new.share_flows6(old.flows6_shared());
    let mut r = tcp(pod(1), client(), 8080, 40000, SYN | ACK);
    assert_eq!(
        run(&mut new, &mut r, Side::Pod(0)),
        Verdict::Drop(DropReason::NoServiceTable)
    );
    assert_eq!(new.flows6_mut().len(), 1, "the flow outlives the wait");
    new.set_services6(Services6::new(1, vec![service(80, IPPROTO_TCP, &[1], 1)]));
    let mut r = tcp(pod(1), client(), 8080, 40000, SYN | ACK);
    assert_eq!(
        run(&mut new, &mut r, Side::Pod(0)),
        Verdict::Tx(Side::Uplink)
    );
    assert_eq!(parse6(&r).unwrap().src, vip(), "translated back to the VIP");
}

#[test]
fn the_clients_mss_and_a_path_mtu_bound_the_segments_towards_it() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    // A SYN with an MSS option of 1220 (kind 2, length 4), padded with NOPs.
    let mut body = upper(IPPROTO_TCP, 40000, 80, SYN, &[]);
    body[12] = 0x70; // 28-byte header
    body.extend_from_slice(&[2, 4, 0x04, 0xc4, 1, 1, 1, 1]);
    let mut f = frame(client(), vip(), &[], IPPROTO_TCP, &body);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    let mut r = tcp(pod(1), client(), 8080, 40000, SYN | ACK);
    assert_eq!(run(&mut e, &mut r, Side::Pod(0)), Verdict::Tx(Side::Uplink));
    assert_eq!(e.client_mss(&r, 1_000), Some(1220));
    // A router says 1280 bytes fit towards the client: 1220 stays (the lower one)...
    let reply = tcp(vip(), client(), 80, 40000, ACK);
    let ptb = |mtu: u32| {
        let mut b = vec![2, 0, 0, 0];
        b.extend_from_slice(&mtu.to_be_bytes());
        b.extend_from_slice(&reply[14..]);
        frame(ip("2001:db8:ffff::1"), vip(), &[], IPPROTO_ICMPV6, &b)
    };
    assert_eq!(
        run(&mut e, &mut ptb(1400), Side::Uplink),
        Verdict::Tx(Side::Pod(0))
    );
    assert_eq!(e.client_mss(&r, 1_000), Some(1220));
    // ... and a smaller path MTU lowers it.
    assert_eq!(
        run(&mut e, &mut ptb(1200), Side::Uplink),
        Verdict::Tx(Side::Pod(0))
    );
    assert_eq!(e.client_mss(&r, 1_000), Some(1140));
}

/// `sessionAffinity: ClientIP`, as IPv4's
/// `client_ip_affinity_keeps_a_clients_connections_on_one_backend`: clients that came
/// while one backend was alone stay on it when another arrives, until their timeout
/// (10 s) passes without a new connection; then the hash spreads them.
#[test]
fn client_ip_affinity_keeps_a_clients_connections_on_its_backend_when_another_arrives() {
    let sticky = |backends: &[u8]| {
        let mut s = service(80, IPPROTO_TCP, backends, backends.len());
        s.client_ip_affinity_ms = Some(10_000);
        s
    };
    let mut e = engine(vec![sticky(&[1])]);
    let nb = neighbours();
    let backend_of = |e: &mut Engine, client: [u8; 16], port: u16, now: u64| {
        let mut f = tcp(client, vip(), port, 80, SYN);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, now),
            Verdict::Tx(Side::Pod(0))
        );
        e.flows6_mut().sweep(u64::MAX, 64); // keep the 64-flow table from filling
        parse6(&f).unwrap().dst[15]
    };
    let clients: Vec<[u8; 16]> = (1..=60u8)
        .map(|i| {
            let mut c = client();
            c[15] = i;
            c
        })
        .collect();
    for c in &clients {
        assert_eq!(backend_of(&mut e, *c, 40000, 1_000), 1);
    }
    e.set_services6(Services6::new(2, vec![sticky(&[1, 2])]));
    for c in &clients {
        assert_eq!(
            backend_of(&mut e, *c, 40001, 9_000),
            1,
            "a client stays on its backend when another arrives"
        );
        assert_eq!(backend_of(&mut e, *c, 40002, 9_500), 1);
    }
    let later: std::collections::HashSet<u8> = clients
        .iter()
        .map(|c| backend_of(&mut e, *c, 40003, 30_000))
        .collect();
    assert_eq!(later.len(), 2, "after the timeout the hash spreads them");
    // Each now stays where the hash put it; its backend gone, the hash again.
    let on_2: Vec<[u8; 16]> = clients
        .iter()
        .copied()
        .filter(|c| backend_of(&mut e, *c, 40004, 31_000) == 2)
        .collect();
    assert!(!on_2.is_empty());
    e.set_services6(Services6::new(3, vec![sticky(&[1])]));
    for c in &on_2 {
        assert_eq!(backend_of(&mut e, *c, 40005, 32_000), 1);
    }
}

/// A client re-uses the 4-tuple of a connection that ended (its port is free at once
/// when the server closed first, while the record waits out its FIN timeout): the SYN
/// opens a new connection where any new one goes — not to the old record's backend,
/// which may be draining (a terminating Pod's closed listener answers with a reset) —
/// as IPv4's `syn_reopens`. A SYN retransmitted during a handshake to a Ready backend
/// stays on its flow.
#[test]
fn a_syn_reusing_an_ended_connections_port_opens_a_new_flow() {
    let mut e = engine(vec![service(80, IPPROTO_TCP, &[1], 1)]);
    let mut f = tcp(client(), vip(), 9, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    // A retransmitted SYN during the handshake: the same flow, the same backend.
    let mut f = tcp(client(), vip(), 9, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    assert_eq!(parse6(&f).unwrap().dst, pod(1));
    assert_eq!(e.service_counters6()[0].new_flows, 1);
    // The connection runs and the server closes it first.
    let mut r = tcp(pod(1), client(), 8080, 9, SYN | ACK);
    assert_eq!(run(&mut e, &mut r, Side::Pod(0)), Verdict::Tx(Side::Uplink));
    for (flags, side) in [
        (ACK, Side::Uplink),
        (tcp_flags::FIN | ACK, Side::Pod(0)),
        (tcp_flags::FIN | ACK, Side::Uplink),
        (ACK, Side::Pod(0)),
    ] {
        let (mut p, out) = match side {
            Side::Uplink => (tcp(client(), vip(), 9, 80, flags), Side::Pod(0)),
            Side::Pod(_) => (tcp(pod(1), client(), 8080, 9, flags), Side::Uplink),
        };
        assert_eq!(run(&mut e, &mut p, side), Verdict::Tx(out));
    }
    // Pod 1 drains (its Pod terminating), pod 2 is Ready: the port's next SYN is a new
    // connection, to pod 2.
    e.set_services6(Services6::new(
        2,
        vec![service(80, IPPROTO_TCP, &[2, 1], 1)],
    ));
    let mut f = tcp(client(), vip(), 9, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    assert_eq!(parse6(&f).unwrap().dst, pod(2), "not the draining backend");
    assert_eq!(e.service_counters6()[0].new_flows, 2);
    assert_eq!(e.flows6_mut().len(), 1, "the old record is gone");
    // During the new handshake pod 2 starts draining: the retransmitted SYN re-opens too.
    e.set_services6(Services6::new(
        3,
        vec![service(80, IPPROTO_TCP, &[3, 2], 1)],
    ));
    let mut f = tcp(client(), vip(), 9, 80, SYN);
    assert_eq!(run(&mut e, &mut f, Side::Uplink), Verdict::Tx(Side::Pod(0)));
    assert_eq!(parse6(&f).unwrap().dst, pod(3));
}
