//! The controller's VIP book: who holds which VIP, in the order the claims were made.
//!
//! Decisions (parsing pools, choosing the lowest free address, honouring a requested
//! IP, refusing a taken one) are `juneau_control::ipam`'s; this book only keeps the
//! allocations between reconciles while AddressPools come and go: each allocation
//! replays the book into an [`Ipam`] over the pools as they are now.
//!
//! The book is rebuilt from what the API records (ServiceLoadBalancer statuses, then the
//! ingress IPs of managed Services) before the controller allocates anything, so a VIP is
//! never handed out twice across restarts or leader changes.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use juneau_control::ipam::{AddressPool, Allocation, Ipam, IpamError};

use crate::crd::AddressPoolSpec;

/// Parses an AddressPool object with `juneau_control::ipam`.
pub fn parse_pool(name: &str, spec: &AddressPoolSpec) -> Result<AddressPool, IpamError> {
    AddressPool::parse(
        name,
        &spec.addresses,
        spec.allow_network_and_broadcast.unwrap_or(false),
    )
}

/// Who holds each VIP (`namespace/name` of the Service), oldest claim first, indexed
/// both ways: the controller asks it several times per reconcile, and with 10 000
/// Services linear scans over the claims were most of its CPU time.
#[derive(Debug, Default, Clone)]
pub struct VipBook {
    claims: Vec<(String, Ipv4Addr)>,
    by_owner: HashMap<String, Ipv4Addr>,
    by_vip: HashMap<Ipv4Addr, String>,
    /// The book replayed into an [`Ipam`] over the pools of the last allocation, kept in
    /// step with every claim and release since: the next allocation from the same pools
    /// uses it instead of replaying the whole book again (that replay, O(N) per new VIP,
    /// made allocation slow down as the book grew: 29 VIPs/s falling to 16/s at 10 000
    /// Services). Dropped when a claim is restored; rebuilt when the pools
    /// differ (another network, or an AddressPool changed).
    replayed: Option<(Vec<AddressPool>, Ipam)>,
    /// How many times the book was replayed into an Ipam.
    replays: u64,
}

impl VipBook {
    /// The owner of a VIP.
    pub fn owner(&self, vip: Ipv4Addr) -> Option<&str> {
        self.by_vip.get(&vip).map(String::as_str)
    }

    /// The VIP a Service holds.
    pub fn vip_of(&self, owner: &str) -> Option<Ipv4Addr> {
        self.by_owner.get(owner).copied()
    }

    /// Records an existing allocation found in the API. Returns false (and records
    /// nothing) when the VIP is held by someone else or the owner already holds another:
    /// the first record wins.
    pub fn restore(&mut self, vip: Ipv4Addr, owner: &str) -> bool {
        match (self.owner(vip), self.vip_of(owner)) {
            (Some(o), _) => o == owner,
            (None, Some(_)) => false,
            (None, None) => {
                self.replayed = None;
                self.claims.push((owner.to_string(), vip));
                self.by_owner.insert(owner.to_string(), vip);
                self.by_vip.insert(vip, owner.to_string());
                true
            }
        }
    }

    /// Releases whatever `owner` holds.
    pub fn release(&mut self, owner: &str) -> Option<Ipv4Addr> {
        let vip = self.by_owner.remove(owner)?;
        self.by_vip.remove(&vip);
        if let Some((_, ipam)) = &mut self.replayed {
            ipam.release(owner);
        }
        if let Some(i) = self.claims.iter().position(|(o, _)| o == owner) {
            self.claims.remove(i);
        }
        Some(vip)
    }

