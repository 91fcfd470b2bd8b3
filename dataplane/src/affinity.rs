//! `sessionAffinity: ClientIP`: a client's new connections to a frontend go to the
//! backend its earlier ones went to, while that backend is Ready and fewer than
//! `timeoutSeconds` have passed since the client's last new connection (kube-proxy's
//! rule). A client without a live entry gets the backend Maglev gives its address alone
//! (not its 5-tuple), so every worker and every restart agrees on it while the node's
//! Ready backends stay the same; the entry keeps it when they change.
//!
//! One table per forwarding worker and address family ([`AffinityTable4`],
//! [`AffinityTable6`]: one generic table), bounded ([`MAX_ENTRIES`] each); expired
//! entries are dropped when it is full (at most once a second), and a client that finds
//! it full of live ones is served by the hash alone. Full, a table holds 131 072 buckets
//! of 32 bytes (IPv4) or 72 (IPv6) plus one control byte each: about 4.1 or 9.1 MiB per
//! worker; it grows only as clients come. Off the per-packet path: consulted for new
//! flows of frontends with affinity only.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

use juneau_control::model::LocalBackend;

use crate::services::FastBuild;
use crate::services6::Backend6;

/// Entries per worker and address family at most.
pub const MAX_ENTRIES: usize = 65_536;
/// Least time between two reaps of a full table.
const REAP_EVERY_MS: u64 = 1_000;

/// A frontend: `(VIP, protocol, port)`.
pub type Frontend<A> = (A, u8, u16);

/// The IPv4 table: addresses host order, the hash the IPv4 service tables use.
pub type AffinityTable4 = AffinityTable<u32, LocalBackend, FastBuild>;
/// The IPv6 table: keyed with a per-process random SipHash key, as the IPv6 flow table
/// ([`crate::flow6`]) is, since an IPv6 client picks among 2^64 addresses of its own.
pub type AffinityTable6 = AffinityTable<[u8; 16], Backend6, RandomState>;

/// The affinity entries of one worker: per `(frontend, client address)` of address type
/// `A`, the backend `B` chosen and when, hashed by `S`.
#[derive(Debug)]
pub struct AffinityTable<A, B, S> {
    entries: HashMap<(Frontend<A>, A), (B, u64), S>,
    last_reap_ms: u64,
}

impl<A, B, S: Default> Default for AffinityTable<A, B, S> {
    fn default() -> Self {
        AffinityTable {
            entries: HashMap::default(),
            last_reap_ms: 0,
        }
    }
}

impl<A: Copy + Eq + Hash, B: Copy + Ord, S: BuildHasher> AffinityTable<A, B, S> {
    /// The index in `ready` (sorted) a new connection of `client` to `frontend` goes to:
    /// its entry's backend if that is still in `ready` and the entry is younger than
    /// `timeout_ms`, else `hashed` (Maglev of the client's address). The choice is
    /// (re)recorded as of `now_ms`.
    pub fn pick(
        &mut self,
        frontend: Frontend<A>,
        client: A,
        timeout_ms: u64,
        now_ms: u64,
        ready: &[B],
        hashed: Option<usize>,
    ) -> Option<usize> {
        let key = (frontend, client);
        let kept = self.entries.get(&key).and_then(|(b, last)| {
            (now_ms.saturating_sub(*last) < timeout_ms)
                .then(|| ready.binary_search(b).ok())
                .flatten()
        });
        let chosen = kept.or(hashed)?;
        if !self.entries.contains_key(&key) && self.entries.len() >= MAX_ENTRIES {
            self.reap(timeout_ms, now_ms);
            if self.entries.len() >= MAX_ENTRIES {
                return Some(chosen);
            }
        }
        self.entries.insert(key, (ready[chosen], now_ms));
        Some(chosen)
    }

