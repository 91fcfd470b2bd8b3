//! Shared VIPs against a real kube-apiserver, with the real controller and agent:
//! Services of one namespace with the same `juneau.loutres.me/allow-shared-ip` key hold
//! one VIP (DNS over TCP and UDP on port 53); a served Service that takes a key brings
//! its VIP to the group; a third that wants 53/TCP too gets no VIP,
//! a `SharedIPPortConflict` condition and Warning, and the others are untouched; a new
//! controller (leader change) finds the group's VIP again; when the older holder of the
//! port goes, the newcomer is served on the same VIP; when the last member goes the VIP
//! is free again. Node-a's agent publishes one announcement for the VIP and both
//! frontends — the UDP one, whose Pod runs on node-c, without a backend, marked to hand
//! connections on.

mod common;

use std::path::Path;

use anyhow::{ensure, Result};
use common::*;
use juneau_control::shm::{NodeStateReader, Snapshot};

const KEY: &str = "juneau.loutres.me/allow-shared-ip";

/// A Local-policy Service `name` on `proto`/`port`, sharing `key` when given.
fn shared(name: &str, key: Option<&str>, proto: &str, port: u16) -> String {
    let share = key.map_or(String::new(), |k| format!("    {KEY}: {k}\n"));
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
  annotations:
    juneau.loutres.me/load-balancer-external-network: public
{share}spec:
  type: LoadBalancer
  loadBalancerClass: juneau.loutres.me/load-balancer
  externalTrafficPolicy: Local
  selector: {{app: {name}}}
  ports:
    - {{name: dns, protocol: {proto}, port: {port}, targetPort: 5353}}
"
    )
}

/// An EndpointSlice of `svc` with one Ready endpoint `ip` on `node`.
fn slice(svc: &str, proto: &str, ip: &str, node: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {svc}-1
  namespace: default
  labels:
    kubernetes.io/service-name: {svc}
    endpointslice.kubernetes.io/managed-by: juneau-tests
addressType: IPv4
ports: [{{name: dns, protocol: {proto}, port: 5353}}]
endpoints:
  - addresses: [\"{ip}\"]
    nodeName: {node}
    conditions: {{ready: true, serving: true, terminating: false}}
"
    )
}

/// The VIP the Service shows (`.status.loadBalancer.ingress[0].ip`).
fn ingress(env: &Env, name: &str) -> Result<Option<String>> {
    Ok(env.get("service", name, Some("default"))?.and_then(|s| {
        s["status"]["loadBalancer"]["ingress"][0]["ip"]
            .as_str()
            .map(String::from)
    }))
}

fn snapshot(path: &Path) -> Result<Option<Snapshot>> {
    if !path.exists() {
        return Ok(None);
    }
    Ok(NodeStateReader::open(path)?.snapshot().ok())
}

