//! Runs the parser and the forwarding engine over a generated corpus of malformed and
//! truncated frames (deterministic; the coverage-guided counterparts are the fuzz targets
//! in `fuzz/`, whose seed corpora [`fuzz_seeds`] generates from the same seed frames).
//!
//! The corpus: valid seed frames (TCP SYN/data, UDP, UDP without checksum, IP options,
//! fragments, ARP, IPv6, VLAN), every truncation of each, each byte of each replaced by
//! 0x00, 0xff and its bit-inverse, and 20 000 seeded random multi-byte mutations.
//! Nothing may panic; every frame that fails to parse is counted as `malformed`; every
//! frame the engine transmits parses again and carries correct checksums when the
//! input's were correct. Set `JUNEAU_FUZZ_CORPUS_DIR` to also write the whole corpus out
//! as single-frame inputs of the `dataplane-engine` fuzz target (its `Records` format).

use std::net::Ipv4Addr;

use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_dataplane::counters::DropReason;
use juneau_dataplane::engine::{Engine, EngineConfig, Verdict};
use juneau_dataplane::neigh::{Iface, Neighbours, Route, Side};
use juneau_dataplane::packet::{self, tcp_flags, MacAddr, Parsed, IPPROTO_TCP, IPPROTO_UDP};
use juneau_dataplane::services::ServiceTable;

const CLIENT: [u8; 4] = [192, 0, 2, 1];
const VIP: [u8; 4] = [203, 0, 113, 10];
const B1: [u8; 4] = [10, 1, 0, 5];

