//! Which nodes advertise a VIP, and the backend summary operators see.
//!
//! With `externalTrafficPolicy: Local`, a node may only attract traffic for a Service if
//! it can deliver it locally: it advertises the VIP's /32 exactly while it has at least
//! one Ready, non-terminating backend of the Service, and is not excluded from external
//! load balancers (`node.kubernetes.io/exclude-from-external-load-balancers`).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use crate::model::{Backend, NodeName};

/// The nodes that must advertise a Service's VIP, sorted by name.
pub fn advertising_nodes<'a>(
    backends: impl IntoIterator<Item = &'a Backend>,
    excluded_nodes: &BTreeSet<NodeName>,
) -> BTreeSet<NodeName> {
    backends
        .into_iter()
        .filter(|b| b.conditions.takes_new_traffic())
        .filter_map(|b| b.node.as_ref())
        .filter(|n| !excluded_nodes.contains(*n))
        .cloned()
        .collect()
}

/// `status.backendSummary` of a ServiceLoadBalancer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackendSummary {
    /// Ready, non-terminating endpoints of the Service cluster-wide (each Pod once, however
    /// many ports the Service has).
    pub total_ready: u32,
    /// Number of advertising nodes.
    pub local_ready_nodes: u32,
}

/// The summary for a Service's backends (one [`Backend`] per endpoint and port).
pub fn backend_summary<'a>(
    backends: impl IntoIterator<Item = &'a Backend> + Clone,
    excluded_nodes: &BTreeSet<NodeName>,
) -> BackendSummary {
    let ready: BTreeSet<Ipv4Addr> = backends
        .clone()
        .into_iter()
        .filter(|b| b.conditions.takes_new_traffic())
        .map(|b| b.ip)
        .collect();
    BackendSummary {
        total_ready: ready.len() as u32,
        local_ready_nodes: advertising_nodes(backends, excluded_nodes).len() as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::EndpointConditions;

    fn b(last: u8, port: u16, node: Option<&str>, ready: bool, terminating: bool) -> Backend {
        Backend {
            ip: Ipv4Addr::new(10, 244, 0, last),
            port,
            node: node.map(String::from),
            conditions: EndpointConditions {
                ready,
                serving: ready,
                terminating,
            },
        }
    }

    #[test]
    fn the_seed_guide_case() {
        let backends = [
            b(1, 80, Some("node-a"), true, false),
            b(2, 80, Some("node-a"), true, false),
            b(3, 80, Some("node-c"), true, false),
        ];
        let nodes = advertising_nodes(&backends, &BTreeSet::new());
        assert_eq!(nodes.into_iter().collect::<Vec<_>>(), ["node-a", "node-c"]);
        assert_eq!(
            backend_summary(&backends, &BTreeSet::new()),
            BackendSummary {
                total_ready: 3,
                local_ready_nodes: 2
            }
        );
    }

    #[test]
    fn unready_terminating_unknown_node_and_excluded_nodes_do_not_advertise() {
        let backends = [
            b(1, 80, Some("node-a"), false, false),
            b(2, 80, Some("node-b"), true, true),
            b(3, 80, None, true, false),
            b(4, 80, Some("node-x"), true, false),
            b(5, 80, Some("node-c"), true, false),
        ];
        let excluded = BTreeSet::from(["node-x".to_string()]);
        let nodes = advertising_nodes(&backends, &excluded);
        assert_eq!(nodes.into_iter().collect::<Vec<_>>(), ["node-c"]);
        let s = backend_summary(&backends, &excluded);
        // Ready endpoints count cluster-wide, whatever their node.
        assert_eq!(s.total_ready, 3);
        assert_eq!(s.local_ready_nodes, 1);
    }

    #[test]
    fn a_pod_with_two_ports_counts_once() {
        let backends = [
            b(1, 80, Some("node-a"), true, false),
            b(1, 443, Some("node-a"), true, false),
        ];
        assert_eq!(backend_summary(&backends, &BTreeSet::new()).total_ready, 1);
    }
}
