//! The flow table: which backend each connection was given, found from either direction.
//!
//! Fixed capacity, chosen at start; nothing on the packet path allocates. Layout:
//! - `flows`: one 32-byte [`Flow`] record per connection (client, VIP, backend, ports,
//!   protocol, TCP state, service index, the service-table generation it was last checked
//!   against, expiry);
//! - `index`: an open-addressing hash index (linear probing, backward-shift deletion, no
//!   tombstones) holding two 8-byte slots per flow — the forward key
//!   `(client, VIP, client port, VIP port, proto)` and the reverse key
//!   `(backend, client, backend port, client port, proto)` — sized to the next power of
//!   two ≥ 4 × capacity so the load factor stays ≤ 0.5;
//! - `free`: a stack of free record numbers (4 bytes per flow).
//!
//! That is 32 + 4 + 32 = **68 bytes per flow** when the capacity is a power of two (up to
//! 100 bytes otherwise, from rounding the index up): 1 Mi flows take 68 MiB.
//!
//! Timeouts follow the TCP state ([`Timeouts`]); expiry is checked on every lookup, and
//! [`FlowTable::sweep`] evicts a bounded number of records per call from a rotating
//! cursor, so eviction never stalls the packet path.

use crate::packet::{tcp_flags, IPPROTO_TCP};

/// Idle timeouts per connection state, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Timeouts {
    /// TCP after the client's SYN, until the backend answers.
    pub tcp_syn_ms: u32,
    /// TCP once both sides have spoken.
    pub tcp_established_ms: u32,
    /// TCP after a FIN in either direction.
    pub tcp_fin_ms: u32,
    /// TCP after a RST in either direction.
    pub tcp_rst_ms: u32,
    /// UDP, refreshed by every packet in either direction.
    pub udp_ms: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            tcp_syn_ms: 30_000,
            tcp_established_ms: 900_000,
            tcp_fin_ms: 30_000,
            tcp_rst_ms: 10_000,
            udp_ms: 60_000,
        }
    }
}

/// Connection state of a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FlowState {
    /// Free record.
    Free = 0,
    /// TCP: only the client's SYN seen.
    SynSent = 1,
    /// TCP: the backend answered / picked up mid-stream.
    Established = 2,
    /// TCP: a FIN was seen.
    Closing = 3,
    /// TCP: a RST was seen.
    Reset = 4,
    /// UDP.
    Udp = 5,
}

/// Which of the flow's two keys matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client -> VIP (the forward key).
    Forward = 0,
    /// Backend -> client (the reverse key).
    Reverse = 1,
}

/// A 5-tuple as it appears in a packet (host byte order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// Source address.
    pub src: u32,
    /// Destination address.
    pub dst: u32,
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// IP protocol.
    pub proto: u8,
}

/// A 5-tuple as a frame's bytes hold it: addresses and ports in network order, loaded
/// as little-endian words straight from the frame (bytes 26..34 and 34..38 of an
/// IHL-5 IPv4 frame), so the fast path needs no byte swaps to hash it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawKey {
    /// Source then destination address bytes.
    pub addrs: u64,
    /// Source then destination port bytes.
    pub ports: u32,
    /// IP protocol.
    pub proto: u8,
}

impl RawKey {
    /// The raw form of a key.
    #[inline(always)]
    pub fn from_key(k: &FlowKey) -> Self {
        let sb = k.src.to_be_bytes();
        let db = k.dst.to_be_bytes();
        let pb = k.src_port.to_be_bytes();
        let qb = k.dst_port.to_be_bytes();
        RawKey {
            addrs: u64::from_le_bytes([sb[0], sb[1], sb[2], sb[3], db[0], db[1], db[2], db[3]]),
            ports: u32::from_le_bytes([pb[0], pb[1], qb[0], qb[1]]),
            proto: k.proto,
        }
    }
}

