//! Cost of a reader's lookups on a published table: the per-batch generation check,
//! the direct seqlock-validated lookup in shared memory, and a pick on a private
//! snapshot (what the dataplane does for a new flow).

use std::net::Ipv4Addr;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use juneau_control::shm::{Capacity, NodeStateReader, NodeStateWriter};
use juneau_control::*;

fn state(services: usize) -> NodeState {
    NodeState {
        node: "bench".into(),
        services: (0..services)
            .map(|i| NodeService {
                frontend: Frontend {
                    vip: Ipv4Addr::new(203, 0, 113, (i % 250) as u8),
                    protocol: Protocol::Tcp,
                    port: 80 + (i / 250) as u16,
                },
                backends: (0..4)
                    .map(|b| LocalBackend {
                        ip: Ipv4Addr::new(10, 244, (i % 250) as u8, b + 1),
                        port: 8080,
                    })
                    .collect(),
                terminating: Vec::new(),
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: false,
            })
            .collect(),
        ..NodeState::default()
    }
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let st = state(256);
    w.publish(&st).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let snap = r.snapshot().unwrap();
    let f = st.services[137].frontend;
    let idx = snap.service_index(&f).unwrap();
    let mut h = 0u64;
    c.bench_function("generation_check", |b| b.iter(|| black_box(r.generation())));
    c.bench_function("shm_direct_lookup_256_services", |b| {
        b.iter(|| {
            h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
            black_box(r.lookup(black_box(&f), h))
        })
    });
    c.bench_function("snapshot_pick", |b| {
        b.iter(|| {
            h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
            black_box(snap.pick(black_box(idx), h))
        })
    });
    c.bench_function("snapshot_copy_256_services", |b| {
        b.iter(|| black_box(r.snapshot().unwrap().generation))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