#[allow(clippy::too_many_arguments)]
fn frame(
    proto: u8,
    src: [u8; 4],
    sport: u16,
    dst: [u8; 4],
    dport: u16,
    payload: &[u8],
    options: &[u8],
    flags: u8,
) -> Vec<u8> {
    let ihl = 20 + options.len();
    let l4_len = if proto == IPPROTO_TCP { 20 } else { 8 } + payload.len();
    let total = ihl + l4_len;
    let mut f = vec![0u8; 14 + total];
    f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
    f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f[14] = 0x40 | (ihl / 4) as u8;
    f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
    f[22] = 64;
    f[23] = proto;
    f[26..30].copy_from_slice(&src);
    f[30..34].copy_from_slice(&dst);
    f[34..34 + options.len()].copy_from_slice(options);
    let c = packet::ipv4_header_checksum(&f[14..14 + ihl]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    let l4 = 14 + ihl;
    f[l4..l4 + 2].copy_from_slice(&sport.to_be_bytes());
    f[l4 + 2..l4 + 4].copy_from_slice(&dport.to_be_bytes());
    if proto == IPPROTO_TCP {
        f[l4 + 12] = 0x50;
        f[l4 + 13] = flags;
        f[l4 + 20..].copy_from_slice(payload);
    } else {
        f[l4 + 4..l4 + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        f[l4 + 8..].copy_from_slice(payload);
    }
    if let Ok(Parsed::Ipv4(v)) = packet::parse(&f) {
        packet::fill_l4_checksum(&mut f, &v);
    }
    f
}

fn seeds() -> Vec<(Vec<u8>, Side)> {
    let mut s = vec![
        (
            frame(
                IPPROTO_TCP,
                CLIENT,
                40000,
                VIP,
                80,
                b"",
                &[],
                tcp_flags::SYN,
            ),
            Side::Uplink,
        ),
        (
            frame(
                IPPROTO_TCP,
                CLIENT,
                40000,
                VIP,
                80,
                b"GET / HTTP/1.1\r\n\r\n",
                &[],
                tcp_flags::ACK,
            ),
            Side::Uplink,
        ),
        (
            frame(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"query", &[], 0),
            Side::Uplink,
        ),
        (
            frame(
                IPPROTO_TCP,
                CLIENT,
                40000,
                VIP,
                80,
                b"",
                &[1, 1, 1, 0],
                tcp_flags::SYN,
            ),
            Side::Uplink,
        ),
        (
            frame(
                IPPROTO_TCP,
                B1,
                8080,
                CLIENT,
                40000,
                b"HTTP/1.1 200 OK",
                &[],
                tcp_flags::ACK,
            ),
            Side::Pod(0),
        ),
        (
            frame(IPPROTO_UDP, B1, 5353, CLIENT, 5353, b"answer", &[], 0),
            Side::Pod(0),
        ),
    ];
    let mut nocsum = frame(IPPROTO_UDP, CLIENT, 5354, VIP, 53, b"q", &[], 0);
    nocsum[40..42].copy_from_slice(&[0, 0]);
    s.push((nocsum, Side::Uplink));
    let mut frag = frame(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"fragmented", &[], 0);
    frag[20] = 0x20;
    s.push((frag, Side::Uplink));
    // ICMP errors: "fragmentation needed" to the VIP quoting a reply, and a backend's
    // port unreachable quoting a DNATed packet.
    let icmp = |src: [u8; 4], dst: [u8; 4], code: u8, quoted: &[u8]| {
        let quote = &quoted[14..(14 + 28).min(quoted.len())];
        let total = 28 + quote.len();
        let mut f = vec![0u8; 14 + total];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
        f[22] = 64;
        f[23] = 1;
        f[26..30].copy_from_slice(&src);
        f[30..34].copy_from_slice(&dst);
        let c = packet::ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f[34] = 3;
        f[35] = code;
        f[42..].copy_from_slice(quote);
        f
    };
    let reply = frame(IPPROTO_UDP, VIP, 53, CLIENT, 5353, b"answer", &[], 0);
    s.push((icmp([198, 51, 100, 1], VIP, 4, &reply), Side::Uplink));
    let dnat = frame(IPPROTO_UDP, CLIENT, 5353, B1, 5353, b"query", &[], 0);
    s.push((icmp(B1, CLIENT, 3, &dnat), Side::Pod(0)));
    let mut arp = vec![0u8; 42];
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    s.push((arp, Side::Uplink));
    let mut v6 = vec![0u8; 74];
    v6[12..14].copy_from_slice(&[0x86, 0xdd]);
    v6[14] = 0x60;
    s.push((v6, Side::Uplink));
    let mut vlan = frame(IPPROTO_UDP, CLIENT, 1, VIP, 53, b"", &[], 0);
    vlan[12..14].copy_from_slice(&[0x81, 0x00]);
    s.push((vlan, Side::Uplink));
    s
}

fn corpus() -> Vec<(Vec<u8>, Side)> {
    let mut out = Vec::new();
    for (f, side) in seeds() {
        for cut in 0..f.len() {
            out.push((f[..cut].to_vec(), side));
        }
        for i in 0..f.len() {
            for v in [0x00, 0xff, !f[i]] {
                let mut g = f.clone();
                g[i] = v;
                out.push((g, side));
            }
        }
        out.push((f, side));
    }
    let seeds = seeds();
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let (f, side) = &seeds[(rnd() % seeds.len() as u64) as usize];
        let mut g = f.clone();
        for _ in 0..1 + rnd() % 4 {
            let i = (rnd() % g.len() as u64) as usize;
            g[i] = rnd() as u8;
        }
        let cut = (rnd() % (g.len() as u64 + 1)) as usize;
        if rnd() % 3 == 0 {
            g.truncate(cut);
        }
        out.push((g, *side));
    }
    out
}

fn engine() -> (Engine, Neighbours) {
    let mut state = NodeState {
        node: "n".into(),
        services: vec![
            NodeService {
                frontend: Frontend {
                    vip: Ipv4Addr::from(VIP),
                    protocol: Protocol::Tcp,
                    port: 80,
                },
                backends: vec![LocalBackend {
                    ip: Ipv4Addr::from(B1),
                    port: 8080,
                }],
                terminating: Vec::new(),
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: false,
            },
            NodeService {
                frontend: Frontend {
                    vip: Ipv4Addr::from(VIP),
                    protocol: Protocol::Udp,
                    port: 53,
                },
                backends: vec![LocalBackend {
                    ip: Ipv4Addr::from(B1),
                    port: 5353,
                }],
                terminating: Vec::new(),
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: false,
            },
        ],
        ..Default::default()
    };
    state.normalize();
    let maglev = vec![vec![0u16; 13]; 2];
    let mut e = Engine::new(EngineConfig {
        flow_capacity: 4096,
        ..Default::default()
    });
    e.set_services(ServiceTable::new(1, &state, &maglev));
    let mut nb = Neighbours::new(
        Iface {
            ifindex: 1,
            mac: MacAddr([0xa; 6]),
        },
        vec![Iface {
            ifindex: 2,
            mac: MacAddr([0xb; 6]),
        }],
    );
    nb.add_route(Route {
        prefix: 0,
        len: 0,
        gateway: Some(u32::from_be_bytes([192, 0, 2, 254])),
        ifindex: 1,
    });
    nb.add_route(Route {
        prefix: u32::from_be_bytes(B1),
        len: 32,
        gateway: None,
        ifindex: 2,
    });
    nb.add_neighbour(u32::from_be_bytes([192, 0, 2, 254]), 1, MacAddr([0x11; 6]));
    nb.add_neighbour(u32::from_be_bytes(B1), 2, MacAddr([0x22; 6]));
    (e, nb)
}

fn checksums_ok(f: &[u8]) -> bool {
    let Ok(Parsed::Ipv4(v)) = packet::parse(f) else {
        return false;
    };
    let hdr = &f[14..14 + v.header_len];
    let stored_ip = u16::from_be_bytes([hdr[10], hdr[11]]);
    if stored_ip != packet::ipv4_header_checksum(hdr) {
        return false;
    }
    if v.l4.is_none() {
        return true;
    }
    let off = v.l4_offset() + if v.protocol == IPPROTO_TCP { 16 } else { 6 };
    let stored = u16::from_be_bytes([f[off], f[off + 1]]);
    (v.protocol == IPPROTO_UDP && stored == 0) || stored == packet::l4_checksum(f, &v)
}

#[test]
fn generated_corpus_never_panics_and_is_counted() {
    let corpus = corpus();
    if let Ok(dir) = std::env::var("JUNEAU_FUZZ_CORPUS_DIR") {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, (f, side)) in corpus.iter().enumerate() {
            if f.len() <= 255 {
                std::fs::write(
                    format!("{dir}/seed-{i:06}"),
                    engine_records(&[(*side, 0, f)]),
                )
                .unwrap();
            }
        }
    }
    let (mut e, nb) = engine();
    let mut parse_errors = 0u64;
    let mut transmitted = 0u64;
    for (i, (f, side)) in corpus.iter().enumerate() {
        // An IPv6 frame's parse error is the IPv6 path's (`packet6`).
        let parsed = packet::parse(f);
        let ipv6 = packet::ethertype(f) == Some(packet::ETHERTYPE_IPV6);
        parse_errors +=
            u64::from(parsed.is_err() || ipv6 && juneau_dataplane::packet6::parse6(f).is_err());
        let valid_in = checksums_ok(f);
        let mut g = f.clone();
        let verdict = e.process(&mut g, *side, &nb, i as u64);
        match verdict {
            Verdict::Tx(_) => {
                transmitted += 1;
                assert!(
                    packet::parse(&g).is_ok(),
                    "frame {i}: transmitted frame does not parse"
                );
                if valid_in {
                    assert!(
                        checksums_ok(&g),
                        "frame {i}: NAT broke a valid checksum: {f:02x?}"
                    );
                }
                assert_eq!(g.len(), f.len(), "frame {i}: length changed");
            }
            _ => assert_eq!(&g, f, "frame {i}: a frame not transmitted was modified"),
        }
    }
    assert_eq!(
        e.counters().drops_for(DropReason::Malformed),
        parse_errors,
        "every parse error is counted"
    );
    assert!(
        parse_errors > 1000,
        "corpus exercises parse errors: {parse_errors}"
    );
    assert!(
        transmitted > 100,
        "corpus still forwards valid frames: {transmitted}"
    );
    eprintln!(
        "{} frames: {parse_errors} malformed, {transmitted} transmitted",
        corpus.len()
    );
}

