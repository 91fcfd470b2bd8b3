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
    peer.source_address = Some(Ipv4Addr::new(192, 0, 2, 10).into());
    peer.bfd = Some(BfdSettings {
        min_rx_ms: 250,
        min_tx_ms: 100_000,
        multiplier: 7,
    });
    peer.bfd_auth = Some(BfdAuth {
        auth_type: BfdAuthType::MeticulousKeyedSha1,
        key_id: 255,
        key: "twenty-bytes-bfd-key".into(),
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
        services6: Vec::new(),
        services: vec![
            NodeService {
                frontend: frontend([203, 0, 113, 10], Protocol::Tcp, 80),
                backends: vec![backend(5, 80), backend(6, 80)],
                // backend 5 is Ready, so normalize() drops it from the draining list.
                terminating: vec![backend(9, 80), backend(5, 80)],
                source_ranges: vec![
                    "198.51.100.0/24".parse().unwrap(),
                    "192.0.2.7".parse().unwrap(),
                ],
                client_ip_affinity: Some(86_400),
                hand_off: true,
                host_network: false,
            },
            NodeService {
                frontend: frontend([203, 0, 113, 10], Protocol::Udp, 53),
                backends: vec![backend(7, 5353)],
                terminating: Vec::new(),
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: true,
            },
            NodeService {
                frontend: frontend([203, 0, 113, 11], Protocol::Tcp, 443),
                backends: vec![],
                // Only draining backends: existing flows only, nothing to pick.
                terminating: vec![backend(8, 443)],
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: false,
            },
        ],
        advertised: vec![AdvertisedVip {
            vip: Ipv4Addr::new(203, 0, 113, 10).into(),
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
                    // Unsorted, with a repeat: normalize() sorts and keeps it (a weight).
                    nodes: vec![
                        Ipv4Addr::new(192, 0, 2, 13),
                        Ipv4Addr::new(192, 0, 2, 11),
                        Ipv4Addr::new(192, 0, 2, 13),
                    ],
                },
            ],
            // Layout 11: IPv6 VIPs' peers (IPv4 redirect addresses), unsorted.
            vips6: vec![
                VipRedirectPeers6 {
                    vip: "2001:db8:71::11".parse().unwrap(),
                    nodes: vec![Ipv4Addr::new(192, 0, 2, 14), Ipv4Addr::new(192, 0, 2, 12)],
                },
                VipRedirectPeers6 {
                    vip: "2001:db8:71::10".parse().unwrap(),
                    nodes: vec![Ipv4Addr::new(192, 0, 2, 12)],
                },
            ],
            keys: vec![
                RedirectKey::new(crate::secret::SecretKey::new([7; 16])),
                RedirectKey::new(crate::secret::SecretKey::new([8; 16])),
            ],
        },
    }
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn header_layout_is_stable() {
    assert_eq!(std::mem::size_of::<FileHeader>(), 120);
    assert_eq!(std::mem::offset_of!(FileHeader, slot_words), 64);
    assert_eq!(std::mem::offset_of!(FileHeader, generation), 72);
    assert_eq!(std::mem::offset_of!(FileHeader, slot_seq), 104);
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
        source_ranges: 1,
        services6: 1,
        backends6: 1,
        source_ranges6: 1,
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
    bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
    let other = dir.path().join("other.state");
    std::fs::write(&other, &bytes).unwrap();
    let err = NodeStateReader::open(&other).err().expect("must refuse");
    assert!(
        matches!(
            err,
            ShmError::LayoutVersion {
                found: 99,
                expected: LAYOUT_VERSION,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("layout version 99"), "{err}");
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
    bad.peers[0].md5_password = Some("x".repeat(81).into());
    assert!(matches!(w.publish(&bad), Err(ShmError::Unrepresentable(m)) if m.contains("MD5")));
    let mut bad = good.clone();
    bad.peers[0].bfd_auth.as_mut().unwrap().key = "x".repeat(21).into();
    assert!(matches!(w.publish(&bad), Err(ShmError::Unrepresentable(m)) if m.contains("BFD key")));
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
    let mut img = Image::new(&cap);
    let tables = Tables {
        v4: MaglevCache::default()
            .tables_for(&state.services, cap.maglev_size)
            .unwrap(),
        v6: Vec::new(),
    };
    encode(&mut img, &state, &cap, 1, &tables).unwrap();
    seal(&mut img, &cap);
    let words = img.words;
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
    // Sorted; a repeat is a weight (one more Ready endpoint there), kept.
    assert_eq!(
        red.peers_of(Ipv4Addr::new(203, 0, 113, 10)),
        [
            Ipv4Addr::new(192, 0, 2, 11),
            Ipv4Addr::new(192, 0, 2, 13),
            Ipv4Addr::new(192, 0, 2, 13)
        ]
    );
    assert_eq!(
        red.weighted_peers_of(Ipv4Addr::new(203, 0, 113, 10)),
        [
            (Ipv4Addr::new(192, 0, 2, 11), 0),
            (Ipv4Addr::new(192, 0, 2, 13), 1)
        ]
    );
    assert_eq!(
        red.peers_of(Ipv4Addr::new(203, 0, 113, 11)),
        [Ipv4Addr::new(192, 0, 2, 12)]
    );
    assert!(red.peers_of(Ipv4Addr::new(203, 0, 113, 99)).is_empty());

    // The MAC keys (layout 6), current first, with their ids.
    assert_eq!(red.keys.len(), 2);
    assert_eq!(red.keys[0].key.expose(), &[7; 16]);
    assert_eq!(red.keys[1].key.expose(), &[8; 16]);
    assert_eq!(red.keys, sample_state().redirects.keys);
    // One key left (the old one retired): the second record is gone.
    let mut one = sample_state();
    one.redirects.keys.remove(0);
    w.publish(&one).unwrap();
    let keys = r.snapshot().unwrap().state.redirects.keys;
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].key.expose(), &[8; 16]);
    // More than current and next cannot be published.
    let mut three = sample_state();
    three
        .redirects
        .keys
        .push(RedirectKey::new(crate::secret::SecretKey::new([9; 16])));
    assert!(
        matches!(w.publish(&three), Err(ShmError::Unrepresentable(m)) if m.contains("redirect keys"))
    );

    // No redirect address and no peers: both absent again.
    let mut none = sample_state();
    none.redirects = Redirects::default();
    w.publish(&none).unwrap();
    assert_eq!(r.snapshot().unwrap().state.redirects, Redirects::default());
}

