//! What the dataplane fuzz targets check, kept out of the `fuzz_target!` bodies so the
//! targets stay one line and a crashing input can be replayed from a plain test.
//!
//! - [`check_packet`]: one frame through [`packet::parse`], [`packet::parse_fast`] /
//!   [`packet::parse_fast_as`] (which must agree with `parse`), the ICMP-error view and
//!   every rewrite the engine uses, the cut to egress sizes and the ICMP "fragmentation
//!   needed" written about it; a rewritten frame parses to the updated view and keeps
//!   valid checksums valid; the same frame through the IPv6 views ([`check_packet6`]).
//! - [`check_engine`]: a sequence of frames (format in [`Records`]) through two engines
//!   with the same small service table, one with the established-flow fast path and one
//!   without: both must give the same verdict and bytes for every frame, a frame that is
//!   not transmitted is unchanged, a transmitted one re-parses with valid checksums (when
//!   they were valid) and is NATed to a backend or from the VIP, every verdict is counted.

use std::net::{Ipv4Addr, Ipv6Addr};

use juneau_control::maglev::MaglevTable;
use juneau_control::model::{
    Frontend, Frontend6, LocalBackend, LocalBackend6, NodeService, NodeService6, NodeState,
    Protocol,
};
use juneau_dataplane::counters::DropReason;
use juneau_dataplane::engine::{Engine, EngineConfig, PassReason, Verdict};
use juneau_dataplane::neigh::{Iface, Neighbours, Route, Route6, Side};
use juneau_dataplane::packet::{
    self, L4Checksum, NatSide, Parsed, ETH_HEADER_LEN, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP,
};
use juneau_dataplane::packet6;
use juneau_dataplane::services::ServiceTable;
use juneau_dataplane::services6::Services6;

/// The VIP of the fixture's Services.
pub const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// A backend on Pod interface 0.
pub const B1: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 5);
/// A backend on Pod interface 1.
pub const B2: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 6);
/// A client behind the default gateway.
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The IPv6 VIP (the seed corpus' IPv6 frames are addressed to it).
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0x71, 0, 0, 0, 0x10);
/// IPv6 backends on Pod interfaces 0 and 1.
pub const B6: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 5),
    Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 6),
];
/// Clients in this /24 are routed via a gateway without a neighbour entry.
pub const UNRESOLVED_NET: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 0);

fn csum_ok(stored: u16, computed: u16) -> bool {
    // One's complement has two zeros: an incremental update may leave either.
    stored == computed || (stored ^ computed == 0xffff && (stored == 0 || computed == 0))
}

/// The IPv4 header checksum of a parsed frame verifies.
pub fn ip_checksum_ok(f: &[u8], v: &packet::Ipv4View) -> bool {
    let hdr = &f[ETH_HEADER_LEN..ETH_HEADER_LEN + v.header_len];
    csum_ok(
        u16::from_be_bytes([hdr[10], hdr[11]]),
        packet::ipv4_header_checksum(hdr),
    )
}

/// The TCP/UDP checksum of a parsed frame verifies (or is UDP's "none"); true without L4.
pub fn l4_checksum_ok(f: &[u8], v: &packet::Ipv4View) -> bool {
    let Some(l4) = v.l4 else { return true };
    if l4.udp_no_checksum {
        return true;
    }
    let off = packet::l4_csum_offset(v);
    csum_ok(
        u16::from_be_bytes([f[off], f[off + 1]]),
        packet::l4_checksum(f, v),
    )
}

/// Both checksums of an IPv4 frame verify.
pub fn checksums_ok(f: &[u8]) -> bool {
    match packet::parse(f) {
        Ok(Parsed::Ipv4(v)) => ip_checksum_ok(f, &v) && l4_checksum_ok(f, &v),
        _ => false,
    }
}

