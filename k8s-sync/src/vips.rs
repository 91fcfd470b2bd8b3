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
use std::net::IpAddr;

use juneau_control::ipam::{AddressPool, Allocation, Family, Ipam, IpamError};

use crate::crd::AddressPoolSpec;

/// Parses an AddressPool object with `juneau_control::ipam`.
pub fn parse_pool(name: &str, spec: &AddressPoolSpec) -> Result<AddressPool, IpamError> {
    AddressPool::parse(
        name,
        &spec.addresses,
        spec.allow_network_and_broadcast.unwrap_or(false),
    )
}

fn slot(f: Family) -> usize {
    match f {
        Family::V4 => 0,
        Family::V6 => 1,
    }
}

/// Who holds each VIP (`namespace/name` of the Service), oldest claim first, indexed
/// both ways: the controller asks it several times per reconcile, and with 10 000
/// Services linear scans over the claims were most of its CPU time. An owner holds at
/// most one VIP per family (a dual-stack Service holds two).
#[derive(Debug, Default, Clone)]
pub struct VipBook {
    claims: Vec<(String, IpAddr)>,
    /// The owner's VIPs, IPv4 then IPv6.
    by_owner: HashMap<String, [Option<IpAddr>; 2]>,
    by_vip: HashMap<IpAddr, String>,
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
    pub fn owner(&self, vip: IpAddr) -> Option<&str> {
        self.by_vip.get(&vip).map(String::as_str)
    }

    /// The VIP of `family` a Service holds.
    pub fn vip_of(&self, owner: &str, family: Family) -> Option<IpAddr> {
        self.by_owner.get(owner).and_then(|h| h[slot(family)])
    }

    /// Every VIP a Service holds, IPv4 first.
    pub fn vips_of(&self, owner: &str) -> Vec<IpAddr> {
        self.by_owner
            .get(owner)
            .map(|h| h.iter().flatten().copied().collect())
            .unwrap_or_default()
    }

    /// The first VIP a Service holds (IPv4 before IPv6): the one its metrics name.
    pub fn first_vip(&self, owner: &str) -> Option<IpAddr> {
        self.by_owner
            .get(owner)
            .and_then(|h| h.iter().flatten().next().copied())
    }

    /// Records an existing allocation found in the API. Returns false (and records
    /// nothing) when the VIP is held by someone else or the owner already holds another
    /// of its family: the first record wins.
    pub fn restore(&mut self, vip: IpAddr, owner: &str) -> bool {
        match (self.owner(vip), self.vip_of(owner, Family::of(vip))) {
            (Some(o), _) => o == owner,
            (None, Some(_)) => false,
            (None, None) => {
                self.replayed = None;
                self.claims.push((owner.to_string(), vip));
                self.by_owner.entry(owner.to_string()).or_default()[slot(Family::of(vip))] =
                    Some(vip);
                self.by_vip.insert(vip, owner.to_string());
                true
            }
        }
    }

    /// Releases `owner`'s VIP of `family`.
    pub fn release_family(&mut self, owner: &str, family: Family) -> Option<IpAddr> {
        let held = self.by_owner.get_mut(owner)?;
        let vip = held[slot(family)].take()?;
        if held.iter().all(Option::is_none) {
            self.by_owner.remove(owner);
        }
        self.by_vip.remove(&vip);
        if let Some((_, ipam)) = &mut self.replayed {
            ipam.release_family(owner, family);
        }
        if let Some(i) = self
            .claims
            .iter()
            .position(|(o, v)| o == owner && *v == vip)
        {
            self.claims.remove(i);
        }
        Some(vip)
    }

    /// Releases whatever `owner` holds, IPv4 first.
    pub fn release(&mut self, owner: &str) -> Vec<IpAddr> {
        [Family::V4, Family::V6]
            .into_iter()
            .filter_map(|f| self.release_family(owner, f))
            .collect()
    }

    /// Gives `owner` a VIP of `family` from the network's `pools` (in order) with
    /// `juneau_control::ipam`: `requested` if given, else the VIP of the family it
    /// already holds if still inside a listed pool, else the lowest free one. On error
    /// the owner keeps what it had. Its VIP of the other family is untouched.
    ///
    /// An owner that keeps the VIP it holds (nothing requested, or exactly that VIP, and
    /// it lies in a listed pool) gets it back without replaying the book into an
    /// [`Ipam`] — the same answer `Ipam::allocate` gives, without its O(N) rebuild.
    pub fn allocate(
        &mut self,
        owner: &str,
        pools: &[AddressPool],
        family: Family,
        requested: Option<IpAddr>,
    ) -> Result<Allocation, IpamError> {
        if let Some(held) = self.vip_of(owner, family) {
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
        let a = ipam.allocate(owner, &names, family, requested)?;
        match self.vip_of(owner, family) {
            Some(old) => {
                self.by_vip.remove(&old);
                if let Some(c) = self
                    .claims
                    .iter_mut()
                    .find(|(o, v)| o == owner && *v == old)
                {
                    c.1 = a.ip;
                }
            }
            None => self.claims.push((owner.to_string(), a.ip)),
        }
        self.by_owner.entry(owner.to_string()).or_default()[slot(family)] = Some(a.ip);
        self.by_vip.insert(a.ip, owner.to_string());
        Ok(a)
    }

    /// Every VIP held.
    pub fn vips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.claims.iter().map(|(_, v)| *v)
    }

