//! The types operators think in.
//!
//! A [`Frontend`] is what a client dials (`VIP:port/protocol`); a [`Backend`] is a Pod
//! endpoint behind it; a [`NodeState`] is everything one node's dataplane and BGP speaker
//! need to know, as published by that node's agent.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An external virtual IP handed out to a Service.
pub type Vip = Ipv4Addr;

/// The name of a Kubernetes Node.
pub type NodeName = String;

/// Transport protocols Juneau forwards (IPv4 only in the first release).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[repr(u8)]
pub enum Protocol {
    /// TCP, IP protocol number 6.
    Tcp = 6,
    /// UDP, IP protocol number 17.
    Udp = 17,
}

impl Protocol {
    /// The IPv4 protocol number.
    pub const fn number(self) -> u8 {
        self as u8
    }

    /// The protocol with this IPv4 protocol number, if Juneau forwards it.
    pub const fn from_number(n: u8) -> Option<Self> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

/// A protocol name Juneau cannot serve (e.g. `SCTP`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("protocol {0:?} is not supported (Juneau serves TCP and UDP)")]
pub struct UnsupportedProtocol(pub String);

impl FromStr for Protocol {
    type Err = UnsupportedProtocol;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_uppercase().as_str() {
            "TCP" => Ok(Protocol::Tcp),
            "UDP" => Ok(Protocol::Udp),
            _ => Err(UnsupportedProtocol(s.to_string())),
        }
    }
}

/// What a client connects to: `VIP:port` over a protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frontend {
    /// The Service's external IP.
    pub vip: Vip,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The Service port (`spec.ports[].port`).
    pub port: u16,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.protocol, self.vip, self.port)
    }
}

/// What a client dials on an IPv6 VIP: `[VIP]:port` over a protocol (issue 28).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frontend6 {
    /// The Service's external IPv6 address.
    pub vip: Ipv6Addr,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The Service port (`spec.ports[].port`).
    pub port: u16,
}

impl fmt::Display for Frontend6 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/[{}]:{}", self.protocol, self.vip, self.port)
    }
}

/// One port of a Service: `protocol/port -> targetPort`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ServicePort {
    /// The port's name in the Service, if any.
    pub name: Option<String>,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The port clients dial on the VIP.
    pub port: u16,
    /// The Pod port traffic is sent to (named ports are resolved per endpoint).
    pub target_port: u16,
}

/// The readiness of an endpoint, as EndpointSlices report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct EndpointConditions {
    /// The endpoint is ready to take new connections.
    pub ready: bool,
    /// The endpoint still serves (may be true while terminating).
    pub serving: bool,
    /// The endpoint's Pod is being deleted.
    pub terminating: bool,
}

impl EndpointConditions {
    /// Ready and not terminating: the only endpoints that make a node advertise a VIP or
    /// receive new flows.
    pub const fn takes_new_traffic(&self) -> bool {
        self.ready && !self.terminating
    }

    /// Listed but taking no new traffic — terminating, or not Ready, whatever `serving`
    /// says: the endpoint keeps the connections it has (graceful drain; kube-proxy keeps
    /// a connection's conntrack entry the same way) and gets no new one. A Pod that fails
    /// its readiness probe as it shuts down, as many do on SIGTERM, finishes its answers.
    pub const fn drains(&self) -> bool {
        !self.takes_new_traffic()
    }
}

/// A backend Pod endpoint of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Backend {
    /// The Pod IP.
    pub ip: Ipv4Addr,
    /// The Pod port for one Service port.
    pub port: u16,
    /// The node the Pod runs on (`None` when the EndpointSlice does not say).
    pub node: Option<NodeName>,
    /// Readiness.
    pub conditions: EndpointConditions,
}

/// A backend as the dataplane of its own node sees it: where to send packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalBackend {
    /// The Pod IP.
    pub ip: Ipv4Addr,
    /// The Pod port.
    pub port: u16,
}

impl fmt::Display for LocalBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.ip, self.port)
    }
}