    /// Drops the entries older than `timeout_ms`, at most once per [`REAP_EVERY_MS`].
    fn reap(&mut self, timeout_ms: u64, now_ms: u64) {
        if now_ms.saturating_sub(self.last_reap_ms) < REAP_EVERY_MS && self.last_reap_ms != 0 {
            return;
        }
        self.last_reap_ms = now_ms;
        self.entries
            .retain(|_, (_, last)| now_ms.saturating_sub(*last) < timeout_ms);
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const F: (u32, u8, u16) = (0xcb00_710a, 6, 80);

    fn b(last: u8) -> LocalBackend {
        LocalBackend {
            ip: Ipv4Addr::new(10, 0, 0, last),
            port: 8080,
        }
    }

    #[test]
    fn a_client_keeps_its_backend_while_it_is_ready_and_the_timeout_has_not_passed() {
        let mut t = AffinityTable4::default();
        let ready = [b(1), b(2), b(3)];
        assert_eq!(t.pick(F, 7, 10_000, 0, &ready, Some(1)), Some(1));
        // Another hash (the backends changed) does not move it; each pick renews it.
        let grown = [b(1), b(2), b(3), b(4)];
        assert_eq!(t.pick(F, 7, 10_000, 9_000, &grown, Some(3)), Some(1));
        assert_eq!(t.pick(F, 7, 10_000, 18_000, &grown, Some(3)), Some(1));
        // Its backend gone: the hash, recorded.
        let shrunk = [b(1), b(3), b(4)];
        assert_eq!(t.pick(F, 7, 10_000, 19_000, &shrunk, Some(2)), Some(2));
        assert_eq!(t.pick(F, 7, 10_000, 19_500, &shrunk, Some(0)), Some(2));
        // Timed out: the hash again.
        assert_eq!(t.pick(F, 7, 10_000, 40_000, &shrunk, Some(0)), Some(0));
        // Other clients and frontends are apart; no backend at all gives none.
        assert_eq!(t.pick(F, 8, 10_000, 40_000, &shrunk, Some(1)), Some(1));
        assert_eq!(
            t.pick((F.0, 17, 53), 7, 10_000, 40_000, &shrunk, Some(2)),
            Some(2)
        );
        assert_eq!(t.pick(F, 9, 10_000, 40_000, &[], None), None);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn a_full_table_drops_its_expired_entries_and_never_grows_past_its_bound() {
        let mut t = AffinityTable4::default();
        let ready = [b(1), b(2)];
        for c in 0..MAX_ENTRIES as u32 {
            t.pick(F, c, 1_000, 5, &ready, Some(0));
        }
        assert_eq!(t.len(), MAX_ENTRIES);
        // Full of live entries: served by the hash, not recorded.
        assert_eq!(t.pick(F, u32::MAX, 1_000, 500, &ready, Some(1)), Some(1));
        assert_eq!(t.len(), MAX_ENTRIES);
        // Once they expired, the next new client clears them.
        assert_eq!(t.pick(F, u32::MAX, 1_000, 2_000, &ready, Some(1)), Some(1));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn the_ipv6_table_keeps_clients_apart_by_their_whole_address_within_its_bound() {
        let mut t = AffinityTable6::default();
        let b6 = |last: u8| Backend6 {
            ip: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last],
            port: 8080,
        };
        let f = (
            [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            6,
            80,
        );
        let client = |n: u32| {
            let mut c = [0x20, 0x01, 0x0d, 0xb8, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            c[12..].copy_from_slice(&n.to_be_bytes());
            c
        };
        let ready = [b6(1), b6(2)];
        assert_eq!(t.pick(f, client(1), 1_000, 5, &ready, Some(0)), Some(0));
        // The same /64, another address: an entry of its own.
        assert_eq!(t.pick(f, client(2), 1_000, 5, &ready, Some(1)), Some(1));
        let grown = [b6(1), b6(2), b6(3)];
        assert_eq!(t.pick(f, client(1), 1_000, 6, &grown, Some(2)), Some(0));
        assert_eq!(t.pick(f, client(2), 1_000, 6, &grown, Some(2)), Some(1));
        for c in 3..=MAX_ENTRIES as u32 + 10 {
            t.pick(f, client(c), 1_000, 7, &ready, Some(0));
        }
        assert_eq!(t.len(), MAX_ENTRIES, "never past its bound");
    }
}
