//! Which IP families a Service's VIPs are of, and which of them Juneau serves: pure
//! functions of the Service's `spec.ipFamilyPolicy` and `spec.ipFamilies`, of whether
//! the dataplane serves IPv6 ([`DATAPLANE_SERVES_IPV6`]) and of which families the
//! ExternalNetwork's AddressPools hold.
//!
//! A Service gets one VIP per family it is served on, in the order of `spec.ipFamilies`
//! (the ClusterIPs' order, which the apiserver sets). The VIP of a family DNATs to the
//! Service's endpoints of that family: Juneau never translates between families.

use juneau_control::ipam::Family;
use k8s_openapi::api::core::v1::ServiceSpec;

/// Whether the dataplane serves IPv6 VIPs. The one switch for IPv6 in the controller:
/// on since the dataplane serves IPv6 end to end and the lab's dual-stack walk proves it
/// in a cluster (tests/tests/lab_e2e.rs). Off, no IPv6 VIP would be allocated or shown; a
/// Service asking for IPv6 would get the `IPv6NotSupported` condition and be served on
/// IPv4 (PreferDualStack) or not at all (SingleStack IPv6, RequireDualStack).
pub const DATAPLANE_SERVES_IPV6: bool = true;

/// Reason of the condition a family the dataplane cannot serve gets.
pub const IPV6_NOT_SUPPORTED: &str = "IPv6NotSupported";
/// Reason of the condition a family no AddressPool of the network holds gets.
pub const NO_POOL_FOR_FAMILY: &str = "NoAddressPoolForFamily";

/// A Service's `spec.ipFamilyPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// One family (the default).
    SingleStack,
    /// Both families where the cluster has both; one is enough.
    PreferDualStack,
    /// Both families or nothing.
    RequireDualStack,
}

impl Policy {
    fn as_str(self) -> &'static str {
        match self {
            Policy::SingleStack => "SingleStack",
            Policy::PreferDualStack => "PreferDualStack",
            Policy::RequireDualStack => "RequireDualStack",
        }
    }
}

/// The families a Service asks for, in order, and its policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// `spec.ipFamilyPolicy`.
    pub policy: Policy,
    /// The families, first = primary (one or two, no repeat).
    pub families: Vec<Family>,
}

impl Wanted {
    /// True for a plain IPv4 single-stack Service (what Juneau served before IPv6).
    pub fn is_ipv4_only(&self) -> bool {
        self.families == [Family::V4]
    }
}

/// A Service's family fields Juneau cannot read. The apiserver refuses all of these,
/// so only a Service written past it (or a future field value) shows one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FamiliesError {
    /// `spec.ipFamilyPolicy` is not one of the three policies.
    #[error("ipFamilyPolicy {0:?} is not SingleStack, PreferDualStack or RequireDualStack")]
    UnknownPolicy(String),
    /// An `spec.ipFamilies` entry is neither IPv4 nor IPv6.
    #[error("ipFamilies lists {0:?}, which is neither IPv4 nor IPv6")]
    UnknownFamily(String),
    /// A family listed twice, or more than two.
    #[error("ipFamilies is [{0}]: list each family at most once")]
    Repeated(String),
    /// SingleStack with two families.
    #[error("ipFamilyPolicy is SingleStack but ipFamilies is [{0}]: list one family")]
    TwoForSingleStack(String),
}