    /// Addresses of `family` in `pools` nobody holds (an address in two pools counted
    /// once), saturating.
    pub fn free_in(&self, pools: &[AddressPool], family: Family) -> u128 {
        let num = |ip: IpAddr| match ip {
            IpAddr::V4(a) => u128::from(u32::from(a)),
            IpAddr::V6(a) => u128::from(a),
        };
        let mut ranges: Vec<(u128, u128)> = pools
            .iter()
            .flat_map(|p| p.ranges.iter())
            .filter(|r| r.family() == family)
            .map(|r| (num(r.first), num(r.last)))
            .collect();
        ranges.sort();
        let mut merged: Vec<(u128, u128)> = Vec::new();
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(m) if a <= m.1.saturating_add(1) => m.1 = m.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let total: u128 = merged.iter().fold(0u128, |n, (a, b)| {
            n.saturating_add((b - a).saturating_add(1))
        });
        let held = self
            .vips()
            .filter(|v| Family::of(*v) == family)
            .filter(|v| {
                let v = num(*v);
                merged.iter().any(|(a, b)| *a <= v && v <= *b)
            })
            .count() as u128;
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
    use std::net::Ipv4Addr;

    const V4: Family = Family::V4;

    fn a4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    fn a4u(v: u32) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(v))
    }

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
            b.allocate("a", &pools, V4, None).unwrap().ip,
            a4(192, 0, 2, 1)
        );
        assert_eq!(
            b.allocate("a", &pools, V4, None).unwrap().ip,
            a4(192, 0, 2, 1)
        );
        assert!(matches!(
            b.allocate("b", &pools, V4, Some(a4(192, 0, 2, 1))),
            Err(IpamError::RequestedTaken { .. })
        ));
        assert!(matches!(
            b.allocate("b", &pools, V4, Some(a4(192, 0, 2, 3))),
            Err(IpamError::RequestedOutsidePools { .. })
        ));
        assert_eq!(
            b.allocate("b", &pools, V4, None).unwrap().ip,
            a4(192, 0, 2, 2)
        );
        assert!(matches!(
            b.allocate("c", &pools, V4, None),
            Err(IpamError::Exhausted { .. })
        ));
        assert_eq!(b.release("a"), vec![a4(192, 0, 2, 1)]);
        assert_eq!(
            b.allocate("c", &pools, V4, None).unwrap().ip,
            a4(192, 0, 2, 1)
        );
        // Moving to a requested address releases the old one.
        let pools = vec![pool("p", &["192.0.2.0/29"])];
        assert_eq!(
            b.allocate("c", &pools, V4, Some(a4(192, 0, 2, 5)))
                .unwrap()
                .ip,
            a4(192, 0, 2, 5)
        );
        assert_eq!(b.owner(a4(192, 0, 2, 1)), None);
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
                    let vip = a4u(u32::from(Ipv4Addr::new(192, 0, 2, 1)) + (x >> 24) % 7);
                    b.restore(vip, &owner);
                }
                op => {
                    let requested = (op == 1)
                        .then(|| a4u(u32::from(Ipv4Addr::new(192, 0, 2, 1)) + (x >> 24) % 7));
                    let (mut ipam, _) =
                        Ipam::rebuild(listed.iter().cloned(), b.claims.iter().cloned());
                    let names: Vec<&str> = listed.iter().map(|p| p.name.as_str()).collect();
                    let want = ipam.allocate(&owner, &names, V4, requested);
                    let got = b.allocate(&owner, &listed, V4, requested);
                    assert_eq!(format!("{got:?}"), format!("{want:?}"), "step {step}");
                }
            }
            assert_eq!(b.by_owner.len(), b.claims.len(), "step {step}");
            assert_eq!(b.by_vip.len(), b.claims.len(), "step {step}");
            for (o, v) in &b.claims {
                assert_eq!(b.vip_of(o, V4), Some(*v), "step {step}");
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
            let a = b.allocate(&format!("s{i}"), &pools, V4, None).unwrap();
            assert_eq!(a.ip, a4u(u32::from(Ipv4Addr::new(10, 0, 0, 1)) + i));
        }
        assert_eq!(b.replays, 1);
        assert_eq!(b.release("s10"), vec![a4(10, 0, 0, 11)]);
        assert_eq!(
            b.allocate("t", &pools, V4, None).unwrap().ip,
            a4(10, 0, 0, 11)
        );
        assert_eq!(b.replays, 1);
        assert!(b.restore(a4(10, 0, 3, 233), "r"));
        assert_eq!(
            b.allocate("u", &pools, V4, None).unwrap().ip,
            a4(10, 0, 3, 234)
        );
        assert_eq!(b.replays, 2);
        let other = vec![pool("q", &["10.1.0.0/24"])];
        assert_eq!(
            b.allocate("v", &other, V4, None).unwrap().ip,
            a4(10, 1, 0, 1)
        );
        assert_eq!(b.replays, 3);
    }

    #[test]
    fn a_vip_outside_current_pools_stays_reserved() {
        let mut b = VipBook::default();
        assert!(b.restore(a4(198, 51, 100, 1), "old"));
        let pools = vec![pool("p", &["198.51.100.1/32"])];
        assert!(matches!(
            b.allocate("new", &pools, V4, None),
            Err(IpamError::Exhausted { .. })
        ));
    }

    #[test]
    fn free_counts_shared_addresses_once() {
        let pools = vec![pool("a", &["192.0.2.0/30"]), pool("b", &["192.0.2.0/29"])];
        let mut b = VipBook::default();
        assert_eq!(b.free_in(&pools, V4), 6);
        assert!(b.restore(a4(192, 0, 2, 2), "x"));
        assert!(b.restore(a4(198, 51, 100, 1), "y"));
        assert_eq!(b.free_in(&pools, V4), 5);
        assert_eq!(b.free_in(&pools[..1], V4), 1);
    }

    /// A dual-stack owner holds one VIP per family, each allocated, moved and released
    /// on its own, and the book answers as a replayed Ipam does.
    #[test]
    fn one_vip_per_family() {
        let v6 = Family::V6;
        let six = |s: &str| s.parse::<IpAddr>().unwrap();
        let pools = vec![pool("dual", &["192.0.2.0/30", "2001:db8::/64"])];
        let mut b = VipBook::default();
        assert_eq!(
            b.allocate("a", &pools, V4, None).unwrap().ip,
            a4(192, 0, 2, 1)
        );
        assert_eq!(
            b.allocate("a", &pools, v6, None).unwrap().ip,
            six("2001:db8::1")
        );
        assert_eq!(
            b.allocate("b", &pools, v6, None).unwrap().ip,
            six("2001:db8::2")
        );
        assert_eq!(b.vips_of("a"), vec![a4(192, 0, 2, 1), six("2001:db8::1")]);
        assert_eq!(b.owner(six("2001:db8::1")), Some("a"));
        // Moving the IPv6 VIP leaves the IPv4 one.
        let moved = b
            .allocate("a", &pools, v6, Some(six("2001:db8::ff")))
            .unwrap();
        assert_eq!(moved.ip, six("2001:db8::ff"));
        assert_eq!(b.owner(six("2001:db8::1")), None);
        assert_eq!(b.vip_of("a", V4), Some(a4(192, 0, 2, 1)));
        assert_eq!(b.len(), 3);
        // An IPv6 VIP restored beside an IPv4 one is no conflict; a second IPv6 one is.
        assert!(b.restore(six("2001:db8::7"), "c"));
        assert!(b.restore(a4(192, 0, 2, 2), "c"));
        assert!(!b.restore(six("2001:db8::8"), "c"));
        assert_eq!(b.free_in(&pools, V4), 0);
        assert_eq!(b.free_in(&pools, v6), u128::from(u64::MAX) - 3);
        let (mut ipam, conflicts) = Ipam::rebuild(pools.iter().cloned(), b.claims.iter().cloned());
        assert!(conflicts.is_empty());
        assert_eq!(
            ipam.allocate("d", &["dual"], v6, None),
            b.allocate("d", &pools, v6, None)
        );
        assert_eq!(b.release_family("a", v6), Some(six("2001:db8::ff")));
        assert_eq!(b.vips_of("a"), vec![a4(192, 0, 2, 1)]);
        assert_eq!(b.release("c"), vec![a4(192, 0, 2, 2), six("2001:db8::7")]);
        assert!(b.vips_of("c").is_empty());
        assert_eq!(b.len(), 3);
    }

    #[test]
    fn restore_first_record_wins() {
        let mut b = VipBook::default();
        assert!(b.restore(a4(192, 0, 2, 1), "a"));
        assert!(b.restore(a4(192, 0, 2, 1), "a"));
        assert!(!b.restore(a4(192, 0, 2, 1), "b"));
        assert!(!b.restore(a4(192, 0, 2, 2), "a"));
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
