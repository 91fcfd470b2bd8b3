use super::*;
use crate::model::*;

fn frontend(vip: [u8; 4], protocol: Protocol, port: u16) -> Frontend {
    Frontend {
        vip: Ipv4Addr::from(vip),
        protocol,
        port,
    }
}

fn backend(last: u8, port: u16) -> LocalBackend {
    LocalBackend {
        ip: Ipv4Addr::new(10, 244, 1, last),
        port,
    }
}

pub(crate) fn sample_state() -> NodeState {
    let mut peer = PeerConfig::new("tor-1", Ipv4Addr::new(192, 0, 2, 1), 65000, 65001);
    peer.md5_password = Some("s3cret".into());
    peer.graceful_restart_time = Some(120);
    peer.ebgp_multihop = Some(4);
    peer.source_address = Some(Ipv4Addr::new(192, 0, 2, 10));
    peer.bfd = Some(BfdSettings {
        min_rx_ms: 250,
        min_tx_ms: 100_000,
        multiplier: 7,
    });
    peer.drain = Some(DrainSettings {
        as_path_prepend: 3,
        local_pref: 7,
        wait_seconds: 65535,
    });
    let peer2 = PeerConfig {
        passive: true,
        ..PeerConfig::new("tor-2", Ipv4Addr::new(192, 0, 2, 2), 65000, 65001)
    };
    NodeState {
        node: "node-a".into(),
        router_id: Some(Ipv4Addr::new(192, 0, 2, 10)),
        services: vec![
            NodeService {
                frontend: frontend([203, 0, 113, 10], Protocol::Tcp, 80),
                backends: vec![backend(5, 80), backend(6, 80)],
                // backend 5 is Ready, so normalize() drops it from the draining list.
                terminating: vec![backend(9, 80), backend(5, 80)],
            },
            NodeService {
                frontend: frontend([203, 0, 113, 10], Protocol::Udp, 53),
                backends: vec![backend(7, 5353)],
                terminating: Vec::new(),
            },
            NodeService {
                frontend: frontend([203, 0, 113, 11], Protocol::Tcp, 443),
                backends: vec![],
                // Only draining backends: existing flows only, nothing to pick.
                terminating: vec![backend(8, 443)],
            },
        ],
        advertised: vec![AdvertisedVip {
            vip: Ipv4Addr::new(203, 0, 113, 10),
            communities: vec![65000 << 16 | 100],
            large_communities: vec![[65000, 1, 2]],
            local_pref: Some(200),
            peers: vec![1],
            weight: Some(3),
        }],
        peers: vec![peer, peer2],
        redirects: Redirects {
            node_address: Some(Ipv4Addr::new(192, 0, 2, 10)),
            vips: vec![
                VipRedirectPeers {
                    vip: Ipv4Addr::new(203, 0, 113, 11),
                    nodes: vec![Ipv4Addr::new(192, 0, 2, 12)],
                },
                VipRedirectPeers {
                    vip: Ipv4Addr::new(203, 0, 113, 10),
                    // Unsorted, with a duplicate: normalize() sorts and dedups.
                    nodes: vec![
                        Ipv4Addr::new(192, 0, 2, 13),
                        Ipv4Addr::new(192, 0, 2, 11),
                        Ipv4Addr::new(192, 0, 2, 13),
                    ],
                },
            ],
        },
    }
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn header_layout_is_stable() {
    assert_eq!(std::mem::size_of::<FileHeader>(), 104);
    assert_eq!(std::mem::offset_of!(FileHeader, generation), 56);
    assert_eq!(std::mem::offset_of!(FileHeader, slot_seq), 88);
    assert_eq!(MAGIC.to_le_bytes(), *b"JUNEAUNS");
}

#[test]
fn publish_then_snapshot_round_trips() {
    let dir = tmp();
    let path = dir.path().join("node-a.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut state = sample_state();
    let g = w.publish(&state).unwrap();
    assert_eq!(g, 1);
    let mut r = NodeStateReader::open(&path).unwrap();
    assert_eq!(r.generation(), 1);
    let snap = r.snapshot().unwrap();
    state.normalize();
    assert_eq!(snap.state, state);
    assert_eq!(snap.generation, 1);
    assert_eq!(snap.maglev.len(), 3);
    // The empty service has an all-empty table.
    let empty = snap
        .service_index(&frontend([203, 0, 113, 11], Protocol::Tcp, 443))
        .unwrap();
    assert_eq!(snap.pick(empty, 7), None);
}

#[test]
fn direct_lookup_agrees_with_snapshot() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let snap = r.snapshot().unwrap();
    for (i, s) in snap.state.services.iter().enumerate() {
        for h in 0..5000u64 {
            let hash = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            assert_eq!(
                r.lookup(&s.frontend, hash),
                snap.pick(i, hash),
                "{} hash {hash}",
                s.frontend
            );
        }
    }
    assert_eq!(
        r.lookup(&frontend([203, 0, 113, 10], Protocol::Tcp, 81), 1),
        None
    );
    assert_eq!(
        r.lookup(&frontend([203, 0, 113, 99], Protocol::Tcp, 80), 1),
        None
    );
    // Both backends of the TCP service get flows.
    let f = frontend([203, 0, 113, 10], Protocol::Tcp, 80);
    let picked: std::collections::BTreeSet<_> =
        (0..200u64).filter_map(|h| r.lookup(&f, h)).collect();
    assert_eq!(picked.len(), 2);
}

#[test]
fn reader_sees_new_generation_with_one_load() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut s = sample_state();
    w.publish(&s).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let g1 = r.generation();
    s.services[0].backends.push(backend(9, 80));
    w.publish(&s).unwrap();
    assert_ne!(r.generation(), g1);
    let snap = r.snapshot().unwrap();
    assert_eq!(
        snap.state
            .services
            .iter()
            .find(|x| x.frontend.port == 80)
            .unwrap()
            .backends
            .len(),
        3
    );
}

