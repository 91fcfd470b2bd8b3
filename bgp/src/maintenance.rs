//! Graceful maintenance (RFC 8326): while a peer's `drain` is set (the node is cordoned),
//! the VIPs are re-announced less preferred — the GRACEFUL_SHUTDOWN community, LOCAL_PREF
//! lowered for iBGP, our AS prepended for eBGP — so the routers move traffic to the other
//! nodes while this one still forwards; after `wait_seconds` they are withdrawn. Pure
//! functions; the peer task keeps the clock.

use std::time::Duration;

use juneau_control::model::DrainSettings;

use crate::rib::AdjRibOut;

/// GRACEFUL_SHUTDOWN well-known community 65535:0 (RFC 8326).
pub const GRACEFUL_SHUTDOWN: u32 = 0xFFFF_0000;

/// Where a drain stands after `elapsed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Announced less preferred; withdraw when `remaining` has passed.
    Depreferred {
        /// Time left before the withdrawal.
        remaining: Duration,
    },
    /// Withdrawn.
    Withdrawn,
}

/// The phase of a drain that started `elapsed` ago.
pub fn phase(d: &DrainSettings, elapsed: Duration) -> Phase {
    let wait = Duration::from_secs(u64::from(d.wait_seconds));
    if elapsed >= wait {
        Phase::Withdrawn
    } else {
        Phase::Depreferred {
            remaining: wait - elapsed,
        }
    }
}

/// What to announce instead of `desired` in `phase` of drain `d`.
pub fn apply(mut desired: AdjRibOut, d: &DrainSettings, phase: Phase) -> AdjRibOut {
    match phase {
        Phase::Withdrawn => AdjRibOut::new(),
        Phase::Depreferred { .. } => {
            for attrs in desired.values_mut() {
                if !attrs.communities.contains(&GRACEFUL_SHUTDOWN) {
                    attrs.communities.push(GRACEFUL_SHUTDOWN);
                }
                attrs.local_pref = Some(d.local_pref);
                attrs.as_path_prepend = d.as_path_prepend;
            }
            desired
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::Families;
    use crate::rib::{diff, RouteAttrs, SessionParams};
    use std::net::{IpAddr, Ipv4Addr};

    #[test]
    fn depreferred_then_withdrawn() {
        let d = DrainSettings {
            as_path_prepend: 2,
            local_pref: 0,
            wait_seconds: 10,
        };
        let vip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        let rib: AdjRibOut = [(
            vip,
            RouteAttrs {
                communities: vec![1],
                large_communities: vec![],
                local_pref: Some(150),
                as_path_prepend: 0,
                weight: None,
            },
        )]
        .into();
        let p = phase(&d, Duration::from_secs(3));
        assert_eq!(
            p,
            Phase::Depreferred {
                remaining: Duration::from_secs(7)
            }
        );
        let out = apply(rib.clone(), &d, p);
        assert_eq!(out[&vip].communities, vec![1, GRACEFUL_SHUTDOWN]);
        assert_eq!(out[&vip].local_pref, Some(0));
        let ebgp = SessionParams {
            local_asn: 65001,
            ibgp: false,
            next_hop: Some(Ipv4Addr::new(10, 0, 0, 2)),
            next_hop_v6: None,
            families: Families::IPV4,
            extended_next_hop: false,
        };
        let ups = diff(&rib, &out, ebgp);
        assert_eq!(ups.len(), 1, "re-announced in place, not withdrawn");
        let a = ups[0].attributes.as_ref().unwrap();
        assert_eq!(a.as_path, vec![65001, 65001, 65001]);
        assert!(ups[0].withdrawn.is_empty());
        let ibgp = SessionParams { ibgp: true, ..ebgp };
        let a = diff(&rib, &out, ibgp)[0].attributes.clone().unwrap();
        assert!(a.as_path.is_empty());
        assert_eq!(a.local_pref, Some(0));
        assert_eq!(phase(&d, Duration::from_secs(10)), Phase::Withdrawn);
        let gone = apply(rib.clone(), &d, Phase::Withdrawn);
        assert!(gone.is_empty());
        assert_eq!(diff(&out, &gone, ebgp)[0].withdrawn.len(), 1);
    }
}