#[test]
fn services_sharing_a_key_share_one_vip_and_a_colliding_port_is_refused() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.81.1"), ("node-c", "192.168.81.3")])?;
    env.apply(SEED_NETWORK)?;
    let mut controller = env.controller("share-1")?;
    env.apply(&shared("dns-tcp", Some("dns"), "TCP", 53))?;
    env.apply(&shared("dns-udp", Some("dns"), "UDP", 53))?;
    env.apply(&shared("web", None, "TCP", 53))?;
    env.apply(&slice("dns-tcp", "TCP", "10.244.1.53", "node-a"))?;
    env.apply(&slice("dns-udp", "UDP", "10.244.3.53", "node-c"))?;
    let vip_of = |name: &str| eventually(&format!("{name}'s VIP"), || ingress(&env, name));
    let vip = vip_of("dns-tcp")?;
    assert_eq!(vip_of("dns-udp")?, vip, "one VIP for the group");
    assert_ne!(
        vip_of("web")?,
        vip,
        "an unshared Service on the same port gets its own"
    );

    // A served Service that takes a key keeps its VIP; the next member joins it there.
    // (A lower address is free by then: a new allocation would take it, not solo's.)
    env.apply(&shared("gap", None, "TCP", 7070))?;
    vip_of("gap")?;
    env.apply(&shared("solo", None, "TCP", 8080))?;
    let solo = vip_of("solo")?;
    env.kubectl(&["delete", "service", "gap", "--wait=true"])?;
    env.kubectl(&["annotate", "service", "solo", &format!("{KEY}=pair")])?;
    env.apply(&shared("pair", Some("pair"), "TCP", 9090))?;
    assert_eq!(
        vip_of("pair")?,
        solo,
        "the first member brought its VIP along"
    );
    assert_eq!(ingress(&env, "solo")?.as_ref(), Some(&solo));

    // A newcomer on 53/TCP: refused, said, nothing half-served.
    env.apply(&shared("dns-late", Some("dns"), "TCP", 53))?;
    let st = eventually("dns-late refused", || {
        Ok(slb_status(&env, "dns-late")?.filter(|s| s["phase"] == "Failed"))
    })?;
    ensure!(
        st["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| {
                c["reason"] == "SharedIPPortConflict"
                    && c["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("default/dns-tcp"))
            })),
        "{st}"
    );
    eventually("a SharedIPPortConflict Warning on dns-late", || {
        Ok(env
            .events("default", "dns-late")?
            .into_iter()
            .find(|(kind, reason, _)| kind == "Warning" && reason == "SharedIPPortConflict"))
    })?;
    assert_eq!(ingress(&env, "dns-late")?, None);
    assert_eq!(
        ingress(&env, "dns-tcp")?.as_ref(),
        Some(&vip),
        "the others untouched"
    );

    // Node-a: one announcement of the VIP, both frontends of the group.
    let dir = tempfile::tempdir()?;
    let shm_a = dir.path().join("node-a.state");
    let mut agent = env.agent("node-a", &shm_a)?;
    let s = eventually(
        "node-a's state with both frontends of the shared VIP",
        || {
            agent.check_running()?;
            Ok(snapshot(&shm_a)?.filter(|s| {
                s.state
                    .services
                    .iter()
                    .filter(|x| x.frontend.vip.to_string() == vip)
                    .count()
                    == 2
            }))
        },
    )?;
    let on_vip: Vec<_> = s
        .state
        .advertised
        .iter()
        .filter(|a| a.vip.to_string() == vip)
        .collect();
    assert_eq!(
        on_vip.len(),
        1,
        "one announcement: {:?}",
        s.state.advertised
    );
    for x in s
        .state
        .services
        .iter()
        .filter(|x| x.frontend.vip.to_string() == vip)
    {
        let udp = x.frontend.protocol == juneau_control::Protocol::Udp;
        assert_eq!(x.backends.is_empty(), udp, "{x:?}");
        assert_eq!(x.hand_off, udp, "the UDP port's Pod is elsewhere: {x:?}");
    }

    // Another leader rebuilds its book from the records: a new member joins the same
    // VIP, the others keep it.
    controller.kill();
    let _controller = env.controller("share-2")?;
    env.apply(&shared("dns-tls", Some("dns"), "TCP", 853))?;
    assert_eq!(
        vip_of("dns-tls")?,
        vip,
        "the new leader found the group's VIP"
    );
    assert_eq!(ingress(&env, "dns-udp")?.as_ref(), Some(&vip));
    assert_eq!(ingress(&env, "dns-tcp")?.as_ref(), Some(&vip));

    // The port's older holder goes: the newcomer is served, on the group's VIP.
    env.kubectl(&["delete", "service", "dns-tcp", "--wait=true"])?;
    assert_eq!(vip_of("dns-late")?, vip);
    assert_eq!(
        ingress(&env, "dns-udp")?.as_ref(),
        Some(&vip),
        "dns-udp kept it throughout"
    );

    // The last members go: the VIP is free for anyone.
    env.kubectl(&[
        "delete",
        "service",
        "dns-udp",
        "dns-late",
        "dns-tls",
        "--wait=true",
    ])?;
    env.apply(&shared("next", None, "TCP", 8053).replace(
        "    juneau.loutres.me/load-balancer-external-network: public\n",
        &format!(
            "    juneau.loutres.me/load-balancer-external-network: public\n    juneau.loutres.me/load-balancer-requested-ip: \"{vip}\"\n"
        ),
    ))?;
    assert_eq!(
        vip_of("next")?,
        vip,
        "the released VIP goes to the next asker"
    );
    agent.check_running()?;
    Ok(())
}
