//! VIP bookkeeping for the controller: which VIP belongs to which Service.
//!
//! The book is rebuilt from what the API records (ServiceLoadBalancer statuses, then the
//! ingress IPs of managed Services) before the controller allocates anything, so a VIP is
//! never handed out twice across restarts or leader changes.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use crate::crd::AddressPoolSpec;

/// An inclusive range of IPv4 addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// First address.
    pub first: Ipv4Addr,
    /// Last address (inclusive).
    pub last: Ipv4Addr,
}

impl Range {
    /// True when `ip` lies in the range.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        self.first <= ip && ip <= self.last
    }
}

/// Parses an AddressPool's `addresses` into ranges, or says in words what is wrong.
pub fn parse_pool(spec: &AddressPoolSpec) -> Result<Vec<Range>, String> {
    let skip_edges = !spec.allow_network_and_broadcast.unwrap_or(false);
    let mut out = Vec::new();
    for a in &spec.addresses {
        let a = a.trim();
        if let Some((f, l)) = a.split_once('-') {
            let first: Ipv4Addr = f
                .trim()
                .parse()
                .map_err(|_| format!("{a:?} is not an IPv4 range (a.b.c.d-a.b.c.e)"))?;
            let last: Ipv4Addr = l
                .trim()
                .parse()
                .map_err(|_| format!("{a:?} is not an IPv4 range (a.b.c.d-a.b.c.e)"))?;
            if first > last {
                return Err(format!("range {a:?} ends before it starts"));
            }
            out.push(Range { first, last });
        } else {
            let (ip, len) = a
                .split_once('/')
                .ok_or_else(|| format!("{a:?} is not an IPv4 CIDR such as 203.0.113.0/24"))?;
            let ip: Ipv4Addr = ip
                .parse()
                .map_err(|_| format!("{a:?} is not an IPv4 CIDR such as 203.0.113.0/24"))?;
            let len: u8 = len
                .parse()
                .ok()
                .filter(|l| *l <= 32)
                .ok_or_else(|| format!("{a:?} has a prefix length outside 0..32"))?;
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            let net = u32::from(ip) & mask;
            let bcast = net | !mask;
            let (mut first, mut last) = (net, bcast);
            if skip_edges && len <= 30 {
                first += 1;
                last -= 1;
            }
            out.push(Range {
                first: first.into(),
                last: last.into(),
            });
        }
    }
    Ok(out)
}

/// Who holds each VIP (`namespace/name` of the Service).
#[derive(Debug, Default, Clone)]
pub struct VipBook {
    by_vip: BTreeMap<Ipv4Addr, String>,
}

/// Why a VIP could not be handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// The requested address lies in none of the network's pools.
    OutsidePools,
    /// The requested address belongs to another Service.
    Taken(String),
    /// Every pool of the network is full.
    Exhausted,
}

impl VipBook {
    /// The owner of a VIP.
    pub fn owner(&self, vip: Ipv4Addr) -> Option<&str> {
        self.by_vip.get(&vip).map(String::as_str)
    }

    /// The VIP a Service holds.
    pub fn vip_of(&self, owner: &str) -> Option<Ipv4Addr> {
        self.by_vip
            .iter()
            .find(|(_, o)| o.as_str() == owner)
            .map(|(v, _)| *v)
    }

    /// Records an existing allocation found in the API. Returns false (and records
    /// nothing) when the VIP is already held by someone else: the first record wins.
    pub fn restore(&mut self, vip: Ipv4Addr, owner: &str) -> bool {
        match self.by_vip.get(&vip) {
            Some(o) => o == owner,
            None => {
                if self.vip_of(owner).is_some() {
                    return false;
                }
                self.by_vip.insert(vip, owner.to_string());
                true
            }
        }
    }

    /// Releases whatever `owner` holds.
    pub fn release(&mut self, owner: &str) -> Option<Ipv4Addr> {
        let vip = self.vip_of(owner)?;
        self.by_vip.remove(&vip);
        Some(vip)
    }

