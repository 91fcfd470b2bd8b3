//! The node's service table compiled for the packet path.
//!
//! Built (with allocation) from a `juneau_control::shm::Snapshot` each time the shared
//! state's generation changes — off the per-packet path, once per batch at most — and then
//! only read: frontend lookup by `(VIP, protocol, port)`, the VIP set, each service's
//! backends and Maglev slots.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::Ipv4Addr;

use juneau_control::model::{Frontend, LocalBackend, NodeState, Redirects, SourceRange};

/// A small multiplicative hasher for integer keys (FxHash-style); the keys it hashes are
/// not attacker-chosen beyond the service configuration.
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }
    fn write_u16(&mut self, i: u16) {
        self.write_u64(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}

/// `BuildHasher` for [`FastHasher`].
pub type FastBuild = BuildHasherDefault<FastHasher>;

/// One frontend with its local backends and Maglev slots.
///
/// `backends` holds the Ready backends (sorted) followed by the draining ones — `serving`
/// but `terminating` (sorted): existing flows to a draining backend are kept (flow
/// re-validation finds it), while the Maglev table only indexes the first `ready`
/// entries, so no new flow picks one.
#[derive(Debug, Clone)]
pub struct Service {
    /// `VIP:port/protocol`.
    pub frontend: Frontend,
    /// Local Ready backends (sorted), then local draining backends (sorted).
    pub backends: Vec<LocalBackend>,
    /// How many of `backends` are Ready (the rest are draining).
    pub ready: usize,
    /// Maglev lookup table: entries index `backends` (anything else means none).
    pub maglev: Vec<u16>,
    /// Slot of `backends[0]` in the table's flat list of `(service, backend)` pairs;
    /// `backends[i]` has slot `first_slot + i`.
    pub first_slot: u32,
    /// The client ranges the frontend admits (`loadBalancerSourceRanges`); empty: all.
    pub source_ranges: Vec<SourceRange>,
    /// `sessionAffinity: ClientIP`'s timeout in ms; `None`: per connection.
    pub client_ip_affinity_ms: Option<u64>,
    /// Without a Ready backend here, a new connection goes to a peer node that has one,
    /// not charged to the redirect buckets (`NodeService::hand_off`: the Cluster policy,
    /// or a shared VIP's port whose Pods are elsewhere).
    pub hand_off: bool,
    /// The backends are this node's own stack (`NodeService::host_network`): the
    /// steering program passes the frontend's packets to the kernel; none is forwarded
    /// here.
    pub host_network: bool,
}

impl Service {
    /// The backend Maglev gives a flow hash.
    #[inline]
    pub fn pick(&self, flow_hash: u64) -> Option<LocalBackend> {
        if self.maglev.is_empty() {
            return None;
        }
        let slot = self.maglev[(flow_hash % self.maglev.len() as u64) as usize];
        self.backends[..self.ready].get(usize::from(slot)).copied()
    }

    /// The index in `backends` Maglev gives a flow hash.
    #[inline]
    pub fn pick_index(&self, flow_hash: u64) -> Option<usize> {
        if self.maglev.is_empty() {
            return None;
        }
        let slot = usize::from(self.maglev[(flow_hash % self.maglev.len() as u64) as usize]);
        (slot < self.ready).then_some(slot)
    }

    /// Whether `ip:port` is still one of this service's backends.
    #[inline]
    pub fn has_backend(&self, ip: u32, port: u16) -> bool {
        self.backend_index(ip, port).is_some()
    }

    /// The index of backend `ip:port` in `backends`.
    #[inline]
    pub fn backend_index(&self, ip: u32, port: u16) -> Option<usize> {
        let b = LocalBackend {
            ip: Ipv4Addr::from(ip),
            port,
        };
        let (ready, draining) = self.backends.split_at(self.ready);
        ready
            .binary_search(&b)
            .ok()
            .or_else(|| draining.binary_search(&b).ok().map(|i| i + self.ready))
    }

    /// Whether the frontend admits a client at host-order address `src`.
    #[inline]
    pub fn admits(&self, src: u32) -> bool {
        juneau_control::model::admits(&self.source_ranges, src)
    }

    /// The Ready backends (the ones new flows go to).
    pub fn ready_backends(&self) -> &[LocalBackend] {
        &self.backends[..self.ready]
    }

    /// The draining backends (existing flows only).
    pub fn draining_backends(&self) -> &[LocalBackend] {
        &self.backends[self.ready..]
    }
}

/// Key of a frontend: VIP, protocol number, port.
pub type FrontendKey = (u32, u8, u16);

/// The compiled table.
#[derive(Debug, Clone, Default)]
pub struct ServiceTable {
    /// Generation of the shared state this was built from.
    pub generation: u64,
    services: Vec<Service>,
    by_frontend: HashMap<FrontendKey, u32, FastBuild>,
    vips: HashSet<u32, FastBuild>,
    /// The service of each `(service, backend)` slot.
    slot_service: Vec<u32>,
    /// What the agent published for redirects between nodes: this node's
    /// address and each VIP's peer nodes; the engine hands it to its redirector.
    redirects: Redirects,
    /// The IPv6 frontends (issue #28; the engine takes them into its IPv6 path).
    pub v6: crate::services6::Services6,
}

impl ServiceTable {
    /// Builds the table from a node state and its Maglev tables (`maglev[i]` belongs to
    /// `state.services[i]`, as in `juneau_control::shm::Snapshot`).
    pub fn new(generation: u64, state: &NodeState, maglev: &[Vec<u16>]) -> Self {
        let mut t = ServiceTable {
            generation,
            redirects: state.redirects.clone(),
            ..Default::default()
        };
        for (i, s) in state.services.iter().enumerate() {
            let mut backends = s.backends.clone();
            backends.sort();
            backends.dedup();
            let ready = backends.len();
            let mut draining: Vec<LocalBackend> = s
                .terminating
                .iter()
                .filter(|b| backends.binary_search(b).is_err())
                .copied()
                .collect();
            draining.sort();
            draining.dedup();
            backends.extend(draining);
            let slots = maglev.get(i).cloned().unwrap_or_default();
            let f = s.frontend;
            t.by_frontend
                .insert((u32::from(f.vip), f.protocol.number(), f.port), i as u32);
            t.vips.insert(u32::from(f.vip));
            let first_slot = t.slot_service.len() as u32;
            t.slot_service
                .extend(std::iter::repeat_n(i as u32, backends.len()));
            t.services.push(Service {
                frontend: f,
                backends,
                ready,
                maglev: slots,
                first_slot,
                source_ranges: s.source_ranges.clone(),
                client_ip_affinity_ms: s.client_ip_affinity.map(|t| u64::from(t) * 1000),
                hand_off: s.hand_off,
                host_network: s.host_network,
            });
        }
        t
    }

    /// Builds the table from a snapshot of the shared control state.
    pub fn from_snapshot(s: &juneau_control::shm::Snapshot) -> Self {
        let mut t = Self::new(s.generation, &s.state, &s.maglev);
        t.v6 =
            crate::services6::Services6::from_state(s.generation, &s.state.services6, &s.maglev6);
        t.v6.set_redirects(&s.state.redirects);
        t
    }

    /// The low 32 bits of the generation (what flow records remember).
    #[inline]
    pub fn generation32(&self) -> u32 {
        // Never `flow::UNCHECKED_GENERATION`, the mark of flows found at start.
        (self.generation as u32).min(crate::flow::UNCHECKED_GENERATION - 1)
    }

    /// Whether `ip` is a VIP served on this node (with or without backends).
    #[inline]
    pub fn is_vip(&self, ip: u32) -> bool {
        self.vips.contains(&ip)
    }

    /// The service for a frontend.
    #[inline]
    pub fn find(&self, vip: u32, proto: u8, port: u16) -> Option<u32> {
        self.by_frontend.get(&(vip, proto, port)).copied()
    }

    /// A service by index.
    #[inline]
    pub fn service(&self, i: u32) -> &Service {
        &self.services[i as usize]
    }

    /// The service of a `(service, backend)` slot.
    #[inline]
    pub fn slot_service(&self, slot: u32) -> u32 {
        self.slot_service.get(slot as usize).copied().unwrap_or(0)
    }

    /// Whether the backend of a `(service, backend)` slot takes new flows (Ready, not
    /// draining).
    pub fn slot_is_ready(&self, slot: u32) -> bool {
        let s = self.service(self.slot_service(slot));
        slot.checked_sub(s.first_slot)
            .is_some_and(|i| (i as usize) < s.ready)
    }

    /// Number of `(service, backend)` slots.
    pub fn slot_count(&self) -> usize {
        self.slot_service.len()
    }

    /// All services, in index order.
    pub fn services(&self) -> &[Service] {
        &self.services
    }

    /// The redirect address and per-VIP peer nodes the agent published.
    pub fn redirects(&self) -> &Redirects {
        &self.redirects
    }

    /// Every VIP served.
    pub fn vips(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.vips.iter().map(|&v| Ipv4Addr::from(v))
    }

    /// The VIPs with a backend new flows can go to (on any of their frontends): what
    /// juneau-bgp may announce. That is a Ready backend here, or, for a Cluster-policy
    /// frontend, a peer node to hand new connections to (and this node's redirect
    /// address known). A VIP steered here only for the flows it drains or for
    /// redirects between nodes is not among them: announced on its account, new
    /// connections would be dropped as `no_backend`.
    pub fn serving_vips(&self) -> Vec<Ipv4Addr> {
        // One pass over the peers (a scan per service is quadratic at 10 000 VIPs).
        let forwarding: HashSet<Ipv4Addr> = match self.redirects.node_address {
            Some(_) => self
                .redirects
                .vips
                .iter()
                .filter(|v| !v.nodes.is_empty())
                .map(|v| v.vip)
                .collect(),
            None => HashSet::new(),
        };
        let forwards = |vip: Ipv4Addr| forwarding.contains(&vip);
        let mut v: Vec<Ipv4Addr> = self
            .services
            .iter()
            .filter(|s| s.ready > 0 || (s.hand_off && forwards(s.frontend.vip)))
            .map(|s| s.frontend.vip)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Every `(backend ip, backend port, protocol)` served, for the steering program.
    /// (Host-network backends' replies come from the node's own stack, through no Pod
    /// interface: none of theirs.)
    pub fn backend_keys(&self) -> HashSet<(Ipv4Addr, u16, u8)> {
        self.services
            .iter()
            .filter(|s| !s.host_network)
            .flat_map(|s| {
                s.backends
                    .iter()
                    .map(move |b| (b.ip, b.port, s.frontend.protocol.number()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use juneau_control::model::{NodeService, Protocol};

    fn b(last: u8) -> LocalBackend {
        LocalBackend {
            ip: Ipv4Addr::new(10, 0, 0, last),
            port: 80,
        }
    }

    #[test]
    fn draining_backends_keep_flows_but_never_take_new_ones() {
        let frontend = Frontend {
            vip: Ipv4Addr::new(203, 0, 113, 1),
            protocol: Protocol::Tcp,
            port: 80,
        };
        let state = NodeState {
            services: vec![NodeService {
                frontend,
                backends: vec![b(3), b(1)],
                terminating: vec![b(2), b(1)],
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: false,
            }],
            ..Default::default()
        };
        let table = juneau_control::maglev::MaglevTable::new(&[b(1), b(3)], 13).unwrap();
        let t = ServiceTable::new(1, &state, &[table.slots().to_vec()]);
        let s = t.service(0);
        // b(1) is Ready, so it is not draining as well.
        assert_eq!(s.ready_backends(), &[b(1), b(3)]);
        assert_eq!(s.draining_backends(), &[b(2)]);
        assert_eq!(t.slot_count(), 3);
        assert_eq!(s.backend_index(u32::from(b(2).ip), 80), Some(2));
        assert_eq!(s.backend_index(u32::from(b(3).ip), 80), Some(1));
        assert_eq!(s.backend_index(u32::from(b(9).ip), 80), None);
        for h in 0..1000u64 {
            let i = s.pick_index(h).unwrap();
            assert!(i < 2, "hash {h} picked draining backend {i}");
            assert_ne!(s.pick(h), Some(b(2)));
        }
        // Replies from a draining backend are still steered to the dataplane.
        assert!(t.backend_keys().contains(&(b(2).ip, 80, 6)));

        // Only draining backends: the frontend stays, no new flow gets a backend.
        let state = NodeState {
            services: vec![NodeService {
                frontend,
                backends: vec![],
                terminating: vec![b(2)],
                source_ranges: Vec::new(),
                client_ip_affinity: None,
                hand_off: false,
                host_network: false,
            }],
            ..Default::default()
        };
        let t = ServiceTable::new(2, &state, &[vec![juneau_control::maglev::NO_BACKEND; 13]]);
        assert!(t.is_vip(u32::from(frontend.vip)));
        let s = t.service(0);
        assert_eq!(s.pick_index(7), None);
        assert_eq!(s.backend_index(u32::from(b(2).ip), 80), Some(0));
        // ...and its VIP is not one juneau-bgp may announce.
        assert!(t.serving_vips().is_empty());
    }

    #[test]
    fn only_vips_with_a_backend_for_new_flows_are_serving() {
        let b = |last: u8| LocalBackend {
            ip: Ipv4Addr::new(10, 0, 0, last),
            port: 8080,
        };
        let svc = |vip: u8, port: u16, backends: Vec<LocalBackend>| NodeService {
            frontend: Frontend {
                vip: Ipv4Addr::new(203, 0, 113, vip),
                protocol: Protocol::Tcp,
                port,
            },
            backends,
            terminating: vec![],
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
            host_network: false,
        };
        let state = NodeState {
            services: vec![
                svc(1, 80, vec![b(1)]),
                svc(1, 443, vec![]),
                svc(2, 80, vec![]),
                svc(3, 80, vec![b(2)]),
            ],
            ..Default::default()
        };
        let t = ServiceTable::new(1, &state, &[]);
        assert_eq!(t.vips().count(), 3);
        assert_eq!(
            t.serving_vips(),
            vec![Ipv4Addr::new(203, 0, 113, 1), Ipv4Addr::new(203, 0, 113, 3)]
        );
    }

    #[test]
    fn a_cluster_policy_vip_without_a_backend_here_serves_while_a_peer_has_one() {
        let vip = Ipv4Addr::new(203, 0, 113, 2);
        let mut svc = NodeService::new(
            Frontend {
                vip,
                protocol: Protocol::Tcp,
                port: 80,
            },
            vec![],
        );
        svc.hand_off = true;
        let peers = |nodes: Vec<Ipv4Addr>, me: Option<Ipv4Addr>| Redirects {
            node_address: me,
            vips: vec![juneau_control::model::VipRedirectPeers { vip, nodes }],
            vips6: Vec::new(),
            keys: Vec::new(),
        };
        let me = Some(Ipv4Addr::new(192, 0, 2, 1));
        let other = Ipv4Addr::new(192, 0, 2, 2);
        let table = |svc: &NodeService, redirects: Redirects| {
            let state = NodeState {
                services: vec![svc.clone()],
                redirects,
                ..Default::default()
            };
            ServiceTable::new(1, &state, &[]).serving_vips()
        };
        assert_eq!(table(&svc, peers(vec![other], me)), vec![vip]);
        assert!(
            table(&svc, peers(vec![], me)).is_empty(),
            "no node has a backend"
        );
        assert!(
            table(&svc, peers(vec![other], None)).is_empty(),
            "this node cannot hand connections on"
        );
        svc.hand_off = false;
        assert!(table(&svc, peers(vec![other], me)).is_empty(), "Local");
    }
}
