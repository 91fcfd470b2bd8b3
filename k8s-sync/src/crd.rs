//! The custom resources of `juneau.loutres.me/v1alpha1`.
//!
//! * [`AddressPool`] (cluster): IPv4 ranges VIPs are handed out from.
//! * [`ExternalNetwork`] (cluster): the network a Service asks for by annotation; it lists
//!   the AddressPools its VIPs come from, in order.
//! * [`ServiceLoadBalancer`] (namespaced): one per managed Service, same name, owned by it;
//!   written only by the controller; its status says what Juneau did and why.
//! * [`BGPPeer`] (cluster): a BGP session the selected nodes open to an upstream router
//!   (modelled on MetalLB's BGPPeer and Calico's BGPPeer).
//! * [`BGPAdvertisement`] (cluster): which AddressPools' VIPs are announced to which peers,
//!   with which communities and LOCAL_PREF (modelled on MetalLB's BGPAdvertisement).
//! * [`NodeBGPStatus`] (cluster): one per node, same name; the live BGP sessions of the
//!   node's speaker as its node agent reads them (modelled on Calico's
//!   CalicoNodeStatus); written only by that agent.
//!
//! Validation lives in the schema where the apiserver can check it (formats, enums, CEL
//! rules), so `kubectl apply` rejects bad objects with a message; the controller and agent
//! still check everything again and never trust a stored object blindly.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};

/// The API group of every Juneau resource.
pub const GROUP: &str = "juneau.loutres.me";
/// The `loadBalancerClass` of Services Juneau manages.
pub const LOAD_BALANCER_CLASS: &str = "juneau.loutres.me/load-balancer";
/// Annotation naming the ExternalNetwork a Service's VIP comes from (required).
pub const EXTERNAL_NETWORK_ANNOTATION: &str = "juneau.loutres.me/load-balancer-external-network";
/// Annotation asking for one specific VIP (optional).
pub const REQUESTED_IP_ANNOTATION: &str = "juneau.loutres.me/load-balancer-requested-ip";
/// Finalizer the controller puts on managed Services so the VIP is released on delete.
pub const FINALIZER: &str = "juneau.loutres.me/load-balancer";
/// Node label that keeps a node out of external load balancing.
pub const EXCLUDE_FROM_LB_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// Field manager name used for server-side apply by the controller.
pub const CONTROLLER_MANAGER: &str = "juneau-controller";

/// A string schema with extra keywords (format, pattern, lengths, enum ...).
fn string_schema(extra: serde_json::Value) -> Schema {
    let mut s = json_schema!({"type": "string"});
    if let serde_json::Value::Object(map) = extra {
        for (k, v) in map {
            s.insert(k, v);
        }
    }
    s
}

/// CEL: a CIDR without host bits (`203.0.113.0/24`, `2001:db8::/64`), a range of one
/// family (`203.0.113.10-203.0.113.20`, `2001:db8::10-2001:db8::1f`) or a single
/// address, IPv4 or IPv6.
const ADDRESS_RULE: &str = "self.contains('-') ? (self.split('-').size() == 2 && isIP(self.split('-')[0]) && isIP(self.split('-')[1]) && ip(self.split('-')[0]).family() == ip(self.split('-')[1]).family()) : self.contains('/') ? (isCIDR(self) && cidr(self) == cidr(self).masked()) : isIP(self)";

fn address_list_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "minItems": 1,
        "maxItems": 64,
        "items": {
            "type": "string",
            "maxLength": 79,
            "x-kubernetes-validations": [{
                "rule": ADDRESS_RULE,
                "message": "each address must be a CIDR without host bits (203.0.113.0/24, 2001:db8::/64), a range of one family (203.0.113.10-203.0.113.20, 2001:db8::10-2001:db8::1f) or one IPv4 or IPv6 address"
            }]
        }
    })
}

fn advertise_mode_schema(_: &mut SchemaGenerator) -> Schema {
    string_schema(serde_json::json!({
        "enum": ["bgp"],
        "description": "How VIPs of this pool reach the upstream routers. Only bgp is supported: each VIP is announced as a /32 by the nodes that have a Ready local backend."
    }))
}

