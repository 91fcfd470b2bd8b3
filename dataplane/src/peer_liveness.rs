//! Liveness of redirect peers: which peers this node still reaches, told by probes.
//!
//! A node hands new connections (the Cluster policy, a withdrawal window) and asks
//! questions (a moved connection) to its redirect peers. A peer whose Node stays Ready
//! but which this node no longer reaches (a cut link on the node network: the kubelet
//! and the agent talk over another network) would get its share of them for the whole
//! outage. So every [`PROBE_INTERVAL_MS`] the node thread sends each peer a probe
//! ([`crate::redirect_wire::KIND_PROBE`]); its dataplane answers
//! ([`crate::redirect_wire::KIND_ANSWER`]), the nonce echoed. A peer that answered once
//! and then left [`MISSED_PROBES`] probes in a row unanswered is **unreachable**: the
//! workers leave it out of hand-offs and questions
//! ([`crate::redirect::Redirector::set_unreachable`]) until it answers again. A peer that
//! never answered (a node older than probes refuses them as malformed) stays a
//! candidate: the probes never make things worse than without them.
//!
//! A state machine in virtual time (milliseconds given by the caller), no I/O: the node
//! thread sends what [`PeerLiveness::due`] returns and feeds back the answers its
//! workers received.
//!
//! Must not touch: sockets, the wire format ([`crate::redirect_wire`]), peer choice.

/// How often each peer is probed (with at most [`MAX_PROBES_PER_S`] in all).
pub const PROBE_INTERVAL_MS: u64 = 100;
/// Most probes a node sends a second: beyond 100 peers each is probed less often
/// (1 000 peers: every second, ~4 s to notice one gone).
pub const MAX_PROBES_PER_S: u64 = 1_000;
/// Probes in a row left unanswered (after one was answered) that make a peer unreachable:
/// declared when the next one is sent, ~`(MISSED_PROBES + 1) × PROBE_INTERVAL_MS` after
/// the last answer at most.
pub const MISSED_PROBES: u32 = 3;
/// Nonces of the latest probes to a peer an answer may echo (a late answer to an
/// older probe still says the peer is there).
const NONCE_WINDOW: u64 = 8;

/// What this node knows of one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// It never answered (just listed, or older than probes): a candidate.
    Unknown,
    /// It answered its latest probes.
    Reachable,
    /// It answered once, then left [`MISSED_PROBES`] in a row unanswered.
    Unreachable,
}

#[derive(Debug, Clone, Copy)]
struct Peer {
    addr: u32,
    /// The nonce of the latest probe sent (each probe to the peer the next one; the
    /// first one the process's base).
    last_nonce: u64,
    last_sent_ms: Option<u64>,
    /// Probes sent since the last answer.
    unanswered: u32,
    answered: bool,
    probes_sent: u64,
    answers: u64,
}

impl Peer {
    fn reach(&self) -> Reach {
        match (self.answered, self.unanswered > MISSED_PROBES) {
            (false, _) => Reach::Unknown,
            (true, false) => Reach::Reachable,
            (true, true) => Reach::Unreachable,
        }
    }
}

/// One peer's liveness, for the statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerReach {
    /// The peer's address on the node network.
    pub addr: u32,
    /// What this node knows of it.
    pub reach: Reach,
    /// Probes sent to it.
    pub probes_sent: u64,
    /// Answers from it accepted.
    pub answers: u64,
}

/// The probes' state for every peer.
#[derive(Debug, Clone)]
pub struct PeerLiveness {
    /// Sorted by address.
    peers: Vec<Peer>,
    /// Where every peer's nonces start: a per-process value, so that an answer to a
    /// probe of an earlier process matches nothing.
    base_nonce: u64,
}

impl PeerLiveness {
    /// No peers yet; every peer's nonces start after `base_nonce` (random per process).
    pub fn new(base_nonce: u64) -> Self {
        PeerLiveness {
            peers: Vec::new(),
            base_nonce,
        }
    }

