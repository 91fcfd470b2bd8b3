//! Two sessions wired back to back, in virtual time.

use super::*;

fn cfg(ms: u64, mult: u8) -> BfdConfig {
    BfdConfig {
        desired_min_tx: Duration::from_millis(ms),
        required_min_rx: Duration::from_millis(ms),
        detect_mult: mult,
        control_plane_independent: false,
    }
}

/// Two sessions and a wire with a one-way delay that can be cut.
struct Pair {
    now: Instant,
    a: Session,
    b: Session,
    /// (deliver at, to b?, bytes)
    wire: Vec<(Instant, bool, Vec<u8>)>,
    delay: Duration,
    cut: bool,
    /// (time, side a?, event)
    log: Vec<(Instant, bool, SessionEvent)>,
    sent: Vec<(Instant, bool, Packet)>,
}

impl Pair {
    fn new(ca: BfdConfig, cb: BfdConfig) -> Self {
        let now = Instant::now();
        Pair {
            now,
            a: Session::new(ca, 0x1111, now),
            b: Session::new(cb, 0x2222, now + Duration::from_millis(137)),
            wire: vec![],
            delay: Duration::from_millis(1),
            cut: false,
            log: vec![],
            sent: vec![],
        }
    }

    /// Runs until `until`, stepping to the next timer or delivery each time.
    fn run_until(&mut self, until: Instant) {
        loop {
            for (side_a, s) in [(true, &mut self.a), (false, &mut self.b)] {
                s.handle_timeout(self.now);
                while let Some(p) = s.poll_transmit(self.now) {
                    self.sent.push((self.now, side_a, p));
                    let bytes = s.wire_bytes(&p);
                    if !self.cut {
                        self.wire.push((self.now + self.delay, side_a, bytes));
                    }
                }
                while let Some(e) = s.poll_event() {
                    self.log.push((self.now, side_a, e));
                }
            }
            let next_wire = self.wire.iter().map(|w| w.0).min();
            let next = [
                Some(self.a.poll_timeout()),
                Some(self.b.poll_timeout()),
                next_wire,
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap();
            if next > until {
                self.now = until;
                return;
            }
            self.now = self.now.max(next);
            let due: Vec<_> = self
                .wire
                .iter()
                .filter(|w| w.0 <= self.now)
                .cloned()
                .collect();
            self.wire.retain(|w| w.0 > self.now);
            for (_, to_b, bytes) in due {
                let s = if to_b { &mut self.b } else { &mut self.a };
                let _ = s.receive(self.now, &bytes);
            }
        }
    }

    fn run_for(&mut self, d: Duration) {
        let until = self.now + d;
        self.run_until(until);
    }

    fn up(&self) -> bool {
        self.a.state() == BfdState::Up && self.b.state() == BfdState::Up
    }
}

#[test]
fn sessions_come_up_then_send_at_the_fast_rate() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up(), "a {:?} b {:?}", p.a.state(), p.b.state());
    assert_eq!(p.a.remote_disc(), 0x2222);
    assert_eq!(p.a.detection_time(), Some(Duration::from_millis(900)));
    // Three-way handshake seen as Down -> Init -> Up (or Down -> Up) on each side.
    let a_states: Vec<BfdState> = p
        .log
        .iter()
        .filter(|l| l.1)
        .map(|l| match l.2 {
            SessionEvent::StateChanged { to, .. } => to,
        })
        .collect();
    assert_eq!(*a_states.last().unwrap(), BfdState::Up);
    // The Poll sequence ended and the fast rate applies: ~10 packets in 3 s (75-100 %
    // jitter of 300 ms gives 10..13).
    let start = p.now;
    let before = p.sent.iter().filter(|s| s.1).count();
    p.run_for(Duration::from_secs(3));
    let n = p.sent.iter().filter(|s| s.1 && s.0 >= start).count();
    assert!(p.sent.len() > before);
    assert!((10..=14).contains(&n), "{n} packets from a in 3 s");
    assert!(
        !p.sent.iter().any(|s| s.0 >= start && s.2.poll),
        "no Poll after the sequence ended"
    );
    // Nothing faster than 75 % of the interval between two periodic packets.
    let times: Vec<Instant> = p
        .sent
        .iter()
        .filter(|s| s.1 && s.0 >= start && !s.2.final_)
        .map(|s| s.0)
        .collect();
    for w in times.windows(2) {
        assert!(
            w[1] - w[0] >= Duration::from_millis(225),
            "{:?}",
            w[1] - w[0]
        );
    }
}