/// CEL: an IPv4 address, or a global (or unique-local) IPv6 one — not link-local (a
/// session to it needs an interface), loopback, multicast or unspecified; `isIP`
/// already refuses IPv4-mapped IPv6 addresses and zones.
const PEER_IP_RULE: &str = "isIP(self) && (ip(self).family() == 4 || ip(self).isGlobalUnicast())";

/// A BGP session's address (issue 28: IPv4 or IPv6). 45: the longest IPv6 text form.
fn peer_ip_schema(_: &mut SchemaGenerator) -> Schema {
    string_schema(serde_json::json!({
        "maxLength": 45,
        "x-kubernetes-validations": [{
            "rule": PEER_IP_RULE,
            "message": "must be an IPv4 address or a global (or unique-local) IPv6 address"
        }]
    }))
}

fn opt_peer_ip_schema(g: &mut SchemaGenerator) -> Schema {
    peer_ip_schema(g)
}

/// An IPv4 or IPv6 address (a VIP).
fn ip_schema(_: &mut SchemaGenerator) -> Schema {
    string_schema(serde_json::json!({
        "maxLength": 39,
        "x-kubernetes-validations": [{"rule": "isIP(self)", "message": "must be an IPv4 or IPv6 address"}]
    }))
}

fn family_schema(_: &mut SchemaGenerator) -> Schema {
    string_schema(serde_json::json!({"enum": ["IPv4", "IPv6"]}))
}

fn pool_names_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": 32,
        "items": {"type": "string", "minLength": 1, "maxLength": 253},
    })
}

/// How an AddressPool's VIPs are made reachable. Kept as a string in Rust so an object
/// written under another schema never breaks a watch; the schema only admits `bgp`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AdvertiseMode(pub String);

impl AdvertiseMode {
    /// The only mode Juneau serves LoadBalancer VIPs with.
    pub fn bgp() -> Self {
        AdvertiseMode("bgp".into())
    }
    /// True for `bgp`.
    pub fn is_bgp(&self) -> bool {
        self.0 == "bgp"
    }
}

impl JsonSchema for AdvertiseMode {
    fn schema_name() -> Cow<'static, str> {
        "AdvertiseMode".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(g: &mut SchemaGenerator) -> Schema {
        advertise_mode_schema(g)
    }
}

/// A set of IPv4 and/or IPv6 addresses Service VIPs are allocated from.
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "juneau.loutres.me",
    version = "v1alpha1",
    kind = "AddressPool",
    shortname = "ap",
    category = "juneau",
    status = "AddressPoolStatus",
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.advertiseMode"}"#,
    printcolumn = r#"{"name":"Addresses","type":"string","jsonPath":".spec.addresses"}"#,
    printcolumn = r#"{"name":"Total","type":"integer","jsonPath":".status.addressesTotal"}"#,
    printcolumn = r#"{"name":"Allocated","type":"integer","jsonPath":".status.addressesAllocated"}"#,
    printcolumn = r#"{"name":"Overlapping","type":"string","jsonPath":".status.conditions[?(@.type==\"Overlapping\")].status"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AddressPoolSpec {
    /// How VIPs of this pool are announced; must be `bgp`.
    pub advertise_mode: AdvertiseMode,
    /// CIDRs (`203.0.113.0/24`, `2001:db8::/64`), ranges of one family
    /// (`203.0.113.10-203.0.113.20`) or single addresses, IPv4 or IPv6; one pool may
    /// hold both families.
    #[schemars(schema_with = "address_list_schema")]
    pub addresses: Vec<String>,
    /// Also hand out the network and broadcast addresses of each CIDR (the first and last
    /// address). Off by default, as routers and hosts often treat them specially.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_network_and_broadcast: Option<bool>,
    /// Hand this pool's addresses to Services that ask for none (the default, `true`).
    /// `false`: only to a Service that asks for one of them (the requested-ip annotation
    /// or `spec.loadBalancerIP`) — a pool kept for addresses given out by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_assign: Option<bool>,
    /// Which Services this pool serves, and before which other pools (default: every
    /// Service, after the pools that have a serviceAllocation). docs/k8s-sync.md,
    /// "Which pool a Service's VIP comes from".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_allocation: Option<ServiceAllocation>,
}

