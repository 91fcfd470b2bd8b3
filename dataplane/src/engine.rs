//! The forwarding engine: one frame in, a verdict out. No I/O, no clock, no allocation
//! (but on the cold path of IPv4 fragments held for their first fragment, `crate::frag`).
//!
//! The caller (the AF_XDP loop, or a test) passes a frame it may rewrite in place, the
//! interface it arrived on, the current next-hop table and the time; the engine parses
//! it, finds or creates its flow, rewrites addresses, ports, TTL, checksums and MACs, and
//! says where the frame goes.
//!
//! Policy (see `docs/dataplane.md`):
//! - Not IPv4 (ARP, IPv6, VLAN-tagged): the kernel's ([`Verdict::Pass`]).
//! - IPv4 to a VIP: IP options and protocols other than TCP/UDP are dropped and counted;
//!   fragments follow their datagram's first fragment ([`crate::frag`]); TTL ≤ 1 goes to the kernel (ICMP time exceeded); a port/protocol the
//!   Service does not expose is dropped; a frontend without local backend is dropped.
//! - From a Pod interface: replies matching a flow are reverse-NATed; replies without a
//!   flow are dropped (never leaked un-NATed).

use crate::counters::{Counters, DropReason, ServiceCounters};
use crate::flow::{
    hash_key, Direction, Flow, FlowId, FlowKey, FlowState, FlowTable, InsertError, Timeouts,
};
use crate::frag::{Decision, FragKey, FragTable, Later};
use crate::neigh::{Neighbours, Resolve, Side};
use crate::packet::{self, tcp_flags, FastView, L4Checksum, MacAddr, NatSide, Parsed};
use crate::services::ServiceTable;

/// Why a frame goes to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    /// Not IPv4 (ARP, IPv6, VLAN-tagged ...).
    NotIpv4,
    /// IPv4, but neither to a VIP (uplink) nor a flow's reply (Pod side).
    NotForUs,
    /// TTL 0 or 1: the kernel sends ICMP time exceeded.
    TtlExpired,
}

/// What to do with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Transmit the (rewritten) frame out of this interface.
    Tx(Side),
    /// Leave the frame to the kernel (unchanged).
    Pass(PassReason),
    /// Drop it (counted).
    Drop(DropReason),
    /// Encapsulate it for another node and send it out of the uplink: take the details
    /// with [`Engine::take_redirect`] (frame unchanged so far).
    Redirect,
    /// Transmit out of this interface with this new frame length (a redirected packet,
    /// decapsulated in place).
    TxResized(Side, u16),
    /// Used up here, not forwarded and not a drop (a redirect notice, recorded).
    Consumed,
}

/// Engine settings.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Flow table capacity.
    pub flow_capacity: usize,
    /// IPv6 flow table capacity ([`crate::flow6`]).
    pub flow6_capacity: usize,
    /// Flow timeouts.
    pub timeouts: Timeouts,
    /// Recompute L4 checksums of replies from Pods instead of updating them
    /// incrementally (Pod veths with tx checksum offload hand over partial checksums).
    pub recompute_pod_checksums: bool,
    /// Seed of the flow-table hash (random per process; a pinned table keeps its own).
    pub hash_seed: u64,
    /// Most half-open TCP flows held at once; 0: a quarter of `flow_capacity`.
    pub half_open_max: usize,
    /// Most flows (and redirect records) one client address holds; 0: no quota.
    pub source_flow_quota: usize,
    /// Most flows (and redirect records) one client /24 holds; 0: no quota.
    pub prefix_flow_quota: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            flow_capacity: 1 << 20,
            flow6_capacity: 1 << 16,
            timeouts: Timeouts::default(),
            recompute_pod_checksums: true,
            hash_seed: 0x6a75_6e65_6175,
            half_open_max: 0,
            source_flow_quota: 0,
            prefix_flow_quota: 0,
        }
    }
}

/// Seed of the Maglev flow hash: fixed, so that every node and every restart picks the
/// same backend for the same 5-tuple.
pub const MAGLEV_HASH_SEED: u64 = 0x4a75_6e65_6175_4d67;

/// Next hops whose resolution the engine asked for, taken by the I/O loop after a batch:
/// `(next hop, ifindex)`, the next hop an IPv4 address (host order) or, for the IPv6
/// path, an IPv6 one. A fixed list: nothing allocates on the packet path.
#[derive(Debug, Default)]
pub struct MissingNeighbours<H = u32> {
    list: [(H, u32); 16],
    len: usize,
}

impl<H: Copy + PartialEq> MissingNeighbours<H> {
    fn push(&mut self, ip: H, ifindex: u32) {
        if self.list[..self.len].contains(&(ip, ifindex)) || self.len == self.list.len() {
            return;
        }
        self.list[self.len] = (ip, ifindex);
        self.len += 1;
    }

    /// Takes the recorded `(next hop, ifindex)` pairs.
    pub fn take(&mut self) -> impl Iterator<Item = (H, u32)> + '_ {
        let n = std::mem::take(&mut self.len);
        self.list[..n].iter().copied()
    }
}

/// What the established-flow fast path writes for one `(service, backend)` slot,
/// precomputed when the service table or the neighbour table changes: the new address
/// and port words, the checksum deltas (RFC 1624) that go with them — including the TTL
/// decrement for the IPv4 header — and the MACs towards the backend.
#[derive(Debug, Clone, Copy, Default)]
struct SlotRewrite {
    service: u32,
    backend: [u8; 4],
    backend_port: [u8; 2],
    vip: [u8; 4],
    vip_port: [u8; 2],
    /// Checksum deltas below are in native byte order (see [`ne`]).
    /// IPv4 header checksum delta, forward: VIP → backend, TTL − 1.
    fwd_ip: u16,
    /// L4 checksum delta, forward: VIP:port → backend:port.
    fwd_l4: u16,
    /// IPv4 header checksum delta, reverse: backend → VIP, TTL − 1.
    rev_ip: u16,
    /// L4 checksum delta, reverse: backend:port → VIP:port.
    rev_l4: u16,
    /// Forward egress: destination MAC then source MAC (bytes 0..12 of the frame).
    fwd_macs: [u8; 12],
    /// Forward egress interface; `None` when the backend's next hop is not resolved
    /// (the slow path drops and asks for resolution).
    fwd_side: Option<Side>,
}

/// One entry of the reply-egress cache: where packets to a client address go.
#[derive(Debug, Clone, Copy, Default)]
struct EgressEntry {
    ip: u32,
    valid: bool,
    side: Option<Side>,
    macs: [u8; 12],
}

/// The reply next-hop cache: one entry per reply-egress entry of the XDP fast path.
const EGRESS_CACHE: usize = crate::fast::EGRESS_ENTRIES;

/// The one's-complement delta of decrementing the TTL (the word `ttl << 8 | proto`
/// drops by 0x100): `~0x0100`.
const TTL_DELTA: u16 = !0x0100;

/// A checksum delta computed over big-endian words, as the native-order word its bytes
/// make: the one's-complement sum is byte-order independent (RFC 1071 §2(B)), so the
/// fast path reads, updates and writes checksum fields in native order, without swaps.
fn ne(delta_be: u16) -> u16 {
    u16::from_ne_bytes(delta_be.to_be_bytes())
}

fn macs(src: MacAddr, dst: MacAddr) -> [u8; 12] {
    let mut m = [0u8; 12];
    m[..6].copy_from_slice(&dst.0);
    m[6..].copy_from_slice(&src.0);
    m
}

/// How replies' L4 checksums are kept right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PodChecksums {
    /// Incremental when the incoming checksum is complete; recomputed when it is a
    /// partial (offload) checksum.
    Detect,
    /// Always incremental (`--trust-pod-checksums`).
    Trust,
}

/// The forwarding engine of one worker.
#[derive(Debug)]
pub struct Engine {
    flows: FlowTable,
    table: ServiceTable,
    counters: Counters,
    pod_checksum: PodChecksums,
    /// Per-slot rewrite data, valid for `rewrites_stamp`.
    rewrites: Vec<SlotRewrite>,
    /// Stamp of the neighbour table `rewrites` and `egress` were derived from (0: stale).
    rewrites_stamp: u64,
    /// Direct-mapped cache of reply next hops by client address.
    egress: Box<[EgressEntry; EGRESS_CACHE]>,
    /// The established-flow fast path is on (tests turn it off to compare).
    fast_path: bool,
    /// Next hops to resolve.
    pub missing: MissingNeighbours,
    /// Redirects between nodes, when configured.
    redirect: Option<crate::redirect::Redirector>,
    /// While a redirected packet is processed: the nodes it visited, its flags and its
    /// cookie.
    redirect_ctx: Option<(crate::redirect::HopList, u8, u64)>,
    /// This worker's part of the XDP fast path, when the steering program runs.
    xdp: Option<crate::fast::FastPath>,
    /// The new-flow admission per source prefix, shared by the workers (none: no limit).
    admission: Option<std::sync::Arc<crate::admission::Admission>>,
    /// Per flow record of this worker's table: the most a TCP segment towards the
    /// client may carry (payload + options), from the client's SYN (MSS option) and
    /// lowered by "fragmentation needed" for the flow; 0 = unknown. Process memory only
    /// (a restart falls back to the egress MTU). Read when a Pod's super-segment is cut
    /// ([`Engine::client_mss`], `crate::segment`).
    client_mss: Vec<u16>,
    /// IPv4 fragments: each datagram's first-fragment decision, early fragments held.
    frags: FragTable,
    /// Held fragments released by their first fragment, rewritten, with their egress:
    /// the runtime sends them after the batch ([`Engine::take_released`]).
    released: Vec<(Vec<u8>, Side)>,
    /// When the flow table was last swept.
    sweep_pace: SweepPace,
    /// Bounds the ICMP "fragmentation needed" this worker sends ([`Engine::frag_needed`]).
    icmp_bucket: crate::redirect::TokenBucket,
    /// `sessionAffinity: ClientIP`: the backend each client's new connections keep.
    affinity: crate::affinity::AffinityTable4,
    /// IPv6: its flow table, service table and counters (`engine6.rs`).
    v6: ipv6_path::V6,
}

/// The sweep passes over a whole flow table once per this many ms (so a record is
/// removed at most this late after it expired).
pub const SWEEP_PASS_MS: u64 = 1_000;
/// Most records one sweep examines (after a stall, the sweep catches up over several
/// iterations instead of stalling the loop).
pub const SWEEP_MAX_PER_CALL: usize = 4_096;

/// Paces the flow-table sweep by the clock. Paced by loop iterations instead (a fixed
/// budget each), a loop that spins on empty rings examined ~45 M records/s — a pass over
/// a 1 M-record table every 23 ms, 11 % of the path core in `juneau-perf`'s profile —
/// and evicted the hot flows' cache lines for nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct SweepPace {
    last_ms: Option<u64>,
}

impl SweepPace {
    /// Records to examine now in a table of `records`: one ms's share of a pass per ms
    /// elapsed since the last sweep (at most [`SWEEP_MAX_PER_CALL`]); 0 within the same
    /// ms and on the first call.
    pub fn budget(&mut self, now_ms: u64, records: usize) -> usize {
        let Some(last) = self.last_ms.replace(now_ms) else {
            return 0;
        };
        let elapsed = now_ms.saturating_sub(last);
        if elapsed == 0 {
            self.last_ms = Some(last);
            return 0;
        }
        let per_ms = records.div_ceil(SWEEP_PASS_MS as usize).max(1);
        per_ms
            .saturating_mul(elapsed as usize)
            .min(SWEEP_MAX_PER_CALL)
            .min(records.max(1))
    }
}

/// Datagrams the fragment table of one worker follows at once.
pub const FRAG_DATAGRAMS: usize = 4096;
/// How long a datagram's fragments are followed after its last one, ms.
pub const FRAG_TIMEOUT_MS: u64 = 5_000;

/// ICMP "fragmentation needed" one worker sends at once, and per second after that.
pub const ICMP_BURST: u32 = 50;
/// See [`ICMP_BURST`].
pub const ICMP_PER_SECOND: u32 = 100;

#[path = "engine_redirect.rs"]
mod redirect_path;

#[path = "engine_icmp.rs"]
mod icmp_path;
#[path = "engine6.rs"]
mod ipv6_path;
#[path = "engine6_redirect.rs"]
mod ipv6_redirect_path;
pub use ipv6_path::SharedFlows6;

impl Engine {
    /// An engine with an empty service table and a flow table on the heap.
    pub fn new(cfg: EngineConfig) -> Self {
        Self::with_flows(
            cfg,
            FlowTable::new(cfg.flow_capacity, cfg.timeouts, cfg.hash_seed),
        )
    }

    /// An engine with an empty service table over a given flow table (a pinned one,
    /// [`FlowTable::open_shared`]).
    pub fn with_flows(cfg: EngineConfig, mut flows: FlowTable) -> Self {
        if cfg.half_open_max > 0 {
            flows.set_half_open_max(cfg.half_open_max);
        }
        flows.set_source_quotas(cfg.source_flow_quota, cfg.prefix_flow_quota);
        Engine {
            flows,
            table: ServiceTable::default(),
            counters: Counters::default(),
            pod_checksum: if cfg.recompute_pod_checksums {
                PodChecksums::Detect
            } else {
                PodChecksums::Trust
            },
            rewrites: Vec::new(),
            rewrites_stamp: 0,
            egress: Box::new([EgressEntry::default(); EGRESS_CACHE]),
            fast_path: true,
            missing: MissingNeighbours::default(),
            redirect: None,
            redirect_ctx: None,
            xdp: None,
            admission: None,
            client_mss: vec![0; cfg.flow_capacity],
            frags: FragTable::new(FRAG_DATAGRAMS, FRAG_TIMEOUT_MS),
            released: Vec::new(),
            sweep_pace: SweepPace::default(),
            icmp_bucket: crate::redirect::TokenBucket::new(ICMP_PER_SECOND, ICMP_BURST),
            affinity: Default::default(),
            v6: ipv6_path::V6::new(crate::flow6::Flow6Table::new(
                cfg.flow6_capacity,
                cfg.timeouts,
            )),
        }
    }

    /// Held fragments released since the last call, rewritten, with their egress.
    pub fn take_released(&mut self) -> Vec<(Vec<u8>, Side)> {
        std::mem::take(&mut self.released)
    }

    /// Whether held fragments wait to be sent ([`Engine::take_released`]).
    pub fn has_released(&self) -> bool {
        !self.released.is_empty()
    }

    /// Datagrams whose fragments are followed now.
    pub fn fragment_datagrams(&self) -> usize {
        self.frags.len()
    }

    /// A later fragment (no transport header): the address its datagram's first
    /// fragment was NATed to, or held until that first fragment comes. `side` is the
    /// address rewritten: the destination towards a backend, the source of a reply.
    fn later_fragment(
        &mut self,
        frame: &mut [u8],
        mut v: packet::Ipv4View,
        side: NatSide,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let key = FragKey {
            src: v.src,
            dst: v.dst,
            id: packet::ip_id(frame),
            proto: v.protocol,
            reply: side == NatSide::Source,
        };
        // Before holding: a held fragment is sent later or dropped, never handed to the
        // kernel, which owes the sender its "time exceeded".
        if v.ttl <= 1 {
            return self.pass(PassReason::TtlExpired);
        }
        let d = match self.frags.later(key, frame, now_ms) {
            Later::Decided(d) => d,
            Later::Held => return Verdict::Consumed,
            Later::Refused => return self.drop(DropReason::FragmentHeldFull, None),
        };
        let service = (d.service < self.counters.services.len() as u32).then_some(d.service);
        let next = match side {
            NatSide::Destination => d.addr,
            NatSide::Source => v.dst,
        };
        let (out, src, dst) = match self.next_hop(nb, next, service) {
            Ok(hop) => hop,
            Err(dropped) => return dropped,
        };
        packet::rewrite_addr(frame, &mut v, side, d.addr);
        packet::decrement_ttl(frame, &mut v);
        packet::set_macs(frame, src, dst);
        if let Some(c) = service.and_then(|s| self.counters.services.get_mut(s as usize)) {
            c.forwarded(side == NatSide::Destination, frame.len());
        }
        Verdict::Tx(out)
    }

    /// A first fragment was NATed: later fragments of its datagram follow `d`; the ones
    /// that came early are rewritten now and queued for sending.
    fn fragment_decided(
        &mut self,
        key: FragKey,
        d: Decision,
        side: NatSide,
        nb: &Neighbours,
        now_ms: u64,
    ) {
        for mut f in self.frags.decided(key, d, now_ms) {
            let Ok(Parsed::Ipv4(v)) = packet::parse(&f) else {
                continue;
            };
            // Not sent: a drop, counted under its reason (no fragment is held with a
            // TTL the kernel must answer: `later_fragment` passes those at once).
            if let Verdict::Tx(out) = self.later_fragment(&mut f, v, side, nb, now_ms) {
                self.released.push((f, out));
            }
        }
    }

