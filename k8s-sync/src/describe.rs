//! `kubectl juneau describe loadbalancer`: the tree an operator reads, rendered from the
//! live ServiceLoadBalancer, its Service, its ExternalNetwork and EndpointSlices.

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::crd::{ExternalNetwork, Phase, ServiceLoadBalancer};

/// The target port shown for a Service port: a number resolved from the EndpointSlices
/// for named target ports (the slice port carrying the Service port's name), else the
/// name itself.
fn target_port(
    svc_port: &k8s_openapi::api::core::v1::ServicePort,
    slices: &[EndpointSlice],
) -> String {
    match &svc_port.target_port {
        None => svc_port.port.to_string(),
        Some(IntOrString::Int(p)) => p.to_string(),
        Some(IntOrString::String(name)) => {
            let sp_name = svc_port.name.clone().unwrap_or_default();
            let mut found: Vec<i32> = slices
                .iter()
                .flat_map(|s| s.ports.iter().flatten())
                .filter(|p| p.name.clone().unwrap_or_default() == sp_name)
                .filter_map(|p| p.port)
                .collect();
            found.sort_unstable();
            found.dedup();
            if found.is_empty() {
                name.clone()
            } else {
                found
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            }
        }
    }
}

/// Renders the tree. `net` is the ExternalNetwork the ServiceLoadBalancer names (None
/// when it names none or it does not exist).
pub fn render(
    slb: &ServiceLoadBalancer,
    svc: Option<&Service>,
    net: Option<&ExternalNetwork>,
    slices: &[EndpointSlice],
) -> String {
    let ns = slb.metadata.namespace.as_deref().unwrap_or("default");
    let name = slb.metadata.name.as_deref().unwrap_or_default();
    let st = slb.status.clone().unwrap_or_default();
    let mut out = String::new();
    // A dual-stack Service shows both VIPs, in its family order; one VIP as the guide.
    if st.vips.len() > 1 {
        let vips: Vec<&str> = st.vips.iter().map(|v| v.ip.as_str()).collect();
        out.push_str(&format!(
            "ServiceLoadBalancer  {ns}/{name}  (vips: {}, phase: {})\n",
            vips.join(", "),
            st.phase
        ));
    } else {
        out.push_str(&format!(
            "ServiceLoadBalancer  {ns}/{name}  (vip: {}, phase: {})\n",
            st.vip.as_deref().unwrap_or("<none>"),
            st.phase
        ));
    }
    match svc {
        Some(s) => {
            let spec = s.spec.clone().unwrap_or_default();
            out.push_str(&format!(
                "├── parent Service  {ns}/{}  (type={}, externalTrafficPolicy={})\n",
                s.metadata.name.as_deref().unwrap_or_default(),
                spec.type_.as_deref().unwrap_or("ClusterIP"),
                spec.external_traffic_policy.as_deref().unwrap_or("Cluster"),
            ));
        }
        None => out.push_str(&format!(
            "├── parent Service  {ns}/{}  (not found)\n",
            slb.spec.service_name
        )),
    }
    let net_name = st
        .external_network
        .clone()
        .or_else(|| slb.spec.external_network.clone());
    match (net_name, net) {
        (Some(n), Some(net)) => out.push_str(&format!(
            "├── ExternalNetwork  {n}  type=bgp  pools={}\n",
            net.spec.address_pools.join(",")
        )),
        (Some(n), None) => out.push_str(&format!("├── ExternalNetwork  {n}  (not found)\n")),
        (None, _) => out.push_str(
            "├── ExternalNetwork  <none>  (the Service has no external-network annotation)\n",
        ),
    }
    match &st.address_pool {
        _ if st.vips.len() > 1 => {
            let from: Vec<String> = st
                .vips
                .iter()
                .map(|v| format!("AddressPool/{} ({} {})", v.address_pool, v.family, v.ip))
                .collect();
            out.push_str(&format!("├── AllocatedFrom  {}\n", from.join(", ")));
        }
        Some(p) => out.push_str(&format!("├── AllocatedFrom  AddressPool/{p}\n")),
        None => out.push_str("├── AllocatedFrom  <none>\n"),
    }
    out.push_str("├── Ports\n");
    let ports: Vec<_> = svc
        .and_then(|s| s.spec.as_ref())
        .and_then(|s| s.ports.clone())
        .unwrap_or_default();
    for (i, p) in ports.iter().enumerate() {
        let branch = if i + 1 == ports.len() {
            "└──"
        } else {
            "├──"
        };
        out.push_str(&format!(
            "│   {branch} {}/{}  ->  {}\n",
            p.protocol.as_deref().unwrap_or("TCP"),
            p.port,
            target_port(p, slices)
        ));
    }
    // Only when set (the guide's tree has none): the clients the dataplane admits.
    if let Some(Ok(ranges)) = svc.map(crate::source_ranges::of_service) {
        if !ranges.is_empty() {
            let shown: Vec<String> = ranges.iter().map(|r| r.to_string()).collect();
            out.push_str(&format!(
                "├── SourceRanges  {}  (other clients are dropped)\n",
                shown.join(", ")
            ));
        }
    }
    out.push_str(&forwarding(svc));
    out.push_str(&format!(
        "├── AdvertisingNodes  ({})\n",
        st.advertising_nodes.len()
    ));
    for (i, n) in st.advertising_nodes.iter().enumerate() {
        let branch = if i + 1 == st.advertising_nodes.len() {
            "└──"
        } else {
            "├──"
        };
        out.push_str(&format!("│   {branch} {n}\n"));
    }
    if st.phase != Phase::Ready {
        for c in st
            .conditions
            .iter()
            .filter(|c| c.status == "False" && c.type_ != "Ready")
        {
            out.push_str(&format!("├── Problem  {}: {}\n", c.reason, c.message));
        }
    }
    out.push_str(&format!(
        "└── Backends  totalReady={}  localReadyNodes={}\n",
        st.backend_summary.total_ready, st.backend_summary.local_ready_nodes
    ));
    out
}