/// One connection: 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Flow {
    /// Client address.
    pub client: u32,
    /// VIP.
    pub vip: u32,
    /// Backend Pod address.
    pub backend: u32,
    /// Client port.
    pub client_port: u16,
    /// VIP port.
    pub vip_port: u16,
    /// Backend port.
    pub backend_port: u16,
    /// IP protocol.
    pub proto: u8,
    /// [`FlowState`] as u8.
    state: u8,
    /// The flow's `(service, backend)` slot in the service table of generation
    /// `checked_generation` ([`crate::services::ServiceTable::slot_service`]).
    pub slot: u32,
    /// The (low 32 bits of the) service-table generation this flow was last checked
    /// against; when it differs from the current one, the flow is re-validated.
    pub checked_generation: u32,
    /// Expiry time, milliseconds (wrapping u32 clock).
    expires: u32,
}

const _: () = assert!(std::mem::size_of::<Flow>() == 32);

impl Flow {
    /// A new flow record.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: u32,
        client_port: u16,
        vip: u32,
        vip_port: u16,
        backend: u32,
        backend_port: u16,
        proto: u8,
        slot: u32,
        generation: u32,
    ) -> Self {
        Flow {
            client,
            vip,
            backend,
            client_port,
            vip_port,
            backend_port,
            proto,
            state: FlowState::Free as u8,
            slot,
            checked_generation: generation,
            expires: 0,
        }
    }

    /// The connection state.
    pub fn state(&self) -> FlowState {
        match self.state {
            1 => FlowState::SynSent,
            2 => FlowState::Established,
            3 => FlowState::Closing,
            4 => FlowState::Reset,
            5 => FlowState::Udp,
            _ => FlowState::Free,
        }
    }

    #[inline(always)]
    fn key(&self, dir: Direction) -> FlowKey {
        match dir {
            Direction::Forward => FlowKey {
                src: self.client,
                dst: self.vip,
                src_port: self.client_port,
                dst_port: self.vip_port,
                proto: self.proto,
            },
            Direction::Reverse => FlowKey {
                src: self.backend,
                dst: self.client,
                src_port: self.backend_port,
                dst_port: self.client_port,
                proto: self.proto,
            },
        }
    }

    fn expired(&self, now: u32) -> bool {
        (self.expires.wrapping_sub(now) as i32) <= 0
    }
}

/// The result of inserting a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    /// Every record is in use by a live flow.
    #[error("flow table full")]
    Full,
}

/// Handle to a flow record.
pub type FlowId = u32;

/// The fixed-capacity flow table.
#[derive(Debug)]
pub struct FlowTable {
    flows: Vec<Flow>,
    index: Vec<u64>,
    mask: usize,
    free: Vec<u32>,
    seed: u64,
    /// Second seed word (derived from `seed`), never zero.
    seed2: u64,
    sweep_cursor: usize,
    timeouts: Timeouts,
    live: usize,
}

#[inline]
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// A 64-bit hash of a 5-tuple with a seed (also used as the Maglev flow hash, with a
/// different seed).
#[inline]
pub fn hash_key(k: &FlowKey, seed: u64) -> u64 {
    let a = (u64::from(k.src) << 32) | u64::from(k.dst);
    let b = (u64::from(k.src_port) << 32) | (u64::from(k.dst_port) << 16) | u64::from(k.proto);
    fmix64(
        fmix64(a ^ seed)
            .wrapping_add(b)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15),
    )
}

/// `madvise(MADV_HUGEPAGE)` over the 2 MiB-aligned interior of a vector's buffer
/// (transparent huge pages in `madvise` mode). Best effort: failure changes nothing but
/// speed.
fn advise_huge_pages<T>(v: &Vec<T>) {
    const HUGE: usize = 2 << 20;
    let start = v.as_ptr() as usize;
    let end = start + v.capacity() * std::mem::size_of::<T>();
    let (a, b) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if b > a {
        // SAFETY: madvise(2) on a range inside an allocation we own; MADV_HUGEPAGE only
        // changes how the kernel backs the pages, never their contents or validity.
        unsafe {
            libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
        }
    }
}

