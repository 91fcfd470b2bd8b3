//! The node's service table compiled for the packet path.
//!
//! Built (with allocation) from a `juneau_control::shm::Snapshot` each time the shared
//! state's generation changes — off the per-packet path, once per batch at most — and then
//! only read: frontend lookup by `(VIP, protocol, port)`, the VIP set, each service's
//! backends and Maglev slots.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::Ipv4Addr;

use juneau_control::model::{Frontend, LocalBackend, NodeState};

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
#[derive(Debug, Clone)]
pub struct Service {
    /// `VIP:port/protocol`.
    pub frontend: Frontend,
    /// Local Ready backends (sorted).
    pub backends: Vec<LocalBackend>,
    /// Maglev lookup table: entries index `backends` (anything else means none).
    pub maglev: Vec<u16>,
    /// Slot of `backends[0]` in the table's flat list of `(service, backend)` pairs;
    /// `backends[i]` has slot `first_slot + i`.
    pub first_slot: u32,
}

impl Service {
    /// The backend Maglev gives a flow hash.
    #[inline]
    pub fn pick(&self, flow_hash: u64) -> Option<LocalBackend> {
        if self.maglev.is_empty() {
            return None;
        }
        let slot = self.maglev[(flow_hash % self.maglev.len() as u64) as usize];
        self.backends.get(usize::from(slot)).copied()
    }

    /// The index in `backends` Maglev gives a flow hash.
    #[inline]
    pub fn pick_index(&self, flow_hash: u64) -> Option<usize> {
        if self.maglev.is_empty() {
            return None;
        }
        let slot = usize::from(self.maglev[(flow_hash % self.maglev.len() as u64) as usize]);
        (slot < self.backends.len()).then_some(slot)
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
        self.backends.binary_search(&b).ok()
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
}

impl ServiceTable {
    /// Builds the table from a node state and its Maglev tables (`maglev[i]` belongs to
    /// `state.services[i]`, as in `juneau_control::shm::Snapshot`).
    pub fn new(generation: u64, state: &NodeState, maglev: &[Vec<u16>]) -> Self {
        let mut t = ServiceTable {
            generation,
            ..Default::default()
        };
        for (i, s) in state.services.iter().enumerate() {
            let mut backends = s.backends.clone();
            backends.sort();
            backends.dedup();
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
                maglev: slots,
                first_slot,
            });
        }
        t
    }

    /// Builds the table from a snapshot of the shared control state.
    pub fn from_snapshot(s: &juneau_control::shm::Snapshot) -> Self {
        Self::new(s.generation, &s.state, &s.maglev)
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

    /// Number of `(service, backend)` slots.
    pub fn slot_count(&self) -> usize {
        self.slot_service.len()
    }

    /// All services, in index order.
    pub fn services(&self) -> &[Service] {
        &self.services
    }

    /// Every VIP served.
    pub fn vips(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.vips.iter().map(|&v| Ipv4Addr::from(v))
    }

    /// Every `(backend ip, backend port, protocol)` served, for the steering program.
    pub fn backend_keys(&self) -> HashSet<(Ipv4Addr, u16, u8)> {
        self.services
            .iter()
            .flat_map(|s| {
                s.backends
                    .iter()
                    .map(move |b| (b.ip, b.port, s.frontend.protocol.number()))
            })
            .collect()
    }
}