/// An IPv6 backend as the dataplane of its own node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalBackend6 {
    /// The Pod's IPv6 address.
    pub ip: Ipv6Addr,
    /// The Pod port.
    pub port: u16,
}

impl fmt::Display for LocalBackend6 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}]:{}", self.ip, self.port)
    }
}

/// A range of client addresses a frontend admits (`loadBalancerSourceRanges`): a
/// network and a prefix length, the network's host bits zero (`10.1.2.3/8` is stored as
/// `10.0.0.0/8`, which is what Kubernetes and kube-proxy mean by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SourceRange {
    /// The network address (host bits zero).
    pub network: Ipv4Addr,
    /// The prefix length, 0..=32.
    pub prefix_len: u8,
}

/// A source range that is not an IPv4 CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadSourceRange {
    /// Not a CIDR at all.
    #[error("{0:?} is not a CIDR (like 192.0.2.0/24)")]
    NotACidr(String),
    /// An IPv6 range: it matches no IPv4 client.
    #[error("{0:?} is an IPv6 range; Juneau serves IPv4 clients only")]
    Ipv6(String),
}

impl SourceRange {
    /// The range `network/prefix_len`, its host bits cleared; `None` if `prefix_len > 32`.
    pub fn new(network: Ipv4Addr, prefix_len: u8) -> Option<Self> {
        let net = ipnet::Ipv4Net::new(network, prefix_len).ok()?.trunc();
        Some(SourceRange {
            network: net.network(),
            prefix_len,
        })
    }

    /// The netmask as a host-order word (`/0`: 0).
    pub fn mask(self) -> u32 {
        u32::MAX
            .checked_shl(32 - u32::from(self.prefix_len))
            .unwrap_or(0)
    }

    /// Whether the host-order address `ip` lies in the range.
    #[inline]
    pub fn contains(self, ip: u32) -> bool {
        ip & self.mask() == u32::from(self.network)
    }
}

impl FromStr for SourceRange {
    type Err = BadSourceRange;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        match t.parse::<ipnet::IpNet>() {
            Ok(ipnet::IpNet::V4(n)) => Ok(SourceRange {
                network: n.trunc().network(),
                prefix_len: n.prefix_len(),
            }),
            Ok(ipnet::IpNet::V6(_)) => Err(BadSourceRange::Ipv6(s.to_string())),
            // A bare address is a /32 (kube-proxy's validation asks for a CIDR; the
            // annotation's users write both).
            Err(_) => match t.parse::<Ipv4Addr>() {
                Ok(ip) => Ok(SourceRange {
                    network: ip,
                    prefix_len: 32,
                }),
                Err(_) if t.parse::<std::net::Ipv6Addr>().is_ok() => {
                    Err(BadSourceRange::Ipv6(s.to_string()))
                }
                Err(_) => Err(BadSourceRange::NotACidr(s.to_string())),
            },
        }
    }
}

impl fmt::Display for SourceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

/// Whether `ranges` admit the host-order client address `ip`: an empty list admits
/// every client (a Service without `loadBalancerSourceRanges`).
#[inline]
pub fn admits(ranges: &[SourceRange], ip: u32) -> bool {
    ranges.is_empty() || ranges.iter().any(|r| r.contains(ip))
}

