//! The new-flow admission per source prefix: packets of no flow (a new connection's
//! first packet, a flood's) to an exposed VIP:port are admitted at most `rate` per second
//! per source /24 (IPv6: /64), `burst` at once.
//!
//! Userspace owns the buckets and debits them: a forwarding worker that sees a packet of
//! no flow asks [`Admission::admit`]. The steering program only reads them: while a
//! prefix's next admission is not due, it drops that prefix's packets of no flow before
//! they cost the AF_XDP ring, and looks a packet's flow up only then — so a prefix with
//! tokens left costs the program no flow look-up (at a million flows, a cache and TLB
//! miss per packet that userspace, which hashes a whole batch, overlaps).
//!
//! Each bucket is one `u64` in `admit_open` (a `BPF_F_MMAPABLE` array the program reads):
//! its theoretical arrival time in CLOCK_MONOTONIC ns (the generic cell-rate algorithm:
//! advanced by one period per packet admitted, from now at the earliest); a packet is
//! admitted while now + the burst's tolerance reaches it. Prefixes hash into
//! [`ADMIT_SLOTS`] slots with a random seed: two prefixes in one slot share its bucket
//! (docs/security.md, "New-flow admission").

use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::abi::ADMIT_SLOTS;
use crate::region::Region;

/// Rate and burst per source prefix (the command line's `--new-flow-prefix-rate` and
/// `--new-flow-prefix-burst`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    /// Admitted per second per prefix (0: no limit).
    pub rate: u64,
    /// Admitted at once at most.
    pub burst: u64,
}

/// The buckets of every source prefix, shared by the forwarding workers (and read by
/// the steering program when `slots` is its map).
pub struct Admission {
    slots: Region<u64>,
    seed: u64,
    /// ns between two admissions at the rate; 0: no limit.
    period_ns: u64,
    /// How far ahead of now a bucket may run: (burst - 1) periods.
    tolerance_ns: u64,
}

// SAFETY: the slots are only ever accessed through atomic operations (`cell`), by any
// number of threads (and by the steering program, which reads them with 8-byte loads);
// the region itself is never moved or resized while an `Admission` exists.
unsafe impl Sync for Admission {}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("slots", &self.slots)
            .field("period_ns", &self.period_ns)
            .field("tolerance_ns", &self.tolerance_ns)
            .finish()
    }
}

impl Admission {
    /// Buckets in `slots` ([`ADMIT_SLOTS`] of them) under `limit`, prefixes hashed with
    /// `seed` (the value the steering program's `admit_conf` holds).
    pub fn new(slots: Region<u64>, seed: u64, limit: Limit) -> Self {
        assert_eq!(slots.len(), ADMIT_SLOTS, "admission slots");
        // No rate: period 0, which `admit` reads as "no limit".
        let period_ns = 1_000_000_000u64
            .checked_div(limit.rate)
            .map_or(0, |p| p.max(1));
        let tolerance_ns = period_ns.saturating_mul(limit.burst.max(1) - 1);
        Admission {
            slots,
            seed,
            period_ns,
            tolerance_ns,
        }
    }

    /// Buckets on the heap (tests, benches).
    pub fn on_heap(seed: u64, limit: Limit) -> Self {
        Self::new(Region::heap(ADMIT_SLOTS, 0), seed, limit)
    }

    /// Whether a packet of no flow from the prefix `key` is admitted at `now_ns`
    /// (CLOCK_MONOTONIC); if so, its bucket is debited.
    pub fn admit(&self, key: u32, now_ns: u64) -> bool {
        if self.period_ns == 0 {
            return true;
        }
        let cell = self.cell(slot(key, self.seed));
        let mut tat = cell.load(Ordering::Relaxed);
        loop {
            if now_ns.saturating_add(self.tolerance_ns) < tat {
                return false;
            }
            let next = tat.max(now_ns) + self.period_ns;
            match cell.compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(seen) => tat = seen,
            }
        }
    }

    /// When the prefix `key`'s next packet of no flow is admitted (ns; 0: any time).
    pub fn open_at(&self, key: u32) -> u64 {
        let tat = self.cell(slot(key, self.seed)).load(Ordering::Relaxed);
        tat.saturating_sub(self.tolerance_ns)
    }

    /// How far ahead of now a bucket may run (ns, the burst less one period), which
    /// the steering program needs to tell when a prefix's next packet is due.
    pub fn tolerance_ns(&self) -> u64 {
        self.tolerance_ns
    }

    fn cell(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.slots.len());
        // SAFETY: `i` is in bounds (checked above) of the region's `len` aligned u64s,
        // alive as long as `self`; every access to them goes through atomics like this
        // one (here and in the steering program), so no plain reference aliases a write.
        unsafe { AtomicU64::from_ptr(self.slots.as_ptr().add(i).cast_mut()) }
    }
}

/// The admission key of an IPv4 source (host order): its /24, as the steering program
/// computes it from the packet (`admit_key`: network order in memory).
pub fn key_v4(src: u32) -> u32 {
    u32::from_ne_bytes((src & 0xffff_ff00).to_be_bytes())
}

