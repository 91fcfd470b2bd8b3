//! What `kubectl juneau status | pools | why | peers` print, as pure functions of the API
//! objects (so they are unit-tested without a cluster). Every report is a serializable
//! value (for `--output json|yaml`) with a plain-text table rendering.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Serialize;

use crate::crd::{AddressPool, Phase, ServiceLoadBalancer};
use crate::endpoints::{node_excluded, slice_endpoints};
use crate::pools;
use crate::reconcile::{advertisement_covers, World};
use crate::vips::VipBook;

/// One row of `kubectl juneau status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusRow {
    /// Service namespace.
    pub namespace: String,
    /// Service name.
    pub service: String,
    /// The VIP, if allocated (a dual-stack Service's two, comma-separated, in its
    /// family order).
    pub vip: Option<String>,
    /// Ready / Pending / Failed.
    pub phase: String,
    /// The AddressPool the VIP came from.
    pub pool: Option<String>,
    /// Nodes announcing the VIP.
    pub advertising_nodes: Vec<String>,
    /// The first failing condition's reason (empty when Ready).
    pub reason: String,
}

/// `kubectl juneau status`: every Juneau Service, by namespace and name.
pub fn status_rows(slbs: &[ServiceLoadBalancer]) -> Vec<StatusRow> {
    let mut rows: Vec<StatusRow> = slbs
        .iter()
        .map(|s| {
            let st = s.status.clone().unwrap_or_default();
            let reason = if st.phase == Phase::Ready {
                String::new()
            } else {
                st.conditions
                    .iter()
                    .find(|c| c.type_ == "Ready")
                    .map(|c| c.reason.clone())
                    .unwrap_or_default()
            };
            StatusRow {
                namespace: s.metadata.namespace.clone().unwrap_or_default(),
                service: s.metadata.name.clone().unwrap_or_default(),
                vip: if st.vips.len() > 1 {
                    Some(
                        st.vips
                            .iter()
                            .map(|v| v.ip.as_str())
                            .collect::<Vec<_>>()
                            .join(","),
                    )
                } else {
                    st.vip
                },
                phase: st.phase.to_string(),
                pool: st.address_pool,
                advertising_nodes: st.advertising_nodes,
                reason,
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.service).cmp(&(&b.namespace, &b.service)));
    rows
}

/// One row of `kubectl juneau pools`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolRow {
    /// AddressPool name.
    pub pool: String,
    /// Addresses it hands out.
    pub total: u64,
    /// Addresses held by a Service.
    pub allocated: u64,
    /// Addresses still free.
    pub free: u64,
    /// Percentage in use (0 when the pool is empty).
    pub used_percent: u64,
    /// Other pools sharing addresses with this one.
    pub overlaps_with: Vec<String>,
    /// Why the addresses do not parse, if they do not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
    /// Hands out addresses to Services that ask for none (`autoAssign`).
    pub auto_assign: bool,
    /// Which Services it serves (`serviceAllocation`, in words; `all` without one).
    pub serves: String,
    /// The Services holding one of its addresses (`namespace/name`), sorted.
    pub services: Vec<String>,
}

/// `kubectl juneau pools`: usage computed from the pools and the VIPs the
/// ServiceLoadBalancers record (so it is right even before the controller reports).
pub fn pool_rows(pool_objs: &[AddressPool], slbs: &[ServiceLoadBalancer]) -> Vec<PoolRow> {
    let specs = pool_objs
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p.spec.clone()))
        .collect();
    let mut book = VipBook::default();
    let mut served: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for s in slbs {
        let vip = s.status.as_ref().and_then(|st| st.vip.as_deref());
        if let Some(v) = vip.and_then(|v| v.parse().ok()) {
            let key = format!(
                "{}/{}",
                s.metadata.namespace.as_deref().unwrap_or_default(),
                s.metadata.name.as_deref().unwrap_or_default()
            );
            book.restore(v, &key);
            if let Some(pool) = s.status.as_ref().and_then(|st| st.address_pool.clone()) {
                served.entry(pool).or_default().push(key);
            }
        }
    }
    let auto_assign: BTreeMap<&str, bool> = pool_objs
        .iter()
        .map(|p| {
            (
                p.metadata.name.as_deref().unwrap_or_default(),
                p.spec.auto_assign != Some(false),
            )
        })
        .collect();
    let serves: BTreeMap<&str, String> = pool_objs
        .iter()
        .map(|p| {
            (
                p.metadata.name.as_deref().unwrap_or_default(),
                allocation_summary(p.spec.service_allocation.as_ref()),
            )
        })
        .collect();
    pools::report(&specs, &book)
        .into_iter()
        .map(|(pool, r)| {
            let mut services = served.remove(&pool).unwrap_or_default();
            services.sort();
            let mut overlaps_with: Vec<String> =
                r.overlaps.iter().map(|(p, _)| p.clone()).collect();
            overlaps_with.dedup();
            PoolRow {
                total: r.total,
                allocated: r.allocated,
                free: r.total.saturating_sub(r.allocated),
                used_percent: (r.allocated * 100).checked_div(r.total).unwrap_or(0),
                overlaps_with,
                invalid: r.invalid,
                auto_assign: auto_assign.get(pool.as_str()).copied().unwrap_or(true),
                serves: serves
                    .get(pool.as_str())
                    .cloned()
                    .unwrap_or_else(|| "all".into()),
                services,
                pool,
            }
        })
        .collect()
}