/// One frontend served on a node, with the node's local Ready backends for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeService {
    /// `VIP:port/protocol`.
    pub frontend: Frontend,
    /// Local Ready, non-terminating backends, sorted: the only ones new flows go to (the
    /// Maglev table is built over these). Empty means: no new flow is accepted (and the
    /// VIP is not advertised on account of this frontend).
    pub backends: Vec<LocalBackend>,
    /// Local backends that are `serving` but `terminating` (graceful drain), sorted: flows
    /// already going to them keep going until they end or the endpoint disappears; no
    /// new flow picks them, and they never make the node advertise the VIP.
    #[serde(default)]
    pub terminating: Vec<LocalBackend>,
    /// The client ranges the frontend admits (`loadBalancerSourceRanges`), sorted; empty:
    /// every client. A packet from outside them is dropped (`source_range_denied`), and
    /// a flow whose client a new list leaves out ends at its next packet.
    #[serde(default)]
    pub source_ranges: Vec<SourceRange>,
    /// `sessionAffinity: ClientIP` with its `timeoutSeconds` (1..=86400): a client's new
    /// connections go to the backend its earlier ones went to. `None`: per connection.
    #[serde(default)]
    pub client_ip_affinity: Option<u32>,
    /// A new TCP connection that finds no Ready backend here goes to a node that has
    /// one, over the node-to-node channel, and that node answers the client directly:
    /// `externalTrafficPolicy: Cluster` (the VIP is announced by nodes without a local
    /// backend too, while another node has one), or a port of a shared VIP this node
    /// announces for another Service. `false`: served from local backends only.
    #[serde(default)]
    pub hand_off: bool,
    /// The backends are this node's own stack (host-network Pods on the node's address,
    /// e.g. an ingress controller): the steering program passes the frontend's packets to
    /// the kernel, whose DNAT to the backend (and conntrack's reverse NAT of the replies)
    /// the dataplane programs, instead of forwarding them through userspace.
    #[serde(default)]
    pub host_network: bool,
}

impl NodeService {
    /// A frontend with these Ready backends, none draining, open to every client.
    pub fn new(frontend: Frontend, backends: Vec<LocalBackend>) -> Self {
        NodeService {
            frontend,
            backends,
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
            host_network: false,
        }
    }
}

/// One IPv6 frontend served on a node, with the node's local Ready IPv6 backends for
/// it: the fields mean what [`NodeService`]'s do (`hand_off`: the Cluster policy, new
/// flows without a Ready backend here handed to a peer of the IPv6 VIP in
/// [`Redirects::vips6`]). There is no `host_network` yet: an IPv6 host-network backend is
/// not served (the agent logs it and counts it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeService6 {
    /// `[VIP]:port/protocol`.
    pub frontend: Frontend6,
    /// Local Ready, non-terminating backends, sorted (the Maglev table is built over
    /// these).
    pub backends: Vec<LocalBackend6>,
    /// Local serving-but-terminating backends, sorted: existing flows only.
    #[serde(default)]
    pub terminating: Vec<LocalBackend6>,
    /// The IPv6 client ranges the frontend admits (the IPv6 entries of
    /// `loadBalancerSourceRanges`; host bits zero), sorted; empty: every client.
    #[serde(default)]
    pub source_ranges: Vec<ipnet::Ipv6Net>,
    /// `sessionAffinity: ClientIP` with its `timeoutSeconds`; `None`: per connection.
    #[serde(default)]
    pub client_ip_affinity: Option<u32>,
    /// New connections without a Ready backend here are handed to a peer (the Cluster
    /// policy), as [`NodeService::hand_off`].
    #[serde(default)]
    pub hand_off: bool,
}

impl NodeService6 {
    /// A frontend with these Ready backends, none draining, open to every client.
    pub fn new(frontend: Frontend6, backends: Vec<LocalBackend6>) -> Self {
        NodeService6 {
            frontend,
            backends,
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
        }
    }
}

/// Whether `ranges` admit the IPv6 client `ip`: an empty list admits every client.
#[inline]
pub fn admits6(ranges: &[ipnet::Ipv6Net], ip: Ipv6Addr) -> bool {
    ranges.is_empty() || ranges.iter().any(|r| r.contains(&ip))
}

/// A VIP this node must announce as a /32 (IPv4) or a /128 (IPv6), with the path
/// attributes to announce it with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertisedVip {
    /// The VIP, IPv4 or IPv6 (its frontends are in [`NodeState::services`] or
    /// [`NodeState::services6`]).
    pub vip: IpAddr,
    /// Standard communities (RFC 1997), as `asn << 16 | value`.
    pub communities: Vec<u32>,
    /// Large communities (RFC 8092).
    pub large_communities: Vec<[u32; 3]>,
    /// LOCAL_PREF for iBGP peers.
    pub local_pref: Option<u32>,
    /// Indexes into [`NodeState::peers`] of the peers this VIP goes to; empty means all.
    pub peers: Vec<u16>,
    /// Weighted ECMP: this node's Ready local backends of the VIP, announced as the BGP
    /// link-bandwidth extended community so routers can spread traffic per Pod; `None`:
    /// not requested by the BGPAdvertisement.
    pub weight: Option<u32>,
}

