//! Times what the node agent does per batch of watch events at scale: copy
//! the watch caches into an [`AgentView`], [`build_node_state`], publish. N Services
//! (`type: LoadBalancer`, Juneau's class), each Ready with a VIP and 3 Ready endpoints
//! on this node, one BGPPeer and one BGPAdvertisement. "copy the caches" clones the
//! view, as the agent takes one from its watch caches: shared objects, so pointers.
//!
//! `cargo run --release -p juneau-k8s-sync --example agent_scale -- [N] [rounds]`

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use juneau_control::shm::{Capacity, NodeStateWriter};
use juneau_k8s_sync::crd::{
    BGPAdvertisement, BGPAdvertisementSpec, BGPPeer, BGPPeerSpec, Phase, ServiceLoadBalancer,
    ServiceLoadBalancerSpec, ServiceLoadBalancerStatus, LOAD_BALANCER_CLASS,
};
use juneau_k8s_sync::endpoints::SERVICE_NAME_LABEL;
use juneau_k8s_sync::node_state::{build_node_state_with, AgentView, BuildCache};
use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeStatus, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(String::from),
        ..Default::default()
    }
}

fn service(name: &str) -> Service {
    Service {
        metadata: meta(name, Some("default")),
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            load_balancer_class: Some(LOAD_BALANCER_CLASS.into()),
            external_traffic_policy: Some("Local".into()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                protocol: Some("TCP".into()),
                port: 80,
                target_port: Some(IntOrString::Int(8080)),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slb(name: &str, vip: Ipv4Addr) -> ServiceLoadBalancer {
    let mut s = ServiceLoadBalancer::new(
        name,
        ServiceLoadBalancerSpec {
            service_name: name.into(),
            external_network: None,
            requested_ip: None,
        },
    );
    s.metadata.namespace = Some("default".into());
    s.status = Some(ServiceLoadBalancerStatus {
        vip: Some(vip.to_string()),
        address_pool: Some("public-v4".into()),
        phase: Phase::Ready,
        ..Default::default()
    });
    s
}

fn slice(name: &str, i: u32, shift: u32) -> EndpointSlice {
    let mut m = meta(&format!("{name}-1"), Some("default"));
    m.labels = Some([(SERVICE_NAME_LABEL.to_string(), name.to_string())].into());
    EndpointSlice {
        metadata: m,
        address_type: "IPv4".into(),
        endpoints: (0..3)
            .map(|b| Endpoint {
                addresses: vec![Ipv4Addr::from(0x0af4_0000 + i * 4 + b + shift).to_string()],
                node_name: Some("node-a".into()),
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    }
}

fn view(n: u32) -> AgentView {
    let node = Node {
        metadata: meta("node-a", None),
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: "192.168.0.1".into(),
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let peer = BGPPeer::new(
        "tor",
        BGPPeerSpec {
            peer_address: "192.0.2.1".into(),
            peer_asn: 65000,
            local_asn: 65001,
            peer_port: None,
            source_address: None,
            node_selector: None,
            hold_time_seconds: None,
            keepalive_time_seconds: None,
            connect_retry_seconds: None,
            password_secret_ref: None,
            ebgp_multihop: None,
            graceful_restart: None,
            passive: None,
            bfd: None,
            maintenance: None,
        },
    );
    let adv = BGPAdvertisement::new(
        "public",
        BGPAdvertisementSpec {
            address_pools: vec!["public-v4".into()],
            service_selector: None,
            peer_selector: None,
            node_selector: None,
            communities: vec![],
            large_communities: vec![],
            local_pref: None,
            weighted_by_backends: None,
        },
    );
    let names: Vec<String> = (0..n).map(|i| format!("svc-{i:05}")).collect();
    AgentView {
        nodes: [("node-a".to_string(), Arc::new(node))].into(),
        slbs: names
            .iter()
            .zip(0..)
            .map(|(s, i)| Arc::new(slb(s, Ipv4Addr::from(0xcb00_0000u32 + i))))
            .collect(),
        services: names
            .iter()
            .map(|s| (format!("default/{s}"), Arc::new(service(s))))
            .collect(),
        slices: names
            .iter()
            .zip(0..)
            .map(|(s, i)| (format!("default/{s}"), vec![Arc::new(slice(s, i, 0))]))
            .collect(),
        peers: vec![Arc::new(peer)],
        advertisements: vec![Arc::new(adv)],
        secrets: Default::default(),
        secret_namespace: "juneau-system".into(),
        maintenance_triggers: Default::default(),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// CPU time of this thread (the whole batch, drops included; wall time on a shared VM
/// also counts other processes): the first field of `/proc/thread-self/schedstat`, ns.
fn thread_cpu() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = text
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u32 = args.next().map(|a| a.parse().expect("N")).unwrap_or(10_000);
    let rounds: u32 = args.next().map(|a| a.parse().expect("rounds")).unwrap_or(5);
    let mut v = view(n);
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut w = NodeStateWriter::create(dir.path().join("node-a.state"), Capacity::default())
        .expect("writer");
    let mut cache = BuildCache::default();
    let (state, warnings) = build_node_state_with("node-a", &v, &mut cache);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(state.services.len(), n as usize);
    let t = Instant::now();
    w.publish(&state).expect("publish");
    println!("{n} Services: first publish {:?}", t.elapsed());
    let (mut copy, mut build, mut compare, mut publish) = (vec![], vec![], vec![], vec![]);
    let mut cpu = vec![];
    let mut last = state;
    for r in 1..=rounds {
        let cpu0 = thread_cpu();
        // One Service's endpoints move, as one watch event would.
        let key = format!("default/svc-{:05}", n / 2);
        v.slices.insert(
            key,
            vec![Arc::new(slice(
                &format!("svc-{:05}", n / 2),
                n / 2,
                r * 1000,
            ))],
        );
        let t = Instant::now();
        let snapshot = v.clone();
        copy.push(t.elapsed());
        let t = Instant::now();
        let (state, _) = build_node_state_with("node-a", &snapshot, &mut cache);
        build.push(t.elapsed());
        let t = Instant::now();
        assert!(state != last);
        compare.push(t.elapsed());
        let t = Instant::now();
        w.publish(&state).expect("publish");
        publish.push(t.elapsed());
        last = state;
        drop(snapshot);
        cpu.push(thread_cpu() - cpu0);
    }
    println!(
        "per batch (medians of {rounds}): copy the caches {:?}, build_node_state {:?}, compare {:?}, publish {:?}; CPU of the whole batch {:?} (mean: the counter moves at scheduler ticks)",
        median(copy),
        median(build),
        median(compare),
        median(publish),
        cpu.iter().sum::<Duration>() / rounds
    );
}