/// A pool's `serviceAllocation` in a few words: `all` (none), else its parts, e.g.
/// `priority 1, namespaces team-a, namespaces env=prod, services tier=gold`.
fn allocation_summary(a: Option<&crate::crd::ServiceAllocation>) -> String {
    let Some(a) = a else {
        return "all".into();
    };
    let selector = |s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector| {
        let mut parts: Vec<String> = s
            .match_labels
            .iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        parts.extend(s.match_expressions.iter().flatten().map(|e| {
            format!(
                "{} {} ({})",
                e.key,
                e.operator,
                e.values.clone().unwrap_or_default().join(" ")
            )
        }));
        parts.join(" ")
    };
    let mut parts = Vec::new();
    if let Some(p) = a.priority {
        parts.push(format!("priority {p}"));
    }
    if let Some(n) = &a.namespaces {
        parts.push(format!("namespaces {}", n.join(" ")));
    }
    if let Some(s) = &a.namespace_selector {
        parts.push(format!("namespaces {}", selector(s)));
    }
    if let Some(s) = &a.service_selector {
        parts.push(format!("services {}", selector(s)));
    }
    if parts.is_empty() {
        "all".into()
    } else {
        parts.join(", ")
    }
}

/// Per-node verdict of `kubectl juneau why SERVICE`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeVerdict {
    /// Node name.
    pub node: String,
    /// True when the node announces the VIP.
    pub advertising: bool,
    /// CamelCase reason.
    pub reason: String,
    /// Plain words.
    pub message: String,
}

/// `kubectl juneau why SERVICE`: the Service's phase and every node's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Why {
    /// `namespace/name`.
    pub service: String,
    /// The VIP, if allocated.
    pub vip: Option<String>,
    /// Ready / Pending / Failed.
    pub phase: String,
    /// Why the Service as a whole is not served (empty when it is).
    pub service_problems: Vec<String>,
    /// One verdict per node.
    pub nodes: Vec<NodeVerdict>,
    /// What this report cannot see yet.
    pub not_checked: Vec<String>,
}

/// What is not visible through the API today (said, rather than guessed).
pub const NOT_IN_API: &str = "whether each node's dataplane has programmed the VIP and whether its BGP sessions are up: the node processes do not report these to the API yet (see their /metrics)";

/// Builds the `why` report from the record, the Service's labels (which
/// BGPAdvertisements apply to it), its EndpointSlices and the world.
pub fn why(
    slb: &ServiceLoadBalancer,
    service_labels: &BTreeMap<String, String>,
    slices: &[EndpointSlice],
    world: &World,
) -> Why {
    let st = slb.status.clone().unwrap_or_default();
    let key = format!(
        "{}/{}",
        slb.metadata.namespace.as_deref().unwrap_or_default(),
        slb.metadata.name.as_deref().unwrap_or_default()
    );
    let service_problems: Vec<String> = st
        .conditions
        .iter()
        .filter(|c| c.status == "False" && c.type_ != "Ready" && c.type_ != "Advertised")
        .map(|c| format!("{}: {}", c.reason, c.message))
        .collect();
    let eps = slice_endpoints(slices.iter());
    let served = st.vip.is_some() && st.phase != Phase::Failed && service_problems.is_empty();
    let pool = st.address_pool.clone().unwrap_or_default();
    let mut nodes = Vec::new();
    for (name, node) in &world.nodes {
        let local: Vec<_> = eps
            .iter()
            .filter(|e| e.node.as_deref() == Some(name))
            .collect();
        let ready = local
            .iter()
            .filter(|e| e.conditions.ready && !e.conditions.terminating)
            .count();
        let advertising = st.advertising_nodes.iter().any(|n| n == name);
        let (reason, message) = if advertising && ready == 0 {
            // Only the Cluster policy announces from a node without a Ready backend.
            (
                "AdvertisingForCluster",
                "announces the VIP without a Ready local backend (externalTrafficPolicy: Cluster): hands each new connection and UDP flow, unchanged, to a node that has one (weighed by its Ready endpoints); that node answers the client, whose address the Pod sees".to_string(),
            )
        } else if advertising {
            (
                "Advertising",
                format!("announces the VIP: {ready} Ready local backend(s)"),
            )
        } else if !served {
            (
                "ServiceNotServed",
                "the Service itself is not served (see the problems above)".to_string(),
            )
        } else if node_excluded(node) {
            (
                "ExcludedByLabel",
                "the node is labelled node.kubernetes.io/exclude-from-external-load-balancers"
                    .to_string(),
            )
        } else if local.is_empty() {
            (
                "NoLocalBackend",
                "no backend of the Service runs on this node".to_string(),
            )
        } else if ready == 0 {
            let term = local.iter().filter(|e| e.conditions.terminating).count();
            (
                "NoReadyLocalBackend",
                format!(
                    "{} local backend(s), none Ready and not terminating ({term} terminating)",
                    local.len()
                ),
            )
        } else if !advertisement_covers(world, &pool, service_labels, name) {
            (
                "NoBGPAdvertisement",
                format!("no BGPAdvertisement that applies to the Service (AddressPool {pool:?}) selects this node"),
            )
        } else {
            (
                "NotYetReconciled",
                format!(
                    "{ready} Ready local backend(s); the controller has not recorded this node yet"
                ),
            )
        };
        nodes.push(NodeVerdict {
            node: name.clone(),
            advertising,
            reason: reason.into(),
            message,
        });
    }
    Why {
        service: key,
        vip: st.vip,
        phase: st.phase.to_string(),
        service_problems,
        nodes,
        not_checked: vec![NOT_IN_API.into()],
    }
}

