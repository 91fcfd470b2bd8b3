//! The controller's decision for one Service, as a pure function: given the Service, the
//! previous ServiceLoadBalancer status, the Juneau objects and the EndpointSlices, say what
//! the status must be, which VIP the Service shows, and which Events a human should see.
//! The only state it touches is the [`VipBook`] it is handed.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::crd::{
    AddressPoolSpec, BGPAdvertisementSpec, BackendSummary, ExternalNetworkSpec, FamilyVip, Phase,
    ServiceLoadBalancerStatus, EXTERNAL_NETWORK_ANNOTATION, LOAD_BALANCER_CLASS,
    REQUESTED_IP_ANNOTATION,
};
use crate::endpoints::{
    host_network_endpoints, picture, slice_endpoints, BackendPicture, SliceEndpoint,
};
use crate::families::{self, IPV6_NOT_SUPPORTED};
use crate::vips::{parse_pool, VipBook};
use juneau_control::ipam::{parse_requested, AddressPool, Family, IpamError, Requested};

/// Condition types written on every ServiceLoadBalancer.
pub mod condition {
    /// Everything the Service asks for is something Juneau serves.
    pub const SUPPORTED: &str = "Supported";
    /// A VIP is allocated.
    pub const VIP_ALLOCATED: &str = "VIPAllocated";
    /// The VIP is announced from at least one node.
    pub const ADVERTISED: &str = "Advertised";
    /// The load balancer is serving.
    pub const READY: &str = "Ready";
    /// Every IP family the Service asks for is served (only on Services that ask for
    /// IPv6 or two families): [`crate::families`].
    pub const IP_FAMILIES: &str = "IPFamilies";
}

/// True when Juneau manages this Service: `type: LoadBalancer` and Juneau's class.
pub fn is_managed(svc: &Service) -> bool {
    svc.spec.as_ref().is_some_and(|s| {
        s.type_.as_deref() == Some("LoadBalancer")
            && s.load_balancer_class.as_deref() == Some(LOAD_BALANCER_CLASS)
    })
}

/// `namespace/name` of an object.
pub fn key_of(svc: &Service) -> String {
    format!(
        "{}/{}",
        svc.metadata.namespace.as_deref().unwrap_or("default"),
        svc.metadata.name.as_deref().unwrap_or_default()
    )
}

/// An Event to publish on the Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// Warning (a problem) or Normal.
    pub warning: bool,
    /// CamelCase reason.
    pub reason: String,
    /// Plain words.
    pub message: String,
}

/// What the world looks like to the controller.
#[derive(Debug, Default, Clone)]
pub struct World {
    /// ExternalNetworks by name.
    pub networks: BTreeMap<String, ExternalNetworkSpec>,
    /// AddressPools by name.
    pub pools: BTreeMap<String, AddressPoolSpec>,
    /// Nodes by name.
    pub nodes: BTreeMap<String, Node>,
    /// BGPAdvertisements (a VIP is announced only where one covers its pool).
    pub advertisements: Vec<BGPAdvertisementSpec>,
    /// Namespaces' labels, by name (AddressPools' serviceAllocation.namespaceSelector).
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Services waiting for a free address of an exhausted pool.
    pub waiters: Vec<Waiter>,
    /// The other managed, not deleted Services of the reconciled Service's namespace
    /// with its `allow-shared-ip` key (empty when it has none): [`crate::sharing`].
    pub shared_with: Vec<std::sync::Arc<Service>>,
}

/// A Service waiting for an address: freed addresses go to waiters in creation order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    /// `namespace/name`.
    pub key: String,
    /// Creation time (seconds since the epoch; `i64::MAX` when unknown).
    pub created: i64,
    /// The AddressPools it waits on.
    pub pools: Vec<String>,
}

/// Creation time of a Service for the waiting line.
pub fn created_secs(svc: &Service) -> i64 {
    svc.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .unwrap_or(i64::MAX)
}

impl World {
    /// Waiters created before `svc` (ties broken by `namespace/name`) waiting on one of
    /// `pools`.
    pub fn waiters_ahead(&self, svc: &Service, pools: &[AddressPool]) -> usize {
        let me = (created_secs(svc), key_of(svc));
        self.waiters
            .iter()
            .filter(|w| w.key != me.1 && (w.created, &w.key) < (me.0, &me.1))
            .filter(|w| w.pools.iter().any(|p| pools.iter().any(|q| &q.name == p)))
            .count()
    }
}

/// True when some BGPAdvertisement that applies to the VIP (of `pool`, its Service
/// labelled `service_labels`: [`crate::selection::for_service`]) selects `node`.
pub fn advertisement_covers(
    world: &World,
    pool: &str,
    service_labels: &BTreeMap<String, String>,
    node: &str,
) -> bool {
    !covered_nodes(world, pool, service_labels, &[node.to_string()]).is_empty()
}

/// Nodes (of `candidates`) that some BGPAdvertisement applying to the VIP selects.
fn covered_nodes(
    world: &World,
    pool: &str,
    service_labels: &BTreeMap<String, String>,
    candidates: &[String],
) -> Vec<String> {
    let applying = crate::selection::for_service(&world.advertisements, pool, service_labels);
    candidates
        .iter()
        .filter(|n| {
            let empty = BTreeMap::new();
            let labels = world
                .nodes
                .get(*n)
                .and_then(|n| n.metadata.labels.as_ref())
                .unwrap_or(&empty);
            applying
                .iter()
                .any(|a| crate::selection::selects(a.node_selector.as_ref(), labels))
        })
        .cloned()
        .collect()
}

/// The decision for one Service.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The ServiceLoadBalancer status to write.
    pub status: ServiceLoadBalancerStatus,
    /// The IPs to show in `.status.loadBalancer.ingress`, one per family served, in the
    /// Service's family order (empty: show none).
    pub ingress_ips: Vec<IpAddr>,
    /// Events worth a human's attention (only on change).
    pub notes: Vec<Note>,
    /// The Service waits for an address that another Service may free (requested IP
    /// taken, pool exhausted): look again soon rather than at the next resync.
    pub waiting_for_address: bool,
    /// The pools whose exhaustion it waits on (empty unless it waits in line for any
    /// free address of them).
    pub queued_on: Vec<String>,
    /// VIPs released because the Service no longer asks for their family (it went from
    /// dual stack to one family).
    pub released: Vec<IpAddr>,
}

impl Outcome {
    /// The first IP to show (the Service's first family), if any.
    pub fn ingress_ip(&self) -> Option<IpAddr> {
        self.ingress_ips.first().copied()
    }
}

/// A problem found in the Service or its configuration.
#[derive(Debug, Clone)]
struct Problem {
    reason: &'static str,
    message: String,
}

fn problem(reason: &'static str, message: impl Into<String>) -> Problem {
    Problem {
        reason,
        message: message.into(),
    }
}

/// Whether the Service's `externalTrafficPolicy` is Cluster (Kubernetes' default: also
/// when unset): every node a BGPAdvertisement selects announces its VIP, and a node
/// without a Ready backend hands new connections to one that has one.
pub fn cluster_policy(svc: &Service) -> bool {
    let policy = svc
        .spec
        .as_ref()
        .and_then(|s| s.external_traffic_policy.as_deref());
    policy != Some("Local")
}

/// Unsupported fields of the Service itself (checked before any allocation).
/// `host_network`: its endpoints on their node's own address; `pod_network`: the others.
fn unsupported(svc: &Service, host_network: &[Ipv4Addr], pod_network: &[Ipv4Addr]) -> Vec<Problem> {
    let mut out = Vec::new();
    let Some(spec) = svc.spec.as_ref() else {
        return vec![problem("InvalidService", "the Service has no spec")];
    };
    for p in spec.ports.iter().flatten() {
        let proto = p.protocol.as_deref().unwrap_or("TCP");
        if proto != "TCP" && proto != "UDP" {
            out.push(problem(
                "ProtocolNotSupported",
                format!(
                    "port {} uses protocol {proto}; Juneau serves TCP and UDP only",
                    p.name.clone().unwrap_or_else(|| p.port.to_string())
                ),
            ));
        }
    }
    if let Err(e) = crate::source_ranges::of_service(svc) {
        out.push(problem("InvalidSourceRanges", e.to_string()));
    }
    out.extend(host_network_problem(svc, host_network, pod_network));
    out
}

