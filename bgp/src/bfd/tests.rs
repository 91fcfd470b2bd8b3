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
    wire: Vec<(Instant, bool, [u8; PACKET_LEN])>,
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
                    if !self.cut {
                        self.wire.push((self.now + self.delay, side_a, p.encode()));
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
                .copied()
                .collect();
            self.wire.retain(|w| w.0 > self.now);
            for (_, to_b, bytes) in due {
                let p = Packet::decode(&bytes).expect("our own packets decode");
                let s = if to_b { &mut self.b } else { &mut self.a };
                let _ = s.handle_packet(self.now, &p);
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
    assert_eq!(with(&|b| b[1] |= 0x04), Err(PacketError::Authenticated));
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