/// Refines a [`why`] report with the records of the Services that share its VIP
/// (`siblings`: the namespace's other ServiceLoadBalancers; only those served on the
/// same VIP count): a node that does not announce it for this Service but does for a
/// sibling announces it all the same, and hands this Service's connections on.
pub fn refine_why_for_shared_vip(r: &mut Why, siblings: &[ServiceLoadBalancer]) {
    let Some(vip) = r.vip.as_deref() else {
        return;
    };
    for v in r.nodes.iter_mut().filter(|v| !v.advertising) {
        let by: Vec<&str> = siblings
            .iter()
            .filter_map(|s| {
                let st = s.status.as_ref()?;
                let here = st.vip.as_deref() == Some(vip)
                    && st.phase != Phase::Failed
                    && st.advertising_nodes.contains(&v.node);
                here.then_some(s.metadata.name.as_deref()?)
            })
            .collect();
        if by.is_empty() || v.reason == "ServiceNotServed" {
            continue;
        }
        v.advertising = true;
        v.reason = "AdvertisingForSharedVIP".into();
        v.message = format!(
            "announces the VIP for {} (same allow-shared-ip key), with no Ready backend of this Service: hands each new TCP connection and UDP flow to its ports, unchanged, to a node that has one",
            by.join(", ")
        );
    }
}

/// Nodes by name, for [`World`].
pub fn node_map(nodes: Vec<Node>) -> BTreeMap<String, Node> {
    nodes
        .into_iter()
        .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
        .collect()
}

