//! Two FSMs against each other over a simulated network, in virtual time.

use std::collections::{BTreeMap, VecDeque};

use super::*;
use crate::family::Families;
use crate::wire::{Update, HEADER_LEN};

const S: Duration = Duration::from_secs(1);

fn cfg(local: u32, peer: u32, id: [u8; 4], passive: bool) -> SessionConfig {
    SessionConfig {
        local_asn: local,
        peer_asn: peer,
        router_id: Ipv4Addr::from(id),
        hold_time: 9,
        keepalive_time: 3,
        connect_retry_time: 5,
        passive,
        graceful_restart_time: Some(120),
        families: Families::IPV4,
        extended_next_hop: false,
    }
}

#[derive(Default)]
struct Log {
    established: Vec<(Duration, ConnId, Negotiated)>,
    down: Vec<(Duration, DownReason)>,
    sent_notifications: Vec<Notification>,
    connects: Vec<Duration>,
    treat_as_withdraw: usize,
    keepalives_sent: usize,
}

struct Node {
    peer: Peer,
    timers: BTreeMap<Timer, Duration>,
    log: Log,
}

#[derive(Clone, Copy)]
struct Link {
    a: ConnId,
    b: ConnId,
    open: bool,
}

/// The network: side 0 is `a`, side 1 is `b`.
struct Sim {
    now: Duration,
    nodes: [Node; 2],
    links: Vec<Link>,
    queue: VecDeque<(usize, OwnedEvent)>,
    /// Connection attempts from side i fail while this is set.
    unreachable: [bool; 2],
    /// Bytes towards side i are lost while this is set (connections stay up).
    blackhole: [bool; 2],
    /// Peer i answers connects (a listener exists).
    listening: [bool; 2],
}

enum OwnedEvent {
    Connected(ConnId, bool),
    ConnectFailed(ConnId),
    Closed(ConnId),
    Received(ConnId, Vec<u8>),
}

impl Sim {
    fn new(a: SessionConfig, b: SessionConfig) -> Self {
        let node = |c| Node {
            peer: Peer::new(c),
            timers: BTreeMap::new(),
            log: Log::default(),
        };
        Sim {
            now: Duration::ZERO,
            nodes: [node(a), node(b)],
            links: Vec::new(),
            queue: VecDeque::new(),
            unreachable: [false; 2],
            blackhole: [false; 2],
            listening: [true; 2],
        }
    }

    fn feed(&mut self, side: usize, ev: Event<'_>) {
        let actions = self.nodes[side].peer.handle(ev);
        for a in actions {
            self.act(side, a);
        }
    }

    fn act(&mut self, side: usize, a: Action) {
        let other = 1 - side;
        match a {
            Action::Connect(id) => {
                self.nodes[side].log.connects.push(self.now);
                if self.unreachable[side] || !self.listening[other] {
                    self.queue.push_back((side, OwnedEvent::ConnectFailed(id)));
                } else {
                    let remote = self.nodes[other].peer.new_conn_id();
                    let (a, b) = if side == 0 {
                        (id, remote)
                    } else {
                        (remote, id)
                    };
                    self.links.push(Link { a, b, open: true });
                    self.queue
                        .push_back((side, OwnedEvent::Connected(id, true)));
                    self.queue
                        .push_back((other, OwnedEvent::Connected(remote, false)));
                }
            }
            Action::Send(id, bytes) => {
                let mut off = 0;
                while off + HEADER_LEN <= bytes.len() {
                    let len = u16::from_be_bytes([bytes[off + 16], bytes[off + 17]]) as usize;
                    match bytes[off + 18] {
                        wire::msg_type::NOTIFICATION => {
                            self.nodes[side].log.sent_notifications.push(Notification {
                                code: bytes[off + 19],
                                subcode: bytes[off + 20],
                                data: bytes[off + 21..off + len].to_vec(),
                            })
                        }
                        wire::msg_type::KEEPALIVE => self.nodes[side].log.keepalives_sent += 1,
                        _ => {}
                    }
                    off += len;
                }
                if let Some((remote, open)) = self.remote_of(side, id) {
                    if open && !self.blackhole[other] {
                        self.queue
                            .push_back((other, OwnedEvent::Received(remote, bytes)));
                    }
                }
            }
            Action::Close(id) => {
                if let Some((remote, open)) = self.remote_of(side, id) {
                    if open {
                        self.close_link(side, id);
                        self.queue.push_back((other, OwnedEvent::Closed(remote)));
                    }
                }
            }
            Action::ArmTimer(t, d) => {
                self.nodes[side].timers.insert(t, self.now + d);
            }
            Action::CancelTimer(t) => {
                self.nodes[side].timers.remove(&t);
            }
            Action::Established(id, n) => self.nodes[side].log.established.push((self.now, id, n)),
            Action::Down(r) => self.nodes[side].log.down.push((self.now, r)),
            Action::TreatAsWithdraw(_) => self.nodes[side].log.treat_as_withdraw += 1,
            Action::StateChanged(_) | Action::RouteRefresh(_) | Action::Error(_) => {}
        }
    }

