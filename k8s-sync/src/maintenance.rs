//! What puts a node in graceful maintenance: the Node signals (cordon, the
//! exclude-from-external-load-balancers label, the kubelet's graceful shutdown, Juneau's
//! annotation) and which of them a BGPPeer listens to. Pure: the agent's node-state
//! builder asks [`active_triggers`] of its Node and [`Triggers::drains`] per peer; the
//! speaker carries the maintenance out (`juneau_bgp::maintenance`).
//!
//! Why cordon is not a default trigger: docs/bgp.md, "Graceful maintenance".

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Node;

use crate::crd::MaintenanceTrigger;
use crate::endpoints::node_excluded;

/// Node annotation asking for graceful maintenance (trigger `Annotation`): `"true"`
/// starts it, `"false"` or no annotation does not; any other value is reported and
/// ignored (the node keeps announcing).
pub const MAINTENANCE_ANNOTATION: &str = "juneau.loutres.me/maintenance";

/// What the kubelet's graceful node shutdown writes in the Ready condition's message
/// (`pkg/kubelet/nodeshutdown`, `ShutdownStatus`).
const SHUTTING_DOWN: &str = "node is shutting down";

/// The triggers a BGPPeer without `spec.maintenance.triggers` listens to (the agent's
/// `--maintenance-triggers`; [`MaintenanceTrigger::DEFAULT`] when not given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Triggers(pub Vec<MaintenanceTrigger>);

impl Default for Triggers {
    fn default() -> Self {
        Triggers(MaintenanceTrigger::DEFAULT.to_vec())
    }
}

impl Triggers {
    /// Parses the agent's `--maintenance-triggers`: API names separated by commas; an
    /// empty value means none.
    pub fn parse(s: &str) -> Result<Triggers, String> {
        s.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::parse)
            .collect::<Result<Vec<_>, _>>()
            .map(Triggers)
    }

    /// Whether a peer listening to `peer` (its own list, else these) drains while the
    /// Node's `active` triggers hold.
    pub fn drains(
        &self,
        peer: Option<&[MaintenanceTrigger]>,
        active: &BTreeSet<MaintenanceTrigger>,
    ) -> bool {
        peer.unwrap_or(&self.0).iter().any(|t| active.contains(t))
    }
}

/// The triggers that hold for `node` now; an annotation value that means nothing is
/// reported in `warnings` (and starts nothing).
pub fn active_triggers(node: &Node, warnings: &mut Vec<String>) -> BTreeSet<MaintenanceTrigger> {
    let mut active = BTreeSet::new();
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        active.insert(MaintenanceTrigger::Cordon);
    }
    if node_excluded(node) {
        active.insert(MaintenanceTrigger::ExcludeLabel);
    }
    if shutting_down(node) {
        active.insert(MaintenanceTrigger::NodeShutdown);
    }
    let annotation = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(MAINTENANCE_ANNOTATION));
    match annotation.map(String::as_str) {
        Some("true") => {
            active.insert(MaintenanceTrigger::Annotation);
        }
        None | Some("false") => {}
        Some(other) => warnings.push(format!(
            "Node {}: annotation {MAINTENANCE_ANNOTATION}={other:?} is neither \"true\" nor \"false\"; ignored (no maintenance)",
            node.metadata.name.as_deref().unwrap_or_default()
        )),
    }
    active
}