    /// The key of a fragment's datagram, for a first fragment; `None` for a whole one.
    fn first_fragment(
        &mut self,
        frame: &[u8],
        v: &mut packet::Ipv4View,
        side: NatSide,
    ) -> Result<Option<FragKey>, Verdict> {
        if !v.fragment {
            return Ok(None);
        }
        match packet::first_fragment_l4(frame, v) {
            Some(l4) => v.l4 = Some(l4),
            None => return Err(self.drop(DropReason::Fragment, None)),
        }
        Ok(Some(FragKey {
            src: v.src,
            dst: v.dst,
            id: packet::ip_id(frame),
            proto: v.protocol,
            reply: side == NatSide::Source,
        }))
    }

    /// The most a TCP segment of the connection `frame` belongs to may carry towards its
    /// client (payload + options): `frame` is a reply this engine has just reverse-NATed
    /// (`VIP:port -> client`). `None` when unknown (not TCP, no MSS option, another
    /// worker's flow, or a flow from before a restart).
    pub fn client_mss(&mut self, frame: &[u8], now_ms: u64) -> Option<u16> {
        let Ok(Parsed::Ipv4(v)) = packet::parse(frame) else {
            return self.client_mss6(frame, now_ms);
        };
        let l4 = v.l4.filter(|_| v.protocol == packet::IPPROTO_TCP)?;
        let key = FlowKey {
            src: v.dst,
            dst: v.src,
            src_port: l4.dst_port,
            dst_port: l4.src_port,
            proto: v.protocol,
        };
        let (id, _) = self.flows.lookup(&key, now_ms)?;
        self.client_mss.get(id as usize).copied().filter(|&m| m > 0)
    }

    /// Records a new TCP flow's client MSS (from its SYN), or lowers it for a path MTU.
    fn note_client_mss(&mut self, id: FlowId, mss: Option<u16>, lower_only: bool) {
        if let (Some(m), Some(slot)) = (mss, self.client_mss.get_mut(id as usize)) {
            if !lower_only || *slot == 0 || m < *slot {
                *slot = m;
            }
        }
    }

    /// Applies the new-flow admission (shared with the other workers and the steering
    /// program): packets of no flow from a source prefix beyond its rate are dropped
    /// (`new_flow_prefix_rate_limited`).
    pub fn set_admission(&mut self, admission: std::sync::Arc<crate::admission::Admission>) {
        self.admission = Some(admission);
    }

    /// Whether the new-flow admission lets a packet of no flow from the prefix `key`
    /// through; if so, its bucket is debited. (Read the clock only here: packets of held
    /// flows never come this way.)
    fn admitted(&self, key: u32) -> bool {
        self.admission
            .as_ref()
            .is_none_or(|a| a.admit(key, crate::region::monotonic_ns()))
    }

    /// Publishes this worker's established flows to the steering program's fast path
    /// (`fast_slots`) from now on, keeping it current with [`Engine::refresh_xdp`].
    pub fn set_xdp_fast_path(&mut self, mut part: crate::fast::FastPath) {
        part.set_complete_partial(self.pod_checksum == PodChecksums::Detect);
        self.xdp = Some(part);
        self.rewrites_stamp = 0;
    }

    /// Keeps the XDP fast path current: republishes it when the service table or the
    /// neighbours changed since it was published. One comparison when nothing changed;
    /// the forwarding loop calls it once per iteration (the program may be forwarding
    /// every packet, so no packet may be needed to trigger it).
    #[inline]
    pub fn refresh_xdp(&mut self, nb: &Neighbours) {
        if self.xdp.is_some() && nb.stamp() != self.rewrites_stamp {
            self.prepare(nb);
        }
    }

    /// Adds what the XDP fast path forwarded since the last fold to the per-service
    /// counters (and `xdp_fast_packets`). Off the packet path (with the statistics).
    pub fn fold_xdp_counters(&mut self) {
        // The slots' numbering is that of the rewrites, valid while they are current.
        if self.rewrites_stamp == 0 {
            return;
        }
        let Some(x) = self.xdp.as_mut() else {
            return;
        };
        let (rewrites, counters) = (&self.rewrites, &mut self.counters);
        x.fold(|slot, (packets_in, bytes_in), (packets_out, bytes_out)| {
            let service = rewrites.get(slot).map(|r| r.service as usize);
            if let Some(c) = service.and_then(|s| counters.services.get_mut(s)) {
                c.packets_in += packets_in;
                c.bytes_in += bytes_in;
                c.packets_out += packets_out;
                c.bytes_out += bytes_out;
            }
        });
        self.counters.xdp_fast_packets = x.packets();
        self.counters.xdp_fast_replies = x.replies();
    }

    /// Where the XDP program may send a slot's packets (see [`crate::fast`]).
    fn xdp_egress(rw: &SlotRewrite, nb: &Neighbours) -> crate::fast::Egress {
        Self::xdp_target(rw.fwd_side?, rw.fwd_macs, nb)
    }

    /// `side` as an XDP redirect target, if its interface takes XDP frames.
    fn xdp_target(side: Side, macs: [u8; 12], nb: &Neighbours) -> crate::fast::Egress {
        let ifindex = match side {
            Side::Uplink => nb.uplink().ifindex,
            Side::Pod(i) => nb.pods().get(usize::from(i))?.ifindex,
        };
        nb.takes_xdp_frames(ifindex).then_some((ifindex, macs))
    }

    /// Turns the established-flow fast path off (every packet takes the general path);
    /// for tests that check both paths give identical results.
    pub fn set_fast_path(&mut self, on: bool) {
        self.fast_path = on;
    }

    /// Rebuilds the per-slot rewrite data and clears the reply-egress cache for this
    /// neighbour table and the current service table. Costs a next-hop look-up per
    /// backend: done when either table changes, never per packet.
    #[cold]
    #[inline(never)]
    fn prepare(&mut self, nb: &Neighbours) {
        self.rewrites.clear();
        for (si, s) in self.table.services().iter().enumerate() {
            let vip = u32::from(s.frontend.vip);
            let vport = s.frontend.port;
            for b in &s.backends {
                let bip = u32::from(b.ip);
                let a_v = packet::addr_words(vip);
                let a_b = packet::addr_words(bip);
                let fwd_addr = packet::csum_delta(&a_v, &a_b);
                let rev_addr = packet::csum_delta(&a_b, &a_v);
                let (fwd_side, fwd_macs) = match nb.resolve(bip) {
                    Resolve::Found { side, src, dst } => (Some(side), macs(src, dst)),
                    _ => (None, [0; 12]),
                };
                self.rewrites.push(SlotRewrite {
                    service: si as u32,
                    backend: bip.to_be_bytes(),
                    backend_port: b.port.to_be_bytes(),
                    vip: vip.to_be_bytes(),
                    vip_port: vport.to_be_bytes(),
                    fwd_ip: ne(packet::csum_delta_add(fwd_addr, TTL_DELTA)),
                    fwd_l4: ne(packet::csum_delta_add(
                        fwd_addr,
                        packet::csum_delta(&[vport], &[b.port]),
                    )),
                    rev_ip: ne(packet::csum_delta_add(rev_addr, TTL_DELTA)),
                    rev_l4: ne(packet::csum_delta_add(
                        rev_addr,
                        packet::csum_delta(&[b.port], &[vport]),
                    )),
                    fwd_macs,
                    fwd_side,
                });
            }
        }
        for e in self.egress.iter_mut() {
            e.valid = false;
        }
        self.rewrites_stamp = nb.stamp();
        if let Some(x) = self.xdp.as_mut() {
            x.clear_egress();
            let slots: Vec<_> = self
                .rewrites
                .iter()
                .map(|rw| Self::xdp_egress(rw, nb))
                .collect();
            x.publish(self.table.generation32(), &self.flows.timeouts(), &slots);
        }
    }

    /// Installs a new service table. Per-service counters follow their frontend; flows
    /// are re-validated lazily (on their next packet) against the new table.
    pub fn set_services(&mut self, table: ServiceTable) {
        self.set_services6(table.v6.clone());
        // What the XDP fast path forwarded under the old table, then stop it until the
        // new one is published (`refresh_xdp`): its flows must be re-validated first.
        self.fold_xdp_counters();
        if let Some(x) = self.xdp.as_mut() {
            x.disable();
        }
        self.rewrites_stamp = 0;
        let mut counters = vec![ServiceCounters::default(); table.services().len()];
        for (i, old) in self.table.services().iter().enumerate() {
            let f = old.frontend;
            if let Some(j) = table.find(u32::from(f.vip), f.protocol.number(), f.port) {
                counters[j as usize] = self.counters.services[i];
            }
        }
        self.counters.services = counters;
        if let Some(r) = self.redirect.as_mut() {
            r.set_from_state(table.redirects());
        }
        self.table = table;
    }