/// How connections reach the Pods, when it is not the guide's Local policy alone (the
/// guide's tree has no such line): the Cluster policy's hand-off between nodes, a shared
/// VIP's ports whose Pods are on another node.
fn forwarding(svc: Option<&Service>) -> String {
    let Some(svc) = svc else {
        return String::new();
    };
    let mut out = String::new();
    if crate::reconcile::cluster_policy(svc) {
        out.push_str(
            "├── Forwarding  Cluster: every node a BGPAdvertisement covers announces the VIP; one without a Ready backend hands each new TCP connection and UDP flow, unchanged, to a node with one (weighed by its Ready endpoints), which answers the client directly (no SNAT: the Pod sees the client's address)\n",
        );
    }
    if let Some(key) = crate::sharing::sharing_key(svc) {
        out.push_str(&format!(
            "├── SharedVIP  key={key}  (a node announcing the VIP for another Service of the key hands this Service's connections to a node with its Pods)\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{
        BackendSummary, ExternalNetworkSpec, ExternalNetworkType, ServiceLoadBalancerSpec,
        ServiceLoadBalancerStatus,
    };
    use crate::endpoints::testutil::slice;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use kube::api::ObjectMeta;

    pub(crate) const SEED: &str =
        "ServiceLoadBalancer  default/nginx  (vip: 203.0.113.10, phase: Ready)
├── parent Service  default/nginx  (type=LoadBalancer, externalTrafficPolicy=Local)
├── ExternalNetwork  public  type=bgp  pools=public-v4
├── AllocatedFrom  AddressPool/public-v4
├── Ports
│   └── TCP/80  ->  80
├── AdvertisingNodes  (2)
│   ├── node-a
│   └── node-c
└── Backends  totalReady=3  localReadyNodes=2
";

    #[test]
    fn renders_the_seed_tree_exactly() {
        let mut slb = ServiceLoadBalancer::new(
            "nginx",
            ServiceLoadBalancerSpec {
                service_name: "nginx".into(),
                external_network: Some("public".into()),
                requested_ip: None,
            },
        );
        slb.metadata.namespace = Some("default".into());
        slb.status = Some(ServiceLoadBalancerStatus {
            vip: Some("203.0.113.10".into()),
            address_pool: Some("public-v4".into()),
            external_network: Some("public".into()),
            advertising_nodes: vec!["node-a".into(), "node-c".into()],
            backend_summary: BackendSummary {
                total_ready: 3,
                local_ready_nodes: 2,
            },
            phase: Phase::Ready,
            ..Default::default()
        });
        let svc = Service {
            metadata: ObjectMeta {
                name: Some("nginx".into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                external_traffic_policy: Some("Local".into()),
                ports: Some(vec![ServicePort {
                    name: Some("http".into()),
                    protocol: Some("TCP".into()),
                    port: 80,
                    target_port: Some(IntOrString::String("http".into())),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let net = ExternalNetwork::new(
            "public",
            ExternalNetworkSpec {
                network_type: ExternalNetworkType::Bgp,
                address_pools: vec!["public-v4".into()],
            },
        );
        let sl = slice(
            "nginx",
            "nginx-1",
            &[("10.0.0.1", "node-a", true, false)],
            ("http", 80),
        );
        assert_eq!(
            render(&slb, Some(&svc), Some(&net), std::slice::from_ref(&sl)),
            SEED
        );
        // Source ranges, when set, get a line of their own after the ports.
        let mut ranged = svc.clone();
        ranged.spec.as_mut().unwrap().load_balancer_source_ranges =
            Some(vec!["198.51.100.0/24".into(), "192.0.2.7".into()]);
        let tree = render(&slb, Some(&ranged), Some(&net), &[sl]);
        assert!(
            tree.contains(
                "│   └── TCP/80  ->  80\n├── SourceRanges  192.0.2.7/32, 198.51.100.0/24  (other clients are dropped)\n├── AdvertisingNodes"
            ),
            "{tree}"
        );
    }

    #[test]
    fn the_cluster_policy_and_a_shared_vip_say_how_connections_are_forwarded() {
        let mut svc = Service::default();
        assert_eq!(forwarding(Some(&svc)).lines().count(), 1, "unset = Cluster");
        assert!(forwarding(Some(&svc)).starts_with("├── Forwarding  Cluster: "));
        svc.spec = Some(ServiceSpec {
            external_traffic_policy: Some("Local".into()),
            ..Default::default()
        });
        assert_eq!(forwarding(Some(&svc)), "", "Local: the guide's tree");
        svc.metadata.annotations = Some(
            [(
                crate::sharing::SHARED_IP_ANNOTATION.to_string(),
                "dns".to_string(),
            )]
            .into(),
        );
        assert!(forwarding(Some(&svc)).starts_with("├── SharedVIP  key=dns  ("));
        assert_eq!(forwarding(None), "");
    }

    #[test]
    fn a_dual_stack_record_shows_both_vips_in_order() {
        let mut slb = ServiceLoadBalancer::new(
            "web",
            ServiceLoadBalancerSpec {
                service_name: "web".into(),
                external_network: Some("public".into()),
                requested_ip: None,
            },
        );
        slb.metadata.namespace = Some("default".into());
        let vip = |family: &str, ip: &str, pool: &str| crate::crd::FamilyVip {
            family: family.into(),
            ip: ip.into(),
            address_pool: pool.into(),
        };
        slb.status = Some(ServiceLoadBalancerStatus {
            vip: Some("2001:db8::1".into()),
            vips: vec![
                vip("IPv6", "2001:db8::1", "public-dual"),
                vip("IPv4", "203.0.113.10", "public-v4"),
            ],
            address_pool: Some("public-dual".into()),
            phase: Phase::Ready,
            ..Default::default()
        });
        let text = render(&slb, None, None, &[]);
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some(
                "ServiceLoadBalancer  default/web  (vips: 2001:db8::1, 203.0.113.10, phase: Ready)"
            )
        );
        assert!(
            text.contains("├── AllocatedFrom  AddressPool/public-dual (IPv6 2001:db8::1), AddressPool/public-v4 (IPv4 203.0.113.10)\n"),
            "{text}"
        );
    }

    #[test]
    fn failed_and_missing_pieces_are_said() {
        let mut slb = ServiceLoadBalancer::new(
            "web",
            ServiceLoadBalancerSpec {
                service_name: "web".into(),
                external_network: Some("nope".into()),
                requested_ip: None,
            },
        );
        slb.metadata.namespace = Some("team".into());
        slb.status = Some(ServiceLoadBalancerStatus {
            phase: Phase::Failed,
            conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "VIPAllocated".into(),
                status: "False".into(),
                reason: "ExternalNetworkNotFound".into(),
                message: "ExternalNetwork \"nope\" does not exist".into(),
                observed_generation: None,
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ),
            }],
            ..Default::default()
        });
        let text = render(&slb, None, None, &[]);
        assert_eq!(
            text,
            "ServiceLoadBalancer  team/web  (vip: <none>, phase: Failed)
├── parent Service  team/web  (not found)
├── ExternalNetwork  nope  (not found)
├── AllocatedFrom  <none>
├── Ports
├── AdvertisingNodes  (0)
├── Problem  ExternalNetworkNotFound: ExternalNetwork \"nope\" does not exist
└── Backends  totalReady=0  localReadyNodes=0
"
        );
    }
}
