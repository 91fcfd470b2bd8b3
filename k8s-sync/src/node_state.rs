//! The agent's decision, as a pure function: from what the API says, the
//! [`juneau_control::NodeState`] one node must publish (its service table, the VIPs it
//! announces with their BGP attributes, and its BGP peers).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use juneau_control::shm::MAX_REDIRECT_NODES_PER_VIP;
use juneau_control::{
    AdvertisedVip, Frontend, Frontend6, LocalBackend, LocalBackend6, NodeService, NodeService6,
    NodeState, PeerConfig, Protocol, Redirects, SourceRange, VipRedirectPeers, VipRedirectPeers6,
};
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::crd::{
    BGPAdvertisement, BGPAdvertisementSpec, BGPPeer, MaintenanceTrigger, Phase,
    ServiceLoadBalancer, ServiceLoadBalancerStatus,
};
use crate::endpoints::{
    host_network_endpoints, node_addresses6, node_excluded, slice_endpoints, slice_endpoints6,
    SliceEndpoint, SliceEndpoint6,
};
use crate::reconcile::is_managed;
use crate::selection::{for_service, selects};

/// Namespace a BGPPeer's password Secret is looked up in when it names none.
pub const DEFAULT_SECRET_NAMESPACE: &str = "juneau-system";

/// Node annotation overriding the address other nodes send redirected packets to (issue
/// 12): by default the Node's InternalIP. Set it when the dataplane's uplink is on
/// another network than the InternalIP (e.g. a separate fabric, as in the lab).
pub const REDIRECT_ADDRESS_ANNOTATION: &str = "juneau.loutres.me/redirect-address";

/// The address other nodes send `node` redirected packets to: the
/// [`REDIRECT_ADDRESS_ANNOTATION`] if set, else the first IPv4 InternalIP. `Ok(None)`: the
/// Node has neither. `Err`: the annotation is not a usable IPv4 address (said in plain
/// words; the node is then left out of redirects rather than guessed at).
pub fn redirect_address(node: &Node) -> Result<Option<Ipv4Addr>, String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    if let Some(v) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REDIRECT_ADDRESS_ANNOTATION))
    {
        return match v.trim().parse::<Ipv4Addr>() {
            Ok(ip) if !ip.is_unspecified() && !ip.is_broadcast() && !ip.is_multicast() => {
                Ok(Some(ip))
            }
            _ => Err(format!(
                "Node {name}: annotation {REDIRECT_ADDRESS_ANNOTATION}={v:?} is not a unicast IPv4 address; the node is left out of redirects between nodes until it is fixed"
            )),
        };
    }
    Ok(node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse::<Ipv4Addr>().ok()))
}

/// Whether node `name` can ever have announced the VIP — a BGPPeer and one of the
/// BGPAdvertisements that apply to it (`applying`) select it — and so can hold
/// connections of it. A
/// node that cannot (e.g. a node outside the edge nodes, running no Juneau at all) is
/// never asked: a redirected packet sent there would be lost, and every later packet of
/// the flow (same hash, same first peer) with it.
fn may_announce(view: &AgentView, name: &str, applying: &[&BGPAdvertisementSpec]) -> bool {
    let empty = BTreeMap::new();
    let Some(n) = view.nodes.get(name) else {
        return false;
    };
    let labels = n.metadata.labels.as_ref().unwrap_or(&empty);
    view.peers
        .iter()
        .any(|p| selects(p.spec.node_selector.as_ref(), labels))
        && applying
            .iter()
            .any(|a| selects(a.node_selector.as_ref(), labels))
}

/// The redirect part of `node`'s state: its own address and, per VIP in `vip_nodes`, the
/// other nodes' addresses, each repeated once per Ready endpoint it has
/// ([`weighted_peers`]; bad annotations become warnings, the node left out).
fn redirects(
    node: &str,
    view: &AgentView,
    (vip_nodes, vip_nodes6): (VipNodes<Ipv4Addr>, VipNodes<Ipv6Addr>),
    warnings: &mut Vec<String>,
) -> Redirects {
    let mut addresses: BTreeMap<&str, Option<Ipv4Addr>> = BTreeMap::new();
    let mut address_of = |name: &str, warnings: &mut Vec<String>| -> Option<Ipv4Addr> {
        if let Some(a) = addresses.get(name) {
            return *a;
        }
        let a = match view.nodes.get(name).map(|n| redirect_address(n)) {
            Some(Ok(a)) => a,
            Some(Err(w)) => {
                warnings.push(w);
                None
            }
            None => None, // not (yet) in the watch cache
        };
        let key = view
            .nodes
            .get_key_value(name)
            .map_or("", |(k, _)| k.as_str());
        if !key.is_empty() {
            addresses.insert(key, a);
        }
        a
    };
    let node_address = address_of(node, warnings);
    let mut list = |vip: IpAddr, names: BTreeMap<String, u32>, warnings: &mut Vec<String>| {
        let mut ready: BTreeMap<Ipv4Addr, u32> = BTreeMap::new();
        for (n, r) in names.iter().filter(|(n, _)| n.as_str() != node) {
            if let Some(a) = address_of(n, warnings).filter(|a| Some(*a) != node_address) {
                *ready.entry(a).or_default() += r;
            }
        }
        let mut ready: Vec<(Ipv4Addr, u32)> = ready.into_iter().collect();
        if ready.len() > MAX_REDIRECT_NODES_PER_VIP {
            warnings.push(format!(
                "VIP {vip}: {} nodes hold endpoints; redirects ask only the first {MAX_REDIRECT_NODES_PER_VIP}",
                ready.len()
            ));
            ready.truncate(MAX_REDIRECT_NODES_PER_VIP);
        }
        let nodes = weighted_peers(&ready).unwrap_or_else(|| {
            warnings.push(format!(
                "VIP {vip}: {} nodes leave no room in the {MAX_REDIRECT_NODES_PER_VIP} redirect entries to weigh them by their Ready endpoints; new connections handed on spread evenly over them",
                ready.len()
            ));
            ready.iter().map(|(a, _)| *a).collect()
        });
        nodes
    };
    let mut vips = Vec::new();
    for (vip, names) in vip_nodes {
        let nodes = list(vip.into(), names, warnings);
        vips.push(VipRedirectPeers { vip, nodes });
    }
    let mut vips6 = Vec::new();
    for (vip, names) in vip_nodes6 {
        let nodes = list(vip.into(), names, warnings);
        vips6.push(VipRedirectPeers6 { vip, nodes });
    }
    Redirects {
        node_address,
        vips,
        vips6,
        // The MAC keys are the agent's to add (`crate::redirect_key`: a bad Secret keeps
        // the keys in force, which this pure build does not know).
        keys: Vec::new(),
    }
}

/// Per VIP: the nodes with an endpoint of it that may announce it (under the Cluster
/// policy every node that may), each with its Ready endpoints.
type VipNodes<A> = BTreeMap<A, BTreeMap<String, u32>>;

/// Everything the agent watches. The objects are shared (`Arc`) with the watch caches
/// they come from: taking a view copies pointers, not objects (deep copies of
/// every cached object were 24 ms per batch of events at 10 000 Services).
/// `Debug` names the Secrets but never prints their data (issue #25).
#[derive(Default, Clone)]
pub struct AgentView {
    /// Nodes by name (this node's labels select peers/advertisements; all nodes' addresses
    /// identify host-network endpoints).
    pub nodes: BTreeMap<String, Arc<Node>>,
    /// ServiceLoadBalancers.
    pub slbs: Vec<Arc<ServiceLoadBalancer>>,
    /// Services by `namespace/name`.
    pub services: BTreeMap<String, Arc<Service>>,
    /// EndpointSlices by the `namespace/name` of their Service.
    pub slices: BTreeMap<String, Vec<Arc<EndpointSlice>>>,
    /// BGPPeers.
    pub peers: Vec<Arc<BGPPeer>>,
    /// BGPAdvertisements.
    pub advertisements: Vec<Arc<BGPAdvertisement>>,
    /// Secrets of Juneau's namespace, by name.
    pub secrets: BTreeMap<String, Arc<Secret>>,
    /// The namespace those Secrets are in (for messages).
    pub secret_namespace: String,
    /// The maintenance triggers of BGPPeers that name none (the agent's
    /// `--maintenance-triggers`).
    pub maintenance_triggers: crate::maintenance::Triggers,
}

impl std::fmt::Debug for AgentView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentView")
            .field("nodes", &self.nodes)
            .field("slbs", &self.slbs)
            .field("services", &self.services)
            .field("slices", &self.slices)
            .field("peers", &self.peers)
            .field("advertisements", &self.advertisements)
            .field("secrets", &self.secrets.keys().collect::<Vec<_>>())
            .field("secret_namespace", &self.secret_namespace)
            .field("maintenance_triggers", &self.maintenance_triggers)
            .finish()
    }
}

/// `ASN:VALUE` -> `ASN << 16 | VALUE`.
pub fn parse_community(s: &str) -> Option<u32> {
    let (a, v) = s.split_once(':')?;
    let a: u16 = a.parse().ok()?;
    let v: u16 = v.parse().ok()?;
    Some(u32::from(a) << 16 | u32::from(v))
}

/// `GLOBAL:DATA1:DATA2`.
pub fn parse_large_community(s: &str) -> Option<[u32; 3]> {
    let mut it = s.split(':').map(|p| p.parse::<u32>().ok());
    let r = [it.next()??, it.next()??, it.next()??];
    it.next().is_none().then_some(r)
}

/// A BGPPeer's `spec.bfd.authentication` with its key from the Secret, or why it cannot
/// be used (the message names the field or the Secret, never the key).
fn bfd_auth(
    view: &AgentView,
    a: &crate::crd::BfdAuthentication,
) -> Result<juneau_control::model::BfdAuth, String> {
    use juneau_control::model::{BfdAuthType, BFD_KEY_MAX_BYTES};
    let auth_type = match a.type_.as_str() {
        "keyedSHA1" => BfdAuthType::KeyedSha1,
        "meticulousKeyedSHA1" => BfdAuthType::MeticulousKeyedSha1,
        other => {
            return Err(format!(
                "type {other:?} is not one of {}",
                crate::crd::BFD_AUTH_TYPES.join(", ")
            ))
        }
    };
    let key_id =
        u8::try_from(a.key_id).map_err(|_| format!("keyID {} is outside 0-255", a.key_id))?;
    let ns = &view.secret_namespace;
    let name = &a.secret_ref.name;
    let k = a.secret_ref.key.as_deref().unwrap_or("password");
    let key = secret_value(view, name, k)
        .ok_or_else(|| format!("key Secret {ns}/{name} (key {k}) not found or not UTF-8"))?;
    if key.is_empty() || key.len() > BFD_KEY_MAX_BYTES {
        return Err(format!(
            "the key in Secret {ns}/{name} (key {k}) is {} bytes; keyed SHA1 takes 1 to {BFD_KEY_MAX_BYTES}",
            key.len()
        ));
    }
    Ok(juneau_control::model::BfdAuth {
        auth_type,
        key_id,
        key,
    })
}

fn secret_value(view: &AgentView, name: &str, key: &str) -> Option<juneau_control::secret::Secret> {
    let s = view.secrets.get(name)?;
    if let Some(v) = s.data.as_ref().and_then(|d| d.get(key)) {
        return String::from_utf8(v.0.clone())
            .ok()
            .map(juneau_control::secret::Secret::new);
    }
    s.string_data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|v| juneau_control::secret::Secret::new(v.as_str()))
}

/// The published peer list of a VIP from each peer's address and Ready endpoints
/// (sorted by address): every peer once — it may hold connections — then once more per
/// Ready endpoint, its weight for the new connections a node without a backend hands on
/// (the dataplane's weighted rendezvous: every endpoint cluster-wide an equal share).
/// The list holds at most [`MAX_REDIRECT_NODES_PER_VIP`] entries: weights above what
/// fits are scaled down (largest remainders), every peer with an endpoint keeping at
/// least one; `None` when even that does not fit (the caller lists each peer once: no
/// weights, so the dataplane spreads evenly).
fn weighted_peers(ready: &[(Ipv4Addr, u32)]) -> Option<Vec<Ipv4Addr>> {
    let room = MAX_REDIRECT_NODES_PER_VIP.checked_sub(ready.len())?;
    let holders = ready.iter().filter(|(_, r)| *r > 0).count();
    let total: u64 = ready.iter().map(|(_, r)| u64::from(*r)).sum();
    if holders > room {
        return None;
    }
    let mut weights: Vec<u64> = ready.iter().map(|(_, r)| u64::from(*r)).collect();
    if total > room as u64 {
        // One each, then the rest of the room in proportion (largest remainder first).
        let spare = (room - holders) as u64;
        let rest = total - holders as u64;
        let mut shares: Vec<(u64, u64, usize)> = ready
            .iter()
            .enumerate()
            .filter(|(_, (_, r))| *r > 0)
            .map(|(i, (_, r))| {
                let x = (u64::from(*r) - 1) * spare;
                (x / rest.max(1), x % rest.max(1), i)
            })
            .collect();
        for w in weights.iter_mut() {
            *w = (*w).min(1);
        }
        let mut left = spare;
        for (q, _, i) in &shares {
            weights[*i] += q;
            left -= q;
        }
        shares.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
        for (_, _, i) in shares.iter().take(left as usize) {
            weights[*i] += 1;
        }
    }
    let mut nodes = Vec::new();
    for ((a, _), w) in ready.iter().zip(weights) {
        nodes.extend(std::iter::repeat_n(*a, 1 + w as usize));
    }
    Some(nodes)
}

