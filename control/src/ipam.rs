//! VIP allocation (IPAM).
//!
//! Address pools are lists of CIDRs (`203.0.113.0/24`), ranges
//! (`203.0.113.10-203.0.113.20`) or single addresses. In a CIDR of prefix length 30 or
//! shorter the network and broadcast addresses are not handed out (some routers and
//! hosts treat them specially), unless the pool sets `allow_network_and_broadcast`;
//! /31 and /32 prefixes and explicit ranges hand out every address they contain.
//!
//! Allocation is deterministic: an ExternalNetwork names its pools in order, and a VIP is
//! the lowest free address of the first pool that has one. An owner (a Service, as
//! `namespace/name`) holds at most one VIP; asking again returns the same one. An address
//! is recorded once across all pools, so even overlapping pools can never hand one out
//! twice. [`Ipam::rebuild`] replays existing allocations (from the API) before anything
//! new is allocated, so a restarted controller gives the same answers.

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;

/// An inclusive range of addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AddressRange {
    /// First address.
    pub first: Ipv4Addr,
    /// Last address (inclusive).
    pub last: Ipv4Addr,
}

impl AddressRange {
    /// Whether `ip` lies in the range.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        self.first <= ip && ip <= self.last
    }

    /// Number of addresses.
    pub fn len(&self) -> u64 {
        u64::from(u32::from(self.last)) - u64::from(u32::from(self.first)) + 1
    }

    /// Always false: a range holds at least one address.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl fmt::Display for AddressRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// Why a VIP could not be allocated, or a pool not understood. Each says what an
/// operator should look at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpamError {
    /// An entry of an AddressPool's `addresses` is not a CIDR, range or address.
    #[error("AddressPool {pool}: {entry:?} is not a valid IPv4 CIDR, range or address: {reason}")]
    MalformedAddresses {
        /// The pool.
        pool: String,
        /// The offending entry.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An ExternalNetwork names a pool that does not exist.
    #[error("AddressPool {0} does not exist")]
    UnknownPool(String),
    /// The ExternalNetwork names no pools.
    #[error("the ExternalNetwork lists no AddressPools")]
    NoPools,
    /// The requested IP is in none of the network's pools.
    #[error("requested IP {ip} is not inside any AddressPool of the ExternalNetwork ({pools})")]
    RequestedOutsidePools {
        /// The requested address.
        ip: Ipv4Addr,
        /// The pools searched, comma-separated.
        pools: String,
    },
    /// The requested IP is already someone else's VIP.
    #[error("requested IP {ip} is already allocated to {owner}")]
    RequestedTaken {
        /// The requested address.
        ip: Ipv4Addr,
        /// Who holds it.
        owner: String,
    },
    /// Every address of every pool is taken.
    #[error("AddressPools {pools} are exhausted: every address is allocated")]
    Exhausted {
        /// The pools searched, comma-separated.
        pools: String,
    },
}

/// A parsed AddressPool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressPool {
    /// The pool's name.
    pub name: String,
    /// The addresses it hands out, sorted, as inclusive ranges.
    pub ranges: Vec<AddressRange>,
}

fn parse_ip(pool: &str, entry: &str, s: &str) -> Result<Ipv4Addr, IpamError> {
    s.trim()
        .parse::<Ipv4Addr>()
        .map_err(|_| IpamError::MalformedAddresses {
            pool: pool.into(),
            entry: entry.into(),
            reason: format!("{:?} is not an IPv4 address", s.trim()),
        })
}