#[test]
fn not_up_means_one_packet_a_second_at_most() {
    // b never answers: a stays Down and sends at the slow rate.
    let mut p = Pair::new(cfg(50, 3), cfg(50, 3));
    p.cut = true;
    p.run_for(Duration::from_secs(5));
    assert_eq!(p.a.state(), BfdState::Down);
    let n = p.sent.iter().filter(|s| s.1).count();
    assert!((5..=7).contains(&n), "{n} packets in 5 s while Down");
    assert!(p.sent.iter().all(|s| s.2.desired_min_tx_us >= 1_000_000));
}

#[test]
fn a_dead_path_is_detected_within_multiplier_times_interval() {
    for (ms, mult) in [(300u64, 3u8), (100, 3), (50, 5)] {
        let mut p = Pair::new(cfg(ms, mult), cfg(ms, mult));
        p.run_for(Duration::from_secs(5));
        assert!(p.up());
        p.cut = true;
        let cut_at = p.now;
        // The last packet may have been received just before the cut.
        p.run_for(Duration::from_secs(3));
        let downs: Vec<_> = p
            .log
            .iter()
            .filter(|l| l.0 >= cut_at)
            .filter_map(|l| match l.2 {
                SessionEvent::StateChanged {
                    to: BfdState::Down,
                    diag,
                    ..
                } => Some((l.0 - cut_at, diag)),
                _ => None,
            })
            .collect();
        assert_eq!(downs.len(), 2, "both sides go down: {downs:?}");
        let limit = Duration::from_millis(ms * u64::from(mult));
        for (took, diag) in downs {
            assert_eq!(diag, Diag::DetectionTimeExpired);
            assert!(took <= limit, "{ms} ms x {mult}: down after {took:?}");
            assert!(
                took >= limit / 2,
                "{ms} ms x {mult}: down too early, {took:?}"
            );
        }
        assert_eq!(p.a.remote_disc(), 0, "remote discriminator forgotten");
        // And it comes back when the path heals.
        p.cut = false;
        p.run_for(Duration::from_secs(4));
        assert!(p.up());
    }
}

#[test]
fn detection_uses_the_slower_side() {
    // a wants packets every 100 ms, b can only send every 500 ms: a times b out after
    // 3 x 500 ms, b times a out after a's multiplier (5) x max(b rx 500, a tx 100).
    let mut p = Pair::new(cfg(100, 3), cfg(500, 5));
    p.run_for(Duration::from_secs(5));
    assert!(p.up());
    assert_eq!(p.a.detection_time(), Some(Duration::from_millis(2500)));
    assert_eq!(p.b.detection_time(), Some(Duration::from_millis(1500)));
    assert_eq!(p.a.transmit_interval(), Duration::from_millis(500));
}

#[test]
fn admin_down_brings_the_peer_down_with_its_diagnostic() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    let at = p.now;
    p.a.set_admin_down(true, at);
    p.run_for(Duration::from_secs(1));
    assert_eq!(p.a.state(), BfdState::AdminDown);
    assert_eq!(p.b.state(), BfdState::Down);
    let ev = p.log.iter().rev().find(|l| !l.1).unwrap().2;
    assert_eq!(
        ev,
        SessionEvent::StateChanged {
            from: BfdState::Up,
            to: BfdState::Down,
            diag: Diag::AdministrativelyDown
        }
    );
    // b stays Down (an AdminDown peer is not a path failure and is not brought up).
    p.run_for(Duration::from_secs(3));
    assert_eq!(p.b.state(), BfdState::Down);
    let at = p.now;
    p.a.set_admin_down(false, at);
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
}

#[test]
fn a_poll_is_answered_with_a_final_at_once() {
    let now = Instant::now();
    let mut s = Session::new(cfg(300, 3), 7, now);
    let _ = s.poll_transmit(now);
    let poll = Packet {
        diag: Diag::None,
        state: BfdState::Down,
        poll: true,
        final_: false,
        control_plane_independent: false,
        demand: false,
        detect_mult: 3,
        my_disc: 99,
        your_disc: 0,
        desired_min_tx_us: 1_000_000,
        required_min_rx_us: 300_000,
        required_min_echo_rx_us: 0,
    };
    s.handle_packet(now, &poll).unwrap();
    let f = s.poll_transmit(now).expect("final sent without waiting");
    assert!(f.final_ && !f.poll);
    assert_eq!(f.your_disc, 99);
    assert_eq!(f.state, BfdState::Init);
    assert!(s.poll_transmit(now).is_none(), "periodic timer not yet due");
}

