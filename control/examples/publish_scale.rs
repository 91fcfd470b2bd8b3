//! Times one publish of a node state at scale: N services x 3 Ready backends,
//! one advertised VIP each, into a state file in a temporary directory (`TMPDIR`).
//!
//! `cargo run --release -p juneau-control --example publish_scale -- [N] [rounds]`
//!
//! Prints the first publish (creates the file), then `rounds` publishes where one
//! service's backends changed, then `rounds` where nothing changed (the agent skips
//! those, but the writer's cost for them is its floor), a reader's first snapshot, then
//! `rounds` more and `rounds` routing snapshots (what juneau-bgp reads). For the
//! publishes where one service changed, also the median of each step
//! ([`PublishPhase`], from [`NodeStateWriter::publish_traced`]).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use juneau_control::shm::{Capacity, NodeStateReader, NodeStateWriter, PublishPhase};
use juneau_control::*;

fn state(services: usize, generation: u32) -> NodeState {
    let vip = |i: usize| Ipv4Addr::from(0xcb00_0000u32 + i as u32);
    NodeState {
        node: "node-a".into(),
        router_id: Some(Ipv4Addr::new(10, 0, 0, 1)),
        services: (0..services)
            .map(|i| {
                // One service's endpoints move with `generation`.
                let g = if i == services / 2 { generation } else { 0 };
                NodeService::new(
                    Frontend {
                        vip: vip(i),
                        protocol: Protocol::Tcp,
                        port: 80,
                    },
                    (0..3u32)
                        .map(|b| LocalBackend {
                            ip: Ipv4Addr::from(0x0af4_0000u32 + (i as u32) * 4 + b + g * 7),
                            port: 8080,
                        })
                        .collect(),
                )
            })
            .collect(),
        advertised: (0..services)
            .map(|i| AdvertisedVip {
                vip: vip(i).into(),
                communities: vec![],
                large_communities: vec![],
                local_pref: None,
                peers: vec![],
                weight: None,
            })
            .collect(),
        peers: vec![PeerConfig::new(
            "router",
            Ipv4Addr::new(10, 0, 0, 2),
            64512,
            64513,
        )],
        ..NodeState::default()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse().expect("N")).unwrap_or(10_000);
    let rounds: u32 = args.next().map(|a| a.parse().expect("rounds")).unwrap_or(5);
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("node-a.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).expect("writer");
    let t = Instant::now();
    w.publish(&state(n, 0)).expect("first publish");
    println!("{n} services: first publish (new file) {:?}", t.elapsed());
    let states: Vec<NodeState> = (1..=rounds).map(|g| state(n, g)).collect();
    let mut changed = Vec::new();
    let mut phases: BTreeMap<PublishPhase, Vec<Duration>> = BTreeMap::new();
    for s in &states {
        let t = Instant::now();
        let mut last = t;
        w.publish_traced(s, &mut |p| {
            let now = Instant::now();
            phases.entry(p).or_default().push(now - last);
            last = now;
        })
        .expect("publish");
        changed.push(t.elapsed());
    }
    println!(
        "one service changed: median {:?} of {changed:?}",
        median(changed.clone())
    );
    let steps: Vec<String> = phases
        .into_iter()
        .map(|(p, v)| format!("{p:?} {:?}", median(v)))
        .collect();
    println!("  steps (medians): {}", steps.join(", "));
    let last = states.last().expect("rounds >= 1");
    let mut same = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        w.publish(last).expect("publish");
        same.push(t.elapsed());
    }
    println!("nothing changed: median {:?}", median(same));
    let meta = std::fs::metadata(&path).expect("stat");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "state file {:.1} MiB long, {:.1} MiB allocated (never-written capacity stays a hole)",
        mib(meta.len()),
        mib(std::os::unix::fs::MetadataExt::blocks(&meta) * 512)
    );
    let mut r = NodeStateReader::open(&path).expect("reader");
    let t = Instant::now();
    let snap = r.snapshot().expect("snapshot");
    println!(
        "reader snapshot {:?} ({} services; the reader's first)",
        t.elapsed(),
        snap.state.services.len()
    );
    drop(snap);
    // The same reader again (as the dataplane and juneau-bgp read each generation).
    let timed = |r: &mut NodeStateReader, routing: bool| {
        let t = Instant::now();
        let snap = if routing {
            r.routing_snapshot()
        } else {
            r.snapshot()
        };
        let took = t.elapsed();
        drop(snap.expect("snapshot"));
        took
    };
    let full: Vec<Duration> = (0..rounds).map(|_| timed(&mut r, false)).collect();
    let routing: Vec<Duration> = (0..rounds).map(|_| timed(&mut r, true)).collect();
    println!(
        "then: snapshot median {:?}, routing snapshot (juneau-bgp's) median {:?}",
        median(full),
        median(routing)
    );
}