fn fast_agrees_with_parse(frame: &[u8], parsed: &Result<Parsed, packet::ParseError>) {
    let full = match parsed {
        Ok(Parsed::Ipv4(v)) if v.header_len == 20 && !v.fragment => v.l4.map(|l4| (*v, l4)),
        _ => None,
    };
    let fast = packet::parse_fast(frame);
    match (fast, full) {
        (None, None) => {}
        (Some(p), Some((v, l4))) => {
            assert_eq!(
                (p.src, p.dst, p.protocol, p.ttl),
                (v.src, v.dst, v.protocol, v.ttl)
            );
            assert_eq!(
                (p.src_port, p.dst_port, p.tcp_flags),
                (l4.src_port, l4.dst_port, l4.tcp_flags)
            );
            assert_eq!(usize::from(p.l4_len), v.total_len - 20);
        }
        (a, b) => panic!("parse_fast {a:?} but parse {b:?}"),
    }
    let (tcp, udp) = (
        packet::parse_fast_as::<true>(frame),
        packet::parse_fast_as::<false>(frame),
    );
    match fast {
        Some(p) if p.protocol == IPPROTO_TCP => assert_eq!((tcp, udp), (Some(p), None)),
        Some(p) => assert_eq!((tcp, udp), (None, Some(p))),
        None => assert_eq!((tcp, udp), (None, None)),
    }
}

/// A packet cut to several egress sizes (`segment::Cut`): every piece fits, parses,
/// carries valid IPv4 and (TCP) L4 checksums, and the pieces' payloads put together
/// are the packet's payload.
fn check_cut(frame: &[u8], v: &packet::Ipv4View) {
    use juneau_dataplane::segment::Cut;
    for (limit, mss) in [(90, None), (600, Some(536)), (1514, None)] {
        let Ok(cut) = Cut::plan(frame, limit, mss) else {
            continue;
        };
        let mut out = vec![0u8; limit];
        let hdrs = ETH_HEADER_LEN + v.header_len;
        let mut payload = vec![0u8; v.total_len - v.header_len];
        let mut seen = 0;
        for i in 0..cut.pieces() {
            let n = cut.write(frame, i, &mut out);
            assert!(n <= limit, "piece {i} of {n} bytes over {limit}");
            let Ok(Parsed::Ipv4(w)) = packet::parse(&out[..n]) else {
                panic!("piece {i} does not parse")
            };
            assert!(ip_checksum_ok(&out[..n], &w), "piece {i}: IPv4 checksum");
            if v.protocol == IPPROTO_TCP {
                assert!(l4_checksum_ok(&out[..n], &w), "piece {i}: TCP checksum");
                let t = w.l4_offset();
                let body = &out[t + usize::from(out[t + 12] >> 4) * 4..n];
                payload[seen..seen + body.len()].copy_from_slice(body);
                seen += body.len();
            } else {
                let off = usize::from(u16::from_be_bytes([out[20], out[21]]) & 0x1fff) * 8;
                let body = &out[hdrs..n];
                payload[off..off + body.len()].copy_from_slice(body);
                seen += body.len();
            }
        }
        let whole = &frame[hdrs..ETH_HEADER_LEN + v.total_len];
        if v.protocol == IPPROTO_TCP {
            let thl = usize::from(frame[hdrs + 12] >> 4) * 4;
            assert_eq!(
                &payload[..seen],
                &whole[thl..],
                "TCP payload not carried whole"
            );
        } else {
            assert_eq!(&payload[..seen], whole, "fragments do not reassemble");
        }
    }
}

/// The ICMP "fragmentation needed" the dataplane would send about `frame`
/// (`icmp::frag_needed`): when written, it fits its bound, parses as an ICMP error
/// whose checksums are valid and quotes the frame's first bytes as they were.
fn check_frag_needed(frame: &[u8]) {
    use juneau_dataplane::icmp;
    let mut out = [0u8; icmp::FRAG_NEEDED_MAX];
    let Some(n) = icmp::frag_needed(frame, 0x0a01_0005, 0xc000_0201, 1400, &mut out) else {
        return;
    };
    assert!(n <= icmp::FRAG_NEEDED_MAX);
    let err = &out[..n];
    let Ok(Parsed::Ipv4(w)) = packet::parse(err) else {
        panic!("the error does not parse")
    };
    assert!(ip_checksum_ok(err, &w), "the error's IPv4 checksum");
    assert_eq!(packet::frag_needed_mtu(err, &w), Some(1400));
    let quoted = n - ETH_HEADER_LEN - 28;
    assert_eq!(
        &err[ETH_HEADER_LEN + 28..],
        &frame[ETH_HEADER_LEN..ETH_HEADER_LEN + quoted]
    );
    let mut sum = 0u32;
    for c in err[ETH_HEADER_LEN + 20..].chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    assert_eq!(sum, 0xffff, "the ICMP checksum");
}