/// Engine fuzz input (`dataplane/fuzz/src/lib.rs`, `Records`): `ctl len frame`, `ctl` bit
/// 0 = from a Pod (bit 1: Pod 1), clock advance `(ctl >> 2)^4` ms; `0xff` swaps services.
fn engine_records(frames: &[(Side, u8, &[u8])]) -> Vec<u8> {
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

/// The fuzz targets' seed corpora, generated from the seed frames above: each frame
/// alone for the parser target; for the engine target each frame alone plus whole
/// exchanges (TCP handshake, data and close with replies from either backend, UDP
/// query/answer, ICMP errors both ways, a service-table swap mid-flow, a flow timing
/// out).
fn fuzz_seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, (f, side)) in seeds().iter().enumerate() {
        out.push(("dataplane-packet", format!("frame-{i:02}"), f.clone()));
        out.push((
            "dataplane-engine",
            format!("frame-{i:02}"),
            engine_records(&[(*side, 0, f)]),
        ));
    }
    for (name, f) in ipv6_frames() {
        out.push(("dataplane-packet", name.into(), f.clone()));
        out.push((
            "dataplane-engine",
            name.into(),
            engine_records(&[(Side::Uplink, 0, &f)]),
        ));
    }
    out.push(("dataplane-engine", "ipv6-exchange".into(), ipv6_exchange()));
    const B2: [u8; 4] = [10, 1, 0, 6];
    let tcp = |src, sport, dst, dport, payload: &[u8], flags| {
        frame(IPPROTO_TCP, src, sport, dst, dport, payload, &[], flags)
    };
    let (syn, ack) = (tcp_flags::SYN, tcp_flags::ACK);
    let fin = tcp_flags::FIN | ack;
    let c_syn = tcp(CLIENT, 40000, VIP, 80, b"", syn);
    let c_ack = tcp(CLIENT, 40000, VIP, 80, b"GET / HTTP/1.1\r\n\r\n", ack);
    let c_fin = tcp(CLIENT, 40000, VIP, 80, b"", fin);
    let b1_synack = tcp(B1, 8080, CLIENT, 40000, b"", syn | ack);
    let b2_synack = tcp(B2, 8080, CLIENT, 40000, b"", syn | ack);
    let b1_data = tcp(B1, 8080, CLIENT, 40000, b"HTTP/1.1 200 OK\r\n\r\n", ack);
    let b2_data = tcp(B2, 8080, CLIENT, 40000, b"HTTP/1.1 200 OK\r\n\r\n", ack);
    let b1_fin = tcp(B1, 8080, CLIENT, 40000, b"", fin);
    let b2_fin = tcp(B2, 8080, CLIENT, 40000, b"", fin);
    let (up, p0, p1) = (Side::Uplink, Side::Pod(0), Side::Pod(1));
    let handshake: Vec<(Side, u8, &[u8])> = vec![
        (up, 0, &c_syn),
        (p0, 1, &b1_synack),
        (p1, 1, &b2_synack),
        (up, 1, &c_ack),
        (p0, 1, &b1_data),
        (p1, 1, &b2_data),
        (up, 2, &c_fin),
        (p0, 1, &b1_fin),
        (p1, 1, &b2_fin),
    ];
    out.push((
        "dataplane-engine",
        "tcp-connection".into(),
        engine_records(&handshake),
    ));
    let mut swapped = engine_records(&handshake[..5]);
    swapped.push(0xff);
    swapped.extend(engine_records(&handshake[3..]));
    out.push(("dataplane-engine", "tcp-services-swapped".into(), swapped));
    let idle = engine_records(&[(up, 0, &c_syn), (p0, 1, &b1_synack), (up, 63, &c_ack)]);
    out.push(("dataplane-engine", "tcp-idle-timeout".into(), idle));
    let q = frame(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"query", &[], 0);
    let a1 = frame(IPPROTO_UDP, B1, 5353, CLIENT, 5353, b"answer", &[], 0);
    let a2 = frame(IPPROTO_UDP, B2, 5353, CLIENT, 5353, b"answer", &[], 0);
    out.push((
        "dataplane-engine",
        "udp-exchange".into(),
        engine_records(&[(up, 0, &q), (p0, 1, &a1), (p1, 1, &a2), (up, 20, &q)]),
    ));
    let s = seeds();
    // seeds() ends with: ICMP to the VIP, ICMP from a backend, ARP, IPv6, VLAN.
    let (icmp_in, icmp_out) = (&s[s.len() - 5].0, &s[s.len() - 4].0);
    out.push((
        "dataplane-engine",
        "icmp-errors".into(),
        engine_records(&[(up, 0, &q), (p0, 1, icmp_out), (up, 1, icmp_in)]),
    ));
    out
}