/// The Services an AddressPool serves (all the given conditions hold) and its priority.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAllocation {
    /// Lower first: among the pools of a Service's ExternalNetwork that serve it, the
    /// ones with a priority go first (lowest number first), then the ones with a
    /// serviceAllocation but no priority, then the pools without a serviceAllocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Namespaces (by name) whose Services it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<Vec<String>>,
    /// Namespaces (by label) whose Services it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Services (by label) it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<LabelSelector>,
}

/// What the controller reports on an AddressPool. Written only by the leading controller.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AddressPoolStatus {
    /// Addresses the pool hands out, both families (network and broadcast addresses,
    /// and IPv6's Subnet-Router anycast address, excluded unless allowed; 0 when the
    /// addresses do not parse). At most 9223372036854775807 (an IPv6 /64 alone holds
    /// 2^64 addresses): a larger pool shows that.
    #[serde(default)]
    pub addresses_total: u64,
    /// Addresses of the pool held by a Service as its VIP.
    #[serde(default)]
    pub addresses_allocated: u64,
    /// `Overlapping`: True when some address is also in another AddressPool (the reason
    /// and message name the pool and the shared range).
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// The kind of an ExternalNetwork.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ExternalNetworkType {
    /// Reached over BGP from the advertising nodes.
    #[serde(rename = "bgp")]
    Bgp,
}

/// A network Services can be exposed on; names the AddressPools its VIPs come from.
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "juneau.loutres.me",
    version = "v1alpha1",
    kind = "ExternalNetwork",
    shortname = "extnet",
    category = "juneau",
    printcolumn = r#"{"name":"Type","type":"string","jsonPath":".spec.type"}"#,
    printcolumn = r#"{"name":"Pools","type":"string","jsonPath":".spec.addressPools"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ExternalNetworkSpec {
    /// `bgp`.
    #[serde(rename = "type")]
    pub network_type: ExternalNetworkType,
    /// AddressPool names; VIPs are allocated from the first pool with room.
    #[schemars(schema_with = "pool_names_schema")]
    pub address_pools: Vec<String>,
}

/// Lifecycle phase of a ServiceLoadBalancer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
pub enum Phase {
    /// Waiting for something (a VIP, a Ready backend) — the conditions say what.
    #[default]
    Pending,
    /// VIP allocated and announced from at least one node.
    Ready,
    /// The Service asks for something Juneau cannot do; nothing is announced.
    Failed,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Pending => "Pending",
            Phase::Ready => "Ready",
            Phase::Failed => "Failed",
        })
    }
}

/// Ready endpoints behind a ServiceLoadBalancer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackendSummary {
    /// Ready, non-terminating endpoints of the Service, cluster-wide.
    pub total_ready: u32,
    /// Number of advertising nodes (nodes with at least one Ready local endpoint).
    pub local_ready_nodes: u32,
}

/// One VIP of a Service, of one IP family.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FamilyVip {
    /// `IPv4` or `IPv6`.
    #[schemars(schema_with = "family_schema")]
    pub family: String,
    /// The address.
    #[schemars(schema_with = "ip_schema")]
    pub ip: String,
    /// The AddressPool it came from.
    pub address_pool: String,
}

/// What Juneau did for a Service. Written only by the controller.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceLoadBalancerStatus {
    /// The allocated external address: the first of `vips` (the Service's first IP
    /// family), kept for readers of one VIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "ip_schema")]
    pub vip: Option<String>,
    /// Every VIP the Service holds, one per IP family, in the order of its
    /// `spec.ipFamilies` (a dual-stack Service has two).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 2))]
    pub vips: Vec<FamilyVip>,
    /// The AddressPool the VIP (the first of `vips`) came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_pool: Option<String>,
    /// The ExternalNetwork the VIP belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_network: Option<String>,
    /// Nodes announcing the VIP as a /32 (exactly the nodes with a Ready local backend).
    #[serde(default)]
    pub advertising_nodes: Vec<String>,
    /// Ready endpoints.
    #[serde(default)]
    pub backend_summary: BackendSummary,
    /// `Pending`, `Ready` or `Failed`.
    #[serde(default)]
    pub phase: Phase,
    /// Standard conditions: `VIPAllocated`, `Supported`, `Advertised`, `Ready`, and
    /// `IPFamilies` on a Service that asks for IPv6 or two families.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The Service generation this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The load balancer Juneau runs for one Service. Created by the controller with the