/// One frame through the parsers and every rewrite. Panics on a broken invariant.
pub fn check_packet(frame: &[u8]) {
    check_packet6(frame);
    let parsed = packet::parse(frame);
    fast_agrees_with_parse(frame, &parsed);
    let Ok(Parsed::Ipv4(v)) = parsed else { return };
    assert!(v.header_len >= 20 && v.header_len <= v.total_len);
    assert!(ETH_HEADER_LEN + v.total_len <= frame.len());
    assert_eq!(
        v.l4.is_some(),
        !v.fragment && matches!(v.protocol, IPPROTO_TCP | IPPROTO_UDP)
    );
    check_cut(frame, &v);
    check_frag_needed(frame);
    let ip_ok = ip_checksum_ok(frame, &v);
    if let Some(e) = packet::parse_icmp_error(frame, &v) {
        for (outer, quoted) in [
            (NatSide::Destination, NatSide::Source),
            (NatSide::Source, NatSide::Destination),
        ] {
            let (mut g, mut w) = (frame.to_vec(), v);
            packet::rewrite_icmp_error(&mut g, &mut w, &e, outer, 0x0a01_0005, quoted, 1, 8080);
            assert_eq!(packet::parse(&g), Ok(Parsed::Ipv4(w)), "ICMP rewrite view");
            assert!(
                !ip_ok || ip_checksum_ok(&g, &w),
                "ICMP rewrite broke the outer header checksum"
            );
            let icmp = &g[w.l4_offset()..ETH_HEADER_LEN + w.total_len];
            let mut s = 0u32;
            for c in icmp.chunks(2) {
                s += u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0));
            }
            while s >> 16 != 0 {
                s = (s & 0xffff) + (s >> 16);
            }
            assert_eq!(s, 0xffff, "ICMP checksum after rewrite");
        }
    }
    if v.l4.is_none() {
        return;
    }
    let l4_ok = l4_checksum_ok(frame, &v);
    for (side, mode) in [
        (NatSide::Destination, L4Checksum::Incremental),
        (NatSide::Source, L4Checksum::Incremental),
        (NatSide::Destination, L4Checksum::Recompute),
        (NatSide::Source, L4Checksum::Recompute),
    ] {
        let (mut g, mut w) = (frame.to_vec(), v);
        packet::rewrite_addr_port(&mut g, &mut w, side, 0x0a01_0005, 8080, mode);
        let forwarded = packet::decrement_ttl(&mut g, &mut w);
        assert_eq!(forwarded, v.ttl > 1);
        packet::set_macs(&mut g, packet::MacAddr([1; 6]), packet::MacAddr([2; 6]));
        assert_eq!(g.len(), frame.len());
        assert_eq!(
            packet::parse(&g),
            Ok(Parsed::Ipv4(w)),
            "{side:?} {mode:?}: view"
        );
        let l4 = w.l4.expect("l4 kept");
        let (addr, port) = match side {
            NatSide::Destination => (w.dst, l4.dst_port),
            NatSide::Source => (w.src, l4.src_port),
        };
        assert_eq!((addr, port), (0x0a01_0005, 8080));
        assert!(
            !ip_ok || ip_checksum_ok(&g, &w),
            "{side:?} {mode:?}: IPv4 checksum broken"
        );
        if mode == L4Checksum::Recompute || l4_ok {
            assert!(l4_checksum_ok(&g, &w), "{side:?} {mode:?}: L4 checksum");
        }
    }
}

