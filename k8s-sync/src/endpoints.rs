//! Reading EndpointSlices the way both the controller and the agent must: the same rules
//! for "Ready", "on which node", "excluded node" and "host network" in one place.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use juneau_control::{advertise, Backend, EndpointConditions};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};

use crate::crd::EXCLUDE_FROM_LB_LABEL;

/// Label on an EndpointSlice naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One endpoint address of a Service, as its EndpointSlice reports it: IPv4 (`A`
/// [`Ipv4Addr`], from `addressType: IPv4` slices) or IPv6 ([`SliceEndpoint6`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint<A = Ipv4Addr> {
    /// Pod IP.
    pub ip: A,
    /// Node the Pod runs on.
    pub node: Option<String>,
    /// Readiness (API semantics: unknown ready = ready, unknown terminating = false).
    pub conditions: EndpointConditions,
    /// Ports of the slice: (name, protocol, port).
    pub ports: Vec<(Option<String>, String, u16)>,
}

/// Converts an endpoint's conditions with the API's defaults for unset fields.
pub fn conditions(ep: &Endpoint) -> EndpointConditions {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let serving = c.and_then(|c| c.serving).unwrap_or(ready);
    EndpointConditions {
        ready,
        serving,
        terminating,
    }
}

/// An IPv6 endpoint address of a Service (from an `addressType: IPv6` slice).
pub type SliceEndpoint6 = SliceEndpoint<Ipv6Addr>;

/// Every IPv4 endpoint address of the given slices (IPv6/FQDN slices are ignored).
pub fn slice_endpoints<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> Vec<SliceEndpoint> {
    endpoints_of(slices, "IPv4")
}

/// Every IPv6 endpoint address of the given slices (IPv4/FQDN slices are ignored), read
/// with the same rules as the IPv4 ones.
pub fn slice_endpoints6<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> Vec<SliceEndpoint6> {
    endpoints_of(slices, "IPv6")
}

/// The endpoint addresses of the slices of `address_type` that parse as `A`.
fn endpoints_of<'a, A: FromStr>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    address_type: &str,
) -> Vec<SliceEndpoint<A>> {
    let mut out = Vec::new();
    for s in slices {
        if s.address_type != address_type {
            continue;
        }
        let ports: Vec<(Option<String>, String, u16)> = s
            .ports
            .iter()
            .flatten()
            .filter_map(|p| {
                let port = u16::try_from(p.port?).ok()?;
                Some((
                    p.name.clone().filter(|n| !n.is_empty()),
                    p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                    port,
                ))
            })
            .collect();
        for ep in &s.endpoints {
            for a in &ep.addresses {
                if let Ok(ip) = a.parse::<A>() {
                    out.push(SliceEndpoint {
                        ip,
                        node: ep.node_name.clone(),
                        conditions: conditions(ep),
                        ports: ports.clone(),
                    });
                }
            }
        }
    }
    out
}

/// True when the node carries `node.kubernetes.io/exclude-from-external-load-balancers`.
pub fn node_excluded(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(EXCLUDE_FROM_LB_LABEL))
}

/// The addresses a Node reports (a Pod with one of them is on the host network).
pub fn node_addresses(node: &Node) -> BTreeSet<Ipv4Addr> {
    addresses_of(node)
}

/// The IPv6 addresses a Node reports.
pub fn node_addresses6(node: &Node) -> BTreeSet<Ipv6Addr> {
    addresses_of(node)
}

/// The addresses of one family a Node reports (the others do not parse as `A`).
fn addresses_of<A: std::str::FromStr + Ord>(node: &Node) -> BTreeSet<A> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// Endpoints whose address is their node's own address: host-network Pods. `nodes`
/// holds `Node`s or shared (`Arc`) ones.
pub fn host_network_endpoints<N: std::borrow::Borrow<Node>>(
    eps: &[SliceEndpoint],
    nodes: &BTreeMap<String, N>,
) -> Vec<Ipv4Addr> {
    let mut host: BTreeSet<Ipv4Addr> = BTreeSet::new();
    for ep in eps {
        let on_host = match ep.node.as_deref().and_then(|n| nodes.get(n)) {
            Some(n) => node_addresses(n.borrow()).contains(&ep.ip),
            None => nodes
                .values()
                .any(|n| node_addresses(n.borrow()).contains(&ep.ip)),
        };
        if on_host {
            host.insert(ep.ip);
        }
    }
    host.into_iter().collect()
}