    fn remote_of(&self, side: usize, id: ConnId) -> Option<(ConnId, bool)> {
        self.links.iter().rev().find_map(|l| match side {
            0 if l.a == id => Some((l.b, l.open)),
            1 if l.b == id => Some((l.a, l.open)),
            _ => None,
        })
    }

    fn close_link(&mut self, side: usize, id: ConnId) {
        for l in self.links.iter_mut() {
            if (side == 0 && l.a == id) || (side == 1 && l.b == id) {
                l.open = false;
            }
        }
    }

    /// Delivers everything queued and fires every timer due up to `until`.
    fn run_until(&mut self, until: Duration) {
        for _ in 0..1_000_000 {
            if let Some((side, ev)) = self.queue.pop_front() {
                match ev {
                    OwnedEvent::Connected(c, o) => self.feed(
                        side,
                        Event::Connected {
                            conn: c,
                            outbound: o,
                        },
                    ),
                    OwnedEvent::ConnectFailed(c) => self.feed(side, Event::ConnectFailed(c)),
                    OwnedEvent::Closed(c) => self.feed(side, Event::Closed(c)),
                    OwnedEvent::Received(c, b) => self.feed(side, Event::Received(c, &b)),
                }
                continue;
            }
            let next = (0..2)
                .flat_map(|s| self.nodes[s].timers.iter().map(move |(t, at)| (*at, s, *t)))
                .min();
            match next {
                Some((at, side, t)) if at <= until => {
                    self.now = self.now.max(at);
                    self.nodes[side].timers.remove(&t);
                    self.feed(side, Event::TimerFired(t));
                }
                _ => {
                    self.now = until;
                    return;
                }
            }
        }
        panic!("simulation did not settle");
    }

    fn state(&self, side: usize) -> State {
        self.nodes[side].peer.state()
    }

    fn established_conn(&self, side: usize) -> ConnId {
        self.nodes[side].peer.established().expect("established").0
    }

    /// Injects raw bytes as if the other side sent them on the established connection.
    fn inject(&mut self, side: usize, bytes: &[u8]) {
        let c = self.established_conn(side);
        self.feed(side, Event::Received(c, bytes));
    }
}

fn up_pair() -> Sim {
    let mut sim = Sim::new(
        cfg(65001, 65002, [10, 0, 0, 1], false),
        cfg(65002, 65001, [10, 0, 0, 2], true),
    );
    sim.feed(0, Event::Start);
    sim.feed(1, Event::Start);
    sim.run_until(S);
    assert_eq!(
        (sim.state(0), sim.state(1)),
        (State::Established, State::Established)
    );
    sim
}

#[test]
fn active_and_passive_peer_reach_established() {
    let sim = up_pair();
    let (_, _, n) = &sim.nodes[0].log.established[0];
    assert_eq!(n.hold_time, 9 * S);
    assert_eq!(n.keepalive, 3 * S);
    assert!(n.graceful_restart);
    assert_eq!(n.peer.asn, 65002);
    assert_eq!(
        sim.nodes[1].log.established[0].2.peer.router_id,
        Ipv4Addr::new(10, 0, 0, 1)
    );
    // The passive side never connected.
    assert!(sim.nodes[1].log.connects.is_empty());
}