    /// Gives `owner` a VIP from `pools` (name, ranges; in order): `requested` if given,
    /// else the VIP it already holds if that is still inside a pool, else the lowest free
    /// one. Returns the VIP and the pool it came from.
    pub fn allocate(
        &mut self,
        owner: &str,
        pools: &[(String, Vec<Range>)],
        requested: Option<Ipv4Addr>,
    ) -> Result<(Ipv4Addr, String), AllocError> {
        let pool_of = |ip: Ipv4Addr| {
            pools
                .iter()
                .find(|(_, rs)| rs.iter().any(|r| r.contains(ip)))
                .map(|(n, _)| n.clone())
        };
        let current = self.vip_of(owner);
        if let Some(req) = requested {
            let pool = pool_of(req).ok_or(AllocError::OutsidePools)?;
            match self.owner(req) {
                Some(o) if o != owner => return Err(AllocError::Taken(o.to_string())),
                _ => {}
            }
            if current != Some(req) {
                self.release(owner);
                self.by_vip.insert(req, owner.to_string());
            }
            return Ok((req, pool));
        }
        if let Some(cur) = current {
            if let Some(pool) = pool_of(cur) {
                return Ok((cur, pool));
            }
            self.release(owner);
        }
        for (name, ranges) in pools {
            for r in ranges {
                let (f, l) = (u32::from(r.first), u32::from(r.last));
                // Skip whole runs of taken addresses via the ordered map.
                let mut ip = f;
                for (taken, _) in self.by_vip.range(r.first..=r.last) {
                    let t = u32::from(*taken);
                    if t > ip {
                        break;
                    }
                    ip = t + 1;
                }
                if ip <= l && ip >= f {
                    let vip = Ipv4Addr::from(ip);
                    self.by_vip.insert(vip, owner.to_string());
                    return Ok((vip, name.clone()));
                }
            }
        }
        Err(AllocError::Exhausted)
    }

    /// Number of VIPs held.
    pub fn len(&self) -> usize {
        self.by_vip.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.by_vip.is_empty()
    }
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
        }
    }

    #[test]
    fn parses_cidrs_and_ranges() {
        let r = parse_pool(&spec(&["203.0.113.0/24", "198.51.100.10-198.51.100.12"])).unwrap();
        assert_eq!(r[0].first, Ipv4Addr::new(203, 0, 113, 1));
        assert_eq!(r[0].last, Ipv4Addr::new(203, 0, 113, 254));
        assert_eq!(r[1].first, Ipv4Addr::new(198, 51, 100, 10));
        assert_eq!(r[1].last, Ipv4Addr::new(198, 51, 100, 12));
        assert!(parse_pool(&spec(&["203.0.113.0/33"])).is_err());
        assert!(parse_pool(&spec(&["nonsense"])).is_err());
        assert!(parse_pool(&spec(&["10.0.0.5-10.0.0.1"])).is_err());
        let one = parse_pool(&spec(&["192.0.2.7/32"])).unwrap();
        assert_eq!(one[0].first, one[0].last);
    }

    #[test]
    fn allocates_lowest_free_requested_and_never_twice() {
        let pools = vec![(
            "p".to_string(),
            parse_pool(&spec(&["192.0.2.0/30"])).unwrap(),
        )];
        // /30 without network+broadcast: .1 and .2
        let mut b = VipBook::default();
        assert_eq!(
            b.allocate("a", &pools, None).unwrap().0,
            Ipv4Addr::new(192, 0, 2, 1)
        );
        assert_eq!(
            b.allocate("a", &pools, None).unwrap().0,
            Ipv4Addr::new(192, 0, 2, 1)
        );
        assert_eq!(
            b.allocate("b", &pools, Some(Ipv4Addr::new(192, 0, 2, 1))),
            Err(AllocError::Taken("a".into()))
        );
        assert_eq!(
            b.allocate("b", &pools, Some(Ipv4Addr::new(192, 0, 2, 3))),
            Err(AllocError::OutsidePools)
        );
        assert_eq!(
            b.allocate("b", &pools, None).unwrap().0,
            Ipv4Addr::new(192, 0, 2, 2)
        );
        assert_eq!(b.allocate("c", &pools, None), Err(AllocError::Exhausted));
        assert_eq!(b.release("a"), Some(Ipv4Addr::new(192, 0, 2, 1)));
        assert_eq!(
            b.allocate("c", &pools, None).unwrap().0,
            Ipv4Addr::new(192, 0, 2, 1)
        );
    }

    #[test]
    fn restore_first_record_wins() {
        let mut b = VipBook::default();
        assert!(b.restore(Ipv4Addr::new(192, 0, 2, 1), "a"));
        assert!(b.restore(Ipv4Addr::new(192, 0, 2, 1), "a"));
        assert!(!b.restore(Ipv4Addr::new(192, 0, 2, 1), "b"));
        assert!(!b.restore(Ipv4Addr::new(192, 0, 2, 2), "a"));
        assert_eq!(b.len(), 1);
    }
}