/// What one ServiceLoadBalancer contributes to the node's state.
#[derive(Debug, Clone, Default)]
struct SlbPart {
    /// Its frontends with this node's backends.
    services: Vec<NodeService>,
    /// Its VIP, when this node announces it.
    advertised: Option<AdvertisedVip>,
    /// Its VIP and the nodes with a serving endpoint of it that can announce it (and,
    /// under the Cluster policy, every node that can), each with its Ready endpoints.
    /// `None`: no IPv4 VIP served.
    vip_nodes: Option<(Ipv4Addr, BTreeMap<String, u32>)>,
    /// Its IPv6 part (issue 28), if it has an IPv6 VIP served here.
    v6: Option<SlbPart6>,
}

/// What one ServiceLoadBalancer's IPv6 VIP contributes to the node's state: frontends
/// with this node's own IPv6 backends (no host network yet), the VIP announced as the
/// IPv4 one is (a Ready backend here, or under the Cluster policy a node to hand the
/// connections to), and the nodes asked about its connections.
#[derive(Debug, Clone, Default)]
struct SlbPart6 {
    services: Vec<NodeService6>,
    advertised: Option<AdvertisedVip>,
    /// The VIP and the nodes asked about its connections ([`SlbPart::vip_nodes`]).
    vip_nodes: Option<(Ipv6Addr, BTreeMap<String, u32>)>,
    /// This node's IPv6 endpoints on one of its own addresses (host-network Pods),
    /// which are not served (warned about, counted by the agent's metrics).
    host_network_unserved: Vec<Ipv6Addr>,
}

/// A VIP of a ServiceLoadBalancer and the AddressPool it came from (which selects the
/// BGPAdvertisements that apply to it).
type PoolVip<A> = Option<(A, String)>;

/// The VIPs of a ServiceLoadBalancer with their pools: from `status.vips` (the first
/// valid one of each family), or, when that is empty (a controller from before IPv6),
/// `status.vip` as IPv4 with `status.addressPool`.
fn status_vips(st: &ServiceLoadBalancerStatus) -> (PoolVip<Ipv4Addr>, PoolVip<Ipv6Addr>) {
    if st.vips.is_empty() {
        let vip = st.vip.as_deref().and_then(|v| v.parse().ok());
        return (
            vip.map(|v| (v, st.address_pool.clone().unwrap_or_default())),
            None,
        );
    }
    let of = |family: &'static str| {
        st.vips
            .iter()
            .filter(move |v| v.family == family)
            .map(|v| (v.ip.as_str(), &v.address_pool))
    };
    (
        of("IPv4").find_map(|(ip, pool)| Some((ip.parse().ok()?, pool.clone()))),
        of("IPv6").find_map(|(ip, pool)| Some((ip.parse().ok()?, pool.clone()))),
    )
}

/// What every ServiceLoadBalancer's part is computed with.
#[derive(Clone, Copy)]
struct NodeCtx<'a> {
    node: &'a str,
    view: &'a AgentView,
    /// The node's labels.
    labels: &'a BTreeMap<String, String>,
    /// The node is excluded from load balancers.
    excluded: bool,
    /// The BGPPeers selecting the node, with their labels.
    peers: &'a [(PeerConfig, BTreeMap<String, String>)],
}

/// The part of `slb` (its Service `svc`, that Service's `slices`) in the node's state,
/// or `None` when it contributes nothing. Depends on nothing else than its arguments and
/// the view's Nodes, BGPPeers, BGPAdvertisements and Secrets (also through `ctx`).
fn slb_part(
    ctx: NodeCtx<'_>,
    slb: &ServiceLoadBalancer,
    svc: Option<&Service>,
    slices: &[Arc<EndpointSlice>],
) -> Option<SlbPart> {
    let st = slb.status.as_ref()?;
    if st.phase == Phase::Failed {
        return None;
    }
    let (vip4, vip6) = status_vips(st);
    let svc = svc?;
    if !is_managed(svc) {
        return None;
    }
    let mut part = vip4.and_then(|(vip, pool)| slb_part4(ctx, &pool, svc, slices, vip));
    if let Some(v6) = vip6.and_then(|(vip, pool)| slb_part6(ctx, &pool, svc, slices, vip)) {
        part.get_or_insert_with(SlbPart::default).v6 = Some(v6);
    }
    part
}

/// The BGPAdvertisements that apply to the Service's VIP from `pool`, on any node.
fn applying<'a>(view: &'a AgentView, pool: &str, svc: &Service) -> Vec<&'a BGPAdvertisementSpec> {
    let empty = BTreeMap::new();
    for_service(
        view.advertisements.iter().map(|a| &a.spec),
        pool,
        svc.metadata.labels.as_ref().unwrap_or(&empty),
    )
}

/// The IPv4 part of a ServiceLoadBalancer with the IPv4 VIP `vip` from `pool`.
fn slb_part4(
    ctx: NodeCtx<'_>,
    pool: &str,
    svc: &Service,
    slices: &[Arc<EndpointSlice>],
    vip: Ipv4Addr,
) -> Option<SlbPart> {
    let NodeCtx {
        node,
        view,
        excluded,
        ..
    } = ctx;
    let eps = slice_endpoints(slices.iter().map(|s| &**s));
    let host = host_network_endpoints(&eps, &view.nodes);
    let cluster = crate::reconcile::cluster_policy(svc);
    // Host-network backends (their node's own address) the controller refuses (the
    // Cluster policy, a shared VIP, mixed with Pods): never served half meanwhile.
    let pods = crate::reconcile::pod_network(&eps, &host);
    if crate::reconcile::host_network_refused(svc, &host, &pods) {
        return None;
    }
    let host_network = !host.is_empty();
    // Ranges that cannot be honoured: served by no node (the controller says why).
    let source_ranges = crate::source_ranges::of_service(svc).ok()?;
    let affinity = client_ip_affinity(svc);
    let here: Vec<_> = eps
        .iter()
        .filter(|e| e.node.as_deref() == Some(node))
        .collect();
    // The BGPAdvertisements that apply to this Service's VIP, on any node.
    let applying = applying(view, pool, svc);
    let mut part = SlbPart::default();
    let mut any_backend = false;
    for sp in svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
    {
        let Some(mut service) = frontend_service(vip, sp, &here, &source_ranges, affinity) else {
            continue;
        };
        service.hand_off = cluster;
        service.host_network = host_network;
        any_backend |= !service.backends.is_empty();
        part.services.push(service);
    }
    // Cluster policy: announced here without a local backend while a node that can take
    // the connections over has a Ready one.
    let (vip_nodes, elsewhere) = vip_nodes_of(ctx, &eps, &applying, cluster);
    part.vip_nodes = Some((vip, vip_nodes));
    if !(any_backend || elsewhere) || excluded {
        return Some(part);
    }
    part.advertised = advertised_vip(ctx, &applying, vip.into(), ready_pods(&here));
    if cluster {
        // Every announcing node hands connections on: no node weighs more.
        if let Some(a) = part.advertised.as_mut() {
            a.weight = None;
        }
    }
    Some(part)
}

/// The Frontend of the Service port `sp` on `vip` with this node's Backends (`here`:
/// the Service's endpoints on this node) and the clients it admits, or `None` when the
/// port is not one we serve.
fn frontend_service(
    vip: Ipv4Addr,
    sp: &k8s_openapi::api::core::v1::ServicePort,
    here: &[&SliceEndpoint],
    source_ranges: &[SourceRange],
    client_ip_affinity: Option<u32>,
) -> Option<NodeService> {
    let proto_name = sp.protocol.as_deref().unwrap_or("TCP");
    let protocol = proto_name.parse::<Protocol>().ok()?;
    let port = u16::try_from(sp.port).ok()?;
    let (backends, terminating) =
        local_backends(sp, proto_name, here, |ip, port| LocalBackend { ip, port });
    Some(NodeService {
        frontend: Frontend {
            vip,
            protocol,
            port,
        },
        backends,
        terminating,
        source_ranges: source_ranges.to_vec(),
        client_ip_affinity,
        hand_off: false,
        host_network: false,
    })
}

/// This node's backends for the Service port `sp` (`proto_name` its protocol) among its
/// endpoints `here`, made by `backend(ip, target port)`: the Ready ones (new flows), and
/// the listed others (terminating, or not Ready: only the flows they have, the graceful
/// drain). Both families read them alike.
fn local_backends<A: Copy, B>(
    sp: &k8s_openapi::api::core::v1::ServicePort,
    proto_name: &str,
    here: &[&SliceEndpoint<A>],
    backend: impl Fn(A, u16) -> B,
) -> (Vec<B>, Vec<B>) {
    let sp_name = sp.name.clone().filter(|n| !n.is_empty());
    let mut backends = Vec::new();
    let mut terminating = Vec::new();
    for e in here {
        let list = if e.conditions.takes_new_traffic() {
            &mut backends
        } else if e.conditions.drains() {
            &mut terminating
        } else {
            continue;
        };
        // The EndpointSlice port carrying the Service port's name holds the
        // resolved target port (named targetPorts are resolved per Pod).
        if let Some((_, _, tp)) = e
            .ports
            .iter()
            .find(|(n, pr, _)| *n == sp_name && pr.eq_ignore_ascii_case(proto_name))
        {
            list.push(backend(e.ip, *tp));
        }
    }
    (backends, terminating)
}

/// Ready local Pods of a VIP (one per Pod IP, whatever its ports): its weight.
fn ready_pods<A: Copy + Ord>(here: &[&SliceEndpoint<A>]) -> u32 {
    here.iter()
        .filter(|e| e.conditions.takes_new_traffic())
        .map(|e| e.ip)
        .collect::<BTreeSet<_>>()
        .len() as u32
}

/// The IPv6 part of a ServiceLoadBalancer with the IPv6 VIP `vip`: its frontends with
/// this node's IPv6 backends (from `addressType: IPv6` EndpointSlices, read as the IPv4
/// ones), announced from here while one of them is Ready. `None` when its IPv6 source
/// ranges cannot be honoured (no node serves the IPv6 VIP then).
fn slb_part6(
    ctx: NodeCtx<'_>,
    pool: &str,
    svc: &Service,
    slices: &[Arc<EndpointSlice>],
    vip: Ipv6Addr,
) -> Option<SlbPart6> {
    let NodeCtx {
        node,
        view,
        excluded,
        ..
    } = ctx;
    let eps = slice_endpoints6(slices.iter().map(|s| &**s));
    let cluster = crate::reconcile::cluster_policy(svc);
    let source_ranges = crate::source_ranges::of_service6(svc).ok()?;
    let affinity = client_ip_affinity(svc);
    let own = view
        .nodes
        .get(node)
        .map(|n| node_addresses6(n))
        .unwrap_or_default();
    let mut part = SlbPart6::default();
    let mut here: Vec<&SliceEndpoint6> = Vec::new();
    for e in eps.iter().filter(|e| e.node.as_deref() == Some(node)) {
        if own.contains(&e.ip) {
            part.host_network_unserved.push(e.ip);
        } else {
            here.push(e);
        }
    }
    for sp in svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
    {
        let proto_name = sp.protocol.as_deref().unwrap_or("TCP");
        let (Ok(protocol), Ok(port)) = (proto_name.parse::<Protocol>(), u16::try_from(sp.port))
        else {
            continue;
        };
        let (backends, terminating) =
            local_backends(sp, proto_name, &here, |ip, port| LocalBackend6 { ip, port });
        part.services.push(NodeService6 {
            frontend: Frontend6 {
                vip,
                protocol,
                port,
            },
            backends,
            terminating,
            source_ranges: source_ranges.clone(),
            client_ip_affinity: affinity,
            hand_off: cluster,
        });
    }
    let applying = applying(view, pool, svc);
    let (vip_nodes, elsewhere) = vip_nodes_of(ctx, &eps, &applying, cluster);
    part.vip_nodes = Some((vip, vip_nodes));
    let any_backend = part.services.iter().any(|s| !s.backends.is_empty());
    if (any_backend || elsewhere) && !excluded {
        part.advertised = advertised_vip(ctx, &applying, vip.into(), ready_pods(&here));
        if cluster {
            // Every announcing node hands connections on: no node weighs more.
            if let Some(a) = part.advertised.as_mut() {
                a.weight = None;
            }
        }
    }
    Some(part)
}

