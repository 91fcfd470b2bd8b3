//! IPv6 frontends in the node state (issue 28) against a real kube-apiserver, with the
//! real agent and no controller (the agent alone: the test control plane is IPv4-only,
//! where the controller gets no dual-stack Service to serve): the ServiceLoadBalancer's
//! status is written as the controller writes it for a dual-stack Service (`status.vips`, one VIP per family,
//! each with its pool), the Service has an IPv4 and an IPv6 EndpointSlice, and the
//! agent publishes both families' frontends into the node state file (layout 10) and
//! announces the IPv6 VIP while the node has a Ready IPv6 backend.

mod common;

use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;

use anyhow::{ensure, Result};
use common::*;
use juneau_control::shm::{NodeStateReader, Snapshot};
use juneau_control::LocalBackend6;

const VIP6: &str = "2001:db8:ffff::10";

/// The IPv6 pool and a BGPAdvertisement of it (beside SEED_NETWORK's IPv4 ones).
const IPV6_POOL: &str = "apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: public-v6}
spec: {advertiseMode: bgp, addresses: [2001:db8:ffff::/64]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: BGPAdvertisement
metadata: {name: public-v6}
spec:
  addressPools: [public-v6]
  communities: [\"64512:600\"]
";

const SLB: &str = "apiVersion: juneau.loutres.me/v1alpha1
kind: ServiceLoadBalancer
metadata: {name: nginx, namespace: default}
spec: {serviceName: nginx, externalNetwork: public}
";

const STATUS: &str = r#"{"status": {"vip": "203.0.113.10", "addressPool": "public-v4",
  "vips": [{"family": "IPv4", "ip": "203.0.113.10", "addressPool": "public-v4"},
           {"family": "IPv6", "ip": "2001:db8:ffff::10", "addressPool": "public-v6"}],
  "phase": "Ready"}}"#;

/// An `addressType: IPv6` EndpointSlice of `nginx` (ip, node, ready, terminating).
fn slice6(eps: &[(&str, &str, bool, bool)]) -> String {
    endpoint_slice("nginx", "nginx-v6", eps, 8080).replace("addressType: IPv4", "addressType: IPv6")
}

fn snapshot(path: &Path) -> Result<Option<Snapshot>> {
    if !path.exists() {
        return Ok(None);
    }
    Ok(NodeStateReader::open(path)?.snapshot().ok())
}

fn b6(ip: &str) -> LocalBackend6 {
    LocalBackend6 {
        ip: ip.parse().unwrap(),
        port: 8080,
    }
}

#[test]
fn a_dual_stack_record_gives_ipv6_frontends_and_announcements() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.81.1")])?;
    env.apply(SEED_NETWORK)?;
    env.apply(IPV6_POOL)?;
    env.apply(&service("nginx", &[], ""))?;
    env.apply(SLB)?;
    env.kubectl(&[
        "patch",
        "serviceloadbalancer",
        "nginx",
        "-n",
        "default",
        "--type=merge",
        "-p",
        STATUS,
    ])?;
    env.apply(&endpoint_slice(
        "nginx",
        "nginx-v4",
        &[("10.244.1.10", "node-a", true, false)],
        8080,
    ))?;
    env.apply(&slice6(&[
        ("fd00:244::10", "node-a", true, false),
        ("fd00:244::11", "node-a", true, true),
        ("fd00:244::30", "node-c", true, false),
    ]))?;
    let dir = tempfile::tempdir()?;
    let shm_a = dir.path().join("node-a.state");
    let mut agent = env.agent("node-a", &shm_a)?;

    let s = eventually("node-a's table with both families announced", || {
        agent.check_running()?;
        Ok(snapshot(&shm_a)?.filter(|s| s.state.advertised.len() == 2))
    })?;
    ensure!(s.state.services.len() == 1, "{:?}", s.state.services);
    ensure!(s.state.services6.len() == 1, "{:?}", s.state.services6);
    let svc6 = &s.state.services6[0];
    ensure!(
        svc6.frontend.to_string() == "TCP/[2001:db8:ffff::10]:80",
        "{}",
        svc6.frontend
    );
    ensure!(
        svc6.backends == vec![b6("fd00:244::10")],
        "{:?}",
        svc6.backends
    );
    ensure!(
        svc6.terminating == vec![b6("fd00:244::11")],
        "{:?}",
        svc6.terminating
    );
    let i = s.service_index6(&svc6.frontend).expect("indexed");
    ensure!((0..64).all(|h| s.pick6(i, h) == Some(b6("fd00:244::10"))));
    let vip6: Ipv6Addr = VIP6.parse()?;
    let v6 = s
        .state
        .advertised
        .iter()
        .find(|a| a.vip == IpAddr::V6(vip6))
        .expect("the IPv6 VIP is announced");
    // Its own pool's advertisement: 64512:600, not the IPv4 pool's 64512:100.
    ensure!(
        v6.communities == vec![64512 << 16 | 600],
        "{:?}",
        v6.communities
    );

    // node-a's IPv6 endpoint stops being Ready: the IPv6 VIP is withdrawn, the IPv4 one
    // stays, and the frontend keeps the draining backends.
    env.apply(&slice6(&[
        ("fd00:244::10", "node-a", false, false),
        ("fd00:244::11", "node-a", true, true),
        ("fd00:244::30", "node-c", true, false),
    ]))?;
    let s = eventually("node-a to announce its IPv4 VIP only", || {
        agent.check_running()?;
        Ok(snapshot(&shm_a)?.filter(|s| s.state.advertised.len() == 1))
    })?;
    ensure!(s.state.advertised[0].vip == IpAddr::from([203, 0, 113, 10]));
    ensure!(s.state.services6[0].backends.is_empty());
    ensure!(
        s.state.services6[0].terminating == vec![b6("fd00:244::10"), b6("fd00:244::11")],
        "{:?}",
        s.state.services6[0].terminating
    );
    agent.check_running()?;
    Ok(())
}