#[test]
fn redirect_counts_past_the_capacity_are_refused_as_corrupt() {
    let (_dir, mut r, scribble, idx) = published_with_scribbler(&sample_state());
    // Scribble a node count past the capacity into the current slot's header.
    let sec = scribble.sections;
    scribble.slot(idx)[13].store(u32::MAX, Ordering::Relaxed);
    assert!(matches!(r.snapshot(), Err(ShmError::Corrupt(..))));
    // A count within the capacity but a record pointing past it: also refused (the
    // checksum is recomputed so only the bounds check can catch it).
    let slot = scribble.slot(idx);
    slot[13].store(3, Ordering::Relaxed);
    slot[sec.redirect_vips + 1].store(100, Ordering::Relaxed);
    reseal(slot, &sec, &scribble.capacity);
    assert!(
        matches!(r.snapshot(), Err(ShmError::Corrupt(_, m)) if m.contains("redirect")),
        "bounds"
    );
}

/// `state` published into a new file, a reader of it, a writable mapping of it (a
/// reader's is read-only) and the index of the slot the reader reads.
fn published_with_scribbler(
    state: &NodeState,
) -> (tempfile::TempDir, NodeStateReader, Mapping, usize) {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(state).unwrap();
    let r = NodeStateReader::open(&path).unwrap();
    let idx = (r.generation() % 2) as usize;
    (dir, r, Mapping::open(&path).unwrap(), idx)
}

/// Stores the checksum of `slot` as it now is (a scribble only the other checks may
/// catch).
fn reseal(slot: &[AtomicU32], sec: &Sections, cap: &Capacity) {
    let words: Vec<u32> = slot.iter().map(|w| w.load(Ordering::Relaxed)).collect();
    let sum = checksums(&words, sec, cap, true).0;
    slot[6].store(sum as u32, Ordering::Relaxed);
    slot[7].store((sum >> 32) as u32, Ordering::Relaxed);
}

/// Every service's table in `snap` is the one a fresh build gives for its backends.
fn assert_tables_fresh(snap: &Snapshot, size: u32) {
    assert_eq!(snap.maglev.len(), snap.state.services.len());
    for (s, t) in snap.state.services.iter().zip(&snap.maglev) {
        let fresh = MaglevTable::new(&s.backends, size).unwrap();
        assert_eq!(
            &t[..],
            fresh.slots(),
            "stale Maglev table for {}",
            s.frontend
        );
    }
    assert_eq!(snap.maglev6.len(), snap.state.services6.len());
    for (s, t) in snap.state.services6.iter().zip(&snap.maglev6) {
        let fresh = MaglevTable::new(&s.backends, size).unwrap();
        assert_eq!(
            &t[..],
            fresh.slots(),
            "stale Maglev table for {}",
            s.frontend
        );
    }
}

fn service(last_octet: u8, backends: &[u8]) -> NodeService {
    NodeService::new(
        frontend([203, 0, 113, last_octet], Protocol::Tcp, 80),
        backends.iter().map(|b| backend(*b, 8080)).collect(),
    )
}

#[test]
fn maglev_tables_are_reused_only_while_the_backends_stay_the_same() {
    let dir = tmp();
    let path = dir.path().join("node-a.state");
    let size = 251;
    let cap = Capacity {
        maglev_size: size,
        ..Capacity::default()
    };
    let mut w = NodeStateWriter::create(&path, cap).unwrap();
    let mut r = None;
    let mut publish = |w: &mut NodeStateWriter, services: Vec<NodeService>| {
        let state = NodeState {
            node: "node-a".into(),
            services,
            ..NodeState::default()
        };
        w.publish(&state).unwrap();
        let r = r.get_or_insert_with(|| NodeStateReader::open(&path).unwrap());
        let snap = r.snapshot().unwrap();
        assert_tables_fresh(&snap, size);
        snap
    };
    let a = service(1, &[1, 2, 3]);
    let b = service(2, &[4, 5]);
    let c = service(3, &[6]);
    publish(&mut w, vec![a.clone(), b.clone(), c.clone()]);
    assert_eq!(w.maglev_tables_built(), 3);
    // Nothing changed: nothing built; the same backends in another order are the same set.
    let mut b_reordered = b.clone();
    b_reordered.backends.reverse();
    publish(&mut w, vec![c.clone(), b_reordered, a.clone()]);
    assert_eq!(w.maglev_tables_built(), 3);
    // A's backend 2 leaves: only A's table is rebuilt, and it is the fresh one.
    let a_less = service(1, &[1, 3]);
    publish(&mut w, vec![a_less.clone(), b.clone(), c.clone()]);
    assert_eq!(w.maglev_tables_built(), 4);
    // B is removed, then comes back with the same backends: rebuilt (the cache keeps only
    // the last publish's tables), and the tables after it shift position correctly.
    let snap = publish(&mut w, vec![a_less.clone(), c.clone()]);
    assert_eq!(snap.state.services.len(), 2);
    assert_eq!(w.maglev_tables_built(), 4);
    publish(&mut w, vec![a_less.clone(), b.clone(), c.clone()]);
    assert_eq!(w.maglev_tables_built(), 5);
    // A gets its backend back; a new service D with C's backends shares C's table.
    let mut d = c.clone();
    d.frontend.port = 8443;
    publish(&mut w, vec![a.clone(), b.clone(), c.clone(), d]);
    assert_eq!(w.maglev_tables_built(), 6);
    // Every backend of C leaves: an empty table, picked by nobody.
    let snap = publish(&mut w, vec![a, b, service(3, &[])]);
    assert_eq!(w.maglev_tables_built(), 7);
    assert!(snap.maglev[2].iter().all(|s| *s == maglev::NO_BACKEND));
}