#[test]
fn packets_for_another_session_are_discarded() {
    let now = Instant::now();
    let mut s = Session::new(cfg(300, 3), 7, now);
    let mut p = Packet::decode(
        &Session::new(cfg(300, 3), 8, now)
            .packet(false, false)
            .encode(),
    )
    .unwrap();
    p.your_disc = 12345;
    assert_eq!(
        s.handle_packet(now, &p),
        Err(PacketError::WrongDiscriminator {
            got: 12345,
            ours: 7
        })
    );
    assert_eq!(s.state(), BfdState::Down);
    assert_eq!(s.remote_disc(), 0);
}

#[test]
fn golden_bytes_round_trip() {
    let p = Packet {
        diag: Diag::DetectionTimeExpired,
        state: BfdState::Up,
        poll: true,
        final_: false,
        control_plane_independent: true,
        demand: false,
        detect_mult: 3,
        my_disc: 0x0102_0304,
        your_disc: 0x0a0b_0c0d,
        desired_min_tx_us: 300_000,
        required_min_rx_us: 300_000,
        required_min_echo_rx_us: 0,
    };
    let b = p.encode();
    assert_eq!(
        b,
        [
            0x21, 0xe8, 3, 24, 1, 2, 3, 4, 0x0a, 0x0b, 0x0c, 0x0d, 0, 4, 0x93, 0xe0, 0, 4, 0x93,
            0xe0, 0, 0, 0, 0
        ]
    );
    assert_eq!(Packet::decode(&b), Ok(p));
}

#[test]
fn malformed_packets_are_rejected_with_the_reason() {
    let good = Packet {
        diag: Diag::None,
        state: BfdState::Up,
        poll: false,
        final_: false,
        control_plane_independent: false,
        demand: false,
        detect_mult: 3,
        my_disc: 1,
        your_disc: 2,
        desired_min_tx_us: 1,
        required_min_rx_us: 1,
        required_min_echo_rx_us: 0,
    }
    .encode();
    let with = |f: &dyn Fn(&mut [u8; PACKET_LEN])| {
        let mut b = good;
        f(&mut b);
        Packet::decode(&b)
    };
    assert_eq!(Packet::decode(&good[..20]), Err(PacketError::TooShort(20)));
    assert_eq!(with(&|b| b[0] = 0x40), Err(PacketError::Version(2)));
    assert!(matches!(
        with(&|b| b[3] = 23),
        Err(PacketError::Length { field: 23, .. })
    ));
    assert!(matches!(
        with(&|b| b[3] = 30),
        Err(PacketError::Length { field: 30, .. })
    ));
    // The A bit without room for an authentication section.
    assert!(matches!(
        with(&|b| b[1] |= 0x04),
        Err(PacketError::AuthLength { len: 24, .. })
    ));
    assert_eq!(with(&|b| b[2] = 0), Err(PacketError::ZeroDetectMult));
    assert_eq!(with(&|b| b[1] |= 0x01), Err(PacketError::Multipoint));
    assert_eq!(
        with(&|b| b[4..8].fill(0)),
        Err(PacketError::ZeroMyDiscriminator)
    );
    assert_eq!(
        with(&|b| b[8..12].fill(0)),
        Err(PacketError::ZeroYourDiscriminator(BfdState::Up))
    );
    // Random bytes never panic.
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..10_000 {
        let mut b = [0u8; 40];
        for byte in &mut b {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *byte = x as u8;
        }
        let len = (x >> 32) as usize % 41;
        let _ = Packet::decode(&b[..len]);
    }
}

fn peer_packet(state: BfdState, your: u32, tx_ms: u32, poll: bool) -> Packet {
    Packet {
        diag: Diag::None,
        state,
        poll,
        final_: false,
        control_plane_independent: false,
        demand: false,
        detect_mult: 3,
        my_disc: 99,
        your_disc: your,
        desired_min_tx_us: tx_ms * 1000,
        required_min_rx_us: 300_000,
        required_min_echo_rx_us: 0,
    }
}