/// The records of an engine input: `ctl len frame[len]`, repeated; the last frame takes
/// what is left when `len` overruns the input. `ctl`: bit 0 set = from a Pod interface
/// (bit 1 picks Pod 0 or 1), the clock advances by `(ctl >> 2)^4` ms before the frame;
/// `ctl == 0xff` (no `len`, no frame) swaps the service table for the other one.
pub struct Records<'a>(pub &'a [u8]);

/// One step of an engine input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    /// A frame arriving on `side` after `advance_ms`.
    Frame {
        /// Ingress.
        side: Side,
        /// Clock advance before the frame.
        advance_ms: u64,
        /// The frame.
        frame: &'a [u8],
    },
    /// Swap the service table.
    SwapServices,
}

/// The `ctl` byte that swaps the service table.
pub const SWAP_SERVICES: u8 = 0xff;

impl<'a> Iterator for Records<'a> {
    type Item = Record<'a>;

    fn next(&mut self) -> Option<Record<'a>> {
        let (&ctl, rest) = self.0.split_first()?;
        if ctl == SWAP_SERVICES {
            self.0 = rest;
            return Some(Record::SwapServices);
        }
        let (len, rest) = match rest.split_first() {
            Some((&len, rest)) => (usize::from(len), rest),
            None => (0, rest),
        };
        let (frame, rest) = rest.split_at(len.min(rest.len()));
        self.0 = rest;
        let side = match ctl & 3 {
            1 => Side::Pod(0),
            3 => Side::Pod(1),
            _ => Side::Uplink,
        };
        Some(Record::Frame {
            side,
            advance_ms: u64::from(ctl >> 2).pow(4),
            frame,
        })
    }
}