/// IPv6 seeds of the packet target (`packet6`'s views): a TCP SYN to the VIP, a UDP
/// query behind a Destination Options header, and a Packet Too Big quoting an answer.
fn ipv6_frames() -> Vec<(&'static str, Vec<u8>)> {
    let client: [u8; 16] = [0x20, 1, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42];
    let vip: [u8; 16] = [
        0x20, 1, 0x0d, 0xb8, 0, 0, 0, 0x71, 0, 0, 0, 0, 0, 0, 0, 0x10,
    ];
    // Ethernet + IPv6 from `src` to `dst`, `nh` first, `payload` after the fixed header.
    let v6 = |src: [u8; 16], dst: [u8; 16], nh: u8, payload: &[u8]| {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
        f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        f.extend_from_slice(&[nh, 64]);
        f.extend_from_slice(&src);
        f.extend_from_slice(&dst);
        f.extend_from_slice(payload);
        f
    };
    let syn = [
        0x9c, 0x40, 0, 80, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0,
    ];
    let mut query = vec![17, 0, 0, 0, 0, 0, 0, 0]; // Destination Options, then UDP
    query.extend_from_slice(&[0x14, 0xe9, 0, 53, 0, 16, 0, 0]);
    query.extend_from_slice(b"question");
    let answer = v6(vip, client, 6, &syn);
    let mut ptb = vec![2, 0, 0, 0, 0, 0, 0x05, 0];
    ptb.extend_from_slice(&answer[14..]);
    let router = [0x20, 1, 0x0d, 0xb8, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    vec![
        ("ipv6-tcp-syn", v6(client, vip, 6, &syn)),
        ("ipv6-udp-destopts", v6(client, vip, 60, &query)),
        ("ipv6-packet-too-big", v6(router, vip, 58, &ptb)),
    ]
}

/// An IPv6 connection for the engine target: the client's SYN to the IPv6 VIP, a
/// SYN-ACK from either IPv6 backend of the fuzz fixture (`fd00:1::5` on Pod interface 0,
/// `fd00:1::6` on 1), the client's ACK, and a Packet Too Big about the reply.
fn ipv6_exchange() -> Vec<u8> {
    let frames = ipv6_frames();
    let syn = &frames[0].1;
    let ptb = &frames[2].1;
    let client = &syn[22..38];
    let synack = |backend_last: u8| {
        let mut f = syn.clone();
        let mut backend = [0u8; 16];
        backend[..2].copy_from_slice(&[0xfd, 0]);
        backend[3] = 1;
        backend[15] = backend_last;
        f[22..38].copy_from_slice(&backend);
        f[38..54].copy_from_slice(client);
        f[54..56].copy_from_slice(&8080u16.to_be_bytes());
        f[56..58].copy_from_slice(&40000u16.to_be_bytes());
        f[54 + 13] = tcp_flags::SYN | tcp_flags::ACK;
        f
    };
    let mut ack = syn.clone();
    ack[54 + 13] = tcp_flags::ACK;
    let (b0, b1) = (synack(5), synack(6));
    engine_records(&[
        (Side::Uplink, 0, syn),
        (Side::Pod(0), 1, &b0),
        (Side::Pod(1), 1, &b1),
        (Side::Uplink, 1, &ack),
        (Side::Uplink, 1, ptb),
    ])
}

/// The committed seed corpora (`dataplane/fuzz/seeds/`) are exactly what
/// [`fuzz_seeds`] generates; `JUNEAU_WRITE_FUZZ_SEEDS=1` rewrites them.
#[test]
fn fuzz_seed_corpora_are_generated_from_the_seed_frames() {
    // The package's directory as cargo runs the test (`CARGO_MANIFEST_DIR` at run time), else
    // the one it was compiled in: a binary reused from another checkout sharing
    // `CARGO_TARGET_DIR` has a baked-in path that may be gone (tests/src/lib.rs, `repo_root`).
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
        .join("fuzz/seeds");
    let want = fuzz_seeds();
    if std::env::var_os("JUNEAU_WRITE_FUZZ_SEEDS").is_some() {
        for target in ["dataplane-packet", "dataplane-engine"] {
            let dir = root.join(target);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
        }
        for (target, name, bytes) in &want {
            std::fs::write(root.join(target).join(name), bytes).unwrap();
        }
    }
    let mut have = Vec::new();
    for target in ["dataplane-packet", "dataplane-engine"] {
        for e in std::fs::read_dir(root.join(target)).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            have.push((target, name, std::fs::read(e.path()).unwrap()));
        }
    }
    let mut want = want;
    want.sort();
    have.sort();
    assert!(
        want == have,
        "dataplane/fuzz/seeds is stale: regenerate with JUNEAU_WRITE_FUZZ_SEEDS=1 \
         cargo test -p juneau-dataplane --test corpus fuzz_seed"
    );
}