#[test]
fn shrinking_and_growing_again_leaves_no_stale_words_visible() {
    // Slots are written only where words changed and only up to the counts: a table
    // that shrinks leaves old records past its counts, which must never show up, and
    // records that come back must be rewritten whole.
    let dir = tmp();
    let path = dir.path().join("node-a.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut r = None;
    let mut full = sample_state();
    let mut small = sample_state();
    small.services.truncate(1);
    small.services[0].backends.truncate(1);
    small.advertised[0].communities.clear();
    small.advertised[0].large_communities.clear();
    small.advertised[0].peers = vec![0];
    small.peers.truncate(1);
    small.peers[0].md5_password = Some("x".into());
    small.peers[0].name = "p".into();
    small.redirects.vips.truncate(1);
    small.node = "n".into();
    let mut changed = full.clone();
    changed.services[1].backends.push(backend(42, 5353));
    changed.advertised[0].communities.push(65000 << 16 | 7);
    for state in [&mut full, &mut small, &mut changed] {
        state.normalize();
    }
    // Rounds of an odd length, so that each state lands in both slots.
    for round in 0..2 {
        for state in [&full, &small, &changed, &small, &full] {
            let g = w.publish(state).unwrap();
            let r = r.get_or_insert_with(|| NodeStateReader::open(&path).unwrap());
            let snap = r.snapshot().unwrap();
            assert_eq!(snap.generation, g);
            assert_eq!(&snap.state, state, "round {round}, generation {g}");
            assert_tables_fresh(&snap, maglev::DEFAULT_TABLE_SIZE);
            for (i, s) in state.services.iter().enumerate() {
                for h in 0..64u64 {
                    assert_eq!(r.lookup(&s.frontend, h), snap.pick(i, h));
                }
            }
        }
    }
}

mod incremental {
    //! The writer updates its image in place and writes only what changed: whatever the
    //! sequence of states (growing, shrinking, moving, growing the file), every reader
    //! snapshot must be exactly the state published, with fresh tables and a valid
    //! checksum.
    use super::*;
    use proptest::prelude::*;

    fn arb_state() -> impl Strategy<Value = NodeState> {
        let service = (1u8..7, 0u16..2, proptest::collection::vec(1u8..6, 0..4))
            .prop_flat_map(|(vip, port, ready)| {
                (
                    Just((vip, port, ready)),
                    proptest::collection::vec(1u8..6, 0..2),
                    proptest::collection::vec((any::<u32>(), 0u8..=32), 0..3),
                )
            })
            .prop_map(|((vip, port, ready), draining, ranges)| {
                let mut source_ranges: Vec<SourceRange> = ranges
                    .into_iter()
                    .filter_map(|(ip, len)| SourceRange::new(Ipv4Addr::from(ip), len))
                    .collect();
                source_ranges.sort();
                source_ranges.dedup();
                NodeService {
                    frontend: frontend([203, 0, 113, vip], Protocol::Tcp, 80 + port),
                    backends: ready.into_iter().map(|b| backend(b, 8080)).collect(),
                    terminating: draining.into_iter().map(|b| backend(b, 8080)).collect(),
                    source_ranges,
                    client_ip_affinity: (port == 1).then_some(10_800),
                    hand_off: vip % 2 == 0,
                    host_network: vip % 3 == 0,
                }
            });
        let services = proptest::collection::vec(service, 0..7);
        let peers = 0usize..3;
        let redirects =
            proptest::collection::vec((1u8..5, proptest::collection::vec(1u8..9, 0..3)), 0..3);
        let name = prop_oneof![Just("node-a".to_string()), Just("n".to_string())];
        (services, peers, redirects, name, any::<bool>(), 0u32..3).prop_map(
            |(mut services, np, redirects, node, router, communities)| {
                services.sort_by_key(|s| s.frontend);
                services.dedup_by_key(|s| s.frontend);
                let mut vips: Vec<IpAddr> = services
                    .iter()
                    .map(|s| IpAddr::V4(s.frontend.vip))
                    .collect();
                vips.dedup();
                // IPv6 VIPs (layout 9) beside them, one per community count.
                vips.extend((0..communities).map(|c| {
                    IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, c as u16 + 1))
                }));
                // IPv6 frontends (layout 10): a twin of every other IPv4 one.
                let services6 = services.iter().step_by(2).map(twin6).collect();
                let mut state = NodeState {
                    node,
                    router_id: router.then(|| Ipv4Addr::new(192, 0, 2, 10)),
                    services6,
                    advertised: vips
                        .into_iter()
                        .map(|vip| AdvertisedVip {
                            vip,
                            communities: (0..communities).map(|c| 65000 << 16 | c).collect(),
                            large_communities: vec![],
                            local_pref: None,
                            peers: (0..np as u16).collect(),
                            weight: None,
                        })
                        .collect(),
                    services,
                    peers: (0..np)
                        .map(|i| {
                            // Every other peer over IPv6, the last with a source.
                            let address = if i % 2 == 1 {
                                IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, i as u16))
                            } else {
                                IpAddr::V4(Ipv4Addr::new(192, 0, 2, i as u8 + 1))
                            };
                            let mut p = PeerConfig::new(format!("peer-{i}"), address, 65000, 65001);
                            p.md5_password = (i == 1).then(|| "pw".into());
                            p.source_address = (i + 1 == np).then(|| match address {
                                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10)),
                                IpAddr::V6(_) => "2001:db8:1::a".parse().unwrap(),
                            });
                            p
                        })
                        .collect(),
                    redirects: Redirects {
                        node_address: router.then(|| Ipv4Addr::new(192, 0, 2, 10)),
                        vips: redirects
                            .into_iter()
                            .map(|(v, nodes)| VipRedirectPeers {
                                vip: Ipv4Addr::new(203, 0, 113, v),
                                nodes: nodes
                                    .into_iter()
                                    .map(|n| Ipv4Addr::new(192, 0, 2, 100 + n))
                                    .collect(),
                            })
                            .collect(),
                        vips6: Vec::new(),
                        keys: (0..communities)
                            .take(MAX_REDIRECT_KEYS)
                            .map(|c| RedirectKey::new(crate::secret::SecretKey::new([c as u8; 16])))
                            .collect(),
                    },
                };
                state.normalize();
                state
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_snapshot_is_the_state_published(states in proptest::collection::vec(arb_state(), 1..12)) {
            let dir = tmp();
            let path = dir.path().join("node-a.state");
            // A small file, so that sequences also grow it.
            let cap = Capacity {
                services: 2,
                backends: 4,
                vips: 2,
                peers: 1,
                maglev_size: 31,
                redirect_vips: 1,
                redirect_nodes: 2,
                source_ranges: 1,
                services6: 1,
                backends6: 1,
                source_ranges6: 1,
            };
            let mut w = NodeStateWriter::create(&path, cap).unwrap();
            let mut r: Option<NodeStateReader> = None;
            for state in &states {
                let g = w.publish(state).unwrap();
                let r = r.get_or_insert_with(|| NodeStateReader::open(&path).unwrap());
                let snap = r.snapshot().unwrap();
                prop_assert_eq!(snap.generation, g);
                prop_assert_eq!(&snap.state, state);
                assert_tables_fresh(&snap, 31);
            }
        }
    }
}