impl AddressPool {
    /// Parses a pool's `addresses` entries.
    pub fn parse(
        name: &str,
        addresses: &[String],
        allow_network_and_broadcast: bool,
    ) -> Result<Self, IpamError> {
        let bad = |entry: &str, reason: String| IpamError::MalformedAddresses {
            pool: name.into(),
            entry: entry.into(),
            reason,
        };
        let mut ranges = Vec::new();
        for entry in addresses {
            let e = entry.trim();
            if let Some((addr, len)) = e.split_once('/') {
                let ip = parse_ip(name, entry, addr)?;
                let len: u32 = len
                    .trim()
                    .parse()
                    .ok()
                    .filter(|l| *l <= 32)
                    .ok_or_else(|| bad(entry, format!("prefix length {len:?} is not 0..=32")))?;
                let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
                let base = u32::from(ip);
                if base & !mask != 0 {
                    return Err(bad(
                        entry,
                        format!(
                            "host bits are set; did you mean {}/{len}?",
                            Ipv4Addr::from(base & mask)
                        ),
                    ));
                }
                let (mut first, mut last) = (base, base | !mask);
                if len <= 30 && !allow_network_and_broadcast {
                    first += 1;
                    last -= 1;
                }
                ranges.push(AddressRange {
                    first: first.into(),
                    last: last.into(),
                });
            } else if let Some((a, b)) = e.split_once('-') {
                let (first, last) = (parse_ip(name, entry, a)?, parse_ip(name, entry, b)?);
                if first > last {
                    return Err(bad(entry, format!("{first} comes after {last}")));
                }
                ranges.push(AddressRange { first, last });
            } else {
                let ip = parse_ip(name, entry, e)?;
                ranges.push(AddressRange {
                    first: ip,
                    last: ip,
                });
            }
        }
        ranges.sort();
        Ok(AddressPool {
            name: name.into(),
            ranges,
        })
    }

    /// Whether the pool hands out `ip`.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        self.ranges.iter().any(|r| r.contains(ip))
    }

    /// How many addresses the pool hands out (overlapping entries counted once each).
    pub fn size(&self) -> u64 {
        self.ranges.iter().map(AddressRange::len).sum()
    }
}

/// A VIP held by an owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The VIP.
    pub ip: Ipv4Addr,
    /// The pool it came from; `None` for an address replayed by [`Ipam::rebuild`] that no
    /// current pool contains (kept reserved so it is never handed out twice).
    pub pool: Option<String>,
    /// Who holds it (`namespace/name`).
    pub owner: String,
}

/// An existing allocation that [`Ipam::rebuild`] could not honour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RebuildConflict {
    /// Two owners claim one address; the first listed keeps it.
    Duplicate {
        /// The address.
        ip: Ipv4Addr,
        /// The owner that keeps it.
        kept_by: String,
        /// The owner that must get another.
        dropped: String,
    },
    /// One owner claims two addresses; the first listed is kept.
    OwnerHasTwo {
        /// The owner.
        owner: String,
        /// The address kept.
        kept: Ipv4Addr,
        /// The address released.
        dropped: Ipv4Addr,
    },
}

/// The allocation state across all pools.
#[derive(Debug, Clone, Default)]
pub struct Ipam {
    pools: BTreeMap<String, AddressPool>,
    by_ip: BTreeMap<Ipv4Addr, Allocation>,
    by_owner: BTreeMap<String, Ipv4Addr>,
}

impl Ipam {
    /// An IPAM over `pools` with nothing allocated.
    pub fn new(pools: impl IntoIterator<Item = AddressPool>) -> Self {
        Ipam {
            pools: pools.into_iter().map(|p| (p.name.clone(), p)).collect(),
            ..Default::default()
        }
    }

    /// An IPAM over `pools` holding `existing` allocations `(owner, ip)` — replayed in the
    /// given order (callers pass oldest first), so on a conflict the older claim wins.
    pub fn rebuild(
        pools: impl IntoIterator<Item = AddressPool>,
        existing: impl IntoIterator<Item = (String, Ipv4Addr)>,
    ) -> (Self, Vec<RebuildConflict>) {
        let mut ipam = Ipam::new(pools);
        let mut conflicts = Vec::new();
        for (owner, ip) in existing {
            if let Some(held) = ipam.by_ip.get(&ip) {
                if held.owner != owner {
                    conflicts.push(RebuildConflict::Duplicate {
                        ip,
                        kept_by: held.owner.clone(),
                        dropped: owner,
                    });
                }
                continue;
            }
            if let Some(&kept) = ipam.by_owner.get(&owner) {
                conflicts.push(RebuildConflict::OwnerHasTwo {
                    owner,
                    kept,
                    dropped: ip,
                });
                continue;
            }
            let pool = ipam
                .pools
                .values()
                .find(|p| p.contains(ip))
                .map(|p| p.name.clone());
            ipam.insert(Allocation { ip, pool, owner });
        }
        (ipam, conflicts)
    }