#[test]
fn growing_past_capacity_renames_a_new_file_and_readers_follow() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let small = Capacity {
        services: 1,
        backends: 1,
        vips: 1,
        peers: 1,
        maglev_size: 251,
        redirect_vips: 1,
        redirect_nodes: 1,
    };
    let mut w = NodeStateWriter::create(&path, small).unwrap();
    let mut one = sample_state();
    one.services.truncate(1);
    one.services[0].backends.truncate(1);
    one.peers.truncate(1);
    one.advertised[0].peers = vec![0];
    one.redirects.vips.truncate(1);
    w.publish(&one).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let len_before = std::fs::metadata(&path).unwrap().len();
    let g_before = r.generation();
    // Keep a handle on the old inode to prove it was never shrunk.
    let old = std::fs::File::open(&path).unwrap();

    let big = sample_state();
    w.publish(&big).unwrap();
    assert!(w.capacity().services >= 3 && w.capacity().backends >= 3);
    assert!(w.capacity().redirect_vips >= 2 && w.capacity().redirect_nodes >= 3);
    assert_ne!(
        r.generation(),
        g_before,
        "the old file must signal the move"
    );
    let snap = r.snapshot().unwrap();
    let mut expect = big.clone();
    expect.normalize();
    assert_eq!(snap.state, expect);
    assert_eq!(r.capacity(), w.capacity());
    assert!(std::fs::metadata(&path).unwrap().len() > len_before);
    assert_eq!(
        old.metadata().unwrap().len(),
        len_before,
        "the old file shrank under a reader"
    );
    // No temporary files left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn other_layout_version_is_refused_with_a_clear_error() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
    let other = dir.path().join("other.state");
    std::fs::write(&other, &bytes).unwrap();
    let err = NodeStateReader::open(&other).err().expect("must refuse");
    assert!(
        matches!(
            err,
            ShmError::LayoutVersion {
                found: 7,
                expected: LAYOUT_VERSION,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("layout version 7"), "{err}");
}

#[test]
fn foreign_and_truncated_files_are_refused() {
    let dir = tmp();
    let junk = dir.path().join("junk");
    std::fs::write(&junk, vec![0xabu8; 8192]).unwrap();
    assert!(matches!(
        NodeStateReader::open(&junk),
        Err(ShmError::NotAStateFile { .. })
    ));
    let short = dir.path().join("short");
    std::fs::write(&short, b"JUNEAUNS").unwrap();
    assert!(matches!(
        NodeStateReader::open(&short),
        Err(ShmError::Truncated { .. })
    ));
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        NodeStateReader::open(&cut),
        Err(ShmError::Truncated { .. })
    ));
    assert!(matches!(
        NodeStateReader::open(dir.path().join("absent")),
        Err(ShmError::Io { .. })
    ));
}