/// How this node's BGP speaker talks to one upstream router.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerConfig {
    /// Operator-facing name (the BGPPeer object's name).
    pub name: String,
    /// The router's address, IPv4 or IPv6 (the session runs over that family).
    pub peer_address: IpAddr,
    /// The router's AS number.
    pub peer_asn: u32,
    /// This node's AS number.
    pub local_asn: u32,
    /// TCP port of the peer (179 unless told otherwise).
    pub peer_port: u16,
    /// Local address to bind to, of the peer address's family; also the next hop
    /// announced for routes of that family. `None`: chosen by the kernel.
    pub source_address: Option<IpAddr>,
    /// Proposed hold time in seconds (0 or >= 3).
    pub hold_time: u16,
    /// Keepalive interval in seconds (0: hold_time / 3).
    pub keepalive_time: u16,
    /// Seconds between connection attempts.
    pub connect_retry_time: u16,
    /// TTL for eBGP multihop; `None` means directly connected (TTL 1 for eBGP).
    pub ebgp_multihop: Option<u8>,
    /// Graceful restart (RFC 4724) restart time in seconds; `None` disables it.
    pub graceful_restart_time: Option<u16>,
    /// TCP-MD5 password (RFC 2385), at most 80 bytes. Redacted in `Debug`, never
    /// serialized (it reaches the speaker through the 0600 node-state file only).
    #[serde(skip_serializing, default)]
    pub md5_password: Option<crate::secret::Secret>,
    /// Only accept connections, never connect.
    pub passive: bool,
    /// Bidirectional Forwarding Detection (RFC 5880) on the path to the peer; `None`
    /// disables it.
    pub bfd: Option<BfdSettings>,
    /// BFD authentication (RFC 5880 6.7) of the session `bfd` asks for; `None`: packets
    /// unauthenticated. Never serialized (the key is a [`crate::secret::Secret`]; it
    /// reaches juneau-bfd through the 0600 node-state file only).
    #[serde(skip_serializing, default)]
    pub bfd_auth: Option<BfdAuth>,
    /// Graceful maintenance in progress (the node is cordoned): announce with less
    /// preference, then withdraw. `None`: normal operation.
    pub drain: Option<DrainSettings>,
}

/// How a node leaves a peer's path when it goes into maintenance (RFC 8326).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DrainSettings {
    /// Extra copies of our AS prepended to the AS_PATH (eBGP) while draining.
    pub as_path_prepend: u8,
    /// LOCAL_PREF sent to iBGP peers while draining (RFC 8326 suggests 0).
    pub local_pref: u32,
    /// Seconds between the less-preferred re-announcement and the withdrawal.
    pub wait_seconds: u16,
}

impl Default for DrainSettings {
    /// Two extra AS hops, LOCAL_PREF 0, withdraw after 30 s.
    fn default() -> Self {
        DrainSettings {
            as_path_prepend: 2,
            local_pref: 0,
            wait_seconds: 30,
        }
    }
}

/// BFD timers of one peer (asynchronous mode). The session is declared down when no
/// packet arrived for `multiplier` x the negotiated receive interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BfdSettings {
    /// Slowest rate at which we want the peer's packets (ms).
    pub min_rx_ms: u32,
    /// Fastest rate at which we want to send (ms).
    pub min_tx_ms: u32,
    /// Detection multiplier (>= 1).
    pub multiplier: u8,
}

impl Default for BfdSettings {
    /// 300 ms x 3: a dead path is declared down within about 0.9 s.
    fn default() -> Self {
        BfdSettings {
            min_rx_ms: 300,
            min_tx_ms: 300,
            multiplier: 3,
        }
    }
}