#[test]
fn keepalives_hold_the_session_for_an_hour_of_virtual_time() {
    let mut sim = up_pair();
    sim.run_until(3600 * S);
    assert_eq!(
        (sim.state(0), sim.state(1)),
        (State::Established, State::Established)
    );
    assert!(sim.nodes[0].log.down.is_empty());
    // One KEEPALIVE every 3 s, plus the one that confirms the OPEN.
    let k = sim.nodes[0].log.keepalives_sent;
    assert!((1199..=1202).contains(&k), "{k} keepalives");
}

#[test]
fn hold_timer_expires_in_virtual_time_and_the_session_comes_back() {
    let mut sim = up_pair();
    sim.run_until(100 * S);
    // From now on nothing reaches side 0.
    sim.blackhole[0] = true;
    let cut = sim.now;
    sim.run_until(cut + 30 * S);
    let (at, reason) = sim.nodes[0].log.down[0].clone();
    assert_eq!(reason, DownReason::Sent(Notification::hold_timer_expired()));
    // The last KEEPALIVE from side 1 arrived at most 3 s before the cut.
    assert!(
        at > cut + 6 * S && at <= cut + 9 * S,
        "hold expired at {at:?}, cut at {cut:?}"
    );
    assert_eq!(
        sim.nodes[0].log.sent_notifications.last().map(|n| n.code),
        Some(4)
    );

    // The network heals: the idle-hold backoff restarts the session by itself.
    sim.blackhole[0] = false;
    sim.run_until(cut + 200 * S);
    assert_eq!(
        (sim.state(0), sim.state(1)),
        (State::Established, State::Established)
    );
}

#[test]
fn connect_retry_backs_off_and_caps() {
    let mut sim = Sim::new(
        cfg(65001, 65002, [10, 0, 0, 1], false),
        cfg(65002, 65001, [10, 0, 0, 2], true),
    );
    sim.listening[1] = false;
    sim.feed(0, Event::Start);
    sim.run_until(1000 * S);
    assert_eq!(sim.state(0), State::Active);
    let t = &sim.nodes[0].log.connects;
    let gaps: Vec<u64> = t.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
    assert_eq!(&gaps[..6], &[5, 10, 20, 40, 80, 120]);
    assert!(gaps[6..].iter().all(|&g| g == 120));

    // The router comes up: the next attempt succeeds and the backoff resets.
    sim.listening[1] = true;
    sim.feed(1, Event::Start);
    sim.run_until(1200 * S);
    assert_eq!(sim.state(0), State::Established);
}

#[test]
fn collision_keeps_the_connection_of_the_higher_router_id() {
    for (a_id, b_id) in [
        ([10, 0, 0, 1], [10, 0, 0, 2]),
        ([10, 0, 0, 9], [10, 0, 0, 2]),
    ] {
        let mut sim = Sim::new(
            cfg(65001, 65002, a_id, false),
            cfg(65002, 65001, b_id, false),
        );
        // Both connect at the same instant.
        sim.feed(0, Event::Start);
        sim.feed(1, Event::Start);
        sim.run_until(2 * S);
        assert_eq!(
            (sim.state(0), sim.state(1)),
            (State::Established, State::Established)
        );
        let a_conn = sim.established_conn(0);
        let b_conn = sim.established_conn(1);
        let link = sim
            .links
            .iter()
            .find(|l| l.a == a_conn)
            .copied()
            .expect("link");
        assert_eq!(link.b, b_conn, "both sides kept the same connection");
        let initiated_by_a = sim.nodes[0]
            .peer
            .conns
            .iter()
            .find(|c| c.id == a_conn)
            .unwrap()
            .outbound;
        assert_eq!(
            initiated_by_a,
            u32::from(Ipv4Addr::from(a_id)) > u32::from(Ipv4Addr::from(b_id))
        );
        let collisions = sim.nodes[0]
            .log
            .sent_notifications
            .iter()
            .chain(&sim.nodes[1].log.sent_notifications)
            .filter(|n| (n.code, n.subcode) == (6, 7))
            .count();
        // Each side detects the collision and closes the same losing connection.
        assert!(
            (1..=2).contains(&collisions),
            "{collisions} collision notifications"
        );
        assert!(sim.nodes[0].log.down.is_empty() && sim.nodes[1].log.down.is_empty());
        // Only one connection each is left.
        assert_eq!(sim.nodes[0].peer.conns.len(), 1);
        assert_eq!(sim.nodes[1].peer.conns.len(), 1);
    }
}

