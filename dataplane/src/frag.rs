//! IPv4 fragments follow their datagram's first fragment (pure, no I/O).
//!
//! Only a datagram's first fragment carries the ports that pick a flow and a backend;
//! its later fragments carry the same source, destination, protocol and IP
//! identification. The engine NATs the first fragment like a whole datagram and records
//! its decision here — the address later fragments are rewritten to, and the service
//! they count for — so every fragment of the datagram goes the same way, in both
//! directions (a client's large datagram to a VIP, a Pod's large reply).
//!
//! Later fragments that arrive before their first fragment are **held** (copied) and
//! released when it comes. Everything is bounded: at most `capacity` datagrams (a new
//! one evicts the oldest; its held fragments are dropped and counted), at most
//! [`HELD_BYTES_MAX`] bytes held per datagram and [`TOTAL_HELD_MAX`] in the table, and
//! an entry lives `timeout_ms` after its last fragment (RFC 791's reassembly timer is
//! the receiver's; a middlebox needs only as long as a datagram's fragments take to
//! arrive). A flood of first fragments with fresh identifications therefore costs one
//! bounded table, never memory beyond it.
//!
//! Cold path: fragments are rare, so this module uses a `HashMap` sized once and an
//! eviction queue rather than the flow table's fixed arrays; holding a fragment copies it.

use std::collections::{HashMap, VecDeque};

/// Most bytes of early fragments held for one datagram.
pub const HELD_BYTES_MAX: usize = 64 * 1024;
/// Most bytes of early fragments held in one table.
pub const TOTAL_HELD_MAX: usize = 4 << 20;

/// What identifies a datagram's fragments (RFC 791).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// Source address (host order).
    pub src: u32,
    /// Destination address (host order).
    pub dst: u32,
    /// IP identification.
    pub id: u16,
    /// Protocol.
    pub proto: u8,
    /// A backend's reply (arrived on a Pod interface) rather than a client's datagram
    /// (on the uplink): a decision made in one direction never rewrites the other's
    /// fragments, whatever their addresses claim.
    pub reply: bool,
}

/// The first fragment's decision: the address later fragments get and where they count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// New destination (towards a backend) or source (a reply, the VIP) address.
    pub addr: u32,
    /// Index of the service in the current table (its counters).
    pub service: u32,
}

/// What happens to a later fragment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Later {
    /// Its first fragment was decided: rewrite and send.
    Decided(Decision),
    /// Held until its first fragment comes.
    Held,
    /// Not held: the datagram's or the table's held bytes are at their limit.
    Refused,
}

#[derive(Debug)]
struct Entry {
    decision: Option<Decision>,
    expires_ms: u64,
    held: Vec<Vec<u8>>,
    held_bytes: usize,
}

/// One worker's fragment table.
#[derive(Debug)]
pub struct FragTable {
    capacity: usize,
    timeout_ms: u64,
    entries: HashMap<FragKey, Entry>,
    /// Keys in the order they were created (the oldest is evicted first); a key may
    /// appear after its entry is gone (skipped then).
    order: VecDeque<FragKey>,
    held_bytes: usize,
    /// Held fragments dropped: evicted, timed out, or replaced.
    pub dropped_held: u64,
    /// Datagrams evicted to make room.
    pub evicted: u64,
}

impl FragTable {
    /// A table of at most `capacity` datagrams, each kept `timeout_ms` after its last
    /// fragment.
    pub fn new(capacity: usize, timeout_ms: u64) -> Self {
        FragTable {
            capacity: capacity.max(1),
            timeout_ms,
            entries: HashMap::with_capacity(capacity.max(1)),
            order: VecDeque::with_capacity(capacity.max(1)),
            held_bytes: 0,
            dropped_held: 0,
            evicted: 0,
        }
    }

    /// Datagrams tracked now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No datagram tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of early fragments held now.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The first fragment of `key` was decided; returns the fragments held for it (to
    /// be rewritten and sent now).
    pub fn decided(&mut self, key: FragKey, d: Decision, now_ms: u64) -> Vec<Vec<u8>> {
        let timeout = self.timeout_ms;
        let e = self.entry(key, now_ms);
        e.decision = Some(d);
        e.expires_ms = now_ms + timeout;
        let held = std::mem::take(&mut e.held);
        let bytes = std::mem::take(&mut e.held_bytes);
        self.held_bytes -= bytes;
        held
    }

    /// A later fragment of `key`: its datagram's decision, or held (a copy of `frame`).
    pub fn later(&mut self, key: FragKey, frame: &[u8], now_ms: u64) -> Later {
        if let Some(e) = self.entries.get_mut(&key) {
            if e.expires_ms > now_ms {
                e.expires_ms = now_ms + self.timeout_ms;
                if let Some(d) = e.decision {
                    return Later::Decided(d);
                }
            }
        }
        if self.held_bytes + frame.len() > TOTAL_HELD_MAX {
            return Later::Refused;
        }
        let timeout = self.timeout_ms;
        let e = self.entry(key, now_ms);
        if e.held_bytes + frame.len() > HELD_BYTES_MAX {
            return Later::Refused;
        }
        e.expires_ms = now_ms + timeout;
        e.held.push(frame.to_vec());
        e.held_bytes += frame.len();
        self.held_bytes += frame.len();
        Later::Held
    }