    /// Gives `owner` a VIP from the network's `pools` (in order) with
    /// `juneau_control::ipam`: `requested` if given, else the VIP it already holds if
    /// still inside a listed pool, else the lowest free one. On error the owner keeps
    /// what it had.
    ///
    /// An owner that keeps the VIP it holds (nothing requested, or exactly that VIP, and
    /// it lies in a listed pool) gets it back without replaying the book into an
    /// [`Ipam`] — the same answer `Ipam::allocate` gives, without its O(N) rebuild.
    pub fn allocate(
        &mut self,
        owner: &str,
        pools: &[AddressPool],
        requested: Option<Ipv4Addr>,
    ) -> Result<Allocation, IpamError> {
        if let Some(held) = self.vip_of(owner) {
            if requested.is_none_or(|r| r == held) {
                if let Some(p) = pools.iter().find(|p| p.contains(held)) {
                    return Ok(Allocation {
                        ip: held,
                        pool: Some(p.name.clone()),
                        owner: owner.to_string(),
                    });
                }
            }
        }
        let ipam = match &mut self.replayed {
            Some((replayed_pools, ipam)) if replayed_pools.as_slice() == pools => ipam,
            _ => {
                // The book never holds conflicting claims (`restore` refuses them), so
                // the replay finds none.
                let (ipam, _conflicts) =
                    Ipam::rebuild(pools.iter().cloned(), self.claims.iter().cloned());
                self.replays += 1;
                &mut self.replayed.insert((pools.to_vec(), ipam)).1
            }
        };
        let names: Vec<&str> = pools.iter().map(|p| p.name.as_str()).collect();
        // On error the Ipam is left as it was, like the book.
        let a = ipam.allocate(owner, &names, requested)?;
        let held = self.by_owner.contains_key(owner);
        match held
            .then(|| self.claims.iter_mut().find(|(o, _)| o == owner))
            .flatten()
        {
            Some(c) => {
                self.by_vip.remove(&c.1);
                c.1 = a.ip
            }
            None => self.claims.push((owner.to_string(), a.ip)),
        }
        self.by_owner.insert(owner.to_string(), a.ip);
        self.by_vip.insert(a.ip, owner.to_string());
        Ok(a)
    }

    /// Every VIP held.
    pub fn vips(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.claims.iter().map(|(_, v)| *v)
    }

    /// Addresses of `pools` nobody holds (an address in two pools counted once).
    pub fn free_in(&self, pools: &[AddressPool]) -> u64 {
        let mut ranges: Vec<(u32, u32)> = pools
            .iter()
            .flat_map(|p| p.ranges.iter())
            .map(|r| (u32::from(r.first), u32::from(r.last)))
            .collect();
        ranges.sort();
        let mut merged: Vec<(u32, u32)> = Vec::new();
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(m) if a <= m.1.saturating_add(1) => m.1 = m.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let total: u64 = merged
            .iter()
            .map(|(a, b)| u64::from(*b) - u64::from(*a) + 1)
            .sum();
        let held = self
            .vips()
            .filter(|v| {
                let v = u32::from(*v);
                merged.iter().any(|(a, b)| *a <= v && v <= *b)
            })
            .count() as u64;
        total.saturating_sub(held)
    }