    /// The peers to probe now: those still listed keep what is known of them, new ones
    /// start [`Reach::Unknown`], those no longer listed are forgotten.
    pub fn set_peers(&mut self, addrs: &[u32]) {
        if self.peers.len() == addrs.len()
            && self.peers.iter().zip(addrs).all(|(p, a)| p.addr == *a)
        {
            return; // the same list, as the redirector gives it (sorted): nothing to do
        }
        let mut peers: Vec<Peer> = addrs
            .iter()
            .map(|&addr| match self.find(addr) {
                Some(i) => self.peers[i],
                None => Peer {
                    addr,
                    last_nonce: self.base_nonce,
                    last_sent_ms: None,
                    unanswered: 0,
                    answered: false,
                    probes_sent: 0,
                    answers: 0,
                },
            })
            .collect();
        peers.sort_unstable_by_key(|p| p.addr);
        peers.dedup_by_key(|p| p.addr);
        self.peers = peers;
    }

    /// Whether `addr` is one of the peers probed.
    pub fn is_listed(&self, addr: u32) -> bool {
        self.find(addr).is_some()
    }

    fn find(&self, addr: u32) -> Option<usize> {
        self.peers.binary_search_by_key(&addr, |p| p.addr).ok()
    }

    /// How often each peer is probed now: [`PROBE_INTERVAL_MS`], longer with so many
    /// peers that the node would send more than [`MAX_PROBES_PER_S`].
    pub fn interval_ms(&self) -> u64 {
        let n = self.peers.len() as u64;
        PROBE_INTERVAL_MS.max((n * 1_000).div_ceil(MAX_PROBES_PER_S))
    }

