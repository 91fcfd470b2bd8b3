//! What to announce to a peer (Adj-RIB-Out) and the UPDATEs that move a peer from what it
//! has to what it should have. Pure functions, no I/O.
//!
//! A VIP is a host route of either family: IPv4 `/32` goes in the UPDATE's NLRI field
//! with NEXT_HOP, IPv6 `/128` in MP_REACH_NLRI / MP_UNREACH_NLRI (RFC 4760) with an
//! IPv6 next hop. A route of a family the session did not negotiate is never sent
//! ([`sendable`] counts it instead).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net};
use juneau_control::model::NodeState;

use crate::family::{AddressFamily, Families};
use crate::wire::{MpReach, MpUnreach, Origin, PathAttributes, Update};

/// The attributes of one VIP that do not depend on the session.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteAttrs {
    /// Standard communities.
    pub communities: Vec<u32>,
    /// Large communities.
    pub large_communities: Vec<[u32; 3]>,
    /// LOCAL_PREF (sent to iBGP peers only).
    pub local_pref: Option<u32>,
    /// Extra copies of our AS in the AS_PATH (eBGP only; graceful maintenance).
    pub as_path_prepend: u8,
    /// Ready local backends, sent as link bandwidth (weighted ECMP).
    pub weight: Option<u32>,
}

/// VIP (a host route, IPv4 or IPv6) -> attributes, for one peer.
pub type AdjRibOut = BTreeMap<IpAddr, RouteAttrs>;

/// The VIPs `state` says to announce to the peer named `peer` (all VIPs whose `peers`
/// list is empty or names this peer's index).
pub fn desired_for(state: &NodeState, peer: &str) -> AdjRibOut {
    let Some(idx) = state.peers.iter().position(|p| p.name == peer) else {
        return AdjRibOut::new();
    };
    state
        .advertised
        .iter()
        .filter(|a| a.peers.is_empty() || a.peers.contains(&(idx as u16)))
        .map(|a| {
            (
                a.vip,
                RouteAttrs {
                    communities: a.communities.clone(),
                    large_communities: a.large_communities.clone(),
                    local_pref: a.local_pref,
                    as_path_prepend: 0,
                    weight: a.weight,
                },
            )
        })
        .collect()
}

/// The IPv6 next hop of MP_REACH_NLRI: the global address, and the link-local one when
/// the peer is on the link (a 32-byte next hop, RFC 2545 §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ipv6NextHop {
    /// Global (or unique-local) address of this node on the peering link.
    pub global: Ipv6Addr,
    /// Link-local address of the interface towards the peer (single-hop sessions only).
    pub link_local: Option<Ipv6Addr>,
}

/// Session-dependent parts of the announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionParams {
    /// Our AS.
    pub local_asn: u32,
    /// Internal BGP (empty AS_PATH, LOCAL_PREF sent).
    pub ibgp: bool,
    /// NEXT_HOP of IPv4 routes; `None`: this node has no IPv4 address towards the peer.
    pub next_hop: Option<Ipv4Addr>,
    /// Next hop of IPv6 routes (and of IPv4 routes under RFC 8950); `None`: no IPv6
    /// address towards the peer, so IPv6 routes are not sent.
    pub next_hop_v6: Option<Ipv6NextHop>,
    /// The families the session negotiated.
    pub families: Families,
    /// The session negotiated IPv4 routes with an IPv6 next hop (RFC 8950): used when
    /// `next_hop` is `None`.
    pub extended_next_hop: bool,
}

/// Routes in the desired Adj-RIB-Out that a session cannot carry, by reason (shown in
/// the peer's status).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Withheld {
    /// The peer did not negotiate the route's family (an IPv4-only router is never sent
    /// an IPv6 route).
    pub family_not_negotiated: usize,
    /// The family is negotiated but this node has no address of it towards the peer to
    /// use as the next hop.
    pub no_next_hop: usize,
}

/// How a route of `af` goes out on this session, if it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Carrier {
    /// IPv4 NLRI field with NEXT_HOP.
    Ipv4(Ipv4Addr),
    /// MP_REACH_NLRI of this family with an IPv6 next hop.
    Mp(AddressFamily, Ipv6NextHop),
}