/// BIRD keeps its slow (1 s) schedule until its Poll for the fast rate is answered: a
/// packet that polls for a faster rate must not shorten the detection time before the
/// peer has switched (this flapped sessions against BIRD 2.0.12 once).
#[test]
fn a_peer_polling_for_a_faster_rate_is_timed_out_on_its_old_rate_until_it_switches() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut s = Session::new(cfg(300, 3), 7, t0);
    let _ = s.poll_transmit(t0);
    s.handle_packet(t0, &peer_packet(BfdState::Down, 0, 1000, false))
        .unwrap();
    s.handle_packet(t0 + ms(10), &peer_packet(BfdState::Init, 7, 1000, false))
        .unwrap();
    assert_eq!(s.state(), BfdState::Up);
    // Up: we tell the peer at once, with a Poll for our fast rate.
    let p = s.poll_transmit(t0 + ms(10)).expect("sent on going Up");
    assert!(p.poll && p.desired_min_tx_us == 300_000 && p.state == BfdState::Up);
    // The peer polls for 300 ms but keeps sending every second for now.
    s.handle_packet(t0 + ms(20), &peer_packet(BfdState::Up, 7, 300, true))
        .unwrap();
    assert!(s.poll_transmit(t0 + ms(20)).unwrap().final_);
    s.handle_timeout(t0 + ms(1020));
    assert_eq!(s.state(), BfdState::Up, "not timed out on 3 x 300 ms");
    // Once it sends without the Poll, its 300 ms rate counts: 900 ms.
    s.handle_packet(t0 + ms(1020), &peer_packet(BfdState::Up, 7, 300, false))
        .unwrap();
    assert_eq!(s.detection_time(), Some(ms(900)));
    s.handle_timeout(t0 + ms(1900));
    assert_eq!(s.state(), BfdState::Up);
    s.handle_timeout(t0 + ms(1921));
    assert_eq!(s.state(), BfdState::Down);
    assert_eq!(s.local_diag(), Diag::DetectionTimeExpired);
}

/// A restart of the process that runs a session: hold (slow rate via Poll), stop, resume
/// with the same discriminators. The peer never goes down, and detects a dead path at
/// the fast rate again afterwards.
#[test]
fn a_held_session_survives_a_restart_and_resumes_fast() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    let at = p.now;
    p.a.hold_for_restart(Duration::from_secs(10));
    p.run_for(Duration::from_millis(100));
    assert!(!p.a.poll_active(), "the peer acknowledged the slow rate");
    assert_eq!(p.b.detection_time(), Some(Duration::from_secs(30)));
    let (la, ra) = (p.a.local_disc(), p.a.remote_disc());
    // a's process is gone for 20 s: b keeps the session Up.
    let cfg_a = p.a.config();
    p.a = Session::new(cfg_a, 0x7777, p.now + Duration::from_secs(3600)); // silent
    p.run_for(Duration::from_secs(20));
    assert_eq!(p.b.state(), BfdState::Up, "b held the session for 20 s");
    let now = p.now;
    p.a = Session::resume(cfg_a, la, ra, now);
    p.run_for(Duration::from_secs(2));
    assert!(p.up());
    assert_eq!(p.b.detection_time(), Some(Duration::from_millis(900)));
    let downs = p
        .log
        .iter()
        .filter(|l| l.0 >= at && !l.1)
        .filter(|l| {
            matches!(
                l.2,
                SessionEvent::StateChanged {
                    to: BfdState::Down,
                    ..
                }
            )
        })
        .count();
    assert_eq!(downs, 0, "b never went down");
}

/// What a spoofer on the path sends (issue #25): "Down", Your Discriminator 0, a made-up
/// My Discriminator. Before RFC 5880 6.8.6 was followed to the letter, one such packet
/// dropped an Up session and overwrote the remote discriminator.
fn spoofed(state: BfdState, my: u32, your: u32) -> Packet {
    Packet {
        my_disc: my,
        ..peer_packet(state, your, 300, false)
    }
}

