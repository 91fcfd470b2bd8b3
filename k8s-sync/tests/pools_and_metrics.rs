//! AddressPools and the controller's bookkeeping against a real kube-apiserver, with the
//! real controller and agent binaries on their ServiceAccounts' tokens:
//!
//! * overlapping AddressPools (198.18.0.0/30 and 198.18.0.0/29, as seen in a user's cluster) get
//!   the `Overlapping` condition and a Warning Event each;
//! * AddressPool status counts addresses total / allocated;
//! * freed VIPs go to the waiting Services in the order they were created;
//! * the controller's and the agent's /metrics, /healthz and /readyz answer with the
//!   values of what the test did.

mod common;

use std::time::Duration;

use anyhow::{ensure, Result};
use common::*;

const POOLS: &str = "apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: small}
spec: {advertiseMode: bgp, addresses: [198.18.0.0/30]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: big}
spec: {advertiseMode: bgp, addresses: [198.18.0.0/29]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: tiny}
spec: {advertiseMode: bgp, addresses: [198.18.1.1-198.18.1.2]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: ExternalNetwork
metadata: {name: tiny}
spec: {type: bgp, addressPools: [tiny]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: BGPAdvertisement
metadata: {name: all}
spec: {}
";

fn tiny_service(name: &str) -> String {
    service(name, &[], "").replace(
        "juneau.loutres.me/load-balancer-external-network: public",
        "juneau.loutres.me/load-balancer-external-network: tiny",
    )
}

fn pool_status(env: &Env, name: &str) -> Result<serde_json::Value> {
    Ok(env
        .get("addresspool", name, None)?
        .map(|p| p["status"].clone())
        .unwrap_or_default())
}

fn overlap_events(env: &Env, pool: &str) -> Result<Vec<String>> {
    let v = env.json(&[
        "get",
        "events.events.k8s.io",
        "-A",
        "--field-selector",
        &format!("regarding.name={pool},regarding.kind=AddressPool"),
    ])?;
    Ok(v["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["reason"] == "AddressPoolOverlap" && e["type"] == "Warning")
        .map(|e| e["note"].as_str().unwrap_or_default().to_string())
        .collect())
}

#[test]
fn overlap_usage_creation_order_and_metrics() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.61.1"), ("node-b", "192.168.61.2")])?;
    env.kubectl(&[
        "label",
        "node",
        "node-b",
        "node.kubernetes.io/exclude-from-external-load-balancers=",
    ])?;
    env.apply(POOLS)?;
    let mut ctl = env.controller("c1")?;
    let state = tempfile::tempdir()?;
    let mut agent = env.agent("node-a", &state.path().join("node-a.state"))?;

    // 1. Overlapping pools: a condition naming the other pool and the shared range, and
    //    a Warning Event, on both; the disjoint pool is clean.
    for (pool, other) in [("small", "big"), ("big", "small")] {
        let st = eventually(&format!("{pool} reports the overlap"), || {
            let st = pool_status(&env, pool)?;
            Ok(st["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Overlapping"))
                .filter(|c| c["status"] == "True")
                .cloned())
        })?;
        assert_eq!(st["reason"], "AddressesOverlap");
        let msg = st["message"].as_str().unwrap_or_default();
        ensure!(
            msg.contains(&format!("AddressPool {other}")) && msg.contains("198.18.0.1-198.18.0.2"),
            "{msg}"
        );
        let ev = eventually(&format!("an AddressPoolOverlap Event on {pool}"), || {
            let e = overlap_events(&env, pool)?;
            Ok((!e.is_empty()).then_some(e))
        })?;
        ensure!(ev[0].contains(other), "{ev:?}");
    }
    let tiny = eventually("tiny's status", || {
        let st = pool_status(&env, "tiny")?;
        Ok((st["addressesTotal"] == 2).then_some(st))
    })?;
    assert_eq!(tiny["addressesAllocated"], 0);
    assert_eq!(tiny["conditions"][0]["status"], "False");
    assert_eq!(pool_status(&env, "big")?["addressesTotal"], 6);

    // 2. Two Services fill `tiny`; four more wait, created one after the other.
    for n in ["o1", "o2"] {
        env.apply(&tiny_service(n))?;
        eventually(&format!("{n} holds a VIP"), || ingress_ip(&env, n))?;
    }
    eventually("tiny: 2 of 2 allocated", || {
        Ok((pool_status(&env, "tiny")?["addressesAllocated"] == 2).then_some(()))
    })?;
    let waiters = ["w3", "w4", "w5", "w6"];
    for n in waiters {
        env.apply(&tiny_service(n))?;
        eventually(&format!("{n} waits for an address"), || {
            Ok(slb_status(&env, n)?.filter(|s| {
                s["conditions"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c["reason"] == "AddressPoolExhausted"))
            }))
        })?;
        // Creation timestamps have one-second resolution.
        std::thread::sleep(Duration::from_millis(1100));
    }
    // Both holders go at once: the two addresses must go to w3 and w4, although w6 and
    // w5 are poked (annotated) over and over meanwhile, so they are reconciled first
    // and most often.
    env.kubectl(&[
        "delete",
        "service",
        "o1",
        "o2",
        "-n",
        "default",
        "--wait=false",
    ])?;
    for i in 0..10 {
        for n in ["w6", "w5"] {
            env.kubectl(&[
                "annotate",
                "service",
                n,
                "-n",
                "default",
                "--overwrite",
                &format!("test.juneau.loutres.me/poke={i}"),
            ])?;
        }
    }
    let shown = eventually("both freed VIPs handed out", || {
        let mut all = Vec::new();
        for n in waiters {
            all.push(ingress_ip(&env, n)?);
        }
        Ok((all.iter().flatten().count() == 2).then_some(all))
    })?;
    ensure!(
        shown[0].is_some() && shown[1].is_some() && shown[0] != shown[1],
        "the freed VIPs went to younger Services: w3..w6 = {shown:?}"
    );
    std::thread::sleep(Duration::from_secs(3));
    for n in ["w5", "w6"] {
        assert_eq!(ingress_ip(&env, n)?, None, "{n} must still wait");
    }
    let w6 = slb_status(&env, "w6")?.unwrap_or_default();
    let msg = w6["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "VIPAllocated").cloned())
        .unwrap_or_default();
    assert_eq!(msg["reason"], "AddressPoolExhausted", "{msg}");

    // 3. Metrics of what happened, and the probes.
    env.apply(&endpoint_slice(
        "w3",
        "w3-1",
        &[
            ("10.244.1.5", "node-a", true, false),
            ("10.244.1.6", "node-a", true, false),
            ("10.244.1.7", "node-b", true, false),
        ],
        8080,
    ))?;
    let page = eventually("controller metrics with pool usage", || {
        let (code, page) = http_get(ctl.metrics_port, "/metrics")?;
        ensure!(code == 200, "GET /metrics: {code}");
        let w3_backends = page
            .lines()
            .find(|l| {
                l.starts_with("juneau_service_ready_backends{namespace=\"default\",service=\"w3\",")
            })
            .and_then(|l| l.rsplit(' ').next())
            .map(String::from);
        Ok(
            (sample(&page, "juneau_address_pool_addresses_in_use{pool=\"tiny\"}") == Some(2.0)
                && w3_backends.as_deref() == Some("3"))
            .then_some(page),
        )
    })?;
    assert_eq!(
        sample(&page, "juneau_address_pool_addresses{pool=\"tiny\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample(&page, "juneau_address_pool_addresses{pool=\"big\"}"),
        Some(6.0)
    );
    assert_eq!(sample(&page, "juneau_controller_is_leader"), Some(1.0));
    ensure!(
        sample(&page, "juneau_controller_vip_allocations_total").unwrap_or(0.0) >= 4.0,
        "{page}"
    );
    ensure!(
        sample(&page, "juneau_controller_vip_releases_total").unwrap_or(0.0) >= 2.0,
        "{page}"
    );
    ensure!(
        sample(&page, "juneau_controller_reconciles_total").unwrap_or(0.0) >= 6.0,
        "{page}"
    );
    ensure!(
        page.contains("juneau_controller_reconcile_duration_seconds_bucket"),
        "{page}"
    );
    assert_eq!(http_get(ctl.metrics_port, "/healthz")?.0, 200);
    assert_eq!(http_get(ctl.metrics_port, "/readyz")?.0, 200);

    let page = eventually("agent metrics with w3's two backends", || {
        let (_, page) = http_get(agent.metrics_port, "/metrics")?;
        Ok((sample(&page, "juneau_agent_backends") == Some(2.0)).then_some(page))
    })?;
    // w3 and w4 hold VIPs: one entry each (w4 without local backends).
    assert_eq!(sample(&page, "juneau_agent_services"), Some(2.0), "{page}");
    ensure!(
        sample(&page, "juneau_agent_state_publishes_total").unwrap_or(0.0) >= 1.0,
        "{page}"
    );
    ensure!(
        sample(&page, "juneau_agent_publish_latency_seconds_count").unwrap_or(0.0) >= 1.0,
        "{page}"
    );
    assert_eq!(
        sample(&page, "juneau_agent_advertised_vips"),
        Some(1.0),
        "{page}"
    );
    assert_eq!(http_get(agent.metrics_port, "/readyz")?.0, 200);
    assert_eq!(http_get(agent.metrics_port, "/healthz")?.0, 200);

    // 4. `kubectl juneau` through the real kubectl.
    plugin_reports(&env)?;
    ctl.check_running()?;
    agent.check_running()?;
    Ok(())
}

fn plugin_reports(env: &Env) -> Result<()> {
    // status: every Juneau Service, in JSON and as a table.
    let rows: serde_json::Value =
        serde_json::from_str(&kubectl_juneau_ok(env, &["status", "-o", "json"])?)?;
    let by: std::collections::BTreeMap<String, serde_json::Value> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["service"].as_str().unwrap().to_string(), r.clone()))
        .collect();
    assert_eq!(
        by.keys().cloned().collect::<Vec<_>>(),
        ["w3", "w4", "w5", "w6"]
    );
    assert_eq!(by["w3"]["phase"], "Ready");
    assert_eq!(by["w3"]["advertisingNodes"], serde_json::json!(["node-a"]));
    assert_eq!(by["w5"]["phase"], "Pending");
    assert_eq!(by["w5"]["vip"], serde_json::Value::Null);
    let table = kubectl_juneau_ok(env, &["status"])?;
    ensure!(
        table.starts_with("NAMESPACE") && table.contains("w3") && table.contains("node-a"),
        "{table}"
    );
    // pools: usage and overlaps, in YAML.
    let pools: serde_json::Value =
        serde_saphyr::from_str(&kubectl_juneau_ok(env, &["pools", "-o", "yaml"])?)?;
    let tiny = pools
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == "tiny")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (tiny["total"].as_u64(), tiny["allocated"].as_u64()),
        (Some(2), Some(2)),
        "{pools}"
    );
    assert_eq!(tiny["usedPercent"], 100);
    // Which Services hold its two addresses, and that it hands them out on its own.
    assert_eq!(
        (
            tiny["services"].as_array().map(Vec::len),
            &tiny["autoAssign"]
        ),
        (Some(2), &serde_json::json!(true)),
        "{pools}"
    );
    let small = pools
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == "small")
        .cloned()
        .unwrap_or_default();
    assert_eq!(small["overlapsWith"], serde_json::json!(["big"]));
    // why: per node, the precise reason.
    let w3 = kubectl_juneau_ok(env, &["why", "w3", "-n", "default"])?;
    let line = |node: &str| {
        w3.lines()
            .find(|l| l.starts_with(node))
            .unwrap_or_default()
            .to_string()
    };
    ensure!(line("node-a").contains("Advertising"), "{w3}");
    ensure!(line("node-b").contains("ExcludedByLabel"), "{w3}");
    ensure!(w3.contains("Not checked:"), "{w3}");
    let w4: serde_json::Value =
        serde_json::from_str(&kubectl_juneau_ok(env, &["why", "w4", "-o", "json"])?)?;
    let verdicts: Vec<(String, String)> = w4["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["node"].as_str().unwrap().into(),
                n["reason"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        verdicts,
        vec![
            ("node-a".to_string(), "NoLocalBackend".to_string()),
            ("node-b".to_string(), "ExcludedByLabel".to_string())
        ]
    );
    let w5 = kubectl_juneau_ok(env, &["why", "w5"])?;
    ensure!(w5.contains("Problem: AddressPoolExhausted"), "{w5}");
    let missing = kubectl_juneau(env, &["why", "nope"])?;
    ensure!(!missing.status.success());
    ensure!(
        String::from_utf8_lossy(&missing.stderr).contains("has no ServiceLoadBalancer"),
        "{missing:?}"
    );
    // peers: node-a's agent runs without a speaker: its session state is said to be
    // missing, and why (k8s-sync/tests/peers_status.rs covers the rest).
    eventually("peers: node-a StatusFileMissing", || {
        let peers: serde_json::Value =
            serde_json::from_str(&kubectl_juneau_ok(env, &["peers", "-o", "json"])?)?;
        Ok(peers
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["node"] == "node-a" && n["reason"] == "StatusFileMissing")
            .then_some(()))
    })?;
    let text = kubectl_juneau_ok(env, &["peers"])?;
    ensure!(
        text.contains("node-a: session state not current (StatusFileMissing)"),
        "{text}"
    );
    Ok(())
}