/// A source range whose host bits are set, or whose prefix is longer than 32, is not
/// published: the error names it, and readers keep the state published before.
#[test]
fn a_source_range_that_is_not_a_network_is_refused_and_nothing_changes() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let good = sample_state();
    let g = w.publish(&good).unwrap();
    for (network, prefix_len) in [([10, 1, 2, 3], 8), ([10, 0, 0, 0], 33)] {
        let mut bad = good.clone();
        bad.services[0].source_ranges = vec![SourceRange {
            network: Ipv4Addr::from(network),
            prefix_len,
        }];
        let e = w.publish(&bad).unwrap_err().to_string();
        assert!(e.contains("is not a network and prefix length"), "{e}");
    }
    let mut r = NodeStateReader::open(&path).unwrap();
    let snap = r.snapshot().unwrap();
    assert_eq!(snap.generation, g);
    let mut want = good;
    want.normalize();
    assert_eq!(snap.state, want);
}

// ---------------------------------------------------------------------------------------
// Layout 9: IPv6 advertised VIPs and peers.

fn v6(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// [`sample_state`] with an IPv6 VIP (announced to the IPv6 peer only) and an IPv6 peer
/// with an IPv6 source address, beside the IPv4 ones.
fn dual_stack_state() -> NodeState {
    let mut s = sample_state();
    let mut p = PeerConfig::new("tor-v6", v6("2001:db8:1::1"), 65000, 65001);
    p.source_address = Some(v6("2001:db8:1::2"));
    p.md5_password = Some("v6-secret".into());
    p.ebgp_multihop = Some(2);
    s.peers.push(p);
    s.advertised.push(AdvertisedVip {
        vip: v6("2001:db8:ffff::10"),
        communities: vec![65000 << 16 | 6],
        large_communities: vec![[65000, 6, 6]],
        local_pref: Some(150),
        peers: vec![2],
        weight: Some(2),
    });
    s
}

/// Slot words of the current table of the file at `path`.
fn current_words(path: &Path) -> (Vec<u32>, Sections) {
    let m = Mapping::open(path).unwrap();
    let g = m.header().generation.load(Ordering::Acquire);
    let words = m
        .slot((g % 2) as usize)
        .iter()
        .map(|w| w.load(Ordering::Relaxed))
        .collect();
    (words, m.sections)
}

#[test]
fn ipv6_vips_and_peers_round_trip_beside_ipv4_ones() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut state = dual_stack_state();
    w.publish(&state).unwrap();
    let snap = NodeStateReader::open(&path).unwrap().snapshot().unwrap();
    state.normalize();
    assert_eq!(snap.state, state);
    // IPv4 sorts before IPv6.
    assert_eq!(
        snap.state
            .advertised
            .iter()
            .map(|a| a.vip)
            .collect::<Vec<_>>(),
        [IpAddr::from([203, 0, 113, 10]), v6("2001:db8:ffff::10")]
    );
    // Unsetting the IPv6 source address republishes cleanly (no stale words).
    state.peers[2].source_address = None;
    w.publish(&state).unwrap();
    let snap = NodeStateReader::open(&path).unwrap().snapshot().unwrap();
    assert_eq!(snap.state, state);
}

/// The words where the layout-9 comment says they are: a golden record.
#[test]
fn ipv6_addresses_sit_in_the_words_the_layout_names() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&dual_stack_state()).unwrap();
    let (words, sec) = current_words(&path);
    let vip = &words[sec.vips + VIP_WORDS..][..VIP_WORDS];
    assert_eq!(vip[0], 0);
    assert_eq!(vip[7], VIP_IPV6);
    assert_eq!(vip[32..36], [0x2001_0db8, 0xffff_0000, 0, 0x10]);
    let v4 = &words[sec.vips..][..VIP_WORDS];
    assert_eq!(
        (v4[0], v4[7], &v4[32..36]),
        (0xcb00_710a, 0, &[0u32; 4][..])
    );
    let peer = &words[sec.peers + 2 * PEER_WORDS..][..PEER_WORDS];
    let f = &peer[NAME_BYTES / 4..];
    let x = &f[12 + MD5_BYTES / 4..];
    assert_eq!((f[0], f[4], f[5]), (0, 0, 1));
    assert_eq!(f[11], PEER_IPV6 | PEER_SOURCE_IPV6);
    assert_eq!(x[16..20], [0x2001_0db8, 0x0001_0000, 0, 1]);
    assert_eq!(x[20..24], [0x2001_0db8, 0x0001_0000, 0, 2]);
    let v4peer = &words[sec.peers..][..PEER_WORDS];
    assert_eq!(v4peer[NAME_BYTES / 4 + 11], 0);
}

