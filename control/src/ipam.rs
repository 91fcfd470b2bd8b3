//! VIP allocation (IPAM), IPv4 and IPv6.
//!
//! Address pools are lists of CIDRs (`203.0.113.0/24`, `2001:db8:1::/64`), ranges
//! (`203.0.113.10-203.0.113.20`, `2001:db8::10-2001:db8::1f`) or single addresses, of
//! either family; one pool may hold both. In an IPv4 CIDR of prefix length 30 or shorter
//! the network and broadcast addresses are not handed out (some routers and hosts treat
//! them specially), and in an IPv6 CIDR of prefix length 126 or shorter the all-zero
//! host address is not (the Subnet-Router anycast address, RFC 4291 2.6.1; IPv6 has no
//! broadcast), unless the pool sets `allow_network_and_broadcast`; /31, /32, /127, /128
//! prefixes and explicit ranges hand out every address they contain. Nothing is ever
//! enumerated: a /64 (2^64 addresses) costs what a /30 costs, and counts are `u128`,
//! saturating (`::/0` holds 2^128 addresses, one more than `u128::MAX`).
//!
//! Allocation is deterministic and per family ([`Family`]): an ExternalNetwork names its
//! pools in order, and a VIP of a family is the lowest free address of that family in
//! the first pool that has one. An owner (a Service, as `namespace/name`) holds at most
//! one VIP per family; asking again returns the same one. An address is recorded once
//! across all pools, so even overlapping pools can never hand one out twice.
//! [`Ipam::rebuild`] replays existing allocations (from the API) before anything new is
//! allocated, so a restarted controller gives the same answers.
//!
//! [`parse_requested`] reads the `load-balancer-requested-ip` annotation: one address, or
//! one per family separated by a comma.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The Kubernetes spelling (`IPv4`, `IPv6`), as in a Service's `spec.ipFamilies`.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// The family a Kubernetes `ipFamilies` entry names, if any.
    pub fn from_k8s(s: &str) -> Option<Family> {
        match s {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        }
    }

    /// Address bits.
    pub fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    /// The address of this family with the numeric value `v` (truncated to its width).
    fn addr(self, v: u128) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(Ipv4Addr::from(v as u32)),
            Family::V6 => IpAddr::V6(Ipv6Addr::from(v)),
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The numeric value of an address (an IPv4 address in the low 32 bits).
fn num(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// An inclusive range of addresses of one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AddressRange {
    /// First address.
    pub first: IpAddr,
    /// Last address (inclusive), of the same family as `first`.
    pub last: IpAddr,
}

impl AddressRange {
    /// Whether `ip` lies in the range (an address of the other family never does).
    pub fn contains(&self, ip: IpAddr) -> bool {
        Family::of(ip) == self.family() && self.first <= ip && ip <= self.last
    }

    /// The range's family.
    pub fn family(&self) -> Family {
        Family::of(self.first)
    }

    /// Number of addresses, saturating at `u128::MAX` (only `::/0` has more).
    pub fn len(&self) -> u128 {
        (num(self.last) - num(self.first)).saturating_add(1)
    }

    /// Always false: a range holds at least one address.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The addresses in both ranges, if any.
    pub fn intersect(&self, other: &AddressRange) -> Option<AddressRange> {
        if self.family() != other.family() {
            return None;
        }
        let first = self.first.max(other.first);
        let last = self.last.min(other.last);
        (first <= last).then_some(AddressRange { first, last })
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
    #[error("AddressPool {pool}: {entry:?} is not a valid CIDR, range or address: {reason}")]
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
        ip: IpAddr,
        /// The pools searched, comma-separated.
        pools: String,
    },
    /// The requested IP is already someone else's VIP.
    #[error("requested IP {ip} is already allocated to {owner}")]
    RequestedTaken {
        /// The requested address.
        ip: IpAddr,
        /// Who holds it.
        owner: String,
    },
    /// The requested IP is not of the family being allocated.
    #[error("requested IP {ip} is not an {family} address")]
    RequestedWrongFamily {
        /// The requested address.
        ip: IpAddr,
        /// The family being allocated.
        family: Family,
    },
    /// Every address of the family in every pool is taken.
    #[error("AddressPools {pools} are exhausted: every {family} address is allocated")]
    Exhausted {
        /// The pools searched, comma-separated.
        pools: String,
        /// The family asked for.
        family: Family,
    },
    /// No listed pool holds an address of the family.
    #[error("AddressPools {pools} hold no {family} address")]
    NoPoolOfFamily {
        /// The pools searched, comma-separated.
        pools: String,
        /// The family asked for.
        family: Family,
    },
}