/// The kubelet is shutting the node down (graceful node shutdown): its Ready condition
/// is not True and says so.
fn shutting_down(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "Ready"
                && c.status != "True"
                && c.message
                    .as_deref()
                    .is_some_and(|m| m.contains(SHUTTING_DOWN))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus};
    use MaintenanceTrigger::*;

    fn node() -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("node-a".into());
        n
    }

    fn active(n: &Node) -> Vec<MaintenanceTrigger> {
        let mut w = Vec::new();
        let a = active_triggers(n, &mut w).into_iter().collect();
        assert!(w.is_empty(), "{w:?}");
        a
    }

    #[test]
    fn each_node_signal_is_its_own_trigger() {
        assert_eq!(active(&node()), []);
        let mut n = node();
        n.spec = Some(NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        assert_eq!(active(&n), [Cordon]);
        let mut n = node();
        n.metadata.labels =
            Some([(crate::crd::EXCLUDE_FROM_LB_LABEL.to_string(), String::new())].into());
        assert_eq!(active(&n), [ExcludeLabel]);
        let mut n = node();
        n.metadata.annotations = Some([(MAINTENANCE_ANNOTATION.to_string(), "true".into())].into());
        assert_eq!(active(&n), [Annotation]);
        n.metadata.annotations =
            Some([(MAINTENANCE_ANNOTATION.to_string(), "false".into())].into());
        assert_eq!(active(&n), []);
    }

    #[test]
    fn the_kubelets_shutdown_is_a_trigger_a_plain_not_ready_is_not() {
        let ready = |status: &str, message: &str| {
            let mut n = node();
            n.status = Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: status.into(),
                    reason: Some("KubeletNotReady".into()),
                    message: Some(message.into()),
                    ..Default::default()
                }]),
                ..Default::default()
            });
            n
        };
        // What the kubelet writes (errors aggregated into the message).
        assert_eq!(
            active(&ready("False", "node is shutting down")),
            [NodeShutdown]
        );
        assert_eq!(
            active(&ready(
                "False",
                "[container runtime is down, node is shutting down]"
            )),
            [NodeShutdown]
        );
        assert_eq!(active(&ready("False", "container runtime is down")), []);
        assert_eq!(
            active(&ready("Unknown", "Kubelet stopped posting node status.")),
            []
        );
        assert_eq!(
            active(&ready("True", "kubelet is posting ready status")),
            []
        );
    }

    #[test]
    fn a_meaningless_annotation_is_reported_and_starts_nothing() {
        let mut n = node();
        n.metadata.annotations = Some([(MAINTENANCE_ANNOTATION.to_string(), "yes".into())].into());
        let mut w = Vec::new();
        assert!(active_triggers(&n, &mut w).is_empty());
        assert_eq!(w.len(), 1);
        assert!(
            w[0].contains("juneau.loutres.me/maintenance=\"yes\""),
            "{w:?}"
        );
    }

    #[test]
    fn a_peer_drains_on_its_own_triggers_else_the_agents() {
        let defaults = Triggers::default();
        let cordoned: BTreeSet<_> = [Cordon].into();
        let labelled: BTreeSet<_> = [ExcludeLabel].into();
        assert!(
            !defaults.drains(None, &cordoned),
            "cordon is no default trigger"
        );
        assert!(defaults.drains(None, &labelled));
        assert!(defaults.drains(Some(&[Cordon]), &cordoned));
        assert!(!defaults.drains(Some(&[Cordon]), &labelled));
        assert!(!defaults.drains(Some(&[]), &labelled), "[]: never");
        assert!(Triggers(vec![Cordon]).drains(None, &cordoned));
    }

    #[test]
    fn the_agents_flag_lists_triggers_or_none() {
        assert_eq!(
            Triggers::parse("Cordon,NodeShutdown"),
            Ok(Triggers(vec![Cordon, NodeShutdown]))
        );
        assert_eq!(Triggers::parse(""), Ok(Triggers(vec![])));
        assert_eq!(
            Triggers::parse("ExcludeLabel,Annotation"),
            Ok(Triggers::default()),
            "the flag's documented default"
        );
        assert!(Triggers::parse("Cordon,drain")
            .unwrap_err()
            .contains("\"drain\""));
    }

    #[test]
    fn triggers_parse_by_their_api_names_and_nothing_else() {
        for t in MaintenanceTrigger::ALL {
            assert_eq!(t.name().parse::<MaintenanceTrigger>(), Ok(t));
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(
                json,
                format!("\"{}\"", t.name()),
                "API and flag spell it alike"
            );
        }
        let e = "cordon".parse::<MaintenanceTrigger>().unwrap_err();
        assert!(
            e.contains("Cordon, ExcludeLabel, NodeShutdown, Annotation"),
            "{e}"
        );
    }
}