/// The backend picture of one Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendPicture {
    /// Ready, non-terminating endpoint addresses cluster-wide (distinct IPs).
    pub total_ready: u32,
    /// Nodes that have at least one Ready, non-terminating endpoint and are not excluded,
    /// sorted.
    pub advertising_nodes: Vec<String>,
}

/// Counts Ready endpoints and picks the advertising nodes with
/// `juneau_control::advertise`.
pub fn picture(eps: &[SliceEndpoint], nodes: &BTreeMap<String, Node>) -> BackendPicture {
    let backends: Vec<Backend> = eps
        .iter()
        .map(|e| Backend {
            ip: e.ip,
            port: e.ports.first().map(|p| p.2).unwrap_or(0),
            node: e.node.clone(),
            conditions: e.conditions,
        })
        .collect();
    let excluded: BTreeSet<String> = nodes
        .iter()
        .filter(|(_, n)| node_excluded(n))
        .map(|(name, _)| name.clone())
        .collect();
    let summary = advertise::backend_summary(&backends, &excluded);
    BackendPicture {
        total_ready: summary.total_ready,
        advertising_nodes: advertise::advertising_nodes(&backends, &excluded)
            .into_iter()
            .collect(),
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
    use k8s_openapi::api::discovery::v1::{EndpointConditions as K8sCond, EndpointPort};
    use kube::api::ObjectMeta;

    pub fn slice(
        svc: &str,
        name: &str,
        eps: &[(&str, &str, bool, bool)],
        port: (&str, i32),
    ) -> EndpointSlice {
        let address_type = if eps.first().is_some_and(|e| e.0.contains(':')) {
            "IPv6"
        } else {
            "IPv4"
        };
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                labels: Some([(SERVICE_NAME_LABEL.to_string(), svc.to_string())].into()),
                ..Default::default()
            },
            address_type: address_type.into(),
            endpoints: eps
                .iter()
                .map(|(ip, node, ready, term)| Endpoint {
                    addresses: vec![ip.to_string()],
                    node_name: Some(node.to_string()),
                    conditions: Some(K8sCond {
                        ready: Some(*ready),
                        serving: Some(*ready),
                        terminating: Some(*term),
                    }),
                    ..Default::default()
                })
                .collect(),
            ports: Some(vec![EndpointPort {
                name: Some(port.0.into()),
                port: Some(port.1),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
        }
    }

    pub fn node(name: &str, ip: &str, excluded: bool) -> (String, Node) {
        let mut labels = BTreeMap::new();
        if excluded {
            labels.insert(EXCLUDE_FROM_LB_LABEL.to_string(), String::new());
        }
        (
            name.to_string(),
            Node {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    labels: Some(labels),
                    ..Default::default()
                },
                status: Some(NodeStatus {
                    addresses: Some(vec![NodeAddress {
                        type_: "InternalIP".into(),
                        address: ip.into(),
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    #[test]
    fn seed_picture() {
        let s = slice(
            "nginx",
            "nginx-1",
            &[
                ("10.0.0.1", "node-a", true, false),
                ("10.0.0.2", "node-a", true, false),
                ("10.0.0.3", "node-c", true, false),
            ],
            ("http", 80),
        );
        let nodes: BTreeMap<_, _> = [
            node("node-a", "192.168.0.1", false),
            node("node-c", "192.168.0.3", false),
        ]
        .into();
        let eps = slice_endpoints([&s]);
        let p = picture(&eps, &nodes);
        assert_eq!(p.total_ready, 3);
        assert_eq!(p.advertising_nodes, vec!["node-a", "node-c"]);
        assert!(host_network_endpoints(&eps, &nodes).is_empty());
    }

    #[test]
    fn unready_terminating_excluded_and_host_network() {
        let s = slice(
            "nginx",
            "nginx-1",
            &[
                ("10.0.0.1", "node-a", false, false),
                ("10.0.0.2", "node-b", true, true),
                ("10.0.0.3", "node-c", true, false),
                ("192.168.0.4", "node-d", true, false),
            ],
            ("http", 80),
        );
        let nodes: BTreeMap<_, _> = [
            node("node-a", "192.168.0.1", false),
            node("node-c", "192.168.0.3", true),
            node("node-d", "192.168.0.4", false),
        ]
        .into();
        let eps = slice_endpoints([&s]);
        let p = picture(&eps, &nodes);
        assert_eq!(p.total_ready, 2);
        assert_eq!(p.advertising_nodes, vec!["node-d"]);
        assert_eq!(
            host_network_endpoints(&eps, &nodes),
            vec![Ipv4Addr::new(192, 168, 0, 4)]
        );
    }
}