/// Encodes frames as an engine input (for seed corpora).
pub fn encode_records(frames: &[(Side, u8, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (side, advance, frame) in frames {
        assert!(frame.len() <= 255 && *advance < 64);
        let side_bits = match side {
            Side::Uplink => 0,
            Side::Pod(0) => 1,
            Side::Pod(_) => 3,
        };
        out.push(advance << 2 | side_bits);
        out.push(frame.len() as u8);
        out.extend_from_slice(frame);
    }
    out
}

fn node_state(tcp80: &[Ipv4Addr], udp53: &[Ipv4Addr], tcp80_ranges: &[&str]) -> NodeState {
    let svc = |protocol, port, backends: &[Ipv4Addr], target| NodeService {
        frontend: Frontend {
            vip: VIP,
            protocol,
            port,
        },
        backends: backends
            .iter()
            .map(|&ip| LocalBackend { ip, port: target })
            .collect(),
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        client_ip_affinity: None,
        hand_off: false,
        host_network: false,
    };
    let mut tcp = svc(Protocol::Tcp, 80, tcp80, 8080);
    tcp.source_ranges = tcp80_ranges
        .iter()
        .map(|r| r.parse().expect("a fixture range"))
        .collect();
    let mut state = NodeState {
        node: "fuzz".into(),
        services: vec![
            tcp,
            svc(Protocol::Udp, 53, udp53, 5353),
            // A frontend without a local backend.
            svc(Protocol::Tcp, 443, &[], 8443),
        ],
        services6: vec![
            svc6(Protocol::Tcp, 80, &B6, 8080),
            svc6(Protocol::Udp, 53, &B6[..1], 5353),
        ],
        ..Default::default()
    };
    state.normalize();
    state
}

fn svc6(protocol: Protocol, port: u16, backends: &[Ipv6Addr], target: u16) -> NodeService6 {
    NodeService6::new(
        Frontend6 {
            vip: VIP6,
            protocol,
            port,
        },
        backends
            .iter()
            .map(|&ip| LocalBackend6 { ip, port: target })
            .collect(),
    )
}

/// The fixture's service table for a generation: odd ones send TCP :80 to B1 and B2,
/// even ones to B2 only, from the clients of its source ranges (and UDP :53 the other way
/// round). Built once per process.
fn service_table(generation: u64) -> ServiceTable {
    static TABLES: std::sync::OnceLock<[ServiceTable; 2]> = std::sync::OnceLock::new();
    let tables = TABLES.get_or_init(|| [build_service_table(0), build_service_table(1)]);
    let mut t = tables[(generation % 2) as usize].clone();
    t.generation = generation;
    t
}

fn build_service_table(generation: u64) -> ServiceTable {
    let state = if generation % 2 == 1 {
        node_state(&[B1, B2], &[B1], &[])
    } else {
        // Source ranges on TCP :80: half the address space and the documentation /24;
        // a swap ends the flows of the clients they leave out.
        node_state(&[B2], &[B1, B2], &["0.0.0.0/1", "192.0.2.0/24"])
    };
    let maglev: Vec<Vec<u16>> = state
        .services
        .iter()
        .map(|s| {
            let mut b = s.backends.clone();
            b.sort();
            b.dedup();
            MaglevTable::new(&b, 13).expect("maglev").slots().to_vec()
        })
        .collect();
    let mut t = ServiceTable::new(generation, &state, &maglev);
    // Slots spread evenly over the Ready backends (which slot is whose does not matter
    // to the invariants).
    let maglev6: Vec<Vec<u16>> = state
        .services6
        .iter()
        .map(|s| {
            (0..13)
                .map(|i| (i % s.backends.len().max(1)) as u16)
                .collect()
        })
        .collect();
    t.v6 = Services6::from_state(generation, &state.services6, &maglev6);
    t
}

/// The fixture's next-hop table: uplink 1, Pods 2 (B1) and 3 (B2), default route via a
/// resolved gateway, [`UNRESOLVED_NET`]/24 via a gateway with no neighbour entry.
pub fn neighbours() -> Neighbours {
    let mac = packet::MacAddr;
    let mut nb = Neighbours::new(
        Iface {
            ifindex: 1,
            mac: mac([0xa; 6]),
        },
        vec![
            Iface {
                ifindex: 2,
                mac: mac([0xb; 6]),
            },
            Iface {
                ifindex: 3,
                mac: mac([0xc; 6]),
            },
        ],
    );
    let gw = u32::from(Ipv4Addr::new(192, 0, 2, 254));
    nb.add_route(Route {
        prefix: 0,
        len: 0,
        gateway: Some(gw),
        ifindex: 1,
    });
    nb.add_route(Route {
        prefix: u32::from(UNRESOLVED_NET),
        len: 24,
        gateway: Some(u32::from(Ipv4Addr::new(192, 0, 2, 253))),
        ifindex: 1,
    });
    for (b, ifindex) in [(B1, 2), (B2, 3)] {
        nb.add_route(Route {
            prefix: u32::from(b),
            len: 32,
            gateway: None,
            ifindex,
        });
        nb.add_neighbour(u32::from(b), ifindex, mac([ifindex as u8; 6]));
    }
    nb.add_neighbour(gw, 1, mac([1; 6]));
    let gw6 = u128::from(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1));
    nb.add_route6(Route6 {
        prefix: 0,
        len: 0,
        gateway: Some(gw6),
        ifindex: 1,
    });
    nb.add_neighbour6(gw6.to_be_bytes(), 1, mac([1; 6]));
    for (b, ifindex) in B6.iter().zip([2, 3]) {
        nb.add_route6(Route6 {
            prefix: u128::from(*b),
            len: 128,
            gateway: None,
            ifindex,
        });
        nb.add_neighbour6(b.octets(), ifindex, mac([ifindex as u8; 6]));
    }
    nb
}

/// Flow capacity of the fuzzed engines: small, so a table-full is reachable.
pub const FLOW_CAPACITY: usize = 64;

fn engine(fast_path: bool) -> Engine {
    let mut e = Engine::new(EngineConfig {
        flow_capacity: FLOW_CAPACITY,
        ..Default::default()
    });
    e.set_fast_path(fast_path);
    e.set_services(service_table(1));
    e
}

/// What a verdict count must add up to.
#[derive(Debug, Default)]
struct Tally {
    frames: u64,
    passed: u64,
    dropped: u64,
    malformed: u64,
}

fn check_verdict(
    input: &[u8],
    out: &[u8],
    side: Side,
    verdict: Verdict,
    table: &ServiceTable,
    tally: &mut Tally,
) {
    let parsed = packet::parse(input);
    tally.frames += 1;
    match verdict {
        Verdict::Tx(_) => {}
        Verdict::Pass(_) => tally.passed += 1,
        Verdict::Drop(_) => tally.dropped += 1,
        // A later IPv4 fragment that came before its first fragment is held.
        Verdict::Consumed => assert!(
            matches!(&parsed, Ok(Parsed::Ipv4(v)) if v.fragment && packet::fragment_offset(input) != 0),
            "Consumed for a frame that is no later fragment"
        ),
        // Redirects between nodes are off in this engine (no node address, no peers).
        Verdict::Redirect | Verdict::TxResized(..) => {
            panic!("{verdict:?} from an engine without redirects")
        }
    }
    match parsed {
        Err(_) => {
            tally.malformed += 1;
            assert_eq!(verdict, Verdict::Drop(DropReason::Malformed));
        }
        Ok(Parsed::NotIpv4(_)) if packet::ethertype(input) == Some(packet::ETHERTYPE_IPV6) => {
            return check_verdict6(input, out, side, verdict, table, tally);
        }
        Ok(Parsed::NotIpv4(_)) => assert_eq!(verdict, Verdict::Pass(PassReason::NotIpv4)),
        Ok(Parsed::Ipv4(_)) => {}
    }
    let Verdict::Tx(egress) = verdict else {
        assert_eq!(
            out, input,
            "a frame not transmitted was modified ({verdict:?})"
        );
        return;
    };
    let Ok(Parsed::Ipv4(vin)) = parsed else {
        panic!("transmitted a frame that does not parse")
    };
    assert_eq!(out.len(), input.len(), "length changed");
    let Ok(Parsed::Ipv4(v)) = packet::parse(out) else {
        panic!("transmitted frame does not parse")
    };
    assert_eq!(
        u16::from(v.ttl) + 1,
        u16::from(vin.ttl),
        "TTL decremented once"
    );
    if checksums_ok(input) {
        assert!(checksums_ok(out), "NAT broke a valid checksum");
    }
    if v.protocol == IPPROTO_ICMP {
        return;
    }
    if v.fragment {
        // A fragment keeps its ports (if any) where they were: only the address moved.
        match side {
            Side::Uplink => assert!(
                table
                    .backend_keys()
                    .iter()
                    .any(|(ip, _, _)| *ip == v.dst_addr()),
                "fragment DNATed to {} which is no backend",
                v.dst_addr()
            ),
            Side::Pod(_) => assert!(table.is_vip(v.src), "fragment reply not from a VIP"),
        }
        return;
    }
    let l4 = v.l4.expect("transmitted TCP/UDP frame has L4");
    match side {
        Side::Uplink => {
            assert!(
                matches!(egress, Side::Pod(_)),
                "uplink frame sent to {egress:?}"
            );
            assert!(table.is_vip(vin.dst), "forwarded a frame not sent to a VIP");
            let backends = table.backend_keys();
            assert!(
                backends.contains(&(v.dst_addr(), l4.dst_port, v.protocol)),
                "DNAT to {}:{} which is no backend",
                v.dst_addr(),
                l4.dst_port
            );
        }
        Side::Pod(_) => {
            assert_eq!(egress, Side::Uplink, "reply sent to {egress:?}");
            assert!(
                table.find(v.src, v.protocol, l4.src_port).is_some(),
                "reply not from a frontend: {}:{}",
                v.src_addr(),
                l4.src_port
            );
        }
    }
}

/// Whether an IPv6 frame's upper-layer checksum (TCP, UDP, ICMPv6) verifies.
fn checksums6_ok(f: &[u8]) -> bool {
    let Ok(v) = packet6::parse6(f) else {
        return false;
    };
    let known =
        matches!(v.upper, packet6::Upper::Transport(_) | packet6::Upper::Icmp) && !v.fragment;
    known && packet6::upper_checksum(f, &v) == 0
}

/// [`check_verdict`]'s IPv6 half: a malformed frame is dropped as such; a transmitted
/// one parses, has its hop limit decremented once and its checksum still valid, and is
/// DNATed to an IPv6 backend (from the uplink) or comes from the IPv6 VIP (a reply).
fn check_verdict6(
    input: &[u8],
    out: &[u8],
    side: Side,
    verdict: Verdict,
    table: &ServiceTable,
    tally: &mut Tally,
) {
    let Ok(vin) = packet6::parse6(input) else {
        tally.malformed += 1;
        assert_eq!(verdict, Verdict::Drop(DropReason::Malformed));
        return;
    };
    let Verdict::Tx(egress) = verdict else {
        assert_eq!(
            out, input,
            "an IPv6 frame not transmitted was modified ({verdict:?})"
        );
        return;
    };
    assert_eq!(out.len(), input.len(), "IPv6 length changed");
    let v = packet6::parse6(out).expect("a transmitted IPv6 frame parses");
    assert_eq!(
        u16::from(v.hop_limit) + 1,
        u16::from(vin.hop_limit),
        "hop limit"
    );
    if checksums6_ok(input) || matches!(side, Side::Pod(_)) {
        // A Pod's (possibly partial) checksum is computed afresh.
        assert!(checksums6_ok(out), "IPv6 NAT left a bad checksum");
    }
    let backends: Vec<[u8; 16]> = B6.iter().map(|b| b.octets()).collect();
    match side {
        Side::Uplink => {
            assert!(
                matches!(egress, Side::Pod(_)),
                "uplink frame sent to {egress:?}"
            );
            assert!(
                table.v6.is_vip(vin.dst),
                "forwarded an IPv6 frame not sent to a VIP"
            );
            assert!(backends.contains(&v.dst), "IPv6 DNAT to no backend");
        }
        Side::Pod(_) => {
            assert_eq!(egress, Side::Uplink, "IPv6 reply sent to {egress:?}");
            assert_eq!(v.src, VIP6.octets(), "IPv6 reply not from the VIP");
        }
    }
}

/// Engine inputs longer than this are cut (keeps one execution short).
pub const MAX_RECORDS: usize = 256;

/// A sequence of frames through a fast-path and a general-path engine. Panics on a
/// broken invariant.
pub fn check_engine(data: &[u8]) {
    let nb = neighbours();
    let mut fast = engine(true);
    let mut general = engine(false);
    let mut tally = Tally::default();
    let mut generation = 1;
    let mut now: u64 = 1_000;
    for record in Records(data).take(MAX_RECORDS) {
        let (side, advance_ms, frame) = match record {
            Record::SwapServices => {
                generation += 1;
                fast.set_services(service_table(generation));
                general.set_services(service_table(generation));
                continue;
            }
            Record::Frame {
                side,
                advance_ms,
                frame,
            } => (side, advance_ms, frame),
        };
        now += advance_ms;
        let (mut a, mut b) = (frame.to_vec(), frame.to_vec());
        let va = fast.process(&mut a, side, &nb, now);
        let vb = general.process(&mut b, side, &nb, now);
        assert_eq!(va, vb, "fast and general path verdicts differ");
        assert_eq!(a, b, "fast and general path rewrites differ");
        check_verdict(frame, &a, side, va, fast.services(), &mut tally);
        let missing_a: Vec<_> = fast.missing.take().collect();
        let missing_b: Vec<_> = general.missing.take().collect();
        assert_eq!(missing_a, missing_b, "next hops to resolve differ");
        let missing_a: Vec<_> = fast.take_missing6().collect();
        let missing_b: Vec<_> = general.take_missing6().collect();
        assert_eq!(missing_a, missing_b, "IPv6 next hops to resolve differ");
        assert_eq!(fast.sweep(now, 4), general.sweep(now, 4), "sweeps differ");
        assert!(fast.flows().len() <= fast.flows().capacity());
        assert_eq!(
            fast.flows().len(),
            general.flows().len(),
            "flow counts differ"
        );
    }
    let (ca, cb) = (fast.counters(), general.counters());
    assert_eq!(ca.drops, cb.drops, "drop counters differ");
    assert_eq!(&ca.services, &cb.services, "service counters differ");
    assert_eq!(
        fast.service_counters6(),
        general.service_counters6(),
        "IPv6 service counters differ"
    );
    assert_eq!(
        ca.rx_packets, tally.frames,
        "every frame counted as received"
    );
    assert_eq!(ca.kernel_bound, tally.passed, "every pass counted");
    // Held fragments whose first fragment never came are dropped by the sweep, after
    // their own verdict (Consumed): counted apart.
    let swept = ca.drops_for(DropReason::FragmentExpired);
    assert_eq!(
        ca.drops.iter().sum::<u64>() - swept,
        tally.dropped,
        "every drop counted once"
    );
    assert_eq!(ca.drops_for(DropReason::Malformed), tally.malformed);
}

/// One frame through the IPv6 views: an accepted frame's offsets stay inside it, ports
/// are read only from an unfragmented TCP/UDP packet, and NAT both ways keeps a valid
/// upper-layer checksum valid and re-parses to the updated view.
pub fn check_packet6(frame: &[u8]) {
    use juneau_dataplane::packet6::{self as p6, Side6, Upper};
    let Ok(v) = p6::parse6(frame) else { return };
    assert!(v.l4_offset() <= v.end() && v.end() <= frame.len());
    assert_eq!(
        v.l4.is_some(),
        matches!(v.upper, Upper::Transport(_)) && !v.fragment
    );
    if let Some(e) = p6::parse_icmp6_error(frame, &v) {
        assert!(e.inner_offset + p6::IPV6_HEADER_LEN <= frame.len());
    }
    let Some(l4) = v.l4 else { return };
    let valid = p6::upper_checksum(frame, &v) == 0 && !l4.udp_no_checksum;
    let (mut g, mut w) = (frame.to_vec(), v);
    let pod = [0xfd, 0, 0, 0x0a, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5];
    p6::rewrite6(&mut g, &mut w, Side6::Destination, pod, 8080);
    assert_eq!(p6::parse6(&g), Ok(w), "IPv6 DNAT view");
    assert!(
        !valid || p6::upper_checksum(&g, &w) == 0,
        "IPv6 DNAT checksum"
    );
    p6::rewrite6(&mut g, &mut w, Side6::Source, v.dst, l4.dst_port);
    assert_eq!(p6::parse6(&g), Ok(w), "IPv6 reverse NAT view");
    assert!(
        !valid || p6::upper_checksum(&g, &w) == 0,
        "IPv6 reverse NAT checksum"
    );
}

#[cfg(test)]
mod tests {
    /// The committed seeds hold every invariant (what `tests/fuzz.sh` starts from), and
    /// so do large TCP and UDP packets built here, which the cutting checks need.
    #[test]
    fn seeds_and_large_packets_hold_every_invariant() {
        // The package's directory as cargo runs the test (`CARGO_MANIFEST_DIR` at run time), else
        // the one it was compiled in: a binary reused from another checkout sharing
        // `CARGO_TARGET_DIR` has a baked-in path that may be gone (tests/src/lib.rs, `repo_root`).
        let dir: std::path::PathBuf = std::env::var_os("CARGO_MANIFEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
        let dir = dir.join("seeds/dataplane-packet");
        for e in std::fs::read_dir(dir).unwrap() {
            super::check_packet(&std::fs::read(e.unwrap().path()).unwrap());
        }
        for (proto, len, df) in [(6u8, 5000usize, true), (17, 4000, false), (17, 3000, true)] {
            let total = 20 + len;
            let mut f = vec![0u8; 14 + total];
            f[12] = 8;
            f[14] = 0x45;
            f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
            f[20] = if df { 0x40 } else { 0 };
            f[22] = 64;
            f[23] = proto;
            f[26..30].copy_from_slice(&[10, 0, 0, 1]);
            f[30..34].copy_from_slice(&[10, 0, 0, 2]);
            if proto == 6 {
                f[46] = 0x50;
                f[47] = 0x19;
            } else {
                f[38..40].copy_from_slice(&(len as u16).to_be_bytes());
            }
            for (i, b) in f[54..].iter_mut().enumerate() {
                *b = (i * 31) as u8;
            }
            super::check_packet(&f);
        }
    }
}
