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
//!   two ≥ 4 × capacity so the load factor stays ≤ 0.5; no key sits more than
//!   [`MAX_PROBE`] slots from its home;
//! - `meta`: a 64-byte header ([`FlowMeta`]: magic, layout version, sizes, hash seeds,
//!   and the sequence word that is odd while index slots move);
//! - private to the process: a stack of free record numbers, one bit per record that
//!   holds a flow ([`crate::occupied::Occupied`]: the sweep skips free stretches), and the
//!   half-open queue.
//!
//! Records, index and header live either on the heap ([`FlowTable::new`]) or in the
//! mmap of pinned `BPF_F_MMAPABLE` array maps ([`FlowTable::open_shared`]): the XDP
//! steering program reads them to tell a Pod's reply of a held flow from the Pod's own
//! traffic, and they outlive the process, so a restarted dataplane finds its flows
//! again. This process is the only writer; it orders its stores so that a concurrent
//! reader sees either no entry or a complete one (docs/dataplane.md, "Flow table").
//!
//! Timeouts follow the TCP state ([`Timeouts`]) on the `CLOCK_MONOTONIC` millisecond
//! clock ([`crate::region::monotonic_ms`]); expiry is checked on every lookup, and
//! [`FlowTable::sweep`] evicts a bounded number of records per call from a rotating
//! cursor, so eviction never stalls the packet path. Half-open TCP flows (only the
//! client's SYN, or SYN and SYN-ACK, seen) are bounded separately and evicted first,
//! oldest first, so a SYN flood never displaces an established flow.

use std::collections::VecDeque;

use crate::proto::{tcp_flags, IPPROTO_TCP};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};

use crate::occupied::Occupied;
use crate::region::{release_store_u32, release_store_u64, Region};

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
            tcp_syn_ms: 5_000,
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
    Established = crate::abi::STATE_ESTABLISHED,
    /// TCP: a FIN was seen.
    Closing = 3,
    /// TCP: a RST was seen.
    Reset = 4,
    /// UDP.
    Udp = crate::abi::STATE_UDP,
    /// TCP: the backend answered the SYN (SYN-ACK); still half-open until the client's
    /// ACK.
    SynReceived = 6,
    /// Not served here: a redirect record. The flow's packets go to the node
    /// in `backend` (its address on the node network, `backend_port` 0), which said it
    /// owns the flow; see [`FlowTable::insert_redirect`].
    Redirect = 7,
}

impl FlowState {
    /// The state a record's byte holds (unknown values read as free).
    #[inline(always)]
    pub fn from_u8(v: u8) -> Self {
        match v {
            1 => FlowState::SynSent,
            2 => FlowState::Established,
            3 => FlowState::Closing,
            4 => FlowState::Reset,
            5 => FlowState::Udp,
            6 => FlowState::SynReceived,
            7 => FlowState::Redirect,
            _ => FlowState::Free,
        }
    }

    /// The state after a packet with `tcp_flags` in direction `dir` of a flow of
    /// protocol `proto` in this state (see [`FlowTable::touch`]).
    #[inline(always)]
    pub fn next(self, proto: u8, dir: Direction, tcp_flags: u8) -> Self {
        let syn = tcp_flags & tcp_flags::SYN != 0;
        let ack = tcp_flags & tcp_flags::ACK != 0;
        if self == FlowState::Redirect {
            FlowState::Redirect
        } else if proto != IPPROTO_TCP {
            FlowState::Udp
        } else if tcp_flags & tcp_flags::RST != 0 {
            FlowState::Reset
        } else if tcp_flags & tcp_flags::FIN != 0 {
            FlowState::Closing
        } else {
            match (self, dir) {
                // A fresh SYN re-using a closed 5-tuple starts over (same backend).
                (FlowState::Closing | FlowState::Reset, Direction::Forward) if syn && !ack => {
                    FlowState::SynSent
                }
                (FlowState::SynSent, Direction::Reverse) if syn && ack => FlowState::SynReceived,
                (FlowState::SynReceived, Direction::Forward) if ack && !syn => {
                    FlowState::Established
                }
                (s, _) => s,
            }
        }
    }

    /// Half-open TCP: no completed handshake yet.
    pub fn is_half_open(self) -> bool {
        matches!(self, FlowState::SynSent | FlowState::SynReceived)
    }
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
    /// The key in host byte order.
    pub fn to_key(&self) -> FlowKey {
        let a = self.addrs.to_le_bytes();
        let p = self.ports.to_le_bytes();
        FlowKey {
            src: u32::from_be_bytes([a[0], a[1], a[2], a[3]]),
            dst: u32::from_be_bytes([a[4], a[5], a[6], a[7]]),
            src_port: u16::from_be_bytes([p[0], p[1]]),
            dst_port: u16::from_be_bytes([p[2], p[3]]),
            proto: self.proto,
        }
    }

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
    /// Expiry time, `CLOCK_MONOTONIC` milliseconds (wrapping u32 clock).
    expires: u32,
}

/// The shared table's header (one 64-byte value of the `flow_meta` map; `struct
/// flow_meta` in `bpf/steer.c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct FlowMeta {
    /// [`FLOW_MAGIC`] once the table is initialised (written last).
    pub magic: u64,
    /// [`LAYOUT_VERSION`] of the records and index.
    pub layout: u32,
    /// Records.
    pub capacity: u32,
    /// Index slots (a power of two).
    pub index_slots: u32,
    /// Odd while this process moves index slots (readers then treat a miss as unsure).
    pub seq: u32,
    /// Index hash seed.
    pub seed: u64,
    /// Second index hash seed word.
    pub seed2: u64,
    /// Tables in the group (one per forwarding worker), all in the same maps.
    pub workers: u32,
    /// This table's number in the group (its part of the maps).
    pub table: u32,
    /// Unused, zero.
    pub reserved: [u64; 2],
}

const _: () = assert!(std::mem::size_of::<FlowMeta>() == crate::abi::FLOW_META_BYTES);

impl FlowMeta {
    /// An uninitialised header (no table).
    pub const EMPTY: FlowMeta = FlowMeta {
        magic: 0,
        layout: 0,
        capacity: 0,
        index_slots: 0,
        seq: 0,
        seed: 0,
        seed2: 0,
        workers: 0,
        table: 0,
        reserved: [0; 2],
    };
}

/// Marks an initialised shared table ([`crate::abi::FLOW_MAGIC`]).
pub const FLOW_MAGIC: u64 = crate::abi::FLOW_MAGIC;
/// Version of the shared layout ([`crate::abi::FLOW_LAYOUT_VERSION`]: bump it there).
pub const LAYOUT_VERSION: u32 = crate::abi::FLOW_LAYOUT_VERSION;
/// No key is stored further than this many slots from its home slot (the XDP program's
/// probe bound).
pub const MAX_PROBE: usize = crate::abi::MAX_PROBE;
/// `checked_generation` of a flow found in a pinned table at start: never equal to a
/// service-table generation ([`crate::services::ServiceTable::generation32`]), so every
/// such flow is re-validated against the new process's table on its next packet.
pub const UNCHECKED_GENERATION: u32 = u32::MAX;

/// Most flow tables in a group (forwarding workers).
pub const MAX_WORKERS: usize = crate::abi::MAX_WORKERS;
/// Most records per table: a [`FlowId`] of another worker's table carries the table in
/// its top bits.
pub const MAX_TABLE_CAPACITY: usize = (1 << PEER_SHIFT) - 1;
/// Attempts of a look-up in another worker's table while that worker moves index slots.
const PEER_RETRIES: usize = 32;
/// Spins of such a look-up waiting for the owner to finish moving slots.
const PEER_WAITS: usize = 4096;
/// Set in a [`FlowId`] of a record in another worker's table.
const REMOTE: u32 = 1 << 31;
const PEER_SHIFT: u32 = 27;
const LOCAL_MASK: u32 = (1 << PEER_SHIFT) - 1;

/// The three shared regions of a pinned flow table (of a whole group: `meta` has one
/// header per table, `index` and `records` are the tables' parts back to back).
#[derive(Debug)]
pub struct SharedRegions {
    /// The `flow_meta` map (one value).
    pub meta: Region<FlowMeta>,
    /// The `flow_index` map.
    pub index: Region<u64>,
    /// The `flow_records` map.
    pub records: Region<Flow>,
}

/// What [`FlowTable::open_shared`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// A table of this layout: its flows were kept (`flows` live, `expired` dropped).
    Adopted {
        /// Live flows kept.
        flows: usize,
        /// Flows that had expired while nobody swept them.
        expired: usize,
    },
    /// No usable table (first start, other layout or size): a fresh one.
    Fresh {
        /// Why (for the log).
        reason: String,
    },
}

const _: () = assert!(std::mem::size_of::<Flow>() == crate::abi::FLOW_RECORD_BYTES);

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
        FlowState::from_u8(self.state)
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
    /// Every record is in use by a live flow (or the index has no free slot within
    /// [`MAX_PROBE`] of the key's home, which at a load factor ≤ 0.5 does not happen in
    /// practice).
    #[error("flow table full")]
    Full,
    /// The client's address, or its /24, already holds its quota of flows
    /// ([`FlowTable::set_source_quotas`]).
    #[error("source over its flow quota")]
    SourceOverQuota,
}

/// "Not linked" in [`Idle`]'s lists.
const NIL: u32 = u32::MAX;