/// A parsed AddressPool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressPool {
    /// The pool's name.
    pub name: String,
    /// The addresses it hands out, sorted (IPv4 first), as inclusive ranges.
    pub ranges: Vec<AddressRange>,
}

fn parse_ip(pool: &str, entry: &str, s: &str) -> Result<IpAddr, IpamError> {
    s.trim()
        .parse::<IpAddr>()
        .map_err(|_| IpamError::MalformedAddresses {
            pool: pool.into(),
            entry: entry.into(),
            reason: format!("{:?} is not an IPv4 or IPv6 address", s.trim()),
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
                let family = Family::of(ip);
                let bits = family.bits();
                let len: u32 = len
                    .trim()
                    .parse()
                    .ok()
                    .filter(|l| *l <= bits)
                    .ok_or_else(|| {
                        bad(entry, format!("prefix length {len:?} is not 0..={bits}"))
                    })?;
                let net = ipnet::IpNet::new(ip, len as u8).expect("length checked above");
                if net.trunc() != net {
                    return Err(bad(
                        entry,
                        format!("host bits are set; did you mean {}?", net.trunc()),
                    ));
                }
                let (mut first, mut last) = (num(net.network()), num(net.broadcast()));
                if !allow_network_and_broadcast {
                    match family {
                        Family::V4 if len <= 30 => {
                            first += 1;
                            last -= 1;
                        }
                        Family::V6 if len <= 126 => first += 1,
                        _ => {}
                    }
                }
                ranges.push(AddressRange {
                    first: family.addr(first),
                    last: family.addr(last),
                });
            } else if let Some((a, b)) = e.split_once('-') {
                let (first, last) = (parse_ip(name, entry, a)?, parse_ip(name, entry, b)?);
                if Family::of(first) != Family::of(last) {
                    return Err(bad(
                        entry,
                        format!("{first} and {last} are of different families"),
                    ));
                }
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
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.ranges.iter().any(|r| r.contains(ip))
    }

    /// Whether the pool holds any address of `family`.
    pub fn has_family(&self, family: Family) -> bool {
        self.ranges.iter().any(|r| r.family() == family)
    }

    /// How many addresses the pool hands out (overlapping entries counted once each),
    /// saturating.
    pub fn size(&self) -> u128 {
        self.ranges
            .iter()
            .fold(0u128, |n, r| n.saturating_add(r.len()))
    }
}

/// What a `load-balancer-requested-ip` value asks for: at most one address per family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Requested {
    /// The IPv4 address asked for.
    pub v4: Option<Ipv4Addr>,
    /// The IPv6 address asked for.
    pub v6: Option<Ipv6Addr>,
}

impl Requested {
    /// The address asked for in `family`.
    pub fn of(&self, family: Family) -> Option<IpAddr> {
        match family {
            Family::V4 => self.v4.map(IpAddr::V4),
            Family::V6 => self.v6.map(IpAddr::V6),
        }
    }

    /// True when nothing is asked for.
    pub fn is_empty(&self) -> bool {
        self.v4.is_none() && self.v6.is_none()
    }
}

/// Why a requested-IP value is refused. Each names the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestedError {
    /// The value lists an empty entry (`"a,"`, `",a"`, `"a,,b"`).
    #[error("entry {index} is empty: list one address, or one IPv4 and one IPv6 address separated by a comma")]
    EmptyEntry {
        /// 1-based position of the entry.
        index: usize,
    },
    /// An entry is not an address.
    #[error("{entry:?} is not an IPv4 or IPv6 address")]
    NotAnAddress {
        /// The entry, trimmed.
        entry: String,
    },
    /// Two entries of one family.
    #[error(
        "{first} and {second} are both {family} addresses: ask for at most one address per family"
    )]
    TwoOfFamily {
        /// The family.
        family: Family,
        /// The first one.
        first: IpAddr,
        /// The second one.
        second: IpAddr,
    },
    /// More than two entries.
    #[error("{count} addresses listed: ask for at most two, one IPv4 and one IPv6")]
    TooMany {
        /// How many entries the value lists.
        count: usize,
    },
}