/// BFD authentication types (RFC 5880 4.1): the two SHA1 ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BfdAuthType {
    /// Keyed SHA1 (type 4).
    KeyedSha1,
    /// Meticulous Keyed SHA1 (type 5): a new sequence number in every packet.
    MeticulousKeyedSha1,
}

/// Longest BFD Keyed SHA1 key (RFC 5880 4.4).
pub const BFD_KEY_MAX_BYTES: usize = 20;

/// A peer's BFD authentication. No `Serialize` (it holds the key): `Debug` shows the key
/// as `<redacted>`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BfdAuth {
    /// Keyed or meticulous keyed SHA1.
    pub auth_type: BfdAuthType,
    /// Auth Key ID sent and required.
    pub key_id: u8,
    /// The key, 1 to [`BFD_KEY_MAX_BYTES`] bytes.
    pub key: crate::secret::Secret,
}

impl PeerConfig {
    /// A peer with the usual defaults (port 179, hold 90 s, keepalive 30 s, retry 5 s).
    pub fn new(
        name: impl Into<String>,
        peer_address: impl Into<IpAddr>,
        peer_asn: u32,
        local_asn: u32,
    ) -> Self {
        PeerConfig {
            name: name.into(),
            peer_address: peer_address.into(),
            peer_asn,
            local_asn,
            peer_port: 179,
            source_address: None,
            hold_time: 90,
            keepalive_time: 30,
            connect_retry_time: 5,
            ebgp_multihop: None,
            graceful_restart_time: None,
            md5_password: None,
            passive: false,
            bfd: None,
            bfd_auth: None,
            drain: None,
        }
    }
}

/// Everything one node's dataplane and BGP speaker need: published by the node agent
/// through [`crate::shm`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeState {
    /// The node this state is for.
    pub node: NodeName,
    /// BGP router ID of this node (usually its address on the peering link).
    pub router_id: Option<Ipv4Addr>,
    /// Frontends served here, sorted by frontend.
    pub services: Vec<NodeService>,
    /// IPv6 frontends served here, sorted by frontend (issue 28).
    #[serde(default)]
    pub services6: Vec<NodeService6>,
    /// VIPs to announce, sorted by VIP.
    pub advertised: Vec<AdvertisedVip>,
    /// BGP peers of this node.
    pub peers: Vec<PeerConfig>,
    /// Redirects between nodes: this node's address on the node network and,
    /// per VIP, the other nodes that hold connections of it.
    #[serde(default)]
    pub redirects: Redirects,
}

/// Where packets of connections another node holds are sent: published by the
/// node agent from the Nodes' addresses and the EndpointSlices, read by the dataplane.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Redirects {
    /// This node's redirect address: where the other nodes send it packets and notices
    /// (the Node's InternalIP, or its `juneau.loutres.me/redirect-address` annotation).
    /// `None`: not known (no usable address); the dataplane then takes no redirects from
    /// the state.
    pub node_address: Option<Ipv4Addr>,
    /// Per VIP served here, sorted by VIP: the other nodes with a serving endpoint of it.
    pub vips: Vec<VipRedirectPeers>,
    /// The same per IPv6 VIP (issue 28): the nodes are their IPv4 redirect addresses (the
    /// channel between nodes is IPv4 whatever the VIP's family).
    #[serde(default)]
    pub vips6: Vec<VipRedirectPeers6>,
    /// The redirect channel's MAC keys, from the Secret
    /// `juneau-redirect-key`: at most [`MAX_REDIRECT_KEYS`], the one to send with
    /// (`current`) first, then the one being rotated in (`next`). Empty: no key, the
    /// channel runs unauthenticated (wire version 2, cookie only). Never serialized (like
    /// every secret of the model: it reaches the dataplane through the 0600 node-state
    /// file only).
    #[serde(skip)]
    pub keys: Vec<RedirectKey>,
}

/// Most redirect MAC keys in force at once (`current` and `next`).
pub const MAX_REDIRECT_KEYS: usize = 2;