/// Flows a flood may displace — UDP flows and redirect records, which no handshake
/// vouches for — in a doubly linked list over record numbers, least recently queued
/// first (private memory, 13 bytes per record). A record is queued when inserted; when
/// the table is full, [`FlowTable::insert`] evicts from the head, but a record seen
/// since it was queued (its expiry was pushed out, by userspace or by the XDP fast
/// path) gets a second chance at the tail: an approximation of least recently seen
/// first that costs nothing on the packet path.
#[derive(Debug)]
struct Idle {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// When the record was (re)queued, ms (its last-seen time then).
    queued: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    /// Records evicted to make room (not timed out).
    evicted: u64,
}

/// Flows held per client address and per client /24, counted in two fixed arrays of
/// counters indexed by a seeded hash (bounded memory, 2 × [`QUOTA_BUCKETS`] × 4 bytes;
/// two sources that share a bucket share its quota).
#[derive(Debug)]
struct Quotas {
    per_addr: Vec<u32>,
    per_prefix: Vec<u32>,
    /// Most flows per address and per /24 (`u32::MAX`: no quota).
    addr_max: u32,
    prefix_max: u32,
    /// New flows refused because their source was at its quota.
    refused: u64,
}

/// Counters per table in each of [`Quotas`]' arrays.
pub const QUOTA_BUCKETS: usize = 1 << 16;

/// Most records [`FlowTable::insert`] sends back to the tail (seen since queued) before
/// it evicts the head anyway.
const IDLE_SECOND_CHANCES: usize = 64;

/// Half-open TCP flows, oldest first: `(record, serial)`; an entry is current while its
/// record is half-open with that serial (a record that completed its handshake or was
/// removed leaves a stale entry, skipped when it reaches the front).
#[derive(Debug)]
struct HalfOpen {
    /// Most half-open flows; also the queue's length bound.
    max: usize,
    /// Half-open flows held.
    count: usize,
    queue: VecDeque<(u32, u32)>,
    /// Serial of each record's current half-open entry.
    serial: Vec<u32>,
    next_serial: u32,
    /// Half-open flows evicted to make room (not timed out).
    evicted: u64,
}

/// Handle to a flow record.
pub type FlowId = u32;

/// The fixed-capacity flow table.
#[derive(Debug)]
pub struct FlowTable {
    flows: Region<Flow>,
    index: Region<u64>,
    meta: Region<FlowMeta>,
    mask: usize,
    free: Vec<u32>,
    /// The records that hold a flow (set and cleared with `free`).
    occupied: Occupied,
    seed: u64,
    /// Second seed word (derived from `seed`), never zero.
    seed2: u64,
    sweep_cursor: usize,
    timeouts: Timeouts,
    live: usize,
    half_open: HalfOpen,
    idle: Idle,
    quotas: Quotas,
    /// This table's number in its group, and the group's size (one table per
    /// forwarding worker; 0 and 1 for a lone table).
    table: u32,
    workers: u32,
    /// The other workers' tables of the group, read-only (see [`Peer`]).
    peers: Vec<Peer>,
    /// Look-ups answered from another worker's table.
    remote_hits: std::cell::Cell<u64>,
}

/// A read-only view of another worker's table of the same group: its header, index and
/// records, in the same (mapped or heap) memory its owner writes. Look-ups follow the
/// owner's ordering like the XDP program does (index slot acquire, record behind it) and
/// additionally bracket the probe with the header's sequence word (a seqlock: a record
/// freed and reused meanwhile shows as a changed word, and the look-up is retried).
/// The only writes through a view are [`FlowTable::touch`]'s two atomic words, `state`
/// (compare-and-swap) and `expires` (store).
struct Peer {
    meta: *const FlowMeta,
    index: *const u64,
    records: *mut Flow,
    mask: usize,
    capacity: usize,
    _keep: Vec<crate::region::KeepAlive>,
}

// SAFETY: the pointers address memory kept alive by `_keep` (the whole group's regions);
// it is only read with atomic/volatile loads and written with the atomic stores above,
// which are sound from any thread.
unsafe impl Send for Peer {}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Peer({} records)", self.capacity)
    }
}

impl Peer {
    /// The seqlock word.
    fn seq(&self) -> &AtomicU32 {
        // SAFETY: `meta` points to a live, aligned header (kept by `_keep`); its `seq`
        // word is only ever written atomically by its owner.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of!((*self.meta).seq).cast_mut()) }
    }

    /// The live record whose key for its direction satisfies `want`, with the hash `h`.
    /// A probe that overlapped a deletion in the owner's table is retried (up to
    /// [`PEER_RETRIES`] times, then reported as a miss: the packet is then handled as if
    /// no flow were held).
    fn find(
        &self,
        h: u32,
        want: impl Fn(&Flow, Direction) -> bool,
        now_ms: u64,
    ) -> Option<(u32, Direction)> {
        let (mut tries, mut waits) = (0, 0);
        while tries < PEER_RETRIES && waits < PEER_WAITS {
            let s1 = self.seq().load(Ordering::Acquire);
            if s1 & 1 == 1 {
                // The owner is moving slots (a deletion takes well under a microsecond).
                waits += 1;
                std::hint::spin_loop();
                continue;
            }
            tries += 1;
            let found = self.probe(h, &want);
            fence(Ordering::Acquire);
            if self.seq().load(Ordering::Relaxed) == s1 {
                return found
                    .filter(|(_, _, f)| !f.expired(now_ms as u32))
                    .map(|(id, dir, _)| (id, dir));
            }
        }
        None
    }