/// The endpoints' distinct addresses that are not in `host_network` (sorted).
pub(crate) fn pod_network(eps: &[SliceEndpoint], host_network: &[Ipv4Addr]) -> Vec<Ipv4Addr> {
    eps.iter()
        .map(|e| e.ip)
        .filter(|ip| !host_network.contains(ip))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Whether the controller refuses the Service's host-network backends (see
/// [`host_network_problem`]): the agent serves such a Service on no node.
pub(crate) fn host_network_refused(
    svc: &Service,
    host_network: &[Ipv4Addr],
    pod_network: &[Ipv4Addr],
) -> bool {
    host_network_problem(svc, host_network, pod_network).is_some()
}

/// What keeps Juneau from serving host-network backends (endpoints on their node's own
/// address, e.g. an ingress controller): each node delivers to its own stack, so only
/// with `externalTrafficPolicy: Local`, an unshared VIP (a node cannot hand a
/// connection to another node's stack), and one kind of backend per Service.
fn host_network_problem(
    svc: &Service,
    host_network: &[Ipv4Addr],
    pod_network: &[Ipv4Addr],
) -> Option<Problem> {
    if host_network.is_empty() {
        return None;
    }
    let list = |v: &[Ipv4Addr]| {
        v.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if cluster_policy(svc) || crate::sharing::sharing_key(svc).is_some() {
        return Some(problem(
            "HostNetworkBackendsNeedLocalPolicy",
            format!(
                "backends {} run on the host network: Juneau delivers them to their node's own stack, which takes externalTrafficPolicy: Local and a VIP of the Service's own (no {} key)",
                list(host_network),
                crate::sharing::SHARED_IP_ANNOTATION
            ),
        ));
    }
    if !pod_network.is_empty() {
        return Some(problem(
            "HostNetworkBackendsMixed",
            format!(
                "backends {} run on the host network and {} on the Pod network: Juneau serves one kind per Service",
                list(host_network),
                list(pod_network)
            ),
        ));
    }
    None
}

/// The pools of a network, parsed, or the problem that prevents allocation.
fn network_pools(svc: &Service, world: &World) -> Result<(String, Vec<AddressPool>), Problem> {
    let ann = svc.metadata.annotations.as_ref();
    let Some(net_name) = ann
        .and_then(|a| a.get(EXTERNAL_NETWORK_ANNOTATION))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
    else {
        return Err(problem(
            "ExternalNetworkMissing",
            format!("the Service has no {EXTERNAL_NETWORK_ANNOTATION} annotation naming the ExternalNetwork its VIP comes from"),
        ));
    };
    let Some(net) = world.networks.get(&net_name) else {
        return Err(problem(
            "ExternalNetworkNotFound",
            format!("ExternalNetwork {net_name:?} does not exist"),
        ));
    };
    if net.address_pools.is_empty() {
        return Err(problem(
            "ExternalNetworkHasNoPools",
            format!("ExternalNetwork {net_name:?} lists no AddressPools"),
        ));
    }
    let mut pools = Vec::new();
    for p in &net.address_pools {
        let Some(pool) = world.pools.get(p) else {
            return Err(problem(
                "AddressPoolNotFound",
                format!("AddressPool {p:?} named by ExternalNetwork {net_name:?} does not exist"),
            ));
        };
        if !pool.advertise_mode.is_bgp() {
            return Err(problem(
                "AddressPoolNotBGP",
                format!(
                    "AddressPool {p:?} has advertiseMode {:?}; LoadBalancer VIPs need advertiseMode: bgp",
                    pool.advertise_mode.0
                ),
            ));
        }
        let parsed =
            parse_pool(p, pool).map_err(|e| problem("AddressPoolInvalid", e.to_string()))?;
        pools.push(parsed);
    }
    Ok((net_name, pools))
}

fn cond(
    type_: &str,
    ok: bool,
    reason: &str,
    message: impl Into<String>,
    previous: &[Condition],
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| now.clone());
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// The addresses the Service asks for (one per family at most), and whether only the
/// deprecated `spec.loadBalancerIP` asked: the annotation (one address, or an IPv4 and an
/// IPv6 address separated by a comma: [`parse_requested`]), or the field where the
/// annotation is absent (IPv4 only: Kubernetes deprecates it and never gave it a second
/// family); both set and asking for different IPv4 addresses is a conflict, nothing is
/// requested.
fn requested_ip(svc: &Service) -> (Result<Requested, Problem>, bool) {
    let annotation = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REQUESTED_IP_ANNOTATION))
        .map(|s| s.trim())
        .filter(|s| !s.is_empty());
    let field = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_ip.as_deref())
        .map(str::trim)
        .filter(|s| !s.is_empty());
    let from_annotation = |a: &str| {
        parse_requested(a).map_err(|e| {
            problem(
                "RequestedIPInvalid",
                format!("{REQUESTED_IP_ANNOTATION} is {a:?}: {e}"),
            )
        })
    };
    let from_field = |f: &str| {
        match f.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => Ok(Requested {
            v4: Some(a),
            v6: None,
        }),
        Ok(IpAddr::V6(_)) => Err(problem(
            "RequestedIPInvalid",
            format!("spec.loadBalancerIP is {f:?}, an IPv6 address: Juneau reads the deprecated spec.loadBalancerIP for IPv4 only; ask with the annotation {REQUESTED_IP_ANNOTATION}"),
        )),
        Err(_) => Err(problem(
            "RequestedIPInvalid",
            format!("spec.loadBalancerIP is {f:?}, which is not an IPv4 address"),
        )),
    }
    };
    match (annotation, field) {
        (None, None) => (Ok(Requested::default()), false),
        (Some(a), None) => (from_annotation(a), false),
        (None, Some(f)) => (from_field(f), true),
        (Some(a), Some(f)) => match (from_annotation(a), from_field(f)) {
            (Err(p), _) | (_, Err(p)) => (Err(p), false),
            (Ok(x), Ok(y)) if x.v4 == y.v4 => (Ok(x), false),
            _ => (
                Err(problem(
                    "RequestedIPConflict",
                    format!(
                        "{REQUESTED_IP_ANNOTATION} asks for {a} and spec.loadBalancerIP for {f}: set one (the annotation; spec.loadBalancerIP is deprecated)"
                    ),
                )),
                false,
            ),
        },
    }
}

/// What [`decide_vip`] decided for one family.
struct VipDecision {
    /// The Service's VIP of the family and its pool, if it holds one.
    vip: Option<(IpAddr, String)>,
    /// The pools it waits on for an address (addresses go out in creation order).
    queued_on: Vec<String>,
    /// The VipAllocated condition's message, or the problem and whether it is fatal
    /// (`false`: waiting for an address).
    condition: Result<String, (Problem, bool)>,
}

/// The Service's VIP of `family`: its ExternalNetwork's pools (`network`), the
/// requested address if any (`requested`, and whether only `spec.loadBalancerIP` asked),
/// the allocation in `book`. Only a `supported` Service gets a new VIP; an unsupported
/// one keeps a VIP it already holds.
#[allow(clippy::too_many_arguments)]
fn decide_vip(
    svc: &Service,
    world: &World,
    book: &mut VipBook,
    owner: &str,
    supported: bool,
    family: Family,
    network: &Result<(String, Vec<AddressPool>), Problem>,
    requested: &(Result<Requested, Problem>, bool),
) -> VipDecision {
    let mut vip = None;
    let mut queued_on = Vec::new();
    let condition = match network {
        Err(p) => Err((p.clone(), true)),
        Ok((net, pools)) => {
            let net = net.clone();
            let by_spec = requested.1;
            let requested = requested.0.clone().map(|r| r.of(family));
            // Only the pools that hold an address of the family.
            let mut pools: Vec<AddressPool> = pools
                .iter()
                .filter(|p| p.has_family(family))
                .cloned()
                .collect();
            // A Service that asks for no address and holds none gets one from the pools
            // that hand out addresses on their own (autoAssign, default true); one that
            // holds a VIP keeps it.
            if matches!(requested, Ok(None)) && book.vip_of(owner, family).is_none() {
                pools.retain(|p| {
                    world
                        .pools
                        .get(&p.name)
                        .is_none_or(|s| s.auto_assign != Some(false))
                });
            }
            let requested = if pools.is_empty() {
                Err(problem(
                    "NoAutoAssignPool",
                    format!("every AddressPool of ExternalNetwork {net:?} has autoAssign: false: ask for one of their addresses (annotation {REQUESTED_IP_ANNOTATION})"),
                ))
            } else {
                requested
            };
            let (pools, requested) = match requested {
                Ok(req) => {
                    match serving_pools(svc, world, &net, pools, req, book.vip_of(owner, family)) {
                        Ok(pools) => (pools, Ok(req)),
                        Err(p) => (Vec::new(), Err(p)),
                    }
                }
                Err(p) => (pools, Err(p)),
            };
            // The group's VIP must not move under the other members.
            let held = book.vip_of(owner, family);
            let requested = requested.and_then(|req| {
                match shared_vip_conflict(svc, world, held, req, &pools, &net) {
                    Some(p) => Err(p),
                    None => Ok(req),
                }
            });
            match requested {
                Err(p) => Err((p, true)),
                Ok(req) if !supported && book.vip_of(owner, family).is_none() => {
                    let _ = req;
                    Err((
                        problem(
                            "NotAllocated",
                            "no VIP is allocated while the Service asks for something Juneau does not support",
                        ),
                        true,
                    ))
                }
                Ok(None)
                    if book.vip_of(owner, family).is_none() && {
                        let ahead = world.waiters_ahead(svc, &pools);
                        ahead > 0 && book.free_in(&pools, family) <= ahead as u128
                    } =>
                {
                    // Freed addresses go to the Services that waited longest.
                    queued_on = pools.iter().map(|p| p.name.clone()).collect();
                    let ahead = world.waiters_ahead(svc, &pools);
                    Err((
                        problem(
                            "AddressPoolExhausted",
                            format!(
                                "no free {family} address for this Service in ExternalNetwork {net:?}: {} free, {ahead} older Service(s) wait for one first (addresses go out in creation order)",
                                book.free_in(&pools, family)
                            ),
                        ),
                        false,
                    ))
                }
                Ok(req) => match book.allocate(owner, &pools, family, req) {
                    Ok(a) => {
                        let pool = a.pool.clone().unwrap_or_default();
                        vip = Some((a.ip, pool.clone()));
                        let how = if by_spec {
                            " (requested with spec.loadBalancerIP, deprecated since Kubernetes \
                             1.24: use the annotation juneau.loutres.me/load-balancer-requested-ip)"
                        } else {
                            ""
                        };
                        Ok(format!(
                            "{} from AddressPool {pool} of ExternalNetwork {net}{how}",
                            a.ip
                        ))
                    }
                    Err(e) => {
                        if matches!(e, IpamError::Exhausted { .. }) && req.is_none() {
                            queued_on = pools.iter().map(|p| p.name.clone()).collect();
                        }
                        let (reason, fatal) = match &e {
                            IpamError::RequestedOutsidePools { .. } => {
                                ("RequestedIPOutsidePools", true)
                            }
                            IpamError::RequestedTaken { .. } => ("RequestedIPTaken", false),
                            IpamError::Exhausted { .. } => ("AddressPoolExhausted", false),
                            IpamError::MalformedAddresses { .. } => ("AddressPoolInvalid", true),
                            IpamError::UnknownPool(_) => ("AddressPoolNotFound", true),
                            IpamError::NoPools => ("ExternalNetworkHasNoPools", true),
                            IpamError::RequestedWrongFamily { .. } => ("RequestedIPInvalid", true),
                            IpamError::NoPoolOfFamily { .. } => {
                                (families::NO_POOL_FOR_FAMILY, true)
                            }
                        };
                        let message = match &e {
                            IpamError::RequestedTaken { ip, owner } => format!(
                                "requested IP {ip} is already the VIP of {}",
                                crate::sharing::describe_owner(owner)
                            ),
                            IpamError::RequestedOutsidePools { ip, pools } => format!(
                                "requested IP {ip} is not inside any AddressPool of ExternalNetwork {net:?} ({pools})"
                            ),
                            IpamError::Exhausted { pools, family } => format!(
                                "no free {family} address left for ExternalNetwork {net:?}: every {family} address of AddressPools {pools} is allocated"
                            ),
                            other => other.to_string(),
                        };
                        Err((problem(reason, message), fatal))
                    }
                },
            }
        }
    };
    VipDecision {
        vip,
        queued_on,
        condition,
    }
}