/// Parses a `load-balancer-requested-ip` value: one address, or one IPv4 and one IPv6
/// address in either order separated by a comma (spaces around each are ignored). Total
/// on every input: any string gives an answer or a [`RequestedError`], never a panic.
pub fn parse_requested(value: &str) -> Result<Requested, RequestedError> {
    let entries: Vec<&str> = value.split(',').map(str::trim).collect();
    if entries.len() > 2 {
        return Err(RequestedError::TooMany {
            count: entries.len(),
        });
    }
    let mut out = Requested::default();
    for (i, e) in entries.iter().enumerate() {
        if e.is_empty() {
            return Err(RequestedError::EmptyEntry { index: i + 1 });
        }
        let ip: IpAddr = e.parse().map_err(|_| RequestedError::NotAnAddress {
            entry: (*e).to_string(),
        })?;
        let family = Family::of(ip);
        if let Some(first) = out.of(family) {
            return Err(RequestedError::TwoOfFamily {
                family,
                first,
                second: ip,
            });
        }
        match ip {
            IpAddr::V4(a) => out.v4 = Some(a),
            IpAddr::V6(a) => out.v6 = Some(a),
        }
    }
    Ok(out)
}

/// A VIP held by an owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The VIP.
    pub ip: IpAddr,
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
        ip: IpAddr,
        /// The owner that keeps it.
        kept_by: String,
        /// The owner that must get another.
        dropped: String,
    },
    /// One owner claims two addresses of one family; the first listed is kept.
    OwnerHasTwo {
        /// The owner.
        owner: String,
        /// The address kept.
        kept: IpAddr,
        /// The address released.
        dropped: IpAddr,
    },
}

/// The allocation state across all pools.
#[derive(Debug, Clone, Default)]
pub struct Ipam {
    pools: BTreeMap<String, AddressPool>,
    by_ip: BTreeMap<IpAddr, Allocation>,
    by_owner: BTreeMap<(String, Family), IpAddr>,
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
        existing: impl IntoIterator<Item = (String, IpAddr)>,
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
            if let Some(&kept) = ipam.by_owner.get(&(owner.clone(), Family::of(ip))) {
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
        self.by_owner
            .insert((a.owner.clone(), Family::of(a.ip)), a.ip);
        self.by_ip.insert(a.ip, a);
    }

    /// The pool of this name.
    pub fn pool(&self, name: &str) -> Option<&AddressPool> {
        self.pools.get(name)
    }

    /// What `owner` holds in `family`.
    pub fn allocation_of(&self, owner: &str, family: Family) -> Option<&Allocation> {
        self.by_owner
            .get(&(owner.to_string(), family))
            .and_then(|ip| self.by_ip.get(ip))
    }

    /// Who holds `ip`.
    pub fn owner_of(&self, ip: IpAddr) -> Option<&str> {
        self.by_ip.get(&ip).map(|a| a.owner.as_str())
    }