fn assert_reset_with(sim: &mut Sim, bytes: &[u8], code: u8, subcode: u8) {
    sim.inject(0, bytes);
    assert_eq!(sim.state(0), State::Idle);
    let n = sim.nodes[0]
        .log
        .sent_notifications
        .last()
        .expect("a NOTIFICATION");
    assert_eq!((n.code, n.subcode), (code, subcode));
    assert!(matches!(
        sim.nodes[0].log.down.last(),
        Some((_, DownReason::Sent(_)))
    ));
}

#[test]
fn malformed_input_gets_the_right_notification() {
    let marker = [0xffu8; 16];
    let msg = |len: u16, ty: u8, body: &[u8]| {
        let mut v = marker.to_vec();
        v.extend_from_slice(&len.to_be_bytes());
        v.push(ty);
        v.extend_from_slice(body);
        v
    };
    let cases: Vec<(Vec<u8>, u8, u8)> = vec![
        ([0u8; 19].to_vec(), 1, 1),                         // not synchronized
        (msg(18, 4, &[]), 1, 2),                            // bad length
        (msg(19, 42, &[]), 1, 3),                           // bad type
        (msg(23, 2, &[0, 200, 0, 0]), 3, 1),                // withdrawn length overrun
        (msg(28, 2, &[0, 0, 0, 0, 40, 1, 2, 3, 4]), 3, 10), // NLRI /40
        (
            wire::encode(&Message::Open(
                cfg(65002, 65001, [10, 0, 0, 2], false).open(),
            ))
            .unwrap(),
            5,
            3,
        ),
    ];
    for (bytes, code, subcode) in cases {
        let mut sim = up_pair();
        assert_reset_with(&mut sim, &bytes, code, subcode);
        // It recovers by itself after the idle hold.
        sim.run_until(sim.now + 10 * S);
        assert_eq!(sim.state(0), State::Established);
    }
}

#[test]
fn attribute_errors_are_treat_as_withdraw_and_keep_the_session() {
    let mut sim = up_pair();
    let mut bad = wire::encode(&Message::Update(Update {
        withdrawn: vec![],
        attributes: None,
        announced: vec!["192.0.2.1/32".parse().unwrap()],
        ..Update::default()
    }))
    .unwrap();
    // Splice in an attribute list whose only attribute overruns it.
    bad.splice(21..23, [0, 4, 0x40, 1, 9, 0]);
    let len = bad.len() as u16;
    bad[16..18].copy_from_slice(&len.to_be_bytes());
    sim.inject(0, &bad);
    assert_eq!(sim.state(0), State::Established);
    assert_eq!(sim.nodes[0].log.treat_as_withdraw, 1);
    // Well-formed UPDATEs are counted and dropped.
    let good = wire::encode(&Message::Update(Update {
        withdrawn: vec![],
        attributes: Some(wire::PathAttributes {
            origin: wire::Origin::Igp,
            as_path: vec![65002],
            next_hop: Ipv4Addr::new(10, 0, 0, 2),
            local_pref: None,
            communities: vec![],
            large_communities: vec![],
            link_bandwidth: None,
        }),
        announced: vec![
            "192.0.2.1/32".parse().unwrap(),
            "192.0.2.2/32".parse().unwrap(),
        ],
        ..Update::default()
    }))
    .unwrap();
    sim.inject(0, &good);
    assert_eq!(sim.nodes[0].peer.prefixes_received, 2);
    assert_eq!(sim.state(0), State::Established);
}

#[test]
fn messages_split_across_reads_are_reassembled() {
    let mut sim = up_pair();
    let k = keepalive_bytes();
    let mut two = k.clone();
    two.extend_from_slice(&k);
    for chunk in two.chunks(5) {
        sim.inject(0, chunk);
    }
    assert_eq!(sim.state(0), State::Established);
}

#[test]
fn wrong_peer_as_is_refused_with_bad_peer_as() {
    let mut sim = Sim::new(
        cfg(65001, 65099, [10, 0, 0, 1], false),
        cfg(65002, 65001, [10, 0, 0, 2], true),
    );
    sim.feed(0, Event::Start);
    sim.feed(1, Event::Start);
    sim.run_until(S);
    assert_ne!(sim.state(0), State::Established);
    let n = &sim.nodes[0].log.sent_notifications[0];
    assert_eq!((n.code, n.subcode), (2, 2));
}