/// Why the Service cannot take the VIP its group holds (`held`) while other members
/// use it: it asks for another address, or the VIP lies outside the pools it may use
/// (`pools`, of ExternalNetwork `net`). Moving the VIP would move it under the others.
fn shared_vip_conflict(
    svc: &Service,
    world: &World,
    held: Option<IpAddr>,
    requested: Option<IpAddr>,
    pools: &[AddressPool],
    net: &str,
) -> Option<Problem> {
    let key = crate::sharing::sharing_key(svc)?;
    let held = held.filter(|_| !world.shared_with.is_empty())?;
    let why = if let Some(r) = requested.filter(|r| *r != held) {
        format!("it asks for {r}")
    } else if !pools.iter().any(|p| p.contains(held)) {
        format!("that address is in no AddressPool of ExternalNetwork {net:?} this Service may use")
    } else {
        return None;
    };
    Some(problem(
        "SharedIPConflict",
        format!(
            "the Services sharing {key:?} ({}) hold {held}, and {why}: ask for the same address and network, or use another key",
            crate::sharing::SHARED_IP_ANNOTATION
        ),
    ))
}

/// Of the ExternalNetwork `net`'s `pools`, the ones the Service's VIP may come from, in
/// the order it is taken from them (AddressPools' `serviceAllocation`:
/// [`crate::selection::pools_for_service`]). A Service that holds a VIP (`held`) keeps
/// every pool, the ones that serve it first: it is never moved to another address. A
/// requested address in a pool that does not serve the Service, or no pool that does,
/// is a problem.
fn serving_pools(
    svc: &Service,
    world: &World,
    net: &str,
    pools: Vec<AddressPool>,
    requested: Option<IpAddr>,
    held: Option<IpAddr>,
) -> Result<Vec<AddressPool>, Problem> {
    use crate::selection::{pools_for_service, ServiceIdentity};
    let namespace = svc.metadata.namespace.as_deref().unwrap_or("default");
    let no_labels = BTreeMap::new();
    let identity = ServiceIdentity {
        namespace,
        namespace_labels: world.namespaces.get(namespace).unwrap_or(&no_labels),
        labels: svc.metadata.labels.as_ref().unwrap_or(&no_labels),
    };
    let allocation = |p: &AddressPool| {
        world
            .pools
            .get(&p.name)
            .and_then(|s| s.service_allocation.as_ref())
    };
    let order: Vec<String> = pools_for_service(
        pools.iter().map(|p| (p.name.as_str(), allocation(p))),
        identity,
    )
    .into_iter()
    .map(String::from)
    .collect();
    if let Some(ip) = requested.filter(|ip| held != Some(*ip)) {
        if let Some(p) = pools
            .iter()
            .find(|p| p.contains(ip) && !order.contains(&p.name))
        {
            return Err(problem(
                "RequestedIPNotAllowed",
                format!(
                    "requested IP {ip} is in AddressPool {:?}, whose serviceAllocation does not select this Service (namespace {namespace:?}, its labels or its namespace's)",
                    p.name
                ),
            ));
        }
    }
    if order.is_empty() && held.is_none() {
        return Err(problem(
            "NoPoolForService",
            format!("no AddressPool of ExternalNetwork {net:?} serves this Service: each one's serviceAllocation selects other namespaces or Services"),
        ));
    }
    let mut ordered: Vec<AddressPool> = order
        .iter()
        .filter_map(|n| pools.iter().find(|p| &p.name == n).cloned())
        .collect();
    if held.is_some() {
        ordered.extend(pools.into_iter().filter(|p| !order.contains(&p.name)));
    }
    Ok(ordered)
}

/// The Events for the conditions that changed since `prev` (reason or status): a
/// warning for a problem (except the quiet NotServed and NotAllocated), a normal Event
/// when a condition becomes true again or first (Supported and IPFamilies only when
/// they were known): those
/// of one change as one Event.
fn condition_events(prev: &[Condition], conditions: &[Condition]) -> Vec<Note> {
    let mut notes = Vec::new();
    let mut became_true: Vec<Note> = Vec::new();
    for c in conditions {
        if c.type_ == condition::READY {
            continue;
        }
        let before = prev.iter().find(|p| p.type_ == c.type_);
        let changed = before.is_none_or(|b| b.status != c.status || b.reason != c.reason);
        if !changed {
            continue;
        }
        if c.status == "False" {
            if c.reason == "NotServed" || c.reason == "NotAllocated" {
                continue;
            }
            notes.push(Note {
                warning: c.type_ != condition::ADVERTISED,
                reason: c.reason.clone(),
                message: c.message.clone(),
            });
        } else if before.is_some()
            || (c.type_ != condition::SUPPORTED && c.type_ != condition::IP_FAMILIES)
        {
            let reason = match c.type_.as_str() {
                condition::VIP_ALLOCATED => "VIPAllocated",
                condition::ADVERTISED => "Advertised",
                condition::IP_FAMILIES => "FamiliesServed",
                _ => "Supported",
            };
            became_true.push(Note {
                warning: false,
                reason: reason.into(),
                message: c.message.clone(),
            });
        }
    }
    notes.extend(merged(became_true));
    notes
}

/// The conditions that became true in one change as one Event (the first's reason,
/// the messages in order): a new Service that becomes Ready is one write, not one per
/// condition (`VIPAllocated` and `Advertised`).
fn merged(notes: Vec<Note>) -> Option<Note> {
    notes.into_iter().reduce(|mut first, n| {
        first.message = format!("{}; {}", first.message, n.message);
        first
    })
}