#[test]
fn a_spoofed_down_without_our_discriminator_does_not_drop_an_up_session() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    let now = p.now;
    for pkt in [
        // Your Discriminator 0 (the session is selected by address) and a stranger's own.
        spoofed(BfdState::Down, 0x6666, 0),
        spoofed(BfdState::AdminDown, 0x6666, 0),
        // Ours guessed right, the peer's not.
        spoofed(BfdState::Down, 0x6666, 0x1111),
        spoofed(BfdState::AdminDown, 0x6666, 0x1111),
    ] {
        assert_eq!(
            p.a.handle_packet(now, &pkt),
            Err(PacketError::NotThePeer {
                got: 0x6666,
                peer: 0x2222
            }),
            "{pkt:?}"
        );
        assert_eq!(p.a.state(), BfdState::Up, "{pkt:?}");
        assert_eq!(p.a.remote_disc(), 0x2222, "learned discriminator kept");
    }
    assert_eq!(p.a.discarded, 4);
    p.run_for(Duration::from_secs(2));
    assert!(p.up(), "the real peer's packets still keep it Up");
    assert!(!p.log.iter().any(|(_, _, e)| matches!(
        e,
        SessionEvent::StateChanged {
            to: BfdState::Down,
            ..
        }
    )));
}

#[test]
fn spoofed_packets_do_not_keep_a_dead_session_up() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    p.cut = true;
    let t0 = p.now;
    // A stranger keeps sending "Up" packets every 100 ms with our discriminator guessed.
    while p.now < t0 + Duration::from_millis(1500) {
        let now = p.now;
        let _ =
            p.a.handle_packet(now, &spoofed(BfdState::Up, 0x6666, 0x1111));
        p.run_for(Duration::from_millis(100));
    }
    assert_eq!(p.a.state(), BfdState::Down);
    assert_eq!(p.a.local_diag(), Diag::DetectionTimeExpired);
}

/// The peer itself, after its detection time expired, forgets our discriminator (RFC 5880
/// 6.8.1) and says Down with Your Discriminator 0: with its own discriminator, that is
/// still the peer, and the session goes down at once.
#[test]
fn the_peer_saying_down_with_its_own_discriminator_still_brings_the_session_down() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    let now = p.now;
    p.a.handle_packet(now, &spoofed(BfdState::Down, 0x2222, 0))
        .unwrap();
    assert_eq!(p.a.state(), BfdState::Down);
    assert_eq!(p.a.local_diag(), Diag::NeighborSignaledDown);
    // The peer gave no reason of its own: the event says it signalled the session down.
    let last = std::iter::from_fn(|| p.a.poll_event()).last();
    assert!(
        matches!(
            last,
            Some(SessionEvent::StateChanged {
                to: BfdState::Down,
                diag: Diag::NeighborSignaledDown,
                ..
            })
        ),
        "{last:?}"
    );
}

/// A peer that restarts with a new discriminator is not heard while our session is Up:
/// the session times out (one detection time), then comes up with the new one.
#[test]
fn a_peer_restarting_with_a_new_discriminator_comes_back_after_one_detection_time() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    p.b = Session::new(cfg(300, 3), 0x3333, p.now);
    let t0 = p.now;
    p.run_for(Duration::from_secs(6));
    let down = p
        .log
        .iter()
        .find(|(t, a, e)| {
            *t >= t0
                && *a
                && matches!(
                    e,
                    SessionEvent::StateChanged {
                        to: BfdState::Down,
                        ..
                    }
                )
        })
        .expect("a goes down");
    assert!(
        down.0 - t0 <= Duration::from_millis(900),
        "{:?}",
        down.0 - t0
    );
    assert!(p.up(), "up again");
    assert_eq!(p.a.remote_disc(), 0x3333);
}

// ---- Authentication (RFC 5880 6.7.3 Keyed SHA1, 6.7.4 Meticulous Keyed SHA1) ----

fn sha1_auth(kind: AuthType, key: &str) -> Auth {
    Auth::new(kind, 7, Secret::new(key)).unwrap()
}

/// Both sides of a pair authenticated with `ka` / `kb`.
fn auth_pair(ka: Auth, kb: Auth) -> Pair {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.a.set_auth(Some(ka), 0xffff_fff0);
    p.b.set_auth(Some(kb), 17);
    p
}