/// A layout-11 reader (no tables' part of the checksum in words 20, 21, which it
/// requires to be zero) must not misread a layout-12 file, and this reader must not
/// misread a layout-11 one (zero there: every table would look corrupt): both are
/// refused by version, with a message naming both versions and the three binaries (they
/// ship together in one image).
#[test]
fn a_reader_of_the_layout_before_the_tables_checksum_refuses_this_one_and_back() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    w.publish(&dual_stack_state()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes[8..12], 12u32.to_le_bytes());
    bytes[8..12].copy_from_slice(&11u32.to_le_bytes());
    let old = dir.path().join("layout11.state");
    std::fs::write(&old, &bytes).unwrap();
    let e = NodeStateReader::open(&old).err().expect("refused");
    assert!(
        matches!(
            e,
            ShmError::LayoutVersion {
                found: 11,
                expected: 12,
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("layout version 11") && msg.contains("reads version 12"),
        "{msg}"
    );
    assert!(msg.contains("juneau-bgp"), "{msg}");
}

#[test]
fn unusable_ipv6_addresses_are_refused_with_a_clear_error_and_nothing_changes() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let good = dual_stack_state();
    let g = w.publish(&good).unwrap();
    let vip = |a: &str| {
        let mut s = good.clone();
        s.advertised[1].vip = v6(a);
        s
    };
    let peer = |a: &str, src: Option<&str>| {
        let mut s = good.clone();
        s.peers[2].peer_address = v6(a);
        s.peers[2].source_address = src.map(v6);
        s
    };
    let cases = [
        (vip("::"), "is the unspecified address"),
        (vip("ff02::1"), "is a multicast address"),
        (vip("::ffff:203.0.113.7"), "IPv4-mapped"),
        (peer("::ffff:192.0.2.1", None), "IPv4-mapped"),
        (
            peer("fe80::1", None),
            "link-local address fe80::1 needs an interface",
        ),
        (
            peer("2001:db8::1", Some("192.0.2.10")),
            "source address 192.0.2.10 is not",
        ),
        (peer("2001:db8::1", Some("::")), "source address :: is not"),
    ];
    for (bad, want) in cases {
        let e = w.publish(&bad).unwrap_err();
        assert!(matches!(e, ShmError::Unrepresentable(_)), "{e}");
        assert!(e.to_string().contains(want), "{e} (want {want:?})");
    }
    let mut v4_from_v6 = good.clone();
    v4_from_v6.peers[0].source_address = Some(v6("2001:db8::9"));
    let e = w.publish(&v4_from_v6).unwrap_err().to_string();
    assert!(
        e.contains("peer tor-1: source address 2001:db8::9 is not"),
        "{e}"
    );
    let snap = NodeStateReader::open(&path).unwrap().snapshot().unwrap();
    assert_eq!(snap.generation, g);
}

/// Records a reader must refuse even with a valid checksum: the address words of the
/// other family set, unknown flag bits, an IPv4-mapped IPv6 address, source words
/// without a source.
#[test]
fn inconsistent_ipv6_records_are_refused_by_the_decoder() {
    let cap = Capacity::default();
    let sec = cap.sections();
    let mut words = vec![0u32; sec.end];
    let state = dual_stack_state();
    let v6vip = vip_record(&state.advertised[1]);
    let v4vip = vip_record(&state.advertised[0]);
    let decode_with = |words: &mut Vec<u32>, rec: &[u32]| {
        words[sec.vips..sec.vips + VIP_WORDS].copy_from_slice(rec);
        decode_vip(words, &sec, 0)
    };
    assert_eq!(
        decode_with(&mut words, &v6vip).unwrap().vip,
        state.advertised[1].vip
    );
    let mut bad = v6vip;
    bad[0] = 1;
    assert!(decode_with(&mut words, &bad)
        .unwrap_err()
        .contains("IPv4 address word set"));
    let mut bad = v4vip;
    bad[35] = 1;
    assert!(decode_with(&mut words, &bad)
        .unwrap_err()
        .contains("IPv6 address words set"));
    let mut bad = v6vip;
    bad[7] |= 4;
    assert!(decode_with(&mut words, &bad)
        .unwrap_err()
        .contains("unknown flags"));
    let mut bad = v6vip;
    bad[32..36].copy_from_slice(&ipv6_words("::ffff:1.2.3.4".parse().unwrap()));
    assert!(decode_with(&mut words, &bad)
        .unwrap_err()
        .contains("IPv4-mapped"));

    let peer = peer_record(&state.peers[2]).unwrap();
    let decode_peer_with = |words: &mut Vec<u32>, rec: &[u32]| {
        words[sec.peers..sec.peers + PEER_WORDS].copy_from_slice(rec);
        decode_peer(words, &sec, 0)
    };
    let p = decode_peer_with(&mut words, &peer).unwrap();
    assert_eq!(
        (p.peer_address, p.source_address),
        (state.peers[2].peer_address, state.peers[2].source_address)
    );
    let f = NAME_BYTES / 4;
    let mut bad = peer;
    bad[f + 11] |= 8;
    assert!(decode_peer_with(&mut words, &bad)
        .unwrap_err()
        .contains("unknown flags"));
    let mut bad = peer;
    bad[f + 5] = 0;
    assert!(decode_peer_with(&mut words, &bad)
        .unwrap_err()
        .contains("source address words but no source address"));
    let mut bad = peer;
    bad[f + 11] &= !PEER_IPV6;
    assert!(decode_peer_with(&mut words, &bad)
        .unwrap_err()
        .contains("address: IPv4, with IPv6"));
}

// ---------------------------------------------------------------------------------------
// Layout 10: IPv6 frontends.

/// The IPv6 twin of an IPv4 service: `2001:db8:ffff::<vip>` and `2001:db8:244::<ip>`.
fn twin6(s: &NodeService) -> NodeService6 {
    let a6 = |prefix: u16, ip: Ipv4Addr| {
        let [a, b, c, d] = ip.octets();
        Ipv6Addr::new(
            0x2001,
            0xdb8,
            prefix,
            0,
            0,
            0,
            u16::from_be_bytes([a, b]),
            u16::from_be_bytes([c, d]),
        )
    };
    let b6 = |b: &LocalBackend| LocalBackend6 {
        ip: a6(0x244, b.ip),
        port: b.port,
    };
    NodeService6 {
        frontend: Frontend6 {
            vip: a6(0xffff, s.frontend.vip),
            protocol: s.frontend.protocol,
            port: s.frontend.port,
        },
        backends: s.backends.iter().map(b6).collect(),
        terminating: s.terminating.iter().map(b6).collect(),
        source_ranges: s
            .source_ranges
            .iter()
            .map(|r| ipnet::Ipv6Net::new(a6(0xaaaa, r.network), 96 + r.prefix_len).unwrap())
            .collect(),
        client_ip_affinity: s.client_ip_affinity,
        hand_off: s.hand_off,
    }
}