impl SessionParams {
    fn carrier(&self, af: AddressFamily) -> Result<Carrier, fn(&mut Withheld)> {
        if !self.families.contains(af) {
            return Err(|w| w.family_not_negotiated += 1);
        }
        match (af, self.next_hop, self.next_hop_v6) {
            (AddressFamily::Ipv4Unicast, Some(nh), _) => Ok(Carrier::Ipv4(nh)),
            (AddressFamily::Ipv4Unicast, None, Some(nh)) if self.extended_next_hop => {
                Ok(Carrier::Mp(af, nh))
            }
            (AddressFamily::Ipv6Unicast, _, Some(nh)) => Ok(Carrier::Mp(af, nh)),
            _ => Err(|w| w.no_next_hop += 1),
        }
    }
}

/// The part of `desired` this session can carry, and what it cannot, counted.
pub fn sendable(mut desired: AdjRibOut, p: &SessionParams) -> (AdjRibOut, Withheld) {
    let mut withheld = Withheld::default();
    desired.retain(|vip, _| match p.carrier(AddressFamily::of(*vip)) {
        Ok(_) => true,
        Err(count) => {
            count(&mut withheld);
            false
        }
    });
    (desired, withheld)
}

/// Link bandwidth announced per Ready local backend: 1 Gbit/s, in bytes per second (the
/// unit of the link-bandwidth community). Only the ratio between nodes matters.
pub const BYTES_PER_SECOND_PER_BACKEND: u64 = 125_000_000;

/// IPv4 announcements per UPDATE (5 bytes each; well under the 4096-byte limit with
/// attributes).
pub const NLRI_PER_UPDATE: usize = 500;
/// IPv4 withdrawals per UPDATE.
pub const WITHDRAWN_PER_UPDATE: usize = 700;
/// Announcements per MP_REACH_NLRI (an IPv6 /128 takes 17 bytes: 2550 bytes, leaving
/// room for the attributes under 4096).
pub const MP_NLRI_PER_UPDATE: usize = 150;
/// Withdrawals per MP_UNREACH_NLRI (17 bytes each for IPv6).
pub const MP_WITHDRAWN_PER_UPDATE: usize = 200;

fn host(v: IpAddr) -> IpNet {
    IpNet::from(v)
}

fn host_v4(v: Ipv4Addr) -> Ipv4Net {
    Ipv4Net::from(v)
}

/// The UPDATEs that turn `old` into `new` at the peer: withdrawals first, then
/// announcements grouped by identical attributes. Both must hold only routes the
/// session can carry ([`sendable`]); others are skipped.
pub fn diff(old: &AdjRibOut, new: &AdjRibOut, p: SessionParams) -> Vec<Update> {
    let mut out = withdrawals(old.keys().filter(|v| !new.contains_key(v)).copied());
    let mut groups: BTreeMap<(&RouteAttrs, Carrier), Vec<IpAddr>> = BTreeMap::new();
    for (vip, attrs) in new {
        if old.get(vip) != Some(attrs) {
            if let Ok(c) = p.carrier(AddressFamily::of(*vip)) {
                groups.entry((attrs, c)).or_default().push(*vip);
            }
        }
    }
    for ((attrs, carrier), vips) in groups {
        let pa = path_attributes(attrs, &p);
        match carrier {
            Carrier::Ipv4(next_hop) => {
                for chunk in vips.chunks(NLRI_PER_UPDATE) {
                    out.push(Update {
                        attributes: Some(PathAttributes {
                            next_hop,
                            ..pa.clone()
                        }),
                        announced: chunk.iter().filter_map(v4).map(host_v4).collect(),
                        ..Update::default()
                    });
                }
            }
            Carrier::Mp(family, nh) => {
                for chunk in vips.chunks(MP_NLRI_PER_UPDATE) {
                    out.push(Update {
                        attributes: Some(pa.clone()),
                        mp_reach: Some(MpReach {
                            family,
                            next_hop: IpAddr::V6(nh.global),
                            link_local: nh.link_local,
                            announced: chunk.iter().copied().map(host).collect(),
                        }),
                        ..Update::default()
                    });
                }
            }
        }
    }
    out
}

fn v4(ip: &IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(a) => Some(*a),
        IpAddr::V6(_) => None,
    }
}