/// The families the Service asks for. Unset policy: SingleStack; unset families (the
/// apiserver always sets them; a test or an old object may not): `[IPv4]`, or
/// `[IPv4, IPv6]` for a dual-stack policy. RequireDualStack with one family listed asks
/// for the other one second; PreferDualStack with one family (a single-stack cluster)
/// asks for that one only: the Service's endpoints are of that family.
pub fn wanted(spec: Option<&ServiceSpec>) -> Result<Wanted, FamiliesError> {
    let policy = match spec.and_then(|s| s.ip_family_policy.as_deref()) {
        None | Some("SingleStack") => Policy::SingleStack,
        Some("PreferDualStack") => Policy::PreferDualStack,
        Some("RequireDualStack") => Policy::RequireDualStack,
        Some(other) => return Err(FamiliesError::UnknownPolicy(other.to_string())),
    };
    let listed: &[String] = spec
        .and_then(|s| s.ip_families.as_deref())
        .unwrap_or_default();
    let joined = || listed.join(", ");
    let mut families = Vec::with_capacity(2);
    for f in listed {
        let family = Family::from_k8s(f).ok_or_else(|| FamiliesError::UnknownFamily(f.clone()))?;
        if families.contains(&family) {
            return Err(FamiliesError::Repeated(joined()));
        }
        families.push(family);
    }
    match (policy, families.len()) {
        (Policy::SingleStack, 0) => families.push(Family::V4),
        (Policy::SingleStack, 2) => return Err(FamiliesError::TwoForSingleStack(joined())),
        (_, 0) => families = vec![Family::V4, Family::V6],
        (Policy::RequireDualStack, 1) => families.push(other(families[0])),
        _ => {}
    }
    Ok(Wanted { policy, families })
}

fn other(f: Family) -> Family {
    match f {
        Family::V4 => Family::V6,
        Family::V6 => Family::V4,
    }
}

/// Why a wanted family is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// The family.
    pub family: Family,
    /// [`IPV6_NOT_SUPPORTED`] or [`NO_POOL_FOR_FAMILY`].
    pub reason: &'static str,
    /// Plain words, including what happens to the Service.
    pub message: String,
}

/// Which families are served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The families served, in the Service's order (empty when refused).
    pub serve: Vec<Family>,
    /// Families wanted but not served while others are (PreferDualStack): a warning.
    pub dropped: Vec<Gap>,
    /// Why nothing is served (SingleStack of an unserved family, RequireDualStack with
    /// one family unserved, PreferDualStack with none served).
    pub refused: Option<Gap>,
}