/// [`dual_stack_state`] with IPv6 twins of its frontends and an IPv6 frontend of its own.
fn dual_stack_services_state() -> NodeState {
    let mut s = dual_stack_state();
    s.services6 = s.services.iter().map(twin6).collect();
    let mut own = NodeService6::new(
        Frontend6 {
            vip: "2001:db8:ffff::10".parse().unwrap(),
            protocol: Protocol::Udp,
            port: 53,
        },
        (1..=5)
            .map(|i| LocalBackend6 {
                ip: Ipv6Addr::new(0x2001, 0xdb8, 0x244, 1, 0, 0, 0, i),
                port: 5353,
            })
            .collect(),
    );
    own.source_ranges = vec!["2001:db8:c11e::/48".parse().unwrap()];
    own.hand_off = true;
    s.services6.push(own);
    s
}

#[test]
fn ipv6_services_round_trip_beside_ipv4_ones_with_fresh_tables() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut state = dual_stack_services_state();
    w.publish(&state).unwrap();
    let snap = NodeStateReader::open(&path).unwrap().snapshot().unwrap();
    state.normalize();
    assert_eq!(snap.state, state);
    assert!(snap.state.services6.len() >= 3);
    assert!(snap
        .state
        .services6
        .iter()
        .any(|s| !s.terminating.is_empty()));
    assert!(snap
        .state
        .services6
        .iter()
        .any(|s| !s.source_ranges.is_empty()));
    assert!(snap
        .state
        .services6
        .iter()
        .any(|s| s.client_ip_affinity.is_some()));
    assert_tables_fresh(&snap, Capacity::default().maglev_size);
    // The same backends in the other family own the same number of slots each.
    for (i4, s4) in snap.state.services.iter().enumerate() {
        let i6 = snap.service_index6(&twin6(s4).frontend).unwrap();
        let count = |t: &[u16], n: usize| {
            let mut c = vec![0usize; n];
            t.iter()
                .filter(|x| **x != maglev::NO_BACKEND)
                .for_each(|x| c[usize::from(*x)] += 1);
            c.sort_unstable();
            c
        };
        let n = s4.backends.len();
        assert_eq!(count(&snap.maglev[i4], n), count(&snap.maglev6[i6], n));
    }
    // Picks name Ready backends only, and spread over all of them.
    let own = snap
        .service_index6(&Frontend6 {
            vip: "2001:db8:ffff::10".parse().unwrap(),
            protocol: Protocol::Udp,
            port: 53,
        })
        .unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for h in 0..20_000u64 {
        let b = snap
            .pick6(own, h.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .unwrap();
        *seen.entry(b).or_insert(0usize) += 1;
    }
    assert_eq!(seen.len(), 5);
    assert!(
        seen.values().all(|c| (3_400..4_600).contains(c)),
        "{seen:?}"
    );
    let drained = snap
        .state
        .services6
        .iter()
        .position(|s| !s.terminating.is_empty() && !s.backends.is_empty())
        .unwrap();
    let only_draining = snap
        .state
        .services6
        .iter()
        .position(|s| !s.terminating.is_empty() && s.backends.is_empty())
        .unwrap();
    assert_eq!(snap.pick6(only_draining, 7), None);
    for h in 0..1000 {
        let b = snap.pick6(drained, h).unwrap();
        assert!(snap.state.services6[drained].backends.contains(&b));
    }
    assert_eq!(snap.pick6(snap.state.services6.len(), 1), None);
    // Taking the IPv6 services away republishes cleanly (no stale words).
    state.services6.clear();
    w.publish(&state).unwrap();
    let snap = NodeStateReader::open(&path).unwrap().snapshot().unwrap();
    assert_eq!(snap.state, state);
    assert!(snap.maglev6.is_empty());
}

#[test]
fn ipv6_services_grow_the_file_like_ipv4_ones() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let small = Capacity {
        services6: 1,
        backends6: 1,
        source_ranges6: 1,
        ..Capacity::default()
    };
    let mut w = NodeStateWriter::create(&path, small).unwrap();
    let mut state = dual_stack_state();
    state.services6 = vec![twin6(&state.services[1])];
    state.services6[0].backends.truncate(1);
    state.services6[0].terminating.clear();
    w.publish(&state).unwrap();
    assert_eq!(w.capacity(), small);
    let mut r = NodeStateReader::open(&path).unwrap();
    let len_before = std::fs::metadata(&path).unwrap().len();
    let big = dual_stack_services_state();
    w.publish(&big).unwrap();
    let cap = w.capacity();
    assert!(cap.services6 >= 3 && cap.backends6 >= 10 && cap.source_ranges6 >= 3);
    assert_eq!(
        (cap.services, cap.backends),
        (small.services, small.backends)
    );
    assert!(std::fs::metadata(&path).unwrap().len() > len_before);
    let snap = r.snapshot().unwrap();
    let mut expect = big;
    expect.normalize();
    assert_eq!(snap.state, expect);
    assert_eq!(r.capacity(), cap);
}

#[test]
fn unrepresentable_ipv6_services_are_refused_with_a_clear_error_and_nothing_changes() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(
        &path,
        Capacity {
            maglev_size: 7,
            ..Capacity::default()
        },
    )
    .unwrap();
    let good = dual_stack_services_state();
    let mut good_small = good.clone();
    good_small.services6.pop();
    let g = w.publish(&good_small).unwrap();
    let with = |f: &dyn Fn(&mut NodeService6)| {
        let mut s = good_small.clone();
        f(&mut s.services6[0]);
        s
    };
    let cases = [
        (
            with(&|s| s.frontend.vip = "::".parse().unwrap()),
            "the VIP is the unspecified",
        ),
        (
            with(&|s| s.frontend.vip = "::ffff:203.0.113.1".parse().unwrap()),
            "the VIP is IPv4-mapped",
        ),
        (
            with(&|s| s.terminating[0].ip = "::ffff:10.0.0.1".parse().unwrap()),
            "backend [::ffff:10.0.0.1]:80 is IPv4-mapped",
        ),
        (
            with(&|s| s.source_ranges = vec!["2001:db8::1/64".parse().unwrap()]),
            "source range 2001:db8::1/64 is not a network",
        ),
        (
            with(&|s| s.client_ip_affinity = Some(0)),
            "a ClientIP affinity of 0 seconds",
        ),
        (
            with(&|s| {
                s.backends = (1..=7)
                    .map(|i| LocalBackend6 {
                        ip: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, i),
                        port: 80,
                    })
                    .collect()
            }),
            "7 local backends; at most 6 fit a Maglev table of 7",
        ),
    ];
    for (bad, want) in cases {
        let e = w.publish(&bad).unwrap_err();
        assert!(matches!(e, ShmError::Unrepresentable(_)), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(want), "{msg} (want {want:?})");
        assert!(msg.contains("cannot be published: TCP/["), "{msg}");
    }
    let snap = NodeStateReader::open(&path).unwrap().snapshot().unwrap();
    assert_eq!(snap.generation, g);
}