/// Service's name and namespace and owned by the Service; do not edit.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "juneau.loutres.me",
    version = "v1alpha1",
    kind = "ServiceLoadBalancer",
    namespaced,
    shortname = "slb",
    category = "juneau",
    status = "ServiceLoadBalancerStatus",
    printcolumn = r#"{"name":"VIP","type":"string","jsonPath":".status.vip"}"#,
    printcolumn = r#"{"name":"VIPs","type":"string","priority":1,"jsonPath":".status.vips[*].ip"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Advertising nodes","type":"string","jsonPath":".status.advertisingNodes"}"#,
    printcolumn = r#"{"name":"Pool","type":"string","priority":1,"jsonPath":".status.addressPool"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ServiceLoadBalancerSpec {
    /// The Service this load balancer serves (same namespace and name).
    pub service_name: String,
    /// The ExternalNetwork named by the Service's annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_network: Option<String>,
    /// The VIP asked for with the requested-ip annotation, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_ip: Option<String>,
}

/// Reference to a key of a Secret in the namespace Juneau runs in (`juneau-system`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Secret name (in Juneau's own namespace, which is the only one the agent may read).
    pub name: String,
    /// Key inside the Secret (default `password`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// Graceful restart (RFC 4724) settings of a BGPPeer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GracefulRestart {
    /// Announce the graceful-restart capability.
    pub enabled: bool,
    /// Seconds the router keeps our routes while we restart (default 120, max 4095).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4095))]
    pub restart_time_seconds: Option<u16>,
}

/// A BGP session that every selected node opens to one upstream router.
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "juneau.loutres.me",
    version = "v1alpha1",
    kind = "BGPPeer",
    plural = "bgppeers",
    shortname = "bgpp",
    category = "juneau",
    printcolumn = r#"{"name":"Peer","type":"string","jsonPath":".spec.peerAddress"}"#,
    printcolumn = r#"{"name":"Peer ASN","type":"integer","jsonPath":".spec.peerASN"}"#,
    printcolumn = r#"{"name":"Local ASN","type":"integer","jsonPath":".spec.localASN"}"#,
    validation = kube::core::Rule::new("!has(self.spec.keepaliveTimeSeconds) || !has(self.spec.holdTimeSeconds) || self.spec.holdTimeSeconds == 0 || self.spec.keepaliveTimeSeconds < self.spec.holdTimeSeconds").message("keepaliveTimeSeconds must be below holdTimeSeconds"),
    validation = kube::core::Rule::new("!has(self.spec.holdTimeSeconds) || self.spec.holdTimeSeconds == 0 || self.spec.holdTimeSeconds >= 3").message("holdTimeSeconds must be 0 (no keepalives) or at least 3 (RFC 4271)"),
    validation = kube::core::Rule::new("!has(self.spec.sourceAddress) || !isIP(self.spec.sourceAddress) || !isIP(self.spec.peerAddress) || ip(self.spec.sourceAddress).family() == ip(self.spec.peerAddress).family()").message("sourceAddress must be of the family of peerAddress (both IPv4 or both IPv6)")
)]
#[serde(rename_all = "camelCase")]
pub struct BGPPeerSpec {
    /// The router's address, IPv4 or IPv6 (global or unique-local): the session runs
    /// over that family.
    #[schemars(schema_with = "peer_ip_schema")]
    pub peer_address: String,
    /// The router's AS number.
    #[serde(rename = "peerASN")]
    #[schemars(range(min = 1))]
    pub peer_asn: u32,
    /// The AS number the nodes speak as.
    #[serde(rename = "localASN")]
    #[schemars(range(min = 1))]
    pub local_asn: u32,
    /// TCP port of the router (default 179).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub peer_port: Option<u16>,
    /// Local source address of the session, of the peer address's family (default:
    /// chosen by the kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "opt_peer_ip_schema")]
    pub source_address: Option<String>,
    /// Nodes that open this session (default: every node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// Hold time proposed in OPEN (0, or 3..65535; default 90).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 65535))]
    pub hold_time_seconds: Option<u16>,
    /// Keepalive interval (default hold time / 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive_time_seconds: Option<u16>,
    /// Seconds between connection attempts (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub connect_retry_seconds: Option<u16>,
    /// TCP-MD5 (RFC 2385) password, read from a Secret (key default `password`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// TTL for an eBGP session to a router that is not directly connected (2..255).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 255))]
    pub ebgp_multihop: Option<u8>,
    /// Graceful restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graceful_restart: Option<GracefulRestart>,
    /// Wait for the router to connect; never dial out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passive: Option<bool>,
    /// Bidirectional Forwarding Detection (RFC 5880; single hop RFC 5881, or multihop RFC
    /// 5883 when ebgpMultihop > 1) on the path to the router: a path failure tears the
    /// session down within multiplier x interval instead of the hold time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bfd: Option<Bfd>,
    /// Graceful maintenance (RFC 8326): when one of the `triggers` holds for a node
    /// (default: its exclude-from-external-load-balancers label or its
    /// `juneau.loutres.me/maintenance: "true"` annotation; not a cordon), its VIPs are
    /// re-announced less preferred (GRACEFUL_SHUTDOWN community, LOCAL_PREF for iBGP,
    /// AS_PATH prepend for eBGP), then withdrawn after `drainSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<Maintenance>,
}

