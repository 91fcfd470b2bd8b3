//! What to announce to a peer (Adj-RIB-Out) and the UPDATEs that move a peer from what it
//! has to what it should have. Pure functions, no I/O.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use juneau_control::model::{NodeState, Vip};

use crate::wire::{Origin, PathAttributes, Update};

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

/// VIP -> attributes, for one peer.
pub type AdjRibOut = BTreeMap<Vip, RouteAttrs>;

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

/// Session-dependent parts of the announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionParams {
    /// Our AS.
    pub local_asn: u32,
    /// Internal BGP (empty AS_PATH, LOCAL_PREF sent).
    pub ibgp: bool,
    /// NEXT_HOP.
    pub next_hop: Ipv4Addr,
}

/// Link bandwidth announced per Ready local backend: 1 Gbit/s, in bytes per second (the
/// unit of the link-bandwidth community). Only the ratio between nodes matters.
pub const BYTES_PER_SECOND_PER_BACKEND: u64 = 125_000_000;

/// Announcements per UPDATE (5 bytes each; well under the 4096-byte limit with attributes).
pub const NLRI_PER_UPDATE: usize = 500;
/// Withdrawals per UPDATE.
pub const WITHDRAWN_PER_UPDATE: usize = 700;

fn host(v: Vip) -> Ipv4Net {
    Ipv4Net::new(v, 32).expect("/32 is valid")
}

/// The UPDATEs that turn `old` into `new` at the peer: withdrawals first, then
/// announcements grouped by identical attributes.
pub fn diff(old: &AdjRibOut, new: &AdjRibOut, p: SessionParams) -> Vec<Update> {
    let mut out = Vec::new();
    let gone: Vec<Ipv4Net> = old
        .keys()
        .filter(|v| !new.contains_key(v))
        .map(|v| host(*v))
        .collect();
    for chunk in gone.chunks(WITHDRAWN_PER_UPDATE) {
        out.push(Update {
            withdrawn: chunk.to_vec(),
            attributes: None,
            announced: vec![],
        });
    }
    let mut groups: BTreeMap<&RouteAttrs, Vec<Ipv4Net>> = BTreeMap::new();
    for (vip, attrs) in new {
        if old.get(vip) != Some(attrs) {
            groups.entry(attrs).or_default().push(host(*vip));
        }
    }
    for (attrs, vips) in groups {
        let pa = PathAttributes {
            origin: Origin::Igp,
            as_path: if p.ibgp {
                vec![]
            } else {
                vec![p.local_asn; 1 + usize::from(attrs.as_path_prepend)]
            },
            next_hop: p.next_hop,
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
        };
        for chunk in vips.chunks(NLRI_PER_UPDATE) {
            out.push(Update {
                withdrawn: vec![],
                attributes: Some(pa.clone()),
                announced: chunk.to_vec(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{encode, Message};
    use juneau_control::model::{AdvertisedVip, PeerConfig};

    fn vip(v: [u8; 4], peers: Vec<u16>, comm: Vec<u32>) -> AdvertisedVip {
        AdvertisedVip {
            vip: Ipv4Addr::from(v),
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
        next_hop: Ipv4Addr::new(10, 0, 0, 2),
    };

    #[test]
    fn vips_go_only_to_their_peers() {
        let s = state();
        let a: Vec<_> = desired_for(&s, "tor-a").into_keys().collect();
        let b: Vec<_> = desired_for(&s, "tor-b").into_keys().collect();
        assert_eq!(
            a,
            vec![Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(192, 0, 2, 3)]
        );
        assert_eq!(
            b,
            vec![Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(192, 0, 2, 2)]
        );
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
        fewer.remove(&Ipv4Addr::new(192, 0, 2, 1));
        let ups = diff(&new, &fewer, P);
        assert_eq!(
            ups,
            vec![Update {
                withdrawn: vec!["192.0.2.1/32".parse().unwrap()],
                attributes: None,
                announced: vec![]
            }]
        );
        // A changed community re-announces just that VIP.
        let mut changed = new.clone();
        changed
            .get_mut(&Ipv4Addr::new(192, 0, 2, 3))
            .unwrap()
            .communities = vec![8];
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
                    Ipv4Addr::from(0xc633_0000 + i),
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
}