    /// The service table in force.
    pub fn services(&self) -> &ServiceTable {
        &self.table
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The counters, mutable (the I/O layer adds its own).
    pub fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    /// The flow table.
    pub fn flows(&self) -> &FlowTable {
        &self.flows
    }

    /// Evicts expired flows and fragment records at the pace of the clock: a full pass
    /// over the flow table every [`SWEEP_PASS_MS`], whatever the loop's iteration rate.
    /// Call it every loop iteration; it returns at once while less than 1 ms passed.
    pub fn sweep_paced(&mut self, now_ms: u64) -> usize {
        match self.sweep_pace.budget(now_ms, self.flows.capacity()) {
            0 => 0,
            budget => self.sweep(now_ms, budget),
        }
    }

    /// Evicts up to `budget` expired flows (examines `budget` records).
    pub fn sweep(&mut self, now_ms: u64, budget: usize) -> usize {
        let expired = self.frags.expire(now_ms, budget);
        self.counters.drops[DropReason::FragmentExpired as usize] += expired;
        // The IPv6 table is swept at the same pace through its own capacity.
        let cap = self.flows.capacity().max(1);
        let budget6 = (budget * self.v6.capacity()).div_ceil(cap);
        self.flows.sweep(now_ms, budget) + self.sweep6(now_ms, budget6)
    }

    /// The egress and MACs towards `addr`; else the packet's drop, counted against
    /// `service` (a missing neighbour is queued for resolution).
    #[inline]
    fn next_hop(
        &mut self,
        nb: &Neighbours,
        addr: u32,
        service: Option<u32>,
    ) -> Result<(Side, MacAddr, MacAddr), Verdict> {
        match nb.resolve(addr) {
            Resolve::Found { side, src, dst } => Ok((side, src, dst)),
            Resolve::Miss { ip, ifindex } => {
                self.missing.push(ip, ifindex);
                Err(self.drop(DropReason::NoNeighbour, service))
            }
            Resolve::NoRoute => Err(self.drop(DropReason::NoRoute, service)),
        }
    }

    fn drop(&mut self, r: DropReason, service: Option<u32>) -> Verdict {
        self.counters.drop(r);
        if let Some(s) = service {
            self.counters.services[s as usize].drops += 1;
        }
        Verdict::Drop(r)
    }

    /// The flow-index hash of a frame's 5-tuple (0 when it has none), for
    /// [`Engine::warm`]. Reads the frame only.
    #[inline]
    pub fn flow_hash(&self, frame: &[u8]) -> u32 {
        if let Some(p) = packet::parse_fast(frame) {
            return self.flows.key_hash(&FlowKey {
                src: p.src,
                dst: p.dst,
                src_port: p.src_port,
                dst_port: p.dst_port,
                proto: p.protocol,
            });
        }
        match packet::parse(frame) {
            Ok(Parsed::Ipv4(v)) => match v.l4 {
                Some(l4) => self.flows.key_hash(&FlowKey {
                    src: v.src,
                    dst: v.dst,
                    src_port: l4.src_port,
                    dst_port: l4.dst_port,
                    proto: v.protocol,
                }),
                None => 0,
            },
            _ => 0,
        }
    }

    /// Pulls the flow-table memory of a batch (up to 64 hashes from
    /// [`Engine::flow_hash`]) into the cache; call before processing the batch.
    #[inline]
    pub fn warm(&self, hashes: &[u32]) -> u64 {
        self.flows.warm(hashes)
    }

    /// Processes one frame that arrived on `ingress`. On [`Verdict::Tx`] the frame has
    /// been rewritten; otherwise it is unchanged. Inlined into the caller's loop: the
    /// established-flow path is short and the general path is a call.
    #[inline(always)]
    pub fn process(
        &mut self,
        frame: &mut [u8],
        ingress: Side,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        self.counters.rx_packets += 1;
        if self.fast_path {
            if nb.stamp() != self.rewrites_stamp {
                self.prepare(nb);
            }
            // One protocol test, then a straight line per protocol (no second test).
            // (Shorter frames are not fast-path frames: `parse_fast` wants 42 bytes.)
            let proto = if frame.len() >= 42 { frame[23] } else { 0 };
            let done = match proto {
                packet::IPPROTO_UDP => self.fast::<false>(frame, ingress, nb, now_ms),
                packet::IPPROTO_TCP => self.fast::<true>(frame, ingress, nb, now_ms),
                _ => None,
            };
            if let Some(v) = done {
                return v;
            }
        }
        self.process_general(frame, ingress, nb, now_ms)
    }

    /// The fast path for one protocol: `None` sends the frame to the general path
    /// (nothing has been changed then).
    #[inline(always)]
    fn fast<const TCP: bool>(
        &mut self,
        frame: &mut [u8],
        ingress: Side,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        // TTL > 1 is checked by each path after its (read-only) flow look-up, where the
        // byte is needed anyway: it is not kept live across the look-up.
        let p = packet::parse_fast_as::<TCP>(frame)?;
        match ingress {
            Side::Uplink => self.forward_fast::<TCP>(frame, &p, now_ms),
            Side::Pod(_) => self.reverse_fast::<TCP>(frame, &p, nb, now_ms),
        }
    }

    /// Everything but established flows on common frames: full parse and policy.
    #[inline(never)]
    fn process_general(
        &mut self,
        frame: &mut [u8],
        ingress: Side,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let v = match packet::parse(frame) {
            Ok(Parsed::Ipv4(v)) => v,
            Ok(Parsed::NotIpv4(_)) if packet::ethertype(frame) == Some(packet::ETHERTYPE_IPV6) => {
                return self.process6(frame, ingress, nb, now_ms)
            }
            Ok(Parsed::NotIpv4(_)) => return self.pass(PassReason::NotIpv4),
            Err(_) => return self.drop(DropReason::Malformed, None),
        };
        match ingress {
            Side::Uplink => self.forward(frame, v, nb, now_ms),
            Side::Pod(_) => self.reverse(frame, v, nb, now_ms),
        }
    }

    fn pass(&mut self, r: PassReason) -> Verdict {
        self.counters.kernel_bound += 1;
        Verdict::Pass(r)
    }

    /// Checks an existing flow against the current service table; `Ok(slot)` with its
    /// `(service, backend)` slot, `Err` when its backend (or its whole frontend) is gone
    /// or its Service no longer admits its client, in which case the flow has been
    /// removed.
    #[inline]
    fn revalidate(&mut self, id: u32) -> Result<u32, Stale> {
        let gen = self.table.generation32();
        let f = self.flows.get(id);
        if f.checked_generation == gen {
            return Ok(f.slot);
        }
        self.revalidate_slow(id, f, gen)
    }

    /// Whether a lone SYN that found forward flow `id` opens a new connection: the client
    /// re-uses the 4-tuple of a connection that ended (its port is free again at once
    /// when the server closed first, while the record waits out its FIN timeout), or the
    /// flow's backend no longer takes new connections. The old record is removed then,
    /// and the SYN goes where any new connection goes. A SYN retransmitted during a
    /// handshake to a backend that is still Ready stays on its flow.
    #[cold]
    fn syn_reopens(&mut self, id: u32) -> bool {
        if FlowTable::is_remote(id) {
            // Another worker's record (only its owner removes it): left as it is. A
            // connection's packets reach one worker (the queue is picked from the
            // 4-tuple), so a re-used 4-tuple comes back to the record's owner.
            return false;
        }
        let handshake = matches!(
            self.flows.get(id).state(),
            FlowState::SynSent | FlowState::SynReceived
        );
        if handshake {
            match self.revalidate(id) {
                Ok(slot) if self.table.slot_is_ready(slot) => return false,
                Ok(_) => {}
                // Removed by the re-validation (its backend left), or no table yet.
                Err(_) => return true,
            }
        }
        self.flows.remove(id);
        true
    }

    #[cold]
    fn revalidate_slow(&mut self, id: u32, f: Flow, gen: u32) -> Result<u32, Stale> {
        if gen == 0 {
            // No service table yet (just started, state file not read): keep the flow
            // (found in the pinned table) for when it comes; drop this packet.
            return Err(Stale {
                reason: DropReason::NoServiceTable,
                service: None,
            });
        }
        match self.table.find(f.vip, f.proto, f.vip_port) {
            Some(s) if !self.table.service(s).admits(f.client) => {
                // New source ranges leave its client out: the flow ends here.
                self.flows.remove(id);
                Err(Stale {
                    reason: DropReason::SourceRangeDenied,
                    service: Some(s),
                })
            }
            Some(s) => {
                let svc = self.table.service(s);
                match svc.backend_index(f.backend, f.backend_port) {
                    Some(b) => {
                        let slot = svc.first_slot + b as u32;
                        // Another worker's flow stays unchecked until its owner sees it.
                        if let Some(rec) = self.flows.get_mut(id) {
                            rec.slot = slot;
                            rec.checked_generation = gen;
                        }
                        Ok(slot)
                    }
                    None => {
                        self.flows.remove(id);
                        Err(Stale {
                            reason: DropReason::BackendRemoved,
                            service: Some(s),
                        })
                    }
                }
            }
            None => {
                self.flows.remove(id);
                Err(Stale::GONE)
            }
        }
    }

    /// The established-flow forward path: a flow hit in the forward direction whose
    /// backend is resolved, on a frame [`packet::parse_fast`] accepted (TTL > 1). Every
    /// other case returns `None` before anything was changed, and the general path
    /// decides. The rewrite is a few stores and two one-fold checksum updates with the
    /// slot's precomputed deltas.
    #[inline(always)]
    fn forward_fast<const TCP: bool>(
        &mut self,
        frame: &mut [u8],
        p: &FastView,
        now_ms: u64,
    ) -> Option<Verdict> {
        // A SYN may open a new connection on an old record (`syn_reopens`): the
        // general path decides, as in the steering program.
        if TCP && p.tcp_flags & tcp_flags::SYN != 0 {
            return None;
        }
        let id = self.flows.find_live(&p.raw, Direction::Forward, now_ms)?;
        // This worker's flows only: another worker's take the general path.
        let f = self.flows.local(id)?;
        if f.checked_generation != self.table.generation32() {
            return None;
        }
        let h: &mut [u8; 42] = (&mut frame[..42]).try_into().ok()?;
        let ttl = h[22];
        if ttl <= 1 {
            return None;
        }
        // Disjoint fields: the rewrite data is read while the flow table is written.
        let rw = self.rewrites.get(f.slot as usize)?;
        let side = rw.fwd_side?;
        self.flows
            .touch_fast::<TCP>(id, Direction::Forward, p.tcp_flags, now_ms);
        h[..12].copy_from_slice(&rw.fwd_macs);
        h[22] = ttl - 1;
        let ipc = u16::from_ne_bytes([h[24], h[25]]);
        h[24..26].copy_from_slice(&packet::csum_apply(ipc, rw.fwd_ip).to_ne_bytes());
        h[30..34].copy_from_slice(&rw.backend);
        h[36..38].copy_from_slice(&rw.backend_port);
        // `rw.service` indexes the table the counters were sized for (set_services).
        // The two adds sit on either side of the checksum branch: together, LLVM turns
        // them into a slower vector add (load, shuffle, add, store).
        let c = &mut self.counters.services[rw.service as usize];
        c.packets_in += 1;
        l4_csum_update::<TCP>(frame, rw.fwd_l4);
        c.bytes_in += frame.len() as u64;
        Some(Verdict::Tx(side))
    }

    /// The established-flow reply path (see [`Engine::forward_fast`]). A partial
    /// (offload) checksum from the Pod is completed by recomputation; a complete one is
    /// updated incrementally.
    #[inline(always)]
    fn reverse_fast<const TCP: bool>(
        &mut self,
        frame: &mut [u8],
        p: &FastView,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        let id = self.flows.find_live(&p.raw, Direction::Reverse, now_ms)?;
        let f = self.flows.local(id)?;
        if f.checked_generation != self.table.generation32() {
            return None;
        }
        if frame[22] <= 1 {
            return None;
        }
        let client = f.client;
        let rw = self.rewrites.get(f.slot as usize)?;
        let (service, rev_ip, rev_l4, vip, vip_port) =
            (rw.service, rw.rev_ip, rw.rev_l4, rw.vip, rw.vip_port);
        let (side, m) = self.reply_egress(client, nb)?;
        let csum_off = if TCP {
            packet::FAST_TCP_CSUM
        } else {
            packet::FAST_UDP_CSUM
        };
        let field = u16::from_be_bytes([frame[csum_off], frame[csum_off + 1]]);
        let partial = self.pod_checksum == PodChecksums::Detect
            && (TCP || field != 0)
            && packet::is_partial_checksum(field, p.src, p.dst, p.protocol, p.l4_len);
        self.flows
            .touch_fast::<TCP>(id, Direction::Reverse, p.tcp_flags, now_ms);
        let h: &mut [u8; 42] = (&mut frame[..42]).try_into().ok()?;
        h[..12].copy_from_slice(&m);
        h[22] -= 1;
        let ipc = u16::from_ne_bytes([h[24], h[25]]);
        h[24..26].copy_from_slice(&packet::csum_apply(ipc, rev_ip).to_ne_bytes());
        h[26..30].copy_from_slice(&vip);
        h[34..36].copy_from_slice(&vip_port);
        if partial {
            recompute_fast(frame);
        } else {
            l4_csum_update::<TCP>(frame, rev_l4);
        }
        let c = &mut self.counters.services[service as usize];
        c.packets_out += 1;
        c.bytes_out += frame.len() as u64;
        Some(Verdict::Tx(side))
    }

    /// Where replies to `client` go: from the cache, or resolved and cached.
    #[inline(always)]
    fn reply_egress(&mut self, client: u32, nb: &Neighbours) -> Option<(Side, [u8; 12])> {
        let i = crate::fast::egress_index(client);
        if let Some(e) = self.cached_egress(i, client) {
            return e.side.map(|s| (s, e.macs));
        }
        self.reply_egress_miss(i, client, nb)
    }

    #[cold]
    fn reply_egress_miss(
        &mut self,
        i: usize,
        client: u32,
        nb: &Neighbours,
    ) -> Option<(Side, [u8; 12])> {
        match nb.resolve(client) {
            Resolve::Found { side, src, dst } => {
                let m = macs(src, dst);
                self.cache_egress(i, client, side, m, nb);
                Some((side, m))
            }
            // Not cached: the general path counts the drop and asks for resolution.
            _ => None,
        }
    }

    /// Caches where replies to `client` go (entry `i`) and publishes it to this
    /// worker's part of the XDP fast path.
    fn cache_egress(&mut self, i: usize, client: u32, side: Side, m: [u8; 12], nb: &Neighbours) {
        self.egress[i] = EgressEntry {
            ip: client,
            valid: true,
            side: Some(side),
            macs: m,
        };
        if let Some(x) = self.xdp.as_mut() {
            x.publish_egress(client, Self::xdp_target(side, m, nb));
        }
    }

    /// The general reply path resolved `client`: caches and publishes it unless the
    /// cache has it already. Replies of another worker's flows take only the general
    /// path; with this the XDP program finds their client in this worker's part
    /// (`other_egress` in `bpf/steer.c`) and fast-paths them.
    fn note_egress(&mut self, client: u32, side: Side, m: [u8; 12], nb: &Neighbours) {
        let i = crate::fast::egress_index(client);
        let same = self
            .cached_egress(i, client)
            .is_some_and(|e| e.side == Some(side) && e.macs == m);
        if !same {
            self.cache_egress(i, client, side, m, nb);
        }
    }

    /// Cache entry `i` if it holds `client` (`prepare` clears the cache, and the
    /// published entries with it, on every new neighbour snapshot).
    #[inline(always)]
    fn cached_egress(&self, i: usize, client: u32) -> Option<&EgressEntry> {
        let e = &self.egress[i];
        (e.valid && e.ip == client).then_some(e)
    }

    fn forward(
        &mut self,
        frame: &mut [u8],
        mut v: packet::Ipv4View,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        if !self.table.is_vip(v.dst) {
            if let Some(r) = self.redirect_in(frame, nb, now_ms) {
                return r;
            }
            return self.pass(PassReason::NotForUs);
        }
        if v.fragment && packet::fragment_offset(frame) != 0 {
            return self.later_fragment(frame, v, NatSide::Destination, nb, now_ms);
        }
        let frag = match self.first_fragment(frame, &mut v, NatSide::Destination) {
            Ok(k) => k,
            Err(verdict) => return verdict,
        };
        if v.has_options() {
            return self.drop(DropReason::IpOptions, None);
        }
        let Some(l4) = v.l4 else {
            if let Some(e) = packet::parse_icmp_error(frame, &v) {
                return self.forward_icmp_error(frame, v, e, nb, now_ms);
            }
            return self.drop(DropReason::UnsupportedProtocol, None);
        };
        if v.ttl <= 1 {
            return self.pass(PassReason::TtlExpired);
        }
        let key = FlowKey {
            src: v.src,
            dst: v.dst,
            src_port: l4.src_port,
            dst_port: l4.dst_port,
            proto: v.protocol,
        };
        // A client the Service's source ranges leave out is dropped here, before it
        // could be redirected, open a flow or take a held one's path (the steering
        // program drops it already unless a table holds its flow); a flow it held
        // (admitted by the ranges before) ends.
        let frontend = self.table.find(v.dst, v.protocol, l4.dst_port);
        if let Some(s) = frontend {
            if !self.table.service(s).admits(v.src) {
                if let Some((id, Direction::Forward)) = self.flows.lookup(&key, now_ms) {
                    if !FlowTable::is_remote(id) {
                        self.flows.remove(id);
                    }
                }
                return self.drop(DropReason::SourceRangeDenied, Some(s));
            }
        }
        // (The frontend found above says whether it hands flows on: no second look-up.)
        let hand_off = frontend.is_some_and(|s| self.table.service(s).hand_off);
        if let Some(r) = self.redirect_hook(frame.len(), (&key, hand_off), l4.tcp_flags, nb, now_ms)
        {
            return r;
        }
        let syn_only = v.protocol == packet::IPPROTO_TCP && tcp_flags::lone_syn(l4.tcp_flags);
        let found = match self.flows.lookup(&key, now_ms) {
            Some((id, Direction::Forward)) if syn_only && self.syn_reopens(id) => None,
            other => other,
        };
        let (id, service, new) = match found {
            Some((id, Direction::Forward)) => match self.revalidate(id) {
                Ok(slot) => (id, self.table.slot_service(slot), false),
                Err(e) => return self.drop(e.reason, e.service),
            },
            Some((_, Direction::Reverse)) => return self.drop(DropReason::FlowConflict, None),
            None => {
                let Some(s) = frontend else {
                    return self.drop(DropReason::PortNotExposed, None);
                };
                if self.table.service(s).host_network {
                    // The steering program passes these to the kernel (host-network
                    // backends): one here came before the program's map said so.
                    return self.drop(DropReason::KernelBound, Some(s));
                }
                if !self.admitted(crate::admission::key_v4(v.src)) {
                    return self.drop(DropReason::NewFlowPrefixRateLimited, Some(s));
                }
                let Some(bi) = self.pick_backend(s, &key, now_ms) else {
                    return self.no_backend(frame.len(), &key, syn_only, s, nb, now_ms);
                };
                let svc = self.table.service(s);
                // Only a SYN opens a TCP flow: anything else without a flow is a spoofed
                // segment or a connection this node never saw; a Pod would answer it
                // with a RST.
                if v.protocol == packet::IPPROTO_TCP && !syn_only {
                    return self.drop(DropReason::NonSynWithoutFlow, Some(s));
                }
                let b = svc.backends[bi];
                let flow = Flow::new(
                    v.src,
                    l4.src_port,
                    v.dst,
                    l4.dst_port,
                    u32::from(b.ip),
                    b.port,
                    v.protocol,
                    svc.first_slot + bi as u32,
                    self.table.generation32(),
                );
                let rev = FlowKey {
                    src: flow.backend,
                    dst: v.src,
                    src_port: b.port,
                    dst_port: l4.src_port,
                    proto: v.protocol,
                };
                if self.flows.lookup(&rev, now_ms).is_some() {
                    return self.drop(DropReason::FlowConflict, Some(s));
                }
                match self.flows.insert(flow, l4.tcp_flags, now_ms) {
                    Ok(id) => (id, s, true),
                    Err(InsertError::Full) => return self.drop(DropReason::FlowTableFull, Some(s)),
                    Err(InsertError::SourceOverQuota) => {
                        return self.drop(DropReason::SourceOverQuota, Some(s))
                    }
                }
            }
        };
        let f = self.flows.get(id);
        let (side, src, dst) = match self.next_hop(nb, f.backend, Some(service)) {
            Ok(hop) => hop,
            Err(dropped) => return dropped,
        };
        if !new {
            self.flows
                .touch(id, Direction::Forward, l4.tcp_flags, now_ms);
        }
        packet::rewrite_addr_port(
            frame,
            &mut v,
            NatSide::Destination,
            f.backend,
            f.backend_port,
            L4Checksum::Incremental,
        );
        packet::decrement_ttl(frame, &mut v);
        packet::set_macs(frame, src, dst);
        if new && v.protocol == packet::IPPROTO_TCP {
            self.note_client_mss(id, crate::segment::syn_mss(frame), false);
        }
        if let Some(k) = frag {
            let d = Decision {
                addr: f.backend,
                service,
            };
            self.fragment_decided(k, d, NatSide::Destination, nb, now_ms);
        }
        let c = &mut self.counters.services[service as usize];
        c.forwarded(true, frame.len());
        c.new_flows += u64::from(new);
        Verdict::Tx(side)
    }

    /// The Ready backend (index in the service's backends) a new flow of `key` to service
    /// `s` goes to: Maglev of its 5-tuple, or with ClientIP affinity the client's kept
    /// backend, else Maglev of the client's address alone ([`crate::affinity`]).
    fn pick_backend(&mut self, s: u32, key: &FlowKey, now_ms: u64) -> Option<usize> {
        let svc = self.table.service(s);
        let Some(timeout_ms) = svc.client_ip_affinity_ms else {
            return svc.pick_index(hash_key(key, MAGLEV_HASH_SEED));
        };
        let client_only = FlowKey {
            src: key.src,
            dst: 0,
            src_port: 0,
            dst_port: 0,
            proto: 0,
        };
        let hashed = svc.pick_index(hash_key(&client_only, MAGLEV_HASH_SEED));
        let f = svc.frontend;
        self.affinity.pick(
            (u32::from(f.vip), f.protocol.number(), f.port),
            key.src,
            timeout_ms,
            now_ms,
            svc.ready_backends(),
            hashed,
        )
    }

    /// No Ready backend here for a new flow. A lone SYN goes to a peer that may have one
    /// (redirects on): the node lost its last Ready backend and asked to withdraw its
    /// route, which the router has not applied yet (or the node before had no backend
    /// either), or the Service's policy is Cluster. The next peer that has one serves it
    /// and tells the first node, like the owner of a moved connection: the connection
    /// opens instead of waiting a second for its SYN's retransmission. Charged to the
    /// redirect bucket, except under the Cluster policy. A UDP datagram of a new flow is
    /// handed on the same way under the Cluster policy (uncharged), and the owner's
    /// notice makes the record its later datagrams follow. Anything else, or a flow
    /// no peer is left for, is dropped (`no_backend`; `redirect_no_peer` on a later node).
    #[cold]
    fn no_backend(
        &mut self,
        frame_len: usize,
        key: &FlowKey,
        syn_only: bool,
        service: u32,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let hand_off = self.table.service(service).hand_off;
        if (syn_only && self.redirects_tcp(key)) || self.redirects_udp(key, hand_off) {
            // (A datagram is handed on only under the Cluster policy.)
            let how = redirect_path::Handing::new_flow(hand_off);
            if let Some(v) = self.ask_next_peer(how, frame_len, key, nb, now_ms) {
                return v;
            }
        }
        self.drop(self.no_backend_reason(), Some(service))
    }

    /// An ICMP error to a VIP about a packet we sent out (e.g. "fragmentation needed"
    /// from a router on the client's path): handed to the flow's backend so path-MTU
    /// discovery works through the VIP. Errors about no known flow are dropped.
    fn forward_icmp_error(
        &mut self,
        frame: &mut [u8],
        v: packet::Ipv4View,
        e: packet::IcmpErrorView,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        if v.ttl <= 1 {
            return self.pass(PassReason::TtlExpired);
        }
        // The quoted packet went VIP:port -> client: the flow's forward key swapped.
        let key = FlowKey {
            src: e.inner_dst,
            dst: e.inner_src,
            src_port: e.inner_dst_port,
            dst_port: e.inner_src_port,
            proto: e.inner_protocol,
        };
        if e.inner_src == v.dst {
            // A flow another node holds: the error goes there, like its packets.
            if let Some(r) = self.redirect_icmp_error(frame.len(), &key, nb, now_ms) {
                return r;
            }
        }
        let (id, service) = match self.flows.lookup(&key, now_ms) {
            Some((id, Direction::Forward)) if e.inner_src == v.dst => match self.revalidate(id) {
                Ok(slot) => (id, self.table.slot_service(slot)),
                Err(e) => return self.drop(e.reason, e.service),
            },
            _ => return self.drop(DropReason::NoFlow, None),
        };
        if let Some(mtu) = packet::frag_needed_mtu(frame, &v) {
            // The client's path takes at most this: cut the Pod's super-segments to it.
            self.note_client_mss(id, Some(mtu.saturating_sub(40)), true);
        }
        self.relay_icmp_error(frame, v, &e, (id, service), Direction::Forward, nb)
    }

    /// A backend's ICMP error about a packet we DNATed to it (e.g. UDP port
    /// unreachable): sent to the client as if from the VIP, quoting the packet as the
    /// client sent it.
    fn reverse_icmp_error(
        &mut self,
        frame: &mut [u8],
        v: packet::Ipv4View,
        e: packet::IcmpErrorView,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        // The quoted packet went client -> backend: the flow's reverse key swapped.
        let key = FlowKey {
            src: e.inner_dst,
            dst: e.inner_src,
            src_port: e.inner_dst_port,
            dst_port: e.inner_src_port,
            proto: e.inner_protocol,
        };
        let (id, service) = match self.flows.lookup(&key, now_ms) {
            Some((id, Direction::Reverse)) if e.inner_dst == v.src => match self.revalidate(id) {
                Ok(slot) => (id, self.table.slot_service(slot)),
                Err(e) => return self.drop(e.reason, e.service),
            },
            _ => return self.drop(DropReason::NoFlow, None),
        };
        if v.ttl <= 1 {
            return self.pass(PassReason::TtlExpired);
        }
        self.relay_icmp_error(frame, v, &e, (id, service), Direction::Reverse, nb)
    }

    /// Sends an ICMP error about flow `id` on: toward the backend (`Forward`: it quotes
    /// our reply as the client got it, from the VIP) or toward the client (`Reverse`: it
    /// quotes the client's packet as the backend got it, to the backend). The quoted
    /// packet is rewritten back to what its receiver sent, and so is the outer address
    /// that names the flow's far end.
    fn relay_icmp_error(
        &mut self,
        frame: &mut [u8],
        mut v: packet::Ipv4View,
        e: &packet::IcmpErrorView,
        (id, service): (FlowId, u32),
        toward: Direction,
        nb: &Neighbours,
    ) -> Verdict {
        let f = self.flows.get(id);
        let (to, outer, quoted, addr, port) = match toward {
            Direction::Forward => (
                f.backend,
                NatSide::Destination,
                NatSide::Source,
                f.backend,
                f.backend_port,
            ),
            Direction::Reverse => (
                f.client,
                NatSide::Source,
                NatSide::Destination,
                f.vip,
                f.vip_port,
            ),
        };
        let (side, src, dst) = match self.next_hop(nb, to, Some(service)) {
            Ok(hop) => hop,
            Err(dropped) => return dropped,
        };
        packet::rewrite_icmp_error(frame, &mut v, e, outer, addr, quoted, addr, port);
        packet::decrement_ttl(frame, &mut v);
        packet::set_macs(frame, src, dst);
        self.counters.services[service as usize]
            .forwarded(toward == Direction::Forward, frame.len());
        Verdict::Tx(side)
    }

    fn reverse(
        &mut self,
        frame: &mut [u8],
        mut v: packet::Ipv4View,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        if v.fragment && packet::fragment_offset(frame) != 0 {
            return self.later_fragment(frame, v, NatSide::Source, nb, now_ms);
        }
        let frag = match self.first_fragment(frame, &mut v, NatSide::Source) {
            Ok(k) => k,
            Err(verdict) => return verdict,
        };
        let Some(l4) = v.l4 else {
            if let Some(e) = packet::parse_icmp_error(frame, &v) {
                if !v.has_options() {
                    return self.reverse_icmp_error(frame, v, e, nb, now_ms);
                }
            }
            // Fragments, options-less non-TCP/UDP: the steering program only sends TCP/UDP
            // from backend ports, so these are malformed or fragmented replies.
            return if v.fragment {
                self.drop(DropReason::Fragment, None)
            } else {
                self.drop(DropReason::UnsupportedProtocol, None)
            };
        };
        if v.has_options() {
            return self.drop(DropReason::IpOptions, None);
        }
        let key = FlowKey {
            src: v.src,
            dst: v.dst,
            src_port: l4.src_port,
            dst_port: l4.dst_port,
            proto: v.protocol,
        };
        let (id, service) = match self.flows.lookup(&key, now_ms) {
            Some((id, Direction::Reverse)) => match self.revalidate(id) {
                Ok(slot) => (id, self.table.slot_service(slot)),
                Err(e) => return self.drop(e.reason, e.service),
            },
            _ => return self.drop(DropReason::NoFlow, None),
        };
        if v.ttl <= 1 {
            return self.pass(PassReason::TtlExpired);
        }
        let f = self.flows.get(id);
        let (side, src, dst) = match self.next_hop(nb, f.client, Some(service)) {
            Ok(hop) => hop,
            Err(dropped) => return dropped,
        };
        self.note_egress(f.client, side, macs(src, dst), nb);
        self.flows
            .touch(id, Direction::Reverse, l4.tcp_flags, now_ms);
        let l4csum = match self.pod_checksum {
            // A fragment's checksum covers the whole datagram: only ever incremental (a
            // Pod's kernel completes the checksum of a datagram it fragments).
            _ if frag.is_some() => L4Checksum::Incremental,
            PodChecksums::Trust => L4Checksum::Incremental,
            PodChecksums::Detect => {
                let off = packet::l4_csum_offset(&v);
                let field = u16::from_be_bytes([frame[off], frame[off + 1]]);
                let l4_len = (v.total_len - v.header_len) as u16;
                if packet::is_partial_checksum(field, v.src, v.dst, v.protocol, l4_len) {
                    L4Checksum::Recompute
                } else {
                    L4Checksum::Incremental
                }
            }
        };
        packet::rewrite_addr_port(frame, &mut v, NatSide::Source, f.vip, f.vip_port, l4csum);
        packet::decrement_ttl(frame, &mut v);
        packet::set_macs(frame, src, dst);
        if let Some(k) = frag {
            let d = Decision {
                addr: f.vip,
                service,
            };
            self.fragment_decided(k, d, NatSide::Source, nb, now_ms);
        }
        self.counters.services[service as usize].forwarded(false, frame.len());
        Verdict::Tx(side)
    }
}

/// Why a held flow no longer stands ([`Engine::revalidate`]; it has been removed): the
/// drop its packet is counted as, and its Service if that is still served.
#[derive(Debug, Clone, Copy)]
struct Stale {
    reason: DropReason,
    service: Option<u32>,
}

impl Stale {
    /// The frontend (or the whole table) is gone.
    const GONE: Stale = Stale {
        reason: DropReason::BackendRemoved,
        service: None,
    };
}

/// Applies a precomputed delta to the L4 checksum of a frame [`packet::parse_fast`]
/// accepted. A UDP datagram without checksum (0) keeps none; a UDP result of 0 is sent
/// as 0xffff.
#[inline(always)]
fn l4_csum_update<const TCP: bool>(frame: &mut [u8], delta: u16) {
    // Native-order words and delta (see `ne`); 0 and 0xffff read the same either way.
    if TCP {
        if let Some(c) = frame.get_mut(packet::FAST_TCP_CSUM..packet::FAST_TCP_CSUM + 2) {
            let v = packet::csum_apply(u16::from_ne_bytes([c[0], c[1]]), delta);
            c.copy_from_slice(&v.to_ne_bytes());
        }
    } else if let Some(c) = frame.get_mut(packet::FAST_UDP_CSUM..packet::FAST_UDP_CSUM + 2) {
        let old = u16::from_ne_bytes([c[0], c[1]]);
        if old != 0 {
            // `~(~old +' delta)` with 0 sent as 0xffff equals `old +' ~delta` (one's-
            // complement subtraction, end-around carry): the two agree on every non-zero
            // value, and for a non-zero `old` the latter never yields 0x0000, so zero
            // comes out as 0xffff either way. One `not` and one fold, no zero test.
            let s = u32::from(old) + u32::from(!delta);
            let v = ((s & 0xffff) + (s >> 16)) as u16;
            c.copy_from_slice(&v.to_ne_bytes());
        }
    }
}

/// Recomputes the L4 checksum of a (rewritten) frame [`packet::parse_fast`] accepted.
#[cold]
fn recompute_fast(frame: &mut [u8]) {
    if let Ok(Parsed::Ipv4(v)) = packet::parse(frame) {
        packet::recompute_l4_checksum(frame, &v);
    }
}

#[cfg(test)]
mod tests {
    /// The sweep follows the clock: nothing on the first call or within the same ms, one
    /// ms's share of a pass per elapsed ms, bounded after a stall, and a whole pass over
    /// the table in [`super::SWEEP_PASS_MS`] however often the loop calls it.
    #[test]
    fn the_sweep_passes_over_the_table_once_per_pass_time() {
        let mut p = super::SweepPace::default();
        let records = 1 << 20;
        assert_eq!(p.budget(100, records), 0);
        assert_eq!(p.budget(100, records), 0);
        let per_ms = records.div_ceil(super::SWEEP_PASS_MS as usize);
        assert_eq!(p.budget(101, records), per_ms);
        assert_eq!(p.budget(103, records), 2 * per_ms);
        assert_eq!(p.budget(10_103, records), super::SWEEP_MAX_PER_CALL);
        let mut examined = 0;
        for ms in 10_104..10_104 + super::SWEEP_PASS_MS {
            for _ in 0..50 {
                examined += p.budget(ms, records);
            }
        }
        assert!(
            examined >= records && examined < records + per_ms,
            "{examined}"
        );
        let mut small = super::SweepPace::default();
        small.budget(0, 10);
        assert_eq!(small.budget(5, 10), 5);
        assert_eq!(small.budget(5_000, 10), 10);
    }