/// The admission key of an IPv6 source: a hash of its /64 whose last byte is never 0, so
/// that it never equals an IPv4 /24's key (`admit_key6`).
pub fn key_v6(src: &[u8; 16]) -> u32 {
    let hi = u64::from_ne_bytes(src[..8].try_into().expect("8 bytes"));
    let h = hi.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 32) as u32 | u32::from_ne_bytes(1u32.to_be_bytes())
}

/// The slot of a prefix key (`admit_slot` in bpf/steer.c).
pub fn slot(key: u32, seed: u64) -> usize {
    let mut h = (key ^ seed as u32).wrapping_mul(0x9e37_79b1);
    h ^= h >> 16;
    h = h.wrapping_mul((seed >> 32) as u32 | 1);
    ((h >> 16) as usize) & (ADMIT_SLOTS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const S: u64 = 1_000_000_000;

    fn v4(a: [u8; 4]) -> u32 {
        key_v4(u32::from(Ipv4Addr::from(a)))
    }

    #[test]
    fn a_prefix_gets_its_burst_at_once_then_the_rate() {
        let a = Admission::on_heap(7, Limit { rate: 10, burst: 3 });
        let k = v4([203, 0, 113, 9]);
        let t = 100 * S;
        assert!((0..3).all(|_| a.admit(k, t)), "the burst");
        assert!(!a.admit(k, t), "then nothing");
        assert!(a.open_at(k) > t);
        // One token per 100 ms.
        assert!(!a.admit(k, t + S / 10 - 1));
        assert!(a.admit(k, t + S / 10));
        assert!(!a.admit(k, t + S / 10));
        // A refused packet takes nothing: after a long pause the burst is back, no more.
        let later = t + 60 * S;
        assert_eq!((0..10).filter(|_| a.admit(k, later)).count(), 3);
    }

    #[test]
    fn a_burst_of_one_is_the_rate_alone() {
        let a = Admission::on_heap(7, Limit { rate: 1, burst: 1 });
        let k = v4([198, 51, 100, 1]);
        assert!(a.admit(k, 5 * S));
        assert!(!a.admit(k, 5 * S + S - 1));
        assert!(a.admit(k, 6 * S));
    }

    #[test]
    fn no_rate_admits_everything_and_writes_nothing() {
        let a = Admission::on_heap(7, Limit { rate: 0, burst: 5 });
        let k = v4([198, 51, 100, 1]);
        assert!((0..1000).all(|_| a.admit(k, S)));
        assert_eq!(a.open_at(k), 0);
    }

    #[test]
    fn addresses_of_one_slash_24_share_a_bucket_and_other_prefixes_do_not() {
        let a = Admission::on_heap(0x1234_5678_9abc_def0, Limit { rate: 1, burst: 1 });
        assert_eq!(v4([203, 0, 113, 9]), v4([203, 0, 113, 200]));
        assert!(a.admit(v4([203, 0, 113, 9]), S));
        assert!(!a.admit(v4([203, 0, 113, 200]), S));
        // (Other prefixes may share a slot: not these, with this seed.)
        assert!(a.admit(v4([203, 0, 114, 9]), S));
        assert!(a.admit(v4([10, 0, 113, 9]), S));
    }

    #[test]
    fn ipv6_keys_group_a_slash_64_and_never_equal_an_ipv4_key() {
        let p = |s: &str| key_v6(&s.parse::<std::net::Ipv6Addr>().unwrap().octets());
        assert_eq!(p("2001:db8:1:0:a:b:c:d"), p("2001:db8:1:0::7"));
        assert_ne!(p("2001:db8:1:0::7"), p("2001:db8:1:1::7"));
        // An IPv4 key's last byte (in memory) is 0, an IPv6 key's never.
        for s in ["2001:db8::1", "::", "fe80::1", "2001:db8:ffff:ffff::"] {
            assert_ne!(p(s).to_ne_bytes()[3], 0, "{s}");
        }
        assert_eq!(v4([1, 2, 3, 4]).to_ne_bytes(), [1, 2, 3, 0]);
    }

    #[test]
    fn slots_spread_prefixes_and_follow_the_seed() {
        let keys: Vec<u32> = (0..4096u32).map(|i| key_v4(0x0a00_0000 | i << 8)).collect();
        let distinct = |seed| {
            let mut s: Vec<usize> = keys.iter().map(|&k| slot(k, seed)).collect();
            s.sort_unstable();
            s.dedup();
            s.len()
        };
        // 4 096 prefixes in 65 536 slots: ~3.1 % collide by chance.
        assert!(distinct(1) > 3900, "{}", distinct(1));
        assert!(distinct(0xdead_beef_0000_0001) > 3900);
        assert_ne!(slot(keys[0], 1), slot(keys[0], 0xdead_beef_0000_0001));
    }

    #[test]
    fn workers_admitting_at_once_never_exceed_the_burst() {
        let a = std::sync::Arc::new(Admission::on_heap(
            3,
            Limit {
                rate: 1,
                burst: 500,
            },
        ));
        let k = v4([192, 0, 2, 1]);
        let admitted: usize = (0..4)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || (0..1000).filter(|_| a.admit(k, 10 * S)).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(admitted, 500);
    }
}