    /// Every allocation, by address (IPv4 first).
    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.by_ip.values()
    }

    /// Allocates (or confirms) `owner`'s VIP of `family` from `pools` (in order),
    /// honouring `requested` (which must be of `family`). Idempotent: an owner that
    /// already holds a suitable VIP of the family keeps it. An owner whose VIP no longer
    /// suits (another address requested, or no longer inside the listed pools) gets a
    /// new one and the old one is released — only once the new one is secured; on error
    /// the owner keeps what it had. The owner's VIP of the other family is untouched.
    pub fn allocate(
        &mut self,
        owner: &str,
        pools: &[&str],
        family: Family,
        requested: Option<IpAddr>,
    ) -> Result<Allocation, IpamError> {
        if pools.is_empty() {
            return Err(IpamError::NoPools);
        }
        if let Some(ip) = requested.filter(|ip| Family::of(*ip) != family) {
            return Err(IpamError::RequestedWrongFamily { ip, family });
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
        let held = self.allocation_of(owner, family).cloned();

        let chosen: (IpAddr, String) = if let Some(ip) = requested {
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
            if !listed.iter().any(|p| p.has_family(family)) {
                return Err(IpamError::NoPoolOfFamily {
                    pools: names(),
                    family,
                });
            }
            let mut found = None;
            'pools: for pool in &listed {
                for r in pool.ranges.iter().filter(|r| r.family() == family) {
                    if let Some(ip) = self.lowest_free(r) {
                        found = Some((ip, pool.name.clone()));
                        break 'pools;
                    }
                }
            }
            found.ok_or_else(|| IpamError::Exhausted {
                pools: names(),
                family,
            })?
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
    /// inside `r`, in order (never over the free ones, so a /64 costs nothing more).
    fn lowest_free(&self, r: &AddressRange) -> Option<IpAddr> {
        let family = r.family();
        let last = num(r.last);
        let mut cand = num(r.first);
        for held in self.by_ip.range(r.first..=r.last).map(|(ip, _)| num(*ip)) {
            if held != cand {
                break;
            }
            if cand == last {
                return None;
            }
            cand += 1;
        }
        Some(family.addr(cand))
    }

    /// Releases `owner`'s VIP of `family`, returning it.
    pub fn release_family(&mut self, owner: &str, family: Family) -> Option<IpAddr> {
        let ip = self.by_owner.remove(&(owner.to_string(), family))?;
        self.by_ip.remove(&ip);
        Some(ip)
    }

    /// Releases every VIP of `owner` (IPv4 first), returning them.
    pub fn release(&mut self, owner: &str) -> Vec<IpAddr> {
        [Family::V4, Family::V6]
            .into_iter()
            .filter_map(|f| self.release_family(owner, f))
            .collect()
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

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const V4: Family = Family::V4;
    const V6: Family = Family::V6;

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
        assert_eq!(pool("p", &["0.0.0.0/0"]).size(), (1 << 32) - 2);
    }

    #[test]
    fn ipv6_cidrs_skip_only_the_subnet_router_anycast_and_never_overflow() {
        let p = pool("p", &["2001:db8::/64"]);
        assert_eq!(p.size(), u128::from(u64::MAX));
        assert!(!p.contains(ip("2001:db8::")));
        assert!(p.contains(ip("2001:db8::1")));
        assert!(p.contains(ip("2001:db8::ffff:ffff:ffff:ffff")));
        let all = AddressPool::parse("p", &["2001:db8::/64".into()], true).unwrap();
        assert_eq!(all.size(), 1u128 << 64);
        assert_eq!(pool("p", &["2001:db8::/127"]).size(), 2);
        assert_eq!(pool("p", &["2001:db8::/126"]).size(), 3);
        assert_eq!(pool("p", &["2001:db8::5/128"]).size(), 1);
        // ::/0 holds 2^128 addresses: the count saturates, it does not wrap.
        let everything = AddressPool::parse("p", &["::/0".into()], true).unwrap();
        assert_eq!(everything.size(), u128::MAX);
        let two = AddressPool::parse("p", &["::/0".into(), "::/1".into()], true).unwrap();
        assert_eq!(two.size(), u128::MAX);
    }

    #[test]
    fn ranges_and_single_addresses_of_both_families_in_one_pool() {
        let p = pool(
            "p",
            &[
                "203.0.113.10-203.0.113.12",
                "198.51.100.7",
                "2001:db8::10-2001:db8::1f",
                "2001:db8:1::5",
            ],
        );
        assert_eq!(p.size(), 4 + 17);
        assert!(p.contains(ip("203.0.113.12")) && p.contains(ip("198.51.100.7")));
        assert!(p.contains(ip("2001:db8::1f")) && p.contains(ip("2001:db8:1::5")));
        assert!(!p.contains(ip("::ffff:203.0.113.11")));
        assert!(p.has_family(V4) && p.has_family(V6));
        assert!(!pool("q", &["2001:db8::/64"]).has_family(V4));
    }

    #[test]
    fn malformed_entries_say_what_is_wrong() {
        for (entry, needle) in [
            ("203.0.113.0/33", "prefix length \"33\" is not 0..=32"),
            ("2001:db8::/129", "prefix length \"129\" is not 0..=128"),
            ("203.0.113.1/24", "did you mean 203.0.113.0/24"),
            ("2001:db8::1/64", "did you mean 2001:db8::/64"),
            ("203.0.113.0/24x", "prefix length"),
            ("2001:db8::/", "prefix length"),
            ("203.0.113.9-203.0.113.1", "comes after"),
            ("2001:db8::9-2001:db8::1", "comes after"),
            ("203.0.113.1-2001:db8::1", "different families"),
            ("banana", "not an IPv4 or IPv6 address"),
            ("2001:db8::g", "not an IPv4 or IPv6 address"),
            ("", "not an IPv4 or IPv6 address"),
        ] {
            let err = AddressPool::parse("public", &[entry.to_string()], false).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("public") && msg.contains(needle),
                "{entry}: {msg}"
            );
        }
    }

    #[test]
    fn requested_values_one_per_family() {
        let ok = |s: &str| parse_requested(s).unwrap();
        assert_eq!(ok("203.0.113.10").v4, Some("203.0.113.10".parse().unwrap()));
        assert_eq!(ok("203.0.113.10").v6, None);
        assert_eq!(ok(" 2001:db8::a ").of(V6), Some(ip("2001:db8::a")));
        for s in ["203.0.113.10,2001:db8::a", "2001:db8::a , 203.0.113.10"] {
            let r = ok(s);
            assert_eq!(r.of(V4), Some(ip("203.0.113.10")), "{s}");
            assert_eq!(r.of(V6), Some(ip("2001:db8::a")), "{s}");
        }
    }

    #[test]
    fn bad_requested_values_each_get_their_error() {
        for (s, want, needle) in [
            (
                "",
                RequestedError::EmptyEntry { index: 1 },
                "entry 1 is empty",
            ),
            (
                "203.0.113.1,",
                RequestedError::EmptyEntry { index: 2 },
                "entry 2 is empty",
            ),
            (
                "banana",
                RequestedError::NotAnAddress {
                    entry: "banana".into(),
                },
                "\"banana\" is not an IPv4 or IPv6 address",
            ),
            (
                "203.0.113.0/24",
                RequestedError::NotAnAddress {
                    entry: "203.0.113.0/24".into(),
                },
                "not an IPv4 or IPv6",
            ),
            (
                "203.0.113.1,203.0.113.2",
                RequestedError::TwoOfFamily {
                    family: V4,
                    first: ip("203.0.113.1"),
                    second: ip("203.0.113.2"),
                },
                "both IPv4 addresses",
            ),
            (
                "2001:db8::1,2001:db8::2",
                RequestedError::TwoOfFamily {
                    family: V6,
                    first: ip("2001:db8::1"),
                    second: ip("2001:db8::2"),
                },
                "both IPv6 addresses",
            ),
            (
                "203.0.113.1,2001:db8::1,203.0.113.2",
                RequestedError::TooMany { count: 3 },
                "3 addresses listed",
            ),
        ] {
            let got = parse_requested(s).unwrap_err();
            assert_eq!(got, want, "{s:?}");
            assert!(got.to_string().contains(needle), "{s:?}: {got}");
        }
    }

    #[test]
    fn allocates_lowest_free_from_pools_in_order() {
        let mut i = Ipam::new([
            pool("a", &["203.0.113.0/30"]),
            pool("b", &["198.51.100.0/24"]),
        ]);
        let x = i.allocate("ns/x", &["a", "b"], V4, None).unwrap();
        assert_eq!((x.ip, x.pool.as_deref()), (ip("203.0.113.1"), Some("a")));
        assert_eq!(
            i.allocate("ns/y", &["a", "b"], V4, None).unwrap().ip,
            ip("203.0.113.2")
        );
        let z = i.allocate("ns/z", &["a", "b"], V4, None).unwrap();
        assert_eq!((z.ip, z.pool.as_deref()), (ip("198.51.100.1"), Some("b")));
        // Idempotent.
        assert_eq!(
            i.allocate("ns/x", &["a", "b"], V4, None).unwrap().ip,
            ip("203.0.113.1")
        );
        // Released addresses are reused, lowest first.
        assert_eq!(i.release("ns/x"), vec![ip("203.0.113.1")]);
        assert_eq!(
            i.allocate("ns/w", &["a", "b"], V4, None).unwrap().ip,
            ip("203.0.113.1")
        );
    }

    #[test]
    fn one_vip_per_family_from_a_dual_stack_pool() {
        let mut i = Ipam::new([
            pool("dual", &["203.0.113.0/30", "2001:db8::/64"]),
            pool("v6", &["2001:db8:1::/64"]),
        ]);
        let pools = ["dual", "v6"];
        let a4 = i.allocate("ns/a", &pools, V4, None).unwrap();
        let a6 = i.allocate("ns/a", &pools, V6, None).unwrap();
        assert_eq!(a4.ip, ip("203.0.113.1"));
        assert_eq!(
            (a6.ip, a6.pool.as_deref()),
            (ip("2001:db8::1"), Some("dual"))
        );
        assert_eq!(i.allocation_of("ns/a", V4).unwrap().ip, a4.ip);
        assert_eq!(i.allocation_of("ns/a", V6).unwrap().ip, a6.ip);
        // Idempotent per family; the other family untouched.
        assert_eq!(i.allocate("ns/a", &pools, V6, None).unwrap(), a6);
        assert_eq!(
            i.allocate("ns/b", &pools, V6, None).unwrap().ip,
            ip("2001:db8::2")
        );
        // A requested IPv6 address moves only the IPv6 VIP.
        let moved = i
            .allocate("ns/a", &pools, V6, Some(ip("2001:db8:1::99")))
            .unwrap();
        assert_eq!(moved.pool.as_deref(), Some("v6"));
        assert_eq!(i.owner_of(ip("2001:db8::1")), None);
        assert_eq!(i.allocation_of("ns/a", V4).unwrap().ip, a4.ip);
        // A freed IPv6 address is reused, lowest first.
        assert_eq!(
            i.allocate("ns/c", &pools, V6, None).unwrap().ip,
            ip("2001:db8::1")
        );
        // Release drops both families.
        assert_eq!(
            i.release("ns/a"),
            vec![ip("203.0.113.1"), ip("2001:db8:1::99")]
        );
        assert!(i.allocation_of("ns/a", V4).is_none());
    }

    #[test]
    fn family_errors_are_named() {
        let mut i = Ipam::new([
            pool("v4", &["203.0.113.0/30"]),
            pool("v6", &["2001:db8::/127"]),
        ]);
        assert_eq!(
            i.allocate("ns/a", &["v4"], V6, None),
            Err(IpamError::NoPoolOfFamily {
                pools: "v4".into(),
                family: V6
            })
        );
        assert_eq!(
            i.allocate("ns/a", &["v4", "v6"], V4, Some(ip("2001:db8::1"))),
            Err(IpamError::RequestedWrongFamily {
                ip: ip("2001:db8::1"),
                family: V4
            })
        );
        i.allocate("ns/a", &["v6"], V6, None).unwrap();
        i.allocate("ns/b", &["v6"], V6, None).unwrap();
        let e = i.allocate("ns/c", &["v6"], V6, None).unwrap_err();
        assert_eq!(
            e,
            IpamError::Exhausted {
                pools: "v6".into(),
                family: V6
            }
        );
        assert!(e.to_string().contains("every IPv6 address"), "{e}");
        // The IPv4 side of the same network is not exhausted.
        assert!(i.allocate("ns/c", &["v4", "v6"], V4, None).is_ok());
    }

    #[test]
    fn a_slash_64_is_not_enumerated() {
        // The last addresses of a /64 and the lowest free one after a run of held ones:
        // the walk is over held addresses only.
        let mut i = Ipam::new([pool("p", &["2001:db8::/64"])]);
        let last = ip("2001:db8::ffff:ffff:ffff:ffff");
        i.allocate("ns/last", &["p"], V6, Some(last)).unwrap();
        for n in 0..100u32 {
            let a = i.allocate(&format!("ns/{n}"), &["p"], V6, None).unwrap();
            assert_eq!(
                a.ip,
                IpAddr::V6(Ipv6Addr::from(0x2001_0db8u128 << 96 | (u128::from(n) + 1)))
            );
        }
        assert_eq!(i.owner_of(last), Some("ns/last"));
    }

    #[test]
    fn requested_ip_is_honoured_or_refused_with_reason() {
        let mut i = Ipam::new([pool("public-v4", &["203.0.113.0/24"])]);
        let a = i
            .allocate(
                "default/nginx",
                &["public-v4"],
                V4,
                Some(ip("203.0.113.10")),
            )
            .unwrap();
        assert_eq!(a.ip, ip("203.0.113.10"));
        assert_eq!(
            i.allocate(
                "default/other",
                &["public-v4"],
                V4,
                Some(ip("203.0.113.10"))
            ),
            Err(IpamError::RequestedTaken {
                ip: ip("203.0.113.10"),
                owner: "default/nginx".into()
            })
        );
        assert!(matches!(
            i.allocate("default/other", &["public-v4"], V4, Some(ip("192.0.2.1"))),
            Err(IpamError::RequestedOutsidePools { .. })
        ));
        // The network address of the CIDR is not inside the pool.
        assert!(matches!(
            i.allocate("default/other", &["public-v4"], V4, Some(ip("203.0.113.0"))),
            Err(IpamError::RequestedOutsidePools { .. })
        ));
        // The failed requests did not allocate anything.
        assert!(i.allocation_of("default/other", V4).is_none());
        // Changing the request moves the owner, releasing the old address.
        i.allocate(
            "default/nginx",
            &["public-v4"],
            V4,
            Some(ip("203.0.113.20")),
        )
        .unwrap();
        assert_eq!(i.owner_of(ip("203.0.113.10")), None);
        assert_eq!(i.owner_of(ip("203.0.113.20")), Some("default/nginx"));
    }

    #[test]
    fn unknown_pool_empty_network_and_exhaustion() {
        let mut i = Ipam::new([pool("tiny", &["203.0.113.5"])]);
        assert_eq!(
            i.allocate("a/a", &["nope"], V4, None),
            Err(IpamError::UnknownPool("nope".into()))
        );
        assert_eq!(i.allocate("a/a", &[], V4, None), Err(IpamError::NoPools));
        i.allocate("a/a", &["tiny"], V4, None).unwrap();
        let e = i.allocate("a/b", &["tiny"], V4, None).unwrap_err();
        assert_eq!(
            e,
            IpamError::Exhausted {
                pools: "tiny".into(),
                family: V4
            }
        );
        assert!(e.to_string().contains("exhausted"));
    }

    #[test]
    fn rebuild_reports_conflicts_and_keeps_the_first_claim() {
        let (i, conflicts) = Ipam::rebuild(
            [pool("p", &["203.0.113.0/24", "2001:db8::/64"])],
            [
                ("ns/a".to_string(), ip("203.0.113.10")),
                ("ns/b".to_string(), ip("203.0.113.10")),
                ("ns/a".to_string(), ip("203.0.113.11")),
                ("ns/a".to_string(), ip("2001:db8::10")),
                ("ns/a".to_string(), ip("2001:db8::11")),
                ("ns/c".to_string(), ip("192.0.2.9")),
            ],
        );
        assert_eq!(i.owner_of(ip("203.0.113.10")), Some("ns/a"));
        // One VIP per family is not a conflict; two of one family are.
        assert_eq!(i.allocation_of("ns/a", V6).unwrap().ip, ip("2001:db8::10"));
        assert_eq!(conflicts.len(), 3);
        // An address outside every pool stays reserved to its owner.
        assert_eq!(i.allocation_of("ns/c", V4).unwrap().pool, None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u8, bool, Option<u8>),
        Release(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..40, any::<bool>(), proptest::option::of(0u8..20))
                .prop_map(|(o, v6, r)| Op::Alloc(o, v6, r)),
            (0u8..40).prop_map(Op::Release),
        ]
    }

    fn pools() -> [AddressPool; 2] {
        [
            pool("a", &["203.0.113.0/29", "2001:db8::/125"]),
            pool(
                "b",
                &["203.0.113.4-203.0.113.12", "2001:db8::4-2001:db8::c"],
            ),
        ]
    }

    proptest! {
        /// Whatever happens, no address is ever held by two owners, an owner holds at
        /// most one VIP per family, every held address is inside a pool, and a rebuild
        /// from the allocations gives the same answers.
        #[test]
        fn never_a_duplicate_and_rebuild_is_faithful(ops in proptest::collection::vec(op(), 1..200)) {
            let mut i = Ipam::new(pools());
            for o in &ops {
                match o {
                    Op::Alloc(owner, v6, req) => {
                        let family = if *v6 { V6 } else { V4 };
                        let req = req.map(|r| match family {
                            V4 => IpAddr::V4(Ipv4Addr::new(203, 0, 113, r)),
                            V6 => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(r))),
                        });
                        let _ = i.allocate(&format!("ns/{owner}"), &["a", "b"], family, req);
                    }
                    Op::Release(owner) => { i.release(&format!("ns/{owner}")); }
                }
                let mut seen = std::collections::BTreeSet::new();
                for a in i.allocations() {
                    prop_assert!(seen.insert(a.ip), "{} handed out twice", a.ip);
                    prop_assert!(i.pool("a").unwrap().contains(a.ip) || i.pool("b").unwrap().contains(a.ip));
                    prop_assert_eq!(i.allocation_of(&a.owner, Family::of(a.ip)).map(|x| x.ip), Some(a.ip));
                }
            }
            let existing: Vec<_> = i.allocations().map(|a| (a.owner.clone(), a.ip)).collect();
            let (mut r, conflicts) = Ipam::rebuild(pools(), existing);
            prop_assert!(conflicts.is_empty());
            for owner in 0..45u8 {
                let o = format!("ns/{owner}");
                for f in [V4, V6] {
                    prop_assert_eq!(i.allocate(&o, &["a", "b"], f, None), r.allocate(&o, &["a", "b"], f, None));
                }
            }
        }

        /// Any string: an answer or an error, never a panic; an answer re-parses from
        /// its own rendering.
        #[test]
        fn parse_requested_is_total(s in ".{0,60}") {
            if let Ok(r) = parse_requested(&s) {
                let text: Vec<String> = [r.of(V4), r.of(V6)].into_iter().flatten().map(|i| i.to_string()).collect();
                if !text.is_empty() {
                    prop_assert_eq!(parse_requested(&text.join(",")), Ok(r));
                }
            }
        }

        /// Requested values built from real addresses parse back to them.
        #[test]
        fn parse_requested_round_trips(v4 in proptest::option::of(any::<u32>()), v6 in proptest::option::of(any::<u128>()), v6_first in any::<bool>()) {
            let v4 = v4.map(Ipv4Addr::from);
            let v6 = v6.map(Ipv6Addr::from);
            let mut parts: Vec<String> = Vec::new();
            if let Some(a) = v4 { parts.push(a.to_string()); }
            if let Some(a) = v6 { if v6_first { parts.insert(0, a.to_string()) } else { parts.push(a.to_string()) } }
            prop_assume!(!parts.is_empty());
            prop_assert_eq!(parse_requested(&parts.join(", ")), Ok(Requested { v4, v6 }));
        }

        /// Any CIDR of either family: parses, counts without overflow, contains its
        /// first and last handed-out addresses and nothing just outside.
        #[test]
        fn any_cidr_is_counted_without_overflow(v6 in any::<bool>(), raw in any::<u128>(), len in 0u32..=128, allow in any::<bool>()) {
            let family = if v6 { V6 } else { V4 };
            let len = len % (family.bits() + 1);
            let host = if len == family.bits() { 0 } else { (if v6 { u128::MAX } else { u128::from(u32::MAX) }) >> len };
            let base = (if v6 { raw } else { raw & u128::from(u32::MAX) }) & !host;
            let entry = format!("{}/{len}", family.addr(base));
            let p = AddressPool::parse("p", std::slice::from_ref(&entry), allow).unwrap();
            let r = p.ranges[0];
            prop_assert!(r.first <= r.last && r.family() == family);
            prop_assert!(p.contains(r.first) && p.contains(r.last));
            if num(r.first) > 0 { prop_assert!(!p.contains(family.addr(num(r.first) - 1))); }
            if len > 0 && host < u128::MAX { prop_assert_eq!(p.size(), host + 1 - u128::from(num(r.first) != base) - u128::from(num(r.last) != (base | host))); }
        }
    }
}
