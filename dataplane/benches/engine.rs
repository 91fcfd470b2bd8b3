//! Userspace cost per packet of the forwarding engine (no I/O): parse, flow lookup,
//! NAT rewrite, TTL, MACs. `cargo bench -p juneau-dataplane --bench engine`.

use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::{criterion_group, criterion_main, Criterion};
use juneau_dataplane::engine::{Engine, Verdict};
use juneau_dataplane::neigh::{Neighbours, Side};
use juneau_dataplane::packet::{self};

mod common;
use common::{udp, B, CLIENT, VIP};

fn setup(recompute: bool) -> (Engine, Neighbours) {
    common::setup(recompute, 1 << 20)
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

/// The redirect channel's MAC (docs/security.md, "Redirect channel"): what a tag costs
/// per redirected packet on each side, against the same frame untagged (version 2).
fn redirect_mac(c: &mut Criterion) {
    use juneau_control::model::RedirectKey;
    use juneau_control::secret::SecretKey;
    use juneau_dataplane::redirect::{HopList, RedirectOut};
    use juneau_dataplane::redirect_wire::{encapsulate, parse, verify};
    let key = RedirectKey::new(SecretKey::new([7; 16]));
    let out = |frame_len| RedirectOut {
        peer: 0x0a00_0002,
        macs: [1; 12],
        hops: HopList::from_slice(&[0x0a00_0001]).expect("one hop"),
        ask: true,
        frame_len,
        entropy: 9,
        cookie: 42,
    };
    for (name, len) in [("64B", 22), ("1514B", 1444)] {
        let inner = udp(CLIENT, 40000, VIP, 53, len);
        let mut buf = vec![0u8; 2048];
        for (label, k) in [("untagged", None), ("tagged", Some(&key))] {
            c.bench_function(&format!("redirect_encapsulate_{label}_{name}"), |b| {
                b.iter(|| {
                    buf[..inner.len()].copy_from_slice(&inner);
                    black_box(encapsulate(
                        &mut buf,
                        &out(inner.len()),
                        0x0a00_0001,
                        7411,
                        9000,
                        k,
                    ))
                })
            });
        }
        buf[..inner.len()].copy_from_slice(&inner);
        let n = encapsulate(
            &mut buf,
            &out(inner.len()),
            0x0a00_0001,
            7411,
            9000,
            Some(&key),
        )
        .expect("fits");
        let frame = buf[..n].to_vec();
        let keys = [key.clone()];
        let r = parse(&frame).expect("a redirect frame");
        assert!(verify(&frame, &r, &keys));
        c.bench_function(&format!("redirect_verify_{name}"), |b| {
            b.iter(|| black_box(verify(black_box(&frame), &r, &keys)))
        });
    }
}

criterion_group!(benches, bench, redirect_mac);
criterion_main!(benches);