#[test]
fn unrepresentable_state_is_refused_and_the_last_table_stays() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let good = sample_state();
    w.publish(&good).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let g = r.generation();

    let mut bad = good.clone();
    bad.advertised[0].communities = (0..9).collect();
    assert!(
        matches!(w.publish(&bad), Err(ShmError::Unrepresentable(m)) if m.contains("communities"))
    );
    let mut bad = good.clone();
    bad.peers[0].md5_password = Some("x".repeat(81));
    assert!(matches!(w.publish(&bad), Err(ShmError::Unrepresentable(m)) if m.contains("MD5")));
    let mut bad = good.clone();
    bad.node = "n".repeat(300);
    assert!(w.publish(&bad).is_err());
    let mut bad = good.clone();
    bad.advertised[0].peers = vec![5];
    assert!(w.publish(&bad).is_err());
    let mut bad = good.clone();
    bad.redirects.vips[0].nodes = (1..=MAX_REDIRECT_NODES_PER_VIP as u32 + 1)
        .map(Ipv4Addr::from)
        .collect();
    assert!(
        matches!(w.publish(&bad), Err(ShmError::Unrepresentable(m)) if m.contains("redirect peer nodes"))
    );
    let mut bad = good.clone();
    bad.redirects.vips[0].nodes.push(Ipv4Addr::UNSPECIFIED);
    assert!(w.publish(&bad).is_err());
    let mut bad = good.clone();
    bad.redirects.node_address = Some(Ipv4Addr::UNSPECIFIED);
    assert!(w.publish(&bad).is_err());

    assert_eq!(r.generation(), g);
    let mut expect = good;
    expect.normalize();
    assert_eq!(r.snapshot().unwrap().state, expect);
    // And the writer still works afterwards.
    let mut next = expect.clone();
    next.services.pop();
    assert_eq!(w.publish(&next).unwrap(), g + 1);
}

#[test]
fn a_writer_dead_mid_update_leaves_readers_on_the_last_good_table() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let good = sample_state();
    w.publish(&good).unwrap();
    // Simulate a crash half-way through writing the next generation: the other slot is
    // marked "being written" and half-scribbled, and the generation never moves.
    {
        let live = w.live.as_ref().unwrap();
        let next = (w.generation() + 1) % 2;
        live.header().slot_seq[next as usize].fetch_add(1, Ordering::SeqCst);
        for word in live.slot(next as usize).iter().take(500) {
            word.store(0xdead_beef, Ordering::Relaxed);
        }
    }
    let stamp_age = Duration::from_millis(1200);
    std::thread::sleep(stamp_age);
    let mut r = NodeStateReader::open(&path).unwrap();
    let mut expect = good;
    expect.normalize();
    assert_eq!(r.snapshot().unwrap().state, expect);
    assert!(
        r.heartbeat_age().unwrap() >= Duration::from_secs(1),
        "a silent writer must look stale"
    );
    w.heartbeat();
    assert!(r.heartbeat_age().unwrap() < Duration::from_secs(1));
}

#[test]
fn a_restarted_writer_keeps_readers_on_the_old_table_until_it_publishes() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w1 = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let s = sample_state();
    w1.publish(&s).unwrap();
    w1.publish(&s).unwrap();
    drop(w1);
    let mut r = NodeStateReader::open(&path).unwrap();
    let g = r.generation();
    let mut w2 = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    assert_eq!(r.generation(), g);
    assert!(r.snapshot().is_ok());
    let mut s2 = s.clone();
    s2.services.clear();
    let g2 = w2.publish(&s2).unwrap();
    assert!(g2 > g, "generations only grow across writer restarts");
    assert_ne!(r.generation(), g);
    let snap = r.snapshot().unwrap();
    assert!(snap.state.services.is_empty());
    assert_eq!(snap.generation, g2);
}

#[test]
fn wait_change_wakes_on_publish() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let g = r.generation();
    // Nothing published: returns the same generation after the timeout.
    assert_eq!(r.wait_change(g, Duration::from_millis(20)), g);
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        w.publish(&NodeState::default()).unwrap()
    });
    let got = r.wait_change(g, Duration::from_secs(30));
    let published = t.join().unwrap();
    assert_eq!(got, published);
}