    fn probe(
        &self,
        h: u32,
        want: &impl Fn(&Flow, Direction) -> bool,
    ) -> Option<(u32, Direction, Flow)> {
        let mut i = h as usize & self.mask;
        for _ in 0..MAX_PROBE {
            // SAFETY: `i <= mask < index length`; the slot is only written atomically.
            let slot = unsafe { AtomicU64::from_ptr(self.index.add(i).cast_mut()) }
                .load(Ordering::Acquire);
            if slot == 0 {
                return None;
            }
            if (slot >> 32) as u32 == h {
                let (id, dir) = FlowTable::slot_flow(slot);
                if (id as usize) < self.capacity {
                    let f = self.read(id);
                    if f.state != FlowState::Free as u8 && want(&f, dir) {
                        return Some((id, dir, f));
                    }
                }
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// A copy of record `id` (`id < capacity`). Its owner may be changing it: the
    /// caller validates the copy (seqlock in [`Peer::find`]) or uses only fields that
    /// never change while the record is indexed.
    fn read(&self, id: u32) -> Flow {
        // SAFETY: `id < capacity`, the records are live (kept by `_keep`) and every bit
        // pattern is a valid `Flow`; a volatile read because the owner writes it.
        unsafe { self.records.add(id as usize).read_volatile() }
    }

    /// The record's `state` and `expires` words, for atomic access.
    fn words(&self, id: u32) -> (&AtomicU8, &AtomicU32) {
        let rec = self.records.wrapping_add(id as usize);
        // SAFETY: `id < capacity` (checked by the caller's id decoding); both fields are
        // aligned, live (kept by `_keep`), and written by every worker only atomically.
        unsafe {
            (
                AtomicU8::from_ptr(std::ptr::addr_of_mut!((*rec).state)),
                AtomicU32::from_ptr(std::ptr::addr_of_mut!((*rec).expires)),
            )
        }
    }
}

/// A record's `state` and `expires` words as atomics (other workers of the group update
/// them concurrently, see [`Peer`]).
#[inline(always)]
fn words_of(f: &mut Flow) -> (&AtomicU8, &AtomicU32) {
    // SAFETY: both fields are aligned and exclusively borrowed through `f` (within this
    // thread); other threads access them only atomically.
    unsafe {
        (
            AtomicU8::from_ptr(std::ptr::addr_of_mut!(f.state)),
            AtomicU32::from_ptr(std::ptr::addr_of_mut!(f.expires)),
        )
    }
}

/// Moves a state word from what it holds to what `step` makes of it with a
/// compare-and-swap (another worker may move it meanwhile; its change is then the base).
/// Returns the state before and after.
#[inline(always)]
fn advance(word: &AtomicU8, step: impl Fn(FlowState) -> FlowState) -> (FlowState, FlowState) {
    let mut cur = word.load(Ordering::Relaxed);
    loop {
        let before = FlowState::from_u8(cur);
        let after = step(before);
        if after as u8 == cur {
            return (before, after);
        }
        match word.compare_exchange_weak(cur, after as u8, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return (before, after),
            Err(now) => cur = now,
        }
    }
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
        let capacity = capacity.clamp(1, MAX_TABLE_CAPACITY);
        let slots = (capacity * 4).next_power_of_two();
        // Ask for huge pages before the memory is touched: random lookups over tens of MiB
        // otherwise pay a TLB miss (a costly nested page walk in a VM) on every access.
        let mut flows = Vec::with_capacity(capacity);
        advise_huge_pages(&flows);
        flows.resize(capacity, Flow::new(0, 0, 0, 0, 0, 0, 0, 0, 0));
        let mut index: Vec<u64> = Vec::with_capacity(slots);
        advise_huge_pages(&index);
        index.resize(slots, 0);
        let mut t = Self::assemble(
            Region::from_vec(flows),
            Region::from_vec(index),
            Region::from_vec(vec![FlowMeta::EMPTY]),
            timeouts,
            seed,
        );
        t.write_fresh_meta();
        t
    }

    fn assemble(
        flows: Region<Flow>,
        index: Region<u64>,
        meta: Region<FlowMeta>,
        timeouts: Timeouts,
        seed: u64,
    ) -> Self {
        let capacity = flows.len();
        let slots = index.len();
        FlowTable {
            flows,
            index,
            meta,
            mask: slots - 1,
            free: (0..capacity as u32).rev().collect(),
            occupied: Occupied::new(capacity),
            seed,
            seed2: fmix64(seed ^ 0x243f_6a88_85a3_08d3) | 1 << 63,
            sweep_cursor: 0,
            timeouts,
            live: 0,
            table: 0,
            workers: 1,
            peers: Vec::new(),
            remote_hits: std::cell::Cell::new(0),
            half_open: HalfOpen {
                max: capacity.div_ceil(4),
                count: 0,
                queue: VecDeque::with_capacity(capacity.div_ceil(4)),
                serial: vec![0; capacity],
                next_serial: 1,
                evicted: 0,
            },
            idle: Idle {
                prev: vec![NIL; capacity],
                next: vec![NIL; capacity],
                queued: vec![0; capacity],
                linked: vec![false; capacity],
                head: NIL,
                tail: NIL,
                evicted: 0,
            },
            quotas: Quotas {
                per_addr: vec![0; QUOTA_BUCKETS],
                per_prefix: vec![0; QUOTA_BUCKETS],
                addr_max: u32::MAX,
                prefix_max: u32::MAX,
                refused: 0,
            },
        }
    }

    /// The table of a pinned flow map: kept when its header says it is a table of this
    /// layout and size (its flows survive a restart), otherwise made fresh (`seed`).
    /// Kept flows are re-indexed (the index is rebuilt from the records while the
    /// header's sequence word is odd, so a concurrent reader treats every miss as
    /// unsure), expired ones dropped, and every flow is re-validated against the service
    /// table on its next packet ([`UNCHECKED_GENERATION`]).
    pub fn open_shared(
        regions: SharedRegions,
        timeouts: Timeouts,
        seed: u64,
        now_ms: u64,
    ) -> (Self, Opened) {
        let (mut tables, opened) = Self::open_group(regions, 1, timeouts, seed, now_ms);
        (tables.remove(0), opened)
    }

    /// The tables of a group of `workers` forwarding workers (one each) in the pinned
    /// maps: `meta` holds one header per table, `index` and `records` the tables' parts
    /// back to back. The group is kept only as a whole — every header of this layout,
    /// size, worker count and seed — otherwise every table is made fresh (a restart with
    /// another worker count starts empty). Each table is written by its worker only and
    /// reads the others' (docs/dataplane.md, "More than one worker").
    pub fn open_group(
        regions: SharedRegions,
        workers: usize,
        timeouts: Timeouts,
        seed: u64,
        now_ms: u64,
    ) -> (Vec<Self>, Opened) {
        let SharedRegions {
            meta,
            index,
            records,
        } = regions;
        let workers = workers.clamp(1, MAX_WORKERS);
        assert!(
            meta.len() == workers
                && index.len().is_multiple_of(workers)
                && records.len().is_multiple_of(workers),
            "flow maps sized for {workers} tables"
        );
        let problem = Self::group_problem(&meta, index.len() / workers, records.len() / workers);
        let (seed_kept, seed2) = (meta[0].seed, meta[0].seed2);
        let seed = if problem.is_none() { seed_kept } else { seed };
        let parts = meta
            .split(workers)
            .into_iter()
            .zip(index.split(workers))
            .zip(records.split(workers));
        let mut tables: Vec<Self> = parts
            .enumerate()
            .map(|(w, ((m, i), r))| {
                let mut t = Self::assemble(r, i, m, timeouts, seed);
                t.table = w as u32;
                t.workers = workers as u32;
                t
            })
            .collect();
        let opened = match problem {
            Some(reason) => {
                for t in &mut tables {
                    t.write_fresh_meta();
                }
                Opened::Fresh { reason }
            }
            None => {
                let (mut flows, mut expired) = (0, 0);
                for t in &mut tables {
                    t.seed2 = seed2;
                    let (f, e) = t.reindex(now_ms);
                    flows += f;
                    expired += e;
                }
                Opened::Adopted { flows, expired }
            }
        };
        Self::link(&mut tables);
        (tables, opened)
    }

    /// A group of `workers` fresh tables of `capacity` flows each on the heap (tests).
    pub fn new_group(workers: usize, capacity: usize, timeouts: Timeouts, seed: u64) -> Vec<Self> {
        let capacity = capacity.clamp(1, MAX_TABLE_CAPACITY);
        let slots = (capacity * 4).next_power_of_two();
        let regions = SharedRegions {
            meta: Region::heap(workers, FlowMeta::EMPTY),
            index: Region::heap(workers * slots, 0),
            records: Region::heap(workers * capacity, Flow::new(0, 0, 0, 0, 0, 0, 0, 0, 0)),
        };
        Self::open_group(regions, workers, timeouts, seed, 0).0
    }

    /// Gives a group's memory back as one set of regions (to open it again, as a
    /// restarted process does).
    pub fn group_into_regions(tables: Vec<Self>) -> SharedRegions {
        let (mut meta, mut index, mut records) = (Vec::new(), Vec::new(), Vec::new());
        for t in tables {
            meta.push(t.meta);
            index.push(t.index);
            records.push(t.flows);
        }
        SharedRegions {
            meta: Region::join(meta),
            index: Region::join(index),
            records: Region::join(records),
        }
    }

    /// Why the pinned group cannot be kept (`None`: it can).
    fn group_problem(meta: &[FlowMeta], slots: usize, capacity: usize) -> Option<String> {
        let workers = meta.len();
        for (w, m) in meta.iter().enumerate() {
            let problem = if m.magic != FLOW_MAGIC {
                Some("no flow table in the pinned map yet".to_string())
            } else if m.layout != LAYOUT_VERSION {
                Some(format!(
                    "pinned flow table has layout version {}, this binary uses {LAYOUT_VERSION}",
                    m.layout
                ))
            } else if m.workers as usize != workers || m.table as usize != w {
                Some(format!(
                    "pinned flow table {} of {} tables, this run has {workers} workers",
                    m.table, m.workers
                ))
            } else if m.capacity as usize != capacity
                || m.index_slots as usize != slots
                || !slots.is_power_of_two()
                || slots < capacity * 4
            {
                Some(format!(
                    "pinned flow table header ({} flows, {} index slots) does not match its maps ({} records, {} slots)",
                    m.capacity, m.index_slots, capacity, slots
                ))
            } else if m.seed != meta[0].seed || m.seed2 != meta[0].seed2 {
                Some("pinned flow tables disagree on their hash seed".to_string())
            } else {
                None
            };
            if problem.is_some() {
                return problem;
            }
        }
        None
    }

    /// Gives every table of a group read-only views of the others.
    fn link(tables: &mut [Self]) {
        let views: Vec<_> = tables
            .iter()
            .map(|t| {
                (
                    t.meta.as_ptr(),
                    t.index.as_ptr(),
                    t.flows.as_ptr(),
                    t.mask,
                    t.flows.len(),
                    [
                        t.meta.keep_alive(),
                        t.index.keep_alive(),
                        t.flows.keep_alive(),
                    ],
                )
            })
            .collect();
        for (w, t) in tables.iter_mut().enumerate() {
            t.peers = views
                .iter()
                .enumerate()
                .filter(|(o, _)| *o != w)
                .map(|(_, (meta, index, records, mask, capacity, keep))| Peer {
                    meta: *meta,
                    index: *index,
                    records: records.cast_mut(),
                    mask: *mask,
                    capacity: *capacity,
                    _keep: keep.iter().flatten().cloned().collect(),
                })
                .collect();
        }
    }

    /// Clears everything and writes the header last (a reader sees no table until the
    /// magic is there).
    fn write_fresh_meta(&mut self) {
        release_store_u64(&mut self.meta[0].magic, 0);
        self.begin_move();
        for s in self.index.iter_mut() {
            *s = 0;
        }
        for f in self.flows.iter_mut() {
            f.state = FlowState::Free as u8;
        }
        self.occupied.clear_all();
        let m = &mut self.meta[0];
        m.layout = LAYOUT_VERSION;
        m.capacity = self.flows.len() as u32;
        m.index_slots = self.index.len() as u32;
        m.seed = self.seed;
        m.seed2 = self.seed2;
        m.workers = self.workers;
        m.table = self.table;
        m.reserved = [0; 2];
        self.end_move();
        release_store_u64(&mut self.meta[0].magic, FLOW_MAGIC);
    }

    /// Rebuilds the index, the free stack and the half-open queue from the records.
    fn reindex(&mut self, now_ms: u64) -> (usize, usize) {
        self.begin_move();
        for s in self.index.iter_mut() {
            *s = 0;
        }
        self.free.clear();
        self.occupied.clear_all();
        let now = now_ms as u32;
        let mut half_open = Vec::new();
        let mut idle = Vec::new();
        let mut expired = 0;
        for id in (0..self.flows.len()).rev() {
            let f = &mut self.flows[id];
            if f.state() == FlowState::Free {
                f.state = FlowState::Free as u8;
                self.free.push(id as u32);
                continue;
            }
            if f.expired(now) {
                f.state = FlowState::Free as u8;
                self.free.push(id as u32);
                expired += 1;
                continue;
            }
            f.checked_generation = UNCHECKED_GENERATION;
            let f = *f;
            if f.state().is_half_open() {
                half_open.push((f.expires.wrapping_sub(now), id as u32));
            }
            if Self::displaceable(f.state()) {
                idle.push((self.last_seen(&f).wrapping_sub(now) as i32, id as u32));
            }
            let Some((a, b)) = self.free_positions(&f) else {
                // Cannot happen at a load factor ≤ 0.5; drop the flow rather than
                // index it beyond the reader's probe bound.
                self.flows[id].state = FlowState::Free as u8;
                self.free.push(id as u32);
                continue;
            };
            self.index[a.0] = Self::make_slot(a.1, id as u32, Direction::Forward);
            self.index[b.0] = Self::make_slot(b.1, id as u32, Direction::Reverse);
            self.occupied.set(id);
            self.live += 1;
            self.count_source(f.client, 1);
        }
        self.end_move();
        idle.sort_unstable();
        for (ago, id) in idle {
            self.idle_push(id, now.wrapping_add(ago as u32));
        }
        // After the move: queueing may evict (a smaller budget than the last run's).
        half_open.sort_unstable();
        for (_, id) in half_open {
            self.half_open_push(id);
        }
        (self.live, expired)
    }

    /// Makes the header's sequence word odd: index slots are about to move.
    #[inline]
    fn begin_move(&mut self) {
        let seq = self.meta[0].seq | 1;
        release_store_u32(&mut self.meta[0].seq, seq);
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    }

    /// Makes the sequence word even again (and different from before the move).
    #[inline]
    fn end_move(&mut self) {
        let seq = (self.meta[0].seq | 1).wrapping_add(1);
        release_store_u32(&mut self.meta[0].seq, seq);
    }

    /// The most half-open TCP flows held at once (default: a quarter of the capacity).
    /// A new half-open flow beyond it evicts the oldest one.
    pub fn set_half_open_max(&mut self, max: usize) {
        let max = max.clamp(1, self.flows.len());
        self.half_open.max = max;
        while self.half_open.queue.len() > max {
            self.evict_oldest_half_open();
        }
        self.half_open
            .queue
            .reserve(max.saturating_sub(self.half_open.queue.len()));
    }

    /// The half-open bound in force.
    pub fn half_open_max(&self) -> usize {
        self.half_open.max
    }

    /// Half-open TCP flows held.
    pub fn half_open(&self) -> usize {
        self.half_open.count
    }

    /// Half-open flows evicted to make room for newer ones (not timed out).
    pub fn half_open_evicted(&self) -> u64 {
        self.half_open.evicted
    }

    /// UDP flows and redirect records evicted to make room in a full table (not timed
    /// out), least recently seen first.
    pub fn idle_evicted(&self) -> u64 {
        self.idle.evicted
    }

    /// Sets the most flows (and redirect records) one client address and one client /24
    /// may hold in this table; beyond it [`FlowTable::insert`] refuses new ones
    /// ([`InsertError::SourceOverQuota`]). `0`: no quota.
    pub fn set_source_quotas(&mut self, per_addr: usize, per_prefix: usize) {
        let q = |n: usize| {
            if n == 0 {
                u32::MAX
            } else {
                n.min(u32::MAX as usize) as u32
            }
        };
        self.quotas.addr_max = q(per_addr);
        self.quotas.prefix_max = q(per_prefix);
    }

    /// The quotas in force (per address, per /24; `u32::MAX`: none).
    pub fn source_quotas(&self) -> (u32, u32) {
        (self.quotas.addr_max, self.quotas.prefix_max)
    }

    /// New flows refused because their source was at its quota.
    pub fn source_refused(&self) -> u64 {
        self.quotas.refused
    }

    /// The quota counters of a client address: (its address's, its /24's).
    fn quota_buckets(&self, client: u32) -> (usize, usize) {
        let h = |x: u64| (fmix64(x ^ self.seed2) as usize) & (QUOTA_BUCKETS - 1);
        (h(u64::from(client)), h(u64::from(client >> 8) | 1 << 40))
    }

    /// Adds `delta` (±1) to a client's counters.
    fn count_source(&mut self, client: u32, delta: i32) {
        let b = self.quota_buckets(client);
        self.count_buckets(b, delta);
    }

    fn count_buckets(&mut self, (a, p): (usize, usize), delta: i32) {
        let q = &mut self.quotas;
        q.per_addr[a] = q.per_addr[a].wrapping_add_signed(delta);
        q.per_prefix[p] = q.per_prefix[p].wrapping_add_signed(delta);
    }

    /// A client's counters if it may have one more flow.
    fn source_within_quota(&mut self, client: u32) -> Option<(usize, usize)> {
        let (a, p) = self.quota_buckets(client);
        let q = &mut self.quotas;
        if q.per_addr[a] >= q.addr_max || q.per_prefix[p] >= q.prefix_max {
            q.refused += 1;
            return None;
        }
        Some((a, p))
    }

    /// Flows a flood may displace: UDP (and other non-TCP) flows and redirect records.
    fn displaceable(s: FlowState) -> bool {
        matches!(s, FlowState::Udp | FlowState::Redirect)
    }

    /// When a record was last seen, ms: its expiry minus the timeout its state gives.
    fn last_seen(&self, f: &Flow) -> u32 {
        let t = match (f.state(), f.slot) {
            (FlowState::Redirect, 1) => self.timeouts.tcp_fin_ms,
            (FlowState::Redirect, 2) => self.timeouts.tcp_rst_ms,
            (s, _) => self.timeout_of(s),
        };
        f.expires.wrapping_sub(t)
    }

    fn idle_push(&mut self, id: FlowId, now: u32) {
        let l = &mut self.idle;
        let i = id as usize;
        l.prev[i] = l.tail;
        l.next[i] = NIL;
        l.queued[i] = now;
        l.linked[i] = true;
        if l.tail == NIL {
            l.head = id;
        } else {
            l.next[l.tail as usize] = id;
        }
        l.tail = id;
    }

    fn idle_unlink(&mut self, id: FlowId) {
        let l = &mut self.idle;
        let i = id as usize;
        if !l.linked[i] {
            return;
        }
        let (p, n) = (l.prev[i], l.next[i]);
        if p == NIL {
            l.head = n;
        } else {
            l.next[p as usize] = n;
        }
        if n == NIL {
            l.tail = p;
        } else {
            l.prev[n as usize] = p;
        }
        l.linked[i] = false;
    }

    /// Evicts the UDP flow or redirect record seen least recently (approximately: see
    /// [`Idle`]). Returns whether one was.
    fn evict_least_recent_idle(&mut self) -> bool {
        for chance in 0..=IDLE_SECOND_CHANCES {
            let id = self.idle.head;
            if id == NIL {
                return false;
            }
            let f = self.flows[id as usize];
            let seen = self.last_seen(&f);
            let seen_since = (seen.wrapping_sub(self.idle.queued[id as usize]) as i32) > 0;
            if seen_since && chance < IDLE_SECOND_CHANCES {
                self.idle_unlink(id);
                self.idle_push(id, seen);
                continue;
            }
            self.remove(id);
            self.idle.evicted += 1;
            return true;
        }
        false
    }

    /// Makes room for one more record in a full table: an expired record (a bounded
    /// sweep), else the least recently seen UDP flow or redirect record, else the
    /// oldest half-open flow; never an established TCP flow.
    fn make_room(&mut self, now_ms: u64) {
        if self.free.is_empty() {
            self.sweep(now_ms, 256);
        }
        if self.free.is_empty() && !self.evict_least_recent_idle() {
            self.evict_oldest_half_open();
        }
    }

    /// Gives the table's memory back (to open it again, as a restarted process does).
    pub fn into_regions(self) -> SharedRegions {
        SharedRegions {
            meta: self.meta,
            index: self.index,
            records: self.flows,
        }
    }

    /// Whether the records live in a shared (pinned) map.
    pub fn is_shared(&self) -> bool {
        self.flows.is_mapped()
    }

    /// Bytes of memory the table holds (records, index, free stack, half-open queue and
    /// serials).
    pub fn memory_bytes(&self) -> usize {
        self.flows.len() * std::mem::size_of::<Flow>()
            + self.index.len() * 8
            + self.free.capacity() * 4
            + self.occupied.bytes()
            + self.half_open.queue.capacity() * 8
            + self.half_open.serial.len() * 4
            + self.idle.prev.len() * 13
            + self.quotas.per_addr.len() * 8
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
                return self.peer_lookup(h, k, None, now_ms);
            }
            if (slot >> 32) as u32 == h {
                let (id, dir) = Self::slot_flow(slot);
                let f = &self.flows[id as usize];
                if f.key(dir) == *k {
                    if f.expired(now_ms as u32) {
                        self.remove_expired(id);
                        return self.peer_lookup(h, k, None, now_ms);
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
    /// then decides (and removes the expired flow); this one changes nothing. This table
    /// only: a flow of another worker's table is found by the general look-up.
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

    /// A key found in another worker's table: the tables in order, each probed like
    /// the XDP program does ([`Peer::find`]); `dir` restricts the direction.
    #[cold]
    #[inline(never)]
    fn peer_lookup(
        &self,
        h: u32,
        k: &FlowKey,
        dir: Option<Direction>,
        now_ms: u64,
    ) -> Option<(FlowId, Direction)> {
        let hit = self.peers.iter().enumerate().find_map(|(p, peer)| {
            let want = |f: &Flow, d: Direction| dir.is_none_or(|w| w == d) && f.key(d) == *k;
            peer.find(h, want, now_ms)
                .map(|(id, d)| (REMOTE | (p as u32) << PEER_SHIFT | id, d))
        });
        self.remote_hits
            .set(self.remote_hits.get() + u64::from(hit.is_some()));
        hit
    }

    /// Look-ups answered from another worker's table so far.
    pub fn remote_hits(&self) -> u64 {
        self.remote_hits.get()
    }

    /// The view and record number of a [`FlowId`] of another worker's table.
    #[inline]
    fn remote(&self, id: FlowId) -> (&Peer, u32) {
        let peer = &self.peers[((id & !REMOTE) >> PEER_SHIFT) as usize];
        let local = id & LOCAL_MASK;
        assert!((local as usize) < peer.capacity, "flow id out of range");
        (peer, local)
    }

    /// Whether a flow lives in another worker's table (found by a look-up here, owned
    /// and removed there).
    #[inline]
    pub fn is_remote(id: FlowId) -> bool {
        id & REMOTE != 0
    }

    /// A copy of the record of a flow (of this table or another worker's).
    #[inline(always)]
    pub fn get(&self, id: FlowId) -> Flow {
        // A remote id (top bit set) is beyond every table: one bounds check for both.
        match self.flows.get(id as usize) {
            Some(f) => *f,
            None => self.get_remote(id),
        }
    }

    /// The record of a flow of this table, by reference (`None` for another worker's:
    /// [`FlowTable::get`] copies those).
    #[inline(always)]
    pub fn local(&self, id: FlowId) -> Option<&Flow> {
        self.flows.get(id as usize)
    }

    #[cold]
    #[inline(never)]
    fn get_remote(&self, id: FlowId) -> Flow {
        let (peer, local) = self.remote(id);
        peer.read(local)
    }

    /// The record of a flow of this table, mutable (re-validation bookkeeping); `None`
    /// for a flow of another worker's table, which only its owner changes.
    pub fn get_mut(&mut self, id: FlowId) -> Option<&mut Flow> {
        if id & REMOTE != 0 {
            return None;
        }
        self.flows.get_mut(id as usize)
    }

    /// Inserts a new flow (the caller looked it up first and found nothing). When the
    /// table is full, a bounded sweep tries to free an expired record first, then the
    /// oldest half-open flow is evicted; a live established flow never is. A TCP flow
    /// starts half-open when `tcp_flags` is a SYN (the engine creates TCP flows only
    /// from SYNs).
    pub fn insert(
        &mut self,
        mut flow: Flow,
        tcp_flags: u8,
        now_ms: u64,
    ) -> Result<FlowId, InsertError> {
        let Some(buckets) = self.source_within_quota(flow.client) else {
            return Err(InsertError::SourceOverQuota);
        };
        self.make_room(now_ms);
        let Some(&id) = self.free.last() else {
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
                FlowState::Established
            }
        } else {
            FlowState::Udp
        } as u8;
        flow.expires = (now_ms as u32).wrapping_add(self.timeout_of(flow.state()));
        let Some((a, b)) = self.free_positions(&flow) else {
            return Err(InsertError::Full);
        };
        self.free.pop();
        self.occupied.set(id as usize);
        // The record first, then its index slots with release stores: a reader that
        // finds a slot finds the complete record behind it.
        self.flows[id as usize] = flow;
        self.index
            .store_release(a.0, Self::make_slot(a.1, id, Direction::Forward));
        self.index
            .store_release(b.0, Self::make_slot(b.1, id, Direction::Reverse));
        self.live += 1;
        self.count_buckets(buckets, 1);
        if flow.state().is_half_open() {
            self.half_open_push(id);
        } else if Self::displaceable(flow.state()) {
            self.idle_push(id, now_ms as u32);
        }
        Ok(id)
    }

    /// Inserts a redirect record: packets with this forward key go to node `owner`
    /// (docs/dataplane.md "Redirects between nodes"). It lives in the same
    /// table as the flows it stands for, with the same keys: its reverse key is
    /// `(owner, client, 0, client port, proto)`, which no real packet carries (port 0),
    /// and its `checked_generation` never matches a service table, so the fast path
    /// always hands it to the general path. It expires like an established flow and
    /// follows FIN/RST ([`FlowTable::touch_redirect`]). The caller looked the key up
    /// first and found nothing.
    pub fn insert_redirect(
        &mut self,
        key: &FlowKey,
        owner: u32,
        now_ms: u64,
    ) -> Result<FlowId, InsertError> {
        let mut flow = Flow::new(
            key.src,
            key.src_port,
            key.dst,
            key.dst_port,
            owner,
            0,
            key.proto,
            0,
            UNCHECKED_GENERATION,
        );
        let Some(buckets) = self.source_within_quota(flow.client) else {
            return Err(InsertError::SourceOverQuota);
        };
        self.make_room(now_ms);
        let Some(&id) = self.free.last() else {
            return Err(InsertError::Full);
        };
        flow.state = FlowState::Redirect as u8;
        flow.expires = (now_ms as u32).wrapping_add(self.redirect_timeout(key.proto, 0));
        let Some((a, b)) = self.free_positions(&flow) else {
            return Err(InsertError::Full);
        };
        self.free.pop();
        self.occupied.set(id as usize);
        self.flows[id as usize] = flow;
        self.index
            .store_release(a.0, Self::make_slot(a.1, id, Direction::Forward));
        self.index
            .store_release(b.0, Self::make_slot(b.1, id, Direction::Reverse));
        self.live += 1;
        self.count_buckets(buckets, 1);
        self.idle_push(id, now_ms as u32);
        Ok(id)
    }

    /// Records a packet sent along a redirect record: pushes its expiry out by the
    /// timeout its TCP flags call for (the record's `slot` remembers a FIN or RST, so
    /// later ACKs do not lengthen it again). The state stays [`FlowState::Redirect`].
    pub fn touch_redirect(&mut self, id: FlowId, (proto, tcp_flags): (u8, u8), now_ms: u64) {
        if id & REMOTE != 0 {
            // Another worker's record: its expiry only (the FIN/RST memory is its
            // owner's, who sees the flow's other packets).
            let t = self.redirect_timeout(proto, 0);
            let (peer, local) = self.remote(id);
            peer.words(local)
                .1
                .store((now_ms as u32).wrapping_add(t), Ordering::Relaxed);
            return;
        }
        let f = &mut self.flows[id as usize];
        if tcp_flags & tcp_flags::RST != 0 {
            f.slot = 2;
        } else if tcp_flags & tcp_flags::FIN != 0 && f.slot == 0 {
            f.slot = 1;
        }
        let slot = f.slot;
        let t = self.redirect_timeout(proto, slot);
        let f = &mut self.flows[id as usize];
        words_of(f)
            .1
            .store((now_ms as u32).wrapping_add(t), Ordering::Relaxed);
    }

    /// How long a redirect record lives after its last packet: a UDP flow's timeout, or
    /// a TCP connection's by what its packets said (`slot`: 0 nothing, 1 FIN, 2 RST).
    fn redirect_timeout(&self, proto: u8, slot: u32) -> u32 {
        match (proto, slot) {
            (crate::proto::IPPROTO_UDP, _) => self.timeouts.udp_ms,
            (_, 0) => self.timeouts.tcp_established_ms,
            (_, 1) => self.timeouts.tcp_fin_ms,
            _ => self.timeouts.tcp_rst_ms,
        }
    }

    /// The empty index slots a flow's forward and reverse keys would take, with their
    /// hashes; `None` if either lies [`MAX_PROBE`] or more slots from its home.
    fn free_positions(&self, flow: &Flow) -> Option<((usize, u32), (usize, u32))> {
        let ha = self.hash32(&flow.key(Direction::Forward));
        let hb = self.hash32(&flow.key(Direction::Reverse));
        let a = self.empty_slot_from(ha, usize::MAX)?;
        let b = self.empty_slot_from(hb, a)?;
        Some(((a, ha), (b, hb)))
    }

    fn empty_slot_from(&self, h: u32, taken: usize) -> Option<usize> {
        let mut i = h as usize & self.mask;
        for _ in 0..MAX_PROBE {
            if self.index[i] == 0 && i != taken {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    fn half_open_push(&mut self, id: FlowId) {
        while self.half_open.queue.len() >= self.half_open.max {
            self.evict_oldest_half_open();
        }
        let serial = self.half_open.next_serial;
        self.half_open.next_serial = serial.wrapping_add(1).max(1);
        self.half_open.serial[id as usize] = serial;
        self.half_open.queue.push_back((id, serial));
        self.half_open.count += 1;
    }

    /// Removes the oldest half-open flow still held (skipping queue entries of flows
    /// that completed their handshake or were removed). Returns whether one was.
    fn evict_oldest_half_open(&mut self) -> bool {
        while let Some((id, serial)) = self.half_open.queue.pop_front() {
            if self.half_open_current(id, serial) {
                self.remove(id);
                self.half_open.evicted += 1;
                return true;
            }
            if self.half_open.serial[id as usize] == serial {
                // Left half-open through another worker's touch: catch up.
                self.left_half_open(id);
            }
        }
        false
    }

    fn half_open_current(&self, id: FlowId, serial: u32) -> bool {
        self.half_open.serial[id as usize] == serial
            && self.flows[id as usize].state().is_half_open()
    }

    /// Leaves the half-open count when a flow's state stops being half-open.
    #[inline]
    fn left_half_open(&mut self, id: FlowId) {
        self.half_open.serial[id as usize] = 0;
        self.half_open.count -= 1;
    }

    fn timeout_of(&self, s: FlowState) -> u32 {
        timeout_for(&self.timeouts, s)
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
                    words_of(f)
                        .1
                        .store((now_ms as u32).wrapping_add(udp_ms), Ordering::Relaxed);
                    return;
                }
            }
        }
        self.touch(id, dir, tcp_flags, now_ms);
    }

    /// Records a packet of a flow: advances the TCP state and pushes the expiry out.
    /// The handshake is followed so that only a client that completes it (SYN,
    /// SYN-ACK from the backend, then the client's ACK) makes an established flow: a
    /// spoofed SYN the backend answers stays half-open.
    #[inline(always)]
    pub fn touch(&mut self, id: FlowId, dir: Direction, tcp_flags: u8, now_ms: u64) {
        if id & REMOTE != 0 {
            return self.touch_remote(id, dir, tcp_flags, now_ms);
        }
        let timeouts = self.timeouts;
        let f = &mut self.flows[id as usize];
        let proto = f.proto;
        let (state, expires) = words_of(f);
        let (before, next) = advance(state, |s| s.next(proto, dir, tcp_flags));
        expires.store(
            (now_ms as u32).wrapping_add(timeout_for(&timeouts, next)),
            Ordering::Relaxed,
        );
        if before != next {
            self.track_half_open(id, next);
        }
    }

    /// [`FlowTable::touch`] of a record in another worker's table: only its `state`
    /// (compare-and-swap) and `expires` (store) words change; its owner catches up with
    /// the half-open bookkeeping ([`FlowTable::track_half_open`]) and clamps an expiry
    /// a race left too long on its next sweep.
    #[cold]
    #[inline(never)]
    fn touch_remote(&self, id: FlowId, dir: Direction, tcp_flags: u8, now_ms: u64) {
        let (peer, local) = self.remote(id);
        let proto = peer.read(local).proto;
        let (state, expires) = peer.words(local);
        let (before, next) = advance(state, |s| {
            if s == FlowState::Free {
                s
            } else {
                s.next(proto, dir, tcp_flags)
            }
        });
        if before != FlowState::Free {
            expires.store(
                (now_ms as u32).wrapping_add(self.timeout_of(next)),
                Ordering::Relaxed,
            );
        }
    }

    /// Keeps the half-open queue and count in step with a record's state, which
    /// another worker may have moved ([`FlowTable::touch_remote`]): a record is tracked
    /// (non-zero serial) exactly while its state is half-open, once this catches up.
    #[inline(always)]
    fn track_half_open(&mut self, id: FlowId, now: FlowState) {
        let tracked = self.half_open.serial[id as usize] != 0;
        if tracked && !now.is_half_open() {
            self.left_half_open(id);
        } else if !tracked && now.is_half_open() {
            self.half_open_push(id);
        }
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

    /// Backward-shift deletion; the caller brackets it with `begin_move`/`end_move`.
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
                self.index.store_release(hole, slot);
                hole = j;
            }
        }
        self.index.store_release(hole, 0);
    }

    #[cold]
    fn remove_expired(&mut self, id: FlowId) {
        self.remove(id);
    }

    /// Removes a flow (both keys) and frees its record.
    pub fn remove(&mut self, id: FlowId) {
        if id & REMOTE != 0 {
            return; // its owner removes it (expiry or its own re-validation)
        }
        let state = self.flows[id as usize].state();
        if state == FlowState::Free {
            return;
        }
        self.begin_move();
        for dir in [Direction::Forward, Direction::Reverse] {
            if let Some(i) = self.find_slot(id, dir) {
                self.delete_slot(i);
            }
        }
        self.end_move();
        words_of(&mut self.flows[id as usize])
            .0
            .store(FlowState::Free as u8, Ordering::Relaxed);
        if self.half_open.serial[id as usize] != 0 {
            self.left_half_open(id);
        }
        self.idle_unlink(id);
        let client = self.flows[id as usize].client;
        self.count_source(client, -1);
        self.free.push(id);
        self.occupied.clear(id as usize);
        self.live -= 1;
    }

    /// A live record other workers may have touched: its half-open tracking follows its
    /// state, and an expiry beyond what its state allows (two workers' touches raced
    /// across a state change) is clamped.
    #[cold]
    fn catch_up(&mut self, id: FlowId, f: Flow, now: u32) {
        let state = f.state();
        self.track_half_open(id, state);
        if state != FlowState::Redirect {
            let limit = self.timeout_of(state);
            if f.expires.wrapping_sub(now) > limit {
                words_of(&mut self.flows[id as usize])
                    .1
                    .store(now.wrapping_add(limit), Ordering::Relaxed);
            }
        }
    }

    /// Examines up to `budget` records from a rotating cursor and removes the expired
    /// ones. Returns how many were removed. The runtime paces it by the clock
    /// ([`crate::engine::SweepPace`]).
    pub fn sweep(&mut self, now_ms: u64, budget: usize) -> usize {
        let now = now_ms as u32;
        let mut left = budget.min(self.flows.len());
        let mut removed = 0;
        while left > 0 {
            // Free records are covered by their bits, up to 64 a word.
            for id in self.occupied.stretch(&mut self.sweep_cursor, &mut left) {
                let f = self.flows[id];
                if f.state == FlowState::Free as u8 {
                    continue;
                }
                if f.expired(now) {
                    self.remove(id as u32);
                    removed += 1;
                } else if !self.peers.is_empty() {
                    self.catch_up(id as u32, f, now);
                }
            }
        }
        removed
    }
}

/// The idle timeout of a state.
#[inline(always)]
pub(crate) fn timeout_for(t: &Timeouts, s: FlowState) -> u32 {
    match s {
        FlowState::SynSent | FlowState::SynReceived => t.tcp_syn_ms,
        FlowState::Established | FlowState::Redirect => t.tcp_established_ms,
        FlowState::Closing => t.tcp_fin_ms,
        FlowState::Reset => t.tcp_rst_ms,
        FlowState::Udp | FlowState::Free => t.udp_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::IPPROTO_UDP;
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
            150,
        );
        assert_eq!(t.get(id2).state(), FlowState::SynReceived);
        t.touch(id2, Direction::Forward, tcp_flags::ACK, 200);
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
    fn full_table_evicts_expired_then_half_open_never_established() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(2, to, 1);
        t.insert(flow(1, 1, 9), tcp_flags::ACK, 0).unwrap();
        t.insert(flow(2, 1, 9), tcp_flags::ACK, 0).unwrap();
        // Full of established flows: a SYN is refused, nothing evicted.
        assert_eq!(
            t.insert(flow(3, 1, 9), tcp_flags::SYN, 1),
            Err(InsertError::Full)
        );
        assert_eq!(t.len(), 2);
        // Once they expired, insert evicts them itself.
        let late = u64::from(to.tcp_established_ms) + 1;
        let id = t.insert(flow(3, 1, 9), tcp_flags::SYN, late).unwrap();
        assert_eq!(
            t.lookup(&fwd(&flow(3, 1, 9)), late + 1).map(|x| x.0),
            Some(id)
        );
        // Full with one half-open flow: the next SYN evicts it, not the established one.
        t.insert(flow(4, 1, 9), tcp_flags::ACK, late).unwrap();
        t.insert(flow(5, 1, 9), tcp_flags::SYN, late + 2).unwrap();
        assert!(t.lookup(&fwd(&flow(3, 1, 9)), late + 3).is_none());
        assert!(t.lookup(&fwd(&flow(4, 1, 9)), late + 3).is_some());
        assert!(t.lookup(&fwd(&flow(5, 1, 9)), late + 3).is_some());
        assert_eq!(t.half_open_evicted(), 1);
    }

    /// A UDP flood (one new 5-tuple per packet, each seen once) fills the table: a new
    /// SYN and new UDP flows still get a record, by evicting the UDP flow seen least
    /// recently, while established TCP flows and a UDP flow that keeps talking stay.
    #[test]
    fn a_udp_flood_is_evicted_least_recently_seen_first_never_established_tcp() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(64, to, 5);
        let udp =
            |client: u32, port: u16| Flow::new(client, port, 2, 53, 3, 5353, IPPROTO_UDP, 0, 0);
        // Eight established connections, one chatty UDP flow.
        for c in 0..8 {
            t.insert(flow(100 + c, 1, 9), tcp_flags::ACK, 0).unwrap();
        }
        let chatty = udp(7, 7);
        let chatty_id = t.insert(chatty, 0, 0).unwrap();
        // The flood: one datagram per new source port, 1 ms apart, ten times the table.
        for i in 0..640u64 {
            let now = 1 + i;
            t.insert(udp(0x0a00_0001, i as u16), 0, now)
                .unwrap_or_else(|e| panic!("datagram {i}: {e}"));
            if i % 8 == 0 {
                t.touch(chatty_id, Direction::Reverse, 0, now);
            }
        }
        let now = 641;
        for c in 0..8 {
            assert!(
                t.lookup(&fwd(&flow(100 + c, 1, 9)), now).is_some(),
                "established {c}"
            );
        }
        assert_eq!(
            t.lookup(&chatty.key(Direction::Forward), now).map(|x| x.0),
            Some(chatty_id)
        );
        // The newest flood flows are held, the oldest were evicted.
        assert!(t
            .lookup(&udp(0x0a00_0001, 639).key(Direction::Forward), now)
            .is_some());
        assert!(t
            .lookup(&udp(0x0a00_0001, 0).key(Direction::Forward), now)
            .is_none());
        // A new connection still gets a record.
        let syn = flow(200, 1, 9);
        t.insert(syn, tcp_flags::SYN, now).unwrap();
        assert!(t.lookup(&fwd(&syn), now).is_some());
        assert!(t.idle_evicted() >= 640 - 64);
        assert_eq!(t.len(), 64);
    }