/// One MAC key of the redirect channel and its 1-byte id (carried in wire version 3's
/// header, so a receiver knows which key a tag is under).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedirectKey {
    /// The key id: derived from the key ([`RedirectKey::new`]), so every node gives the
    /// same key the same id, and a key keeps its id when it moves from `next` to
    /// `current`.
    pub id: u8,
    /// The key (SipHash-2-4, 128 bits).
    pub key: crate::secret::SecretKey,
}

impl RedirectKey {
    /// A key with its derived id: the first byte of SipHash-2-4-128, under the key, of a
    /// fixed label (two keys may share an id: a receiver then tries both).
    pub fn new(key: crate::secret::SecretKey) -> Self {
        let id = siphasher::sip128::SipHasher24::new_with_key(key.expose())
            .hash(b"juneau redirect key id")
            .as_bytes()[0];
        RedirectKey { id, key }
    }
}

/// The nodes asked about a VIP's connections this node does not hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VipRedirectPeers {
    /// The VIP.
    pub vip: Vip,
    /// Redirect addresses of the other nodes with a Ready or serving-but-terminating
    /// (draining) endpoint of the VIP's Service (under the Cluster policy: every node
    /// that may announce it), sorted, without this node. A node is listed once, and once
    /// more per Ready endpoint of the VIP it has: its weight for the new connections a
    /// node without a backend hands on (at most `shm::MAX_REDIRECT_NODES_PER_VIP`
    /// entries; the agent scales weights down to fit). A list without repeats (no weights)
    /// spreads those connections evenly over the nodes.
    pub nodes: Vec<Ipv4Addr>,
}

/// The nodes asked about an IPv6 VIP's connections this node does not hold: as
/// [`VipRedirectPeers`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VipRedirectPeers6 {
    /// The IPv6 VIP.
    pub vip: Ipv6Addr,
    /// Redirect addresses (IPv4) of the other nodes, as [`VipRedirectPeers::nodes`].
    pub nodes: Vec<Ipv4Addr>,
}

impl Redirects {
    /// The peers published for the IPv6 VIP `vip` (empty when none).
    pub fn peers_of6(&self, vip: Ipv6Addr) -> &[Ipv4Addr] {
        self.vips6
            .binary_search_by_key(&vip, |v| v.vip)
            .map(|i| self.vips6[i].nodes.as_slice())
            .unwrap_or(&[])
    }

    /// The peers published for `vip` (empty when none).
    pub fn peers_of(&self, vip: Vip) -> &[Ipv4Addr] {
        self.vips
            .binary_search_by_key(&vip, |v| v.vip)
            .map(|i| self.vips[i].nodes.as_slice())
            .unwrap_or(&[])
    }

    /// The peers published for `vip`, each once, with its weight (its repeats in
    /// [`VipRedirectPeers::nodes`]: its Ready endpoints of the VIP).
    pub fn weighted_peers_of(&self, vip: Vip) -> Vec<(Ipv4Addr, u32)> {
        let mut out: Vec<(Ipv4Addr, u32)> = Vec::new();
        for n in self.peers_of(vip) {
            match out.last_mut() {
                Some((a, w)) if a == n => *w += 1,
                _ => out.push((*n, 0)),
            }
        }
        out
    }
}

impl NodeState {
    /// Sorts every list so two equal states compare equal and publish identical bytes.
    pub fn normalize(&mut self) {
        for s in &mut self.services {
            s.backends.sort();
            s.backends.dedup();
            s.terminating.sort();
            s.terminating.dedup();
            // A backend that takes new flows is not draining.
            let ready = &s.backends;
            s.terminating.retain(|b| ready.binary_search(b).is_err());
            s.source_ranges.sort();
            s.source_ranges.dedup();
        }
        self.services.sort_by_key(|s| s.frontend);
        for s in &mut self.services6 {
            s.backends.sort();
            s.backends.dedup();
            s.terminating.sort();
            s.terminating.dedup();
            let ready = &s.backends;
            s.terminating.retain(|b| ready.binary_search(b).is_err());
            s.source_ranges.sort();
            s.source_ranges.dedup();
        }
        self.services6.sort_by_key(|s| s.frontend);
        self.advertised.sort_by_key(|a| a.vip);
        for v in &mut self.redirects.vips {
            // Repeats are weights (kept).
            v.nodes.sort();
        }
        self.redirects.vips.sort_by_key(|v| v.vip);
        self.redirects.vips.dedup_by_key(|v| v.vip);
        for v in &mut self.redirects.vips6 {
            v.nodes.sort();
        }
        self.redirects.vips6.sort_by_key(|v| v.vip);
        self.redirects.vips6.dedup_by_key(|v| v.vip);
    }