#[test]
fn unacceptable_hold_time_and_missing_four_octet_as_are_refused() {
    let mut sim = up_pair();
    sim.feed(0, Event::Stop(None));
    sim.run_until(sim.now + S);
    // A peer that opens with hold time 2.
    let mut p = Peer::new(cfg(65001, 65002, [10, 0, 0, 1], true));
    p.handle(Event::Start);
    let id = p.new_conn_id();
    p.handle(Event::Connected {
        conn: id,
        outbound: false,
    });
    let mut open = cfg(65002, 65001, [10, 0, 0, 2], false).open();
    open.hold_time = 2;
    let mut bytes = wire::encode(&Message::Open(open.clone())).unwrap();
    // The codec itself refuses hold time 2, so this is a 2/6 either way.
    let acts = p.handle(Event::Received(id, &bytes));
    assert!(
        acts.iter()
            .any(|a| matches!(a, Action::Send(_, b) if b[18] == 3 && b[19] == 2 && b[20] == 6)),
        "{acts:?}"
    );

    let id = p.new_conn_id();
    p.handle(Event::TimerFired(Timer::IdleHold));
    p.handle(Event::Connected {
        conn: id,
        outbound: false,
    });
    open.hold_time = 90;
    open.capabilities.four_octet_as = None;
    bytes = wire::encode(&Message::Open(open)).unwrap();
    let acts = p.handle(Event::Received(id, &bytes));
    assert!(
        acts.iter()
            .any(|a| matches!(a, Action::Send(_, b) if b[18] == 3 && b[19] == 2 && b[20] == 7)),
        "{acts:?}"
    );
}

#[test]
fn notification_from_peer_takes_the_session_down_and_stop_stays_down() {
    let mut sim = up_pair();
    sim.feed(
        1,
        Event::Stop(Some(Notification::cease(cease::ADMINISTRATIVE_SHUTDOWN))),
    );
    sim.run_until(sim.now + S);
    assert!(matches!(
        sim.nodes[0].log.down.last(),
        Some((_, DownReason::Received(n))) if (n.code, n.subcode) == (6, 2)
    ));
    assert_eq!(sim.state(1), State::Idle);
    // Side 1 was stopped: side 0 keeps trying but never gets further than OpenSent.
    sim.run_until(sim.now + 300 * S);
    assert_eq!(sim.state(1), State::Idle);
    assert_ne!(sim.state(0), State::Established);
    sim.feed(1, Event::Start);
    sim.run_until(sim.now + 200 * S);
    assert_eq!(
        (sim.state(0), sim.state(1)),
        (State::Established, State::Established)
    );
}

#[test]
fn route_refresh_asks_for_the_routes_again() {
    let mut sim = up_pair();
    let c = sim.established_conn(0);
    let rr = wire::encode(&Message::RouteRefresh { afi: 1, safi: 1 }).unwrap();
    let acts = sim.nodes[0].peer.handle(Event::Received(c, &rr));
    assert!(acts.contains(&Action::RouteRefresh(c)), "{acts:?}");
    // Another family is ignored, not an error.
    let rr6 = wire::encode(&Message::RouteRefresh { afi: 2, safi: 1 }).unwrap();
    let acts = sim.nodes[0].peer.handle(Event::Received(c, &rr6));
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, Action::RouteRefresh(_) | Action::Close(_))),
        "{acts:?}"
    );
}

#[test]
fn hold_time_zero_means_no_keepalives_and_no_hold_timer() {
    let mut a = cfg(65001, 65002, [10, 0, 0, 1], false);
    a.hold_time = 0;
    let mut sim = Sim::new(a, cfg(65002, 65001, [10, 0, 0, 2], true));
    sim.feed(0, Event::Start);
    sim.feed(1, Event::Start);
    sim.run_until(S);
    assert_eq!(sim.nodes[1].log.established[0].2.hold_time, Duration::ZERO);
    let sent = sim.nodes[0].log.keepalives_sent;
    sim.run_until(10_000 * S);
    assert_eq!(sim.nodes[0].log.keepalives_sent, sent);
    assert_eq!(
        (sim.state(0), sim.state(1)),
        (State::Established, State::Established)
    );
}

