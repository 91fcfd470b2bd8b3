//! What `kubectl juneau peers` prints: per node, its BGP sessions — configured (BGPPeers
//! whose node selector picks the node) and live (the node's [`NodeBGPStatus`], written
//! by its agent from the speaker's status file): state, uptime, prefixes, BFD. A pure
//! function of the API objects, unit-tested without a cluster.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use crate::crd::{BGPPeer, NodeBGPStatus};
use crate::report::{table, Why};
use crate::speaker_status::SPEAKER_STATUS_AVAILABLE;

/// One node's sessions.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePeers {
    /// Node name.
    pub node: String,
    /// Whether the live state is current (the agent read the speaker's status file).
    pub live: bool,
    /// Why not, when not (the condition's reason).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The condition's message (or why there is no NodeBGPStatus).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the sessions were read from the speaker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed_time: Option<String>,
    /// Sessions, by peer name.
    pub sessions: Vec<Session>,
}

/// One session as `peers` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    /// BGPPeer name.
    pub peer: String,
    /// Router address.
    pub peer_address: String,
    /// Router ASN (from the BGPPeer, when it still exists).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_asn: Option<u32>,
    /// FSM state, or `NotReported` when the speaker does not report this configured peer.
    pub state: String,
    /// Seconds Established (as of the time of the command).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uptime_seconds: Option<i64>,
    /// VIPs announced to the peer.
    pub prefixes_announced: u64,
    /// Prefixes received (discarded).
    pub prefixes_received: u64,
    /// Established sessions that went down.
    pub session_flaps: u64,
    /// BFD state, when the peer has BFD.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bfd: Option<String>,
    /// The last error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

fn selects(p: &BGPPeer, node: &Node) -> bool {
    let labels = node.metadata.labels.clone().unwrap_or_default();
    crate::selection::selects(p.spec.node_selector.as_ref(), &labels)
}

/// The report: every node with a configured peer or a NodeBGPStatus, sorted by name.
pub fn peers_report(
    peers: &[BGPPeer],
    nodes: &[Node],
    statuses: &[NodeBGPStatus],
    now: Timestamp,
) -> Vec<NodePeers> {
    let by_node: BTreeMap<String, &NodeBGPStatus> =
        statuses.iter().map(|s| (s.name_any(), s)).collect();
    let asn: BTreeMap<String, u32> = peers
        .iter()
        .map(|p| (p.name_any(), p.spec.peer_asn))
        .collect();
    let mut names: BTreeSet<String> = by_node.keys().cloned().collect();
    let mut configured: BTreeMap<String, Vec<&BGPPeer>> = BTreeMap::new();
    for n in nodes {
        let sel: Vec<&BGPPeer> = peers.iter().filter(|p| selects(p, n)).collect();
        if !sel.is_empty() {
            names.insert(n.name_any());
            configured.insert(n.name_any(), sel);
        }
    }
    names
        .into_iter()
        .map(|node| {
            let st = by_node.get(&node).and_then(|o| o.status.as_ref());
            let cond = st.and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == SPEAKER_STATUS_AVAILABLE)
            });
            let mut sessions: Vec<Session> = st
                .map(|s| s.peers.as_slice())
                .unwrap_or_default()
                .iter()
                .map(|p| Session {
                    peer: p.name.clone(),
                    peer_address: p.peer_address.clone(),
                    peer_asn: asn.get(&p.name).copied(),
                    state: p.state.clone(),
                    uptime_seconds: p
                        .established_since
                        .as_deref()
                        .and_then(|t| t.parse::<Timestamp>().ok())
                        .map(|t| (now.as_second() - t.as_second()).max(0)),
                    prefixes_announced: p.prefixes_announced,
                    prefixes_received: p.prefixes_received,
                    session_flaps: p.session_flaps,
                    bfd: p.bfd.as_ref().map(|b| b.state.clone()),
                    last_error: p.last_error.clone(),
                })
                .collect();
            for p in configured.get(&node).into_iter().flatten() {
                if !sessions.iter().any(|s| s.peer == p.name_any()) {
                    sessions.push(Session {
                        peer: p.name_any(),
                        peer_address: p.spec.peer_address.clone(),
                        peer_asn: Some(p.spec.peer_asn),
                        state: "NotReported".into(),
                        uptime_seconds: None,
                        prefixes_announced: 0,
                        prefixes_received: 0,
                        session_flaps: 0,
                        bfd: None,
                        last_error: None,
                    });
                }
            }
            sessions.sort_by(|a, b| a.peer.cmp(&b.peer));
            let (live, reason, message) = match (by_node.contains_key(&node), cond) {
                (false, _) => (
                    false,
                    Some("NoNodeBGPStatus".to_string()),
                    Some(format!(
                        "no NodeBGPStatus/{node}: is the node agent running there (and allowed to write it)?"
                    )),
                ),
                (true, None) => (false, Some("NotObservedYet".to_string()), None),
                (true, Some(c)) if c.status == "True" => (true, None, None),
                (true, Some(c)) => (false, Some(c.reason.clone()), Some(c.message.clone())),
            };
            NodePeers {
                node,
                live,
                reason,
                message,
                observed_time: st.and_then(|s| s.observed_time.clone()),
                sessions,
            }
        })
        .collect()
}

