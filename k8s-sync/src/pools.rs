//! What the controller reports on each AddressPool, as a pure function of the pools and
//! the VIP book: how many addresses it hands out, how many are held, and whether its
//! addresses overlap another pool's (accepted, but flagged by a condition and an Event:
//! the VIP book never hands one address out twice, yet an operator who wrote two pools
//! over one range almost certainly meant something else).

use std::collections::BTreeMap;
use std::net::IpAddr;

use juneau_control::ipam::AddressRange;

use crate::crd::AddressPoolSpec;
use crate::vips::{parse_pool, VipBook};

/// Condition type on AddressPools: True when the pool shares addresses with another.
pub const OVERLAPPING: &str = "Overlapping";
/// Event reason raised when a pool starts overlapping another.
pub const OVERLAP_REASON: &str = "AddressPoolOverlap";

/// The largest count reported: the apiserver keeps integers as int64, and an IPv6 /64
/// alone holds 2^64 addresses. A pool holding more reports this many.
pub const COUNT_CAP: u64 = i64::MAX as u64;

/// `n` as a reported count: at most [`COUNT_CAP`].
pub fn capped(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX).min(COUNT_CAP)
}

/// The report for one pool.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolReport {
    /// Addresses handed out, both families (0 when the addresses do not parse), at most
    /// [`COUNT_CAP`].
    pub total: u64,
    /// Addresses held by a Service.
    pub allocated: u64,
    /// Other pools sharing addresses, with the shared range (`pool`, `a.b.c.d-a.b.c.e`).
    pub overlaps: Vec<(String, String)>,
    /// Why the addresses do not parse, if they do not.
    pub invalid: Option<String>,
}

impl PoolReport {
    /// The condition message for [`OVERLAPPING`].
    pub fn overlap_message(&self, name: &str) -> String {
        if self.overlaps.is_empty() {
            return format!("AddressPool {name} shares no address with another AddressPool");
        }
        let list: Vec<String> = self
            .overlaps
            .iter()
            .map(|(p, r)| format!("{r} with AddressPool {p}"))
            .collect();
        format!(
            "AddressPool {name} shares addresses {}; each address is still handed out at most once, but usage and announcements of the shared range count for both pools",
            list.join(", ")
        )
    }
}

/// Reports every pool of `pools` against the VIPs of `book`.
pub fn report(
    pools: &BTreeMap<String, AddressPoolSpec>,
    book: &VipBook,
) -> BTreeMap<String, PoolReport> {
    let parsed: BTreeMap<&String, Result<Vec<AddressRange>, String>> = pools
        .iter()
        .map(|(n, s)| {
            (
                n,
                parse_pool(n, s)
                    .map(|p| p.ranges)
                    .map_err(|e| e.to_string()),
            )
        })
        .collect();
    let vips: Vec<IpAddr> = book.vips().collect();
    let mut out = BTreeMap::new();
    for (name, ranges) in &parsed {
        let mut r = PoolReport::default();
        match ranges {
            Err(e) => r.invalid = Some(e.clone()),
            Ok(ranges) => {
                r.total = capped(ranges.iter().fold(0u128, |n, x| n.saturating_add(x.len())));
                r.allocated = vips
                    .iter()
                    .filter(|v| ranges.iter().any(|x| x.contains(**v)))
                    .count() as u64;
                for (other, oranges) in &parsed {
                    if other == name {
                        continue;
                    }
                    let Ok(oranges) = oranges else { continue };
                    for a in ranges {
                        for b in oranges {
                            if let Some(x) = a.intersect(b) {
                                r.overlaps.push(((*other).clone(), x.to_string()));
                            }
                        }
                    }
                }
            }
        }
        out.insert((*name).clone(), r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AdvertiseMode;

    fn spec(a: &[&str]) -> AddressPoolSpec {
        AddressPoolSpec {
            advertise_mode: AdvertiseMode::bgp(),
            addresses: a.iter().map(|s| s.to_string()).collect(),
            allow_network_and_broadcast: None,
            auto_assign: None,
            service_allocation: None,
        }
    }

    #[test]
    fn overlapping_pools_are_named_with_the_shared_range() {
        let mut pools = BTreeMap::new();
        pools.insert("small".to_string(), spec(&["198.18.0.0/30"]));
        pools.insert("big".to_string(), spec(&["198.18.0.0/29"]));
        pools.insert("apart".to_string(), spec(&["198.18.1.0/30"]));
        pools.insert("bad".to_string(), spec(&["198.18.2.0/99"]));
        pools.insert(
            "dual".to_string(),
            spec(&["198.18.3.0/30", "2001:db8::/64", "2001:db8:1::/48"]),
        );
        pools.insert("dual-too".to_string(), spec(&["2001:db8::10-2001:db8::1f"]));
        let mut book = VipBook::default();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(book.restore(ip("198.18.0.1"), "default/a"));
        assert!(book.restore(ip("198.18.0.5"), "default/b"));
        assert!(book.restore(ip("2001:db8::12"), "default/b"));
        let r = report(&pools, &book);
        assert_eq!(r["small"].total, 2);
        assert_eq!(r["big"].total, 6);
        assert_eq!(r["small"].allocated, 1);
        assert_eq!(r["big"].allocated, 2);
        assert_eq!(
            r["small"].overlaps,
            vec![("big".to_string(), "198.18.0.1-198.18.0.2".to_string())]
        );
        assert_eq!(
            r["big"].overlaps,
            vec![("small".to_string(), "198.18.0.1-198.18.0.2".to_string())]
        );
        assert!(r["apart"].overlaps.is_empty());
        assert_eq!(r["apart"].allocated, 0);
        assert!(r["bad"]
            .invalid
            .as_deref()
            .unwrap()
            .contains("198.18.2.0/99"));
        // 2 + (2^64 - 1) + (2^80 - 1) addresses: capped, not wrapped.
        assert_eq!(r["dual"].total, COUNT_CAP);
        assert_eq!(r["dual"].allocated, 1);
        assert_eq!(r["dual-too"].total, 16);
        assert_eq!(
            r["dual-too"].overlaps,
            vec![("dual".to_string(), "2001:db8::10-2001:db8::1f".to_string())]
        );
        assert_eq!(capped(5), 5);
        assert_eq!(capped(u128::MAX), COUNT_CAP);
        assert!(r["small"]
            .overlap_message("small")
            .contains("AddressPool big"));
    }
}