/// How a node in maintenance leaves this peer's path, and what puts it there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Maintenance {
    /// What puts a node in maintenance for this peer (any one of them); default: the
    /// node agent's `--maintenance-triggers` (the chart's `node.maintenanceTriggers`,
    /// `[ExcludeLabel, Annotation]`). `[]`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggers: Option<Vec<MaintenanceTrigger>>,
    /// Extra copies of the local AS prepended for eBGP (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 10))]
    pub as_path_prepend: Option<u8>,
    /// LOCAL_PREF sent to iBGP peers (default 0, as RFC 8326 suggests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_pref: Option<u32>,
    /// Seconds between the less-preferred announcement and the withdrawal (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_seconds: Option<u16>,
}

/// A Node signal that starts graceful maintenance (docs/bgp.md, "Graceful maintenance").
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum MaintenanceTrigger {
    /// `spec.unschedulable` (`kubectl cordon`, the first step of `kubectl drain`). Not a
    /// default: DaemonSets and many operators cordon without a reboot coming.
    Cordon,
    /// The `node.kubernetes.io/exclude-from-external-load-balancers` label. Without this
    /// trigger the label withdraws the node's VIPs at once.
    ExcludeLabel,
    /// The kubelet's graceful node shutdown: the Ready condition not True with "node is
    /// shutting down" in its message.
    NodeShutdown,
    /// The Node's `juneau.loutres.me/maintenance: "true"` annotation.
    Annotation,
}

impl MaintenanceTrigger {
    /// Every trigger, in declaration order.
    pub const ALL: [MaintenanceTrigger; 4] = [
        MaintenanceTrigger::Cordon,
        MaintenanceTrigger::ExcludeLabel,
        MaintenanceTrigger::NodeShutdown,
        MaintenanceTrigger::Annotation,
    ];
    /// The triggers of a BGPPeer that names none, and of the agent without
    /// `--maintenance-triggers`.
    pub const DEFAULT: [MaintenanceTrigger; 2] = [
        MaintenanceTrigger::ExcludeLabel,
        MaintenanceTrigger::Annotation,
    ];

    /// Its name in the API (and on the agent's command line).
    pub fn name(self) -> &'static str {
        match self {
            MaintenanceTrigger::Cordon => "Cordon",
            MaintenanceTrigger::ExcludeLabel => "ExcludeLabel",
            MaintenanceTrigger::NodeShutdown => "NodeShutdown",
            MaintenanceTrigger::Annotation => "Annotation",
        }
    }
}

impl std::str::FromStr for MaintenanceTrigger {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
                format!(
                    "unknown maintenance trigger {s:?} (one of {})",
                    names.join(", ")
                )
            })
    }
}