/// The Supported condition's status, reason and message for the Service's unsupported
/// fields `bad` (none: supported).
fn supported_verdict(bad: &[Problem]) -> (bool, &'static str, String) {
    if bad.is_empty() {
        (
            true,
            "Supported",
            "every field of the Service is supported".to_string(),
        )
    } else {
        let reason = bad[0].reason;
        let message = bad
            .iter()
            .map(|p| p.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        (false, reason, message)
    }
}

/// The VipAllocated condition's status, reason and message for the VIP decision
/// `vip_cond`.
fn vip_verdict(vip_cond: &Result<String, (Problem, bool)>) -> (bool, &'static str, String) {
    match vip_cond {
        Ok(msg) => (true, "Allocated", msg.clone()),
        Err((p, _)) => (false, p.reason, p.message.clone()),
    }
}

/// Fills `status`'s advertising nodes (when `serving`: the nodes with Ready backends in
/// `pic` that a BGPAdvertisement of the VIP's pool covers) and their count. Returns
/// whether nodes with Ready backends are left uncovered by every BGPAdvertisement.
fn set_advertising_nodes(
    world: &World,
    service_labels: &BTreeMap<String, String>,
    pic: &BackendPicture,
    serving: bool,
    status: &mut ServiceLoadBalancerStatus,
) -> bool {
    let mut uncovered = false;
    if serving {
        let pool = status.address_pool.clone().unwrap_or_default();
        status.advertising_nodes =
            covered_nodes(world, &pool, service_labels, &pic.advertising_nodes);
        uncovered = status.advertising_nodes.is_empty() && !pic.advertising_nodes.is_empty();
    }
    status.backend_summary.local_ready_nodes =
        u32::try_from(status.advertising_nodes.len()).unwrap_or(u32::MAX);
    uncovered
}

/// The record's phase: Failed on a fatal problem, else Ready once `advertised`, else
/// Pending.
fn phase_of(failed: bool, advertised: bool) -> Phase {
    if failed {
        Phase::Failed
    } else if advertised {
        Phase::Ready
    } else {
        Phase::Pending
    }
}

/// The Advertised condition's reason and message: whether the VIP is `serving`, which
/// nodes announce it (`status`), whether nodes with Ready backends are left `uncovered`
/// by every BGPAdvertisement (`pic`: the Service's backends).
fn advertised_verdict(
    serving: bool,
    advertised: bool,
    uncovered: bool,
    status: &ServiceLoadBalancerStatus,
    pic: &BackendPicture,
) -> (&'static str, String) {
    if !serving {
        (
            "NotServed",
            "nothing is announced for this Service until the problems above are fixed".to_string(),
        )
    } else if advertised {
        (
            "ReadyBackends",
            format!(
                "announced as a /32 from {} node(s): {}",
                status.advertising_nodes.len(),
                status.advertising_nodes.join(", ")
            ),
        )
    } else if uncovered {
        (
            "NoBGPAdvertisement",
            format!(
                "nodes {} have Ready backends, but no BGPAdvertisement covers AddressPool {} on them",
                pic.advertising_nodes.join(", "),
                status.address_pool.as_deref().unwrap_or_default()
            ),
        )
    } else {
        (
            "NoReadyBackends",
            "no node has a Ready local backend, so no node announces the VIP".to_string(),
        )
    }
}

/// The IPFamilies condition's status, reason and message for the families `plan`.
fn families_verdict(plan: &families::Plan) -> (bool, &'static str, String) {
    if plan.refused.is_some() {
        // Said by the Supported or VIPAllocated condition, with its Event.
        return (
            false,
            "NotServed",
            "no IP family of the Service is served: see the Supported and VIPAllocated conditions"
                .to_string(),
        );
    }
    if let Some(g) = plan.dropped.first() {
        let message = plan
            .dropped
            .iter()
            .map(|g| g.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        return (false, g.reason, message);
    }
    let served = plan
        .serve
        .iter()
        .map(|f| f.as_str())
        .collect::<Vec<_>>()
        .join(" and ");
    (true, "FamiliesServed", format!("served on {served}"))
}

/// The Ready condition's reason and message: the first condition that is not true, or
/// "Ready" when all are. IPFamilies is left out: a family PreferDualStack does without
/// is a warning, not a reason the Service is not ready.
fn ready_verdict(conditions: &[Condition]) -> (&str, String) {
    let first_problem = conditions
        .iter()
        .find(|c| c.status == "False" && c.type_ != condition::IP_FAMILIES);
    (
        match first_problem {
            None => "Ready",
            Some(c) => c.reason.as_str(),
        },
        match first_problem {
            None => "the VIP is allocated and announced".to_string(),
            Some(c) => c.message.clone(),
        },
    )
}

/// Decides everything for one managed Service. `slices` are the Service's EndpointSlices.
pub fn reconcile_service(
    svc: &Service,
    previous: Option<&ServiceLoadBalancerStatus>,
    slices: &[&EndpointSlice],
    world: &World,
    book: &mut VipBook,
    now: Time,
) -> Outcome {
    reconcile_with(
        svc,
        previous,
        slices,
        world,
        book,
        now,
        families::DATAPLANE_SERVES_IPV6,
    )
}

/// [`reconcile_service`] with the dataplane serving IPv6 or not (`serves_v6`), so the
/// tests cover both settings of [`families::DATAPLANE_SERVES_IPV6`].
fn reconcile_with(
    svc: &Service,
    previous: Option<&ServiceLoadBalancerStatus>,
    slices: &[&EndpointSlice],
    world: &World,
    book: &mut VipBook,
    now: Time,
    serves_v6: bool,
) -> Outcome {
    let owner = crate::sharing::vip_owner(svc);
    let prev_conds: Vec<Condition> = previous.map(|p| p.conditions.clone()).unwrap_or_default();
    let generation = svc.metadata.generation;
    let eps = slice_endpoints(slices.iter().copied());
    let host = host_network_endpoints(&eps, &world.nodes);
    let mut pic = picture(&eps, &world.nodes);
    if cluster_policy(svc) && pic.total_ready > 0 {
        // Every node may announce it (those a BGPAdvertisement covers, below).
        pic.advertising_nodes = world
            .nodes
            .iter()
            .filter(|(_, n)| !crate::endpoints::node_excluded(n))
            .map(|(name, _)| name.clone())
            .collect();
    }
    let mut status = ServiceLoadBalancerStatus {
        backend_summary: BackendSummary {
            total_ready: pic.total_ready,
            local_ready_nodes: 0,
        },
        observed_generation: generation,
        ..Default::default()
    };
    let mut notes = Vec::new();
    let mut conditions = Vec::new();

    let mut bad = unsupported(svc, &host, &pod_network(&eps, &host));
    // The families it asks for and which of them are served ([`crate::families`]).
    let network = network_pools(svc, world);
    let wanted = families::wanted(svc.spec.as_ref());
    let plan = match &wanted {
        Err(e) => {
            bad.push(problem("InvalidIPFamilies", e.to_string()));
            None
        }
        Ok(w) => Some(families::plan(w, serves_v6, |f| {
            // A network problem is reported by the VIP decision.
            network
                .as_ref()
                .map_or(true, |(_, pools)| pools.iter().any(|p| p.has_family(f)))
        })),
    };
    let refused = plan.as_ref().and_then(|p| p.refused.clone());
    // A family the Service no longer asks for lets go of its VIP (a shared VIP's group
    // keeps it: another member may ask for it).
    let mut released = Vec::new();
    if let Ok(w) = &wanted {
        if crate::sharing::sharing_key(svc).is_none() {
            for f in [Family::V4, Family::V6] {
                if !w.families.contains(&f) {
                    released.extend(book.release_family(&owner, f));
                }
            }
        }
    }
    if let Some(g) = refused.as_ref().filter(|g| g.reason == IPV6_NOT_SUPPORTED) {
        bad.push(problem(IPV6_NOT_SUPPORTED, g.message.clone()));
    }
    let others: Vec<&Service> = world.shared_with.iter().map(|s| &**s).collect();
    if let Err(c) = crate::sharing::admitted(svc, &others) {
        bad.push(problem(
            "SharedIPPortConflict",
            format!(
                "port {}/{} is already served on the shared VIP by the older Service {} (same {} key): give this Service another port or another key",
                c.port, c.protocol, c.holder, crate::sharing::SHARED_IP_ANNOTATION
            ),
        ));
    }
    let supported = bad.is_empty();
    let (ok, reason, message) = supported_verdict(&bad);
    conditions.push(cond(
        condition::SUPPORTED,
        ok,
        reason,
        message,
        &prev_conds,
        generation,
        &now,
    ));

    if let (Some(w), Some(plan)) = (wanted.as_ref().ok(), plan.as_ref()) {
        if !w.is_ipv4_only() {
            let (ok, reason, message) = families_verdict(plan);
            conditions.push(cond(
                condition::IP_FAMILIES,
                ok,
                reason,
                message,
                &prev_conds,
                generation,
                &now,
            ));
        }
    }

    // VIPs, one per family served: only for supported Services; an unsupported one
    // keeps the VIPs it already holds (so fixing the Service gives it back the same
    // addresses) but shows and announces none.
    if let Ok((net, _)) = &network {
        status.external_network = Some(net.clone());
    }
    let requested = requested_ip(svc);
    let serve: Vec<Family> = match plan.as_ref() {
        Some(p) if !p.serve.is_empty() => p.serve.clone(),
        _ => vec![Family::V4],
    };
    let mut vips: Vec<(IpAddr, String)> = Vec::new();
    let mut queued_on: Vec<String> = Vec::new();
    let mut messages: Vec<String> = Vec::new();
    let mut first_err = None;
    match refused.as_ref().filter(|g| g.reason != IPV6_NOT_SUPPORTED) {
        // A family without a pool that the policy cannot do without: nothing is
        // allocated, nothing is half-served.
        Some(g) => {
            first_err = Some((problem(g.reason, g.message.clone()), true));
        }
        None => {
            for family in serve {
                let d = decide_vip(
                    svc, world, book, &owner, supported, family, &network, &requested,
                );
                for p in d.queued_on {
                    if !queued_on.contains(&p) {
                        queued_on.push(p);
                    }
                }
                match d.condition {
                    Ok(m) => {
                        messages.push(m);
                        vips.extend(d.vip);
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
    }
    let vip_cond = match first_err {
        Some(e) => Err(e),
        None => {
            // Recorded (so a restarted controller finds them) whether or not served.
            status.vip = vips.first().map(|(ip, _)| ip.to_string());
            status.address_pool = vips.first().map(|(_, p)| p.clone());
            status.vips = vips
                .iter()
                .map(|(ip, pool)| FamilyVip {
                    family: Family::of(*ip).as_str().to_string(),
                    ip: ip.to_string(),
                    address_pool: pool.clone(),
                })
                .collect();
            Ok(messages.join("; "))
        }
    };
    let vip_ok = vip_cond.is_ok();
    let waiting_for_address = matches!(&vip_cond, Err((_, false)));
    let mut failed = !supported;
    if let Err((_, fatal)) = &vip_cond {
        failed |= *fatal && supported;
    }
    let (ok, reason, message) = vip_verdict(&vip_cond);
    conditions.push(cond(
        condition::VIP_ALLOCATED,
        ok,
        reason,
        message,
        &prev_conds,
        generation,
        &now,
    ));

    let serving = supported && vip_ok;
    let no_labels = BTreeMap::new();
    let service_labels = svc.metadata.labels.as_ref().unwrap_or(&no_labels);
    let uncovered = set_advertising_nodes(world, service_labels, &pic, serving, &mut status);
    let advertised = serving && !status.advertising_nodes.is_empty();
    let (adv_reason, adv_msg) = advertised_verdict(serving, advertised, uncovered, &status, &pic);
    conditions.push(cond(
        condition::ADVERTISED,
        advertised,
        adv_reason,
        adv_msg,
        &prev_conds,
        generation,
        &now,
    ));

    status.phase = phase_of(failed, advertised);
    let (ready_reason, ready_msg) = ready_verdict(&conditions);
    let ready = cond(
        condition::READY,
        status.phase == Phase::Ready,
        ready_reason,
        ready_msg,
        &prev_conds,
        generation,
        &now,
    );
    conditions.push(ready);

    // Events: only when a condition changes (reason or status), so a resync is silent.
    notes.extend(condition_events(&prev_conds, &conditions));

    status.conditions = conditions;
    Outcome {
        ingress_ips: if serving {
            vips.iter().map(|(ip, _)| *ip).collect()
        } else {
            Vec::new()
        },
        status,
        notes,
        waiting_for_address,
        queued_on,
        released,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AdvertiseMode;
    use crate::endpoints::testutil::{node, slice};
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use kube::api::ObjectMeta;
    use std::sync::Arc;

    fn world() -> World {
        World {
            networks: [(
                "public".to_string(),
                ExternalNetworkSpec {
                    network_type: crate::crd::ExternalNetworkType::Bgp,
                    address_pools: vec!["public-v4".into()],
                },
            )]
            .into(),
            pools: [(
                "public-v4".to_string(),
                AddressPoolSpec {
                    advertise_mode: AdvertiseMode::bgp(),
                    addresses: vec!["203.0.113.0/24".into()],
                    allow_network_and_broadcast: None,
                    auto_assign: None,
                    service_allocation: None,
                },
            )]
            .into(),
            nodes: [
                node("node-a", "192.168.0.1", false),
                node("node-c", "192.168.0.3", false),
            ]
            .into(),
            advertisements: vec![BGPAdvertisementSpec {
                address_pools: vec!["public-v4".into()],
                service_selector: None,
                peer_selector: None,
                node_selector: None,
                communities: vec![],
                large_communities: vec![],
                local_pref: None,
                weighted_by_backends: None,
            }],
            namespaces: BTreeMap::new(),
            waiters: vec![],
            shared_with: vec![],
        }
    }

    /// A Service of the shared-VIP group `key` listening on `ports`, created at `secs`.
    fn sharing(name: &str, key: &str, secs: i64, ports: &[(&str, i32)]) -> Service {
        let mut s = svc(
            name,
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (crate::sharing::SHARED_IP_ANNOTATION, key),
            ],
        );
        s.metadata.creation_timestamp = Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + secs).unwrap(),
        ));
        s.spec.as_mut().unwrap().ports = Some(crate::sharing::test_ports(ports));
        s
    }

    #[test]
    fn services_sharing_a_key_hold_one_vip_and_a_colliding_port_gets_none() {
        let sl = seed_slice();
        let tcp = Arc::new(sharing("dns-tcp", "dns", 1, &[("TCP", 53)]));
        let udp = Arc::new(sharing("dns-udp", "dns", 2, &[("UDP", 53)]));
        let late = Arc::new(sharing("dns-late", "dns", 3, &[("TCP", 53)]));
        let other = svc("web", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let mut book = VipBook::default();
        let with = |others: &[&Arc<Service>]| World {
            shared_with: others.iter().map(|s| Arc::clone(s)).collect(),
            ..world()
        };
        let o_udp = reconcile_service(&udp, None, &[&sl], &with(&[&tcp, &late]), &mut book, now());
        let o_tcp = reconcile_service(&tcp, None, &[&sl], &with(&[&udp, &late]), &mut book, now());
        let o_web = reconcile_service(&other, None, &[&sl], &world(), &mut book, now());
        assert!(
            o_udp.ingress_ip().is_some(),
            "{:?}",
            o_udp.status.conditions
        );
        assert_eq!(
            o_udp.ingress_ip(),
            o_tcp.ingress_ip(),
            "one VIP for the group"
        );
        assert_ne!(
            o_web.ingress_ip(),
            o_tcp.ingress_ip(),
            "a Service outside it gets its own"
        );
        assert_eq!(book.len(), 2);
        // The newcomer collides on 53/TCP with the older dns-tcp: no VIP shown, Failed, a
        // Warning naming the port and the holder; the group keeps its VIP.
        let o = reconcile_service(&late, None, &[&sl], &with(&[&tcp, &udp]), &mut book, now());
        assert_eq!(o.ingress_ip(), None);
        assert_eq!(o.status.phase, Phase::Failed);
        let n = o
            .notes
            .iter()
            .find(|n| n.reason == "SharedIPPortConflict")
            .unwrap();
        assert!(
            n.warning && n.message.contains("53/TCP") && n.message.contains("default/dns-tcp"),
            "{n:?}"
        );
        assert_eq!(
            book.first_vip("default/allow-shared-ip=dns"),
            o_tcp.ingress_ip()
        );
        // Once dns-tcp is gone, it fits.
        let o = reconcile_service(&late, None, &[&sl], &with(&[&udp]), &mut book, now());
        assert_eq!(o.ingress_ip(), o_udp.ingress_ip());
    }

    #[test]
    fn a_member_asking_for_another_address_is_refused_and_moves_nothing() {
        let sl = seed_slice();
        let a = Arc::new(sharing("a", "k", 1, &[("TCP", 80)]));
        let mut b = sharing("b", "k", 2, &[("TCP", 443)]);
        b.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(REQUESTED_IP_ANNOTATION.into(), "203.0.113.77".into());
        let mut book = VipBook::default();
        let w = World {
            shared_with: vec![Arc::new(b.clone())],
            ..world()
        };
        let held = reconcile_service(&a, None, &[&sl], &w, &mut book, now()).ingress_ip();
        let w = World {
            shared_with: vec![a.clone()],
            ..world()
        };
        let o = reconcile_service(&b, None, &[&sl], &w, &mut book, now());
        assert_eq!(o.ingress_ip(), None);
        assert_eq!(o.status.phase, Phase::Failed);
        assert!(o
            .notes
            .iter()
            .any(|n| n.reason == "SharedIPConflict" && n.message.contains("203.0.113.77")));
        assert_eq!(
            book.first_vip("default/allow-shared-ip=k"),
            held,
            "the group keeps its VIP"
        );
        // Alone, the same request moves the group's VIP (nobody else uses it).
        let o = reconcile_service(&b, None, &[&sl], &world(), &mut book, now());
        assert_eq!(o.ingress_ip(), Some("203.0.113.77".parse().unwrap()));
    }

    #[test]
    fn freed_addresses_go_to_the_oldest_waiters() {
        let mut w = world();
        w.pools.get_mut("public-v4").unwrap().addresses = vec!["203.0.113.5-203.0.113.6".into()];
        let sl = seed_slice();
        let aged = |name: &str, secs: i64| {
            let mut s = svc(name, &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
            s.metadata.creation_timestamp = Some(Time(
                k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + secs).unwrap(),
            ));
            s
        };
        // Two addresses were just freed; w3 and w4 (older) and w5 (younger) wait.
        w.waiters = [("default/w3", 3), ("default/w4", 4), ("default/w5", 5)]
            .iter()
            .map(|(k, c)| Waiter {
                key: k.to_string(),
                created: 1_700_000_000 + c,
                pools: vec!["public-v4".into()],
            })
            .collect();
        let mut book = VipBook::default();
        // The youngest is reconciled first: it must leave both addresses to its elders.
        let o5 = reconcile_service(&aged("w5", 5), None, &[&sl], &w, &mut book, now());
        assert_eq!(o5.ingress_ip(), None);
        assert_eq!(o5.queued_on, vec!["public-v4".to_string()]);
        assert!(o5
            .status
            .conditions
            .iter()
            .any(|c| c.reason == "AddressPoolExhausted"
                && c.message.contains("2 older Service(s) wait")));
        let o4 = reconcile_service(&aged("w4", 4), None, &[&sl], &w, &mut book, now());
        assert!(o4.ingress_ip().is_some(), "{:?}", o4.status.conditions);
        let o3 = reconcile_service(&aged("w3", 3), None, &[&sl], &w, &mut book, now());
        assert!(o3.ingress_ip().is_some());
        assert!(o3.queued_on.is_empty());
        // Once the elders hold theirs, w5 is simply exhausted and stays in line.
        w.waiters.retain(|x| x.key == "default/w5");
        let o5 = reconcile_service(&aged("w5", 5), None, &[&sl], &w, &mut book, now());
        assert_eq!(o5.ingress_ip(), None);
        assert_eq!(o5.queued_on, vec!["public-v4".to_string()]);
    }

    #[test]
    fn no_advertisement_no_announcement() {
        let mut w = world();
        w.advertisements.clear();
        let mut book = VipBook::default();
        let sl = seed_slice();
        let o = reconcile_service(
            &svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]),
            None,
            &[&sl],
            &w,
            &mut book,
            now(),
        );
        assert_eq!(o.status.phase, Phase::Pending);
        assert!(o.status.advertising_nodes.is_empty());
        assert!(o.notes.iter().any(|n| n.reason == "NoBGPAdvertisement"));
    }

    fn svc(name: &str, ann: &[(&str, &str)]) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                annotations: Some(
                    ann.iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                generation: Some(1),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                load_balancer_class: Some(LOAD_BALANCER_CLASS.into()),
                external_traffic_policy: Some("Local".into()),
                ip_families: Some(vec!["IPv4".into()]),
                ports: Some(vec![ServicePort {
                    name: Some("http".into()),
                    protocol: Some("TCP".into()),
                    port: 80,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
    }

    /// The seed world with a second pool holding both families first in the network.
    fn dual_world() -> World {
        let mut w = world();
        w.pools.insert(
            "public-dual".into(),
            AddressPoolSpec {
                advertise_mode: AdvertiseMode::bgp(),
                addresses: vec!["2001:db8:1::/64".into(), "198.51.100.0/30".into()],
                allow_network_and_broadcast: None,
                auto_assign: None,
                service_allocation: None,
            },
        );
        w.networks.get_mut("public").unwrap().address_pools =
            vec!["public-dual".into(), "public-v4".into()];
        w.advertisements[0].address_pools.push("public-dual".into());
        w
    }

    fn dual_svc(name: &str, policy: &str, families: &[&str], ann: &[(&str, &str)]) -> Service {
        let mut a = vec![(EXTERNAL_NETWORK_ANNOTATION, "public")];
        a.extend_from_slice(ann);
        let mut s = svc(name, &a);
        let spec = s.spec.as_mut().unwrap();
        spec.ip_family_policy = Some(policy.into());
        spec.ip_families = Some(families.iter().map(|f| f.to_string()).collect());
        s
    }

    fn ips(v: &[&str]) -> Vec<IpAddr> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn condition<'a>(o: &'a Outcome, type_: &str) -> Option<&'a Condition> {
        o.status.conditions.iter().find(|c| c.type_ == type_)
    }

    /// The dataplane does not serve IPv6 (the switch as shipped): PreferDualStack is
    /// served on IPv4, first or second, with a warning; RequireDualStack and
    /// SingleStack IPv6 are refused, nothing allocated.
    #[test]
    fn without_ipv6_in_the_dataplane_only_ipv4_is_served() {
        let sl = seed_slice();
        for fams in [["IPv6", "IPv4"], ["IPv4", "IPv6"]] {
            let w = dual_world();
            let mut book = VipBook::default();
            let s = dual_svc("web", "PreferDualStack", &fams, &[]);
            let o = reconcile_with(&s, None, &[&sl], &w, &mut book, now(), false);
            assert_eq!(o.status.phase, Phase::Ready, "{:?}", o.status.conditions);
            assert_eq!(o.ingress_ips, ips(&["198.51.100.1"]));
            assert_eq!(o.status.vip.as_deref(), Some("198.51.100.1"));
            assert_eq!(o.status.vips.len(), 1);
            assert!(book.vip_of("default/web", Family::V6).is_none());
            let c = condition(&o, condition::IP_FAMILIES).unwrap();
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", IPV6_NOT_SUPPORTED)
            );
            assert!(
                c.message.contains("the dataplane does not serve IPv6 yet"),
                "{}",
                c.message
            );
            assert_eq!(condition(&o, condition::READY).unwrap().status, "True");
            assert!(
                o.notes
                    .iter()
                    .any(|n| n.warning && n.reason == IPV6_NOT_SUPPORTED),
                "{:?}",
                o.notes
            );
            // A resync is silent.
            let again = reconcile_with(&s, Some(&o.status), &[&sl], &w, &mut book, now(), false);
            assert!(again.notes.is_empty(), "{:?}", again.notes);
        }
        for (policy, fams) in [
            ("RequireDualStack", &["IPv4", "IPv6"][..]),
            ("RequireDualStack", &["IPv6", "IPv4"][..]),
            ("SingleStack", &["IPv6"][..]),
        ] {
            let w = dual_world();
            let mut book = VipBook::default();
            let s = dual_svc("web", policy, fams, &[]);
            let o = reconcile_with(&s, None, &[&sl], &w, &mut book, now(), false);
            assert_eq!(o.status.phase, Phase::Failed, "{policy} {fams:?}");
            assert!(o.ingress_ips.is_empty() && o.status.vip.is_none() && o.status.vips.is_empty());
            assert!(book.is_empty(), "{policy} {fams:?}: nothing allocated");
            let c = condition(&o, condition::SUPPORTED).unwrap();
            assert_eq!(c.reason, IPV6_NOT_SUPPORTED);
            assert!(c.message.contains("the dataplane does not serve IPv6 yet"));
            assert!(o
                .notes
                .iter()
                .any(|n| n.warning && n.reason == IPV6_NOT_SUPPORTED));
        }
    }

    /// With the dataplane serving IPv6: one VIP per family in the Service's order, in
    /// the record and in the ingress; a requested address per family.
    #[test]
    fn with_ipv6_in_the_dataplane_both_families_are_served_in_order() {
        let sl = seed_slice();
        let w = dual_world();
        let mut book = VipBook::default();
        let s = dual_svc("web", "RequireDualStack", &["IPv6", "IPv4"], &[]);
        let o = reconcile_with(&s, None, &[&sl], &w, &mut book, now(), true);
        assert_eq!(o.status.phase, Phase::Ready, "{:?}", o.status.conditions);
        assert_eq!(o.ingress_ips, ips(&["2001:db8:1::1", "198.51.100.1"]));
        assert_eq!(o.status.vip.as_deref(), Some("2001:db8:1::1"));
        assert_eq!(o.status.address_pool.as_deref(), Some("public-dual"));
        let families: Vec<(&str, &str)> = o
            .status
            .vips
            .iter()
            .map(|v| (v.family.as_str(), v.ip.as_str()))
            .collect();
        assert_eq!(
            families,
            [("IPv6", "2001:db8:1::1"), ("IPv4", "198.51.100.1")]
        );
        let c = condition(&o, condition::IP_FAMILIES).unwrap();
        assert_eq!(
            (c.status.as_str(), c.message.as_str()),
            ("True", "served on IPv6 and IPv4")
        );
        let vip_msg = &condition(&o, condition::VIP_ALLOCATED).unwrap().message;
        assert!(
            vip_msg.contains("2001:db8:1::1") && vip_msg.contains("198.51.100.1"),
            "{vip_msg}"
        );
        // Idempotent.
        let again = reconcile_with(&s, Some(&o.status), &[&sl], &w, &mut book, now(), true);
        assert_eq!(again.status, o.status);
        assert!(again.notes.is_empty(), "{:?}", again.notes);
        assert!(again.released.is_empty());
        // Going back to one family releases the other family's VIP.
        let single = dual_svc("web", "SingleStack", &["IPv6"], &[]);
        let one = reconcile_with(&single, Some(&o.status), &[&sl], &w, &mut book, now(), true);
        assert_eq!(one.released, ips(&["198.51.100.1"]));
        assert_eq!(one.ingress_ips, ips(&["2001:db8:1::1"]));
        assert!(book.vip_of("default/web", Family::V4).is_none());
        let back = reconcile_with(&s, Some(&one.status), &[&sl], &w, &mut book, now(), true);
        assert_eq!(back.ingress_ips, ips(&["2001:db8:1::1", "198.51.100.1"]));

        // Requested addresses, one per family.
        let r = dual_svc(
            "req",
            "PreferDualStack",
            &["IPv4", "IPv6"],
            &[(REQUESTED_IP_ANNOTATION, "2001:db8:1::50, 203.0.113.50")],
        );
        let o = reconcile_with(&r, None, &[&sl], &w, &mut book, now(), true);
        assert_eq!(
            o.ingress_ips,
            ips(&["203.0.113.50", "2001:db8:1::50"]),
            "{:?}",
            o.status.conditions
        );
        // A bad value is a condition naming it; nothing allocated.
        let bad = dual_svc(
            "bad",
            "PreferDualStack",
            &["IPv4", "IPv6"],
            &[(REQUESTED_IP_ANNOTATION, "2001:db8:1::50,2001:db8:1::51")],
        );
        let o = reconcile_with(&bad, None, &[&sl], &w, &mut book, now(), true);
        assert_eq!(o.status.phase, Phase::Failed);
        let c = condition(&o, condition::VIP_ALLOCATED).unwrap();
        assert_eq!(c.reason, "RequestedIPInvalid");
        assert!(c.message.contains("both IPv6 addresses"), "{}", c.message);
        assert!(book.vips_of("default/bad").is_empty());
        // spec.loadBalancerIP stays IPv4-only.
        let mut f = dual_svc("field", "SingleStack", &["IPv6"], &[]);
        f.spec.as_mut().unwrap().load_balancer_ip = Some("2001:db8:1::60".into());
        let o = reconcile_with(&f, None, &[&sl], &w, &mut book, now(), true);
        assert!(condition(&o, condition::VIP_ALLOCATED)
            .unwrap()
            .message
            .contains("for IPv4 only"));
    }

    /// With the dataplane serving IPv6, a family no pool holds: PreferDualStack is
    /// served on the other with a warning, RequireDualStack and SingleStack serve
    /// nothing.
    #[test]
    fn a_family_without_a_pool_is_a_condition_and_never_half_served() {
        let sl = seed_slice();
        let w = world(); // IPv4 pools only
        let mut book = VipBook::default();
        let s = dual_svc("web", "PreferDualStack", &["IPv6", "IPv4"], &[]);
        let o = reconcile_with(&s, None, &[&sl], &w, &mut book, now(), true);
        assert_eq!(o.status.phase, Phase::Ready);
        assert_eq!(o.ingress_ips, ips(&["203.0.113.1"]));
        let c = condition(&o, condition::IP_FAMILIES).unwrap();
        assert_eq!(c.reason, families::NO_POOL_FOR_FAMILY);
        assert!(o
            .notes
            .iter()
            .any(|n| n.warning && n.reason == families::NO_POOL_FOR_FAMILY));
        for (policy, fams) in [
            ("RequireDualStack", &["IPv4", "IPv6"][..]),
            ("SingleStack", &["IPv6"][..]),
        ] {
            let mut book = VipBook::default();
            let s = dual_svc("web", policy, fams, &[]);
            let o = reconcile_with(&s, None, &[&sl], &w, &mut book, now(), true);
            assert_eq!(o.status.phase, Phase::Failed, "{policy}");
            assert!(o.ingress_ips.is_empty() && o.status.vip.is_none());
            assert!(book.is_empty(), "{policy}: nothing half-served");
            let c = condition(&o, condition::VIP_ALLOCATED).unwrap();
            assert_eq!(c.reason, families::NO_POOL_FOR_FAMILY);
            assert!(c.message.contains("nothing is served"), "{}", c.message);
            assert!(o
                .notes
                .iter()
                .any(|n| n.warning && n.reason == families::NO_POOL_FOR_FAMILY));
        }
    }

    fn seed_slice() -> EndpointSlice {
        slice(
            "nginx",
            "nginx-1",
            &[
                ("10.0.0.1", "node-a", true, false),
                ("10.0.0.2", "node-a", true, false),
                ("10.0.0.3", "node-c", true, false),
            ],
            ("http", 80),
        )
    }

    #[test]
    fn host_network_backends_under_local_policy_are_served() {
        // An ingress controller on both nodes' own addresses.
        let w = world();
        let mut book = VipBook::default();
        let s = svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let sl = slice(
            "nginx",
            "nginx-1",
            &[
                ("192.168.0.1", "node-a", true, false),
                ("192.168.0.3", "node-c", true, false),
            ],
            ("http", 80),
        );
        let o = reconcile_service(&s, None, &[&sl], &w, &mut book, now());
        assert_eq!(o.status.phase, Phase::Ready, "{:?}", o.status.conditions);
        assert_eq!(o.status.advertising_nodes, vec!["node-a", "node-c"]);
    }

    #[test]
    fn seed_service_becomes_ready() {
        let w = world();
        let mut book = VipBook::default();
        let s = svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let sl = seed_slice();
        let o = reconcile_service(&s, None, &[&sl], &w, &mut book, now());
        assert_eq!(o.status.phase, Phase::Ready);
        assert_eq!(o.status.vip.as_deref(), Some("203.0.113.1"));
        assert_eq!(o.status.address_pool.as_deref(), Some("public-v4"));
        assert_eq!(o.status.advertising_nodes, vec!["node-a", "node-c"]);
        assert_eq!(
            o.status.backend_summary,
            BackendSummary {
                total_ready: 3,
                local_ready_nodes: 2
            }
        );
        assert_eq!(
            o.ingress_ip(),
            Some(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)))
        );
        // One Normal Event says both: the VIP and where it is advertised.
        let normal: Vec<&Note> = o.notes.iter().filter(|n| !n.warning).collect();
        assert_eq!(normal.len(), 1, "{:?}", o.notes);
        assert_eq!(normal[0].reason, "VIPAllocated");
        assert!(
            normal[0].message.contains("203.0.113.1") && normal[0].message.contains("node-a"),
            "{}",
            normal[0].message
        );
        // Resync: same answer, no new events.
        let o2 = reconcile_service(&s, Some(&o.status), &[&sl], &w, &mut book, now());
        assert_eq!(o2.status, o.status);
        assert!(o2.notes.is_empty(), "{:?}", o2.notes);
    }

    /// A Service-specific BGPAdvertisement decides where its Services are announced:
    /// limited to node-c, the Service's advertising nodes are node-c alone, while a
    /// Service it does not select keeps the pool's general advertisement (both nodes).
    #[test]
    fn a_service_specific_advertisement_decides_its_services_advertising_nodes() {
        let mut w = world();
        w.nodes.get_mut("node-c").unwrap().metadata.labels =
            Some([("rack".to_string(), "r3".to_string())].into());
        let selector =
            |k: &str, v: &str| k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                match_labels: Some([(k.to_string(), v.to_string())].into()),
                ..Default::default()
            };
        let mut specific = w.advertisements[0].clone();
        specific.service_selector = Some(selector("tier", "gold"));
        specific.node_selector = Some(selector("rack", "r3"));
        w.advertisements.push(specific);
        let mut book = VipBook::default();
        let sl = seed_slice();
        let plain = svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let o = reconcile_service(&plain, None, &[&sl], &w, &mut book, now());
        assert_eq!(o.status.advertising_nodes, vec!["node-a", "node-c"]);
        let mut gold = plain.clone();
        gold.metadata.labels = Some([("tier".to_string(), "gold".to_string())].into());
        let o = reconcile_service(&gold, Some(&o.status), &[&sl], &w, &mut book, now());
        assert_eq!(o.status.advertising_nodes, vec!["node-c"]);
        assert_eq!(o.status.backend_summary.local_ready_nodes, 1);
    }

    #[test]
    fn a_cluster_policy_service_is_announced_by_every_node_while_one_has_a_backend() {
        let mut w = world();
        w.nodes.extend([
            node("node-b", "192.168.0.2", false),
            node("node-x", "192.168.0.9", true),
        ]);
        let mut book = VipBook::default();
        let mut s = svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        s.spec.as_mut().unwrap().external_traffic_policy = None; // Kubernetes' default
        let o = reconcile_service(&s, None, &[&seed_slice()], &w, &mut book, now());
        assert_eq!(o.status.phase, Phase::Ready, "{o:?}");
        assert_eq!(
            o.status.advertising_nodes,
            vec!["node-a", "node-b", "node-c"],
            "every node but the excluded one"
        );
        let none = slice("nginx", "nginx-1", &[], ("http", 80));
        let o = reconcile_service(&s, Some(&o.status), &[&none], &w, &mut book, now());
        assert!(
            o.status.advertising_nodes.is_empty(),
            "no Ready endpoint anywhere"
        );
        // UDP too: the dataplane hands a new flow's datagrams on like a connection.
        let mut dns = svc("dns", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let spec = dns.spec.as_mut().unwrap();
        spec.external_traffic_policy = Some("Cluster".into());
        spec.ports.as_mut().unwrap()[0].protocol = Some("UDP".into());
        let sl = slice(
            "dns",
            "dns-1",
            &[("10.0.0.5", "node-a", true, false)],
            ("http", 80),
        );
        let o = reconcile_service(&dns, None, &[&sl], &w, &mut book, now());
        assert_eq!(o.status.phase, Phase::Ready, "{o:?}");
        assert_eq!(o.status.advertising_nodes.len(), 3, "{o:?}");
    }

    #[test]
    fn transition_times_move_only_on_change() {
        let w = world();
        let mut book = VipBook::default();
        let s = svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let sl = seed_slice();
        let first = reconcile_service(&s, None, &[&sl], &w, &mut book, now());
        let later = Time(k8s_openapi::jiff::Timestamp::from_second(1_000_000).unwrap());
        let unready = slice(
            "nginx",
            "nginx-1",
            &[("10.0.0.1", "node-a", false, false)],
            ("http", 80),
        );
        let second = reconcile_service(
            &s,
            Some(&first.status),
            &[&unready],
            &w,
            &mut book,
            later.clone(),
        );
        let t = |o: &Outcome, ty: &str| {
            o.status
                .conditions
                .iter()
                .find(|c| c.type_ == ty)
                .unwrap()
                .last_transition_time
                .clone()
        };
        assert_eq!(t(&second, condition::VIP_ALLOCATED), now());
        assert_eq!(t(&second, condition::ADVERTISED), later);
        assert_eq!(second.status.phase, Phase::Pending);
        assert!(second
            .notes
            .iter()
            .any(|n| n.reason == "NoReadyBackends" && !n.warning));
    }

    #[test]
    fn requested_ip_and_conflicts() {
        let w = world();
        let mut book = VipBook::default();
        let sl = seed_slice();
        let a = svc(
            "a",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "203.0.113.10"),
            ],
        );
        let b = svc(
            "b",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "203.0.113.10"),
            ],
        );
        let oa = reconcile_service(&a, None, &[&sl], &w, &mut book, now());
        assert_eq!(oa.status.vip.as_deref(), Some("203.0.113.10"));
        let ob = reconcile_service(&b, None, &[&sl], &w, &mut book, now());
        assert_eq!(ob.status.vip, None);
        assert_eq!(ob.status.phase, Phase::Pending);
        assert_eq!(ob.ingress_ip(), None);
        assert!(ob.status.advertising_nodes.is_empty());
        assert!(ob.notes.iter().any(|n| n.warning
            && n.reason == "RequestedIPTaken"
            && n.message.contains("default/a")));
        let c = svc(
            "c",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "198.51.100.1"),
            ],
        );
        assert!(ob.waiting_for_address && !oa.waiting_for_address);
        let oc = reconcile_service(&c, None, &[&sl], &w, &mut book, now());
        assert_eq!(oc.status.phase, Phase::Failed);
        assert!(!oc.waiting_for_address);
        assert!(oc
            .notes
            .iter()
            .any(|n| n.reason == "RequestedIPOutsidePools"));
        let d = svc(
            "d",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "not-an-ip"),
            ],
        );
        let od = reconcile_service(&d, None, &[&sl], &w, &mut book, now());
        assert!(od.notes.iter().any(|n| n.reason == "RequestedIPInvalid"));
    }

    /// A pool with autoAssign: false gives addresses only to Services that ask for one.
    #[test]
    fn an_auto_assign_false_pool_serves_only_requests() {
        let (mut w, sl) = (world(), seed_slice());
        w.pools.insert(
            "manual".into(),
            AddressPoolSpec {
                advertise_mode: AdvertiseMode::bgp(),
                addresses: vec!["198.51.100.0/30".into()],
                allow_network_and_broadcast: None,
                auto_assign: Some(false),
                service_allocation: None,
            },
        );
        w.networks.get_mut("public").unwrap().address_pools =
            vec!["manual".into(), "public-v4".into()];
        let mut book = VipBook::default();
        let a = svc("a", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let oa = reconcile_service(&a, None, &[&sl], &w, &mut book, now());
        assert_eq!(
            oa.status.address_pool.as_deref(),
            Some("public-v4"),
            "{oa:?}"
        );
        let b = svc(
            "b",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "198.51.100.2"),
            ],
        );
        let ob = reconcile_service(&b, None, &[&sl], &w, &mut book, now());
        assert_eq!(ob.status.vip.as_deref(), Some("198.51.100.2"), "{ob:?}");
        // Only manual pools: a Service asking for nothing fails with the reason.
        w.networks.get_mut("public").unwrap().address_pools = vec!["manual".into()];
        let c = svc("c", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let oc = reconcile_service(&c, None, &[&sl], &w, &mut book, now());
        assert_eq!(oc.status.phase, Phase::Failed, "{oc:?}");
        assert!(
            oc.notes.iter().any(|n| n.reason == "NoAutoAssignPool"),
            "{oc:?}"
        );
        // b keeps its VIP once it stops asking (a VIP is not taken away).
        let b2 = svc("b", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        let ob2 = reconcile_service(&b2, Some(&ob.status), &[&sl], &w, &mut book, now());
        assert_eq!(ob2.status.vip.as_deref(), Some("198.51.100.2"), "{ob2:?}");
    }

    /// AddressPools' serviceAllocation: a team's pool serves its namespace first (by
    /// name), a labelled namespace's pool by selector; other Services get the general
    /// pool; asking for an address of a pool that does not serve you is refused; a
    /// Service no pool serves fails with the reason; a held VIP is never taken away.
    #[test]
    fn pools_serve_the_services_their_allocation_selects_in_priority_order() {
        use crate::crd::ServiceAllocation;
        let (mut w, sl) = (world(), seed_slice());
        let pool = |addresses: &str, allocation: ServiceAllocation| AddressPoolSpec {
            advertise_mode: AdvertiseMode::bgp(),
            addresses: vec![addresses.into()],
            allow_network_and_broadcast: None,
            auto_assign: None,
            service_allocation: Some(allocation),
        };
        w.pools.insert(
            "team-a".into(),
            pool(
                "198.51.100.0/30",
                ServiceAllocation {
                    priority: Some(10),
                    namespaces: Some(vec!["team-a".into()]),
                    ..Default::default()
                },
            ),
        );
        w.pools.insert(
            "prod".into(),
            pool(
                "192.0.2.64/30",
                ServiceAllocation {
                    namespace_selector: Some(LabelSelector {
                        match_labels: Some([("env".to_string(), "prod".to_string())].into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ),
        );
        w.namespaces.insert(
            "shop".into(),
            [("env".to_string(), "prod".to_string())].into(),
        );
        w.networks.get_mut("public").unwrap().address_pools =
            vec!["public-v4".into(), "prod".into(), "team-a".into()];
        let in_ns = |name: &str, ns: &str, ann: &[(&str, &str)]| {
            let mut s = svc(name, ann);
            s.metadata.namespace = Some(ns.into());
            s
        };
        let net = [(EXTERNAL_NETWORK_ANNOTATION, "public")];
        let mut book = VipBook::default();
        let mut run = |w: &World, name: &str, ns: &str, ann: &[(&str, &str)], prev| {
            reconcile_service(&in_ns(name, ns, ann), prev, &[&sl], w, &mut book, now())
        };
        let team = run(&w, "a", "team-a", &net, None);
        assert_eq!(
            team.status.address_pool.as_deref(),
            Some("team-a"),
            "{team:?}"
        );
        let shop = run(&w, "s", "shop", &net, None);
        assert_eq!(
            shop.status.address_pool.as_deref(),
            Some("prod"),
            "{shop:?}"
        );
        let other = run(&w, "o", "default", &net, None);
        assert_eq!(
            other.status.address_pool.as_deref(),
            Some("public-v4"),
            "{other:?}"
        );
        // Asking for team-a's address from another namespace.
        let asks = [
            (EXTERNAL_NETWORK_ANNOTATION, "public"),
            (REQUESTED_IP_ANNOTATION, "198.51.100.2"),
        ];
        let o = run(&w, "x", "default", &asks, None);
        assert_eq!(o.status.phase, Phase::Failed, "{o:?}");
        assert!(
            o.notes.iter().any(|n| n.reason == "RequestedIPNotAllowed"),
            "{o:?}"
        );
        assert_ne!(o.status.vip.as_deref(), Some("198.51.100.2"));
        // Only team-a's pool left: a Service of another namespace has none.
        w.networks.get_mut("public").unwrap().address_pools = vec!["team-a".into()];
        let o = run(&w, "y", "default", &net, None);
        assert_eq!(o.status.phase, Phase::Failed, "{o:?}");
        assert!(
            o.notes.iter().any(|n| n.reason == "NoPoolForService"),
            "{o:?}"
        );
        // The shop's Service keeps its VIP when its namespace loses the label.
        w.networks.get_mut("public").unwrap().address_pools =
            vec!["public-v4".into(), "prod".into(), "team-a".into()];
        w.namespaces.clear();
        let again = run(&w, "s", "shop", &net, Some(&shop.status));
        assert_eq!(again.status.vip, shop.status.vip, "{again:?}");
    }

    /// `spec.loadBalancerIP` (deprecated, still in many manifests) asks for the VIP like
    /// the annotation; the condition says it is deprecated; both, disagreeing: refused.
    #[test]
    fn spec_load_balancer_ip_is_honoured_as_a_requested_ip() {
        let (w, sl) = (world(), seed_slice());
        let mut book = VipBook::default();
        let mut a = svc("a", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
        a.spec.as_mut().unwrap().load_balancer_ip = Some("203.0.113.77".into());
        let oa = reconcile_service(&a, None, &[&sl], &w, &mut book, now());
        assert_eq!(oa.status.vip.as_deref(), Some("203.0.113.77"), "{oa:?}");
        let allocated = oa
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == condition::VIP_ALLOCATED)
            .unwrap();
        assert!(
            allocated.message.contains("spec.loadBalancerIP")
                && allocated.message.contains("deprecated"),
            "{allocated:?}"
        );
        // The annotation and the field agree: fine; disagree: refused, nothing allocated.
        let mut b = svc(
            "b",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "203.0.113.78"),
            ],
        );
        b.spec.as_mut().unwrap().load_balancer_ip = Some("203.0.113.78".into());
        let ob = reconcile_service(&b, None, &[&sl], &w, &mut book, now());
        assert_eq!(ob.status.vip.as_deref(), Some("203.0.113.78"), "{ob:?}");
        let mut c = svc(
            "c",
            &[
                (EXTERNAL_NETWORK_ANNOTATION, "public"),
                (REQUESTED_IP_ANNOTATION, "203.0.113.79"),
            ],
        );
        c.spec.as_mut().unwrap().load_balancer_ip = Some("203.0.113.80".into());
        let oc = reconcile_service(&c, None, &[&sl], &w, &mut book, now());
        assert_eq!(oc.status.phase, Phase::Failed, "{oc:?}");
        assert!(oc.status.vip.is_none() && book.first_vip("default/c").is_none());
        assert!(oc.notes.iter().any(|n| n.reason == "RequestedIPConflict"));
    }

    #[test]
    fn every_bad_input_fails_with_a_reason() {
        let sl = seed_slice();
        type Mutation = Box<dyn Fn(&mut Service, &mut World)>;
        let cases: Vec<(&str, Mutation)> = vec![
            (
                // RequireDualStack where the network's pools hold IPv4 only (the switch
                // off refuses it as IPv6NotSupported: without_ipv6_in_the_dataplane_...).
                "NoAddressPoolForFamily",
                Box::new(|s, _| {
                    let spec = s.spec.as_mut().unwrap();
                    spec.ip_family_policy = Some("RequireDualStack".into());
                    spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()])
                }),
            ),
            (
                "InvalidIPFamilies",
                Box::new(|s, _| {
                    s.spec.as_mut().unwrap().ip_families = Some(vec!["IPv4".into(), "IPv6".into()])
                }),
            ),
            (
                "ProtocolNotSupported",
                Box::new(|s, _| {
                    s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].protocol =
                        Some("SCTP".into())
                }),
            ),
            (
                "InvalidSourceRanges",
                Box::new(|s, _| {
                    s.spec.as_mut().unwrap().load_balancer_source_ranges =
                        Some(vec!["2001:db8::/32".into()])
                }),
            ),
            (
                "ExternalNetworkMissing",
                Box::new(|s, _| {
                    s.metadata.annotations = None;
                }),
            ),
            (
                "ExternalNetworkNotFound",
                Box::new(|s, _| {
                    s.metadata
                        .annotations
                        .as_mut()
                        .unwrap()
                        .insert(EXTERNAL_NETWORK_ANNOTATION.into(), "nope".into());
                }),
            ),
            (
                "AddressPoolNotBGP",
                Box::new(|_, w| {
                    w.pools.get_mut("public-v4").unwrap().advertise_mode =
                        AdvertiseMode("layer2".into())
                }),
            ),
            (
                "AddressPoolInvalid",
                Box::new(|_, w| {
                    w.pools.get_mut("public-v4").unwrap().addresses = vec!["203.0.113.0/99".into()]
                }),
            ),
            (
                "AddressPoolNotFound",
                Box::new(|_, w| {
                    w.pools.clear();
                }),
            ),
            (
                "HostNetworkBackendsNeedLocalPolicy",
                Box::new(|s, w| {
                    w.nodes
                        .insert("node-c".into(), node("node-c", "10.0.0.3", false).1);
                    s.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
                }),
            ),
            (
                "HostNetworkBackendsMixed",
                Box::new(|_, w| {
                    w.nodes
                        .insert("node-c".into(), node("node-c", "10.0.0.3", false).1);
                }),
            ),
        ];
        for (reason, mutate) in cases {
            let mut w = world();
            let mut s = svc("x", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]);
            mutate(&mut s, &mut w);
            let mut book = VipBook::default();
            let o = reconcile_service(&s, None, &[&sl], &w, &mut book, now());
            assert_eq!(o.status.phase, Phase::Failed, "{reason}");
            assert!(o.status.advertising_nodes.is_empty(), "{reason}");
            assert_eq!(o.ingress_ip(), None, "{reason}");
            assert!(
                o.notes.iter().any(|n| n.warning && n.reason == reason),
                "{reason}: {:?}",
                o.notes
            );
            assert!(
                o.status
                    .conditions
                    .iter()
                    .any(|c| c.reason == reason && c.status == "False"),
                "{reason}"
            );
        }
    }

    #[test]
    fn exhausted_pool_is_pending() {
        let mut w = world();
        w.pools.get_mut("public-v4").unwrap().addresses = vec!["203.0.113.5/32".into()];
        let mut book = VipBook::default();
        let sl = seed_slice();
        let a = reconcile_service(
            &svc("a", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]),
            None,
            &[&sl],
            &w,
            &mut book,
            now(),
        );
        assert_eq!(a.status.vip.as_deref(), Some("203.0.113.5"));
        let b = reconcile_service(
            &svc("b", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]),
            None,
            &[&sl],
            &w,
            &mut book,
            now(),
        );
        assert_eq!(b.status.phase, Phase::Pending);
        assert!(b.notes.iter().any(|n| n.reason == "AddressPoolExhausted"));
    }

    #[test]
    fn no_ready_backend_is_pending_with_vip() {
        let w = world();
        let mut book = VipBook::default();
        let sl = slice(
            "nginx",
            "n",
            &[("10.0.0.1", "node-a", false, false)],
            ("http", 80),
        );
        let o = reconcile_service(
            &svc("nginx", &[(EXTERNAL_NETWORK_ANNOTATION, "public")]),
            None,
            &[&sl],
            &w,
            &mut book,
            now(),
        );
        assert_eq!(o.status.phase, Phase::Pending);
        assert!(o.status.vip.is_some());
        assert_eq!(
            o.ingress_ip(),
            o.status.vip.as_ref().map(|v| v.parse().unwrap())
        );
        assert!(o
            .status
            .conditions
            .iter()
            .any(|c| c.reason == "NoReadyBackends"));
    }

    #[test]
    fn managed_only_by_class() {
        let mut s = svc("x", &[]);
        assert!(is_managed(&s));
        s.spec.as_mut().unwrap().load_balancer_class = Some("other.io/lb".into());
        assert!(!is_managed(&s));
        s.spec.as_mut().unwrap().load_balancer_class = Some(LOAD_BALANCER_CLASS.into());
        s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        assert!(!is_managed(&s));
    }
}