#[test]
fn config_change_resets_only_when_the_open_changes() {
    let mut sim = up_pair();
    let first = sim.established_conn(0);
    // A new connect-retry time does not touch the session.
    let mut c = sim.nodes[0].peer.config().clone();
    c.connect_retry_time = 30;
    sim.feed(0, Event::ConfigChanged(c.clone()));
    sim.run_until(sim.now + S);
    assert_eq!(sim.established_conn(0), first);
    assert!(sim.nodes[0].log.down.is_empty());

    // A new hold time does: Cease 6/6, then a new session at once (no idle-hold wait).
    c.hold_time = 30;
    let t = sim.now;
    sim.feed(0, Event::ConfigChanged(c));
    sim.run_until(t + S / 2);
    let n = sim.nodes[0].log.sent_notifications.last().unwrap().clone();
    assert_eq!((n.code, n.subcode), (6, 6));
    assert_eq!(
        (sim.state(0), sim.state(1)),
        (State::Established, State::Established)
    );
    assert_ne!(sim.established_conn(0), first);
    assert_eq!(
        sim.nodes[0].log.established.last().unwrap().2.hold_time,
        9 * S,
        "min(30, peer's 9)"
    );
}

#[test]
fn becoming_passive_stops_connecting() {
    let mut sim = Sim::new(
        cfg(65001, 65002, [10, 0, 0, 1], false),
        cfg(65002, 65001, [10, 0, 0, 2], true),
    );
    sim.listening[1] = false;
    sim.feed(0, Event::Start);
    sim.run_until(100 * S);
    let attempts = sim.nodes[0].log.connects.len();
    assert!(attempts > 3);
    let mut c = sim.nodes[0].peer.config().clone();
    c.passive = true;
    sim.feed(0, Event::ConfigChanged(c.clone()));
    sim.run_until(1000 * S);
    assert_eq!(sim.nodes[0].log.connects.len(), attempts);
    assert_eq!(sim.state(0), State::Active);
    c.passive = false;
    sim.feed(0, Event::ConfigChanged(c));
    sim.run_until(1001 * S);
    assert_eq!(sim.nodes[0].log.connects.len(), attempts + 1);
}

fn with_families(mut c: SessionConfig, families: Families, enh: bool) -> SessionConfig {
    c.families = families;
    c.extended_next_hop = enh;
    c
}

#[test]
fn families_are_negotiated_only_when_both_sides_offer_them() {
    let v6 = Families::NONE.with(crate::family::AddressFamily::Ipv6Unicast);
    let (v4, both, none) = (Families::IPV4, Families::BOTH, Families::NONE);
    // (ours, theirs, ENH ours, ENH theirs) -> (families, ENH), the same seen from both
    // sides.
    let table = [
        (v4, v4, false, false, v4, false),
        (both, v4, true, false, v4, false),
        (v4, both, false, true, v4, false),
        (both, both, true, true, both, true),
        (v6, both, false, true, v6, false),
        (v4, v6, false, false, none, false),
    ];
    for (a, b, ea, eb, want, want_enh) in table {
        let mut sim = Sim::new(
            with_families(cfg(65001, 65002, [10, 0, 0, 1], false), a, ea),
            with_families(cfg(65002, 65001, [10, 0, 0, 2], true), b, eb),
        );
        sim.feed(0, Event::Start);
        sim.feed(1, Event::Start);
        sim.run_until(S);
        for side in 0..2 {
            let n = &sim.nodes[side].log.established[0].2;
            assert_eq!(
                (n.families, n.extended_next_hop),
                (want, want_enh),
                "{a:?}/{b:?} seen from side {side}"
            );
        }
    }
}

/// Bytes of the OPEN a peer sends first on an inbound connection.
fn first_open(c: SessionConfig) -> Open {
    let mut p = Peer::new(c);
    p.handle(Event::Start);
    let id = p.new_conn_id();
    let acts = p.handle(Event::Connected {
        conn: id,
        outbound: false,
    });
    let bytes = acts
        .iter()
        .find_map(|a| match a {
            Action::Send(_, b) => Some(b.clone()),
            _ => None,
        })
        .expect("an OPEN");
    match wire::decode(&bytes, DecodeContext::default()) {
        Ok(Message::Open(o)) => o,
        other => panic!("{other:?}"),
    }
}

