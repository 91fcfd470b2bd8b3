//! Which objects select which: a label selector against an object's labels, and the
//! BGPAdvertisements that apply to one Service's VIP. Pure; used by the controller
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

use crate::crd::BGPAdvertisementSpec;

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