/// BFD timers of a BGPPeer (asynchronous mode).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bfd {
    /// Slowest interval at which the router's packets are wanted, ms (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 60000))]
    pub min_rx_ms: Option<u32>,
    /// Fastest interval at which we send, ms (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 60000))]
    pub min_tx_ms: Option<u32>,
    /// Missed packets before the path is declared down (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 255))]
    pub multiplier: Option<u8>,
    /// Authentication of the BFD packets (RFC 5880 6.7), both ways: the router must be
    /// configured with the same type, key ID and key. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authentication: Option<BfdAuthentication>,
}

/// BFD authentication of a BGPPeer. The agent checks it again (a bad value becomes a
/// warning and the peer runs without BFD, never with unauthenticated BFD), so the type
/// and key ID are kept loose here: an object the schema did not check still decodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BfdAuthentication {
    /// `keyedSHA1` (RFC 5880 6.7.3: the sequence number may repeat within a window) or
    /// `meticulousKeyedSHA1` (6.7.4: a new sequence number in every packet).
    #[serde(rename = "type")]
    #[schemars(schema_with = "bfd_auth_type_schema")]
    pub type_: String,
    /// Auth Key ID (0-255), the router's key ID for this key.
    #[serde(rename = "keyID")]
    #[schemars(range(min = 0, max = 255))]
    pub key_id: i64,
    /// The key (1 to 20 bytes), read from a Secret (key default `password`).
    pub secret_ref: SecretKeyRef,
}

/// `spec.bfd.authentication.type` values.
pub const BFD_AUTH_TYPES: [&str; 2] = ["keyedSHA1", "meticulousKeyedSHA1"];

fn bfd_auth_type_schema(_: &mut SchemaGenerator) -> Schema {
    string_schema(serde_json::json!({"enum": BFD_AUTH_TYPES}))
}

fn communities_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": 32,
        "items": {
            "type": "string",
            "maxLength": 11,
            "pattern": "^[0-9]{1,5}:[0-9]{1,5}$",
            "x-kubernetes-validations": [{
                "rule": "int(self.split(':')[0]) <= 65535 && int(self.split(':')[1]) <= 65535",
                "message": "a community is ASN:VALUE with both parts at most 65535, e.g. 64512:100"
            }]
        }
    })
}

fn large_communities_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": 32,
        "items": {
            "type": "string",
            "maxLength": 32,
            "pattern": "^[0-9]{1,10}:[0-9]{1,10}:[0-9]{1,10}$",
            "x-kubernetes-validations": [{
                "rule": "self.split(':').all(p, int(p) <= 4294967295)",
                "message": "a large community is GLOBAL:DATA1:DATA2 with each part at most 4294967295"
            }]
        }
    })
}

/// Which VIPs are announced to which peers, and with which attributes.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "juneau.loutres.me",
    version = "v1alpha1",
    kind = "BGPAdvertisement",
    plural = "bgpadvertisements",
    shortname = "bgpadv",
    category = "juneau",
    printcolumn = r#"{"name":"Pools","type":"string","jsonPath":".spec.addressPools"}"#,
    printcolumn = r#"{"name":"Local pref","type":"integer","jsonPath":".spec.localPref"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BGPAdvertisementSpec {
    /// AddressPools whose VIPs this applies to (empty: every pool).
    #[serde(default)]
    #[schemars(schema_with = "pool_names_schema")]
    pub address_pools: Vec<String>,
    /// Services (by label) whose VIPs this applies to (default: every Service of those
    /// pools). The most specific win: for a Service that some advertisement with a
    /// serviceSelector selects, the pool's advertisements without one do not apply
    /// (docs/k8s-sync.md, "Per-Service attributes").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<LabelSelector>,
    /// BGPPeers (by label) the VIPs are announced to (default: every peer of the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_selector: Option<LabelSelector>,
    /// Nodes this applies to (default: every node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// Standard communities `ASN:VALUE`.
    #[serde(default)]
    #[schemars(schema_with = "communities_schema")]
    pub communities: Vec<String>,
    /// Large communities `GLOBAL:DATA1:DATA2`.
    #[serde(default)]
    #[schemars(schema_with = "large_communities_schema")]
    pub large_communities: Vec<String>,
    /// LOCAL_PREF sent to iBGP peers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_pref: Option<u32>,
    /// Weighted ECMP: attach the BGP link-bandwidth extended community in proportion to
    /// each node's Ready local backends of the VIP (1 Gbit/s per backend), so a router
    /// that honours it (FRR: weighted ECMP by link bandwidth) spreads traffic per Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weighted_by_backends: Option<bool>,
}