    /// The fast path's UDP checksum update (`old +' ~delta`) writes exactly what the
    /// RFC 1624 form (`~(~old +' delta)`, 0 sent as 0xffff) writes, for every non-zero
    /// checksum against a spread of deltas (and every delta against a spread of
    /// checksums).
    #[test]
    fn udp_checksum_update_equals_rfc1624_form() {
        let reference = |old: u16, delta: u16| match crate::packet::csum_apply(old, delta) {
            0 => 0xffff,
            v => v,
        };
        let check = |old: u16, delta: u16| {
            let mut f = [0u8; 42];
            f[40..42].copy_from_slice(&old.to_ne_bytes());
            super::l4_csum_update::<false>(&mut f, delta);
            let got = u16::from_ne_bytes([f[40], f[41]]);
            assert_eq!(
                got,
                reference(old, delta),
                "old {old:#06x} delta {delta:#06x}"
            );
        };
        let some = [0u16, 1, 2, 0x7fff, 0x8000, 0xfffe, 0xffff, 0x1234, 0xedcb];
        for old in 1..=0xffffu16 {
            for &d in &some {
                check(old, d);
            }
        }
        for d in 0..=0xffffu16 {
            for &old in some.iter().filter(|&&o| o != 0) {
                check(old, d);
            }
        }
    }

    use super::*;
    use crate::neigh::{Iface, Route};
    use crate::packet::tests::{assert_checksums_valid, build, build_with, set_partial_checksum};
    use crate::packet::{tcp_flags, MacAddr, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};
    use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    const CLIENT: [u8; 4] = [192, 0, 2, 1];
    const VIP: [u8; 4] = [203, 0, 113, 10];
    const B1: [u8; 4] = [10, 1, 0, 5];
    const B2: [u8; 4] = [10, 1, 1, 5];
    const UP_MAC: MacAddr = MacAddr([0xa0; 6]);
    const P0_MAC: MacAddr = MacAddr([0xb0; 6]);
    const P1_MAC: MacAddr = MacAddr([0xb1; 6]);
    const GW_MAC: MacAddr = MacAddr([0x11; 6]);
    const B1_MAC: MacAddr = MacAddr([0x51; 6]);
    const B2_MAC: MacAddr = MacAddr([0x52; 6]);

    fn ip(a: [u8; 4]) -> u32 {
        u32::from_be_bytes(a)
    }

    fn neighbours() -> Neighbours {
        let mut n = Neighbours::new(
            Iface {
                ifindex: 2,
                mac: UP_MAC,
            },
            vec![
                Iface {
                    ifindex: 10,
                    mac: P0_MAC,
                },
                Iface {
                    ifindex: 11,
                    mac: P1_MAC,
                },
            ],
        );
        n.add_route(Route {
            prefix: 0,
            len: 0,
            gateway: Some(ip([192, 0, 2, 254])),
            ifindex: 2,
        });
        n.add_route(Route {
            prefix: ip(B1),
            len: 32,
            gateway: None,
            ifindex: 10,
        });
        n.add_route(Route {
            prefix: ip(B2),
            len: 32,
            gateway: None,
            ifindex: 11,
        });
        n.add_neighbour(ip([192, 0, 2, 254]), 2, GW_MAC);
        n.add_neighbour(ip(B1), 10, B1_MAC);
        n.add_neighbour(ip(B2), 11, B2_MAC);
        n
    }

    fn maglev(n: usize) -> Vec<u16> {
        (0..251).map(|i| (i % n.max(1)) as u16).collect()
    }

    fn state(backends: &[[u8; 4]]) -> (NodeState, Vec<Vec<u16>>) {
        let bs: Vec<LocalBackend> = backends
            .iter()
            .map(|b| LocalBackend {
                ip: Ipv4Addr::from(*b),
                port: 8080,
            })
            .collect();
        let mut s = NodeState {
            node: "node-a".into(),
            services: vec![
                NodeService {
                    frontend: Frontend {
                        vip: Ipv4Addr::from(VIP),
                        protocol: Protocol::Tcp,
                        port: 80,
                    },
                    backends: bs.clone(),
                    terminating: Vec::new(),
                    source_ranges: Vec::new(),
                    client_ip_affinity: None,
                    hand_off: false,
                    host_network: false,
                },
                NodeService {
                    frontend: Frontend {
                        vip: Ipv4Addr::from(VIP),
                        protocol: Protocol::Udp,
                        port: 53,
                    },
                    backends: bs.clone(),
                    terminating: Vec::new(),
                    source_ranges: Vec::new(),
                    client_ip_affinity: None,
                    hand_off: false,
                    host_network: false,
                },
                NodeService {
                    frontend: Frontend {
                        vip: Ipv4Addr::from([203, 0, 113, 11]),
                        protocol: Protocol::Tcp,
                        port: 80,
                    },
                    backends: vec![],
                    terminating: Vec::new(),
                    source_ranges: Vec::new(),
                    client_ip_affinity: None,
                    hand_off: false,
                    host_network: false,
                },
            ],
            ..Default::default()
        };
        s.normalize();
        let m = s
            .services
            .iter()
            .map(|x| {
                if x.backends.is_empty() {
                    vec![]
                } else {
                    maglev(x.backends.len())
                }
            })
            .collect();
        (s, m)
    }

    fn engine(backends: &[[u8; 4]]) -> Engine {
        let (s, m) = state(backends);
        engine_for(&s, &m)
    }

    /// An engine (1 024 flows) serving `st` with its Maglev tables `m`.
    fn engine_for(st: &NodeState, m: &[Vec<u16>]) -> Engine {
        let mut e = Engine::new(EngineConfig {
            flow_capacity: 1024,
            ..Default::default()
        });
        e.set_services(ServiceTable::new(1, st, m));
        e
    }

    fn update(e: &mut Engine, generation: u64, backends: &[[u8; 4]]) {
        let (s, m) = state(backends);
        e.set_services(ServiceTable::new(generation, &s, &m));
    }

    fn syn(cport: u16) -> Vec<u8> {
        build_with(IPPROTO_TCP, CLIENT, cport, VIP, 80, b"", 64, tcp_flags::SYN)
    }

    fn parse(f: &[u8]) -> packet::Ipv4View {
        match packet::parse(f).unwrap() {
            Parsed::Ipv4(v) => v,
            _ => panic!(),
        }
    }

    fn tcp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Vec<u8> {
        build_with(IPPROTO_TCP, src, sport, dst, dport, b"", 64, flags)
    }

    /// The real steering program (loaded from a temporary pin directory, the loopback in
    /// the uplink's role) over an engine's shared flow table, the engine serving one
    /// service with backends B1 and B2 and the program synced to it. Loads BPF: needs root.
    fn steered_engine() -> anyhow::Result<(tempfile::TempDir, crate::steering::Steering, Engine)> {
        let dir = tempfile::tempdir()?;
        let (mut st, regions, _) = crate::steering::Steering::load(dir.path(), 1024, 1, false)
            .map_err(|e| e.context("loading the steering program (run as root)"))?;
        let cfg = EngineConfig {
            flow_capacity: 1024,
            ..Default::default()
        };
        let now = crate::region::monotonic_ms();
        let (tables, _) = FlowTable::open_group(regions, 1, cfg.timeouts, 7, now);
        let mut e = Engine::with_flows(cfg, tables.into_iter().next().expect("a table"));
        update(&mut e, 1, &[B1, B2]);
        st.sync(e.services())?;
        st.configure_test_uplink()?;
        Ok((dir, st, e))
    }