impl FlowTable {
    /// A table for `capacity` flows (at least 1). Allocates everything now.
    pub fn new(capacity: usize, timeouts: Timeouts, seed: u64) -> Self {
        let capacity = capacity.clamp(1, (u32::MAX / 4) as usize);
        let slots = (capacity * 4).next_power_of_two();
        // Ask for huge pages before the memory is touched: random lookups over tens of MiB
        // otherwise pay a TLB miss (a costly nested page walk in a VM) on every access.
        let mut flows = Vec::with_capacity(capacity);
        advise_huge_pages(&flows);
        flows.resize(capacity, Flow::new(0, 0, 0, 0, 0, 0, 0, 0, 0));
        let mut index: Vec<u64> = Vec::with_capacity(slots);
        advise_huge_pages(&index);
        index.resize(slots, 0);
        FlowTable {
            flows,
            index,
            mask: slots - 1,
            free: (0..capacity as u32).rev().collect(),
            seed,
            seed2: fmix64(seed ^ 0x243f_6a88_85a3_08d3) | 1 << 63,
            sweep_cursor: 0,
            timeouts,
            live: 0,
        }
    }

    /// Bytes of memory the table holds (records, index and free stack).
    pub fn memory_bytes(&self) -> usize {
        self.flows.capacity() * std::mem::size_of::<Flow>()
            + self.index.len() * 8
            + self.free.capacity() * 4
    }

    /// Maximum number of flows.
    pub fn capacity(&self) -> usize {
        self.flows.len()
    }

    /// Flows currently held (some may have expired and not been swept yet).
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no flow is held.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The timeouts in force.
    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// The index hash: one 64×64→128-bit multiply of the seeded key halves, high and
    /// low halves folded (wyhash's "mum"). A dozen instructions instead of two rounds of
    /// `fmix64`; with the random per-process seed an attacker still cannot aim keys at
    /// one index slot. (The Maglev choice uses [`hash_key`], unchanged: it must be the
    /// same on every node and across versions.)
    #[inline(always)]
    fn hash32(&self, k: &FlowKey) -> u32 {
        self.hash_raw(&RawKey::from_key(k))
    }

    #[inline(always)]
    fn hash_raw(&self, r: &RawKey) -> u32 {
        let a = r.addrs ^ self.seed;
        let b = (u64::from(r.ports) | (u64::from(r.proto) << 32)) ^ self.seed2;
        let m = u128::from(a).wrapping_mul(u128::from(b));
        let h = (m as u64) ^ ((m >> 64) as u64);
        (h ^ (h >> 32)) as u32
    }

    #[inline]
    fn slot_flow(slot: u64) -> (u32, Direction) {
        let low = (slot as u32) - 1;
        (
            low >> 1,
            if low & 1 == 0 {
                Direction::Forward
            } else {
                Direction::Reverse
            },
        )
    }

    #[inline]
    fn make_slot(hash: u32, id: u32, dir: Direction) -> u64 {
        (u64::from(hash) << 32) | u64::from(id * 2 + dir as u32 + 1)
    }

    /// The index hash of a key (for [`FlowTable::warm`]).
    #[inline]
    pub fn key_hash(&self, k: &FlowKey) -> u32 {
        self.hash32(k)
    }

    /// Pulls the index slots and flow records of a batch of keys (given by
    /// [`FlowTable::key_hash`]) into the cache before the batch is processed. Two tight
    /// loops of independent loads let the CPU overlap the cache misses of the whole batch
    /// instead of paying them one packet at a time; with large tables (≥ 100 k flows)
    /// these misses dominate the per-packet cost. Returns a value only to keep the loads.
    pub fn warm(&self, hashes: &[u32]) -> u64 {
        let mut acc = 0u64;
        let mut slots = [0u64; 64];
        for (s, &h) in slots.iter_mut().zip(hashes) {
            *s = self.index[h as usize & self.mask];
            acc ^= *s;
        }
        for (&s, &h) in slots.iter().zip(hashes) {
            if s != 0 && (s >> 32) as u32 == h {
                let (id, _) = Self::slot_flow(s);
                acc ^= u64::from(self.flows[id as usize].expires);
            }
        }
        acc
    }

