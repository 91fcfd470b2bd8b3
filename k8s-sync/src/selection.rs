//! Which objects select which: a label selector against an object's labels, the
//! AddressPools a Service's VIP may come from and in which order ([`pools_for_service`],
//! the controller's allocation), and the BGPAdvertisements that apply to one Service's
//! VIP ([`for_service`]). Pure; the advertisements part is used by the controller
//! (advertising nodes, `kubectl juneau why`) and the agent (what a node announces, with
//! which attributes), so both read the advertisements alike.
//!
//! The rule for a VIP of AddressPool P whose Service has labels L: the advertisements
//! covering P (`addressPools` empty or naming P) whose `serviceSelector` matches L; when
//! one of those has a `serviceSelector`, only the ones that have one apply (the most
//! specific win: a Service-specific advertisement replaces the pool's general ones for
//! that Service), otherwise the general ones. Node and peer selection then apply as
//! before, and the attributes of the advertisements that apply are merged (docs/k8s-sync.md,
//! "Per-Service attributes").

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};

use crate::crd::{BGPAdvertisementSpec, ServiceAllocation};

/// Whether `sel` selects an object with `labels`: no selector selects everything; a
/// selector that is not valid selects nothing.
pub fn selects(sel: Option<&LabelSelector>, labels: &BTreeMap<String, String>) -> bool {
    match sel {
        None => true,
        Some(s) => Selector::try_from(s.clone()).is_ok_and(|sel| sel.matches(labels)),
    }
}

/// Whether `adv` covers AddressPool `pool` (its `addressPools` empty or naming it).
pub fn covers_pool(adv: &BGPAdvertisementSpec, pool: &str) -> bool {
    adv.address_pools.is_empty() || adv.address_pools.iter().any(|p| p == pool)
}

/// The advertisements of `advs` that apply to the VIP of a Service with labels
/// `service_labels` in AddressPool `pool` (the rule in the module's documentation), in
/// their order.
pub fn for_service<'a>(
    advs: impl IntoIterator<Item = &'a BGPAdvertisementSpec>,
    pool: &str,
    service_labels: &BTreeMap<String, String>,
) -> Vec<&'a BGPAdvertisementSpec> {
    let mut matching: Vec<&BGPAdvertisementSpec> = advs
        .into_iter()
        .filter(|a| covers_pool(a, pool) && selects(a.service_selector.as_ref(), service_labels))
        .collect();
    if matching.iter().any(|a| a.service_selector.is_some()) {
        matching.retain(|a| a.service_selector.is_some());
    }
    matching
}

/// A Service as pool selection sees it: its namespace with that namespace's labels, and
/// its own labels.
#[derive(Debug, Clone, Copy)]
pub struct ServiceIdentity<'a> {
    /// Its namespace.
    pub namespace: &'a str,
    /// The labels of its namespace.
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// Its labels.
    pub labels: &'a BTreeMap<String, String>,
}

/// Whether a pool with `allocation` serves the Service `svc` (no serviceAllocation:
/// every Service).
pub fn pool_serves(allocation: Option<&ServiceAllocation>, svc: ServiceIdentity<'_>) -> bool {
    let Some(a) = allocation else {
        return true;
    };
    a.namespaces
        .as_ref()
        .is_none_or(|names| names.iter().any(|n| n == svc.namespace))
        && selects(a.namespace_selector.as_ref(), svc.namespace_labels)
        && selects(a.service_selector.as_ref(), svc.labels)
}