/// The nodes asked about a VIP's connections (each with its Ready endpoints: its share
/// of the new connections handed on), as [`slb_part4`] finds them: every node with a
/// listed endpoint that may announce the VIP, and under the Cluster policy every node
/// that may announce it; and whether, under the Cluster policy, another such node has a
/// Ready endpoint (this node then announces without one of its own).
fn vip_nodes_of<A>(
    ctx: NodeCtx<'_>,
    eps: &[SliceEndpoint<A>],
    applying: &[&BGPAdvertisementSpec],
    cluster: bool,
) -> (BTreeMap<String, u32>, bool) {
    let NodeCtx { node, view, .. } = ctx;
    // Every node with a listed endpoint may hold connections of it (a draining Pod's,
    // whatever its readiness says): a node asks those about connections it does not hold.
    let mut vip_nodes: BTreeMap<String, u32> = BTreeMap::new();
    for e in eps {
        let Some(n) = e.node.as_ref().filter(|n| may_announce(view, n, applying)) else {
            continue;
        };
        *vip_nodes.entry(n.clone()).or_default() += u32::from(e.conditions.takes_new_traffic());
    }
    let elsewhere = cluster
        && eps.iter().any(|e| {
            e.conditions.takes_new_traffic()
                && e.node
                    .as_deref()
                    .is_some_and(|n| n != node && vip_nodes.contains_key(n))
        });
    if cluster {
        // Any node that may announce the VIP may hand connections to any other: each
        // takes the others' (a node accepts redirects from its peers only), and a node
        // without endpoints that is asked passes the connection on.
        for n in view
            .nodes
            .keys()
            .filter(|n| may_announce(view, n, applying))
        {
            vip_nodes.entry(n.clone()).or_default();
        }
    }
    (vip_nodes, elsewhere)
}

/// `sessionAffinity: ClientIP`'s timeout in seconds (Kubernetes' default 10 800 when
/// `sessionAffinityConfig` says none; the apiserver keeps it within 1..=86 400), or
/// `None` for per-connection balancing.
fn client_ip_affinity(svc: &Service) -> Option<u32> {
    let spec = svc.spec.as_ref()?;
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return None;
    }
    let t = spec
        .session_affinity_config
        .as_ref()
        .and_then(|c| c.client_ip.as_ref())
        .and_then(|c| c.timeout_seconds)
        .unwrap_or(10_800);
    Some(t.clamp(1, 86_400) as u32)
}

/// How this node announces `vip` (with the local endpoints `here`), from the
/// BGPAdvertisements that apply to it (`applying`: [`for_service`]) on this node; `None`
/// when none does or none selects a peer of the node.
fn advertised_vip(
    ctx: NodeCtx<'_>,
    applying: &[&BGPAdvertisementSpec],
    vip: IpAddr,
    ready_pods: u32,
) -> Option<AdvertisedVip> {
    let NodeCtx { labels, peers, .. } = ctx;
    // Attributes from the BGPAdvertisements that apply, on this node.
    let mut matched = false;
    let mut communities = BTreeSet::new();
    let mut large = BTreeSet::new();
    let mut local_pref: Option<u32> = None;
    let mut peer_idx = BTreeSet::new();
    let mut all_peers = false;
    let mut weighted = false;
    for adv in applying {
        if !selects(adv.node_selector.as_ref(), labels) {
            continue;
        }
        matched = true;
        communities.extend(adv.communities.iter().filter_map(|c| parse_community(c)));
        large.extend(
            adv.large_communities
                .iter()
                .filter_map(|c| parse_large_community(c)),
        );
        if let Some(lp) = adv.local_pref {
            local_pref = Some(local_pref.map_or(lp, |x| x.max(lp)));
        }
        weighted |= adv.weighted_by_backends.unwrap_or(false);
        match &adv.peer_selector {
            None => all_peers = true,
            Some(sel) => {
                for (i, (_, pl)) in peers.iter().enumerate() {
                    if selects(Some(sel), pl) {
                        peer_idx.insert(u16::try_from(i).unwrap_or(u16::MAX));
                    }
                }
            }
        }
    }
    if !matched || (!all_peers && peer_idx.is_empty()) {
        return None;
    }
    Some(AdvertisedVip {
        vip,
        communities: communities.into_iter().collect(),
        large_communities: large.into_iter().collect(),
        local_pref,
        peers: if all_peers {
            Vec::new()
        } else {
            peer_idx.into_iter().collect()
        },
        // Ready local Pods of the VIP (one per Pod IP, whatever its ports).
        weight: weighted.then_some(ready_pods),
    })
}

/// What a [`SlbPart`] was computed from, by identity: the watch caches replace an object's
/// `Arc` when it changes, so the same `Arc`s mean the same objects.
#[derive(Debug, Clone)]
struct SlbInputs {
    slb: Arc<ServiceLoadBalancer>,
    svc: Option<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
}

impl SlbInputs {
    fn same(
        &self,
        slb: &Arc<ServiceLoadBalancer>,
        svc: Option<&Arc<Service>>,
        slices: &[Arc<EndpointSlice>],
    ) -> bool {
        Arc::ptr_eq(&self.slb, slb)
            && match (&self.svc, svc) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
            && same_arcs(&self.slices, slices)
    }
}

/// One ServiceLoadBalancer's part with what it was computed from.
#[derive(Debug)]
struct CachedPart {
    inputs: SlbInputs,
    part: Option<SlbPart>,
    /// The last build that saw the ServiceLoadBalancer.
    epoch: u64,
}

fn same_arcs<T>(a: &[Arc<T>], b: &[Arc<T>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y))
}

/// What every [`SlbPart`] depends on besides its own objects, by identity (peers,
/// advertisements and Secrets in pointer order: their order in the view means nothing).
#[derive(Debug, Clone)]
struct Globals {
    node: String,
    secret_namespace: String,
    maintenance_triggers: crate::maintenance::Triggers,
    nodes: Vec<Arc<Node>>,
    peers: Vec<Arc<BGPPeer>>,
    advertisements: Vec<Arc<BGPAdvertisement>>,
    secrets: Vec<Arc<Secret>>,
}

impl Globals {
    fn of(node: &str, view: &AgentView) -> Self {
        fn by_ptr<T>(mut v: Vec<Arc<T>>) -> Vec<Arc<T>> {
            v.sort_by_key(|a| Arc::as_ptr(a) as usize);
            v
        }
        Globals {
            node: node.to_string(),
            secret_namespace: view.secret_namespace.clone(),
            maintenance_triggers: view.maintenance_triggers.clone(),
            nodes: view.nodes.values().cloned().collect(),
            peers: by_ptr(view.peers.clone()),
            advertisements: by_ptr(view.advertisements.clone()),
            secrets: by_ptr(view.secrets.values().cloned().collect()),
        }
    }

    fn same(&self, o: &Globals) -> bool {
        self.node == o.node
            && self.secret_namespace == o.secret_namespace
            && self.maintenance_triggers == o.maintenance_triggers
            && same_arcs(&self.nodes, &o.nodes)
            && same_arcs(&self.peers, &o.peers)
            && same_arcs(&self.advertisements, &o.advertisements)
            && same_arcs(&self.secrets, &o.secrets)
    }
}

/// What [`build_node_state_with`] keeps between calls: each ServiceLoadBalancer's part of
/// the state with the objects it came from. A part is reused while its
/// ServiceLoadBalancer, Service and EndpointSlices are the same objects and nothing it
/// shares with the others (Nodes, BGPPeers, BGPAdvertisements, Secrets, the node name)
/// changed; any change of those rebuilds every part (rebuilding all 10 000
/// parts was 30 ms per batch of events; one endpoint change now rebuilds one).
#[derive(Debug, Default)]
pub struct BuildCache {
    globals: Option<Globals>,
    /// By the ServiceLoadBalancer's `namespace/name`.
    parts: HashMap<String, CachedPart>,
    epoch: u64,
    /// This node's IPv6 host-network endpoints the last build left unserved.
    host_network6_unserved: usize,
}

impl BuildCache {
    /// This node's IPv6 host-network endpoints (on the Node's own addresses) the last
    /// build left unserved: Juneau does not serve IPv6 host-network backends yet.
    pub fn ipv6_host_network_unserved(&self) -> usize {
        self.host_network6_unserved
    }
}

/// Builds the state of `node`. Returns it (normalized) with warnings about objects that
/// had to be skipped (said in plain words, for the log).
pub fn build_node_state(node: &str, view: &AgentView) -> (NodeState, Vec<String>) {
    build_node_state_with(node, view, &mut BuildCache::default())
}

/// [`build_node_state`], reusing from `cache` what the last call (with the same cache)
/// computed from the same objects. The result is the same as without a cache.
pub fn build_node_state_with(
    node: &str,
    view: &AgentView,
    cache: &mut BuildCache,
) -> (NodeState, Vec<String>) {
    let mut warnings = Vec::new();
    let empty = BTreeMap::new();
    let me = view.nodes.get(node).map(|n| &**n);
    let labels = me
        .and_then(|n| n.metadata.labels.as_ref())
        .unwrap_or(&empty);
    // Graceful maintenance on the peers listening to a trigger that holds (carried out
    // by `juneau_bgp::maintenance`).
    let active = me
        .map(|n| crate::maintenance::active_triggers(n, &mut warnings))
        .unwrap_or_default();
    let router_id = me.and_then(node_router_id);

    let peers = node_peers(view, labels, &active, &mut warnings);
    // The exclude label withdraws the node's VIPs at once, unless every peer drains
    // (then each withdraws them after its drain, as maintenance does).
    let excluded = me.is_some_and(node_excluded)
        && (peers.is_empty() || peers.iter().any(|(p, _)| p.drain.is_none()));
    let ctx = NodeCtx {
        node,
        view,
        labels,
        excluded,
        peers: &peers,
    };
    let mut merged = merged_parts(ctx, cache);
    merged.hand_off_shared_frontends();

    let vip_nodes = (merged.vip_nodes, merged.vip_nodes6);
    let redirects = redirects(node, view, vip_nodes, &mut warnings);
    cache.host_network6_unserved = merged.host_network6_unserved;
    if merged.host_network6_unserved > 0 {
        warnings.push(format!(
            "{} IPv6 host-network endpoint(s) on this node are not served: Juneau serves IPv6 VIPs from Pod-network backends only so far",
            merged.host_network6_unserved
        ));
    }
    let mut state = NodeState {
        node: node.to_string(),
        router_id,
        services: merged.services,
        services6: merged.services6,
        advertised: merged.advertised.into_values().collect(),
        peers: peers.into_iter().map(|(c, _)| c).collect(),
        redirects,
    };
    state.normalize();
    (state, warnings)
}

/// The Node's router ID: its first IPv4 InternalIP.
fn node_router_id(n: &Node) -> Option<Ipv4Addr> {
    n.status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse::<Ipv4Addr>().ok())
}

/// The BGPPeers selecting the node (node labels `labels`), by name, each with its own
/// labels; the ones that cannot be configured are skipped with a warning.
fn node_peers(
    view: &AgentView,
    labels: &BTreeMap<String, String>,
    active: &BTreeSet<MaintenanceTrigger>,
    warnings: &mut Vec<String>,
) -> Vec<(PeerConfig, BTreeMap<String, String>)> {
    let mut peers: Vec<(PeerConfig, BTreeMap<String, String>)> = Vec::new();
    let mut peer_list: Vec<&BGPPeer> = view.peers.iter().map(|p| &**p).collect();
    peer_list.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for p in peer_list {
        if !selects(p.spec.node_selector.as_ref(), labels) {
            continue;
        }
        let Some(cfg) = peer_config(view, p, active, warnings) else {
            continue;
        };
        let plabels = p.metadata.labels.clone().unwrap_or_default();
        peers.push((cfg, plabels));
    }
    peers
}

/// Why `a` cannot be a BGP peer's (or source) address in the node state, if it cannot:
/// the IPv6 addresses `juneau_control::shm` refuses (one such peer would keep the whole
/// state from being published), and link-local ones, which need an interface the state
/// does not carry.
fn unusable_peer_address(a: IpAddr) -> Option<&'static str> {
    match a {
        IpAddr::V4(_) => None,
        IpAddr::V6(v6) if v6.is_unspecified() => Some("the unspecified address"),
        IpAddr::V6(v6) if v6.is_multicast() => Some("a multicast address"),
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            Some("IPv4-mapped (write the IPv4 address)")
        }
        IpAddr::V6(v6) if v6.is_unicast_link_local() => {
            Some("link-local (not supported: use a global or unique-local address)")
        }
        IpAddr::V6(_) => None,
    }
}

