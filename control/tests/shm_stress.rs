//! Multi-process proof of the shared-memory protocol: one writer process republishes
//! changing, self-checking tables (growing the file now and then, which renames a new
//! file over the old one) while several reader processes verify every table they see.
//! A table is self-checking because all of its contents derive from a seed stored in it
//! (`router_id`): a reader regenerates the expected table from the seed and compares.
//! Bounded in time; fails on any torn or inconsistent read.
//!
//! Runs with `harness = false`: the same binary re-executes itself in the `writer` and
//! `reader` roles.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use juneau_control::shm::{Capacity, NodeStateReader, NodeStateWriter};
use juneau_control::*;

const READERS: usize = 3;
const RUN: Duration = Duration::from_secs(4);

/// The table for `seed`: four consecutive seeds share most of it (the base table of
/// `seed / 4`) and differ only in the router ID and one backend's port (so in one
/// Maglev table), so the writer — which stores only the words that differ from what
/// the slot held two publishes ago — skips most of the slot half the time while
/// readers copy it; from one group to the next everything changes, and sizes vary so
/// publishes cross capacity limits.
fn table(seed: u32) -> NodeState {
    let mut s = base_table(seed / 4);
    s.router_id = Some(Ipv4Addr::from(seed));
    if let Some(b) = s
        .services
        .iter_mut()
        .find_map(|svc| svc.backends.first_mut())
    {
        b.port = b.port.wrapping_add((seed & 3) as u16 * 1000);
    }
    s.normalize();
    s
}

fn base_table(seed: u32) -> NodeState {
    let n_services = 1 + (seed % 7) as usize + if seed.is_multiple_of(97) { 80 } else { 0 };
    let services = (0..n_services)
        .map(|i| NodeService {
            frontend: Frontend {
                vip: Ipv4Addr::new(203, 0, 113, (i % 250) as u8),
                protocol: if i % 2 == 0 {
                    Protocol::Tcp
                } else {
                    Protocol::Udp
                },
                port: 1000 + i as u16,
            },
            backends: (0..(seed as usize + i) % 5)
                .map(|b| LocalBackend {
                    ip: Ipv4Addr::from(
                        0x0af4_0000 + seed.wrapping_mul(31).wrapping_add(b as u32) % 65536,
                    ),
                    port: (seed % 60000) as u16 + b as u16,
                })
                .collect(),
            terminating: Vec::new(),
            source_ranges: {
                let mut r: Vec<SourceRange> = (0..(seed as usize + i) % 3)
                    .filter_map(|r| {
                        SourceRange::new(
                            Ipv4Addr::from(seed.wrapping_mul(7919) ^ r as u32),
                            8 * r as u8 + 8,
                        )
                    })
                    .collect();
                r.sort();
                r.dedup();
                r
            },
            client_ip_affinity: (i % 3 == 1).then_some(seed % 86_400 + 1),
            hand_off: false,
            host_network: false,
        })
        .collect();
    let advertised = (0..(seed % 4) as usize)
        .map(|i| AdvertisedVip {
            vip: Ipv4Addr::new(203, 0, 113, i as u8).into(),
            communities: vec![seed; i],
            large_communities: vec![[seed, i as u32, 7]; i.min(2)],
            local_pref: (i % 2 == 0).then_some(seed),
            peers: vec![],
            weight: None,
        })
        .collect();
    let peers = (0..(seed % 3) as usize)
        .map(|i| {
            PeerConfig::new(
                format!("peer-{seed}-{i}"),
                Ipv4Addr::new(192, 0, 2, i as u8 + 1),
                65000,
                seed,
            )
        })
        .collect();
    // IPv6 frontends (layout 10) vary in number too, so growth crosses their capacity.
    let services6 = (0..(seed % 3) as usize)
        .map(|i| {
            let mut s6 = NodeService6::new(
                Frontend6 {
                    vip: Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, i as u16 + 1),
                    protocol: Protocol::Tcp,
                    port: 443,
                },
                (0..(seed as usize + i) % 4)
                    .map(|b| LocalBackend6 {
                        ip: Ipv6Addr::new(0x2001, 0xdb8, 0x244, 0, 0, 0, seed as u16, b as u16 + 1),
                        port: 8443,
                    })
                    .collect(),
            );
            s6.source_ranges = (0..i)
                .map(|r| {
                    ipnet::Ipv6Net::new(Ipv6Addr::new(0x2001, 0xdb8, r as u16, 0, 0, 0, 0, 0), 48)
                        .unwrap()
                })
                .collect();
            s6
        })
        .collect();
    let mut s = NodeState {
        node: format!("node-{seed}"),
        router_id: Some(Ipv4Addr::from(seed)),
        services,
        services6,
        advertised,
        peers,
        // Redirect peers vary in number too, so growth crosses their capacity as well.
        redirects: Redirects {
            node_address: seed.is_multiple_of(2).then(|| Ipv4Addr::from(seed | 1)),
            vips: (0..seed % 4)
                .map(|v| VipRedirectPeers {
                    vip: Ipv4Addr::new(203, 0, 113, v as u8),
                    nodes: (0..(seed / 4) % 5)
                        .map(|n| Ipv4Addr::new(192, 0, 2, (n + 1) as u8))
                        .collect(),
                })
                .collect(),
            vips6: (0..seed % 3)
                .map(|v| juneau_control::model::VipRedirectPeers6 {
                    vip: std::net::Ipv6Addr::new(0x2001, 0xdb8, 0x71, 0, 0, 0, 0, v as u16 + 1),
                    nodes: (0..(seed / 3) % 4)
                        .map(|n| Ipv4Addr::new(192, 0, 2, (n + 1) as u8))
                        .collect(),
                })
                .collect(),
            // MAC keys (layout 6) come and go too.
            keys: (0..seed % 3)
                .map(|k| {
                    juneau_control::RedirectKey::new(juneau_control::secret::SecretKey::new(
                        [(seed + k) as u8; 16],
                    ))
                })
                .collect(),
        },
    };
    s.normalize();
    s
}