/// The BGP sessions of one node as its speaker reports them. Created and written only by
/// the node's agent (server-side apply, field manager `juneau-agent`); do not edit.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "juneau.loutres.me",
    version = "v1alpha1",
    kind = "NodeBGPStatus",
    shortname = "nbs",
    category = "juneau",
    status = "NodeBGPStatusStatus",
    printcolumn = r#"{"name":"Established","type":"integer","jsonPath":".status.establishedSessions"}"#,
    printcolumn = r#"{"name":"Sessions","type":"integer","jsonPath":".status.sessions"}"#,
    printcolumn = r#"{"name":"Available","type":"string","jsonPath":".status.conditions[?(@.type==\"SpeakerStatusAvailable\")].status"}"#,
    printcolumn = r#"{"name":"Observed","type":"date","jsonPath":".status.observedTime"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeBGPStatusSpec {
    /// The node (also the object's name).
    pub node: String,
}

/// What the node's speaker reports, as its agent last read it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeBGPStatusStatus {
    /// When the sessions shown were read from the speaker's status file (RFC 3339). The
    /// status is rewritten only when something in it changes; uptime is now minus
    /// `establishedSince`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_time: Option<String>,
    /// The speaker's BGP identifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "routerID")]
    pub router_id: Option<String>,
    /// Generation of the node state the speaker last applied.
    #[serde(default)]
    pub state_generation: u64,
    /// Sessions configured on the speaker.
    #[serde(default)]
    pub sessions: u32,
    /// Sessions Established.
    #[serde(default)]
    pub established_sessions: u32,
    /// One entry per session, by peer name.
    #[serde(default)]
    pub peers: Vec<BGPSessionStatus>,
    /// VIPs the agent asks to announce that the speaker withholds, and why.
    #[serde(default)]
    pub held_back: Vec<HeldBackVip>,
    /// `SpeakerStatusAvailable`: False when the speaker's status file is missing or
    /// unreadable (the reason says which; `peers` then keeps what was last read).
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The token of the decommission request (`helm uninstall`) this node carried out:
    /// its speaker closed its sessions with a Cease, its dataplane detached and removed
    /// its pins, and its files in /run/juneau are gone. Written by the agent with its
    /// own field manager; the uninstall hook waits for it on every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decommissioned: Option<String>,
}

/// One BGP session of a node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BGPSessionStatus {
    /// The BGPPeer's name.
    pub name: String,
    /// The router's address.
    pub peer_address: String,
    /// Idle, Connect, Active, OpenSent, OpenConfirm or Established.
    pub state: String,
    /// Since when the session is Established (RFC 3339); uptime = now - this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub established_since: Option<String>,
    /// VIPs (/32) announced to the peer.
    #[serde(default)]
    pub prefixes_announced: u64,
    /// Prefixes the peer sent (discarded).
    #[serde(default)]
    pub prefixes_received: u64,
    /// Times an Established session went down.
    #[serde(default)]
    pub session_flaps: u64,
    /// Graceful restart negotiated.
    #[serde(default)]
    pub graceful_restart: bool,
    /// The last error (NOTIFICATION, connection failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// BFD on the path to the peer, when configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bfd: Option<BfdSessionStatus>,
}

/// BFD of one session.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BfdSessionStatus {
    /// AdminDown, Down, Init or Up.
    pub state: String,
    /// Negotiated detection time, once the peer is heard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detection_time_ms: Option<u64>,
    /// Times an Up session went down.
    #[serde(default)]
    pub down_events: u64,
    /// Why the session went down last, or could not be set up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnostic: Option<String>,
    /// Authentication in use (`keyed SHA1`, `meticulous keyed SHA1`); none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authentication: Option<String>,
    /// Packets discarded by authentication (A bit not as configured, another type or key
    /// ID, a replayed sequence number, a wrong digest).
    #[serde(default)]
    pub auth_failures: u64,
}