    /// The steering program's XDP fast path, run by the kernel (`BPF_PROG_TEST_RUN` of
    /// the real program over this engine's own shared flow table and fast-path part),
    /// writes exactly the bytes `Engine::process` writes for forward packets of
    /// established flows — TCP and UDP, any TTL > 1, any checksum value incl. UDP's 0 —
    /// and leaves to userspace (unchanged, to the empty socket slot: `XDP_DROP`) what
    /// the engine must decide: SYN/FIN/RST, a flow not re-validated since the service
    /// table changed, a part not yet republished. Loads BPF: needs root.
    #[test]
    fn the_xdp_fast_path_writes_what_the_engine_writes() -> anyhow::Result<()> {
        use crate::steering::{SteeredIface, Steering};
        const XDP_DROP: u32 = 1;
        const XDP_REDIRECT: u32 = 4;
        let (_dir, mut st, mut e) = steered_engine()?;
        let now = crate::region::monotonic_ms;
        e.set_xdp_fast_path(st.take_fast_parts(1).remove(0));
        let mut nb = neighbours();
        nb.set_xdp_frame_targets(vec![10, 11]);
        e.refresh_xdp(&nb);

        // Establish a TCP connection through the engine, and a UDP flow.
        let mut f = syn(44000);
        assert!(matches!(
            e.process(&mut f, Side::Uplink, &nb, now()),
            Verdict::Tx(_)
        ));
        let b = Ipv4Addr::from(parse(&f).dst).octets();
        let mut r = tcp(b, 8080, CLIENT, 44000, tcp_flags::SYN | tcp_flags::ACK);
        assert!(matches!(
            e.process(&mut r, Side::Pod(0), &nb, now()),
            Verdict::Tx(_)
        ));
        let mut u = build_with(IPPROTO_UDP, CLIENT, 44001, VIP, 53, b"q", 64, 0);
        assert!(matches!(
            e.process(&mut u, Side::Uplink, &nb, now()),
            Verdict::Tx(_)
        ));

        let bu = Ipv4Addr::from(parse(&u).dst).octets();

        // `fast`: the program must forward it as the engine does; else leave it alone.
        // Packets come in on the loopback, in the uplink's role unless `reply`.
        fn check_on(
            st: &Steering,
            e: &mut Engine,
            nb: &Neighbours,
            f: Vec<u8>,
            reply: bool,
            fast: bool,
            what: &str,
        ) -> anyhow::Result<()> {
            let (action, out) = st.test_run(&f, 1)?;
            let mut want = f.clone();
            let ingress = if reply { Side::Pod(0) } else { Side::Uplink };
            let v = e.process(&mut want, ingress, nb, crate::region::monotonic_ms());
            if fast {
                let egress_ok = match v {
                    Verdict::Tx(Side::Pod(_)) => !reply,
                    Verdict::Tx(Side::Uplink) => reply,
                    _ => false,
                };
                assert!(egress_ok, "{what}: engine {v:?}");
                assert_eq!(action, XDP_REDIRECT, "{what}");
                assert_eq!(out, want, "{what}: program and engine differ");
            } else {
                assert_eq!(action, XDP_DROP, "{what}: to the (empty) socket slot");
                assert_eq!(out, f, "{what}: left unchanged");
            }
            Ok(())
        }
        fn check(
            st: &Steering,
            e: &mut Engine,
            nb: &Neighbours,
            f: Vec<u8>,
            fast: bool,
            what: &str,
        ) -> anyhow::Result<()> {
            check_on(st, e, nb, f, false, fast, what)
        }
        // The client's ACK completes the handshake in the engine: userspace's.
        check(
            &st,
            &mut e,
            &nb,
            tcp(CLIENT, 44000, VIP, 80, tcp_flags::ACK),
            false,
            "handshake ACK",
        )?;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for i in 0..300 {
            let x = next();
            let ttl = 2 + (x % 254) as u8;
            let payload = vec![(x >> 8) as u8; (x >> 16) as usize % 64];
            let udp = i % 2 == 0;
            let mut f = if udp {
                build_with(IPPROTO_UDP, CLIENT, 44001, VIP, 53, &payload, ttl, 0)
            } else {
                let flags = if x & (1 << 40) != 0 {
                    0x08 | tcp_flags::ACK
                } else {
                    tcp_flags::ACK
                };
                build_with(IPPROTO_TCP, CLIENT, 44000, VIP, 80, &payload, ttl, flags)
            };
            // Any checksum values: both sides update incrementally, valid or not.
            let c = (next() & 0xffff) as u16;
            let l4c = if udp { 40 } else { 50 };
            match i % 7 {
                0 => f[l4c..l4c + 2].copy_from_slice(&[0, 0]),
                1 => f[l4c..l4c + 2].copy_from_slice(&[0xff, 0xff]),
                2 => f[24..26].copy_from_slice(&[0xff, 0xff]),
                3 => f[l4c..l4c + 2].copy_from_slice(&c.to_be_bytes()),
                4 => f[24..26].copy_from_slice(&c.to_be_bytes()),
                _ => {}
            }
            check(&st, &mut e, &nb, f, true, &format!("packet {i}"))?;
        }

        // Replies, in on a Pod interface (the loopback again, in the Pod role), out to
        // the client's next hop on the uplink once the worker has published it.
        let lo_as = |uplink| SteeredIface {
            name: "lo".into(),
            ifindex: 1,
            uplink,
            slot_base: 0,
            queues: 1,
        };
        st.configure_iface(&lo_as(false))?;
        nb.set_xdp_frame_targets(vec![2, 10, 11]);
        e.refresh_xdp(&nb);
        let tcp_reply = |payload: &[u8], ttl| {
            build_with(
                IPPROTO_TCP,
                b,
                8080,
                CLIENT,
                44000,
                payload,
                ttl,
                tcp_flags::ACK,
            )
        };
        let udp_reply =
            |payload: &[u8], ttl| build_with(IPPROTO_UDP, bu, 8080, CLIENT, 44001, payload, ttl, 0);
        check_on(
            &st,
            &mut e,
            &nb,
            tcp_reply(b"", 64),
            true,
            false,
            "egress unresolved",
        )?;
        for i in 0..300 {
            let x = next();
            let ttl = 2 + (x % 254) as u8;
            // Up to past the program's 64-byte chunks, and one full-size segment.
            let len = if i == 7 {
                1400
            } else {
                (x >> 16) as usize % 200
            };
            let payload: Vec<u8> = (0..len).map(|j| (x >> (j % 7)) as u8).collect();
            let udp = i % 2 == 0;
            let mut f = if udp {
                udp_reply(&payload, ttl)
            } else {
                tcp_reply(&payload, ttl)
            };
            let c = (next() & 0xffff) as u16;
            let l4c = if udp { 40 } else { 50 };
            match i % 6 {
                // What Pods send: a partial (pseudo-header only) checksum.
                0 | 1 => packet::tests::set_partial_checksum(&mut f),
                2 => f[l4c..l4c + 2].copy_from_slice(&[0, 0]),
                3 => f[l4c..l4c + 2].copy_from_slice(&c.to_be_bytes()),
                4 => f[24..26].copy_from_slice(&c.to_be_bytes()),
                _ => {}
            }
            check_on(&st, &mut e, &nb, f, true, true, &format!("reply {i}"))?;
        }
        // A partial UDP checksum whose completion is 0, sent as 0xffff: a payload word
        // chosen to make the one's-complement sum of the NATed datagram 0xffff.
        let mut z = udp_reply(&[0, 0], 64);
        packet::tests::set_partial_checksum(&mut z);
        let mut probe = z.clone();
        let _ = e.process(&mut probe, Side::Pod(0), &nb, now());
        let sum = !u16::from_be_bytes([probe[40], probe[41]]);
        let w = 0xffff - u32::from(sum);
        z[42..44].copy_from_slice(&(w as u16).to_be_bytes());
        let mut want = z.clone();
        let _ = e.process(&mut want, Side::Pod(0), &nb, now());
        assert_eq!(
            &want[40..42],
            &[0xff, 0xff],
            "the crafted reply's checksum is 0"
        );
        check_on(
            &st,
            &mut e,
            &nb,
            z,
            true,
            true,
            "UDP checksum 0 sent as 0xffff",
        )?;
        // A reply that changes the TCP state is userspace's.
        let fin = build_with(
            IPPROTO_TCP,
            b,
            8080,
            CLIENT,
            44000,
            b"",
            64,
            tcp_flags::FIN | tcp_flags::ACK,
        );
        let (action, out) = st.test_run(&fin, 1)?;
        assert_eq!((action, &out), (XDP_DROP, &fin), "a reply with FIN");
        // New neighbours: the published egress dies with the worker's cache.
        nb.set_xdp_frame_targets(vec![2, 10, 11, 12]);
        e.refresh_xdp(&nb);
        check_on(
            &st,
            &mut e,
            &nb,
            udp_reply(b"r", 64),
            true,
            false,
            "egress cleared",
        )?;
        check_on(
            &st,
            &mut e,
            &nb,
            udp_reply(b"r", 64),
            true,
            true,
            "egress republished",
        )?;
        st.configure_iface(&lo_as(true))?;
        // State changes stay userspace's.
        for flags in [
            tcp_flags::FIN | tcp_flags::ACK,
            tcp_flags::RST,
            tcp_flags::SYN,
        ] {
            let mut f = tcp(CLIENT, 44000, VIP, 80, flags);
            let (action, out) = st.test_run(&f, 1)?;
            assert_eq!((action, &out), (XDP_DROP, &f), "flags {flags:#x}");
            let _ = e.process(&mut f, Side::Uplink, &nb, now());
        }
        // A new service table: off until republished, then the flow must be re-validated
        // by the engine (one packet through userspace) before the program takes it.
        update(&mut e, 2, &[B1, B2]);
        let udp = || build_with(IPPROTO_UDP, CLIENT, 44001, VIP, 53, b"x", 64, 0);
        let (action, _) = st.test_run(&udp(), 1)?;
        assert_eq!(action, XDP_DROP, "part off after set_services");
        e.refresh_xdp(&nb);
        check(&st, &mut e, &nb, udp(), false, "not re-validated yet")?;
        check(&st, &mut e, &nb, udp(), true, "re-validated")?;
        // An interface that takes no XDP frames: its slots are not used.
        nb.set_xdp_frame_targets(vec![]);
        e.refresh_xdp(&nb);
        check(&st, &mut e, &nb, udp(), false, "egress takes no XDP frames")?;
        Ok(())
    }

    /// The new-flow admission end to end, the real program over this engine's shared
    /// flow table and the buckets the engine debits: a /24's packets of no flow reach
    /// userspace within its burst and the engine debits them; once the bucket is empty
    /// the program drops the prefix's packets of no flow (and only then looks flows up:
    /// a held flow's packets still reach userspace), another /24 is untouched, and a
    /// packet already past the program is dropped by the engine under the same reason.
    /// Loads BPF: needs root.
    #[test]
    fn the_program_drops_new_flows_beyond_what_the_engine_debited() -> anyhow::Result<()> {
        use crate::steering::Steering;
        let (_dir, mut st, mut e) = steered_engine()?;
        let now = crate::region::monotonic_ms;
        // A burst of 2, then one a minute: nothing refills during the test.
        let limit = crate::admission::Limit { rate: 1, burst: 2 };
        e.set_admission(st.set_new_flow_admission(limit)?);
        let nb = neighbours();
        let udp = |src: [u8; 4], port| build_with(IPPROTO_UDP, src, port, VIP, 53, b"q", 64, 0);
        // To userspace: the program's verdict with no socket in a test run.
        let to_userspace = |st: &Steering, f: &[u8]| -> anyhow::Result<bool> {
            let before = st.drops();
            st.test_run(f, 1)?;
            let after = st.drops();
            if after.no_socket == before.no_socket + 1 {
                return Ok(true);
            }
            anyhow::ensure!(
                after.new_flow_prefix_rate == before.new_flow_prefix_rate + 1,
                "neither to userspace nor rate-limited: {before:?} -> {after:?}"
            );
            Ok(false)
        };
        for port in [44001, 44002] {
            assert!(to_userspace(&st, &udp(CLIENT, port))?, "within the burst");
            let v = e.process(&mut udp(CLIENT, port), Side::Uplink, &nb, now());
            assert!(matches!(v, Verdict::Tx(_)), "{v:?}");
        }
        let same_24 = [192, 0, 2, 77];
        assert!(
            !to_userspace(&st, &udp(same_24, 44003))?,
            "beyond the burst"
        );
        let v = e.process(&mut udp(same_24, 44003), Side::Uplink, &nb, now());
        assert_eq!(v, Verdict::Drop(DropReason::NewFlowPrefixRateLimited));
        assert!(to_userspace(&st, &udp(CLIENT, 44001))?, "a held flow");
        let v = e.process(&mut udp(CLIENT, 44001), Side::Uplink, &nb, now());
        assert!(matches!(v, Verdict::Tx(_)), "{v:?}");
        let other_24 = [198, 51, 100, 7];
        assert!(to_userspace(&st, &udp(other_24, 44003))?, "another /24");
        let v = e.process(&mut udp(other_24, 44003), Side::Uplink, &nb, now());
        assert!(matches!(v, Verdict::Tx(_)), "{v:?}");
        assert_eq!(
            e.counters().drops_for(DropReason::NewFlowPrefixRateLimited),
            1
        );
        assert_eq!(e.flows().len(), 3);
        Ok(())
    }