fn writer(path: &Path, deadline: Instant) -> Result<(), String> {
    let small = Capacity {
        services: 4,
        backends: 8,
        vips: 2,
        peers: 1,
        // A small prime keeps Maglev builds cheap, so the writer republishes fast.
        maglev_size: 61,
        redirect_vips: 1,
        redirect_nodes: 2,
        source_ranges: 1,
        services6: 1,
        backends6: 2,
        source_ranges6: 1,
    };
    let mut w = NodeStateWriter::create(path, small).map_err(|e| e.to_string())?;
    let mut seed = 1u32;
    while Instant::now() < deadline {
        w.publish(&table(seed)).map_err(|e| e.to_string())?;
        seed += 1;
    }
    println!(
        "writer: published {} tables, final capacity {:?}",
        seed - 1,
        w.capacity()
    );
    Ok(())
}

fn reader(path: &Path, deadline: Instant) -> Result<(), String> {
    let mut r = loop {
        match NodeStateReader::open(path) {
            Ok(r) => break r,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => return Err(format!("reader never opened the file: {e}")),
        }
    };
    let (mut seen, mut verified, mut contended, mut last_gen) = (0u64, 0u64, 0u64, 0u64);
    let mut last_seed = 0u32;
    while Instant::now() < deadline {
        let g = r.generation();
        if g == last_gen {
            continue;
        }
        last_gen = g;
        seen += 1;
        let snap = match r.snapshot() {
            Ok(s) => s,
            Err(juneau_control::shm::ShmError::Contended(_)) => {
                contended += 1;
                continue;
            }
            Err(e) => return Err(format!("snapshot failed: {e}")),
        };
        let seed = u32::from(snap.state.router_id.ok_or("table without seed")?);
        if snap.state != table(seed) {
            return Err(format!(
                "TORN: table of generation {} does not match its seed {seed}",
                snap.generation
            ));
        }
        if seed < last_seed {
            return Err(format!("went back in time: seed {seed} after {last_seed}"));
        }
        last_seed = seed;
        // The direct lookup must agree with the snapshot, or see a newer table.
        for (i, s) in snap.state.services.iter().enumerate() {
            let h = u64::from(seed) * 7919;
            let direct = r.lookup(&s.frontend, h);
            if r.generation() == snap.generation && direct != snap.pick(i, h) {
                return Err(format!(
                    "lookup disagrees with snapshot at generation {}",
                    snap.generation
                ));
            }
        }
        verified += 1;
    }
    println!(
        "reader: {seen} generations noticed, {verified} verified, {contended} contended, 0 torn"
    );
    if verified == 0 {
        return Err("verified no table at all".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(role) = std::env::var_os("JUNEAU_SHM_STRESS_ROLE") {
        let path = std::env::var("JUNEAU_SHM_STRESS_PATH").expect("path");
        let deadline = Instant::now() + RUN;
        let res = match role.to_str() {
            Some("writer") => writer(Path::new(&path), deadline),
            _ => reader(Path::new(&path), deadline + Duration::from_millis(200)),
        };
        return match res {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{role:?}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    // Listing mode (`cargo test -- --list`): one test.
    if args.iter().any(|a| a == "--list") {
        println!("shm_stress: test");
        return ExitCode::SUCCESS;
    }
    println!("\nrunning 1 test");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stress.state");
    let spawn = |role: &str| {
        Command::new(&args[0])
            .env("JUNEAU_SHM_STRESS_ROLE", role)
            .env("JUNEAU_SHM_STRESS_PATH", &path)
            .spawn()
            .expect("spawn")
    };
    let w = spawn("writer");
    let readers: Vec<_> = (0..READERS).map(|_| spawn("reader")).collect();
    let mut ok = true;
    for mut c in std::iter::once(w).chain(readers) {
        ok &= c.wait().map(|s| s.success()).unwrap_or(false);
    }
    if ok {
        println!("test shm_stress ... ok\n\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n");
        ExitCode::SUCCESS
    } else {
        println!("test shm_stress ... FAILED\n\ntest result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n");
        ExitCode::FAILURE
    }
}