/// Withdrawals: IPv4 in the Withdrawn Routes field, IPv6 in MP_UNREACH_NLRI.
fn withdrawals(gone: impl Iterator<Item = IpAddr>) -> Vec<Update> {
    let (v4s, v6s): (Vec<IpAddr>, Vec<IpAddr>) = gone.partition(IpAddr::is_ipv4);
    let mut out = Vec::new();
    for chunk in v4s.chunks(WITHDRAWN_PER_UPDATE) {
        out.push(Update {
            withdrawn: chunk.iter().filter_map(v4).map(host_v4).collect(),
            ..Update::default()
        });
    }
    for chunk in v6s.chunks(MP_WITHDRAWN_PER_UPDATE) {
        out.push(Update {
            mp_unreach: Some(MpUnreach {
                family: AddressFamily::Ipv6Unicast,
                withdrawn: chunk.iter().copied().map(host).collect(),
            }),
            ..Update::default()
        });
    }
    out
}

/// The attributes of a route, the same for both families (NEXT_HOP unset: the carrier
/// sets it).
fn path_attributes(attrs: &RouteAttrs, p: &SessionParams) -> PathAttributes {
    PathAttributes {
        origin: Origin::Igp,
        as_path: if p.ibgp {
            vec![]
        } else {
            vec![p.local_asn; 1 + usize::from(attrs.as_path_prepend)]
        },
        next_hop: Ipv4Addr::UNSPECIFIED,
        local_pref: if p.ibgp {
            Some(attrs.local_pref.unwrap_or(100))
        } else {
            None
        },
        communities: attrs.communities.clone(),
        large_communities: attrs.large_communities.clone(),
        link_bandwidth: attrs
            .weight
            .map(|w| (p.local_asn, u64::from(w) * BYTES_PER_SECOND_PER_BACKEND)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{encode, Message};
    use juneau_control::model::{AdvertisedVip, PeerConfig};

    fn vip(v: [u8; 4], peers: Vec<u16>, comm: Vec<u32>) -> AdvertisedVip {
        AdvertisedVip {
            vip: IpAddr::from(v),
            communities: comm,
            large_communities: vec![],
            local_pref: None,
            peers,
            weight: None,
        }
    }

    fn state() -> NodeState {
        NodeState {
            node: "n1".into(),
            peers: vec![
                PeerConfig::new("tor-a", Ipv4Addr::new(10, 0, 0, 1), 65000, 65001),
                PeerConfig::new("tor-b", Ipv4Addr::new(10, 0, 1, 1), 65000, 65001),
            ],
            advertised: vec![
                vip([192, 0, 2, 1], vec![], vec![]),
                vip([192, 0, 2, 2], vec![1], vec![]),
                vip([192, 0, 2, 3], vec![0], vec![7]),
            ],
            ..Default::default()
        }
    }

    const P: SessionParams = SessionParams {
        local_asn: 65001,
        ibgp: false,
        next_hop: Some(Ipv4Addr::new(10, 0, 0, 2)),
        next_hop_v6: None,
        families: Families::IPV4,
        extended_next_hop: false,
    };

    fn ip4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    #[test]
    fn vips_go_only_to_their_peers() {
        let s = state();
        let a: Vec<_> = desired_for(&s, "tor-a").into_keys().collect();
        let b: Vec<_> = desired_for(&s, "tor-b").into_keys().collect();
        assert_eq!(a, vec![ip4(192, 0, 2, 1), ip4(192, 0, 2, 3)]);
        assert_eq!(b, vec![ip4(192, 0, 2, 1), ip4(192, 0, 2, 2)]);
        assert!(desired_for(&s, "unknown").is_empty());
    }

    #[test]
    fn diff_withdraws_announces_and_groups() {
        let s = state();
        let new = desired_for(&s, "tor-a");
        let ups = diff(&AdjRibOut::new(), &new, P);
        // Two attribute sets (no community / community 7): two UPDATEs.
        assert_eq!(ups.len(), 2);
        assert!(ups
            .iter()
            .all(|u| u.attributes.as_ref().unwrap().as_path == vec![65001]));
        assert!(diff(&new, &new, P).is_empty());
        let mut fewer = new.clone();
        fewer.remove(&ip4(192, 0, 2, 1));
        let ups = diff(&new, &fewer, P);
        assert_eq!(
            ups,
            vec![Update {
                withdrawn: vec!["192.0.2.1/32".parse().unwrap()],
                ..Update::default()
            }]
        );
        // A changed community re-announces just that VIP.
        let mut changed = new.clone();
        changed.get_mut(&ip4(192, 0, 2, 3)).unwrap().communities = vec![8];
        let ups = diff(&new, &changed, P);
        assert_eq!(ups.len(), 1);
        assert_eq!(
            ups[0].announced,
            vec!["192.0.2.3/32".parse::<Ipv4Net>().unwrap()]
        );
    }

    #[test]
    fn ibgp_gets_local_pref_and_empty_as_path() {
        let new = desired_for(&state(), "tor-a");
        let ups = diff(&AdjRibOut::new(), &new, SessionParams { ibgp: true, ..P });
        let a = ups[0].attributes.as_ref().unwrap();
        assert!(a.as_path.is_empty());
        assert_eq!(a.local_pref, Some(100));
    }

    #[test]
    fn thousands_of_vips_fit_in_legal_updates() {
        let new: AdjRibOut = (0..5000u32)
            .map(|i| {
                (
                    IpAddr::V4(Ipv4Addr::from(0xc633_0000 + i)),
                    RouteAttrs {
                        communities: vec![1, 2, 3],
                        large_communities: vec![[1, 2, 3]],
                        local_pref: None,
                        as_path_prepend: 0,
                        weight: None,
                    },
                )
            })
            .collect();
        let ups = diff(&AdjRibOut::new(), &new, P);
        assert_eq!(ups.iter().map(|u| u.announced.len()).sum::<usize>(), 5000);
        for u in &ups {
            encode(&Message::Update(u.clone())).expect("fits in 4096 bytes");
        }
        let ups = diff(&new, &AdjRibOut::new(), P);
        assert_eq!(ups.iter().map(|u| u.withdrawn.len()).sum::<usize>(), 5000);
        for u in &ups {
            encode(&Message::Update(u.clone())).expect("fits in 4096 bytes");
        }
    }

    fn attrs(communities: Vec<u32>, weight: Option<u32>) -> RouteAttrs {
        RouteAttrs {
            communities,
            large_communities: vec![[65001, 1, 2]],
            local_pref: None,
            as_path_prepend: 0,
            weight,
        }
    }

    fn ip6(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const NH6: Ipv6NextHop = Ipv6NextHop {
        global: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2),
        link_local: Some(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2)),
    };

    const DUAL: SessionParams = SessionParams {
        next_hop_v6: Some(NH6),
        families: Families::BOTH,
        ..P
    };

    fn dual_rib() -> AdjRibOut {
        [
            (ip4(192, 0, 2, 1), attrs(vec![7], Some(3))),
            (ip6("2001:db8:ffff::1"), attrs(vec![7], Some(3))),
            (ip6("2001:db8:ffff::2"), attrs(vec![8], None)),
        ]
        .into()
    }

    #[test]
    fn ipv6_vips_go_in_mp_reach_with_the_same_attributes_as_ipv4() {
        let ups = diff(&AdjRibOut::new(), &dual_rib(), DUAL);
        let v4: Vec<_> = ups.iter().filter(|u| !u.announced.is_empty()).collect();
        let v6: Vec<_> = ups.iter().filter(|u| u.mp_reach.is_some()).collect();
        assert_eq!((v4.len(), v6.len()), (1, 2));
        assert!(v4[0].mp_reach.is_none());
        assert_eq!(
            v4[0].attributes.as_ref().unwrap().next_hop,
            Ipv4Addr::new(10, 0, 0, 2)
        );
        let same = v6
            .iter()
            .find(|u| u.attributes.as_ref().unwrap().communities == vec![7])
            .unwrap();
        let (a4, a6) = (
            v4[0].attributes.clone().unwrap(),
            same.attributes.clone().unwrap(),
        );
        assert_eq!(
            PathAttributes {
                next_hop: Ipv4Addr::UNSPECIFIED,
                ..a4
            },
            a6,
            "communities, AS path, link bandwidth: as for IPv4"
        );
        let r = same.mp_reach.as_ref().unwrap();
        assert_eq!(r.family, AddressFamily::Ipv6Unicast);
        assert_eq!(r.next_hop, IpAddr::V6(NH6.global));
        assert_eq!(r.link_local, NH6.link_local);
        assert_eq!(
            r.announced,
            vec!["2001:db8:ffff::1/128".parse::<IpNet>().unwrap()]
        );
        // Every UPDATE encodes and decodes back to itself; IPv6-only ones carry no
        // NEXT_HOP (it decodes as 0.0.0.0).
        for u in &ups {
            let b = encode(&Message::Update(u.clone())).unwrap();
            let back = crate::wire::decode(&b, Default::default()).unwrap();
            assert_eq!(back, Message::Update(u.clone()));
        }
        // Withdrawals: IPv4 in the withdrawn routes, IPv6 in MP_UNREACH_NLRI.
        let ups = diff(&dual_rib(), &AdjRibOut::new(), DUAL);
        assert_eq!(ups.len(), 2);
        assert_eq!(
            ups[0].withdrawn,
            vec!["192.0.2.1/32".parse::<Ipv4Net>().unwrap()]
        );
        let un = ups[1].mp_unreach.as_ref().unwrap();
        assert_eq!(
            (un.family, un.withdrawn.len()),
            (AddressFamily::Ipv6Unicast, 2)
        );
        assert!(ups[1].attributes.is_none() && ups[1].withdrawn.is_empty());
    }

    #[test]
    fn an_ipv4_only_peer_is_never_sent_an_ipv6_route() {
        let v4_only = SessionParams {
            families: Families::IPV4,
            ..DUAL
        };
        let (out, withheld) = sendable(dual_rib(), &v4_only);
        assert_eq!(
            out.keys().copied().collect::<Vec<_>>(),
            vec![ip4(192, 0, 2, 1)]
        );
        assert_eq!(
            withheld,
            Withheld {
                family_not_negotiated: 2,
                no_next_hop: 0
            }
        );
        // Even handed the unfiltered table, diff sends no IPv6 (nor withdraws it).
        for ups in [
            diff(&AdjRibOut::new(), &dual_rib(), v4_only),
            diff(&dual_rib(), &AdjRibOut::new(), v4_only)
                .into_iter()
                .filter(|u| u.mp_unreach.is_none())
                .collect(),
        ] {
            assert!(ups.iter().all(|u| u.mp_reach.is_none()), "{ups:?}");
        }
        // Negotiated but no IPv6 address towards the peer: withheld, counted apart.
        let no_nh = SessionParams {
            next_hop_v6: None,
            ..DUAL
        };
        let (out, withheld) = sendable(dual_rib(), &no_nh);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (withheld.family_not_negotiated, withheld.no_next_hop),
            (0, 2)
        );
        // An IPv6-only peer gets no IPv4.
        let v6_only = SessionParams {
            families: Families::NONE.with(AddressFamily::Ipv6Unicast),
            ..DUAL
        };
        let (out, withheld) = sendable(dual_rib(), &v6_only);
        assert!(out.keys().all(IpAddr::is_ipv6));
        assert_eq!(withheld.family_not_negotiated, 1);
    }

    #[test]
    fn ipv4_over_an_ipv6_session_uses_the_extended_next_hop_only_if_negotiated() {
        let v6_transport = SessionParams {
            next_hop: None,
            extended_next_hop: true,
            ..DUAL
        };
        let ups = diff(&AdjRibOut::new(), &dual_rib(), v6_transport);
        let v4 = ups
            .iter()
            .find_map(|u| {
                u.mp_reach
                    .as_ref()
                    .filter(|r| r.family == AddressFamily::Ipv4Unicast)
            })
            .expect("IPv4 in MP_REACH_NLRI");
        assert_eq!(v4.next_hop, IpAddr::V6(NH6.global));
        assert!(ups.iter().all(|u| u.announced.is_empty()));
        let no_enh = SessionParams {
            extended_next_hop: false,
            ..v6_transport
        };
        assert_eq!(sendable(dual_rib(), &no_enh).1.no_next_hop, 1);
    }

    #[test]
    fn thousands_of_ipv6_vips_fit_in_legal_updates() {
        let new: AdjRibOut = (0..3000u128)
            .map(|i| {
                (
                    IpAddr::V6(Ipv6Addr::from(
                        0x2001_0db8_ffff_0000_0000_0000_0000_0000 + i,
                    )),
                    RouteAttrs {
                        communities: vec![1, 2, 3, crate::maintenance::GRACEFUL_SHUTDOWN],
                        large_communities: vec![[1, 2, 3]],
                        local_pref: None,
                        as_path_prepend: 3,
                        weight: Some(7),
                    },
                )
            })
            .collect();
        for (old, new) in [(&AdjRibOut::new(), &new), (&new, &AdjRibOut::new())] {
            let ups = diff(old, new, DUAL);
            let moved: usize = ups
                .iter()
                .map(|u| u.announced_count() + u.withdrawn_count())
                .sum();
            assert_eq!(moved, 3000);
            for u in &ups {
                let b = encode(&Message::Update(u.clone())).expect("fits in 4096 bytes");
                assert!(b.len() <= crate::wire::MAX_MESSAGE_LEN);
            }
        }
    }
}