/// The bytes of a known packet, its digest computed apart (Python's hashlib over the 52
/// bytes with "juneau-bfd" zero-padded to 20 in the digest field).
#[test]
fn golden_meticulous_keyed_sha1_packet() {
    let p = Packet {
        diag: Diag::None,
        state: BfdState::Up,
        poll: false,
        final_: false,
        control_plane_independent: false,
        demand: false,
        detect_mult: 3,
        my_disc: 0x0102_0304,
        your_disc: 0x0a0b_0c0d,
        desired_min_tx_us: 300_000,
        required_min_rx_us: 300_000,
        required_min_echo_rx_us: 0,
    };
    let a = sha1_auth(AuthType::MeticulousKeyedSha1, "juneau-bfd");
    let b = p.encode_sha1(&a, 0xdead_beef);
    assert_eq!(b[..4], [0x20, 0xc4, 3, 52]);
    assert_eq!(b[24..32], [5, 28, 7, 0, 0xde, 0xad, 0xbe, 0xef]);
    assert_eq!(
        b[32..],
        [
            0x6d, 0x8d, 0xfe, 0x3a, 0x5e, 0xc9, 0x35, 0x79, 0xa4, 0xd7, 0xcf, 0x5f, 0x1d, 0x1d,
            0x4c, 0xa7, 0xad, 0x0a, 0xa9, 0x44
        ]
    );
    let (q, s) = Packet::decode_any(&b).unwrap();
    assert_eq!(q, p);
    assert_eq!(
        s,
        Some(AuthSection {
            auth_type: 5,
            key_id: 7,
            seq: 0xdead_beef
        })
    );
    assert_eq!(Packet::decode(&b), Err(PacketError::Authenticated));
    // Keyed SHA1 is type 4.
    let k = p.encode_sha1(&sha1_auth(AuthType::KeyedSha1, "juneau-bfd"), 1);
    assert_eq!(k[24], 4);
}

#[test]
fn auth_keys_are_one_to_twenty_bytes() {
    assert!(Auth::new(AuthType::KeyedSha1, 0, Secret::new("x".repeat(20))).is_ok());
    assert_eq!(
        Auth::new(AuthType::KeyedSha1, 0, Secret::new("x".repeat(21))),
        Err(AuthConfigError::KeyTooLong(21))
    );
    assert_eq!(
        Auth::new(AuthType::KeyedSha1, 0, Secret::new("")),
        Err(AuthConfigError::EmptyKey)
    );
    let dbg = format!("{:?}", sha1_auth(AuthType::KeyedSha1, "hunter2"));
    assert!(!dbg.contains("hunter2"), "{dbg}");
}

#[test]
fn sessions_come_up_with_keyed_sha1_and_with_meticulous_keyed_sha1() {
    for kind in [AuthType::KeyedSha1, AuthType::MeticulousKeyedSha1] {
        let mut p = auth_pair(sha1_auth(kind, "k3y"), sha1_auth(kind, "k3y"));
        p.run_for(Duration::from_secs(4));
        assert!(p.up(), "{kind}");
        // Across the sequence number's wrap (a started at 2^32 - 16).
        p.run_for(Duration::from_secs(10));
        assert!(p.up(), "{kind}");
        assert_eq!(p.a.auth_failures + p.b.auth_failures, 0, "{kind}");
        assert!(
            p.a.next_auth_seq() < 100,
            "wrapped: {}",
            p.a.next_auth_seq()
        );
    }
}

#[test]
fn a_wrong_key_keeps_the_session_down_and_is_counted() {
    for kind in [AuthType::KeyedSha1, AuthType::MeticulousKeyedSha1] {
        let mut p = auth_pair(sha1_auth(kind, "right"), sha1_auth(kind, "wrong"));
        p.run_for(Duration::from_secs(5));
        assert_eq!(p.a.state(), BfdState::Down, "{kind}");
        assert_eq!(p.b.state(), BfdState::Down, "{kind}");
        assert!(p.a.auth_failures >= 4, "{kind}: {}", p.a.auth_failures);
        assert!(p.b.auth_failures >= 4, "{kind}: {}", p.b.auth_failures);
    }
}

#[test]
fn an_unauthenticated_peer_is_not_heard_and_neither_is_an_authenticated_one_by_a_plain_session() {
    let mut p = Pair::new(cfg(300, 3), cfg(300, 3));
    p.a.set_auth(Some(sha1_auth(AuthType::KeyedSha1, "k")), 1);
    p.run_for(Duration::from_secs(5));
    assert_eq!(p.a.state(), BfdState::Down);
    assert_eq!(p.b.state(), BfdState::Down);
    assert!(p.a.auth_failures >= 4, "A bit clear, auth configured");
    assert!(p.b.auth_failures >= 4, "A bit set, no auth configured");
}