/// `1d2h3m4s`-style, largest unit first.
pub fn human_duration(secs: i64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3_600 % 24, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    for (v, u) in [(d, "d"), (h, "h"), (m, "m")] {
        if v > 0 || !out.is_empty() {
            out += &format!("{v}{u}");
        }
    }
    out + &format!("{s}s")
}

/// The table `kubectl juneau peers` prints, with a line per node whose live state is not
/// current.
pub fn render(report: &[NodePeers]) -> String {
    let rows: Vec<Vec<String>> = report
        .iter()
        .flat_map(|n| {
            n.sessions.iter().map(move |s| {
                vec![
                    n.node.clone(),
                    s.peer.clone(),
                    s.peer_address.clone(),
                    s.peer_asn.map_or("-".into(), |a| a.to_string()),
                    if n.live {
                        s.state.clone()
                    } else {
                        format!("{} (stale)", s.state)
                    },
                    s.uptime_seconds.map_or("-".into(), human_duration),
                    s.prefixes_announced.to_string(),
                    s.bfd.clone().unwrap_or_else(|| "-".into()),
                ]
            })
        })
        .collect();
    let mut out = table(
        &[
            "NODE", "PEER", "ADDRESS", "ASN", "STATE", "UPTIME", "PREFIXES", "BFD",
        ],
        &rows,
    );
    for n in report.iter().filter(|n| !n.live) {
        out += &format!(
            "\n{}: session state not current ({}): {}\n",
            n.node,
            n.reason.as_deref().unwrap_or("unknown"),
            n.message.as_deref().unwrap_or("")
        );
    }
    out
}