/// Of `pools` (name and serviceAllocation, in the ExternalNetwork's order), those that
/// serve `svc`, in the order its VIP is taken from them: pools with a priority (lowest
/// first), then pools with a serviceAllocation but no priority, then pools without one;
/// within each, the ExternalNetwork's order.
pub fn pools_for_service<'a>(
    pools: impl IntoIterator<Item = (&'a str, Option<&'a ServiceAllocation>)>,
    svc: ServiceIdentity<'_>,
) -> Vec<&'a str> {
    let mut serving: Vec<(usize, (u8, i32), &str)> = pools
        .into_iter()
        .enumerate()
        .filter(|(_, (_, a))| pool_serves(*a, svc))
        .map(|(i, (name, a))| {
            let rank = match a {
                Some(ServiceAllocation {
                    priority: Some(p), ..
                }) => (0, *p),
                Some(_) => (1, 0),
                None => (2, 0),
            };
            (i, rank, name)
        })
        .collect();
    serving.sort_by_key(|(i, rank, _)| (*rank, *i));
    serving.into_iter().map(|(_, _, name)| name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adv(pools: &[&str], service: Option<(&str, &str)>, community: &str) -> BGPAdvertisementSpec {
        BGPAdvertisementSpec {
            address_pools: pools.iter().map(|p| p.to_string()).collect(),
            service_selector: service.map(|(k, v)| LabelSelector {
                match_labels: Some([(k.to_string(), v.to_string())].into()),
                ..Default::default()
            }),
            communities: vec![community.into()],
            ..Default::default()
        }
    }

    fn communities(advs: &[&BGPAdvertisementSpec]) -> Vec<String> {
        advs.iter().map(|a| a.communities[0].clone()).collect()
    }

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_service_specific_advertisement_replaces_the_general_ones_for_its_services() {
        let advs = [
            adv(&["public"], None, "65000:1"),
            adv(&[], None, "65000:2"),
            adv(&["public"], Some(("tier", "gold")), "65000:100"),
            adv(&["other"], Some(("tier", "gold")), "65000:200"),
        ];
        let gold = labels(&[("tier", "gold"), ("app", "web")]);
        assert_eq!(
            communities(&for_service(&advs, "public", &gold)),
            ["65000:100"]
        );
        // Another Service of the pool, and a gold one in a pool with no specific one.
        let plain = labels(&[("app", "db")]);
        assert_eq!(
            communities(&for_service(&advs, "public", &plain)),
            ["65000:1", "65000:2"]
        );
        assert_eq!(
            communities(&for_service(&advs, "third", &gold)),
            ["65000:2"]
        );
        assert_eq!(
            communities(&for_service(&advs, "other", &gold)),
            ["65000:200"]
        );
        assert_eq!(
            communities(&for_service(&advs, "other", &plain)),
            ["65000:2"]
        );
        assert!(
            for_service(&advs[2..], "other", &plain).is_empty(),
            "none covers it"
        );
    }

    #[test]
    fn pools_serve_by_namespace_and_labels_in_priority_order() {
        let sel = |k: &str, v: &str| LabelSelector {
            match_labels: Some([(k.to_string(), v.to_string())].into()),
            ..Default::default()
        };
        let team_a = ServiceAllocation {
            namespaces: Some(vec!["team-a".into()]),
            priority: Some(20),
            ..Default::default()
        };
        let gold = ServiceAllocation {
            service_selector: Some(sel("tier", "gold")),
            priority: Some(10),
            ..Default::default()
        };
        let prod = ServiceAllocation {
            namespace_selector: Some(sel("env", "prod")),
            ..Default::default()
        };
        let pools = [
            ("general", None),
            ("team-a", Some(&team_a)),
            ("gold", Some(&gold)),
            ("prod", Some(&prod)),
        ];
        let who = |ns: &'static str, ns_labels: &'static BTreeMap<String, String>, labels| {
            pools_for_service(
                pools.iter().map(|(n, a)| (*n, *a)),
                ServiceIdentity {
                    namespace: ns,
                    namespace_labels: ns_labels,
                    labels,
                },
            )
        };
        let none: &'static BTreeMap<String, String> = Box::leak(Box::default());
        let prod_ns: &'static BTreeMap<String, String> =
            Box::leak(Box::new(labels(&[("env", "prod")])));
        let gold_svc = labels(&[("tier", "gold")]);
        assert_eq!(who("default", none, none), ["general"]);
        assert_eq!(who("team-a", none, none), ["team-a", "general"]);
        assert_eq!(
            who("team-a", none, &gold_svc),
            ["gold", "team-a", "general"]
        );
        assert_eq!(who("shop", prod_ns, none), ["prod", "general"]);
        assert_eq!(
            who("team-a", prod_ns, &gold_svc),
            ["gold", "team-a", "prod", "general"]
        );
    }

    #[test]
    fn an_invalid_selector_selects_nothing_and_no_selector_everything() {
        let bad = LabelSelector {
            match_expressions: Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: "tier".into(),
                    operator: "Between".into(),
                    values: None,
                },
            ]),
            ..Default::default()
        };
        assert!(!selects(Some(&bad), &labels(&[("tier", "gold")])));
        assert!(selects(None, &labels(&[])));
        let mut a = adv(&["public"], None, "65000:9");
        a.service_selector = Some(bad);
        let general = adv(&["public"], None, "65000:1");
        let advs = [a, general];
        assert_eq!(
            communities(&for_service(&advs, "public", &labels(&[("tier", "gold")]))),
            ["65000:1"],
            "an advertisement whose selector is invalid applies to no Service"
        );
    }
}
