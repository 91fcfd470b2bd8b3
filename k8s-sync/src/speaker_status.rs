//! The node's live BGP sessions in the API: the node agent reads the status file of its
//! node's `juneau-bgp` (`--status-file` there, `--bgp-status-file` here) every
//! [`POLL`] and, when what it says changed, writes the node's [`NodeBGPStatus`] by
//! server-side apply with its own field manager ([`AGENT_MANAGER`]). `kubectl juneau
//! peers` reads those objects.
//!
//! A missing or unreadable file is a condition (`SpeakerStatusAvailable=False` with the
//! reason and the error), never a crash, and loses nothing: the sessions last read stay
//! in the status, with the time they were read (`observedTime`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde::Deserialize;
use tracing::{info, warn};

use crate::crd::{
    BGPSessionStatus, BfdSessionStatus, HeldBackVip, NodeBGPStatus, NodeBGPStatusSpec,
    NodeBGPStatusStatus,
};

/// Field manager of everything the agent writes.
pub const AGENT_MANAGER: &str = "juneau-agent";
/// The condition on a NodeBGPStatus.
pub const SPEAKER_STATUS_AVAILABLE: &str = "SpeakerStatusAvailable";
/// How often the speaker's status file is read.
pub const POLL: Duration = Duration::from_secs(2);

/// The default `--bgp-status-file` (what the manifests give `juneau-bgp --status-file`).
pub fn default_path(node: &str) -> PathBuf {
    Path::new(juneau_control::shm::DEFAULT_DIR).join(format!("{node}.bgp-status.json"))
}

/// The speaker's status file (`juneau-bgp`'s `status::Status`), the fields used here.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SpeakerFile {
    /// BGP identifier.
    pub router_id: Option<String>,
    /// Node state generation applied.
    pub state_generation: u64,
    /// Per peer, by name.
    pub peers: BTreeMap<String, SpeakerPeer>,
    /// Withheld VIPs and why.
    pub held_back: BTreeMap<String, String>,
}

/// One peer in the speaker's file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SpeakerPeer {
    /// BGPPeer name.
    pub name: String,
    /// Router address.
    pub peer_address: String,
    /// FSM state.
    pub state: String,
    /// Unix time it became Established.
    pub established_since_unix: Option<i64>,
    /// Prefixes announced.
    pub prefixes_announced: u64,
    /// Prefixes received.
    pub prefixes_received: u64,
    /// Session flaps.
    pub session_flaps: u64,
    /// Graceful restart negotiated.
    pub graceful_restart: bool,
    /// Last error.
    pub last_error: Option<String>,
    /// BFD.
    pub bfd: Option<SpeakerBfd>,
}

/// BFD of one peer in the speaker's file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SpeakerBfd {
    /// State.
    pub state: String,
    /// Our diagnostic.
    pub diag: String,
    /// Detection time.
    pub detection_time_ms: Option<u64>,
    /// Down events.
    pub down_events: u64,
    /// Set-up error.
    pub error: Option<String>,
    /// Authentication in use.
    pub authentication: Option<String>,
    /// Packets discarded by authentication.
    pub auth_failures: u64,
}

/// One reading of the speaker's file.
#[derive(Debug, Clone, PartialEq)]
pub enum Reading {
    /// Parsed.
    Ok(SpeakerFile),
    /// Not there (the speaker is not running yet, or writes elsewhere).
    Missing(String),
    /// There but not readable or not the speaker's JSON.
    Unreadable(String),
}

/// Reads and parses the file.
pub fn read(path: &Path) -> Reading {
    match std::fs::read(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Reading::Missing(format!(
            "{} does not exist (is juneau-bgp running with --status-file {}?)",
            path.display(),
            path.display()
        )),
        Err(e) => Reading::Unreadable(format!("reading {}: {e}", path.display())),
        Ok(bytes) => match serde_json::from_slice::<SpeakerFile>(&bytes) {
            Ok(f) => Reading::Ok(f),
            Err(e) => Reading::Unreadable(format!(
                "{} is not juneau-bgp's status JSON: {e}",
                path.display()
            )),
        },
    }
}

fn rfc3339(unix: i64) -> Option<String> {
    Timestamp::from_second(unix).ok().map(|t| t.to_string())
}

fn session(p: &SpeakerPeer) -> BGPSessionStatus {
    BGPSessionStatus {
        name: p.name.clone(),
        peer_address: p.peer_address.clone(),
        state: p.state.clone(),
        established_since: p.established_since_unix.and_then(rfc3339),
        prefixes_announced: p.prefixes_announced,
        prefixes_received: p.prefixes_received,
        session_flaps: p.session_flaps,
        graceful_restart: p.graceful_restart,
        last_error: p.last_error.clone(),
        bfd: p.bfd.as_ref().map(|b| BfdSessionStatus {
            state: b.state.clone(),
            detection_time_ms: b.detection_time_ms,
            down_events: b.down_events,
            diagnostic: b
                .error
                .clone()
                .or_else(|| (!b.diag.is_empty()).then(|| b.diag.clone())),
            authentication: b.authentication.clone(),
            auth_failures: b.auth_failures,
        }),
    }
}