/// Refines `kubectl juneau why` with what the speakers report (their NodeBGPStatus): a
/// node the controller counts as advertising whose speaker withholds the VIP (the
/// dataplane has not programmed it, or is down) or has no Established session does not
/// announce it; the nodes whose speaker state is not current are named as not checked.
pub fn refine_why(why: &mut Why, statuses: &[NodeBGPStatus]) {
    let by_node: BTreeMap<String, &NodeBGPStatus> =
        statuses.iter().map(|s| (s.name_any(), s)).collect();
    let mut unknown = Vec::new();
    for v in why.nodes.iter_mut().filter(|v| v.advertising) {
        let live = by_node
            .get(&v.node)
            .and_then(|o| o.status.as_ref())
            .filter(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == SPEAKER_STATUS_AVAILABLE && c.status == "True")
            });
        let Some(s) = live else {
            unknown.push(v.node.clone());
            continue;
        };
        let held = why
            .vip
            .as_ref()
            .and_then(|vip| s.held_back.iter().find(|h| &h.vip == vip));
        if let Some(h) = held {
            v.advertising = false;
            v.reason = "DataplaneNotReady".into();
            v.message = format!("the speaker withholds the VIP: {}", h.reason);
        } else if s.established_sessions == 0 {
            let states: Vec<String> = s
                .peers
                .iter()
                .map(|p| format!("{} {}", p.name, p.state))
                .collect();
            v.advertising = false;
            v.reason = "NoSessionUp".into();
            v.message = if states.is_empty() {
                "the speaker has no BGP session configured".into()
            } else {
                format!("no BGP session Established ({})", states.join(", "))
            };
        } else {
            let up: Vec<&str> = s
                .peers
                .iter()
                .filter(|p| p.state == "Established")
                .map(|p| p.name.as_str())
                .collect();
            v.message += &format!("; Established to {}", up.join(", "));
        }
    }
    why.not_checked = if unknown.is_empty() {
        vec![]
    } else {
        vec![format!(
            "whether the speaker of {} has a session up and the VIP programmed: no current NodeBGPStatus (see `kubectl juneau peers`)",
            unknown.join(", ")
        )]
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{BGPPeerSpec, BGPSessionStatus, NodeBGPStatusSpec, NodeBGPStatusStatus};
    use crate::speaker_status::{status_from, Reading};

    fn node(name: &str) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n
    }

    fn peer(name: &str) -> BGPPeer {
        let spec: BGPPeerSpec = serde_json::from_value(serde_json::json!({
            "peerAddress": "192.0.2.1", "peerASN": 64512, "localASN": 64513
        }))
        .unwrap();
        BGPPeer::new(name, spec)
    }

    fn status(node: &str, st: NodeBGPStatusStatus) -> NodeBGPStatus {
        let mut o = NodeBGPStatus::new(node, NodeBGPStatusSpec { node: node.into() });
        o.status = Some(st);
        o
    }

    #[test]
    fn live_stale_and_missing_nodes() {
        let now = Timestamp::from_second(10_000).unwrap();
        let established = BGPSessionStatus {
            name: "tor".into(),
            peer_address: "192.0.2.1".into(),
            state: "Established".into(),
            established_since: Some(Timestamp::from_second(10_000 - 3_725).unwrap().to_string()),
            prefixes_announced: 1,
            ..Default::default()
        };
        let good = NodeBGPStatusStatus {
            peers: vec![established.clone()],
            sessions: 1,
            established_sessions: 1,
            ..status_from(&Reading::Ok(Default::default()), None, now)
        };
        let stale = status_from(&Reading::Unreadable("corrupt".into()), Some(&good), now);
        let r = peers_report(
            &[peer("tor")],
            &[node("node-a"), node("node-b"), node("node-c")],
            &[
                status("node-a", good.clone()),
                status("node-b", stale.clone()),
            ],
            now,
        );
        assert_eq!(r.len(), 3);
        assert!(r[0].live);
        assert_eq!(r[0].sessions[0].state, "Established");
        assert_eq!(r[0].sessions[0].uptime_seconds, Some(3_725));
        assert_eq!(r[0].sessions[0].peer_asn, Some(64512));
        assert!(!r[1].live);
        assert_eq!(r[1].reason.as_deref(), Some("StatusFileUnreadable"));
        assert_eq!(r[1].sessions[0].state, "Established", "last known kept");
        assert!(!r[2].live);
        assert_eq!(r[2].reason.as_deref(), Some("NoNodeBGPStatus"));
        assert_eq!(r[2].sessions[0].state, "NotReported");
        let t = render(&r);
        assert!(t.contains("Established"), "{t}");
        assert!(t.contains("1h2m5s"), "{t}");
        assert!(t.contains("Established (stale)"), "{t}");
        assert!(
            t.contains("node-c: session state not current (NoNodeBGPStatus)"),
            "{t}"
        );
        assert_eq!(human_duration(59), "59s");
        // why: node-a Established and not holding the VIP back stays advertising; the
        // same with the VIP held back does not; node-b (stale) is not checked.
        let verdict = |n: &str| crate::report::NodeVerdict {
            node: n.into(),
            advertising: true,
            reason: "Advertising".into(),
            message: "announces the VIP: 1 Ready local backend(s)".into(),
        };
        let mut w = Why {
            service: "default/web".into(),
            vip: Some("203.0.113.10".into()),
            phase: "Ready".into(),
            service_problems: vec![],
            nodes: vec![verdict("node-a"), verdict("node-b")],
            not_checked: vec![],
        };
        let mut a = status("node-a", good.clone());
        refine_why(&mut w, &[a.clone(), status("node-b", stale.clone())]);
        assert!(w.nodes[0].advertising);
        assert!(
            w.nodes[0].message.ends_with("; Established to tor"),
            "{:?}",
            w.nodes[0]
        );
        assert!(w.not_checked[0].contains("node-b"), "{:?}", w.not_checked);
        a.status
            .as_mut()
            .unwrap()
            .held_back
            .push(crate::crd::HeldBackVip {
                vip: "203.0.113.10".into(),
                reason: "not programmed in the dataplane yet".into(),
            });
        w.nodes = vec![verdict("node-a")];
        refine_why(&mut w, &[a.clone()]);
        assert_eq!(
            (w.nodes[0].advertising, w.nodes[0].reason.as_str()),
            (false, "DataplaneNotReady")
        );
        assert!(w.not_checked.is_empty());
        let mut down = good.clone();
        down.established_sessions = 0;
        down.peers[0].state = "Active".into();
        w.nodes = vec![verdict("node-a")];
        refine_why(&mut w, &[status("node-a", down)]);
        assert_eq!(w.nodes[0].reason, "NoSessionUp");
        assert_eq!(
            w.nodes[0].message,
            "no BGP session Established (tor Active)"
        );
        assert_eq!(human_duration(86_400 + 1), "1d0h0m1s");
    }
}