    #[test]
    fn sweep_is_bounded_and_removes_expired() {
        let to = Timeouts::default();
        let mut t = FlowTable::new(1000, to, 3);
        t.set_half_open_max(1000);
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
    fn a_restarted_table_sweeps_the_flows_it_adopted() {
        let to = Timeouts::default();
        let (mut t, _) = FlowTable::open_shared(heap_regions(256), to, 77, 1000);
        // Records far apart: the ones between them were taken and freed again.
        let mut ids = Vec::new();
        for i in 0..200 {
            ids.push(t.insert(flow(i + 1, 1, 9), tcp_flags::ACK, 1000).unwrap());
        }
        for &id in &ids[1..199] {
            t.remove(id);
        }
        assert_eq!(t.len(), 2);
        let (mut t2, opened) = FlowTable::open_shared(t.into_regions(), to, 1, 2000);
        assert_eq!(
            opened,
            Opened::Adopted {
                flows: 2,
                expired: 0
            }
        );
        let expired = 1000 + u64::from(to.tcp_established_ms) + 1;
        assert_eq!(
            t2.sweep(expired, t2.capacity()),
            2,
            "both adopted flows swept"
        );
        assert!(t2.is_empty());
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
        // 68 bytes of records, index and free stack, plus 4 of half-open serial and
        // 8 per queue entry for a quarter of the flows, 13 of the idle list, and the
        // quota counters' fixed 512 KiB (0.5 per flow here).
        assert!(
            t.memory_bytes() >= n * 87 && t.memory_bytes() <= n * 88,
            "{}",
            t.memory_bytes()
        );
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
            t.insert(f, tcp_flags::ACK, 0).unwrap();
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

    #[test]
    fn handshake_decides_when_a_flow_is_established() {
        let mut t = FlowTable::new(8, Timeouts::default(), 3);
        let f = flow(1, 1, 2);
        let id = t.insert(f, tcp_flags::SYN, 0).unwrap();
        assert_eq!(t.half_open(), 1);
        // The backend answers a (possibly spoofed) SYN: still half-open.
        t.touch(id, Direction::Reverse, tcp_flags::SYN | tcp_flags::ACK, 1);
        assert_eq!(t.get(id).state(), FlowState::SynReceived);
        assert_eq!(t.half_open(), 1);
        // A data segment from the backend does not complete it either.
        t.touch(id, Direction::Reverse, tcp_flags::ACK, 2);
        assert_eq!(t.get(id).state(), FlowState::SynReceived);
        // The client's ACK does.
        t.touch(id, Direction::Forward, tcp_flags::ACK, 3);
        assert_eq!(t.get(id).state(), FlowState::Established);
        assert_eq!(t.half_open(), 0);
        // A RST during the handshake leaves the half-open count too.
        let g = flow(5, 5, 2);
        let id2 = t.insert(g, tcp_flags::SYN, 4).unwrap();
        t.touch(id2, Direction::Reverse, tcp_flags::RST | tcp_flags::ACK, 5);
        assert_eq!(t.half_open(), 0);
        t.remove(id2);
        assert_eq!(t.half_open(), 0);
    }

    #[test]
    fn syn_flood_evicts_oldest_half_open_never_established() {
        let mut t = FlowTable::new(1000, Timeouts::default(), 11);
        t.set_half_open_max(50);
        let est: Vec<Flow> = (0..100).map(|i| flow(0x0a00_0000 + i, 1000, 9)).collect();
        for f in &est {
            let id = t.insert(*f, tcp_flags::SYN, 0).unwrap();
            t.touch(id, Direction::Reverse, tcp_flags::SYN | tcp_flags::ACK, 0);
            t.touch(id, Direction::Forward, tcp_flags::ACK, 0);
        }
        // 20 000 spoofed SYNs (far beyond the table's capacity).
        for i in 0..20_000u32 {
            let f = flow(0xc000_0000 + i, (i % 60000) as u16, 9);
            t.insert(f, tcp_flags::SYN, 1)
                .expect("a SYN always finds room");
            assert!(t.half_open() <= 50);
        }
        for f in &est {
            assert!(t.lookup(&fwd(f), 2).is_some(), "established flow evicted");
        }
        assert_eq!(t.half_open(), 50);
        assert_eq!(t.len(), 150);
        assert_eq!(t.half_open_evicted(), 20_000 - 50);
        // Oldest first: the last 50 SYNs are the ones left.
        for i in 19_950..20_000u32 {
            let f = flow(0xc000_0000 + i, (i % 60000) as u16, 9);
            assert!(t.lookup(&fwd(&f), 2).is_some());
        }
        // A legitimate connection opened in the flood completes its handshake as long
        // as fewer than 50 SYNs arrive before its ACK.
        let legit = flow(0x0b00_0001, 4242, 9);
        let id = t.insert(legit, tcp_flags::SYN, 3).unwrap();
        for i in 0..40u32 {
            t.insert(flow(0xd000_0000 + i, 1, 9), tcp_flags::SYN, 3)
                .unwrap();
        }
        t.touch(id, Direction::Reverse, tcp_flags::SYN | tcp_flags::ACK, 3);
        t.touch(id, Direction::Forward, tcp_flags::ACK, 3);
        assert_eq!(t.get(id).state(), FlowState::Established);
        assert_eq!(t.lookup(&fwd(&legit), 4).map(|x| x.0), Some(id));
    }

    fn heap_regions(capacity: usize) -> SharedRegions {
        SharedRegions {
            meta: Region::heap(1, FlowMeta::EMPTY),
            index: Region::heap(crate::steering::index_slots(capacity), 0u64),
            records: Region::heap(capacity, Flow::new(0, 0, 0, 0, 0, 0, 0, 0, 0)),
        }
    }

    /// A restart keeps what the flood defences know: the UDP flows found again are
    /// displaceable (least recently seen first) and count towards their source's quota.
    #[test]
    fn a_table_found_again_keeps_its_displaceable_flows_and_source_counts() {
        let to = Timeouts::default();
        let udp = |c: u32, p: u16| {
            Flow::new(
                c,
                p,
                0xcb00710a,
                53,
                9,
                5353,
                crate::proto::IPPROTO_UDP,
                0,
                1,
            )
        };
        let (mut t, _) = FlowTable::open_shared(heap_regions(4), to, 77, 1000);
        t.insert(flow(1, 1, 9), tcp_flags::ACK, 1000).unwrap();
        t.insert(udp(5, 2), 0, 1001).unwrap();
        t.insert(udp(5, 1), 0, 1000).unwrap();
        t.insert(flow(2, 1, 9), tcp_flags::ACK, 1000).unwrap();
        let (mut t2, _) = FlowTable::open_shared(t.into_regions(), to, 1, 2000);
        assert_eq!(t2.len(), 4);
        t2.set_source_quotas(2, 0);
        assert_eq!(
            t2.insert(udp(5, 3), 0, 2000),
            Err(InsertError::SourceOverQuota)
        );
        // Full: a SYN displaces the UDP flow seen least recently, nothing else.
        t2.insert(flow(3, 1, 9), tcp_flags::SYN, 2000).unwrap();
        assert!(t2
            .lookup(&udp(5, 1).key(Direction::Forward), 2000)
            .is_none());
        assert!(t2
            .lookup(&udp(5, 2).key(Direction::Forward), 2000)
            .is_some());
        for c in [1, 2] {
            assert!(t2.lookup(&fwd(&flow(c, 1, 9)), 2000).is_some());
        }
        // And the source is below its quota again.
        assert!(t2.insert(udp(5, 3), 0, 2001).is_ok());
    }

    #[test]
    fn a_shared_table_is_found_again_with_its_flows() {
        let to = Timeouts::default();
        let (mut t, opened) = FlowTable::open_shared(heap_regions(64), to, 77, 1000);
        assert!(matches!(opened, Opened::Fresh { .. }), "{opened:?}");
        let a = flow(1, 1, 9);
        let b = flow(2, 2, 9);
        let c = Flow::new(
            3,
            3,
            0xcb00710a,
            53,
            9,
            5353,
            crate::proto::IPPROTO_UDP,
            0,
            1,
        );
        let ia = t.insert(a, tcp_flags::ACK, 1000).unwrap();
        t.insert(b, tcp_flags::SYN, 1000).unwrap();
        t.insert(c, 0, 1000).unwrap();
        assert_eq!(t.get(ia).checked_generation, 1);
        let regions = t.into_regions();
        // "Restart" 10 s later: the SYN flow (5 s... 30 s default) and UDP flow kept or
        // expired by their own timeouts; the established one is kept.
        let later = 1000 + u64::from(to.tcp_syn_ms) + 1;
        let (mut t2, opened) = FlowTable::open_shared(regions, to, 12345, later);
        assert_eq!(
            opened,
            Opened::Adopted {
                flows: 2,
                expired: 1
            }
        );
        let (id, dir) = t2.lookup(&rev(&a), later).expect("kept");
        assert_eq!(dir, Direction::Reverse);
        assert_eq!(t2.get(id).checked_generation, UNCHECKED_GENERATION);
        assert!(t2.lookup(&fwd(&b), later).is_none());
        assert!(t2.lookup(&c.key(Direction::Forward), later).is_some());
        assert_eq!(t2.seed, 77, "the table keeps its hash seed");
        // Another layout version is never read.
        let mut regions = t2.into_regions();
        regions.meta[0].layout = LAYOUT_VERSION + 1;
        let (mut t3, opened) = FlowTable::open_shared(regions, to, 5, later);
        assert!(
            matches!(opened, Opened::Fresh { ref reason } if reason.contains("layout")),
            "{opened:?}"
        );
        assert!(t3.is_empty());
        assert!(t3.lookup(&rev(&a), later).is_none());
        assert_eq!(t3.meta[0].layout, LAYOUT_VERSION);
        assert_eq!(t3.meta[0].magic, FLOW_MAGIC);
    }

    #[test]
    fn a_worker_finds_and_touches_another_workers_flows() {
        let to = Timeouts::default();
        let mut g = FlowTable::new_group(2, 64, to, 5);
        let f = flow(0xc0000201, 40000, 0x0a010005);
        let id = g[0].insert(f, tcp_flags::SYN, 0).unwrap();
        assert_eq!(g[0].half_open(), 1);
        // The reply arrives at worker 1: found in worker 0's table.
        let (rid, dir) = g[1].lookup(&rev(&f), 1).expect("found across workers");
        assert_eq!(dir, Direction::Reverse);
        assert!(FlowTable::is_remote(rid));
        assert_eq!(g[1].get(rid), g[0].get(id));
        let raw = RawKey::from_key(&rev(&f));
        // The fast path's look-up serves the worker's own flows only.
        assert_eq!(g[1].find_live(&raw, Direction::Reverse, 1), None);
        assert_eq!(g[0].find_live(&raw, Direction::Reverse, 1), Some(id));
        // SYN-ACK through worker 1, the client's ACK through worker 0.
        g[1].touch(rid, Direction::Reverse, tcp_flags::SYN | tcp_flags::ACK, 2);
        assert_eq!(g[0].get(id).state(), FlowState::SynReceived);
        g[0].touch(id, Direction::Forward, tcp_flags::ACK, 3);
        assert_eq!(g[0].get(id).state(), FlowState::Established);
        assert_eq!(g[0].half_open(), 0);
        // Worker 1 refreshes the expiry; it never removes or re-validates the record.
        g[1].touch(rid, Direction::Reverse, tcp_flags::ACK, 100_000);
        assert_eq!(g[0].get(id).expires, 100_000 + to.tcp_established_ms);
        g[1].remove(rid);
        assert!(g[1].get_mut(rid).is_none());
        assert_eq!(g[0].len(), 1);
        // A backend RST seen by worker 1 takes a half-open flow out of worker 0's
        // half-open count once worker 0 catches up (its sweep).
        let h = flow(0xc0000202, 40001, 0x0a010005);
        let hid = g[0].insert(h, tcp_flags::SYN, 0).unwrap();
        assert_eq!(g[0].half_open(), 1);
        let (rh, _) = g[1].lookup(&rev(&h), 1).unwrap();
        g[1].touch(rh, Direction::Reverse, tcp_flags::RST, 1);
        assert_eq!(g[0].get(hid).state(), FlowState::Reset);
        g[0].sweep(2, 64);
        assert_eq!(g[0].half_open(), 0);
        // Removed by its owner: gone for everyone.
        g[0].remove(id);
        assert!(g[1].lookup(&fwd(&f), 200_000).is_none());
    }

    /// Worker 1 looks up a flow of worker 0 while worker 0 inserts and removes other
    /// flows around it (backward shifts, record reuse) on another thread: a hit is always
    /// that flow, never another record or a torn one (the seqlock of [`Peer::find`]).
    /// Misses (a probe that overlapped deletions more than the retry bound allows) are
    /// counted, not asserted: they depend on scheduling.
    #[test]
    fn cross_worker_lookups_race_with_the_owners_deletions() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let to = Timeouts::default();
        let mut g = FlowTable::new_group(2, 64, to, 21);
        let reader = g.pop().unwrap();
        let mut owner = g.pop().unwrap();
        let kept = flow(0xc0000201, 1000, 0x0a010005);
        let kept_id = owner.insert(kept, tcp_flags::ACK, 0).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let churn = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) && rounds < 2_000_000 {
                    let ids: Vec<_> = (0..40u16)
                        .filter_map(|p| {
                            let f = flow(0xc0000201, 2000 + p, 0x0a010005);
                            owner.insert(f, tcp_flags::ACK, 0).ok()
                        })
                        .collect();
                    for id in ids {
                        owner.remove(id);
                    }
                    rounds += 1;
                }
                (owner, rounds)
            })
        };
        let mut reader = reader;
        let (mut hits, mut misses) = (0u64, 0u64);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
        while std::time::Instant::now() < deadline {
            for k in [fwd(&kept), rev(&kept)] {
                match reader.lookup(&k, 1) {
                    Some((id, _)) => {
                        assert_eq!(id & LOCAL_MASK, kept_id, "a hit is the flow itself");
                        hits += 1;
                    }
                    None => misses += 1,
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (owner, rounds) = churn.join().unwrap();
        assert_eq!(owner.len(), 1);
        assert!(hits > 0 && rounds > 0, "hits {hits}, churn rounds {rounds}");
        eprintln!("cross-worker look-ups under churn: {hits} hits, {misses} misses, {rounds} churn rounds");
    }

    #[test]
    fn a_group_survives_a_restart_with_the_same_worker_count_only() {
        let to = Timeouts::default();
        let mut g = FlowTable::new_group(2, 64, to, 9);
        let a = flow(1, 1, 9);
        let b = flow(2, 2, 9);
        g[0].insert(a, tcp_flags::ACK, 1000).unwrap();
        g[1].insert(b, tcp_flags::ACK, 1000).unwrap();
        let regions = FlowTable::group_into_regions(g);
        let (mut g2, opened) = FlowTable::open_group(regions, 2, to, 1, 1001);
        assert_eq!(
            opened,
            Opened::Adopted {
                flows: 2,
                expired: 0
            }
        );
        assert!(
            g2[0].lookup(&rev(&b), 1002).is_some(),
            "b found from worker 0"
        );
        assert!(
            g2[1].lookup(&fwd(&a), 1002).is_some(),
            "a found from worker 1"
        );
        // The same maps read as a group of one (another --workers): a fresh table.
        let SharedRegions {
            mut meta,
            index,
            records,
        } = FlowTable::group_into_regions(g2);
        meta[1] = FlowMeta::EMPTY;
        let one = SharedRegions {
            meta: Region::join(meta.split(2).into_iter().take(1).collect()),
            index: Region::join(index.split(2).into_iter().take(1).collect()),
            records: Region::join(records.split(2).into_iter().take(1).collect()),
        };
        let (mut t, opened) = FlowTable::open_group(one, 1, to, 1, 1003);
        assert!(
            matches!(opened, Opened::Fresh { ref reason } if reason.contains("workers")),
            "{opened:?}"
        );
        assert!(t[0].lookup(&fwd(&a), 1004).is_none());
    }

    /// The XDP program's look-up (`reply_of_held_flow` in bpf/steer.c), transcribed:
    /// the hash from four 32x32-bit products, the bounded probe, the record compare.
    fn bpf_reply_of_held_flow(t: &FlowTable, k: &FlowKey, now: u32) -> bool {
        let m = t.meta[0];
        let raw = RawKey::from_key(k);
        let (a, b) = (
            raw.addrs ^ m.seed,
            (u64::from(raw.ports) | (u64::from(raw.proto) << 32)) ^ m.seed2,
        );
        let (al, ah, bl, bh) = (a & 0xffff_ffff, a >> 32, b & 0xffff_ffff, b >> 32);
        let (ll, lh, hl, hh) = (al * bl, al * bh, ah * bl, ah * bh);
        let mid = (ll >> 32) + (lh & 0xffff_ffff) + (hl & 0xffff_ffff);
        let lo = (ll & 0xffff_ffff) | (mid << 32);
        let hi = hh
            .wrapping_add(lh >> 32)
            .wrapping_add(hl >> 32)
            .wrapping_add(mid >> 32);
        let h = lo ^ hi;
        let h = (h ^ (h >> 32)) as u32;
        let mask = m.index_slots - 1;
        for i in 0..MAX_PROBE as u32 {
            let slot = t.index[(h.wrapping_add(i) & mask) as usize];
            if slot == 0 {
                return m.seq & 1 == 1;
            }
            if (slot >> 32) as u32 != h {
                continue;
            }
            let low = (slot as u32) - 1;
            if low & 1 != 1 {
                continue;
            }
            let f = &t.flows[(low >> 1) as usize];
            if f.state != 0
                && f.backend == k.src
                && f.client == k.dst
                && f.backend_port == k.src_port
                && f.client_port == k.dst_port
                && f.proto == k.proto
                && (f.expires.wrapping_sub(now) as i32) > 0
            {
                return true;
            }
        }
        true
    }

    proptest! {
        /// The XDP program's look-up (transcribed) finds every held flow's reply and,
        /// for keys the table does not hold, agrees with the table: exact steering.
        #[test]
        fn bpf_lookup_matches_the_table(
            ops in prop::collection::vec((0u32..48, 0u8..3), 1..300),
            seed in any::<u64>(),
        ) {
            let mut t = FlowTable::new(32, Timeouts::default(), seed);
            let mut held: std::collections::HashMap<u32, FlowId> = Default::default();
            for (c, op) in ops {
                let f = flow(c % 6, (c / 6) as u16, 100 + c % 2);
                match op {
                    0 | 1 => {
                        if let std::collections::hash_map::Entry::Vacant(e) = held.entry(c) {
                            if let Ok(id) = t.insert(f, tcp_flags::ACK, 0) {
                                e.insert(id);
                            }
                        }
                    }
                    _ => {
                        if let Some(id) = held.remove(&c) {
                            t.remove(id);
                        }
                    }
                }
                for c2 in 0u32..48 {
                    let f2 = flow(c2 % 6, (c2 / 6) as u16, 100 + c2 % 2);
                    let want = held.contains_key(&c2);
                    prop_assert_eq!(bpf_reply_of_held_flow(&t, &rev(&f2), 1), want);
                    // A forward key is never taken for a reply.
                    prop_assert!(!bpf_reply_of_held_flow(&t, &fwd(&f2), 1) || fwd(&f2) == rev(&f2));
                }
            }
        }

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