/// The session configuration of the BGPPeer `p` (draining when one of its maintenance
/// triggers is among the node's `active` ones), or `None` with a warning when it cannot
/// be configured.
fn peer_config(
    view: &AgentView,
    p: &BGPPeer,
    active: &BTreeSet<MaintenanceTrigger>,
    warnings: &mut Vec<String>,
) -> Option<PeerConfig> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let addr = match p.spec.peer_address.parse::<IpAddr>() {
        Err(_) => {
            warnings.push(format!(
                "BGPPeer {name}: peerAddress {:?} is not an IPv4 or IPv6 address; skipped",
                p.spec.peer_address
            ));
            return None;
        }
        Ok(a) => match unusable_peer_address(a) {
            Some(why) => {
                warnings.push(format!("BGPPeer {name}: peerAddress {a} is {why}; skipped"));
                return None;
            }
            None => a,
        },
    };
    let mut cfg = PeerConfig::new(name.clone(), addr, p.spec.peer_asn, p.spec.local_asn);
    if let Some(port) = p.spec.peer_port {
        cfg.peer_port = port;
    }
    cfg.source_address = p
        .spec
        .source_address
        .as_deref()
        .and_then(|s| s.parse::<IpAddr>().ok());
    if let Some(src) = cfg.source_address {
        if src.is_ipv6() != addr.is_ipv6() || unusable_peer_address(src).is_some() {
            warnings.push(format!(
                "BGPPeer {name}: sourceAddress {src} is not a usable address of the family of peerAddress {addr}; skipped"
            ));
            return None;
        }
    }
    if let Some(h) = p.spec.hold_time_seconds {
        cfg.hold_time = h;
        cfg.keepalive_time = h / 3;
    }
    if let Some(k) = p.spec.keepalive_time_seconds {
        cfg.keepalive_time = k;
    }
    if let Some(c) = p.spec.connect_retry_seconds {
        cfg.connect_retry_time = c;
    }
    cfg.ebgp_multihop = p.spec.ebgp_multihop;
    cfg.graceful_restart_time = p
        .spec
        .graceful_restart
        .as_ref()
        .filter(|g| g.enabled)
        .map(|g| g.restart_time_seconds.unwrap_or(120));
    cfg.passive = p.spec.passive.unwrap_or(false);
    cfg.bfd = p.spec.bfd.as_ref().map(|b| {
        let d = juneau_control::model::BfdSettings::default();
        juneau_control::model::BfdSettings {
            min_rx_ms: b.min_rx_ms.unwrap_or(d.min_rx_ms),
            min_tx_ms: b.min_tx_ms.unwrap_or(d.min_tx_ms),
            multiplier: b.multiplier.unwrap_or(d.multiplier),
        }
    });
    // BFD authentication: a bad setting leaves the peer without BFD (never with
    // unauthenticated BFD) and says why; the BGP session is kept.
    if let Some(a) = p.spec.bfd.as_ref().and_then(|b| b.authentication.as_ref()) {
        match bfd_auth(view, a) {
            Ok(auth) => cfg.bfd_auth = Some(auth),
            Err(e) => {
                warnings.push(format!(
                    "BGPPeer {name}: BFD authentication: {e}; BFD not configured for this peer (its BGP session runs without it)"
                ));
                cfg.bfd = None;
            }
        }
    }
    if let Some(r) = &p.spec.password_secret_ref {
        let ns = &view.secret_namespace;
        let key = r.key.as_deref().unwrap_or("password");
        match secret_value(view, &r.name, key) {
            Some(pw) => cfg.md5_password = Some(pw),
            None => {
                warnings.push(format!(
                    "BGPPeer {name}: password Secret {ns}/{} (key {key}) not found; session not configured",
                    r.name
                ));
                return None;
            }
        }
    }
    let own = p
        .spec
        .maintenance
        .as_ref()
        .and_then(|m| m.triggers.as_deref());
    if view.maintenance_triggers.drains(own, active) {
        cfg.drain = Some(drain_settings(p));
    }
    Some(cfg)
}

/// The graceful-maintenance settings of the BGPPeer `p` (its `spec.maintenance` over the
/// defaults), used while the node is in maintenance.
fn drain_settings(p: &BGPPeer) -> juneau_control::model::DrainSettings {
    let d = juneau_control::model::DrainSettings::default();
    let m = p.spec.maintenance.clone().unwrap_or_default();
    juneau_control::model::DrainSettings {
        as_path_prepend: m.as_path_prepend.unwrap_or(d.as_path_prepend),
        local_pref: m.local_pref.unwrap_or(d.local_pref),
        wait_seconds: m.drain_seconds.unwrap_or(d.wait_seconds),
    }
}

/// Every ServiceLoadBalancer's part of the node's state, merged.
#[derive(Default)]
struct MergedParts {
    services: Vec<NodeService>,
    /// The frontends of `services`.
    frontends: std::collections::HashSet<Frontend>,
    advertised: BTreeMap<IpAddr, AdvertisedVip>,
    /// Per VIP served here: the nodes with a serving endpoint (Ready, or serving while
    /// terminating: the drain case), asked about connections this node does not hold,
    /// each with its Ready endpoints of the VIP (summed over the Services sharing it).
    vip_nodes: BTreeMap<Ipv4Addr, BTreeMap<String, u32>>,
    /// The same per IPv6 VIP.
    vip_nodes6: BTreeMap<Ipv6Addr, BTreeMap<String, u32>>,
    /// IPv6 frontends (issue 28) and theirs.
    services6: Vec<NodeService6>,
    frontends6: std::collections::HashSet<Frontend6>,
    /// This node's IPv6 host-network endpoints left unserved, per Service.
    host_network6_unserved: usize,
}

impl MergedParts {
    /// Adds one ServiceLoadBalancer's part. Services sharing a VIP each bring theirs:
    /// one announcement per VIP ([`merge_announcements`]), one entry per frontend (the
    /// controller admits one Service per port of a shared VIP; should two parts still
    /// name one frontend for a moment, the first stays).
    fn add(&mut self, part: &SlbPart) {
        for s in &part.services {
            if self.frontends.insert(s.frontend) {
                self.services.push(s.clone());
            }
        }
        let v6 = part.v6.as_ref();
        for a in part
            .advertised
            .iter()
            .chain(v6.and_then(|p| p.advertised.as_ref()))
        {
            match self.advertised.get_mut(&a.vip) {
                Some(m) => merge_announcements(m, a),
                None => {
                    self.advertised.insert(a.vip, a.clone());
                }
            }
        }
        if let Some((vip, nodes)) = &part.vip_nodes {
            let merged = self.vip_nodes.entry(*vip).or_default();
            for (n, ready) in nodes {
                *merged.entry(n.clone()).or_default() += ready;
            }
        }
        if let Some((vip, nodes)) = v6.and_then(|p| p.vip_nodes.as_ref()) {
            let merged = self.vip_nodes6.entry(*vip).or_default();
            for (n, ready) in nodes {
                *merged.entry(n.clone()).or_default() += ready;
            }
        }
        for s in v6.into_iter().flat_map(|p| &p.services) {
            if self.frontends6.insert(s.frontend) {
                self.services6.push(s.clone());
            }
        }
        self.host_network6_unserved += v6.map_or(0, |p| p.host_network_unserved.len());
    }

    /// The frontends of a VIP this node announces for another Service sharing it, but
    /// without a backend of their own here: they hand each new connection to a node
    /// that has one, as under the Cluster policy (TCP connections and UDP flows), in
    /// either family.
    fn hand_off_shared_frontends(&mut self) {
        for s in &mut self.services {
            if s.backends.is_empty() && self.advertised.contains_key(&IpAddr::V4(s.frontend.vip)) {
                s.hand_off = true;
            }
        }
        for s in &mut self.services6 {
            if s.backends.is_empty() && self.advertised.contains_key(&IpAddr::V6(s.frontend.vip)) {
                s.hand_off = true;
            }
        }
    }
}

/// One announcement of a VIP that Services sharing it each asked for: every community,
/// the highest local preference, the union of the peers (none listed: all), the summed
/// weights (none if one is unweighted).
fn merge_announcements(into: &mut AdvertisedVip, other: &AdvertisedVip) {
    fn union<T: Ord + Clone>(a: &mut Vec<T>, b: &[T]) {
        a.extend_from_slice(b);
        a.sort_unstable();
        a.dedup();
    }
    union(&mut into.communities, &other.communities);
    union(&mut into.large_communities, &other.large_communities);
    into.local_pref = into.local_pref.max(other.local_pref);
    if into.peers.is_empty() || other.peers.is_empty() {
        into.peers.clear();
    } else {
        union(&mut into.peers, &other.peers);
    }
    into.weight = into.weight.zip(other.weight).map(|(a, b)| a + b);
}