    /// Finds the flow a packet belongs to, in either direction. An expired flow is
    /// removed and reported as absent.
    #[inline(always)]
    pub fn lookup(&mut self, k: &FlowKey, now_ms: u64) -> Option<(FlowId, Direction)> {
        let h = self.hash32(k);
        let mut i = h as usize & self.mask;
        loop {
            let slot = self.index[i];
            if slot == 0 {
                return None;
            }
            if (slot >> 32) as u32 == h {
                let (id, dir) = Self::slot_flow(slot);
                let f = &self.flows[id as usize];
                if f.key(dir) == *k {
                    if f.expired(now_ms as u32) {
                        self.remove_expired(id);
                        return None;
                    }
                    return Some((id, dir));
                }
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The established-flow look-up of the fast path: the live flow whose key for
    /// direction `dir` is `k`, comparing packed words of the record. `None` on a miss, a
    /// hit in the other direction or an expired flow — the general [`FlowTable::lookup`]
    /// then decides (and removes the expired flow); this one changes nothing.
    #[inline(always)]
    pub fn find_live(&self, k: &RawKey, dir: Direction, now_ms: u64) -> Option<FlowId> {
        let h = self.hash_raw(k);
        let want_dir = dir as u32;
        // Host-order packings matching the record's field pairs (see below).
        let ka = k.addrs.swap_bytes().rotate_left(32);
        let kb = k.ports.swap_bytes().rotate_left(16);
        let mut i = h as usize & self.mask;
        loop {
            let slot = *self.index.get(i)?;
            if slot == 0 {
                return None;
            }
            let low = (slot as u32).wrapping_sub(1);
            if (slot >> 32) as u32 == h {
                if low & 1 != want_dir {
                    // A key of the other direction with the same tag: let the general
                    // look-up decide (it may be this very key: a conflict).
                    return None;
                }
                let id = low >> 1;
                let f = self.flows.get(id as usize)?;
                let (fa, fb) = match dir {
                    Direction::Forward => (
                        (u64::from(f.vip) << 32) | u64::from(f.client),
                        (u32::from(f.vip_port) << 16) | u32::from(f.client_port),
                    ),
                    Direction::Reverse => (
                        (u64::from(f.client) << 32) | u64::from(f.backend),
                        (u32::from(f.client_port) << 16) | u32::from(f.backend_port),
                    ),
                };
                if fa == ka && fb == kb && f.proto == k.proto {
                    return (!f.expired(now_ms as u32)).then_some(id);
                }
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The record of a flow.
    #[inline]
    pub fn get(&self, id: FlowId) -> &Flow {
        &self.flows[id as usize]
    }

    /// The record of a flow, mutable (for re-validation bookkeeping).
    pub fn get_mut(&mut self, id: FlowId) -> &mut Flow {
        &mut self.flows[id as usize]
    }

    /// Inserts a new flow (the caller looked it up first and found nothing). When the
    /// table is full, a bounded sweep tries to free an expired record first.
    pub fn insert(
        &mut self,
        mut flow: Flow,
        tcp_flags: u8,
        now_ms: u64,
    ) -> Result<FlowId, InsertError> {
        if self.free.is_empty() {
            self.sweep(now_ms, 256);
        }
        let Some(id) = self.free.pop() else {
            return Err(InsertError::Full);
        };
        flow.state = if flow.proto == IPPROTO_TCP {
            if tcp_flags & tcp_flags::RST != 0 {
                FlowState::Reset
            } else if tcp_flags & tcp_flags::FIN != 0 {
                FlowState::Closing
            } else if tcp_flags & tcp_flags::SYN != 0 && tcp_flags & tcp_flags::ACK == 0 {
                FlowState::SynSent
            } else {
                // Picked up mid-stream (e.g. after a restart): Maglev gave the same backend.
                FlowState::Established
            }
        } else {
            FlowState::Udp
        } as u8;
        flow.expires = (now_ms as u32).wrapping_add(self.timeout_of(flow.state()));
        self.flows[id as usize] = flow;
        for dir in [Direction::Forward, Direction::Reverse] {
            let h = self.hash32(&flow.key(dir));
            let mut i = h as usize & self.mask;
            while self.index[i] != 0 {
                i = (i + 1) & self.mask;
            }
            self.index[i] = Self::make_slot(h, id, dir);
        }
        self.live += 1;
        Ok(id)
    }

    fn timeout_of(&self, s: FlowState) -> u32 {
        match s {
            FlowState::SynSent => self.timeouts.tcp_syn_ms,
            FlowState::Established => self.timeouts.tcp_established_ms,
            FlowState::Closing => self.timeouts.tcp_fin_ms,
            FlowState::Reset => self.timeouts.tcp_rst_ms,
            FlowState::Udp | FlowState::Free => self.timeouts.udp_ms,
        }
    }

    /// [`FlowTable::touch`] for the fast path: a UDP flow (`TCP == false`, checked
    /// against the record) only has its expiry pushed out (its state is always `Udp`);
    /// TCP takes the full state machine.
    #[inline(always)]
    pub fn touch_fast<const TCP: bool>(
        &mut self,
        id: FlowId,
        dir: Direction,
        tcp_flags: u8,
        now_ms: u64,
    ) {
        if !TCP {
            let udp_ms = self.timeouts.udp_ms;
            if let Some(f) = self.flows.get_mut(id as usize) {
                if f.proto != IPPROTO_TCP {
                    f.expires = (now_ms as u32).wrapping_add(udp_ms);
                    return;
                }
            }
        }
        self.touch(id, dir, tcp_flags, now_ms);
    }

    /// Records a packet of a flow: advances the TCP state and pushes the expiry out.
    #[inline(always)]
    pub fn touch(&mut self, id: FlowId, dir: Direction, tcp_flags: u8, now_ms: u64) {
        let f = &mut self.flows[id as usize];
        let state = f.state();
        let next = if f.proto != IPPROTO_TCP {
            FlowState::Udp
        } else if tcp_flags & tcp_flags::RST != 0 {
            FlowState::Reset
        } else if tcp_flags & tcp_flags::FIN != 0 {
            FlowState::Closing
        } else {
            match (state, dir) {
                // A fresh SYN re-using a closed 5-tuple starts over (same backend).
                (FlowState::Closing | FlowState::Reset, Direction::Forward)
                    if tcp_flags & tcp_flags::SYN != 0 && tcp_flags & tcp_flags::ACK == 0 =>
                {
                    FlowState::SynSent
                }
                (FlowState::SynSent, Direction::Reverse) => FlowState::Established,
                (s, _) => s,
            }
        };
        f.state = next as u8;
        let t = self.timeout_of(next);
        self.flows[id as usize].expires = (now_ms as u32).wrapping_add(t);
    }

    fn find_slot(&self, id: FlowId, dir: Direction) -> Option<usize> {
        let h = self.hash32(&self.flows[id as usize].key(dir));
        let want = Self::make_slot(h, id, dir);
        let mut i = h as usize & self.mask;
        loop {
            let slot = self.index[i];
            if slot == 0 {
                return None;
            }
            if slot == want {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    fn delete_slot(&mut self, mut hole: usize) {
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let slot = self.index[j];
            if slot == 0 {
                break;
            }
            let home = (slot >> 32) as usize & self.mask;
            // Leave `slot` where it is if its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.index[hole] = slot;
                hole = j;
            }
        }
        self.index[hole] = 0;
    }

    #[cold]
    fn remove_expired(&mut self, id: FlowId) {
        self.remove(id);
    }

    /// Removes a flow (both keys) and frees its record.
    pub fn remove(&mut self, id: FlowId) {
        if self.flows[id as usize].state == FlowState::Free as u8 {
            return;
        }
        for dir in [Direction::Forward, Direction::Reverse] {
            if let Some(i) = self.find_slot(id, dir) {
                self.delete_slot(i);
            }
        }
        self.flows[id as usize].state = FlowState::Free as u8;
        self.free.push(id);
        self.live -= 1;
    }

    /// Examines up to `budget` records from a rotating cursor and removes the expired
    /// ones. Returns how many were removed. Call it once per loop iteration.
    pub fn sweep(&mut self, now_ms: u64, budget: usize) -> usize {
        let now = now_ms as u32;
        let n = self.flows.len();
        let mut removed = 0;
        for _ in 0..budget.min(n) {
            let id = self.sweep_cursor;
            self.sweep_cursor = if id + 1 == n { 0 } else { id + 1 };
            let f = &self.flows[id];
            if f.state != FlowState::Free as u8 && f.expired(now) {
                self.remove(id as u32);
                removed += 1;
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::IPPROTO_UDP;
    use proptest::prelude::*;

    fn flow(client: u32, cport: u16, backend: u32) -> Flow {
        Flow::new(
            client,
            cport,
            0xcb00710a,
            80,
            backend,
            8080,
            IPPROTO_TCP,
            0,
            1,
        )
    }

    fn fwd(f: &Flow) -> FlowKey {
        f.key(Direction::Forward)
    }
    fn rev(f: &Flow) -> FlowKey {
        f.key(Direction::Reverse)
    }

    #[test]
    fn insert_lookup_both_directions_and_remove() {
        let mut t = FlowTable::new(16, Timeouts::default(), 7);
        let f = flow(0xc0000201, 40000, 0x0a010005);
        let id = t.insert(f, tcp_flags::SYN, 0).unwrap();
        assert_eq!(t.lookup(&fwd(&f), 1), Some((id, Direction::Forward)));
        assert_eq!(t.lookup(&rev(&f), 1), Some((id, Direction::Reverse)));
        assert_eq!(t.get(id).state(), FlowState::SynSent);
        t.remove(id);
        assert_eq!(t.lookup(&fwd(&f), 1), None);
        assert_eq!(t.lookup(&rev(&f), 1), None);
        assert!(t.is_empty());
    }

    #[test]
    fn tcp_state_timeouts() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(16, to, 1);
        let f = flow(1, 1, 2);
        let id = t.insert(f, tcp_flags::SYN, 0).unwrap();
        // Unanswered SYN expires after the SYN timeout.
        assert!(t.lookup(&fwd(&f), u64::from(to.tcp_syn_ms) - 1).is_some());
        assert!(t.lookup(&fwd(&f), u64::from(to.tcp_syn_ms) + 1).is_none());
        // Answered: established timeout.
        let id2 = t.insert(f, tcp_flags::SYN, 100).unwrap();
        t.touch(
            id2,
            Direction::Reverse,
            tcp_flags::SYN | tcp_flags::ACK,
            200,
        );
        assert_eq!(t.get(id2).state(), FlowState::Established);
        assert!(t
            .lookup(&fwd(&f), 200 + u64::from(to.tcp_syn_ms) + 5)
            .is_some());
        // FIN: short timeout.
        t.touch(
            id2,
            Direction::Forward,
            tcp_flags::FIN | tcp_flags::ACK,
            1000,
        );
        assert_eq!(t.get(id2).state(), FlowState::Closing);
        assert!(t
            .lookup(&fwd(&f), 1000 + u64::from(to.tcp_fin_ms) + 1)
            .is_none());
        let _ = id;
        // RST.
        let id3 = t.insert(f, tcp_flags::ACK, 5000).unwrap();
        assert_eq!(t.get(id3).state(), FlowState::Established);
        t.touch(id3, Direction::Reverse, tcp_flags::RST, 6000);
        assert_eq!(t.get(id3).state(), FlowState::Reset);
        assert!(t
            .lookup(&rev(&f), 6000 + u64::from(to.tcp_rst_ms) + 1)
            .is_none());
    }

    #[test]
    fn udp_timeout_refreshed_by_traffic() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(4, to, 1);
        let f = Flow::new(1, 1, 2, 53, 3, 5353, IPPROTO_UDP, 0, 0);
        let id = t.insert(f, 0, 0).unwrap();
        t.touch(id, Direction::Reverse, 0, u64::from(to.udp_ms) - 10);
        assert!(t
            .lookup(&f.key(Direction::Forward), u64::from(to.udp_ms) + 10)
            .is_some());
        assert!(t
            .lookup(&f.key(Direction::Forward), 2 * u64::from(to.udp_ms))
            .is_none());
    }

    #[test]
    fn full_table_evicts_expired_or_refuses() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(2, to, 1);
        t.insert(flow(1, 1, 9), tcp_flags::SYN, 0).unwrap();
        t.insert(flow(2, 1, 9), tcp_flags::SYN, 0).unwrap();
        assert_eq!(
            t.insert(flow(3, 1, 9), tcp_flags::SYN, 1),
            Err(InsertError::Full)
        );
        // Once the SYN flows expired, insert evicts them itself.
        let id = t
            .insert(flow(3, 1, 9), tcp_flags::SYN, u64::from(to.tcp_syn_ms) + 1)
            .unwrap();
        assert_eq!(
            t.lookup(&fwd(&flow(3, 1, 9)), u64::from(to.tcp_syn_ms) + 2)
                .map(|x| x.0),
            Some(id)
        );
    }

    #[test]
    fn sweep_is_bounded_and_removes_expired() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(1000, to, 3);
        for i in 0..1000 {
            t.insert(flow(i, 7, 9), tcp_flags::SYN, 0).unwrap();
        }
        let later = u64::from(to.tcp_syn_ms) + 1;
        assert_eq!(t.sweep(later, 100), 100);
        assert_eq!(t.len(), 900);
        let mut total = 100;
        for _ in 0..20 {
            total += t.sweep(later, 100);
        }
        assert_eq!(total, 1000);
        assert!(t.is_empty());
    }

    #[test]
    fn warming_reads_only() {
        let mut t = FlowTable::new(64, Timeouts::default(), 9);
        let f = flow(1, 2, 3);
        let id = t.insert(f, tcp_flags::SYN, 0).unwrap();
        let hashes: Vec<u32> = [fwd(&f), rev(&f), fwd(&flow(9, 9, 9))]
            .iter()
            .map(|k| t.key_hash(k))
            .collect();
        let _ = t.warm(&hashes);
        let _ = t.warm(&[]);
        assert_eq!(t.lookup(&fwd(&f), 1), Some((id, Direction::Forward)));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn clock_wraps() {
        let mut t = FlowTable::new(4, Timeouts::default(), 1);
        let start = u64::from(u32::MAX) - 1000;
        let f = flow(1, 1, 2);
        t.insert(f, tcp_flags::ACK, start).unwrap();
        assert!(t.lookup(&fwd(&f), start + 5000).is_some());
    }

    #[test]
    fn one_million_flows_fit() {
        let n = 1 << 20;
        let mut t = FlowTable::new(n, Timeouts::default(), 42);
        assert_eq!(t.memory_bytes(), n * 68);
        for i in 0..n as u32 {
            let f = Flow::new(
                i,
                (i % 60000) as u16,
                0xcb00710a,
                443,
                0x0a000000 | (i & 0xff),
                8443,
                IPPROTO_TCP,
                0,
                0,
            );
            t.insert(f, tcp_flags::SYN, 0).unwrap();
        }
        assert_eq!(t.len(), n);
        for i in (0..n as u32).step_by(997) {
            let f = Flow::new(
                i,
                (i % 60000) as u16,
                0xcb00710a,
                443,
                0x0a000000 | (i & 0xff),
                8443,
                IPPROTO_TCP,
                0,
                0,
            );
            assert!(t.lookup(&f.key(Direction::Reverse), 1).is_some());
        }
    }

    proptest! {
        /// The table agrees with a HashMap model under random inserts and removals.
        #[test]
        fn matches_a_model(ops in prop::collection::vec((0u32..64, prop::bool::ANY), 1..400)) {
            let mut t = FlowTable::new(64, Timeouts::default(), 5);
            let mut model: std::collections::HashMap<u32, FlowId> = Default::default();
            for (c, ins) in ops {
                // Small key space with colliding structure to exercise probing.
                let f = flow(c % 8, (c / 8) as u16, 100 + c % 3);
                if ins {
                    if let std::collections::hash_map::Entry::Vacant(e) = model.entry(c) {
                        e.insert(t.insert(f, tcp_flags::ACK, 0).unwrap());
                    }
                } else if let Some(id) = model.remove(&c) {
                    t.remove(id);
                }
                for (&c2, &id2) in &model {
                    let f2 = flow(c2 % 8, (c2 / 8) as u16, 100 + c2 % 3);
                    prop_assert_eq!(t.lookup(&fwd(&f2), 1), Some((id2, Direction::Forward)));
                    prop_assert_eq!(t.lookup(&rev(&f2), 1), Some((id2, Direction::Reverse)));
                }
                prop_assert_eq!(t.len(), model.len());
            }
        }
    }
}