    /// Number of VIPs held.
    pub fn len(&self) -> usize {
        self.claims.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AdvertiseMode;

    fn pool(name: &str, a: &[&str]) -> AddressPool {
        parse_pool(
            name,
            &AddressPoolSpec {
                advertise_mode: AdvertiseMode::bgp(),
                addresses: a.iter().map(|s| s.to_string()).collect(),
                allow_network_and_broadcast: None,
                auto_assign: None,
                service_allocation: None,
            },
        )
        .unwrap()
    }

    #[test]
    fn allocates_lowest_free_requested_and_never_twice() {
        let pools = vec![pool("p", &["192.0.2.0/30"])];
        // /30 without network+broadcast: .1 and .2
        let mut b = VipBook::default();
        assert_eq!(
            b.allocate("a", &pools, None).unwrap().ip,
            Ipv4Addr::new(192, 0, 2, 1)
        );
        assert_eq!(
            b.allocate("a", &pools, None).unwrap().ip,
            Ipv4Addr::new(192, 0, 2, 1)
        );
        assert!(matches!(
            b.allocate("b", &pools, Some(Ipv4Addr::new(192, 0, 2, 1))),
            Err(IpamError::RequestedTaken { .. })
        ));
        assert!(matches!(
            b.allocate("b", &pools, Some(Ipv4Addr::new(192, 0, 2, 3))),
            Err(IpamError::RequestedOutsidePools { .. })
        ));
        assert_eq!(
            b.allocate("b", &pools, None).unwrap().ip,
            Ipv4Addr::new(192, 0, 2, 2)
        );
        assert!(matches!(
            b.allocate("c", &pools, None),
            Err(IpamError::Exhausted { .. })
        ));
        assert_eq!(b.release("a"), Some(Ipv4Addr::new(192, 0, 2, 1)));
        assert_eq!(
            b.allocate("c", &pools, None).unwrap().ip,
            Ipv4Addr::new(192, 0, 2, 1)
        );
        // Moving to a requested address releases the old one.
        let pools = vec![pool("p", &["192.0.2.0/29"])];
        assert_eq!(
            b.allocate("c", &pools, Some(Ipv4Addr::new(192, 0, 2, 5)))
                .unwrap()
                .ip,
            Ipv4Addr::new(192, 0, 2, 5)
        );
        assert_eq!(b.owner(Ipv4Addr::new(192, 0, 2, 1)), None);
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn the_indexed_book_answers_as_a_replayed_ipam_does() {
        let pools = [
            pool("a", &["192.0.2.0/29"]),
            pool("b", &["198.51.100.0/30"]),
        ];
        let mut b = VipBook::default();
        let mut x: u32 = 7;
        for step in 0..2000 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let owner = format!("s{}", (x >> 8) % 12);
            let listed: Vec<AddressPool> = match (x >> 20) % 3 {
                0 => pools.to_vec(),
                1 => vec![pools[1].clone()],
                _ => vec![pools[0].clone()],
            };
            match (x >> 16) % 5 {
                0 => {
                    b.release(&owner);
                }
                4 => {
                    let vip =
                        Ipv4Addr::from(u32::from(Ipv4Addr::new(192, 0, 2, 1)) + (x >> 24) % 7);
                    b.restore(vip, &owner);
                }
                op => {
                    let requested = (op == 1).then(|| {
                        Ipv4Addr::from(u32::from(Ipv4Addr::new(192, 0, 2, 1)) + (x >> 24) % 7)
                    });
                    let (mut ipam, _) =
                        Ipam::rebuild(listed.iter().cloned(), b.claims.iter().cloned());
                    let names: Vec<&str> = listed.iter().map(|p| p.name.as_str()).collect();
                    let want = ipam.allocate(&owner, &names, requested);
                    let got = b.allocate(&owner, &listed, requested);
                    assert_eq!(format!("{got:?}"), format!("{want:?}"), "step {step}");
                }
            }
            assert_eq!(b.by_owner.len(), b.claims.len(), "step {step}");
            assert_eq!(b.by_vip.len(), b.claims.len(), "step {step}");
            for (o, v) in &b.claims {
                assert_eq!(b.vip_of(o), Some(*v), "step {step}");
                assert_eq!(b.owner(*v), Some(o.as_str()), "step {step}");
            }
        }
    }

    /// A new VIP from the same pools does not replay the whole book again (O(N) per
    /// allocation); a restored claim or other pools do.
    #[test]
    fn allocations_from_the_same_pools_replay_the_book_once() {
        let pools = vec![pool("p", &["10.0.0.0/16"])];
        let mut b = VipBook::default();
        for i in 0..1000u32 {
            let a = b.allocate(&format!("s{i}"), &pools, None).unwrap();
            assert_eq!(
                a.ip,
                Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 1)) + i)
            );
        }
        assert_eq!(b.replays, 1);
        assert_eq!(b.release("s10"), Some(Ipv4Addr::new(10, 0, 0, 11)));
        assert_eq!(
            b.allocate("t", &pools, None).unwrap().ip,
            Ipv4Addr::new(10, 0, 0, 11)
        );
        assert_eq!(b.replays, 1);
        assert!(b.restore(Ipv4Addr::new(10, 0, 3, 233), "r"));
        assert_eq!(
            b.allocate("u", &pools, None).unwrap().ip,
            Ipv4Addr::new(10, 0, 3, 234)
        );
        assert_eq!(b.replays, 2);
        let other = vec![pool("q", &["10.1.0.0/24"])];
        assert_eq!(
            b.allocate("v", &other, None).unwrap().ip,
            Ipv4Addr::new(10, 1, 0, 1)
        );
        assert_eq!(b.replays, 3);
    }

    #[test]
    fn a_vip_outside_current_pools_stays_reserved() {
        let mut b = VipBook::default();
        assert!(b.restore(Ipv4Addr::new(198, 51, 100, 1), "old"));
        let pools = vec![pool("p", &["198.51.100.1/32"])];
        assert!(matches!(
            b.allocate("new", &pools, None),
            Err(IpamError::Exhausted { .. })
        ));
    }

    #[test]
    fn free_counts_shared_addresses_once() {
        let pools = vec![pool("a", &["192.0.2.0/30"]), pool("b", &["192.0.2.0/29"])];
        let mut b = VipBook::default();
        assert_eq!(b.free_in(&pools), 6);
        assert!(b.restore(Ipv4Addr::new(192, 0, 2, 2), "x"));
        assert!(b.restore(Ipv4Addr::new(198, 51, 100, 1), "y"));
        assert_eq!(b.free_in(&pools), 5);
        assert_eq!(b.free_in(&pools[..1]), 1);
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

    #[test]
    fn malformed_pools_are_named() {
        let spec = AddressPoolSpec {
            advertise_mode: AdvertiseMode::bgp(),
            addresses: vec!["203.0.113.0/99".into()],
            allow_network_and_broadcast: None,
            auto_assign: None,
            service_allocation: None,
        };
        let e = parse_pool("bad", &spec).unwrap_err().to_string();
        assert!(e.contains("bad") && e.contains("203.0.113.0/99"), "{e}");
    }
}