/// Every ServiceLoadBalancer's part of the node's state, merged: from `cache` when its
/// objects and the shared ones did not change, computed (and cached) otherwise. Entries
/// of ServiceLoadBalancers no longer in the view are dropped from the cache.
fn merged_parts(ctx: NodeCtx<'_>, cache: &mut BuildCache) -> MergedParts {
    let NodeCtx { node, view, .. } = ctx;
    let mut merged = MergedParts::default();
    let fresh = Globals::of(node, view);
    let valid = cache.globals.as_ref().is_some_and(|g| g.same(&fresh));
    if !valid {
        cache.parts.clear();
    }
    // Entries are updated in place (a batch of events changes few); `epoch` marks the
    // ones still in the view.
    cache.epoch = cache.epoch.wrapping_add(1);
    let epoch = cache.epoch;
    let mut key = String::new();
    for slb in &view.slbs {
        use std::fmt::Write as _;
        key.clear();
        let _ = write!(
            key,
            "{}/{}",
            slb.metadata.namespace.as_deref().unwrap_or("default"),
            slb.metadata.name.as_deref().unwrap_or_default()
        );
        let svc = view.services.get(&key);
        let slices = view.slices.get(&key).map(Vec::as_slice).unwrap_or(&[]);
        let entry = match cache.parts.get_mut(key.as_str()) {
            Some(e) if e.inputs.same(slb, svc, slices) => e,
            _ => {
                let part = slb_part(ctx, slb, svc.map(|s| &**s), slices);
                let inputs = SlbInputs {
                    slb: Arc::clone(slb),
                    svc: svc.cloned(),
                    slices: slices.to_vec(),
                };
                cache.parts.insert(
                    key.clone(),
                    CachedPart {
                        inputs,
                        part,
                        epoch,
                    },
                );
                cache.parts.get_mut(key.as_str()).expect("just inserted")
            }
        };
        entry.epoch = epoch;
        if let Some(p) = &entry.part {
            merged.add(p);
        }
    }
    if cache.parts.len() != view.slbs.len() {
        cache.parts.retain(|_, e| e.epoch == epoch);
    }
    cache.globals = Some(fresh);
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{
        BGPAdvertisementSpec, BGPPeerSpec, SecretKeyRef, ServiceLoadBalancerSpec,
        ServiceLoadBalancerStatus, LOAD_BALANCER_CLASS,
    };
    use crate::endpoints::testutil::{node as plain_node, slice};

    /// A Node as the view holds it (shared).
    fn node(name: &str, address: &str, excluded: bool) -> (String, Arc<Node>) {
        let (k, n) = plain_node(name, address, excluded);
        (k, Arc::new(n))
    }
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use k8s_openapi::ByteString;
    use kube::api::ObjectMeta;

    fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: ns.map(String::from),
            ..Default::default()
        }
    }

    fn view() -> AgentView {
        let svc = Service {
            metadata: meta("nginx", Some("default")),
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                load_balancer_class: Some(LOAD_BALANCER_CLASS.into()),
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
            phase: Phase::Ready,
            ..Default::default()
        });
        let mut peer = BGPPeer::new(
            "tor",
            BGPPeerSpec {
                peer_address: "192.0.2.1".into(),
                peer_asn: 65000,
                local_asn: 65001,
                peer_port: None,
                source_address: None,
                node_selector: None,
                hold_time_seconds: Some(9),
                keepalive_time_seconds: None,
                connect_retry_seconds: None,
                password_secret_ref: Some(SecretKeyRef {
                    name: "bgp-pw".into(),
                    key: None,
                }),
                ebgp_multihop: None,
                graceful_restart: None,
                passive: None,
                bfd: Some(crate::crd::Bfd {
                    min_rx_ms: Some(150),
                    min_tx_ms: None,
                    multiplier: None,
                    authentication: None,
                }),
                maintenance: None,
            },
        );
        peer.metadata.labels = Some([("role".to_string(), "tor".to_string())].into());
        let adv = BGPAdvertisement::new(
            "public",
            BGPAdvertisementSpec {
                address_pools: vec!["public-v4".into()],
                service_selector: None,
                peer_selector: None,
                node_selector: None,
                communities: vec!["64512:100".into()],
                large_communities: vec!["64512:1:2".into()],
                local_pref: Some(150),
                weighted_by_backends: None,
            },
        );
        let secret = Secret {
            metadata: meta("bgp-pw", Some(DEFAULT_SECRET_NAMESPACE)),
            data: Some([("password".to_string(), ByteString(b"s3cret".to_vec()))].into()),
            ..Default::default()
        };
        AgentView {
            nodes: [
                node("node-a", "192.168.0.1", false),
                node("node-c", "192.168.0.3", false),
            ]
            .into(),
            slbs: vec![Arc::new(slb)],
            services: [("default/nginx".to_string(), Arc::new(svc))].into(),
            slices: [(
                "default/nginx".to_string(),
                vec![Arc::new(slice(
                    "nginx",
                    "nginx-1",
                    &[
                        ("10.0.0.1", "node-a", true, false),
                        ("10.0.0.2", "node-a", true, false),
                        ("10.0.0.3", "node-c", true, false),
                        ("10.0.0.4", "node-a", false, false),
                        ("10.0.0.5", "node-a", true, true),
                    ],
                    ("http", 8080),
                ))],
            )]
            .into(),
            peers: vec![Arc::new(peer)],
            advertisements: vec![Arc::new(adv)],
            secrets: [("bgp-pw".to_string(), Arc::new(secret))].into(),
            secret_namespace: DEFAULT_SECRET_NAMESPACE.into(),
            maintenance_triggers: Default::default(),
        }
    }

    #[test]
    fn seed_node_a() {
        let (s, w) = build_node_state("node-a", &view());
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(s.router_id, Some(Ipv4Addr::new(192, 168, 0, 1)));
        assert_eq!(s.services.len(), 1);
        let svc = &s.services[0];
        assert_eq!(
            svc.frontend,
            Frontend {
                vip: Ipv4Addr::new(203, 0, 113, 10),
                protocol: Protocol::Tcp,
                port: 80
            }
        );
        assert_eq!(
            svc.backends,
            vec![
                LocalBackend {
                    ip: Ipv4Addr::new(10, 0, 0, 1),
                    port: 8080
                },
                LocalBackend {
                    ip: Ipv4Addr::new(10, 0, 0, 2),
                    port: 8080
                }
            ]
        );
        assert_eq!(s.advertised.len(), 1);
        let a = &s.advertised[0];
        assert_eq!(a.communities, vec![64512 << 16 | 100]);
        assert_eq!(a.large_communities, vec![[64512, 1, 2]]);
        assert_eq!(a.local_pref, Some(150));
        assert!(a.peers.is_empty());
        assert_eq!(s.peers.len(), 1);
        assert_eq!(
            s.peers[0].md5_password.as_ref().map(|p| p.expose()),
            Some("s3cret")
        );
        // The agent logs the state with `debug!(?state)`, and status is serialized: the
        // password must be in neither (issue #25).
        let debug = format!("{s:?}");
        assert!(!debug.contains("s3cret"), "password in Debug: {debug}");
        assert!(debug.contains("<redacted>"), "{debug}");
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("s3cret"), "password in JSON: {json}");
        let view = format!("{:?}", view());
        assert!(
            !view.contains("s3cret"),
            "Secret data in the view's Debug: {view}"
        );
        assert!(
            !view.contains("115, 51, 99"),
            "Secret bytes in the view's Debug: {view}"
        );
        assert_eq!(
            s.peers[0].bfd,
            Some(juneau_control::model::BfdSettings {
                min_rx_ms: 150,
                min_tx_ms: 300,
                multiplier: 3
            }),
            "BFD from the BGPPeer, defaults filled in"
        );
        assert_eq!(s.peers[0].hold_time, 9);
        assert_eq!(s.peers[0].keepalive_time, 3);
        assert_eq!(s.peers[0].drain, None, "not cordoned");
        assert_eq!(a.weight, None, "not asked for");
    }

    fn with_bfd_auth(type_: &str, key_id: i64, secret: &str, key: Option<&str>) -> AgentView {
        let mut v = view();
        Arc::make_mut(&mut v.peers[0])
            .spec
            .bfd
            .as_mut()
            .unwrap()
            .authentication = Some(crate::crd::BfdAuthentication {
            type_: type_.into(),
            key_id,
            secret_ref: SecretKeyRef {
                name: secret.into(),
                key: Some("bfd".into()),
            },
        });
        if let Some(k) = key {
            v.secrets.insert(
                "bfd-key".into(),
                Arc::new(Secret {
                    metadata: meta("bfd-key", Some(DEFAULT_SECRET_NAMESPACE)),
                    data: Some([("bfd".to_string(), ByteString(k.as_bytes().to_vec()))].into()),
                    ..Default::default()
                }),
            );
        }
        v
    }

    fn with_peer_address(peer: &str, source: Option<&str>) -> AgentView {
        let mut v = view();
        let spec = &mut Arc::make_mut(&mut v.peers[0]).spec;
        spec.peer_address = peer.into();
        spec.source_address = source.map(Into::into);
        v
    }

    /// An IPv6 BGPPeer (issue 28) reaches the node state with its IPv6 source address,
    /// and the VIPs go to it as to an IPv4 one.
    #[test]
    fn an_ipv6_peer_reaches_the_state_with_its_source_address() {
        let (good, _) = build_node_state("node-a", &view());
        let (s, w) = build_node_state(
            "node-a",
            &with_peer_address("2001:db8::1", Some("2001:db8::11")),
        );
        assert!(w.is_empty(), "{w:?}");
        let p = &s.peers[0];
        assert_eq!(p.peer_address, "2001:db8::1".parse::<IpAddr>().unwrap());
        assert_eq!(p.source_address, Some("2001:db8::11".parse().unwrap()));
        assert_eq!(s.advertised, good.advertised);
        // And it can be published.
        let dir = tempfile::tempdir().unwrap();
        let mut wr = juneau_control::shm::NodeStateWriter::create(
            dir.path().join("s"),
            juneau_control::shm::Capacity::default(),
        )
        .unwrap();
        wr.publish(&s).unwrap();
    }

    /// Bad input: a peer whose address the state cannot carry, or whose source is of the
    /// other family, is skipped with a warning naming it; the rest of the state stays.
    #[test]
    fn an_unusable_peer_address_is_a_warning_and_costs_only_that_peer() {
        let (good, _) = build_node_state("node-a", &view());
        for (peer, source, says) in [
            ("fe80::1", None, "peerAddress fe80::1 is link-local"),
            ("::ffff:192.0.2.1", None, "is IPv4-mapped"),
            ("ff02::5", None, "is a multicast address"),
            (
                "2001:db8::1",
                Some("192.0.2.11"),
                "sourceAddress 192.0.2.11 is not",
            ),
            (
                "192.0.2.1",
                Some("2001:db8::11"),
                "sourceAddress 2001:db8::11 is not",
            ),
            (
                "tor.example",
                None,
                "\"tor.example\" is not an IPv4 or IPv6 address",
            ),
        ] {
            let (s, w) = build_node_state("node-a", &with_peer_address(peer, source));
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].starts_with("BGPPeer tor: "), "{}", w[0]);
            assert!(w[0].contains(says), "{} lacks {says}", w[0]);
            assert!(s.peers.is_empty(), "{:?}", s.peers);
            assert_eq!(s.services, good.services);
        }
    }

    #[test]
    fn bfd_authentication_takes_its_key_from_the_secret() {
        use juneau_control::model::{BfdAuth, BfdAuthType};
        for (t, want) in [
            ("keyedSHA1", BfdAuthType::KeyedSha1),
            ("meticulousKeyedSHA1", BfdAuthType::MeticulousKeyedSha1),
        ] {
            let (s, w) = build_node_state(
                "node-a",
                &with_bfd_auth(t, 255, "bfd-key", Some("bfd-K3y-20-bytes-max")),
            );
            assert!(w.is_empty(), "{w:?}");
            assert!(s.peers[0].bfd.is_some());
            assert_eq!(
                s.peers[0].bfd_auth,
                Some(BfdAuth {
                    auth_type: want,
                    key_id: 255,
                    key: "bfd-K3y-20-bytes-max".into()
                })
            );
            // Never in the logged state or its serialization.
            assert!(!format!("{s:?}").contains("bfd-K3y"));
            assert!(!serde_json::to_string(&s).unwrap().contains("bfd-K3y"));
        }
    }

    /// Bad input: each becomes a warning that names the peer and the problem (never the
    /// key); that peer runs without BFD, its BGP session and everything else stay.
    #[test]
    fn bad_bfd_authentication_is_a_warning_and_costs_only_that_peers_bfd() {
        let (good, _) = build_node_state("node-a", &view());
        for (v, says) in [
            (
                with_bfd_auth("md5", 1, "bfd-key", Some("k")),
                "type \"md5\" is not one of keyedSHA1, meticulousKeyedSHA1",
            ),
            (
                with_bfd_auth("keyedSHA1", 256, "bfd-key", Some("k")),
                "keyID 256 is outside 0-255",
            ),
            (
                with_bfd_auth("keyedSHA1", -1, "bfd-key", Some("k")),
                "keyID -1 is outside 0-255",
            ),
            (
                with_bfd_auth("keyedSHA1", 1, "missing", None),
                "key Secret juneau-system/missing (key bfd) not found",
            ),
            (
                with_bfd_auth("keyedSHA1", 1, "bfd-key", Some("twenty-one-bytes-key!")),
                "is 21 bytes; keyed SHA1 takes 1 to 20",
            ),
            (
                with_bfd_auth("keyedSHA1", 1, "bfd-key", Some("")),
                "is 0 bytes",
            ),
        ] {
            let (s, w) = build_node_state("node-a", &v);
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(
                w[0].starts_with("BGPPeer tor: BFD authentication: "),
                "{}",
                w[0]
            );
            assert!(w[0].contains(says), "{} lacks {says}", w[0]);
            assert!(w[0].contains("BFD not configured"), "{}", w[0]);
            assert!(
                !w[0].contains("twenty-one"),
                "the key in a warning: {}",
                w[0]
            );
            assert_eq!(s.peers.len(), 1, "the BGP session stays");
            assert_eq!(s.peers[0].bfd, None);
            assert_eq!(s.peers[0].bfd_auth, None);
            assert_eq!(
                s.peers[0].md5_password, good.peers[0].md5_password,
                "the rest of the peer as before"
            );
            assert_eq!(s.advertised, good.advertised);
            assert_eq!(s.services, good.services);
        }
    }

    #[test]
    fn weighted_advertisement_carries_the_ready_local_pods() {
        let mut v = view();
        Arc::make_mut(&mut v.advertisements[0])
            .spec
            .weighted_by_backends = Some(true);
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.advertised[0].weight, Some(2), "two Ready Pods on node-a");
    }

    /// A cached build is the uncached one, whatever changed in between: a Service's
    /// slices, this node's labels and spec, a peer, an advertisement, a Secret, an
    /// object gone.
    #[test]
    fn a_cached_build_equals_a_fresh_one_after_any_change() {
        let mut cache = BuildCache::default();
        let mut v = view();
        let check = |v: &AgentView, cache: &mut BuildCache, what: &str| {
            let cached = build_node_state_with("node-a", v, cache);
            assert_eq!(cached, build_node_state("node-a", v), "after: {what}");
        };
        check(&v, &mut cache, "nothing (first build)");
        check(&v, &mut cache, "nothing (reused)");
        Arc::make_mut(&mut v.slices.get_mut("default/nginx").unwrap()[0]).endpoints[2].node_name =
            Some("node-a".into());
        check(&v, &mut cache, "an endpoint moved to this node");
        Arc::make_mut(v.nodes.get_mut("node-a").unwrap())
            .spec
            .get_or_insert_with(Default::default)
            .unschedulable = Some(true);
        check(&v, &mut cache, "the node cordoned");
        Arc::make_mut(v.nodes.get_mut("node-a").unwrap())
            .metadata
            .annotations = Some(
            [(
                crate::maintenance::MAINTENANCE_ANNOTATION.to_string(),
                "true".into(),
            )]
            .into(),
        );
        check(&v, &mut cache, "the node annotated for maintenance");
        v.maintenance_triggers = crate::maintenance::Triggers(vec![]);
        check(&v, &mut cache, "no maintenance trigger");
        Arc::make_mut(&mut v.advertisements[0])
            .spec
            .weighted_by_backends = Some(true);
        check(&v, &mut cache, "an advertisement weighted");
        Arc::make_mut(&mut v.peers[0]).spec.peer_asn = 65100;
        check(&v, &mut cache, "a peer's ASN");
        v.secrets.clear();
        check(&v, &mut cache, "the Secret gone");
        Arc::make_mut(&mut v.slbs[0]).status.as_mut().unwrap().vip = Some("203.0.113.11".into());
        check(&v, &mut cache, "another VIP");
        v.services.clear();
        check(&v, &mut cache, "the Service gone");
        let fresh = view();
        v.services = fresh.services.clone();
        v.slices.clear();
        check(&v, &mut cache, "the Service back, its slices gone");
        v.nodes
            .insert("node-a".into(), node("node-a", "192.168.0.1", true).1);
        check(&v, &mut cache, "the node excluded");
    }

    #[test]
    fn a_node_drains_on_its_peers_triggers_and_not_on_a_plain_cordon() {
        use crate::crd::MaintenanceTrigger::*;
        let drain = Some(juneau_control::model::DrainSettings::default());
        let mut v = view();
        let n = Arc::make_mut(v.nodes.get_mut("node-a").unwrap());
        n.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.peers[0].drain, None, "cordon is no default trigger");
        assert_eq!(s.advertised.len(), 1);
        // The agent's --maintenance-triggers, and a peer's own list over it.
        v.maintenance_triggers = crate::maintenance::Triggers(vec![Cordon]);
        assert_eq!(build_node_state("node-a", &v).0.peers[0].drain, drain);
        v.maintenance_triggers = Default::default();
        Arc::make_mut(&mut v.peers[0]).spec.maintenance = Some(crate::crd::Maintenance {
            triggers: Some(vec![Cordon]),
            as_path_prepend: Some(5),
            local_pref: None,
            drain_seconds: Some(4),
        });
        let (s, _) = build_node_state("node-a", &v);
        let d = s.peers[0].drain.unwrap();
        assert_eq!((d.as_path_prepend, d.local_pref, d.wait_seconds), (5, 0, 4));
        assert_eq!(s.advertised.len(), 1, "still announced: the speaker drains");
    }

    #[test]
    fn the_annotation_drains_the_exclude_label_drains_or_withdraws_at_once() {
        use crate::crd::MaintenanceTrigger::*;
        let mut v = view();
        let n = Arc::make_mut(v.nodes.get_mut("node-a").unwrap());
        n.metadata.annotations = Some(
            [(
                crate::maintenance::MAINTENANCE_ANNOTATION.to_string(),
                "true".into(),
            )]
            .into(),
        );
        let (s, w) = build_node_state("node-a", &v);
        assert!(
            s.peers[0].drain.is_some() && s.advertised.len() == 1,
            "{w:?}"
        );
        // The label, a default trigger: drained, then withdrawn by the speaker.
        v.nodes
            .insert("node-a".into(), node("node-a", "192.168.0.1", true).1);
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.peers[0].drain.is_some());
        assert_eq!(s.advertised.len(), 1, "announced while the peers drain");
        // A peer that does not drain on it: withdrawn at once, as without maintenance.
        Arc::make_mut(&mut v.peers[0]).spec.maintenance = Some(crate::crd::Maintenance {
            triggers: Some(vec![Annotation]),
            ..Default::default()
        });
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.peers[0].drain, None);
        assert!(s.advertised.is_empty(), "excluded at once");
        // A meaningless annotation value is reported; the node keeps announcing.
        Arc::make_mut(&mut v.peers[0]).spec.maintenance = None;
        v.nodes
            .insert("node-a".into(), node("node-a", "192.168.0.1", false).1);
        Arc::make_mut(v.nodes.get_mut("node-a").unwrap())
            .metadata
            .annotations = Some(
            [(
                crate::maintenance::MAINTENANCE_ANNOTATION.to_string(),
                "yes".into(),
            )]
            .into(),
        );
        let (s, w) = build_node_state("node-a", &v);
        assert!(s.peers[0].drain.is_none() && s.advertised.len() == 1);
        assert!(w.iter().any(|w| w.contains("maintenance=\"yes\"")), "{w:?}");
    }

    /// The Service's source ranges reach each of its frontends; ranges that cannot be
    /// honoured (IPv6 only) leave the Service served by no node, not open to all.
    #[test]
    fn source_ranges_reach_the_frontends_and_bad_ones_serve_nothing() {
        let set = |v: &mut AgentView, ranges: &[&str]| {
            let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
            svc.spec.as_mut().unwrap().load_balancer_source_ranges =
                Some(ranges.iter().map(|r| r.to_string()).collect());
        };
        let mut v = view();
        set(&mut v, &["198.51.100.0/24", "2001:db8::/32", "192.0.2.7"]);
        let (s, _) = build_node_state("node-a", &v);
        let shown: Vec<String> = s.services[0]
            .source_ranges
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(shown, ["192.0.2.7/32", "198.51.100.0/24"]);
        assert_eq!(s.advertised.len(), 1);

        set(&mut v, &["2001:db8::/32"]);
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services.is_empty() && s.advertised.is_empty(), "{s:?}");

        set(&mut v, &[]);
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services[0].source_ranges.is_empty());
    }

    /// `sessionAffinity: ClientIP` reaches the frontends with its timeout (Kubernetes'
    /// default when the config names none).
    #[test]
    fn client_ip_affinity_reaches_the_frontends() {
        use k8s_openapi::api::core::v1::{ClientIPConfig, SessionAffinityConfig};
        let mut v = view();
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services[0].client_ip_affinity, None);
        let set = |v: &mut AgentView, config: Option<i32>| {
            let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
            let sp = svc.spec.as_mut().unwrap();
            sp.session_affinity = Some("ClientIP".into());
            sp.session_affinity_config = config.map(|t| SessionAffinityConfig {
                client_ip: Some(ClientIPConfig {
                    timeout_seconds: Some(t),
                }),
            });
        };
        set(&mut v, None);
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services[0].client_ip_affinity, Some(10_800));
        set(&mut v, Some(600));
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services[0].client_ip_affinity, Some(600));
    }

    #[test]
    fn host_network_backends_are_served_by_their_node_s_own_stack_under_local_policy() {
        let mut v = view();
        let host_slice = |eps: &[(&str, &str, bool, bool)]| {
            vec![Arc::new(slice("nginx", "nginx-1", eps, ("http", 8080)))]
        };
        // An ingress controller on each node's own address.
        v.slices.insert(
            "default/nginx".into(),
            host_slice(&[
                ("192.168.0.1", "node-a", true, false),
                ("192.168.0.3", "node-c", true, false),
            ]),
        );
        let (s, w) = build_node_state("node-a", &v);
        assert!(w.is_empty(), "{w:?}");
        assert!(s.services[0].host_network);
        assert_eq!(
            s.services[0].backends,
            vec![LocalBackend {
                ip: Ipv4Addr::new(192, 168, 0, 1),
                port: 8080
            }]
        );
        assert_eq!(s.advertised.len(), 1, "announced where it runs");
        // Mixed with a Pod, or under the Cluster policy: served by no node.
        v.slices.insert(
            "default/nginx".into(),
            host_slice(&[
                ("192.168.0.1", "node-a", true, false),
                ("10.0.0.3", "node-c", true, false),
            ]),
        );
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services.is_empty() && s.advertised.is_empty(), "{s:?}");
        v.slices.insert(
            "default/nginx".into(),
            host_slice(&[("192.168.0.1", "node-a", true, false)]),
        );
        let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
        svc.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services.is_empty() && s.advertised.is_empty(), "{s:?}");
    }

    #[test]
    fn under_the_cluster_policy_a_node_without_backends_announces_and_hands_connections_on() {
        let mut v = view();
        v.nodes.extend([node("node-b", "192.168.0.2", false)]);
        let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
        svc.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
        let (s, w) = build_node_state("node-b", &v);
        assert!(w.is_empty(), "{w:?}");
        assert!(s.services[0].backends.is_empty());
        assert!(s.services[0].hand_off);
        assert_eq!(s.advertised.len(), 1, "{s:?}");
        assert_eq!(s.advertised[0].weight, None, "no node weighs more");
        assert_eq!(
            s.redirects.weighted_peers_of(s.redirects.vips[0].vip),
            [
                (Ipv4Addr::new(192, 168, 0, 1), 2),
                (Ipv4Addr::new(192, 168, 0, 3), 1)
            ],
            "the nodes with endpoints take its connections, by their Ready endpoints"
        );
        let (a, _) = build_node_state("node-a", &v);
        assert!(a.services[0].hand_off && !a.services[0].backends.is_empty());
        assert_eq!(a.advertised.len(), 1);
        assert_eq!(
            a.redirects.weighted_peers_of(a.redirects.vips[0].vip),
            [
                (Ipv4Addr::new(192, 168, 0, 2), 0),
                (Ipv4Addr::new(192, 168, 0, 3), 1)
            ],
            "node-a takes node-b's connections; node-b (no endpoint) is no place to hand one"
        );
        // No Ready endpoint on any node: nobody announces it.
        v.slices.clear();
        let (s, _) = build_node_state("node-b", &v);
        assert!(s.advertised.is_empty());
    }

    /// `admin`: a second Service sharing nginx's VIPs (its ServiceLoadBalancer a copy
    /// of nginx's) on port 8443, one Ready Pod on node-c at each of `addresses`.
    fn share_with_admin(v: &mut AgentView, addresses: &[&str]) {
        let mut admin = (**v.services.get("default/nginx").unwrap()).clone();
        admin.metadata = meta("admin", Some("default"));
        admin.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8443;
        let mut slb = (*v.slbs[0]).clone();
        slb.metadata = meta("admin", Some("default"));
        v.services.insert("default/admin".into(), Arc::new(admin));
        v.slbs.push(Arc::new(slb));
        let pods = addresses.iter().enumerate().map(|(i, addr)| {
            let name = format!("admin-{}", i + 1);
            let pod = [(*addr, "node-c", true, false)];
            Arc::new(slice("admin", &name, &pod, ("http", 8443)))
        });
        v.slices.insert("default/admin".into(), pods.collect());
    }

    #[test]
    fn services_sharing_a_vip_announce_it_once_and_hand_on_a_port_whose_backends_are_elsewhere() {
        let mut v = view();
        v.nodes.extend([node("node-b", "192.168.0.2", false)]);
        // `admin` shares nginx's VIP (the controller gave both the group's address), on
        // 8443, its only Pod on node-c; the advertisement weighs by backends.
        share_with_admin(&mut v, &["10.0.0.9"]);
        Arc::make_mut(&mut v.advertisements[0])
            .spec
            .weighted_by_backends = Some(true);
        let frontend = |s: &NodeState, port: u16| {
            s.services
                .iter()
                .find(|x| x.frontend.port == port)
                .cloned()
                .unwrap()
        };
        let (a, w) = build_node_state("node-a", &v);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(
            a.advertised.len(),
            1,
            "one announcement for the shared VIP: {a:?}"
        );
        assert_eq!(a.advertised[0].weight, Some(2), "node-a's Ready nginx Pods");
        assert!(!frontend(&a, 80).hand_off, "nginx is served here");
        let admin_here = frontend(&a, 8443);
        assert!(
            admin_here.backends.is_empty() && admin_here.hand_off,
            "handed on"
        );
        assert_eq!(
            a.redirects.weighted_peers_of(a.redirects.vips[0].vip),
            [(Ipv4Addr::new(192, 168, 0, 3), 2)],
            "to node-c, which has admin's Pod (and web's: the VIP's endpoints summed)"
        );
        let (c, _) = build_node_state("node-c", &v);
        assert_eq!(c.advertised.len(), 1);
        assert_eq!(
            c.advertised[0].weight,
            Some(2),
            "one Pod of each Service, summed"
        );
        assert!(c
            .services
            .iter()
            .all(|x| !x.backends.is_empty() && !x.hand_off));
        let (b, _) = build_node_state("node-b", &v);
        assert!(
            b.advertised.is_empty(),
            "no Pod of either Service on node-b"
        );
        assert!(b.services.iter().all(|x| !x.hand_off));
    }

    #[test]
    fn node_without_backends_serves_nothing_and_announces_nothing() {
        let (s, _) = build_node_state("node-b", &view());
        assert_eq!(s.services.len(), 1);
        assert!(s.services[0].backends.is_empty());
        assert!(s.advertised.is_empty());
    }

    #[test]
    fn excluded_failed_missing_advertisement_and_secret() {
        // Excluded, the label no maintenance trigger: withdrawn at once.
        let mut v = view();
        v.maintenance_triggers = crate::maintenance::Triggers(vec![]);
        v.nodes
            .insert("node-a".into(), node("node-a", "192.168.0.1", true).1);
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.advertised.is_empty());

        let mut v = view();
        v.advertisements.clear();
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.advertised.is_empty());
        assert_eq!(s.services[0].backends.len(), 2);

        let mut v = view();
        Arc::make_mut(&mut v.slbs[0]).status.as_mut().unwrap().phase = Phase::Failed;
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services.is_empty() && s.advertised.is_empty());

        let mut v = view();
        v.secrets.clear();
        let (s, w) = build_node_state("node-a", &v);
        assert!(s.peers.is_empty());
        assert!(w[0].contains("bgp-pw"));
    }

    /// A BGPAdvertisement with a serviceSelector gives the Services it selects their own
    /// attributes (and nodes); the pool's general one stays for the others.
    #[test]
    fn a_service_specific_advertisement_replaces_the_pools_general_one() {
        let mut v = view();
        let gold = LabelSelector {
            match_labels: Some([("tier".to_string(), "gold".to_string())].into()),
            ..Default::default()
        };
        let mut specific = (*v.advertisements[0]).clone();
        specific.metadata.name = Some("gold".into());
        specific.spec.service_selector = Some(gold);
        specific.spec.communities = vec!["64512:900".into()];
        specific.spec.large_communities.clear();
        specific.spec.local_pref = None;
        v.advertisements.push(Arc::new(specific));
        let communities = |v: &AgentView| -> Vec<Vec<u32>> {
            let (s, _) = build_node_state("node-a", v);
            s.advertised.iter().map(|a| a.communities.clone()).collect()
        };
        assert_eq!(
            communities(&v),
            [vec![64512 << 16 | 100]],
            "not gold: the general one"
        );
        let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
        svc.metadata.labels = Some([("tier".to_string(), "gold".to_string())].into());
        assert_eq!(
            communities(&v),
            [vec![64512 << 16 | 900]],
            "gold: its own only"
        );
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(
            s.advertised[0].local_pref, None,
            "nothing of the general one"
        );
        // Its own node selector: node-a is not among its nodes, so it announces nothing
        // (the general advertisement does not stand in).
        Arc::make_mut(v.advertisements.last_mut().unwrap())
            .spec
            .node_selector = Some(LabelSelector {
            match_labels: Some([("rack".to_string(), "r9".to_string())].into()),
            ..Default::default()
        });
        assert_eq!(communities(&v), Vec::<Vec<u32>>::new());
    }

    #[test]
    fn peer_selector_gives_indexes() {
        let mut v = view();
        Arc::make_mut(&mut v.advertisements[0]).spec.peer_selector = Some(LabelSelector {
            match_labels: Some([("role".to_string(), "tor".to_string())].into()),
            ..Default::default()
        });
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.advertised[0].peers, vec![0]);
        Arc::make_mut(&mut v.advertisements[0]).spec.peer_selector = Some(LabelSelector {
            match_labels: Some([("role".to_string(), "other".to_string())].into()),
            ..Default::default()
        });
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.advertised.is_empty());
    }

    #[test]
    fn udp_and_unnamed_ports_resolve_per_protocol() {
        let mut v = view();
        let spec = Arc::make_mut(v.services.get_mut("default/nginx").unwrap())
            .spec
            .as_mut()
            .unwrap();
        spec.ports = Some(vec![
            ServicePort {
                name: Some("dns".into()),
                protocol: Some("UDP".into()),
                port: 53,
                target_port: Some(IntOrString::Int(5353)),
                ..Default::default()
            },
            ServicePort {
                name: Some("dns-tcp".into()),
                protocol: Some("TCP".into()),
                port: 53,
                target_port: Some(IntOrString::Int(5354)),
                ..Default::default()
            },
        ]);
        let mut sl = slice(
            "nginx",
            "n",
            &[("10.0.0.1", "node-a", true, false)],
            ("dns", 5353),
        );
        let ports = sl.ports.as_mut().unwrap();
        ports[0].protocol = Some("UDP".into());
        ports.push(k8s_openapi::api::discovery::v1::EndpointPort {
            name: Some("dns-tcp".into()),
            port: Some(5354),
            protocol: Some("TCP".into()),
            ..Default::default()
        });
        v.slices.insert("default/nginx".into(), vec![Arc::new(sl)]);
        let (s, _) = build_node_state("node-a", &v);
        let vip = Ipv4Addr::new(203, 0, 113, 10);
        let udp = s
            .service(&Frontend {
                vip,
                protocol: Protocol::Udp,
                port: 53,
            })
            .unwrap();
        assert_eq!(
            udp.backends,
            vec![LocalBackend {
                ip: Ipv4Addr::new(10, 0, 0, 1),
                port: 5353
            }]
        );
        let tcp = s
            .service(&Frontend {
                vip,
                protocol: Protocol::Tcp,
                port: 53,
            })
            .unwrap();
        assert_eq!(
            tcp.backends,
            vec![LocalBackend {
                ip: Ipv4Addr::new(10, 0, 0, 1),
                port: 5354
            }]
        );

        // A single unnamed port: the slice's port has an empty name.
        let mut v = view();
        let spec = Arc::make_mut(v.services.get_mut("default/nginx").unwrap())
            .spec
            .as_mut()
            .unwrap();
        spec.ports.as_mut().unwrap()[0].name = None;
        let mut sl = slice(
            "nginx",
            "n",
            &[("10.0.0.1", "node-a", true, false)],
            ("", 9000),
        );
        sl.ports.as_mut().unwrap()[0].name = Some(String::new());
        v.slices.insert("default/nginx".into(), vec![Arc::new(sl)]);
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services[0].backends[0].port, 9000);
    }

    #[test]
    fn endpoints_taking_no_new_traffic_drain_and_never_advertise() {
        let b = |last: u8| LocalBackend {
            ip: Ipv4Addr::new(10, 0, 0, last),
            port: 8080,
        };
        // node-a has Ready .1, .2, not Ready .4 and terminating .5: .4 and .5 keep the
        // flows they have.
        let (s, _) = build_node_state("node-a", &view());
        assert_eq!(s.services[0].backends, vec![b(1), b(2)]);
        assert_eq!(s.services[0].terminating, vec![b(4), b(5)]);
        assert_eq!(s.advertised.len(), 1);

        // Only terminating endpoints left on node-a: the frontend stays (existing flows
        // are forwarded), the VIP is not advertised; one that no longer serves (a Pod
        // failing readiness as it shuts down) keeps its flows too, until it is gone.
        let mut v = view();
        let mut sl = slice(
            "nginx",
            "nginx-1",
            &[
                ("10.0.0.5", "node-a", true, true),
                ("10.0.0.6", "node-a", false, true),
                ("10.0.0.3", "node-c", true, false),
            ],
            ("http", 8080),
        );
        // Kubernetes reports ready=false for a terminating endpoint; serving says
        // whether it still answers.
        let c = sl.endpoints[0].conditions.as_mut().unwrap();
        c.ready = Some(false);
        c.serving = Some(true);
        v.slices.insert("default/nginx".into(), vec![Arc::new(sl)]);
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services.len(), 1);
        assert!(s.services[0].backends.is_empty());
        assert_eq!(s.services[0].terminating, vec![b(5), b(6)]);
        assert!(s.advertised.is_empty(), "{:?}", s.advertised);
        // node-c still advertises.
        let (s, _) = build_node_state("node-c", &v);
        assert_eq!(s.advertised.len(), 1);
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn annotate(v: &mut AgentView, node: &str, value: &str) {
        Arc::make_mut(v.nodes.get_mut(node).unwrap())
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(REDIRECT_ADDRESS_ANNOTATION.into(), value.into());
    }

    #[test]
    fn a_bad_redirect_address_annotation_is_reported_and_the_node_left_out() {
        let mut v = view();
        v.nodes.extend([node("node-b", "192.168.0.2", false)]);
        Arc::make_mut(&mut v.slices.get_mut("default/nginx").unwrap()[0])
            .endpoints
            .push(
                slice(
                    "nginx",
                    "x",
                    &[("10.0.0.7", "node-b", true, false)],
                    ("http", 8080),
                )
                .endpoints[0]
                    .clone(),
            );
        annotate(&mut v, "node-c", "not-an-address");
        annotate(&mut v, "node-b", "0.0.0.0");
        let (s, w) = build_node_state("node-a", &v);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w.iter().any(|m| m.contains("node-c")
                && m.contains(REDIRECT_ADDRESS_ANNOTATION)
                && m.contains("not-an-address")),
            "{w:?}"
        );
        // Everything else is still published: services, advertisement, this node's own
        // address; the VIP simply has no peer to ask.
        assert_eq!(s.services[0].backends.len(), 2);
        assert_eq!(s.advertised.len(), 1);
        assert_eq!(s.redirects.node_address, Some(ip("192.168.0.1")));
        assert_eq!(s.redirects.vips.len(), 1);
        assert!(s.redirects.vips[0].nodes.is_empty());
        // A bad annotation on this node's own Node: no own address (the dataplane takes
        // no redirects from the state), peers still published.
        let mut v = view();
        annotate(&mut v, "node-a", "192.168.0.300");
        let (s, w) = build_node_state("node-a", &v);
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(s.redirects.node_address, None);
        assert_eq!(
            s.redirects.weighted_peers_of(ip("203.0.113.10")),
            [(ip("192.168.0.3"), 1)]
        );
    }

    #[test]
    fn redirect_peers_are_the_other_nodes_with_listed_endpoints() {
        let mut v = view();
        v.nodes.extend([
            node("node-b", "192.168.0.2", false),
            node("node-d", "192.168.0.4", false),
            node("node-e", "192.168.0.5", false),
        ]);
        let mut sl = slice(
            "nginx",
            "nginx-2",
            &[
                // node-b: Ready. node-d: terminating but still serving (drain). node-e:
                // neither Ready nor serving, but listed: it may still hold connections.
                ("10.0.1.1", "node-b", true, false),
                ("10.0.1.2", "node-d", false, true),
                ("10.0.1.3", "node-e", false, false),
            ],
            ("http", 8080),
        );
        sl.endpoints[1].conditions.as_mut().unwrap().serving = Some(true);
        v.slices
            .get_mut("default/nginx")
            .unwrap()
            .push(Arc::new(sl));
        // node-c's uplink is on another network: its annotation wins over InternalIP.
        annotate(&mut v, "node-c", " 192.0.2.13 ");
        let (s, w) = build_node_state("node-a", &v);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(s.redirects.node_address, Some(ip("192.168.0.1")));
        assert_eq!(
            s.redirects.weighted_peers_of(ip("203.0.113.10")),
            [
                (ip("192.0.2.13"), 1),
                (ip("192.168.0.2"), 1),
                (ip("192.168.0.4"), 0),
                (ip("192.168.0.5"), 0)
            ],
            "sorted, without this node; weighed by Ready endpoints (draining node-d: none)"
        );
        // node-e's list holds every other node with an endpoint, node-a included.
        let (s, _) = build_node_state("node-e", &v);
        assert_eq!(s.redirects.node_address, Some(ip("192.168.0.5")));
        assert_eq!(
            s.redirects.weighted_peers_of(ip("203.0.113.10")),
            [
                (ip("192.0.2.13"), 1),
                (ip("192.168.0.1"), 2),
                (ip("192.168.0.2"), 1),
                (ip("192.168.0.4"), 0)
            ]
        );
        // A node the agent does not know (yet) is left out silently.
        let (s, w) = build_node_state("node-z", &v);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(s.redirects.node_address, None);
        let peers = s.redirects.weighted_peers_of(ip("203.0.113.10"));
        assert_eq!(peers.len(), 5);
        assert_eq!(peers.iter().map(|p| p.1).sum::<u32>(), 4, "{peers:?}");
    }

    /// A VIP's peer list holds at most 64 entries: weights beyond that are scaled down
    /// (each node with an endpoint keeps one at least), and when even one each does not
    /// fit, every node is listed once (spread evenly).
    #[test]
    fn weights_are_scaled_down_to_fit_the_list() {
        let a = |d: u8| Ipv4Addr::new(192, 168, 0, d);
        let exact = weighted_peers(&[(a(1), 2), (a(2), 0), (a(3), 1)]).unwrap();
        assert_eq!(exact, [a(1), a(1), a(1), a(2), a(3), a(3)]);
        // 4 nodes, 300 + 100 + 1 + 0 endpoints: 60 entries of room for the weights.
        let big = weighted_peers(&[(a(1), 300), (a(2), 100), (a(3), 1), (a(4), 0)]).unwrap();
        assert_eq!(big.len(), MAX_REDIRECT_NODES_PER_VIP);
        let weight = |x| big.iter().filter(|n| **n == x).count() - 1;
        assert_eq!(
            (weight(a(1)), weight(a(2)), weight(a(3)), weight(a(4))),
            (44, 15, 1, 0)
        );
        // 40 nodes with endpoints: 24 entries of room, fewer than the 40 weights.
        let crowd: Vec<_> = (1..=40).map(|d| (a(d), 3)).collect();
        assert_eq!(weighted_peers(&crowd), None);
        let none: Vec<_> = (1..=64).map(|d| (a(d), 0)).collect();
        assert_eq!(weighted_peers(&none).unwrap().len(), 64);
    }

    #[test]
    fn nodes_that_can_never_announce_the_vip_are_not_asked() {
        let mut v = view();
        v.nodes.extend([
            node("node-b", "192.168.0.2", false),
            node("node-d", "192.168.0.4", false),
        ]);
        v.slices
            .get_mut("default/nginx")
            .unwrap()
            .push(Arc::new(slice(
                "nginx",
                "nginx-2",
                &[
                    ("10.0.1.1", "node-b", true, false),
                    ("10.0.1.2", "node-d", true, false),
                ],
                ("http", 8080),
            )));
        let edge = |v: &mut AgentView, n: &str| {
            Arc::make_mut(v.nodes.get_mut(n).unwrap())
                .metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert("edge".into(), "true".into());
        };
        for n in ["node-a", "node-c", "node-d"] {
            edge(&mut v, n);
        }
        let edge_only = LabelSelector {
            match_labels: Some([("edge".to_string(), "true".to_string())].into()),
            ..Default::default()
        };
        // Only edge nodes peer: node-b (not edge) runs Pods but never announces.
        Arc::make_mut(&mut v.peers[0]).spec.node_selector = Some(edge_only.clone());
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(
            s.redirects.weighted_peers_of(ip("203.0.113.10")),
            [(ip("192.168.0.3"), 1), (ip("192.168.0.4"), 1)]
        );
        // Only node-a and node-c get the VIP's pool advertised: node-d is left out too.
        Arc::make_mut(v.nodes.get_mut("node-d").unwrap())
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("pool".into(), "other".into());
        Arc::make_mut(&mut v.advertisements[0]).spec.node_selector = Some(LabelSelector {
            match_expressions: Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: "pool".into(),
                    operator: "DoesNotExist".into(),
                    values: None,
                },
            ]),
            ..Default::default()
        });
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(
            s.redirects.weighted_peers_of(ip("203.0.113.10")),
            [(ip("192.168.0.3"), 1)]
        );
    }

    #[test]
    fn communities_parse() {
        assert_eq!(parse_community("65535:65535"), Some(u32::MAX));
        assert_eq!(parse_community("65536:1"), None);
        assert_eq!(parse_large_community("1:2:3"), Some([1, 2, 3]));
        assert_eq!(parse_large_community("1:2"), None);
        assert_eq!(parse_large_community("1:2:3:4"), None);
    }

    // -----------------------------------------------------------------------------------
    // IPv6 VIPs (issue 28): fed directly with status.vips, as the controller writes it
    // once it allocates IPv6 VIPs.

    fn ip6(s: &str) -> Ipv6Addr {
        s.parse().unwrap()
    }

    fn b6(s: &str) -> LocalBackend6 {
        LocalBackend6 {
            ip: ip6(s),
            port: 8080,
        }
    }

    const VIP6: &str = "2001:db8:ffff::10";

    /// [`view`] made dual-stack: the ServiceLoadBalancer holds 203.0.113.10 (pool
    /// public-v4) and 2001:db8:ffff::10 (pool public-v6, which the BGPAdvertisement
    /// covers too), and the Service has an IPv6 EndpointSlice with `v6` endpoints beside
    /// the IPv4 one.
    fn dual_view(v6: &[(&str, &str, bool, bool)]) -> AgentView {
        let mut v = view();
        let slb = Arc::make_mut(&mut v.slbs[0]);
        slb.status.as_mut().unwrap().vips = vec![
            crate::crd::FamilyVip {
                family: "IPv4".into(),
                ip: "203.0.113.10".into(),
                address_pool: "public-v4".into(),
            },
            crate::crd::FamilyVip {
                family: "IPv6".into(),
                ip: VIP6.into(),
                address_pool: "public-v6".into(),
            },
        ];
        Arc::make_mut(&mut v.advertisements[0])
            .spec
            .address_pools
            .push("public-v6".into());
        let slices = v.slices.get_mut("default/nginx").unwrap();
        slices.push(Arc::new(slice("nginx", "nginx-v6", v6, ("http", 8080))));
        v
    }

    fn v6_endpoints() -> Vec<(&'static str, &'static str, bool, bool)> {
        vec![
            ("fd00::1", "node-a", true, false),
            ("fd00::2", "node-a", true, false),
            ("fd00::3", "node-c", true, false),
            ("fd00::4", "node-a", false, false),
            ("fd00::5", "node-a", true, true),
        ]
    }

    #[test]
    fn a_dual_stack_service_is_served_and_announced_on_both_vips() {
        let (plain, _) = build_node_state("node-a", &view());
        let (s, w) = build_node_state("node-a", &dual_view(&v6_endpoints()));
        assert!(w.is_empty(), "{w:?}");
        // The IPv4 side is exactly what it was.
        assert_eq!(s.services, plain.services);
        assert_eq!(
            (&s.redirects.node_address, &s.redirects.vips),
            (&plain.redirects.node_address, &plain.redirects.vips)
        );
        // The IPv6 VIP's connections node-a does not hold: asked of node-c (its IPv4
        // redirect address), which has a Ready IPv6 endpoint (its weight).
        assert_eq!(
            s.redirects.peers_of6(ip6(VIP6)),
            [ip("192.168.0.3"), ip("192.168.0.3")]
        );
        assert_eq!(
            s.services6,
            vec![NodeService6 {
                frontend: Frontend6 {
                    vip: ip6(VIP6),
                    protocol: Protocol::Tcp,
                    port: 80,
                },
                backends: vec![b6("fd00::1"), b6("fd00::2")],
                // Not Ready, and terminating: existing flows only.
                terminating: vec![b6("fd00::4"), b6("fd00::5")],
                source_ranges: vec![],
                client_ip_affinity: None,
                hand_off: false,
            }]
        );
        assert_eq!(
            s.services6[0].frontend.to_string(),
            "TCP/[2001:db8:ffff::10]:80"
        );
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(
            vips,
            [IpAddr::from([203, 0, 113, 10]), IpAddr::V6(ip6(VIP6))]
        );
        // The same BGPAdvertisement, the same attributes.
        let (a4, a6) = (&s.advertised[0], &s.advertised[1]);
        assert_eq!(
            (
                &a6.communities,
                &a6.large_communities,
                a6.local_pref,
                &a6.peers
            ),
            (
                &a4.communities,
                &a4.large_communities,
                a4.local_pref,
                &a4.peers
            )
        );
        assert_eq!(a6.communities, vec![64512 << 16 | 100]);
        // node-c: its own IPv6 backend, its own announcement.
        let (c, _) = build_node_state("node-c", &dual_view(&v6_endpoints()));
        assert_eq!(c.services6[0].backends, vec![b6("fd00::3")]);
        assert!(c.services6[0].terminating.is_empty());
        assert_eq!(c.advertised.len(), 2);
        // The state goes through the shared memory file as it is.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node-a.state");
        let mut writer =
            juneau_control::shm::NodeStateWriter::create(&path, Default::default()).unwrap();
        writer.publish(&s).unwrap();
        let snap = juneau_control::shm::NodeStateReader::open(&path)
            .unwrap()
            .snapshot()
            .unwrap();
        assert_eq!(snap.state.services6, s.services6);
        let i = snap.service_index6(&s.services6[0].frontend).unwrap();
        assert!(s.services6[0]
            .backends
            .contains(&snap.pick6(i, 42).unwrap()));
    }

    #[test]
    fn a_shared_ipv6_vip_s_port_whose_backends_are_elsewhere_is_handed_on() {
        let mut v = dual_view(&v6_endpoints());
        // `admin` shares nginx's two VIPs on 8443, its only Pod (both families) on node-c.
        share_with_admin(&mut v, &["10.0.0.9", "fd00::9"]);
        let frontend6 = |s: &NodeState, port: u16| {
            s.services6
                .iter()
                .find(|x| x.frontend.port == port)
                .cloned()
                .unwrap()
        };
        let (a, w) = build_node_state("node-a", &v);
        assert!(w.is_empty(), "{w:?}");
        assert!(!frontend6(&a, 80).hand_off, "nginx is served here");
        let admin_here = frontend6(&a, 8443);
        assert!(
            admin_here.backends.is_empty() && admin_here.hand_off,
            "handed on: {admin_here:?}"
        );
        assert!(
            a.redirects
                .peers_of6(ip6(VIP6))
                .contains(&ip("192.168.0.3")),
            "to node-c, which has admin's Pod"
        );
        let (c, _) = build_node_state("node-c", &v);
        assert!(c
            .services6
            .iter()
            .all(|x| !x.backends.is_empty() && !x.hand_off));
    }

    #[test]
    fn a_vip_of_a_pool_no_advertisement_covers_is_not_announced() {
        let mut v = dual_view(&v6_endpoints());
        Arc::make_mut(&mut v.advertisements[0])
            .spec
            .address_pools
            .retain(|p| p != "public-v6");
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services6.len(), 1, "served, not announced");
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(vips, [IpAddr::from([203, 0, 113, 10])]);
    }

    #[test]
    fn without_a_ready_ipv6_endpoint_the_ipv6_vip_is_announced_under_the_cluster_policy_only() {
        let v = dual_view(&[
            ("fd00::1", "node-a", false, false),
            ("fd00::5", "node-a", true, true),
            ("fd00::3", "node-c", true, false),
        ]);
        let (s, _) = build_node_state("node-a", &v);
        assert_eq!(s.services.len(), 1);
        assert!(!s.services[0].backends.is_empty());
        assert_eq!(s.services6.len(), 1);
        assert!(s.services6[0].backends.is_empty());
        assert_eq!(
            s.services6[0].terminating,
            vec![b6("fd00::1"), b6("fd00::5")]
        );
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(vips, [IpAddr::from([203, 0, 113, 10])]);
        assert!(!s.services6[0].hand_off);
        // Its connections (the draining Pods') may be on node-c too: asked there.
        assert_eq!(s.redirects.peers_of6(ip6(VIP6)), [ip("192.168.0.3"); 2]);
        // Under the Cluster policy, as IPv4: node-a announces the IPv6 VIP too and hands
        // its new connections to node-c, which has a Ready one (unweighted: every
        // announcing node hands connections on).
        let mut v = v;
        let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
        svc.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
        let (s, _) = build_node_state("node-a", &v);
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(
            vips,
            [IpAddr::from([203, 0, 113, 10]), IpAddr::V6(ip6(VIP6))]
        );
        assert!(s.advertised.iter().all(|a| a.weight.is_none()));
        assert!(s.services6[0].hand_off && s.services6[0].backends.is_empty());
        assert_eq!(s.redirects.peers_of6(ip6(VIP6)), [ip("192.168.0.3"); 2]);
        let (c, _) = build_node_state("node-c", &v);
        assert!(c.advertised.iter().any(|a| a.vip == IpAddr::V6(ip6(VIP6))));
        assert!(c.services6[0].hand_off);
        assert_eq!(c.redirects.peers_of6(ip6(VIP6)), [ip("192.168.0.1")]);
        // No Ready IPv6 endpoint anywhere: no node announces the IPv6 VIP.
        let none = dual_view(&[("fd00::1", "node-a", false, false)]);
        let mut none = none;
        let svc = Arc::make_mut(none.services.get_mut("default/nginx").unwrap());
        svc.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
        for n in ["node-a", "node-c"] {
            let (s, _) = build_node_state(n, &none);
            assert!(
                !s.advertised.iter().any(|a| a.vip == IpAddr::V6(ip6(VIP6))),
                "{n}"
            );
        }
    }

    #[test]
    fn ipv6_source_ranges_go_to_the_ipv6_frontends() {
        let set = |v: &mut AgentView, ranges: &[&str]| {
            let svc = Arc::make_mut(v.services.get_mut("default/nginx").unwrap());
            svc.spec.as_mut().unwrap().load_balancer_source_ranges =
                Some(ranges.iter().map(|r| r.to_string()).collect());
        };
        let mut v = dual_view(&v6_endpoints());
        set(&mut v, &["198.51.100.0/24", "2001:db8:c11e::7/48"]);
        let (s, _) = build_node_state("node-a", &v);
        let shown = |r: &[SourceRange]| r.iter().map(|r| r.to_string()).collect::<Vec<_>>();
        assert_eq!(shown(&s.services[0].source_ranges), ["198.51.100.0/24"]);
        assert_eq!(
            s.services6[0].source_ranges,
            vec!["2001:db8:c11e::/48".parse::<ipnet::Ipv6Net>().unwrap()]
        );
        assert_eq!(s.advertised.len(), 2);
        // IPv4 ranges only: no IPv6 client admitted, so the IPv6 VIP is served by no
        // node; the IPv4 one as its ranges say.
        set(&mut v, &["198.51.100.0/24"]);
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services6.is_empty(), "{:?}", s.services6);
        assert_eq!(s.services.len(), 1);
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(vips, [IpAddr::from([203, 0, 113, 10])]);
        // IPv6 ranges only: the IPv4 side is refused as before, the IPv6 one served.
        set(&mut v, &["2001:db8:c11e::/48"]);
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services.is_empty());
        assert_eq!(s.services6.len(), 1);
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(vips, [IpAddr::V6(ip6(VIP6))]);
    }

    #[test]
    fn without_status_vips_the_ipv4_vip_of_status_vip_is_served_as_before() {
        // IPv6 slices exist, but the status names no IPv6 VIP: nothing IPv6.
        let mut v = dual_view(&v6_endpoints());
        Arc::make_mut(&mut v.slbs[0]).status.as_mut().unwrap().vips = vec![];
        let (s, w) = build_node_state("node-a", &v);
        let (plain, _) = build_node_state("node-a", &view());
        assert!(w.is_empty(), "{w:?}");
        assert!(s.services6.is_empty());
        assert_eq!(s, plain);
        // An IPv6 single-stack Service: IPv6 only, whatever status.vip says.
        let st = Arc::make_mut(&mut v.slbs[0]).status.as_mut().unwrap();
        st.vip = Some(VIP6.into());
        st.vips = vec![crate::crd::FamilyVip {
            family: "IPv6".into(),
            ip: VIP6.into(),
            address_pool: "public-v6".into(),
        }];
        let (s, _) = build_node_state("node-a", &v);
        assert!(s.services.is_empty() && s.redirects.vips.is_empty());
        assert_eq!(s.services6.len(), 1);
        let vips: Vec<IpAddr> = s.advertised.iter().map(|a| a.vip).collect();
        assert_eq!(vips, [IpAddr::V6(ip6(VIP6))]);
    }

    #[test]
    fn an_ipv6_host_network_endpoint_is_not_served_and_is_counted() {
        let mut v = dual_view(&[
            ("fd00::1", "node-a", true, false),
            ("2001:db8:0:1::a", "node-a", true, false),
        ]);
        let node = Arc::make_mut(v.nodes.get_mut("node-a").unwrap());
        node.status
            .as_mut()
            .unwrap()
            .addresses
            .as_mut()
            .unwrap()
            .push(k8s_openapi::api::core::v1::NodeAddress {
                address: "2001:db8:0:1::a".into(),
                type_: "InternalIP".into(),
            });
        let mut cache = BuildCache::default();
        let (s, w) = build_node_state_with("node-a", &v, &mut cache);
        assert_eq!(s.services6[0].backends, vec![b6("fd00::1")]);
        assert_eq!(cache.ipv6_host_network_unserved(), 1);
        assert!(
            w.iter()
                .any(|w| w.contains("1 IPv6 host-network endpoint(s)")),
            "{w:?}"
        );
        let (_, w) = build_node_state_with("node-a", &dual_view(&v6_endpoints()), &mut cache);
        assert_eq!(cache.ipv6_host_network_unserved(), 0);
        assert!(w.is_empty(), "{w:?}");
    }
}