/// Which of the `wanted` families are served: a family is served when the dataplane
/// serves it (`serves_v6` for IPv6: [`DATAPLANE_SERVES_IPV6`]) and `has_pool(family)`
/// (an AddressPool of the network holds an address of the family). Nothing is ever
/// half-served against the policy: RequireDualStack is both families or none.
pub fn plan(wanted: &Wanted, serves_v6: bool, has_pool: impl Fn(Family) -> bool) -> Plan {
    let gap = |f: Family| -> Option<(&'static str, String)> {
        if f == Family::V6 && !serves_v6 {
            Some((
                IPV6_NOT_SUPPORTED,
                "the dataplane does not serve IPv6 yet".to_string(),
            ))
        } else if !has_pool(f) {
            Some((
                NO_POOL_FOR_FAMILY,
                format!("no AddressPool of the ExternalNetwork holds an {f} address"),
            ))
        } else {
            None
        }
    };
    let mut serve = Vec::new();
    let mut gaps = Vec::new();
    for &f in &wanted.families {
        match gap(f) {
            None => serve.push(f),
            Some((reason, why)) => gaps.push((f, reason, why)),
        }
    }
    let families = wanted
        .families
        .iter()
        .map(|f| f.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let policy = wanted.policy.as_str();
    let Some((f, reason, why)) = gaps.first().cloned() else {
        return Plan {
            serve,
            dropped: Vec::new(),
            refused: None,
        };
    };
    if wanted.policy == Policy::PreferDualStack && !serve.is_empty() {
        let served = serve
            .iter()
            .map(|f| f.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let dropped = gaps
            .into_iter()
            .map(|(family, reason, why)| Gap {
                family,
                reason,
                message: format!(
                    "ipFamilyPolicy is PreferDualStack: served on {served} only, not on {family}: {why}"
                ),
            })
            .collect();
        return Plan {
            serve,
            dropped,
            refused: None,
        };
    }
    let hint = match (wanted.policy, reason) {
        (Policy::RequireDualStack, IPV6_NOT_SUPPORTED) => {
            "; use ipFamilyPolicy: PreferDualStack to be served on IPv4 meanwhile"
        }
        (Policy::SingleStack, IPV6_NOT_SUPPORTED) => {
            "; set ipFamilies: [IPv4], or ipFamilyPolicy: PreferDualStack to be served on IPv4"
        }
        _ => "",
    };
    Plan {
        serve: Vec::new(),
        dropped: Vec::new(),
        refused: Some(Gap {
            family: f,
            reason,
            message: format!(
                "ipFamilyPolicy is {policy} with ipFamilies [{families}]: {why}, so nothing is served{hint}"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Family::{V4, V6};

    fn spec(policy: Option<&str>, families: &[&str]) -> ServiceSpec {
        ServiceSpec {
            ip_family_policy: policy.map(String::from),
            ip_families: (!families.is_empty())
                .then(|| families.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        }
    }

    /// Every policy (and none) against every list of families (and none).
    #[test]
    fn wanted_for_every_policy_and_families() {
        use FamiliesError::*;
        let single = Policy::SingleStack;
        let prefer = Policy::PreferDualStack;
        let require = Policy::RequireDualStack;
        let ok = |policy, families: &[Family]| {
            Ok(Wanted {
                policy,
                families: families.to_vec(),
            })
        };
        type Case<'a> = (
            Option<&'a str>,
            &'a [&'a str],
            Result<Wanted, FamiliesError>,
        );
        let cases: Vec<Case<'_>> = vec![
            (None, &[], ok(single, &[V4])),
            (None, &["IPv4"], ok(single, &[V4])),
            (None, &["IPv6"], ok(single, &[V6])),
            (
                None,
                &["IPv4", "IPv6"],
                Err(TwoForSingleStack("IPv4, IPv6".into())),
            ),
            (Some("SingleStack"), &[], ok(single, &[V4])),
            (Some("SingleStack"), &["IPv4"], ok(single, &[V4])),
            (Some("SingleStack"), &["IPv6"], ok(single, &[V6])),
            (
                Some("SingleStack"),
                &["IPv6", "IPv4"],
                Err(TwoForSingleStack("IPv6, IPv4".into())),
            ),
            (Some("PreferDualStack"), &[], ok(prefer, &[V4, V6])),
            (Some("PreferDualStack"), &["IPv4"], ok(prefer, &[V4])),
            (Some("PreferDualStack"), &["IPv6"], ok(prefer, &[V6])),
            (
                Some("PreferDualStack"),
                &["IPv4", "IPv6"],
                ok(prefer, &[V4, V6]),
            ),
            (
                Some("PreferDualStack"),
                &["IPv6", "IPv4"],
                ok(prefer, &[V6, V4]),
            ),
            (Some("RequireDualStack"), &[], ok(require, &[V4, V6])),
            (Some("RequireDualStack"), &["IPv4"], ok(require, &[V4, V6])),
            (Some("RequireDualStack"), &["IPv6"], ok(require, &[V6, V4])),
            (
                Some("RequireDualStack"),
                &["IPv4", "IPv6"],
                ok(require, &[V4, V6]),
            ),
            (
                Some("RequireDualStack"),
                &["IPv6", "IPv4"],
                ok(require, &[V6, V4]),
            ),
            (
                Some("RequireDualStack"),
                &["IPv4", "IPv4"],
                Err(Repeated("IPv4, IPv4".into())),
            ),
            (
                Some("PreferDualStack"),
                &["IPv4", "IPv6", "IPv4"],
                Err(Repeated("IPv4, IPv6, IPv4".into())),
            ),
            (Some("Dual"), &["IPv4"], Err(UnknownPolicy("Dual".into()))),
            (None, &["ipv4"], Err(UnknownFamily("ipv4".into()))),
        ];
        for (policy, families, want) in cases {
            assert_eq!(
                wanted(Some(&spec(policy, families))),
                want,
                "{policy:?} {families:?}"
            );
        }
        assert_eq!(wanted(None), ok(single, &[V4]));
        assert!(wanted(None).unwrap().is_ipv4_only());
    }

    fn w(policy: Policy, families: &[Family]) -> Wanted {
        Wanted {
            policy,
            families: families.to_vec(),
        }
    }

    #[test]
    fn the_switch_off_serves_ipv4_only_and_never_half_serves() {
        let all = |_: Family| true;
        // PreferDualStack: IPv4 served, first or second, with IPv6 as a warning.
        for fams in [[V4, V6], [V6, V4]] {
            let p = plan(&w(Policy::PreferDualStack, &fams), false, all);
            assert_eq!(p.serve, vec![V4]);
            assert_eq!(p.refused, None);
            assert_eq!(p.dropped.len(), 1);
            assert_eq!(p.dropped[0].family, V6);
            assert_eq!(p.dropped[0].reason, IPV6_NOT_SUPPORTED);
            assert!(
                p.dropped[0]
                    .message
                    .contains("the dataplane does not serve IPv6 yet")
                    && p.dropped[0].message.contains("served on IPv4 only"),
                "{}",
                p.dropped[0].message
            );
        }
        // RequireDualStack, SingleStack IPv6, PreferDualStack IPv6 alone: refused.
        for wanted in [
            w(Policy::RequireDualStack, &[V4, V6]),
            w(Policy::RequireDualStack, &[V6, V4]),
            w(Policy::SingleStack, &[V6]),
            w(Policy::PreferDualStack, &[V6]),
        ] {
            let p = plan(&wanted, false, all);
            assert!(p.serve.is_empty(), "{wanted:?}");
            let r = p.refused.expect("refused");
            assert_eq!(r.reason, IPV6_NOT_SUPPORTED);
            assert!(
                r.message.contains("the dataplane does not serve IPv6 yet")
                    && r.message.contains("nothing is served"),
                "{}",
                r.message
            );
        }
        // IPv4 single stack: as before.
        let p = plan(&w(Policy::SingleStack, &[V4]), false, all);
        assert_eq!((p.serve, p.dropped, p.refused), (vec![V4], vec![], None));
    }

    #[test]
    fn the_switch_on_serves_both_in_order_unless_a_pool_is_missing() {
        let all = |_: Family| true;
        for fams in [[V4, V6], [V6, V4]] {
            for policy in [Policy::PreferDualStack, Policy::RequireDualStack] {
                let p = plan(&w(policy, &fams), true, all);
                assert_eq!(
                    (p.serve, p.dropped, p.refused),
                    (fams.to_vec(), vec![], None)
                );
            }
        }
        let p = plan(&w(Policy::SingleStack, &[V6]), true, all);
        assert_eq!(p.serve, vec![V6]);
        // No IPv6 pool: PreferDualStack is served on IPv4 with a warning,
        // RequireDualStack and SingleStack IPv6 are refused.
        let v4_only = |f: Family| f == V4;
        let p = plan(&w(Policy::PreferDualStack, &[V6, V4]), true, v4_only);
        assert_eq!(p.serve, vec![V4]);
        assert_eq!(p.dropped[0].reason, NO_POOL_FOR_FAMILY);
        assert!(p.dropped[0].message.contains("holds an IPv6 address"));
        for wanted in [
            w(Policy::RequireDualStack, &[V4, V6]),
            w(Policy::SingleStack, &[V6]),
        ] {
            let p = plan(&wanted, true, v4_only);
            assert!(p.serve.is_empty());
            assert_eq!(p.refused.unwrap().reason, NO_POOL_FOR_FAMILY);
        }
        // No IPv4 pool either way round.
        let v6_only = |f: Family| f == V6;
        let p = plan(&w(Policy::PreferDualStack, &[V4, V6]), true, v6_only);
        assert_eq!(p.serve, vec![V6]);
        assert_eq!(p.dropped[0].family, V4);
        let p = plan(&w(Policy::SingleStack, &[V4]), true, v6_only);
        assert_eq!(p.refused.unwrap().family, V4);
        // No pool of either family.
        let p = plan(&w(Policy::PreferDualStack, &[V4, V6]), true, |_| false);
        assert!(p.serve.is_empty());
        assert_eq!(p.refused.unwrap().family, V4);
    }
}