    /// Forgets datagrams whose time is up (at most `budget` looked at); their held
    /// fragments are dropped and counted. Returns the fragments dropped.
    pub fn expire(&mut self, now_ms: u64, budget: usize) -> u64 {
        let before = self.dropped_held;
        for _ in 0..budget {
            let Some(&key) = self.order.front() else {
                break;
            };
            match self.entries.get(&key) {
                Some(e) if e.expires_ms > now_ms => break,
                Some(_) => {
                    self.order.pop_front();
                    self.remove(key);
                }
                None => {
                    self.order.pop_front();
                }
            }
        }
        self.dropped_held - before
    }

    /// The entry of `key`, created (evicting the oldest when full) or renewed when
    /// expired.
    fn entry(&mut self, key: FragKey, now_ms: u64) -> &mut Entry {
        if self
            .entries
            .get(&key)
            .is_some_and(|e| e.expires_ms <= now_ms)
        {
            self.remove(key);
        }
        if !self.entries.contains_key(&key) {
            while self.entries.len() >= self.capacity {
                let Some(old) = self.order.pop_front() else {
                    break;
                };
                if self.entries.contains_key(&old) {
                    self.remove(old);
                    self.evicted += 1;
                }
            }
            // The queue holds keys of removed entries until they reach its front:
            // compact it when it outgrows the table.
            if self.order.len() >= 2 * self.capacity {
                let entries = &self.entries;
                self.order.retain(|k| entries.contains_key(k));
            }
            self.order.push_back(key);
        }
        let timeout = self.timeout_ms;
        self.entries.entry(key).or_insert_with(|| Entry {
            decision: None,
            expires_ms: now_ms + timeout,
            held: Vec::new(),
            held_bytes: 0,
        })
    }

    fn remove(&mut self, key: FragKey) {
        if let Some(e) = self.entries.remove(&key) {
            self.held_bytes -= e.held_bytes;
            self.dropped_held += e.held.len() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u16) -> FragKey {
        FragKey {
            src: 0x0a00_0001,
            dst: 0x0a00_0002,
            id,
            proto: 17,
            reply: false,
        }
    }

    const D: Decision = Decision {
        addr: 0x0a64_0205,
        service: 3,
    };

    #[test]
    fn later_fragments_follow_the_first_in_order_and_out_of_order() {
        let mut t = FragTable::new(8, 1000);
        // In order.
        assert!(t.decided(key(1), D, 0).is_empty());
        assert_eq!(t.later(key(1), &[1; 100], 10), Later::Decided(D));
        // Out of order: two later fragments first, held, then released by the first.
        assert_eq!(t.later(key(2), &[2; 100], 10), Later::Held);
        assert_eq!(t.later(key(2), &[3; 50], 11), Later::Held);
        assert_eq!(t.held_bytes(), 150);
        let released = t.decided(key(2), D, 12);
        assert_eq!(released, vec![vec![2; 100], vec![3; 50]]);
        assert_eq!(t.held_bytes(), 0);
        assert_eq!(t.later(key(2), &[4; 10], 13), Later::Decided(D));
    }

    #[test]
    fn a_decision_never_crosses_directions() {
        let mut t = FragTable::new(8, 1000);
        t.decided(key(1), D, 0);
        let reply = FragKey {
            reply: true,
            ..key(1)
        };
        assert_eq!(t.later(reply, &[0; 8], 1), Later::Held);
        assert_eq!(t.later(key(1), &[0; 8], 1), Later::Decided(D));
    }

    #[test]
    fn entries_time_out_and_their_held_fragments_are_counted() {
        let mut t = FragTable::new(8, 1000);
        assert_eq!(t.later(key(5), &[0; 64], 0), Later::Held);
        t.decided(key(6), D, 0);
        assert_eq!(t.expire(500, 100), 0);
        assert_eq!(t.expire(1500, 100), 1);
        assert!(t.is_empty());
        assert_eq!(t.held_bytes(), 0);
        // A decision does not outlive its timeout either: a later fragment of an
        // expired datagram is held, not sent on a stale decision.
        t.decided(key(7), D, 2000);
        assert_eq!(t.later(key(7), &[0; 8], 3500), Later::Held);
    }

    #[test]
    fn a_flood_of_first_fragments_stays_within_the_capacity() {
        let mut t = FragTable::new(64, 5000);
        for id in 0..10_000u16 {
            t.decided(key(id), D, u64::from(id));
            assert!(t.len() <= 64);
        }
        assert_eq!(t.evicted, 10_000 - 64);
        // The newest are kept.
        assert_eq!(t.later(key(9_999), &[0; 8], 10_000), Later::Decided(D));
        assert!(t.order.len() <= 128);
    }

    #[test]
    fn held_bytes_are_bounded_per_datagram_and_per_table() {
        let mut t = FragTable::new(8192, 5000);
        let big = vec![0u8; 1500];
        let mut held = 0;
        while t.later(key(1), &big, 0) == Later::Held {
            held += 1;
        }
        assert_eq!(held, HELD_BYTES_MAX / 1500);
        let mut id = 2;
        while t.later(key(id), &big, 0) == Later::Held {
            id += 1;
        }
        assert!(t.held_bytes() <= TOTAL_HELD_MAX);
        assert!(t.held_bytes() + 1500 > TOTAL_HELD_MAX);
    }
}