/// Layout-10 words where the comment says they are: a golden record.
#[test]
fn ipv6_service_records_sit_in_the_words_the_layout_names() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut state = dual_stack_state();
    let mut s6 = NodeService6::new(
        Frontend6 {
            vip: "2001:db8:ffff::10".parse().unwrap(),
            protocol: Protocol::Tcp,
            port: 443,
        },
        vec![LocalBackend6 {
            ip: "2001:db8:244::5".parse().unwrap(),
            port: 8443,
        }],
    );
    s6.terminating = vec![LocalBackend6 {
        ip: "2001:db8:244::9".parse().unwrap(),
        port: 8443,
    }];
    s6.source_ranges = vec!["2001:db8:c11e::/48".parse().unwrap()];
    s6.client_ip_affinity = Some(60);
    state.services6 = vec![s6];
    w.publish(&state).unwrap();
    let (words, sec) = current_words(&path);
    // Word 19 (layout 11): the IPv6 redirect VIPs of the fixture's state; 20, 21
    // (layout 12): the tables' part of the checksum; 22, 23 spare.
    let nrv6 = state.redirects.vips6.len() as u32;
    assert_eq!(words[16..20], [1, 2, 1, nrv6]);
    let tables = checksums(&words, &sec, &Capacity::default(), true).1;
    assert_ne!(tables, 0);
    assert_eq!(words[20..24], [tables as u32, (tables >> 32) as u32, 0, 0]);
    assert_eq!(
        words[sec.services6..][..SERVICE6_WORDS],
        [
            0x2001_0db8,
            0xffff_0000,
            0,
            0x10,
            6 | (443 << 16),
            0,
            1,
            1,
            0,
            1,
            60,
            0
        ]
    );
    assert_eq!(
        words[sec.backends6..][..2 * BACKEND6_WORDS],
        [
            0x2001_0db8,
            0x0244_0000,
            0,
            5,
            8443,
            0x2001_0db8,
            0x0244_0000,
            0,
            9,
            8443 | BACKEND_TERMINATING
        ]
    );
    assert_eq!(
        words[sec.source_ranges6..][..SOURCE_RANGE6_WORDS],
        [0x2001_0db8, 0xc11e_0000, 0, 0, 48]
    );
    let table = &words[sec.maglev6..][..Capacity::default().maglev_words()];
    assert!(
        table.iter().all(|w| *w == 0 || *w == 0xffff_0000),
        "one backend: index 0 everywhere"
    );
    assert_eq!(node_name_at(&words), "node-a");
}

fn node_name_at(words: &[u32]) -> String {
    get_name(&words[SLOT_HEADER_WORDS - NAME_BYTES / 4..SLOT_HEADER_WORDS]).unwrap()
}

/// IPv6 records a reader must refuse even under a valid checksum (each case names what
/// is wrong): an IPv4-mapped or multicast address where an IPv6 one belongs, unknown
/// protocol or flags, a backend range past the count, a terminating flag out of place,
/// a source range with host bits, unsorted frontends, a Maglev slot past the Ready
/// backends, spare words set.
#[test]
fn malformed_ipv6_service_records_are_refused_by_the_reader() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut good = dual_stack_services_state();
    w.publish(&good).unwrap();
    good.normalize();
    let (words, sec) = current_words(&path);
    let cap = Capacity::default();
    assert_eq!(decode(&words, &cap, 1).unwrap().state, good);
    let s6_at = sec.services6;
    let s6 = move |i: usize| s6_at + i * SERVICE6_WORDS;
    let mapped = ipv6_words("::ffff:1.2.3.4".parse().unwrap());
    type Poke = Box<dyn Fn(&mut Vec<u32>)>;
    let cases: Vec<(Poke, &str)> = vec![
        (
            Box::new(move |w| w[s6(0)..s6(0) + 4].copy_from_slice(&mapped)),
            "IPv6 service 0: VIP ::ffff:1.2.3.4 is IPv4-mapped",
        ),
        (
            Box::new(move |w| w[s6(0)] = 0xff02_0000),
            "is a multicast address",
        ),
        (
            Box::new(move |w| w[s6(0) + 4] = (w[s6(0) + 4] & !0xff) | 132),
            "unknown protocol 132",
        ),
        (
            // 1 << 8 is the hand-off bit (layout 11); 1 << 9 means nothing for IPv6.
            Box::new(move |w| w[s6(0) + 4] |= 1 << 9),
            "unknown flags 0x200",
        ),
        (
            Box::new(move |w| w[s6(1) + 11] = 1),
            "IPv6 service 1: unknown flags 0x0 or spare word 0x1",
        ),
        (
            Box::new(move |w| w[s6(2) + 6] = w[17] + 1),
            "IPv6 service 2: backends out of range",
        ),
        (
            Box::new(move |w| w[s6(0) + 5] = w[17]),
            "IPv6 service 0: backends out of range",
        ),
        (
            Box::new(move |w| w[sec.backends6 + 4] |= BACKEND_TERMINATING),
            "backend 0 has inconsistent flags",
        ),
        (
            Box::new(move |w| w[sec.backends6 + 4] |= 1 << 20),
            "backend 0 has inconsistent flags",
        ),
        (
            Box::new(move |w| w[sec.backends6..sec.backends6 + 4].copy_from_slice(&mapped)),
            "backend 0: ::ffff:1.2.3.4 is IPv4-mapped",
        ),
        (
            Box::new(move |w| w[sec.source_ranges6 + 3] = 1),
            "is not a network",
        ),
        (
            Box::new(move |w| w[sec.source_ranges6 + 4] = 129),
            "/129 is not a network",
        ),
        (
            Box::new(move |w| w[s6(0) + 9] = w[18] + 1),
            "source ranges out of range",
        ),
        (
            Box::new(move |w| w[s6(0) + 3] = 0xffff_ffff),
            "IPv6 services 0 and 1 are not in ascending order",
        ),
        (
            Box::new(move |w| w.copy_within(s6(0)..s6(0) + 5, s6(1))),
            "not in ascending order",
        ),
        (
            Box::new(move |w| w[sec.maglev6] = 0x0000_0007),
            "IPv6 service 0: Maglev slot names a missing backend",
        ),
        (
            Box::new(move |w| w[23] = 1),
            "spare words 22, 23 are not zero",
        ),
    ];
    for (poke, want) in cases {
        let mut bad = words.clone();
        poke(&mut bad);
        let e = decode(&bad, &cap, 1).unwrap_err();
        assert!(e.contains(want), "{e} (want {want:?})");
    }
    // Through the reader, with the checksum resealed: a Corrupt error naming the record.
    let mut bad = words.clone();
    bad[s6(0)..s6(0) + 4].copy_from_slice(&mapped);
    let e = ShmError::Corrupt(1, decode(&bad, &cap, 1).unwrap_err()).to_string();
    assert!(
        e.contains("table of generation 1 is corrupt: IPv6 service 0"),
        "{e}"
    );
    // Counts past the capacity are refused before any record is read.
    let mut bad = words.clone();
    bad[16] = cap.services6 + 1;
    assert!(used_ranges(&bad, &sec, &cap).is_none());
}

