//! Userspace cost per packet of the forwarding engine (no I/O): parse, flow lookup,
//! NAT rewrite, TTL, MACs. `cargo bench -p juneau-dataplane --bench engine`.

use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::{criterion_group, criterion_main, Criterion};
use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_dataplane::engine::{Engine, EngineConfig, Verdict};
use juneau_dataplane::neigh::{Iface, Neighbours, Route, Side};
use juneau_dataplane::packet::{self, MacAddr, Parsed};
use juneau_dataplane::services::ServiceTable;

const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const B: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 5);
const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, payload: usize) -> Vec<u8> {
    let total = 28 + payload;
    let mut f = vec![0u8; 14 + total];
    f[12..14].copy_from_slice(&[0x08, 0]);
    f[14] = 0x45;
    f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&src.octets());
    f[30..34].copy_from_slice(&dst.octets());
    let c = packet::ipv4_header_checksum(&f[14..34]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    if let Ok(Parsed::Ipv4(v)) = packet::parse(&f) {
        packet::fill_l4_checksum(&mut f, &v);
    }
    f
}

fn setup(recompute: bool) -> (Engine, Neighbours) {
    let mut state = NodeState {
        node: "n".into(),
        services: vec![NodeService {
            frontend: Frontend {
                vip: VIP,
                protocol: Protocol::Udp,
                port: 53,
            },
            backends: vec![LocalBackend { ip: B, port: 5353 }],
        }],
        ..Default::default()
    };
    state.normalize();
    let mut e = Engine::new(EngineConfig {
        flow_capacity: 1 << 20,
        recompute_pod_checksums: recompute,
        ..Default::default()
    });
    e.set_services(ServiceTable::new(1, &state, &[vec![0; 65537]]));
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
        gateway: Some(u32::from(Ipv4Addr::new(192, 0, 2, 254))),
        ifindex: 1,
    });
    nb.add_route(Route {
        prefix: u32::from(B),
        len: 32,
        gateway: None,
        ifindex: 2,
    });
    nb.add_neighbour(u32::from(Ipv4Addr::new(192, 0, 2, 254)), 1, MacAddr([1; 6]));
    nb.add_neighbour(u32::from(B), 2, MacAddr([2; 6]));
    (e, nb)
}

fn bench(c: &mut Criterion) {
    let frame = udp(CLIENT, 40000, VIP, 53, 22); // 64-byte frame
    c.bench_function("parse_64B", |b| {
        b.iter(|| black_box(packet::parse(black_box(&frame))))
    });

    // Forward, established flow, 256 flows round robin.
    let (mut e, nb) = setup(true);
    let frames: Vec<Vec<u8>> = (0..256)
        .map(|i| udp(CLIENT, 10000 + i, VIP, 53, 22))
        .collect();
    for f in &frames {
        let mut g = f.clone();
        assert!(matches!(
            e.process(&mut g, Side::Uplink, &nb, 0),
            Verdict::Tx(_)
        ));
    }
    let mut buf = frames[0].clone();
    let mut i = 0usize;
    c.bench_function("forward_hit_64B_256flows", |b| {
        b.iter(|| {
            i = (i + 1) & 255;
            buf.copy_from_slice(&frames[i]);
            black_box(e.process(&mut buf, Side::Uplink, &nb, 1))
        })
    });

    // Reverse, with L4 checksum recomputation (default) and incremental.
    for (name, recompute) in [
        ("reverse_hit_64B_recompute", true),
        ("reverse_hit_64B_incremental", false),
    ] {
        let (mut e, nb) = setup(recompute);
        let mut f = udp(CLIENT, 40000, VIP, 53, 22);
        e.process(&mut f, Side::Uplink, &nb, 0);
        let reply = udp(B, 5353, CLIENT, 40000, 22);
        let mut buf = reply.clone();
        c.bench_function(name, |b| {
            b.iter(|| {
                buf.copy_from_slice(&reply);
                black_box(e.process(&mut buf, Side::Pod(0), &nb, 1))
            })
        });
    }
    let (mut e, nb) = setup(true);
    let mut f = udp(CLIENT, 40000, VIP, 53, 22);
    e.process(&mut f, Side::Uplink, &nb, 0);
    let reply = udp(B, 5353, CLIENT, 40000, 1444); // 1500-byte IP packet
    let mut buf = reply.clone();
    c.bench_function("reverse_hit_1514B_recompute", |b| {
        b.iter(|| {
            buf.copy_from_slice(&reply);
            black_box(e.process(&mut buf, Side::Pod(0), &nb, 1))
        })
    });

    // New flows: a fresh 5-tuple per packet, 1 ms of virtual time per packet, the
    // loop's sweep budget per packet (steady state ~ UDP timeout worth of flows).
    let (mut e, nb) = setup(true);
    let mut n: u32 = 0;
    let mut now = 0u64;
    c.bench_function("new_flow_64B", |b| {
        b.iter(|| {
            n = n.wrapping_add(1);
            now += 1;
            let src = Ipv4Addr::from(0x0a00_0000 | (n >> 16));
            let mut g = udp(src, n as u16, VIP, 53, 22);
            let v = e.process(&mut g, Side::Uplink, &nb, now);
            e.sweep(now, 64);
            black_box(v)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
