//! Graceful drain in the control state, against a real kube-apiserver with the real
//! controller and agent: an endpoint that is `terminating` — serving or not (a Pod that
//! fails readiness while it shuts down) — reaches the node's shared-memory table as
//! terminating (existing flows only, never in the Maglev table), and a node whose local
//! endpoints are all terminating keeps the frontend but stops advertising the VIP.

mod common;

use std::net::Ipv4Addr;
use std::path::Path;

use anyhow::Result;
use common::*;
use juneau_control::shm::{NodeStateReader, Snapshot};
use juneau_control::LocalBackend;

/// An EndpointSlice of `nginx` with endpoints (ip, node, ready, serving, terminating).
fn slice(eps: &[(&str, &str, bool, bool, bool)]) -> String {
    let mut s = String::from(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: nginx-1
  namespace: default
  labels:
    kubernetes.io/service-name: nginx
    endpointslice.kubernetes.io/managed-by: juneau-tests
addressType: IPv4
ports:
  - name: http
    protocol: TCP
    port: 8080
endpoints:
",
    );
    for (ip, node, ready, serving, term) in eps {
        s.push_str(&format!(
            "  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    conditions: {{ready: {ready}, serving: {serving}, terminating: {term}}}\n"
        ));
    }
    s
}

fn snapshot(path: &Path) -> Result<Option<Snapshot>> {
    if !path.exists() {
        return Ok(None);
    }
    Ok(NodeStateReader::open(path)?.snapshot().ok())
}

fn b(ip: &str) -> LocalBackend {
    LocalBackend {
        ip: ip.parse::<Ipv4Addr>().unwrap(),
        port: 8080,
    }
}

#[test]
fn terminating_endpoints_drain_and_only_ready_ones_advertise() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.80.1"), ("node-c", "192.168.80.3")])?;
    let _controller = env.controller("drain-test")?;
    env.apply(SEED_NETWORK)?;
    env.apply(&service("nginx", &[], ""))?;
    // node-a: one Ready endpoint and one being deleted that still serves (what the
    // EndpointSlice controller reports during a rolling update); one terminating that no
    // longer serves (it keeps its connections too). node-c: one Ready.
    env.apply(&slice(&[
        ("10.244.1.10", "node-a", true, true, false),
        ("10.244.1.11", "node-a", false, true, true),
        ("10.244.1.12", "node-a", false, false, true),
        ("10.244.3.10", "node-c", true, true, false),
    ]))?;
    let dir = tempfile::tempdir()?;
    let shm_a = dir.path().join("node-a.state");
    let mut agent = env.agent("node-a", &shm_a)?;

    let s = eventually("node-a's table with a draining backend", || {
        agent.check_running()?;
        Ok(snapshot(&shm_a)?
            .filter(|s| s.state.services.len() == 1 && !s.state.services[0].terminating.is_empty()))
    })?;
    let svc = &s.state.services[0];
    assert_eq!(svc.backends, vec![b("10.244.1.10")]);
    assert_eq!(svc.terminating, vec![b("10.244.1.11"), b("10.244.1.12")]);
    // The Maglev table names only the Ready backend.
    assert!(s.maglev[0]
        .iter()
        .all(|i| *i == 0 || *i == juneau_control::maglev::NO_BACKEND));
    assert_eq!(s.state.advertised.len(), 1, "node-a has a Ready endpoint");
    let vip = s.state.advertised[0].vip;

    // The rolling update goes on: node-a's Ready endpoint is now terminating too.
    env.apply(&slice(&[
        ("10.244.1.10", "node-a", false, true, true),
        ("10.244.1.11", "node-a", false, true, true),
        ("10.244.3.10", "node-c", true, true, false),
    ]))?;
    let s = eventually("node-a to stop advertising and drain both", || {
        agent.check_running()?;
        Ok(snapshot(&shm_a)?.filter(|s| s.state.advertised.is_empty()))
    })?;
    let svc = &s.state.services[0];
    assert_eq!(svc.frontend.vip, vip, "the frontend stays programmed");
    assert!(svc.backends.is_empty());
    assert_eq!(svc.terminating, vec![b("10.244.1.10"), b("10.244.1.11")]);
    // The controller agrees: only node-c advertises.
    let st = eventually("advertising nodes = node-c", || {
        Ok(slb_status(&env, "nginx")?.filter(|s| strs(&s["advertisingNodes"]) == ["node-c"]))
    })?;
    assert_eq!(st["backendSummary"]["totalReady"], 1);

    // The endpoints are gone: nothing left to drain.
    env.apply(&slice(&[("10.244.3.10", "node-c", true, true, false)]))?;
    eventually("node-a's draining backends gone", || {
        Ok(snapshot(&shm_a)?.filter(|s| s.state.services[0].terminating.is_empty()))
    })?;
    agent.check_running()?;
    Ok(())
}