/// The routing snapshot (what juneau-bgp reads) is the full snapshot's node, router ID,
/// advertised VIPs and peers, without services, redirects or tables, in both families;
/// after publishes that change tables incrementally too.
#[test]
fn a_routing_snapshot_is_the_full_one_without_services_or_tables() {
    let dir = tmp();
    let path = dir.path().join("n.state");
    let mut w = NodeStateWriter::create(&path, Capacity::default()).unwrap();
    let mut reader: Option<NodeStateReader> = None;
    let mut state = dual_stack_services_state();
    state.advertised = dual_stack_state().advertised;
    state.peers = dual_stack_state().peers;
    for round in 0..3u8 {
        if round > 0 {
            // Backends change (tables rebuilt in place) and a service goes.
            state.services[0].backends.push(backend(200 + round, 80));
            state.services.pop();
        }
        w.publish(&state).unwrap();
        // One reader throughout (its buffer is reused), the two reads in either order.
        let r = reader.get_or_insert_with(|| NodeStateReader::open(&path).unwrap());
        let (full, routing) = if round % 2 == 0 {
            (r.snapshot().unwrap(), r.routing_snapshot().unwrap())
        } else {
            let routing = r.routing_snapshot().unwrap();
            (r.snapshot().unwrap(), routing)
        };
        assert_tables_fresh(&full, Capacity::default().maglev_size);
        assert_eq!(routing.generation, full.generation);
        let want = NodeState {
            node: full.state.node.clone(),
            router_id: full.state.router_id,
            advertised: full.state.advertised.clone(),
            peers: full.state.peers.clone(),
            ..NodeState::default()
        };
        assert!(!want.advertised.is_empty() && !want.peers.is_empty());
        assert_eq!(routing.state, want, "round {round}");
        assert!(routing.maglev.is_empty() && routing.maglev6.is_empty());
    }
}

/// The tables' part of the checksum (words 20, 21) lets the routing reader verify all it
/// reads without the tables, and the full reader still catches a scribbled table or a
/// forged part: each case refused by whom it should be.
#[test]
fn the_tables_part_of_the_checksum_guards_both_readers() {
    let (_dir, mut r, scribble, idx) = published_with_scribbler(&dual_stack_services_state());
    let (sec, cap) = (scribble.sections, scribble.capacity);
    let slot = scribble.slot(idx);
    let poke = |at: usize, v: u32| -> u32 { slot[at].swap(v, Ordering::Relaxed) };
    let reseal = || reseal(slot, &sec, &cap);
    let corrupt = |res: Result<Snapshot, ShmError>, what: &str| match res {
        Err(ShmError::Corrupt(_, m)) => assert!(m.contains(what), "{m} (want {what:?})"),
        other => panic!(
            "want Corrupt({what:?}), got {:?}",
            other.map(|s| s.generation)
        ),
    };
    // A scribbled table word: the full reader refuses it; the routing reader reads no
    // table and is right to go on.
    let was = poke(
        sec.maglev6 + 1,
        0x0001_0001 ^ slot[sec.maglev6 + 1].load(Ordering::Relaxed),
    );
    corrupt(r.snapshot(), "checksum");
    assert!(r.routing_snapshot().is_ok());
    poke(sec.maglev6 + 1, was);
    assert!(r.snapshot().is_ok());
    // A scribbled advertised VIP: both refuse it.
    let was = poke(sec.vips + 2, 0xdead_beef);
    corrupt(r.snapshot(), "checksum");
    corrupt(r.routing_snapshot(), "checksum");
    poke(sec.vips + 2, was);
    // A forged tables' part with the checksum resealed over it: the full reader sums
    // the tables and refuses it.
    let was = poke(TABLES_SUM_WORDS.start, 12345);
    reseal();
    corrupt(r.snapshot(), "Maglev tables' checksum");
    poke(TABLES_SUM_WORDS.start, was);
    reseal();
    assert!(r.snapshot().is_ok() && r.routing_snapshot().is_ok());
    // The tables' part stored without resealing: both refuse it.
    poke(TABLES_SUM_WORDS.start + 1, 7);
    corrupt(r.snapshot(), "checksum");
    corrupt(r.routing_snapshot(), "checksum");
}

/// The Maglev sections are where [`TABLE_RANGES`] says in [`used_ranges`]' answer, also
/// with no IPv6 capacity (a zero-length section starting where the next one does).
#[test]
fn the_table_ranges_name_the_maglev_sections() {
    for cap in [
        Capacity::default(),
        Capacity {
            services6: 0,
            ..Capacity::default()
        },
    ] {
        let sec = cap.sections();
        let mut hdr = vec![0u32; SLOT_HEADER_WORDS];
        hdr[2] = 3;
        hdr[16] = cap.services6.min(2);
        let ranges = used_ranges(&hdr, &sec, &cap).unwrap();
        assert_eq!(
            ranges[TABLE_RANGES[0]],
            (sec.maglev, 3 * cap.maglev_words())
        );
        assert_eq!(
            ranges[TABLE_RANGES[1]],
            (sec.maglev6, hdr[16] as usize * cap.maglev_words())
        );
    }
}