    #[test]
    fn only_a_syn_creates_a_tcp_flow() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        for (i, flags) in [
            tcp_flags::ACK,
            tcp_flags::ACK | 0x08,
            tcp_flags::SYN | tcp_flags::ACK,
            tcp_flags::RST,
            tcp_flags::FIN | tcp_flags::ACK,
            0,
        ]
        .into_iter()
        .enumerate()
        {
            let mut f = tcp(CLIENT, 41000 + i as u16, VIP, 80, flags);
            assert_eq!(
                e.process(&mut f, Side::Uplink, &nb, 0),
                Verdict::Drop(DropReason::NonSynWithoutFlow),
                "flags {flags:#x}"
            );
        }
        assert_eq!(e.flows().len(), 0);
        assert_eq!(e.counters().drops_for(DropReason::NonSynWithoutFlow), 6);
        // An unexposed port still counts as such, not as a non-SYN.
        let mut f = tcp(CLIENT, 41000, VIP, 81, tcp_flags::ACK);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::PortNotExposed)
        );
        // UDP needs no SYN; a SYN opens a TCP flow, whose ACKs then pass.
        let mut u = build_with(IPPROTO_UDP, CLIENT, 41000, VIP, 53, b"q", 64, 0);
        assert!(matches!(
            e.process(&mut u, Side::Uplink, &nb, 0),
            Verdict::Tx(_)
        ));
        let mut f = tcp(CLIENT, 41000, VIP, 80, tcp_flags::SYN);
        assert!(matches!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Tx(_)
        ));
        let mut f = tcp(CLIENT, 41000, VIP, 80, tcp_flags::ACK);
        assert!(matches!(
            e.process(&mut f, Side::Uplink, &nb, 1),
            Verdict::Tx(_)
        ));
        assert_eq!(e.flows().len(), 2);
    }

    /// Two workers' engines over one group of flow tables: a connection whose client
    /// packets reach worker 0 and whose replies reach worker 1 is served by both, the
    /// handshake followed across them; worker 1 never re-validates or removes worker 0's
    /// flow (after a backend is removed it drops the reply; worker 0 removes the flow).
    #[test]
    fn a_connection_split_over_two_workers() {
        let nb = neighbours();
        let cfg = EngineConfig {
            flow_capacity: 256,
            ..Default::default()
        };
        let mut tables = FlowTable::new_group(2, 256, cfg.timeouts, 3).into_iter();
        let mut w0 = Engine::with_flows(cfg, tables.next().unwrap());
        let mut w1 = Engine::with_flows(cfg, tables.next().unwrap());
        for e in [&mut w0, &mut w1] {
            update(e, 1, &[B1, B2]);
        }
        let mut f = syn(43000);
        assert!(matches!(
            w0.process(&mut f, Side::Uplink, &nb, 10),
            Verdict::Tx(_)
        ));
        let b = Ipv4Addr::from(parse(&f).dst).octets();
        let flags = tcp_flags::SYN | tcp_flags::ACK;
        let mut r = tcp(b, 8080, CLIENT, 43000, flags);
        assert_eq!(
            w1.process(&mut r, Side::Pod(0), &nb, 11),
            Verdict::Tx(Side::Uplink)
        );
        assert_eq!(parse(&r).src, u32::from(Ipv4Addr::from(VIP)));
        let mut a = tcp(CLIENT, 43000, VIP, 80, tcp_flags::ACK);
        assert!(matches!(
            w0.process(&mut a, Side::Uplink, &nb, 12),
            Verdict::Tx(_)
        ));
        assert_eq!(w0.flows().half_open(), 0, "established across workers");
        // Data both ways (fast paths), then replies after a table change (slow path).
        for t in 13..20 {
            let mut r = tcp(b, 8080, CLIENT, 43000, tcp_flags::ACK);
            assert_eq!(
                w1.process(&mut r, Side::Pod(0), &nb, t),
                Verdict::Tx(Side::Uplink)
            );
        }
        for e in [&mut w0, &mut w1] {
            update(e, 2, &[B1, B2]);
        }
        let mut r = tcp(b, 8080, CLIENT, 43000, tcp_flags::ACK);
        assert_eq!(
            w1.process(&mut r, Side::Pod(0), &nb, 21),
            Verdict::Tx(Side::Uplink)
        );
        assert_eq!(w1.flows().len(), 0, "worker 1 owns no flow");
        assert!(w1.flows().remote_hits() > 0);
        // The backend goes: worker 1 drops its replies, worker 0 removes the flow.
        let other = if b == B1 { B2 } else { B1 };
        for e in [&mut w0, &mut w1] {
            update(e, 3, &[other]);
        }
        let mut r = tcp(b, 8080, CLIENT, 43000, tcp_flags::ACK);
        assert!(matches!(
            w1.process(&mut r, Side::Pod(0), &nb, 22),
            Verdict::Drop(_)
        ));
        assert_eq!(w0.flows().len(), 1);
        let mut a = tcp(CLIENT, 43000, VIP, 80, tcp_flags::ACK);
        assert!(matches!(
            w0.process(&mut a, Side::Uplink, &nb, 23),
            Verdict::Drop(_)
        ));
        assert_eq!(w0.flows().len(), 0);
    }

    /// A flow table handed from one engine to the next (what a restart does with the
    /// pinned table) keeps every connection on its backend, and re-validates each flow
    /// against the new service table even when the slots differ.
    #[test]
    fn flows_survive_a_restart_and_are_revalidated() {
        use crate::flow::{FlowMeta, Opened, SharedRegions};
        use crate::region::Region;
        let nb = neighbours();
        let cfg = EngineConfig {
            flow_capacity: 256,
            ..Default::default()
        };
        let regions = SharedRegions {
            meta: Region::heap(1, FlowMeta::EMPTY),
            index: Region::heap(crate::steering::index_slots(256), 0u64),
            records: Region::heap(256, Flow::new(0, 0, 0, 0, 0, 0, 0, 0, 0)),
        };
        let (t, _) = FlowTable::open_shared(regions, cfg.timeouts, 1, 0);
        let mut e = Engine::with_flows(cfg, t);
        update(&mut e, 1, &[B1, B2]);
        let mut backends = Vec::new();
        for cport in 42000..42016u16 {
            let mut f = syn(cport);
            assert!(matches!(
                e.process(&mut f, Side::Uplink, &nb, 10),
                Verdict::Tx(_)
            ));
            let b = parse(&f).dst;
            let mut r = tcp(
                Ipv4Addr::from(b).octets(),
                8080,
                CLIENT,
                cport,
                tcp_flags::SYN | tcp_flags::ACK,
            );
            assert_eq!(
                e.process(&mut r, Side::Pod(0), &nb, 11),
                Verdict::Tx(Side::Uplink)
            );
            let mut a = tcp(CLIENT, cport, VIP, 80, tcp_flags::ACK);
            assert!(matches!(
                e.process(&mut a, Side::Uplink, &nb, 12),
                Verdict::Tx(_)
            ));
            backends.push(b);
        }
        assert_eq!(e.flows().half_open(), 0);
        // "kill -9": only the table's memory is left.
        let regions = e.flows.into_regions();
        let (t, opened) = FlowTable::open_shared(regions, cfg.timeouts, 999, 20);
        assert_eq!(
            opened,
            Opened::Adopted {
                flows: 16,
                expired: 0
            }
        );
        let mut e2 = Engine::with_flows(cfg, t);
        // Before the state file is read: packets dropped, flows kept.
        let mut a = tcp(CLIENT, 42000, VIP, 80, tcp_flags::ACK);
        assert!(matches!(
            e2.process(&mut a, Side::Uplink, &nb, 21),
            Verdict::Pass(_)
        ));
        let mut r = tcp(
            Ipv4Addr::from(backends[0]).octets(),
            8080,
            CLIENT,
            42000,
            tcp_flags::ACK,
        );
        assert!(matches!(
            e2.process(&mut r, Side::Pod(0), &nb, 21),
            Verdict::Drop(_)
        ));
        assert_eq!(e2.flows().len(), 16);
        // A new table whose services are in another order (other slots): an extra
        // frontend sorts first.
        let (mut s, mut m) = state(&[B1, B2]);
        s.services.push(NodeService {
            frontend: Frontend {
                vip: Ipv4Addr::from([10, 0, 0, 1]),
                protocol: Protocol::Tcp,
                port: 1,
            },
            backends: vec![LocalBackend {
                ip: Ipv4Addr::from(B2),
                port: 9,
            }],
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
            host_network: false,
        });
        m.push(maglev(1));
        s.normalize();
        let order: Vec<Vec<u16>> = s
            .services
            .iter()
            .map(|x| {
                if x.backends.is_empty() {
                    vec![]
                } else {
                    maglev(x.backends.len())
                }
            })
            .collect();
        e2.set_services(ServiceTable::new(7, &s, &order));
        for (k, cport) in (42000..42016u16).enumerate() {
            let mut a = tcp(CLIENT, cport, VIP, 80, tcp_flags::ACK | 0x08);
            assert!(matches!(
                e2.process(&mut a, Side::Uplink, &nb, 30),
                Verdict::Tx(_)
            ));
            assert_eq!(
                parse(&a).dst,
                backends[k],
                "connection moved to another backend"
            );
            let mut r = tcp(
                Ipv4Addr::from(backends[k]).octets(),
                8080,
                CLIENT,
                cport,
                tcp_flags::ACK,
            );
            assert_eq!(
                e2.process(&mut r, Side::Pod(0), &nb, 30),
                Verdict::Tx(Side::Uplink)
            );
            let rv = parse(&r);
            assert_eq!((rv.src, rv.l4.unwrap().src_port), (ip(VIP), 80));
        }
        let _ = m;
    }

    /// The TCP service's table with `ready` backends for new flows and `draining` ones
    /// (terminating but serving) for the flows they hold.
    fn update_draining(e: &mut Engine, generation: u64, ready: &[[u8; 4]], draining: &[[u8; 4]]) {
        let b = |l: &[[u8; 4]]| -> Vec<LocalBackend> {
            l.iter()
                .map(|b| LocalBackend {
                    ip: Ipv4Addr::from(*b),
                    port: 8080,
                })
                .collect()
        };
        let (mut s, _) = state(ready);
        s.services.retain(|x| {
            x.frontend.protocol == Protocol::Tcp && x.frontend.vip == Ipv4Addr::from(VIP)
        });
        s.services[0].terminating = b(draining);
        s.normalize();
        let m = vec![maglev(ready.len())];
        e.set_services(ServiceTable::new(generation, &s, &m));
    }

    /// A client port of a new connection that Maglev gives to `backend`.
    fn port_to(e: &mut Engine, nb: &Neighbours, backend: [u8; 4]) -> u16 {
        (50000..51000u16)
            .find(|p| {
                let mut f = syn(*p);
                let to = matches!(e.process(&mut f, Side::Uplink, nb, 1), Verdict::Tx(_))
                    && parse(&f).dst == ip(backend);
                let key = FlowKey {
                    src: ip(CLIENT),
                    dst: ip(VIP),
                    src_port: *p,
                    dst_port: 80,
                    proto: IPPROTO_TCP,
                };
                if let Some((id, _)) = e.flows.lookup(&key, 1) {
                    e.flows.remove(id);
                }
                to
            })
            .expect("a port to the backend")
    }

    /// A client re-uses the 4-tuple of a connection that ended — its port is free again
    /// at once when the server closed first — while the dataplane still holds the old
    /// record (FIN timeout). Its SYN opens a new connection, so it goes to a Ready backend,
    /// never to the old one now draining (whose listener may be closed: a refused
    /// connection, seen in the lab). A SYN retransmitted during a handshake keeps its flow
    /// while its backend is Ready.
    #[test]
    fn a_syn_reusing_a_finished_connections_tuple_goes_to_a_ready_backend() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let p = port_to(&mut e, &nb, B1);
        let s = e.table.find(ip(VIP), IPPROTO_TCP, 80).unwrap() as usize;
        let new_flows = |e: &Engine| e.counters().services[s].new_flows;
        let before = new_flows(&e);
        let step = |e: &mut Engine, from_pod: bool, flags: u8, t: u64| {
            let mut f = if from_pod {
                tcp(B1, 8080, CLIENT, p, flags)
            } else {
                tcp(CLIENT, p, VIP, 80, flags)
            };
            let side = if from_pod { Side::Pod(0) } else { Side::Uplink };
            let v = e.process(&mut f, side, &nb, t);
            (v, parse(&f).dst)
        };
        // Handshake (with the SYN retransmitted: same flow), request, both FINs.
        assert_eq!(step(&mut e, false, tcp_flags::SYN, 10).1, ip(B1));
        assert_eq!(step(&mut e, false, tcp_flags::SYN, 11).1, ip(B1));
        assert_eq!(
            new_flows(&e),
            before + 1,
            "a retransmitted SYN is the same connection"
        );
        step(&mut e, true, tcp_flags::SYN | tcp_flags::ACK, 12);
        step(&mut e, false, tcp_flags::ACK, 13);
        step(&mut e, true, tcp_flags::FIN | tcp_flags::ACK, 14);
        step(&mut e, false, tcp_flags::FIN | tcp_flags::ACK, 15);
        // B1's Pod terminates: it drains, B2 takes new connections.
        update_draining(&mut e, 2, &[B2], &[B1]);
        let before = new_flows(&e);
        let (v, dst) = step(&mut e, false, tcp_flags::SYN, 1000);
        assert!(matches!(v, Verdict::Tx(_)), "{v:?}");
        assert_eq!(
            dst,
            ip(B2),
            "the new connection went to the draining backend"
        );
        assert_eq!(new_flows(&e), before + 1, "counted as a new flow");
        // The Pod's reply is un-NATed through the new record.
        let mut r = tcp(B2, 8080, CLIENT, p, tcp_flags::SYN | tcp_flags::ACK);
        assert_eq!(
            e.process(&mut r, Side::Pod(1), &nb, 1001),
            Verdict::Tx(Side::Uplink)
        );
        // A handshake in progress whose backend starts draining: the retransmitted SYN
        // goes to a Ready backend too (new connections only go to Ready ones).
        let mut e = engine(&[B1, B2]);
        let p = port_to(&mut e, &nb, B1);
        let mut f = syn(p);
        assert!(matches!(
            e.process(&mut f, Side::Uplink, &nb, 10),
            Verdict::Tx(_)
        ));
        update_draining(&mut e, 2, &[B2], &[B1]);
        let mut f = syn(p);
        assert!(matches!(
            e.process(&mut f, Side::Uplink, &nb, 1010),
            Verdict::Tx(_)
        ));
        assert_eq!(parse(&f).dst, ip(B2));
        // An established connection's segments still go to the draining backend.
        let mut e = engine(&[B1, B2]);
        let p = port_to(&mut e, &nb, B1);
        let mut f = syn(p);
        e.process(&mut f, Side::Uplink, &nb, 10);
        let mut r = tcp(B1, 8080, CLIENT, p, tcp_flags::SYN | tcp_flags::ACK);
        e.process(&mut r, Side::Pod(0), &nb, 11);
        update_draining(&mut e, 2, &[B2], &[B1]);
        let mut a = tcp(CLIENT, p, VIP, 80, tcp_flags::ACK);
        assert!(matches!(
            e.process(&mut a, Side::Uplink, &nb, 12),
            Verdict::Tx(_)
        ));
        assert_eq!(parse(&a).dst, ip(B1));
    }

    #[test]
    fn dnat_then_reverse_nat_round_trip() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let mut f = syn(40000);
        let verdict = e.process(&mut f, Side::Uplink, &nb, 0);
        let Verdict::Tx(Side::Pod(i)) = verdict else {
            panic!("{verdict:?}")
        };
        assert_checksums_valid(&f);
        let v = parse(&f);
        let backend = v.dst;
        assert!(backend == ip(B1) || backend == ip(B2));
        let (pod_mac, bmac) = if backend == ip(B1) {
            (P0_MAC, B1_MAC)
        } else {
            (P1_MAC, B2_MAC)
        };
        assert_eq!(i, if backend == ip(B1) { 0 } else { 1 });
        assert_eq!(&f[0..6], &bmac.0);
        assert_eq!(&f[6..12], &pod_mac.0);
        assert_eq!(v.l4.unwrap().dst_port, 8080);
        assert_eq!(v.src, ip(CLIENT), "no SNAT: the Pod sees the client");
        assert_eq!(v.ttl, 63);

        // The backend's SYN-ACK, with a partial checksum as a veth with offload gives it.
        let mut r = build_with(
            IPPROTO_TCP,
            Ipv4Addr::from(backend).octets(),
            8080,
            CLIENT,
            40000,
            b"",
            64,
            tcp_flags::SYN | tcp_flags::ACK,
        );
        set_partial_checksum(&mut r);
        assert_eq!(
            e.process(&mut r, Side::Pod(i), &nb, 1),
            Verdict::Tx(Side::Uplink)
        );
        assert_checksums_valid(&r);
        let rv = parse(&r);
        assert_eq!((rv.src, rv.l4.unwrap().src_port), (ip(VIP), 80));
        assert_eq!(rv.dst, ip(CLIENT));
        assert_eq!(&r[0..6], &GW_MAC.0);
        assert_eq!(&r[6..12], &UP_MAC.0);
        let sc =
            e.counters().services[e.services().find(ip(VIP), IPPROTO_TCP, 80).unwrap() as usize];
        assert_eq!((sc.packets_in, sc.packets_out, sc.new_flows), (1, 1, 1));
        assert_eq!(e.flows().len(), 1);
    }

    #[test]
    fn connections_spread_and_stick() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let mut first = std::collections::HashMap::new();
        for p in 0..200u16 {
            let mut f = syn(10000 + p);
            assert!(matches!(
                e.process(&mut f, Side::Uplink, &nb, 0),
                Verdict::Tx(_)
            ));
            first.insert(p, parse(&f).dst);
        }
        let n1 = first.values().filter(|&&b| b == ip(B1)).count();
        assert!(n1 > 40 && n1 < 160, "both backends used: {n1}/200 on B1");
        for round in 0..3 {
            for p in 0..200u16 {
                let mut f = build(IPPROTO_TCP, CLIENT, 10000 + p, VIP, 80, b"data");
                assert!(matches!(
                    e.process(&mut f, Side::Uplink, &nb, 10 + round),
                    Verdict::Tx(_)
                ));
                assert_eq!(parse(&f).dst, first[&p]);
            }
        }
    }

    #[test]
    fn policy_drops_and_passes() {
        let nb = neighbours();
        let mut e = engine(&[B1]);
        // Port not exposed.
        let mut f = build(IPPROTO_TCP, CLIENT, 1, VIP, 443, b"");
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::PortNotExposed)
        );
        // UDP port exposed only for 53: UDP/80 dropped.
        let mut f = build(IPPROTO_UDP, CLIENT, 1, VIP, 80, b"");
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::PortNotExposed)
        );
        // VIP without a local backend.
        let mut f = build(IPPROTO_TCP, CLIENT, 1, [203, 0, 113, 11], 80, b"");
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::NoBackend)
        );
        // ICMP to a VIP.
        let mut f = build(IPPROTO_UDP, CLIENT, 1, VIP, 53, b"");
        f[14 + 9] = IPPROTO_ICMP;
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::UnsupportedProtocol)
        );
        // Not a VIP: the kernel's.
        let mut f = build(IPPROTO_TCP, CLIENT, 1, [192, 0, 2, 2], 22, b"");
        let before = f.clone();
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Pass(PassReason::NotForUs)
        );
        assert_eq!(f, before);
        // ARP: the kernel's; IPv6 to no VIP too (the IPv6 path: `engine6.rs`), and an IPv6
        // frame that does not parse is dropped as malformed.
        let mut arp = vec![0u8; 42];
        arp[12..14].copy_from_slice(&packet::ETHERTYPE_ARP.to_be_bytes());
        assert_eq!(
            e.process(&mut arp, Side::Uplink, &nb, 0),
            Verdict::Pass(PassReason::NotIpv4)
        );
        let mut v6 = vec![0u8; 60];
        v6[12..14].copy_from_slice(&packet::ETHERTYPE_IPV6.to_be_bytes());
        assert_eq!(
            e.process(&mut v6.clone(), Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::Malformed)
        );
        v6[14] = 0x60; // version 6
        v6[19] = 6; // payload length 6, next header 59 (no next header)
        v6[20] = 59;
        v6[21] = 64;
        assert_eq!(
            e.process(&mut v6, Side::Uplink, &nb, 0),
            Verdict::Pass(PassReason::NotForUs)
        );
        // TTL 1: the kernel's (time exceeded), unchanged.
        let mut f = build_with(IPPROTO_TCP, CLIENT, 1, VIP, 80, b"", 1, tcp_flags::SYN);
        let before = f.clone();
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Pass(PassReason::TtlExpired)
        );
        assert_eq!(f, before);
        // A first fragment too short for its transport header (RFC 1858).
        let mut f = build(IPPROTO_UDP, CLIENT, 1, VIP, 53, b"abcdefgh");
        f[14 + 6] = 0x20;
        f[14 + 2..14 + 4].copy_from_slice(&24u16.to_be_bytes());
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::Fragment)
        );
        // IP options.
        let mut f = build(IPPROTO_UDP, CLIENT, 1, VIP, 53, b"abcd");
        f[14] = 0x46; // header claims 24 bytes: the UDP header now starts 4 bytes later
        assert!(matches!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::IpOptions | DropReason::Malformed)
        ));
        // Malformed.
        let mut f = syn(5)[..30].to_vec();
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::Malformed)
        );
        // A reply without a flow.
        let mut r = build(IPPROTO_TCP, B1, 8080, CLIENT, 999, b"");
        assert_eq!(
            e.process(&mut r, Side::Pod(0), &nb, 0),
            Verdict::Drop(DropReason::NoFlow)
        );
        for r in [
            DropReason::PortNotExposed,
            DropReason::NoBackend,
            DropReason::UnsupportedProtocol,
            DropReason::Fragment,
            DropReason::Malformed,
            DropReason::NoFlow,
        ] {
            assert!(e.counters().drops_for(r) >= 1, "{r:?} counted");
        }
        assert_eq!(e.flows().len(), 0, "no flow created by dropped packets");
    }

    #[test]
    fn ip_options_are_dropped_not_natted() {
        let nb = neighbours();
        let mut e = engine(&[B1]);
        // A real options header: 20 bytes + 4 bytes of NOPs, then UDP.
        let base = build(IPPROTO_UDP, CLIENT, 1, VIP, 53, b"payload!");
        let mut f = base[..34].to_vec();
        f.extend_from_slice(&[1, 1, 1, 0]);
        f.extend_from_slice(&base[34..]);
        f[14] = 0x46;
        let tl = (f.len() - 14) as u16;
        f[16..18].copy_from_slice(&tl.to_be_bytes());
        let before = f.clone();
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::IpOptions)
        );
        assert_eq!(f, before);
    }

    #[test]
    fn pod_checksum_mode_is_honoured() {
        let nb = neighbours();
        for recompute in [true, false] {
            let mut e = Engine::new(EngineConfig {
                flow_capacity: 64,
                recompute_pod_checksums: recompute,
                ..Default::default()
            });
            let (s, m) = state(&[B1]);
            e.set_services(ServiceTable::new(1, &s, &m));
            let mut f = build(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"query");
            assert_eq!(
                e.process(&mut f, Side::Uplink, &nb, 0),
                Verdict::Tx(Side::Pod(0))
            );
            // A reply with a partial (pseudo-header only) checksum, as veth offload leaves it.
            let mut r = build(IPPROTO_UDP, B1, 8080, CLIENT, 5353, b"answer");
            set_partial_checksum(&mut r);
            assert_eq!(
                e.process(&mut r, Side::Pod(0), &nb, 1),
                Verdict::Tx(Side::Uplink)
            );
            let v = parse(&r);
            let stored = u16::from_be_bytes([r[14 + 20 + 6], r[14 + 20 + 7]]);
            assert_eq!(
                stored == packet::l4_checksum(&r, &v),
                recompute,
                "recompute={recompute}"
            );
        }
    }

    /// An ICMP "fragmentation needed" from `router` to the VIP quoting `quoted` (an IPv4
    /// packet as it left the node, from its IP header on).
    fn frag_needed(router: [u8; 4], quoted: &[u8]) -> Vec<u8> {
        icmp_error(router, VIP, packet::ICMP_DEST_UNREACH, 4, quoted)
    }

    fn icmp_error(src: [u8; 4], dst: [u8; 4], ty: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
        let quote = &quoted[..quoted.len().min(20 + 8 + 20)];
        let total = 20 + 8 + quote.len();
        let mut f = vec![0u8; 14 + total];
        f[12..14].copy_from_slice(&packet::ETHERTYPE_IPV4.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
        f[22] = 64;
        f[23] = IPPROTO_ICMP;
        f[26..30].copy_from_slice(&src);
        f[30..34].copy_from_slice(&dst);
        let c = packet::ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f[34] = ty;
        f[35] = code;
        if code == 4 {
            f[40..42].copy_from_slice(&1400u16.to_be_bytes());
        }
        f[42..].copy_from_slice(quote);
        let c = icmp_checksum(&f[34..]);
        f[36..38].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn icmp_checksum(icmp: &[u8]) -> u16 {
        let mut sum: u32 = 0;
        for (i, c) in icmp.chunks(2).enumerate() {
            if i == 1 {
                continue; // the checksum field
            }
            sum += u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0));
        }
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    #[test]
    fn icmp_errors_about_our_replies_reach_the_backend() {
        let nb = neighbours();
        for proto in [IPPROTO_TCP, IPPROTO_UDP] {
            let mut e = engine(&[B1]);
            let vport = if proto == IPPROTO_TCP { 80 } else { 53 };
            let mut f = build_with(proto, CLIENT, 40000, VIP, vport, b"", 64, tcp_flags::SYN);
            assert_eq!(
                e.process(&mut f, Side::Uplink, &nb, 0),
                Verdict::Tx(Side::Pod(0))
            );
            // The reply as it left the uplink (already reverse-NATed), too big for the path.
            let mut reply = build(proto, B1, 8080, CLIENT, 40000, &[7u8; 100]);
            assert_eq!(
                e.process(&mut reply, Side::Pod(0), &nb, 1),
                Verdict::Tx(Side::Uplink)
            );
            let mut icmp = frag_needed([198, 51, 100, 1], &reply[14..]);
            assert_eq!(
                e.process(&mut icmp, Side::Uplink, &nb, 2),
                Verdict::Tx(Side::Pod(0)),
                "proto {proto}"
            );
            let v = parse(&icmp);
            assert_eq!(v.dst, ip(B1), "outer destination is the backend");
            assert_eq!(v.src, u32::from_be_bytes([198, 51, 100, 1]));
            assert_eq!(
                packet::ipv4_header_checksum(&icmp[14..34]),
                u16::from_be_bytes([icmp[24], icmp[25]])
            );
            assert_eq!(
                icmp_checksum(&icmp[34..]),
                u16::from_be_bytes([icmp[36], icmp[37]]),
                "ICMP checksum"
            );
            let inner = &icmp[42..];
            assert_eq!(&inner[12..16], &B1, "quoted source is the backend");
            assert_eq!(
                u16::from_be_bytes([inner[20], inner[21]]),
                8080,
                "quoted source port"
            );
            assert_eq!(
                packet::ipv4_header_checksum(&inner[..20]),
                u16::from_be_bytes([inner[10], inner[11]])
            );
            assert_eq!(&icmp[0..6], &B1_MAC.0);
            // What the backend originally sent, quoted back: its UDP checksum is right again.
            if proto == IPPROTO_UDP {
                let orig = build(proto, B1, 8080, CLIENT, 40000, &[7u8; 100]);
                assert_eq!(&inner[26..28], &orig[14 + 26..14 + 28]);
            }
        }
        // No flow: dropped. Echo to the VIP: still not served.
        let mut e = engine(&[B1]);
        let stray = build(IPPROTO_UDP, VIP, 53, CLIENT, 1234, b"x");
        let mut icmp = frag_needed([198, 51, 100, 1], &stray[14..]);
        assert_eq!(
            e.process(&mut icmp, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::NoFlow)
        );
        let mut echo = frag_needed([198, 51, 100, 1], &stray[14..]);
        echo[34] = 8;
        assert_eq!(
            e.process(&mut echo, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::UnsupportedProtocol)
        );
    }

    #[test]
    fn backend_icmp_errors_go_to_the_client_as_if_from_the_vip() {
        let nb = neighbours();
        let mut e = engine(&[B1]);
        let mut f = build(IPPROTO_UDP, CLIENT, 40000, VIP, 53, b"query");
        let original = f.clone();
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Tx(Side::Pod(0))
        );
        // The Pod has nothing on the port: port unreachable, quoting what it received.
        let mut icmp = icmp_error(B1, CLIENT, packet::ICMP_DEST_UNREACH, 3, &f[14..]);
        assert_eq!(
            e.process(&mut icmp, Side::Pod(0), &nb, 1),
            Verdict::Tx(Side::Uplink)
        );
        let v = parse(&icmp);
        assert_eq!((v.src, v.dst), (ip(VIP), ip(CLIENT)));
        assert_eq!(
            packet::ipv4_header_checksum(&icmp[14..34]),
            u16::from_be_bytes([icmp[24], icmp[25]])
        );
        assert_eq!(
            icmp_checksum(&icmp[34..]),
            u16::from_be_bytes([icmp[36], icmp[37]])
        );
        // The quote is the packet as the client sent it (TTL aside).
        let inner = &icmp[42..];
        assert_eq!(
            &inner[12..20],
            &original[14 + 12..14 + 20],
            "quoted addresses"
        );
        assert_eq!(
            &inner[20..28],
            &original[34..42],
            "quoted UDP header incl. checksum"
        );
        assert_eq!(
            packet::ipv4_header_checksum(&inner[..20]),
            u16::from_be_bytes([inner[10], inner[11]])
        );
        assert_eq!(&icmp[0..6], &GW_MAC.0);
        // An error about a packet of no flow stays dropped.
        let stray = build(IPPROTO_UDP, CLIENT, 1, B1, 8080, b"x");
        let mut icmp = icmp_error(B1, CLIENT, packet::ICMP_DEST_UNREACH, 3, &stray[14..]);
        assert_eq!(
            e.process(&mut icmp, Side::Pod(0), &nb, 1),
            Verdict::Drop(DropReason::NoFlow)
        );
    }

    /// A flood of new UDP flows from one address (any number of source ports) holds at
    /// most the address's quota of records, its /24 at most the /24's; the rest is
    /// dropped as `source_over_quota`, other sources still open flows, and a source
    /// gets its quota back as its flows end.
    #[test]
    fn a_source_holds_at_most_its_quota_of_flows() {
        let nb = neighbours();
        let mut e = Engine::new(EngineConfig {
            flow_capacity: 1024,
            source_flow_quota: 100,
            prefix_flow_quota: 300,
            ..Default::default()
        });
        update(&mut e, 1, &[B1]);
        let udp_from = |e: &mut Engine, src: [u8; 4], port: u16, now: u64| {
            let mut f = build(IPPROTO_UDP, src, port, VIP, 53, b"q");
            e.process(&mut f, Side::Uplink, &nb, now)
        };
        for port in 0..1000u16 {
            udp_from(&mut e, CLIENT, 10_000 + port, 0);
        }
        assert_eq!(e.flows().len(), 100);
        assert_eq!(e.counters().drops_for(DropReason::SourceOverQuota), 900);
        // Its neighbours in the /24 share the /24's quota.
        for host in 2..10u8 {
            for port in 0..100u16 {
                udp_from(&mut e, [192, 0, 2, host], 10_000 + port, 0);
            }
        }
        assert_eq!(e.flows().len(), 300);
        // Another source still opens flows, TCP and UDP.
        assert_eq!(
            udp_from(&mut e, [198, 51, 100, 7], 1, 1),
            Verdict::Tx(Side::Pod(0))
        );
        let mut s = tcp([198, 51, 100, 7], 2, VIP, 80, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut s, Side::Uplink, &nb, 1),
            Verdict::Tx(Side::Pod(0))
        );
        // Refused while at its quota, accepted once its flows have ended.
        assert_eq!(
            udp_from(&mut e, CLIENT, 20_000, 2),
            Verdict::Drop(DropReason::SourceOverQuota)
        );
        let later = u64::from(Timeouts::default().udp_ms) + 1;
        e.sweep(later, 1024);
        assert_eq!(
            udp_from(&mut e, CLIENT, 20_000, later),
            Verdict::Tx(Side::Pod(0))
        );
    }

    #[test]
    fn udp_round_trip() {
        let nb = neighbours();
        let mut e = engine(&[B1]);
        let mut f = build(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"query");
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Tx(Side::Pod(0))
        );
        assert_checksums_valid(&f);
        let mut r = build(IPPROTO_UDP, B1, 8080, CLIENT, 5353, b"answer");
        assert_eq!(
            e.process(&mut r, Side::Pod(0), &nb, 1),
            Verdict::Tx(Side::Uplink)
        );
        assert_checksums_valid(&r);
        assert_eq!(parse(&r).src, ip(VIP));
    }

    #[test]
    fn two_frontends_to_one_pod_port_from_one_client_port_are_one_connection_at_the_pod() {
        // Without SNAT the Pod sees client:port <-> pod:port only: a second VIP leading
        // to the same Pod port, from the same client port, would be the same connection
        // there. The second SYN is dropped, named (docs/k8s-sync.md).
        let nb = neighbours();
        let (mut st, m) = state(&[B1]);
        let mut second = st.services[0].clone();
        second.frontend.vip = Ipv4Addr::from([203, 0, 113, 12]);
        st.services.push(second);
        st.normalize();
        let m: Vec<Vec<u16>> = st
            .services
            .iter()
            .map(|x| {
                if x.backends.is_empty() {
                    vec![]
                } else {
                    m[0].clone()
                }
            })
            .collect();
        let mut e = engine_for(&st, &m);
        let mut first = tcp(CLIENT, 40000, VIP, 80, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut first, Side::Uplink, &nb, 0),
            Verdict::Tx(Side::Pod(0))
        );
        let mut other = tcp(CLIENT, 40000, [203, 0, 113, 12], 80, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut other, Side::Uplink, &nb, 1),
            Verdict::Drop(DropReason::FlowConflict)
        );
        // Another client port is another connection.
        let mut next = tcp(CLIENT, 40001, [203, 0, 113, 12], 80, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut next, Side::Uplink, &nb, 2),
            Verdict::Tx(Side::Pod(0))
        );
    }

    #[test]
    fn a_handed_off_udp_port_without_a_backend_hands_its_datagrams_to_a_peer() {
        // A shared VIP's UDP port whose Pods are on other nodes (or the Cluster policy):
        // with redirects on and a peer known, the datagram goes to the peer; without
        // a peer, it is dropped here under its name.
        let nb = neighbours();
        let (mut st, m) = state(&[]);
        for x in &mut st.services {
            x.hand_off = true;
        }
        let engine = |peers: Vec<u32>| {
            let mut e = Engine::new(EngineConfig {
                flow_capacity: 1024,
                ..Default::default()
            });
            e.set_redirect(crate::redirect::Redirector::new(
                crate::redirect::RedirectConfig {
                    node: 0x0a01_0001,
                    port: crate::redirect::DEFAULT_PORT,
                    peers,
                    rate_per_s: 100,
                    burst: 100,
                    prefix_rate_per_s: 100,
                    prefix_burst: 100,
                    node_from_state: false,
                },
            ));
            e.set_services(ServiceTable::new(1, &st, &m));
            e
        };
        let mut f = build(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"query");
        let mut handing = engine(vec![0x0a01_0002]);
        let v = handing.process(&mut f, Side::Uplink, &nb, 0);
        // The peer's neighbour entry is unknown in this table: asked for, named.
        assert!(
            matches!(
                v,
                Verdict::Redirect | Verdict::Drop(DropReason::NoNeighbour)
            ),
            "{v:?}"
        );
        assert_eq!(handing.counters().drops_for(DropReason::NoBackend), 0);
        let mut alone = engine(vec![]);
        let mut f = build(IPPROTO_UDP, CLIENT, 5353, VIP, 53, b"query");
        assert_eq!(
            alone.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::NoBackend)
        );
        assert_eq!(alone.counters().drops_for(DropReason::NoBackend), 1);
    }

    /// A host-network frontend's packet is the kernel's (the steering program passes
    /// it): one that reaches userspace is dropped as `kernel_bound`, never forwarded.
    #[test]
    fn a_host_network_frontend_s_packet_in_userspace_is_kernel_bound() {
        let (mut st, m) = state(&[[10, 0, 0, 2]]);
        for x in &mut st.services {
            x.host_network = true;
        }
        let mut e = engine_for(&st, &m);
        let mut f = syn(40000);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &neighbours(), 0),
            Verdict::Drop(DropReason::KernelBound)
        );
        assert_eq!(e.counters().drops_for(DropReason::KernelBound), 1);
    }

    /// `whole` (DF cleared) cut into IPv4 fragments of at most 1514-byte frames.
    fn fragments_of(mut whole: Vec<u8>) -> Vec<Vec<u8>> {
        whole[14 + 6] &= !0x40;
        let ipc = packet::ipv4_header_checksum(&whole[14..34]);
        whole[24..26].copy_from_slice(&ipc.to_be_bytes());
        let cut = crate::segment::Cut::plan(&whole, 1514, None).unwrap();
        let mut out = vec![0u8; 1514];
        (0..cut.pieces())
            .map(|i| {
                let n = cut.write(&whole, i, &mut out);
                out[..n].to_vec()
            })
            .collect()
    }

    /// Puts fragments' payloads back together (as the receiver does) into one datagram.
    fn reassemble(frags: &[Vec<u8>]) -> Vec<u8> {
        let mut whole = frags[0][..34].to_vec();
        let mut body = Vec::new();
        for f in frags {
            let off = usize::from(packet::fragment_offset(f)) * 8;
            let b = &f[34..];
            if body.len() < off + b.len() {
                body.resize(off + b.len(), 0);
            }
            body[off..off + b.len()].copy_from_slice(b);
        }
        whole[14 + 2..14 + 4].copy_from_slice(&((20 + body.len()) as u16).to_be_bytes());
        whole[14 + 6] = 0;
        whole[24..26].copy_from_slice(&[0, 0]);
        let ipc = packet::ipv4_header_checksum(&whole[14..34]);
        whole[24..26].copy_from_slice(&ipc.to_be_bytes());
        whole.extend_from_slice(&body);
        whole
    }

    #[test]
    fn fragments_follow_their_first_fragment_both_ways_in_any_order() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let payload: Vec<u8> = (0..4000u32).map(|i| (i * 13) as u8).collect();
        let frags = fragments_of(build(IPPROTO_UDP, CLIENT, 5353, VIP, 53, &payload));
        assert_eq!(frags.len(), 3);
        // The last fragment first: held; then the first (NATed, releases the last); then
        // the middle one.
        let mut sent = Vec::new();
        let mut f2 = frags[2].clone();
        assert_eq!(e.process(&mut f2, Side::Uplink, &nb, 0), Verdict::Consumed);
        for (i, t) in [(0usize, 1u64), (1, 2)] {
            let mut f = frags[i].clone();
            assert!(matches!(
                e.process(&mut f, Side::Uplink, &nb, t),
                Verdict::Tx(Side::Pod(_))
            ));
            sent.push(f);
            for (r, side) in e.take_released() {
                assert!(matches!(side, Side::Pod(_)));
                sent.push(r);
            }
        }
        assert_eq!(sent.len(), 3);
        let backend = parse(&sent[0]).dst;
        assert!(
            sent.iter().all(|f| parse(f).dst == backend),
            "one backend for all"
        );
        let mut order = sent.clone();
        order.sort_by_key(|f| packet::fragment_offset(f));
        let d = reassemble(&order);
        assert_checksums_valid(&d);
        let v = parse(&d);
        assert_eq!(v.l4.map(|l| l.dst_port), Some(8080));
        assert_eq!(&d[42..], &payload[..]);
        // The backend's large answer, fragmented by its kernel, leaves from the VIP.
        let b = backend.to_be_bytes();
        let answer = fragments_of(build(IPPROTO_UDP, b, 8080, CLIENT, 5353, &payload));
        let mut out = Vec::new();
        for (i, f) in answer.iter().enumerate() {
            let mut f = f.clone();
            assert_eq!(
                e.process(&mut f, Side::Pod(0), &nb, 10 + i as u64),
                Verdict::Tx(Side::Uplink)
            );
            out.push(f);
        }
        let d = reassemble(&out);
        assert_checksums_valid(&d);
        assert_eq!(parse(&d).src, ip(VIP));
        assert_eq!(parse(&d).l4.map(|l| l.src_port), Some(53));
        assert_eq!(e.fragment_datagrams(), 2);
        // Nothing outlives the timeout.
        e.sweep(20 + FRAG_TIMEOUT_MS, 64);
        assert_eq!(e.fragment_datagrams(), 0);
    }

    /// A later fragment whose TTL runs out goes to the kernel at once (its ICMP time
    /// exceeded), even before its first fragment: never held, where it could only be
    /// sent on or dropped, and counted once, as passed.
    #[test]
    fn an_early_fragment_whose_ttl_runs_out_is_passed_not_held() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let payload: Vec<u8> = (0..4000u32).map(|i| i as u8).collect();
        let frags = fragments_of(build(IPPROTO_UDP, CLIENT, 5353, VIP, 53, &payload));
        let mut last = frags[2].clone();
        last[14 + 8] = 1;
        last[24..26].copy_from_slice(&[0, 0]);
        let ipc = packet::ipv4_header_checksum(&last[14..34]);
        last[24..26].copy_from_slice(&ipc.to_be_bytes());
        assert_eq!(
            e.process(&mut last, Side::Uplink, &nb, 0),
            Verdict::Pass(PassReason::TtlExpired)
        );
        let mut first = frags[0].clone();
        assert!(matches!(
            e.process(&mut first, Side::Uplink, &nb, 1),
            Verdict::Tx(Side::Pod(_))
        ));
        assert!(e.take_released().is_empty(), "nothing was held");
        assert_eq!(e.counters().kernel_bound, 1);
    }

    #[test]
    fn removed_backend_flows_drop_others_stay() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let mut on = std::collections::HashMap::new();
        for p in 0..100u16 {
            let mut f = syn(20000 + p);
            e.process(&mut f, Side::Uplink, &nb, 0);
            on.insert(p, parse(&f).dst);
        }
        update(&mut e, 2, &[B1]);
        for p in 0..100u16 {
            let mut f = build(IPPROTO_TCP, CLIENT, 20000 + p, VIP, 80, b"more");
            let verdict = e.process(&mut f, Side::Uplink, &nb, 5);
            if on[&p] == ip(B1) {
                assert_eq!(verdict, Verdict::Tx(Side::Pod(0)));
                assert_eq!(parse(&f).dst, ip(B1));
            } else {
                assert_eq!(verdict, Verdict::Drop(DropReason::BackendRemoved));
            }
        }
        // Replies from the removed backend are dropped too, never leaked.
        let p = on.iter().find(|(_, &b)| b == ip(B2)).map(|(p, _)| *p);
        if let Some(p) = p {
            let mut r = build(IPPROTO_TCP, B2, 8080, CLIENT, 20000 + p, b"");
            assert!(matches!(
                e.process(&mut r, Side::Pod(1), &nb, 6),
                Verdict::Drop(_)
            ));
        }
        // Added backend: existing flows stay where they are.
        update(&mut e, 3, &[B1, B2]);
        for p in 0..100u16 {
            if on[&p] == ip(B1) {
                let mut f = build(IPPROTO_TCP, CLIENT, 20000 + p, VIP, 80, b"again");
                assert_eq!(
                    e.process(&mut f, Side::Uplink, &nb, 7),
                    Verdict::Tx(Side::Pod(0))
                );
            }
        }
    }

    /// Sets `ranges` on the TCP frontend of `state(backends)` as generation `generation`.
    fn update_ranges(e: &mut Engine, generation: u64, backends: &[[u8; 4]], ranges: &[&str]) {
        let (mut s, m) = state(backends);
        let tcp = s
            .services
            .iter_mut()
            .find(|x| x.frontend.protocol == Protocol::Tcp && x.frontend.port == 80)
            .unwrap();
        tcp.source_ranges = ranges.iter().map(|r| r.parse().unwrap()).collect();
        e.set_services(ServiceTable::new(generation, &s, &m));
    }

    /// A client the source ranges admit opens connections; another is dropped under its
    /// own name before it costs a flow, on the Service's counters; a held flow whose
    /// client new ranges leave out ends at its next packet (both ways), and the clients
    /// both lists admit keep theirs.
    #[test]
    fn source_ranges_admit_their_clients_and_end_the_flows_of_others() {
        let nb = neighbours();
        let mut e = engine(&[B1]);
        update_ranges(&mut e, 2, &[B1], &["192.0.2.0/24"]);
        let other = [198, 18, 0, 9];
        let mut f = tcp(other, 40000, VIP, 80, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::SourceRangeDenied)
        );
        assert_eq!(e.flows().len(), 0, "a denied SYN costs no flow");
        let s = e.services().find(ip(VIP), IPPROTO_TCP, 80).unwrap() as usize;
        assert_eq!(e.counters().services[s].drops, 1);
        // UDP on the same VIP has no ranges: the stranger is served there.
        let mut u = build_with(IPPROTO_UDP, other, 5353, VIP, 53, b"q", 64, 0);
        assert_eq!(
            e.process(&mut u, Side::Uplink, &nb, 0),
            Verdict::Tx(Side::Pod(0))
        );

        for p in [20000u16, 20001] {
            let mut f = syn(p);
            assert_eq!(
                e.process(&mut f, Side::Uplink, &nb, 1),
                Verdict::Tx(Side::Pod(0))
            );
        }
        // New ranges still admit the first client's /24 with a longer prefix; then none.
        update_ranges(&mut e, 3, &[B1], &["192.0.2.0/25", "10.0.0.0/8"]);
        let mut f = build(IPPROTO_TCP, CLIENT, 20000, VIP, 80, b"kept");
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 2),
            Verdict::Tx(Side::Pod(0))
        );
        update_ranges(&mut e, 4, &[B1], &["10.0.0.0/8"]);
        let mut r = build(IPPROTO_TCP, B1, 8080, CLIENT, 20001, b"reply");
        assert_eq!(
            e.process(&mut r, Side::Pod(0), &nb, 3),
            Verdict::Drop(DropReason::SourceRangeDenied)
        );
        let mut f = build(IPPROTO_TCP, CLIENT, 20000, VIP, 80, b"cut");
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 3),
            Verdict::Drop(DropReason::SourceRangeDenied)
        );
        assert_eq!(e.flows().len(), 1, "only the stranger's UDP flow is left");
        // No ranges again: everyone.
        update_ranges(&mut e, 5, &[B1], &[]);
        let mut f = tcp(other, 40001, VIP, 80, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 4),
            Verdict::Tx(Side::Pod(0))
        );
    }

    /// `sessionAffinity: ClientIP`: every connection of a client goes to one backend,
    /// which another backend's arrival does not change; without it, connections spread.
    #[test]
    fn client_ip_affinity_keeps_a_clients_connections_on_one_backend() {
        let nb = neighbours();
        let with_affinity = |e: &mut Engine, generation: u64, backends: &[[u8; 4]]| {
            let (mut s, m) = state(backends);
            for x in &mut s.services {
                x.client_ip_affinity = Some(10);
            }
            e.set_services(ServiceTable::new(generation, &s, &m));
        };
        let backend_of = |e: &mut Engine, client: [u8; 4], port: u16, now: u64| {
            let mut f = tcp(client, port, VIP, 80, tcp_flags::SYN);
            assert!(matches!(
                e.process(&mut f, Side::Uplink, &nb, now),
                Verdict::Tx(_)
            ));
            parse(&f).dst
        };
        let mut e = engine(&[B1]);
        with_affinity(&mut e, 2, &[B1, B2]);
        for client in [CLIENT, [192, 0, 2, 77], [198, 18, 3, 4]] {
            let first = backend_of(&mut e, client, 30000, 0);
            for p in 1..20 {
                assert_eq!(backend_of(&mut e, client, 30000 + p, 100), first);
            }
        }
        // Clients that came while B1 was alone stay on it when B2 arrives, until their
        // timeout (10 s) passes without a new connection; new clients spread.
        with_affinity(&mut e, 3, &[B1]);
        let clients: Vec<[u8; 4]> = (1..=60u8).map(|i| [198, 18, 9, i]).collect();
        for c in &clients {
            assert_eq!(backend_of(&mut e, *c, 40000, 1_000), ip(B1));
        }
        with_affinity(&mut e, 4, &[B1, B2]);
        for c in &clients {
            assert_eq!(backend_of(&mut e, *c, 40001, 9_000), ip(B1));
        }
        let later: std::collections::HashSet<u32> = clients
            .iter()
            .map(|c| backend_of(&mut e, *c, 40002, 30_000))
            .collect();
        assert_eq!(later.len(), 2, "after the timeout the hash spreads them");
        // Without affinity one client's connections spread over both.
        let mut plain = engine(&[B1, B2]);
        let seen: std::collections::HashSet<u32> = (0..40)
            .map(|p| backend_of(&mut plain, CLIENT, 50000 + p, 0))
            .collect();
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn missing_neighbour_is_requested_and_dropped() {
        let mut nb = Neighbours::new(
            Iface {
                ifindex: 2,
                mac: UP_MAC,
            },
            vec![Iface {
                ifindex: 10,
                mac: P0_MAC,
            }],
        );
        nb.add_route(Route {
            prefix: ip(B1),
            len: 32,
            gateway: None,
            ifindex: 10,
        });
        let mut e = engine(&[B1]);
        let mut f = syn(1);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::NoNeighbour)
        );
        assert_eq!(e.missing.take().collect::<Vec<_>>(), vec![(ip(B1), 10)]);
        assert_eq!(e.missing.take().count(), 0);
        // Once resolved, the retransmitted SYN goes through on the same flow.
        nb.add_neighbour(ip(B1), 10, B1_MAC);
        let mut f = syn(1);
        assert_eq!(
            e.process(&mut f, Side::Uplink, &nb, 1),
            Verdict::Tx(Side::Pod(0))
        );
        assert_eq!(e.flows().len(), 1);
    }

    #[test]
    fn counters_follow_frontends_across_updates() {
        let nb = neighbours();
        let mut e = engine(&[B1]);
        let mut f = syn(1);
        e.process(&mut f, Side::Uplink, &nb, 0);
        update(&mut e, 2, &[B1, B2]);
        let s = e.services().find(ip(VIP), IPPROTO_TCP, 80).unwrap();
        assert_eq!(e.counters().services[s as usize].new_flows, 1);
    }

    #[test]
    fn garbage_never_panics() {
        let nb = neighbours();
        let mut e = engine(&[B1, B2]);
        let mut seed = 0x1234_5678_u64;
        for i in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mut f = if i % 2 == 0 {
                syn((seed % 1000) as u16)
            } else {
                build(IPPROTO_UDP, B1, 8080, CLIENT, (seed % 1000) as u16, b"x")
            };
            let pos = (seed >> 16) as usize % f.len();
            f[pos] = (seed >> 40) as u8;
            let cut = (seed >> 24) as usize % (f.len() + 1);
            f.truncate(cut.max(f.len() / 2));
            let side = if i % 2 == 0 {
                Side::Uplink
            } else {
                Side::Pod(0)
            };
            let _ = e.process(&mut f, side, &nb, i);
        }
    }

    /// One step of the fast/general equivalence check.
    #[derive(Debug, Clone)]
    struct Step {
        reply: bool,
        tcp: bool,
        client_port: u16,
        backend: bool,
        flags: u8,
        ttl: u8,
        /// 0 complete, 1 partial (offload), 2 corrupt, 3 UDP without checksum.
        checksum: u8,
        /// 0: publish a new table (backends change), otherwise nothing.
        update: u8,
        payload: usize,
    }

    fn step() -> impl Strategy<Value = Step> {
        (
            any::<bool>(),
            any::<bool>(),
            0u16..6,
            any::<bool>(),
            prop::sample::select(vec![
                0u8,
                tcp_flags::SYN,
                tcp_flags::SYN | tcp_flags::ACK,
                tcp_flags::ACK,
                tcp_flags::FIN | tcp_flags::ACK,
                tcp_flags::RST,
            ]),
            prop::sample::select(vec![0u8, 1, 2, 64]),
            0u8..4,
            0u8..12,
            0usize..40,
        )
            .prop_map(
                |(reply, tcp, client_port, backend, flags, ttl, checksum, update, payload)| Step {
                    reply,
                    tcp,
                    client_port,
                    backend,
                    flags,
                    ttl,
                    checksum,
                    update,
                    payload,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// The established-flow fast path changes nothing but speed: the same packets
        /// through an engine with it and one without give the same verdicts, the same
        /// bytes and the same counters — across TCP states, TTLs, partial, corrupt and
        /// absent checksums, and table updates that add and remove backends.
        #[test]
        fn fast_path_is_identical_to_the_general_path(steps in prop::collection::vec(step(), 1..80)) {
            let nb = neighbours();
            let mut fast = engine(&[B1, B2]);
            let mut general = engine(&[B1, B2]);
            general.set_fast_path(false);
            let mut generation = 1;
            for (now, st) in steps.iter().enumerate() {
                if st.update == 0 {
                    generation += 1;
                    let set: &[[u8; 4]] = match generation % 3 {
                        0 => &[B1],
                        1 => &[B1, B2],
                        _ => &[B2],
                    };
                    update(&mut fast, generation, set);
                    update(&mut general, generation, set);
                }
                let proto = if st.tcp { IPPROTO_TCP } else { IPPROTO_UDP };
                let vport = if st.tcp { 80 } else { 53 };
                let cport = 40000 + st.client_port;
                let payload = vec![0x5au8; st.payload];
                let backend = if st.backend { B2 } else { B1 };
                let (mut f, side) = if st.reply {
                    let side = Side::Pod(u16::from(st.backend));
                    (build_with(proto, backend, 8080, CLIENT, cport, &payload, st.ttl, st.flags), side)
                } else {
                    (build_with(proto, CLIENT, cport, VIP, vport, &payload, st.ttl, st.flags), Side::Uplink)
                };
                match st.checksum {
                    1 => set_partial_checksum(&mut f),
                    2 => {
                        let off = if st.tcp { 14 + 20 + 16 } else { 14 + 20 + 6 };
                        f[off] ^= 0x21;
                    }
                    3 if !st.tcp => f[14 + 20 + 6..14 + 20 + 8].copy_from_slice(&[0, 0]),
                    _ => {}
                }
                let (mut a, mut b) = (f.clone(), f);
                let va = fast.process(&mut a, side, &nb, now as u64);
                let vb = general.process(&mut b, side, &nb, now as u64);
                prop_assert_eq!(va, vb, "step {} {:?}", now, st);
                prop_assert_eq!(&a, &b, "step {} {:?}", now, st);
            }
            let (ca, cb) = (fast.counters(), general.counters());
            prop_assert_eq!(ca.drops, cb.drops);
            prop_assert_eq!(&ca.services, &cb.services);
            prop_assert_eq!((ca.rx_packets, ca.kernel_bound), (cb.rx_packets, cb.kernel_bound));
            prop_assert_eq!(fast.flows().len(), general.flows().len());
        }
    }
}