#[test]
fn graceful_restart_lists_only_the_offered_families() {
    use crate::family::AddressFamily::{Ipv4Unicast, Ipv6Unicast};
    let base = cfg(65001, 65002, [10, 0, 0, 1], true);
    // IPv4 only (the cilium#30367 trap: no IPv6 restart state promised to an IPv4 router).
    let o = first_open(base.clone());
    assert_eq!(o.capabilities.multiprotocol, Families::IPV4);
    assert!(!o.capabilities.extended_next_hop);
    let gr = o.capabilities.graceful_restart.unwrap();
    assert_eq!(gr.families, vec![(Ipv4Unicast, true)]);
    // Dual stack over IPv6 transport.
    let o = first_open(with_families(base, Families::BOTH, true));
    assert_eq!(o.capabilities.multiprotocol, Families::BOTH);
    assert!(o.capabilities.extended_next_hop);
    let gr = o.capabilities.graceful_restart.unwrap();
    assert_eq!(gr.families, vec![(Ipv4Unicast, true), (Ipv6Unicast, true)]);
}

#[test]
fn a_peer_without_multiprotocol_capability_negotiates_ipv4_only() {
    let mut p = Peer::new(with_families(
        cfg(65001, 65002, [10, 0, 0, 1], true),
        Families::BOTH,
        false,
    ));
    p.handle(Event::Start);
    let id = p.new_conn_id();
    p.handle(Event::Connected {
        conn: id,
        outbound: false,
    });
    let open = Message::Open(Open {
        asn: 65002,
        hold_time: 90,
        router_id: Ipv4Addr::new(10, 0, 0, 2),
        capabilities: Capabilities {
            four_octet_as: Some(65002),
            any: true,
            ..Capabilities::default()
        },
    });
    p.handle(Event::Received(id, &wire::encode(&open).unwrap()));
    let acts = p.handle(Event::Received(id, &keepalive_bytes()));
    let neg = acts
        .iter()
        .find_map(|a| match a {
            Action::Established(_, n) => Some(n.clone()),
            _ => None,
        })
        .expect("established");
    assert_eq!(neg.families, Families::IPV4);
}

#[test]
fn offering_a_new_family_resets_the_session() {
    let mut sim = up_pair();
    let first = sim.established_conn(0);
    let c = with_families(sim.nodes[0].peer.config().clone(), Families::BOTH, false);
    let t = sim.now;
    sim.feed(0, Event::ConfigChanged(c));
    sim.run_until(t + S / 2);
    let n = sim.nodes[0].log.sent_notifications.last().unwrap().clone();
    assert_eq!((n.code, n.subcode), (6, 6));
    assert_ne!(sim.established_conn(0), first);
    // The peer (IPv4 only) still negotiates IPv4 alone.
    let n = &sim.nodes[0].log.established.last().unwrap().2;
    assert_eq!(n.families, Families::IPV4);
}

#[test]
fn ipv6_updates_from_the_peer_are_counted_and_keep_the_session() {
    let mut sim = up_pair();
    let v6 = Message::Update(Update {
        attributes: Some(wire::PathAttributes {
            origin: wire::Origin::Igp,
            as_path: vec![65002],
            next_hop: Ipv4Addr::UNSPECIFIED,
            local_pref: None,
            communities: vec![],
            large_communities: vec![],
            link_bandwidth: None,
        }),
        mp_reach: Some(wire::MpReach {
            family: crate::family::AddressFamily::Ipv6Unicast,
            next_hop: "2001:db8::2".parse().unwrap(),
            link_local: None,
            announced: vec![
                "2001:db8:1::/48".parse().unwrap(),
                "2001:db8:2::/48".parse().unwrap(),
            ],
        }),
        ..Update::default()
    });
    let before = sim.nodes[0].peer.prefixes_received;
    sim.inject(0, &wire::encode(&v6).unwrap());
    sim.inject(
        0,
        &wire::encode(&Message::Update(Update::end_of_rib_for(
            crate::family::AddressFamily::Ipv6Unicast,
        )))
        .unwrap(),
    );
    sim.run_until(sim.now + S);
    assert_eq!(sim.nodes[0].peer.prefixes_received, before + 2);
    assert_eq!(sim.state(0), State::Established);
    assert!(sim.nodes[0].log.down.is_empty());
}