/// A plain table: header plus rows, columns padded to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.len());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}   ", width = w[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{
        AddressPoolSpec, AdvertiseMode, BGPAdvertisementSpec, ServiceLoadBalancerStatus,
    };
    use crate::endpoints::testutil::{node, slice};
    use kube::api::ObjectMeta;

    fn slb(name: &str, vip: Option<&str>, phase: Phase, adv: &[&str]) -> ServiceLoadBalancer {
        ServiceLoadBalancer {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Default::default(),
            status: Some(ServiceLoadBalancerStatus {
                vip: vip.map(String::from),
                address_pool: Some("p".into()),
                phase,
                advertising_nodes: adv.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn why_names_the_precise_reason_per_node() {
        let mut w = World {
            nodes: [
                node("a", "192.168.0.1", false),
                node("b", "192.168.0.2", false),
                node("c", "192.168.0.3", true),
                node("d", "192.168.0.4", false),
                node("e", "192.168.0.5", false),
            ]
            .into(),
            ..Default::default()
        };
        w.nodes
            .get_mut("e")
            .unwrap()
            .metadata
            .labels
            .get_or_insert_default()
            .insert("role".into(), "quiet".into());
        w.advertisements = vec![BGPAdvertisementSpec {
            address_pools: vec!["p".into()],
            service_selector: None,
            peer_selector: None,
            node_selector: Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                    match_expressions: Some(vec![
                        k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                            key: "role".into(),
                            operator: "NotIn".into(),
                            values: Some(vec!["quiet".into()]),
                        },
                    ]),
                    match_labels: None,
                },
            ),
            communities: vec![],
            large_communities: vec![],
            local_pref: None,
            weighted_by_backends: None,
        }];
        let sl = slice(
            "web",
            "web-1",
            &[
                ("10.0.0.1", "a", true, false),
                ("10.0.0.2", "b", false, false),
                ("10.0.0.3", "c", true, false),
                ("10.0.0.5", "e", true, false),
            ],
            ("http", 80),
        );
        let r = why(
            &slb("web", Some("203.0.113.1"), Phase::Ready, &["a"]),
            &BTreeMap::new(),
            std::slice::from_ref(&sl),
            &w,
        );
        let by: BTreeMap<_, _> = r
            .nodes
            .iter()
            .map(|v| (v.node.as_str(), v.reason.as_str()))
            .collect();
        assert_eq!(by["a"], "Advertising");
        assert_eq!(by["b"], "NoReadyLocalBackend");
        assert_eq!(by["c"], "ExcludedByLabel");
        assert_eq!(by["d"], "NoLocalBackend");
        assert_eq!(by["e"], "NoBGPAdvertisement", "{r:?}");
        assert!(!r.not_checked.is_empty());
        // Cluster policy: the controller lists d, which has no backend, as advertising.
        let r = why(
            &slb("web", Some("203.0.113.1"), Phase::Ready, &["a", "d"]),
            &BTreeMap::new(),
            &[sl],
            &w,
        );
        let d = r.nodes.iter().find(|v| v.node == "d").unwrap();
        assert_eq!(d.reason, "AdvertisingForCluster");
        assert!(d.advertising && d.message.contains("hands each new connection"));
    }

    #[test]
    fn a_node_announcing_a_shared_vip_for_a_sibling_says_so() {
        let w = World {
            nodes: [
                node("a", "192.168.0.1", false),
                node("d", "192.168.0.4", false),
            ]
            .into(),
            ..Default::default()
        };
        let sl = slice(
            "web",
            "web-1",
            &[("10.0.0.1", "a", true, false)],
            ("http", 80),
        );
        let mut r = why(
            &slb("web", Some("203.0.113.1"), Phase::Ready, &["a"]),
            &BTreeMap::new(),
            &[sl],
            &w,
        );
        let siblings = [
            slb("admin", Some("203.0.113.1"), Phase::Ready, &["d"]),
            slb("other", Some("203.0.113.9"), Phase::Ready, &["a", "d"]),
            slb("broken", Some("203.0.113.1"), Phase::Failed, &["a", "d"]),
        ];
        refine_why_for_shared_vip(&mut r, &siblings);
        let d = r.nodes.iter().find(|v| v.node == "d").unwrap();
        assert_eq!(d.reason, "AdvertisingForSharedVIP");
        assert!(d.advertising && d.message.contains("for admin"), "{d:?}");
        assert!(!d.message.contains("other") && !d.message.contains("broken"));
        let a = r.nodes.iter().find(|v| v.node == "a").unwrap();
        assert_eq!(a.reason, "Advertising", "its own Pods: unchanged");
    }

    #[test]
    fn pools_and_status_rows() {
        let pool = |n: &str, a: &str| {
            AddressPool::new(
                n,
                AddressPoolSpec {
                    advertise_mode: AdvertiseMode::bgp(),
                    addresses: vec![a.into()],
                    allow_network_and_broadcast: None,
                    auto_assign: None,
                    service_allocation: None,
                },
            )
        };
        let slbs = vec![
            slb("b", Some("198.18.0.1"), Phase::Ready, &["n1"]),
            slb("a", None, Phase::Pending, &[]),
        ];
        let rows = pool_rows(
            &[pool("p", "198.18.0.0/30"), pool("q", "198.18.0.0/29")],
            &slbs,
        );
        assert_eq!(rows[0].pool, "p");
        assert_eq!(
            (
                rows[0].total,
                rows[0].allocated,
                rows[0].free,
                rows[0].used_percent
            ),
            (2, 1, 1, 50)
        );
        assert_eq!(rows[0].overlaps_with, vec!["q".to_string()]);
        // Which Services a pool serves: those holding one of its addresses.
        assert_eq!(rows[0].services, vec!["default/b".to_string()]);
        assert!(rows[1].services.is_empty() && rows[0].auto_assign);
        assert_eq!(rows[0].serves, "all");
        let team = crate::crd::ServiceAllocation {
            priority: Some(1),
            namespaces: Some(vec!["team-a".into(), "team-b".into()]),
            service_selector: Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                    match_labels: Some([("tier".to_string(), "gold".to_string())].into()),
                    ..Default::default()
                },
            ),
            ..Default::default()
        };
        assert_eq!(
            allocation_summary(Some(&team)),
            "priority 1, namespaces team-a team-b, services tier=gold"
        );
        let st = status_rows(&slbs);
        assert_eq!(st[0].service, "a");
        assert_eq!(st[1].advertising_nodes, vec!["n1".to_string()]);
        let t = table(&["A", "B"], &[vec!["x".into(), "y".into()]]);
        assert_eq!(t, "A   B\nx   y\n");
    }
}