#[test]
fn terminating_backends_round_trip_and_are_never_picked() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let snap = r.snapshot().unwrap();
    let web = snap
        .service_index(&frontend([203, 0, 113, 10], Protocol::Tcp, 80))
        .unwrap();
    assert_eq!(snap.state.services[web].terminating, vec![backend(9, 80)]);
    let drained = snap
        .service_index(&frontend([203, 0, 113, 11], Protocol::Tcp, 443))
        .unwrap();
    assert_eq!(
        snap.state.services[drained].terminating,
        vec![backend(8, 443)]
    );
    for h in 0..5000u64 {
        let hash = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let f = &snap.state.services[web].frontend;
        assert_ne!(r.lookup(f, hash), Some(backend(9, 80)));
        assert_ne!(snap.pick(web, hash), Some(backend(9, 80)));
        let f = &snap.state.services[drained].frontend;
        assert_eq!(r.lookup(f, hash), None);
        assert_eq!(snap.pick(drained, hash), None);
    }
}

#[test]
fn a_backend_flag_that_contradicts_its_position_is_refused() {
    let mut state = sample_state();
    state.normalize();
    let cap = Capacity::default();
    let mut words = vec![0u32; cap.sections().end];
    encode(&state, &cap, 1, &mut words).unwrap();
    assert!(decode(&words, &cap, 1).is_ok());
    // The first backend record is Ready: mark it terminating.
    let first = cap.sections().backends;
    let mut bad = words.clone();
    bad[first + 1] |= BACKEND_TERMINATING;
    let e = decode(&bad, &cap, 1).unwrap_err();
    assert!(e.contains("inconsistent flags"), "{e}");
    // Unknown flag bits are refused too.
    let mut bad = words;
    bad[first + 1] |= 1 << 20;
    assert!(decode(&bad, &cap, 1).is_err());
}

#[test]
fn redirect_peers_round_trip_per_vip() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    let snap = r.snapshot().unwrap();
    let red = &snap.state.redirects;
    assert_eq!(red.node_address, Some(Ipv4Addr::new(192, 0, 2, 10)));
    assert_eq!(
        red.peers_of(Ipv4Addr::new(203, 0, 113, 10)),
        [Ipv4Addr::new(192, 0, 2, 11), Ipv4Addr::new(192, 0, 2, 13)]
    );
    assert_eq!(
        red.peers_of(Ipv4Addr::new(203, 0, 113, 11)),
        [Ipv4Addr::new(192, 0, 2, 12)]
    );
    assert!(red.peers_of(Ipv4Addr::new(203, 0, 113, 99)).is_empty());

    // No redirect address and no peers: both absent again.
    let mut none = sample_state();
    none.redirects = Redirects::default();
    w.publish(&none).unwrap();
    assert_eq!(r.snapshot().unwrap().state.redirects, Redirects::default());
}

#[test]
fn redirect_counts_past_the_capacity_are_refused_as_corrupt() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&sample_state()).unwrap();
    let mut r = NodeStateReader::open(&path).unwrap();
    // Scribble a node count past the capacity into the current slot's header.
    let idx = (r.generation() % 2) as usize;
    let sec = r.map.sections;
    r.map.slot(idx)[13].store(u32::MAX, Ordering::Relaxed);
    assert!(matches!(r.snapshot(), Err(ShmError::Corrupt(..))));
    // A count within the capacity but a record pointing past it: also refused (the
    // checksum is recomputed so only the bounds check can catch it).
    let slot = r.map.slot(idx);
    slot[13].store(3, Ordering::Relaxed);
    slot[sec.redirect_vips + 1].store(100, Ordering::Relaxed);
    let words: Vec<u32> = slot.iter().map(|w| w.load(Ordering::Relaxed)).collect();
    let sum = checksum(&words, &sec, &r.map.capacity);
    slot[6].store(sum as u32, Ordering::Relaxed);
    slot[7].store((sum >> 32) as u32, Ordering::Relaxed);
    assert!(
        matches!(r.snapshot(), Err(ShmError::Corrupt(_, m)) if m.contains("redirect")),
        "bounds"
    );
}