/// A VIP the speaker withholds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeldBackVip {
    /// The VIP.
    pub vip: String,
    /// Why (from the speaker).
    pub reason: String,
}

/// Every CRD of the group, in a stable order.
pub fn all_crds(
) -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use kube::CustomResourceExt;
    vec![
        AddressPool::crd(),
        ExternalNetwork::crd(),
        service_load_balancer_crd(),
        BGPPeer::crd(),
        BGPAdvertisement::crd(),
        NodeBGPStatus::crd(),
    ]
}

/// The ServiceLoadBalancer CRD **without** the status subresource the derive adds: the
/// controller alone writes the record, spec and status in one request (a new Service:
/// two API writes, not three; [`crate::records`]).
pub fn service_load_balancer_crd(
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = ServiceLoadBalancer::crd();
    for v in &mut crd.spec.versions {
        if let Some(sub) = v.subresources.as_mut() {
            sub.status = None;
        }
        if v.subresources.as_ref().is_some_and(|s| s.scale.is_none()) {
            v.subresources = None;
        }
    }
    crd
}

/// The CRDs as one multi-document YAML stream (what `crdgen` prints and `deploy/crds/`
/// holds).
pub fn crds_yaml() -> Result<String, serde_saphyr::SerializeError> {
    let mut out = String::from(
        "# Generated by `cargo run -p juneau-k8s-sync --bin crdgen`; do not edit by hand.\n",
    );
    for crd in all_crds() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_yaml_matches_committed() {
        let committed = include_str!("../../deploy/crds/juneau.loutres.me.yaml");
        let generated = crds_yaml().unwrap();
        assert!(
            committed == generated,
            "deploy/crds/juneau.loutres.me.yaml is stale: regenerate it with \
             `cargo run -p juneau-k8s-sync --bin crdgen > deploy/crds/juneau.loutres.me.yaml`"
        );
    }

    #[test]
    fn seed_objects_deserialize() {
        let pool: AddressPool = serde_saphyr::from_str(
            "apiVersion: juneau.loutres.me/v1alpha1\nkind: AddressPool\nmetadata: {name: public-v4}\nspec:\n  advertiseMode: bgp\n  addresses: [203.0.113.0/24]\n",
        )
        .unwrap();
        assert!(pool.spec.advertise_mode.is_bgp());
        let net: ExternalNetwork = serde_saphyr::from_str(
            "apiVersion: juneau.loutres.me/v1alpha1\nkind: ExternalNetwork\nmetadata: {name: public}\nspec:\n  type: bgp\n  addressPools: [public-v4]\n",
        )
        .unwrap();
        assert_eq!(net.spec.address_pools, vec!["public-v4"]);
    }

    #[test]
    fn schema_carries_validation() {
        let yaml = crds_yaml().unwrap();
        assert!(yaml.contains("isCIDR(self)"));
        assert!(
            yaml.contains(PEER_IP_RULE),
            "BGPPeer addresses: IPv4 or IPv6"
        );
        assert!(yaml.contains("sourceAddress must be of the family of peerAddress"));
        assert!(yaml.contains("isIP(self)"));
        assert!(yaml.contains("- Pending") || yaml.contains("Pending"));
        assert!(yaml.contains("subresources"));
    }

    #[test]
    fn the_record_has_no_status_subresource_and_the_other_kinds_keep_theirs() {
        let slb = service_load_balancer_crd();
        assert!(slb.spec.versions.iter().all(|v| v.subresources.is_none()));
        let schema = serde_json::to_value(&slb.spec.versions[0].schema).unwrap();
        assert!(
            schema
                .pointer("/openAPIV3Schema/properties/status/properties/vip")
                .is_some(),
            "the status stays in the schema: {schema}"
        );
        let pools = all_crds()
            .into_iter()
            .find(|c| c.spec.names.kind == "AddressPool")
            .unwrap();
        assert!(pools.spec.versions[0]
            .subresources
            .as_ref()
            .is_some_and(|s| s.status.is_some()));
    }
}