/// The status to write after `reading`, given the one written before. Pure.
pub fn status_from(
    reading: &Reading,
    previous: Option<&NodeBGPStatusStatus>,
    now: Timestamp,
) -> NodeBGPStatusStatus {
    let mut st = match reading {
        Reading::Ok(f) => {
            let peers: Vec<BGPSessionStatus> = f.peers.values().map(session).collect();
            NodeBGPStatusStatus {
                observed_time: Some(now.to_string()),
                router_id: f.router_id.clone(),
                state_generation: f.state_generation,
                sessions: peers.len() as u32,
                established_sessions: peers.iter().filter(|p| p.state == "Established").count()
                    as u32,
                peers,
                held_back: f
                    .held_back
                    .iter()
                    .map(|(vip, reason)| HeldBackVip {
                        vip: vip.clone(),
                        reason: reason.clone(),
                    })
                    .collect(),
                conditions: vec![],
                decommissioned: None,
            }
        }
        // Keep what was last read; the condition says it is not current.
        Reading::Missing(_) | Reading::Unreadable(_) => NodeBGPStatusStatus {
            conditions: vec![],
            ..previous.cloned().unwrap_or_default()
        },
    };
    let (ok, reason, message) = match reading {
        Reading::Ok(_) => (
            true,
            "StatusFileRead",
            "the speaker's status file was read".to_string(),
        ),
        Reading::Missing(e) => (false, "StatusFileMissing", last_read(e, &st)),
        Reading::Unreadable(e) => (false, "StatusFileUnreadable", last_read(e, &st)),
    };
    let status = if ok { "True" } else { "False" };
    let last_transition_time = previous
        .and_then(|p| {
            p.conditions
                .iter()
                .find(|c| c.type_ == SPEAKER_STATUS_AVAILABLE && c.status == status)
        })
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    st.conditions = vec![Condition {
        type_: SPEAKER_STATUS_AVAILABLE.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: None,
        last_transition_time,
    }];
    st
}

fn last_read(error: &str, st: &NodeBGPStatusStatus) -> String {
    match &st.observed_time {
        Some(t) => format!("{error}; the sessions shown were read at {t}"),
        None => format!("{error}; no session state has been read yet"),
    }
}

/// Whether two statuses say the same (ignoring when they were read).
fn same(a: &NodeBGPStatusStatus, b: &NodeBGPStatusStatus) -> bool {
    let strip = |s: &NodeBGPStatusStatus| NodeBGPStatusStatus {
        observed_time: None,
        decommissioned: None,
        ..s.clone()
    };
    strip(a) == strip(b)
}

async fn apply(
    api: &Api<NodeBGPStatus>,
    node: &str,
    owner: Option<&OwnerReference>,
    status: &NodeBGPStatusStatus,
) -> kube::Result<()> {
    let pp = PatchParams::apply(AGENT_MANAGER).force();
    let mut obj = serde_json::json!({
        "apiVersion": "juneau.loutres.me/v1alpha1",
        "kind": "NodeBGPStatus",
        "metadata": {"name": node},
        "spec": NodeBGPStatusSpec { node: node.to_string() },
    });
    if let Some(o) = owner {
        obj["metadata"]["ownerReferences"] = serde_json::json!([o]);
    }
    api.patch(node, &pp, &Patch::Apply(&obj)).await?;
    // `decommissioned` is the decommission report's (crate::decommission), not ours.
    let status = NodeBGPStatusStatus {
        decommissioned: None,
        ..status.clone()
    };
    let st = serde_json::json!({
        "apiVersion": "juneau.loutres.me/v1alpha1",
        "kind": "NodeBGPStatus",
        "metadata": {"name": node},
        "status": status,
    });
    api.patch_status(node, &pp, &Patch::Apply(&st)).await?;
    Ok(())
}

