//! `kubectl juneau peers` with live session state, through the real kubectl against a
//! real kube-apiserver: the node agent (real binary, ServiceAccount juneau-node with the
//! RBAC of deploy/rbac.yaml) reads the speaker's status file and writes
//! `NodeBGPStatus/<node>` by server-side apply; the plugin shows state, uptime, prefixes
//! and BFD per node, in a table, JSON and YAML.
//!
//! Bad input first: a missing and a corrupt speaker status file each give a clear
//! condition (and the plugin says so), the agent keeps running, and the sessions last
//! read are kept. The speaker's file is written here in juneau-bgp's format
//! (docs/bgp.md); the lab's end-to-end test checks the same with the real speakers.

mod common;

use std::path::Path;

use anyhow::Result;
use common::*;
use serde_json::Value;

fn node_entry(env: &Env, node: &str) -> Result<Option<Value>> {
    let v: Value = serde_json::from_str(&kubectl_juneau_ok(env, &["peers", "-o", "json"])?)?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .find(|n| n["node"] == node)
        .cloned())
}

/// Writes the way juneau-bgp does: a temporary file, then a rename.
fn write(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn speaker_file(established_since: u64) -> String {
    format!(
        r#"{{
  "node": "node-a", "router_id": "192.0.2.11", "state_generation": 7, "written_unix": {established_since},
  "peers": {{
    "tor": {{
      "name": "tor", "peer_address": "192.0.2.1", "state": "Established",
      "established_since_unix": {established_since}, "uptime_seconds": 0,
      "last_error": null, "prefixes_announced": 3, "prefixes_received": 0,
      "session_flaps": 1, "updates_sent": 4, "treat_as_withdraw": 0, "graceful_restart": true,
      "bfd": {{"state": "Up", "diag": "", "peer_diag": "", "detection_time_ms": 900,
              "down_events": 0, "error": null, "local_discriminator": 1, "remote_discriminator": 2}}
    }}
  }},
  "held_back": {{}}
}}"#
    )
}

#[test]
fn peers_show_live_sessions_and_say_why_when_the_speaker_status_is_missing_or_corrupt() -> Result<()>
{
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.64.1"), ("node-b", "192.168.64.2")])?;
    env.apply(SEED_NETWORK)?;
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("node-a.state");
    // What common's agent reads (state file with extension bgp-status.json).
    let bgp = state.with_extension("bgp-status.json");
    let mut agent = env.agent("node-a", &state)?;

    // 1. No speaker status yet: a condition naming the file; the configured peer is
    //    listed as not reported. node-b runs no agent: said so.
    let a = eventually("node-a: StatusFileMissing", || {
        Ok(node_entry(&env, "node-a")?.filter(|n| n["reason"] == "StatusFileMissing"))
    })?;
    assert_eq!(a["live"], false);
    let msg = a["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(bgp.to_str().unwrap()) && msg.contains("does not exist"),
        "{msg}"
    );
    assert_eq!(a["sessions"][0]["peer"], "tor");
    assert_eq!(a["sessions"][0]["state"], "NotReported");
    let b = node_entry(&env, "node-b")?.expect("node-b has the peer configured");
    assert_eq!(b["reason"], "NoNodeBGPStatus");

    // 2. A corrupt file (half written by something else): a condition with the parse
    //    error; the agent runs on.
    write(&bgp, "{\"peers\": {\"tor\": {\"state\": ")?;
    let a = eventually("node-a: StatusFileUnreadable", || {
        Ok(node_entry(&env, "node-a")?.filter(|n| n["reason"] == "StatusFileUnreadable"))
    })?;
    let msg = a["message"].as_str().unwrap_or_default();
    assert!(msg.contains("not juneau-bgp's status JSON"), "{msg}");
    assert!(msg.contains("no session state has been read yet"), "{msg}");
    agent.check_running()?;

    // 3. The speaker's status: state, uptime, prefixes, BFD, in JSON, YAML and a table.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    write(&bgp, &speaker_file(now - 1000))?;
    let a = eventually("node-a live", || {
        Ok(node_entry(&env, "node-a")?.filter(|n| n["live"] == true))
    })?;
    let tor = &a["sessions"][0];
    assert_eq!(
        (
            &tor["peer"],
            &tor["state"],
            &tor["prefixesAnnounced"],
            &tor["bfd"],
            &tor["peerAsn"]
        ),
        (
            &Value::from("tor"),
            &Value::from("Established"),
            &Value::from(3),
            &Value::from("Up"),
            &Value::from(65000)
        ),
        "{a}"
    );
    let up = tor["uptimeSeconds"].as_i64().unwrap_or(0);
    assert!((1000..1200).contains(&up), "uptime {up}");
    let yaml: Value = serde_saphyr::from_str(&kubectl_juneau_ok(&env, &["peers", "-o", "yaml"])?)?;
    let ya = yaml
        .as_array()
        .and_then(|v| v.iter().find(|n| n["node"] == "node-a"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(ya["sessions"][0]["state"], "Established", "{yaml}");
    let table = kubectl_juneau_ok(&env, &["peers"])?;
    let line = table
        .lines()
        .find(|l| l.starts_with("node-a"))
        .unwrap_or_default();
    for want in ["tor", "192.0.2.1", "65000", "Established", "3", "Up"] {
        assert!(line.contains(want), "{want} missing in: {table}");
    }
    assert!(
        table.contains("node-b: session state not current (NoNodeBGPStatus)"),
        "{table}"
    );

    // Written by server-side apply with the agent's field manager, owned by the Node.
    let obj = env.json(&[
        "get",
        "nodebgpstatus",
        "node-a",
        "-o",
        "json",
        "--show-managed-fields",
    ])?;
    let managers: Vec<(String, String, String)> = obj["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
            (s("manager"), s("operation"), s("subresource"))
        })
        .collect();
    assert!(
        managers.contains(&("juneau-agent".into(), "Apply".into(), "status".into()))
            && managers.contains(&("juneau-agent".into(), "Apply".into(), String::new())),
        "{managers:?}"
    );
    assert_eq!(obj["metadata"]["ownerReferences"][0]["kind"], "Node");
    assert_eq!(obj["status"]["establishedSessions"], 1);

    // 4. Corrupt again: the condition says so, the sessions last read stay (stale).
    write(&bgp, "not json")?;
    let a = eventually("node-a stale", || {
        Ok(node_entry(&env, "node-a")?.filter(|n| n["reason"] == "StatusFileUnreadable"))
    })?;
    assert_eq!(a["sessions"][0]["state"], "Established", "{a}");
    assert!(
        a["message"]
            .as_str()
            .unwrap_or_default()
            .contains("read at"),
        "{a}"
    );
    assert!(kubectl_juneau_ok(&env, &["peers"])?.contains("Established (stale)"));
    agent.check_running()?;
    Ok(())
}