    /// The probes to send at `now_ms` (peer, nonce): every peer whose last probe is at
    /// least [`Self::interval_ms`] old. Counts them as sent.
    pub fn due(&mut self, now_ms: u64) -> Vec<(u32, u64)> {
        let interval = self.interval_ms();
        let mut out = Vec::new();
        for p in &mut self.peers {
            let due = p
                .last_sent_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= interval);
            if !due {
                continue;
            }
            let nonce = p.last_nonce.wrapping_add(1);
            p.last_nonce = nonce;
            p.last_sent_ms = Some(now_ms);
            p.unanswered = p.unanswered.saturating_add(1);
            p.probes_sent += 1;
            out.push((p.addr, nonce));
        }
        out
    }

    /// An answer from `addr` echoing `nonce`: `true` when it answers one of the probes
    /// sent to that peer since its last answer (at most the latest [`NONCE_WINDOW`]; then
    /// the peer is reachable), `false` (ignored) else.
    pub fn answered(&mut self, addr: u32, nonce: u64) -> bool {
        let Some(i) = self.find(addr) else {
            return false;
        };
        let p = &mut self.peers[i];
        let behind = p.last_nonce.wrapping_sub(nonce);
        let fresh = behind < NONCE_WINDOW.min(u64::from(p.unanswered));
        if !fresh {
            return false;
        }
        p.answered = true;
        p.unanswered = 0;
        p.answers += 1;
        true
    }

    /// The peers now [`Reach::Unreachable`], sorted.
    pub fn unreachable(&self) -> Vec<u32> {
        self.peers
            .iter()
            .filter(|p| p.reach() == Reach::Unreachable)
            .map(|p| p.addr)
            .collect()
    }

    /// Every peer's liveness, by address.
    pub fn peers(&self) -> impl Iterator<Item = PeerReach> + '_ {
        self.peers.iter().map(|p| PeerReach {
            addr: p.addr,
            reach: p.reach(),
            probes_sent: p.probes_sent,
            answers: p.answers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u32 = 0x0a01_0002;
    const C: u32 = 0x0a01_0003;

    /// Runs the probes from `from` to `to` (ms, a tick every 10), answering those to the
    /// peers `answers` says are up at that moment; returns the unreachable set at `to`.
    fn run(l: &mut PeerLiveness, from: u64, to: u64, up: impl Fn(u32, u64) -> bool) -> Vec<u32> {
        let mut t = from;
        while t <= to {
            for (peer, nonce) in l.due(t) {
                if up(peer, t) {
                    assert!(l.answered(peer, nonce));
                }
            }
            t += 10;
        }
        l.unreachable()
    }

    #[test]
    fn a_peer_that_never_answered_stays_a_candidate() {
        let mut l = PeerLiveness::new(77);
        l.set_peers(&[B, C]);
        assert!(run(&mut l, 0, 5_000, |p, _| p == B).is_empty());
        let c = l.peers().find(|p| p.addr == C).unwrap();
        assert_eq!((c.reach, c.answers), (Reach::Unknown, 0));
        assert_eq!(c.probes_sent, 51, "one probe every 100 ms");
    }

    #[test]
    fn a_peer_that_stops_answering_is_unreachable_after_three_missed_probes_and_back_at_its_first_answer(
    ) {
        let mut l = PeerLiveness::new(1);
        l.set_peers(&[B, C]);
        let cut = |p: u32, t: u64| !(p == C && (1_050..2_000).contains(&t));
        assert!(run(&mut l, 0, 1_000, cut).is_empty());
        // Probes at 1 100, 1 200, 1 300 unanswered: still reachable (the latest may be
        // in flight) until the fourth is sent.
        assert!(run(&mut l, 1_010, 1_390, cut).is_empty());
        assert_eq!(run(&mut l, 1_400, 1_400, cut), vec![C]);
        assert_eq!(run(&mut l, 1_410, 1_990, cut), vec![C]);
        let c = l.peers().find(|p| p.addr == C).unwrap();
        assert_eq!(c.reach, Reach::Unreachable);
        // The link is back: the next probe's answer.
        assert!(run(&mut l, 2_000, 2_000, cut).is_empty());
        assert_eq!(
            l.peers().find(|p| p.addr == C).unwrap().reach,
            Reach::Reachable
        );
    }

    #[test]
    fn answers_to_probes_never_sent_are_ignored() {
        let mut l = PeerLiveness::new(1_000);
        l.set_peers(&[B]);
        assert!(!l.answered(B, 1_000), "no probe sent yet");
        assert!(!l.answered(B, 1_001), "no probe sent yet");
        let (_, nonce) = l.due(0)[0];
        assert!(!l.answered(C, nonce), "not a peer");
        assert!(!l.answered(B, nonce + 1), "a probe not sent yet");
        assert!(!l.answered(B, 3), "an earlier process's probe");
        assert!(l.answered(B, nonce));
        for t in 1..=MISSED_PROBES as u64 + 1 {
            l.due(t * PROBE_INTERVAL_MS);
        }
        assert_eq!(l.unreachable(), vec![B]);
        // A late answer to one of the recent probes still counts; one older than the
        // window does not.
        assert!(
            !l.answered(B, nonce),
            "answered already: older than the unanswered"
        );
        assert!(l.answered(B, nonce + 2));
        assert!(l.unreachable().is_empty());
    }

    #[test]
    fn many_peers_are_probed_less_often_within_the_node_budget() {
        let mut l = PeerLiveness::new(9);
        let peers: Vec<u32> = (1..=400).collect();
        l.set_peers(&peers[..50]);
        assert_eq!(l.interval_ms(), PROBE_INTERVAL_MS);
        l.set_peers(&peers);
        assert_eq!(l.interval_ms(), 400);
        let sent: usize = (0..10_000).step_by(10).map(|t| l.due(t).len()).sum();
        assert!(
            sent as u64 <= 10 * MAX_PROBES_PER_S,
            "{sent} probes in 10 s"
        );
        assert_eq!(sent, 400 * 25);
    }

    #[test]
    fn peers_no_longer_listed_are_forgotten_and_new_ones_start_unknown() {
        let mut l = PeerLiveness::new(5);
        l.set_peers(&[C, B, C]);
        let _ = run(&mut l, 0, 200, |_, _| true);
        assert_eq!(l.peers().count(), 2);
        let _ = run(&mut l, 210, 1_000, |p, _| p != C);
        assert_eq!(l.unreachable(), vec![C]);
        l.set_peers(&[B]);
        assert!(l.unreachable().is_empty());
        l.set_peers(&[B, C]);
        let c = l.peers().find(|p| p.addr == C).unwrap();
        assert_eq!((c.reach, c.probes_sent), (Reach::Unknown, 0));
        let b = l.peers().find(|p| p.addr == B).unwrap();
        assert_eq!(b.reach, Reach::Reachable, "B kept what was known");
    }
}