/// The perfect forgery (both discriminators right, from the peer's address)
/// without the key does not take an authenticated Up session down.
#[test]
fn a_spoofed_unauthenticated_down_does_not_drop_an_authenticated_up_session() {
    for kind in [AuthType::KeyedSha1, AuthType::MeticulousKeyedSha1] {
        let mut p = auth_pair(sha1_auth(kind, "k3y"), sha1_auth(kind, "k3y"));
        p.run_for(Duration::from_secs(4));
        assert!(p.up());
        let now = p.now;
        let forged = spoofed(BfdState::Down, 0x2222, 0x1111);
        let other_key = sha1_auth(kind, "guess");
        for bytes in [
            forged.encode().to_vec(),
            spoofed(BfdState::AdminDown, 0x2222, 0x1111)
                .encode()
                .to_vec(),
            forged.encode_sha1(&other_key, 0).to_vec(),
        ] {
            assert!(p.a.receive(now, &bytes).is_err());
            assert_eq!(p.a.state(), BfdState::Up, "{kind}");
        }
        assert_eq!(p.a.auth_failures, 3, "{kind}");
        p.run_for(Duration::from_secs(2));
        assert!(p.up(), "{kind}");
    }
}

/// The same forgery keeps no dead authenticated session Up.
#[test]
fn spoofed_packets_without_the_key_do_not_keep_a_dead_authenticated_session_up() {
    let kind = AuthType::KeyedSha1;
    let mut p = auth_pair(sha1_auth(kind, "k3y"), sha1_auth(kind, "k3y"));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    p.cut = true;
    let t0 = p.now;
    while p.now < t0 + Duration::from_millis(1500) {
        let now = p.now;
        let _ =
            p.a.receive(now, &spoofed(BfdState::Up, 0x2222, 0x1111).encode());
        p.run_for(Duration::from_millis(100));
    }
    assert_eq!(p.a.state(), BfdState::Down);
    assert_eq!(p.a.local_diag(), Diag::DetectionTimeExpired);
}

/// A session whose peer is `b`, fed by hand: returns it Up after one accepted packet with
/// sequence number `seq0`, and the peer's auth to forge the next ones with.
fn hand_fed(kind: AuthType) -> (Session, Auth, Instant) {
    let now = Instant::now();
    let auth = sha1_auth(kind, "k3y");
    let mut s = Session::new(cfg(300, 3), 0x1111, now);
    s.set_auth(Some(auth.clone()), 1);
    let init = Packet {
        my_disc: 0x2222,
        ..peer_packet(BfdState::Init, 0x1111, 300, false)
    };
    s.receive(now, &init.encode_sha1(&auth, 1000)).unwrap();
    assert_eq!(s.state(), BfdState::Up);
    (s, auth, now)
}

fn up_from_b() -> Packet {
    Packet {
        my_disc: 0x2222,
        ..peer_packet(BfdState::Up, 0x1111, 300, false)
    }
}

#[test]
fn meticulous_keyed_sha1_requires_a_new_sequence_number_every_packet() {
    let (mut s, auth, now) = hand_fed(AuthType::MeticulousKeyedSha1);
    let p = up_from_b();
    // A replay of the same number, and one behind.
    for seq in [1000, 999, 1000 - 100] {
        assert_eq!(
            s.receive(now, &p.encode_sha1(&auth, seq)),
            Err(PacketError::AuthSequence {
                got: seq,
                last: 1000
            })
        );
    }
    // Beyond 3 x Detect Mult (9) ahead.
    assert!(matches!(
        s.receive(now, &p.encode_sha1(&auth, 1010)),
        Err(PacketError::AuthSequence { got: 1010, .. })
    ));
    assert_eq!(s.auth_failures, 4);
    // Within: 1001 .. 1009; a gap is fine (lost packets).
    s.receive(now, &p.encode_sha1(&auth, 1001)).unwrap();
    s.receive(now, &p.encode_sha1(&auth, 1009)).unwrap();
    assert!(s.receive(now, &p.encode_sha1(&auth, 1009)).is_err());
    assert_eq!(s.auth_failures, 5);
}

#[test]
fn keyed_sha1_accepts_the_same_sequence_number_within_the_window_only() {
    let (mut s, auth, now) = hand_fed(AuthType::KeyedSha1);
    let p = up_from_b();
    s.receive(now, &p.encode_sha1(&auth, 1000)).unwrap();
    s.receive(now, &p.encode_sha1(&auth, 1009)).unwrap();
    for seq in [1008, 1019, 0] {
        assert!(
            matches!(
                s.receive(now, &p.encode_sha1(&auth, seq)),
                Err(PacketError::AuthSequence { .. })
            ),
            "{seq}"
        );
    }
    assert_eq!(s.auth_failures, 3);
    assert_eq!(s.state(), BfdState::Up);
}