    fn insert(&mut self, a: Allocation) {
        self.by_owner.insert(a.owner.clone(), a.ip);
        self.by_ip.insert(a.ip, a);
    }

    /// The pool of this name.
    pub fn pool(&self, name: &str) -> Option<&AddressPool> {
        self.pools.get(name)
    }

    /// What `owner` holds.
    pub fn allocation_of(&self, owner: &str) -> Option<&Allocation> {
        self.by_owner.get(owner).and_then(|ip| self.by_ip.get(ip))
    }

    /// Who holds `ip`.
    pub fn owner_of(&self, ip: Ipv4Addr) -> Option<&str> {
        self.by_ip.get(&ip).map(|a| a.owner.as_str())
    }

    /// Every allocation, by address.
    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.by_ip.values()
    }

    /// Allocates (or confirms) `owner`'s VIP from `pools` (in order), honouring
    /// `requested`. Idempotent: an owner that already holds a suitable VIP keeps it. An
    /// owner whose VIP no longer suits (another address requested, or no longer inside
    /// the listed pools) gets a new one and the old one is released — only once the new
    /// one is secured; on error the owner keeps what it had.
    pub fn allocate(
        &mut self,
        owner: &str,
        pools: &[&str],
        requested: Option<Ipv4Addr>,
    ) -> Result<Allocation, IpamError> {
        if pools.is_empty() {
            return Err(IpamError::NoPools);
        }
        let mut listed = Vec::with_capacity(pools.len());
        for name in pools {
            listed.push(
                self.pools
                    .get(*name)
                    .ok_or_else(|| IpamError::UnknownPool(name.to_string()))?,
            );
        }
        let names = || pools.join(", ");
        let held = self.allocation_of(owner).cloned();

        let chosen: (Ipv4Addr, String) = if let Some(ip) = requested {
            let pool = listed
                .iter()
                .find(|p| p.contains(ip))
                .ok_or_else(|| IpamError::RequestedOutsidePools { ip, pools: names() })?;
            match self.by_ip.get(&ip) {
                Some(a) if a.owner != owner => {
                    return Err(IpamError::RequestedTaken {
                        ip,
                        owner: a.owner.clone(),
                    })
                }
                _ => (ip, pool.name.clone()),
            }
        } else if let Some(pool) = held
            .as_ref()
            .and_then(|h| listed.iter().find(|p| p.contains(h.ip)))
        {
            (held.as_ref().expect("checked").ip, pool.name.clone())
        } else {
            let mut found = None;
            'pools: for pool in &listed {
                for r in &pool.ranges {
                    if let Some(ip) = self.lowest_free(r) {
                        found = Some((ip, pool.name.clone()));
                        break 'pools;
                    }
                }
            }
            found.ok_or_else(|| IpamError::Exhausted { pools: names() })?
        };

        if let Some(h) = held {
            if h.ip != chosen.0 {
                self.by_ip.remove(&h.ip);
            }
        }
        let a = Allocation {
            ip: chosen.0,
            pool: Some(chosen.1),
            owner: owner.to_string(),
        };
        self.insert(a.clone());
        Ok(a)
    }

    /// The lowest address of `r` nobody holds: one walk over the allocated addresses
    /// inside `r`, in order.
    fn lowest_free(&self, r: &AddressRange) -> Option<Ipv4Addr> {
        let last = u32::from(r.last);
        let mut cand = u32::from(r.first);
        for held in self
            .by_ip
            .range(r.first..=r.last)
            .map(|(ip, _)| u32::from(*ip))
        {
            if held != cand {
                break;
            }
            if cand == last {
                return None;
            }
            cand += 1;
        }
        Some(Ipv4Addr::from(cand))
    }

    /// Releases `owner`'s VIP, returning it.
    pub fn release(&mut self, owner: &str) -> Option<Ipv4Addr> {
        let ip = self.by_owner.remove(owner)?;
        self.by_ip.remove(&ip);
        Some(ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pool(name: &str, addrs: &[&str]) -> AddressPool {
        AddressPool::parse(
            name,
            &addrs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            false,
        )
        .unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn cidr_skips_network_and_broadcast_unless_allowed() {
        let p = pool("p", &["203.0.113.0/30"]);
        assert_eq!(p.size(), 2);
        assert!(!p.contains(ip("203.0.113.0")) && !p.contains(ip("203.0.113.3")));
        let all = AddressPool::parse("p", &["203.0.113.0/30".into()], true).unwrap();
        assert_eq!(all.size(), 4);
        assert_eq!(pool("p", &["203.0.113.0/31"]).size(), 2);
        assert_eq!(pool("p", &["203.0.113.7/32"]).size(), 1);
        assert_eq!(pool("p", &["203.0.113.0/24"]).size(), 254);
    }

    #[test]
    fn ranges_and_single_addresses() {
        let p = pool("p", &["203.0.113.10-203.0.113.12", "198.51.100.7"]);
        assert_eq!(p.size(), 4);
        assert!(p.contains(ip("203.0.113.12")) && p.contains(ip("198.51.100.7")));
    }

    #[test]
    fn malformed_entries_say_what_is_wrong() {
        for (entry, needle) in [
            ("203.0.113.0/33", "prefix length"),
            ("203.0.113.1/24", "host bits"),
            ("203.0.113.0/24x", "prefix length"),
            ("2001:db8::/64", "not an IPv4 address"),
            ("203.0.113.9-203.0.113.1", "comes after"),
            ("banana", "not an IPv4 address"),
        ] {
            let err = AddressPool::parse("public-v4", &[entry.to_string()], false).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("public-v4") && msg.contains(needle),
                "{entry}: {msg}"
            );
        }
    }

    #[test]
    fn allocates_lowest_free_from_pools_in_order() {
        let mut i = Ipam::new([
            pool("a", &["203.0.113.0/30"]),
            pool("b", &["198.51.100.0/24"]),
        ]);
        let x = i.allocate("ns/x", &["a", "b"], None).unwrap();
        assert_eq!((x.ip, x.pool.as_deref()), (ip("203.0.113.1"), Some("a")));
        assert_eq!(
            i.allocate("ns/y", &["a", "b"], None).unwrap().ip,
            ip("203.0.113.2")
        );
        let z = i.allocate("ns/z", &["a", "b"], None).unwrap();
        assert_eq!((z.ip, z.pool.as_deref()), (ip("198.51.100.1"), Some("b")));
        // Idempotent.
        assert_eq!(
            i.allocate("ns/x", &["a", "b"], None).unwrap().ip,
            ip("203.0.113.1")
        );
        // Released addresses are reused, lowest first.
        assert_eq!(i.release("ns/x"), Some(ip("203.0.113.1")));
        assert_eq!(
            i.allocate("ns/w", &["a", "b"], None).unwrap().ip,
            ip("203.0.113.1")
        );
    }

    #[test]
    fn requested_ip_is_honoured_or_refused_with_reason() {
        let mut i = Ipam::new([pool("public-v4", &["203.0.113.0/24"])]);
        let a = i
            .allocate("default/nginx", &["public-v4"], Some(ip("203.0.113.10")))
            .unwrap();
        assert_eq!(a.ip, ip("203.0.113.10"));
        assert_eq!(
            i.allocate("default/other", &["public-v4"], Some(ip("203.0.113.10"))),
            Err(IpamError::RequestedTaken {
                ip: ip("203.0.113.10"),
                owner: "default/nginx".into()
            })
        );
        assert!(matches!(
            i.allocate("default/other", &["public-v4"], Some(ip("192.0.2.1"))),
            Err(IpamError::RequestedOutsidePools { .. })
        ));
        // The network address of the CIDR is not inside the pool.
        assert!(matches!(
            i.allocate("default/other", &["public-v4"], Some(ip("203.0.113.0"))),
            Err(IpamError::RequestedOutsidePools { .. })
        ));
        // The failed requests did not allocate anything.
        assert!(i.allocation_of("default/other").is_none());
        // Changing the request moves the owner, releasing the old address.
        i.allocate("default/nginx", &["public-v4"], Some(ip("203.0.113.20")))
            .unwrap();
        assert_eq!(i.owner_of(ip("203.0.113.10")), None);
        assert_eq!(i.owner_of(ip("203.0.113.20")), Some("default/nginx"));
    }

    #[test]
    fn unknown_pool_empty_network_and_exhaustion() {
        let mut i = Ipam::new([pool("tiny", &["203.0.113.5"])]);
        assert_eq!(
            i.allocate("a/a", &["nope"], None),
            Err(IpamError::UnknownPool("nope".into()))
        );
        assert_eq!(i.allocate("a/a", &[], None), Err(IpamError::NoPools));
        i.allocate("a/a", &["tiny"], None).unwrap();
        let e = i.allocate("a/b", &["tiny"], None).unwrap_err();
        assert_eq!(
            e,
            IpamError::Exhausted {
                pools: "tiny".into()
            }
        );
        assert!(e.to_string().contains("exhausted"));
    }

    #[test]
    fn rebuild_reports_conflicts_and_keeps_the_first_claim() {
        let (i, conflicts) = Ipam::rebuild(
            [pool("p", &["203.0.113.0/24"])],
            [
                ("ns/a".to_string(), ip("203.0.113.10")),
                ("ns/b".to_string(), ip("203.0.113.10")),
                ("ns/a".to_string(), ip("203.0.113.11")),
                ("ns/c".to_string(), ip("192.0.2.9")),
            ],
        );
        assert_eq!(i.owner_of(ip("203.0.113.10")), Some("ns/a"));
        assert_eq!(conflicts.len(), 2);
        // An address outside every pool stays reserved to its owner.
        assert_eq!(i.allocation_of("ns/c").unwrap().pool, None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u8, Option<u8>),
        Release(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..40, proptest::option::of(0u8..20)).prop_map(|(o, r)| Op::Alloc(o, r)),
            (0u8..40).prop_map(Op::Release),
        ]
    }

    proptest! {
        /// Whatever happens, no address is ever held by two owners, every held address is
        /// inside a pool, and a rebuild from the allocations gives the same answers.
        #[test]
        fn never_a_duplicate_and_rebuild_is_faithful(ops in proptest::collection::vec(op(), 1..200)) {
            let pools = || [pool("a", &["203.0.113.0/29"]), pool("b", &["203.0.113.4-203.0.113.12"])];
            let mut i = Ipam::new(pools());
            for o in &ops {
                match o {
                    Op::Alloc(owner, req) => {
                        let req = req.map(|r| Ipv4Addr::new(203, 0, 113, r));
                        let _ = i.allocate(&format!("ns/{owner}"), &["a", "b"], req);
                    }
                    Op::Release(owner) => { i.release(&format!("ns/{owner}")); }
                }
                let mut seen = std::collections::BTreeSet::new();
                for a in i.allocations() {
                    prop_assert!(seen.insert(a.ip), "{} handed out twice", a.ip);
                    prop_assert!(i.pool("a").unwrap().contains(a.ip) || i.pool("b").unwrap().contains(a.ip));
                    prop_assert_eq!(i.allocation_of(&a.owner).map(|x| x.ip), Some(a.ip));
                }
            }
            let existing: Vec<_> = i.allocations().map(|a| (a.owner.clone(), a.ip)).collect();
            let (mut r, conflicts) = Ipam::rebuild(pools(), existing);
            prop_assert!(conflicts.is_empty());
            for owner in 0..45u8 {
                let o = format!("ns/{owner}");
                prop_assert_eq!(i.allocate(&o, &["a", "b"], None), r.allocate(&o, &["a", "b"], None));
            }
        }
    }
}