/// Reads the speaker's file every [`POLL`] and keeps `NodeBGPStatus/<node>` current, until
/// the process ends. API errors are logged and retried on the next change or poll.
pub async fn run(client: kube::Client, node: String, path: PathBuf) {
    let api: Api<NodeBGPStatus> = Api::all(client.clone());
    // Owned by the Node, so it goes when the Node goes.
    let owner = Api::<k8s_openapi::api::core::v1::Node>::all(client)
        .get(&node)
        .await
        .ok()
        .and_then(|n| {
            Some(OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.clone(),
                uid: n.metadata.uid?,
                ..Default::default()
            })
        });
    let mut previous: Option<NodeBGPStatusStatus> = api
        .get_opt(&node)
        .await
        .ok()
        .flatten()
        .and_then(|o| o.status);
    let mut written = false;
    let mut last_kind = "";
    let mut last_error: Option<String> = None;
    info!(node = %node, path = %path.display(), "publishing the speaker's sessions as NodeBGPStatus/{node}");
    let mut tick = tokio::time::interval(POLL);
    loop {
        tick.tick().await;
        let reading = read(&path);
        let kind = match &reading {
            Reading::Ok(_) => "ok",
            Reading::Missing(_) => "missing",
            Reading::Unreadable(_) => "unreadable",
        };
        if kind != last_kind {
            match &reading {
                Reading::Ok(_) => info!(path = %path.display(), "speaker status readable"),
                Reading::Missing(e) | Reading::Unreadable(e) => warn!("speaker status: {e}"),
            }
            last_kind = kind;
        }
        let next = status_from(&reading, previous.as_ref(), Timestamp::now());
        if written && previous.as_ref().is_some_and(|p| same(p, &next)) {
            continue;
        }
        match apply(&api, &node, owner.as_ref(), &next).await {
            Ok(()) => {
                previous = Some(next);
                written = true;
                last_error = None;
            }
            Err(e) => {
                // Logged once per distinct error (a missing CRD or RBAC rule would
                // otherwise log every poll).
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    warn!(error = %text, "writing NodeBGPStatus/{node} failed; retrying every {POLL:?}");
                    last_error = Some(text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{
  "node": "node-a", "router_id": "10.0.1.2", "state_generation": 42, "written_unix": 1790000000,
  "peers": {
    "tor-a": {
      "name": "tor-a", "peer_address": "10.0.1.1", "state": "Established",
      "established_since_unix": 1789999000, "uptime_seconds": 1000,
      "last_error": null, "prefixes_announced": 3, "prefixes_received": 0,
      "session_flaps": 1, "updates_sent": 7, "treat_as_withdraw": 0, "graceful_restart": true,
      "bfd": {"state": "Up", "diag": "", "peer_diag": "", "detection_time_ms": 900, "down_events": 2, "error": null,
              "authentication": "meticulous keyed SHA1", "auth_failures": 4}
    },
    "tor-b": {"name": "tor-b", "peer_address": "10.0.2.1", "state": "Active"}
  },
  "held_back": {"203.0.113.11": "not programmed in the dataplane yet"}
}"#;

    fn now() -> Timestamp {
        Timestamp::from_second(1_790_000_100).unwrap()
    }

    #[test]
    fn bad_input_first_missing_and_corrupt_files_are_conditions_and_keep_the_last_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.bgp-status.json");
        // Missing, nothing read before.
        let r = read(&path);
        assert!(matches!(r, Reading::Missing(_)), "{r:?}");
        let st = status_from(&r, None, now());
        let c = &st.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            (SPEAKER_STATUS_AVAILABLE, "False", "StatusFileMissing")
        );
        assert!(
            c.message.contains("no session state has been read yet"),
            "{}",
            c.message
        );
        assert!(st.peers.is_empty());
        // Good.
        std::fs::write(&path, FILE).unwrap();
        let good = status_from(&read(&path), Some(&st), now());
        assert_eq!(good.conditions[0].status, "True");
        assert_eq!((good.sessions, good.established_sessions), (2, 1));
        let a = &good.peers[0];
        assert_eq!(a.state, "Established");
        assert_eq!(a.established_since.as_deref(), Some("2026-09-21T13:56:40Z"));
        assert_eq!(a.prefixes_announced, 3);
        assert_eq!(a.bfd.as_ref().unwrap().state, "Up");
        assert_eq!(a.bfd.as_ref().unwrap().auth_failures, 4);
        assert_eq!(
            a.bfd.as_ref().unwrap().authentication.as_deref(),
            Some("meticulous keyed SHA1")
        );
        assert_eq!(good.held_back[0].vip, "203.0.113.11");
        // Corrupt (half a file): a condition with the parse error; the sessions stay.
        std::fs::write(&path, &FILE[..40]).unwrap();
        let r = read(&path);
        assert!(matches!(r, Reading::Unreadable(_)), "{r:?}");
        let bad = status_from(&r, Some(&good), now());
        let c = &bad.conditions[0];
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "StatusFileUnreadable")
        );
        assert!(
            c.message.contains("not juneau-bgp's status JSON"),
            "{}",
            c.message
        );
        assert!(c.message.contains("read at"), "{}", c.message);
        assert_eq!(bad.peers, good.peers, "the last sessions read are kept");
        assert_eq!(bad.observed_time, good.observed_time);
        // Not JSON of the right shape at all.
        std::fs::write(&path, "[1,2,3]").unwrap();
        assert!(matches!(read(&path), Reading::Unreadable(_)));
    }

    #[test]
    fn the_transition_time_moves_only_when_the_condition_flips() {
        let t1 = Timestamp::from_second(1_000).unwrap();
        let t2 = Timestamp::from_second(2_000).unwrap();
        let ok = Reading::Ok(serde_json::from_str(FILE).unwrap());
        let a = status_from(&ok, None, t1);
        let b = status_from(&ok, Some(&a), t2);
        assert_eq!(b.conditions[0].last_transition_time, Time(t1));
        assert!(same(&a, &b), "only observedTime differs");
        let c = status_from(&Reading::Missing("gone".into()), Some(&b), t2);
        assert_eq!(c.conditions[0].last_transition_time, Time(t2));
        assert!(!same(&b, &c));
    }
}