#[test]
fn wrong_digest_type_and_key_id_are_discarded_and_counted() {
    let (mut s, auth, now) = hand_fed(AuthType::MeticulousKeyedSha1);
    let p = Packet {
        state: BfdState::Down,
        ..up_from_b()
    };
    let mut b = p.encode_sha1(&auth, 1001);
    b[40] ^= 1;
    assert_eq!(s.receive(now, &b), Err(PacketError::AuthDigest));
    let mut b = p.encode_sha1(&auth, 1001);
    b[20] ^= 1; // a covered byte changed in flight
    assert_eq!(s.receive(now, &b), Err(PacketError::AuthDigest));
    let other_id = Auth::new(AuthType::MeticulousKeyedSha1, 8, Secret::new("k3y")).unwrap();
    assert_eq!(
        s.receive(now, &p.encode_sha1(&other_id, 1001)),
        Err(PacketError::AuthKeyId { got: 8, want: 7 })
    );
    let keyed = sha1_auth(AuthType::KeyedSha1, "k3y");
    assert_eq!(
        s.receive(now, &p.encode_sha1(&keyed, 1001)),
        Err(PacketError::AuthType {
            got: 4,
            want: AuthType::MeticulousKeyedSha1
        })
    );
    // Simple password (type 1): we do not speak it.
    let mut simple = p.encode().to_vec();
    simple[1] |= 0x04;
    simple[3] = 24 + 7;
    simple.extend_from_slice(&[1, 7, 7, b'k', b'3', b'y', b'!']);
    assert_eq!(
        s.receive(now, &simple),
        Err(PacketError::AuthType {
            got: 1,
            want: AuthType::MeticulousKeyedSha1
        })
    );
    // A SHA1 section with the wrong Auth Len.
    let mut short = p.encode_sha1(&auth, 1001);
    short[25] = 27;
    assert!(matches!(
        s.receive(now, &short),
        Err(PacketError::AuthLength { .. })
    ));
    assert_eq!(s.auth_failures, 5);
    assert_eq!(s.state(), BfdState::Up, "none of them took it down");
    // The real one does.
    s.receive(now, &p.encode_sha1(&auth, 1001)).unwrap();
    assert_eq!(s.state(), BfdState::Down);
}

/// RFC 5880 6.8.1: bfd.AuthSeqKnown is forgotten after twice the detection time without
/// a packet, so a peer that restarted with a new random sequence number is heard again.
#[test]
fn the_sequence_number_is_forgotten_after_twice_the_detection_time() {
    let (mut s, auth, now) = hand_fed(AuthType::MeticulousKeyedSha1);
    let p = up_from_b();
    let later = now + Duration::from_millis(1700);
    assert!(s.receive(later, &p.encode_sha1(&auth, 5)).is_err());
    let later = now + Duration::from_millis(1800);
    s.handle_timeout(later);
    s.receive(later, &p.encode_sha1(&auth, 5)).unwrap();
}

/// A restart hold with authentication: the resumed session continues the sequence
/// numbers, so the peer (meticulous) keeps the session Up.
#[test]
fn a_held_authenticated_session_resumes_with_the_next_sequence_number() {
    let kind = AuthType::MeticulousKeyedSha1;
    let mut p = auth_pair(sha1_auth(kind, "k3y"), sha1_auth(kind, "k3y"));
    p.run_for(Duration::from_secs(4));
    assert!(p.up());
    p.a.hold_for_restart(Duration::from_secs(10));
    p.run_for(Duration::from_millis(100));
    let (la, ra, seq) = (p.a.local_disc(), p.a.remote_disc(), p.a.next_auth_seq());
    let cfg_a = p.a.config();
    p.a = Session::new(cfg_a, 0x7777, p.now + Duration::from_secs(3600)); // silent
    p.run_for(Duration::from_secs(20));
    let now = p.now;
    p.a = Session::resume(cfg_a, la, ra, now);
    p.a.set_auth(Some(sha1_auth(kind, "k3y")), seq);
    p.run_for(Duration::from_secs(2));
    assert!(p.up());
    assert_eq!(p.b.auth_failures, 0);
    assert_eq!(p.b.state(), BfdState::Up);
}