    /// The service for a frontend, if this node serves it.
    pub fn service(&self, frontend: &Frontend) -> Option<&NodeService> {
        self.services
            .binary_search_by_key(frontend, |s| s.frontend)
            .ok()
            .map(|i| &self.services[i])
    }

    /// The IPv6 service for a frontend, if this node serves it.
    pub fn service6(&self, frontend: &Frontend6) -> Option<&NodeService6> {
        self.services6
            .binary_search_by_key(frontend, |s| s.frontend)
            .ok()
            .map(|i| &self.services6[i])
    }
}

#[cfg(test)]
mod source_range_tests {
    use super::*;

    #[test]
    fn source_ranges_parse_as_kubernetes_means_them() {
        let r: SourceRange = "10.1.2.3/8".parse().unwrap();
        assert_eq!(r.to_string(), "10.0.0.0/8");
        assert!(r.contains(u32::from(Ipv4Addr::new(10, 200, 0, 1))));
        assert!(!r.contains(u32::from(Ipv4Addr::new(11, 0, 0, 1))));
        let host: SourceRange = " 192.0.2.7 ".parse().unwrap();
        assert_eq!(host.to_string(), "192.0.2.7/32");
        assert!(host.contains(u32::from(Ipv4Addr::new(192, 0, 2, 7))));
        assert!(!host.contains(u32::from(Ipv4Addr::new(192, 0, 2, 8))));
        let all: SourceRange = "0.0.0.0/0".parse().unwrap();
        assert_eq!(all.mask(), 0);
        assert!(all.contains(u32::MAX));
        assert!(matches!(
            "2001:db8::/32".parse::<SourceRange>(),
            Err(BadSourceRange::Ipv6(_))
        ));
        assert!(matches!(
            "2001:db8::1".parse::<SourceRange>(),
            Err(BadSourceRange::Ipv6(_))
        ));
        for bad in ["", "10.0.0.0/33", "10.0.0/8", "ten/8", "10.0.0.0/-1"] {
            assert!(
                matches!(bad.parse::<SourceRange>(), Err(BadSourceRange::NotACidr(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn ipv6_ranges_admit_their_own_clients_and_no_ranges_every_client() {
        let ip = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        assert!(admits6(&[], ip("2001:db8::1")));
        let ranges: Vec<ipnet::Ipv6Net> = vec!["2001:db8:c11e::/48".parse().unwrap()];
        assert!(admits6(&ranges, ip("2001:db8:c11e:ffff::1")));
        assert!(!admits6(&ranges, ip("2001:db8:c11f::1")));
        assert_eq!(
            Frontend6 {
                vip: ip("2001:db8::1"),
                protocol: Protocol::Tcp,
                port: 80
            }
            .to_string(),
            "TCP/[2001:db8::1]:80"
        );
    }

    #[test]
    fn no_ranges_admit_every_client_and_a_list_only_its_own() {
        let ip = |a: [u8; 4]| u32::from(Ipv4Addr::from(a));
        assert!(admits(&[], ip([203, 0, 113, 9])));
        let ranges: Vec<SourceRange> = ["198.51.100.0/24", "192.0.2.7/32"]
            .iter()
            .map(|r| r.parse().unwrap())
            .collect();
        assert!(admits(&ranges, ip([198, 51, 100, 42])));
        assert!(admits(&ranges, ip([192, 0, 2, 7])));
        assert!(!admits(&ranges, ip([192, 0, 2, 8])));
        assert!(!admits(&ranges, ip([198, 51, 101, 1])));
    }
}
