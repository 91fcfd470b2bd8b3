//! The engine's IPv6 path (issue #28): DNAT of a client's packets to a local backend and
//! reverse NAT of the backend's replies, without SNAT (the Pod sees the client's address),
//! through the IPv6 flow table ([`crate::flow6`]); ICMPv6 errors about a flow relayed to
//! its other end — Packet Too Big above all, since IPv6 routers never fragment; everything
//! else to a VIP dropped under a named reason.
//!
//! One IPv6 flow table serves every forwarding worker, locked once per IPv6 packet: a
//! flow's replies may reach another worker's socket than its client's packets (a Pod's
//! veth has one queue), and unlike IPv4's tables it is not readable across processes.
//!
//! Redirects between nodes go through the IPv4 path's channel (`engine6_redirect.rs`).
//!
//! What the IPv4 path has and this one has not yet: the established-flow fast path, the
//! XDP fast path, fragments (dropped as `fragment`), cutting a Pod's super-segment for
//! its egress (dropped as `too_big` by the caller). ClientIP affinity is IPv4's table
//! ([`crate::affinity`]), one per worker for IPv6 clients.

use crate::counters::{DropReason, ServiceCounters};
use crate::flow::Direction;
use crate::flow6::{Flow6, Flow6Key, Flow6Table, Insert6Error};
use crate::neigh::{Neighbours, Resolve6, Side};
use crate::packet::{set_macs, tcp_flags};
use crate::packet6::{self, Icmp6ErrorView, Ipv6View, Side6, Upper};
use crate::services6::{Backend6, Services6};

use super::{Engine, PassReason, Verdict, MAGLEV_HASH_SEED};
use std::sync::{Arc, Mutex, MutexGuard};

/// The IPv6 flow table the forwarding workers share.
pub type SharedFlows6 = Arc<Mutex<Flow6Table>>;

pub(super) fn lock(t: &SharedFlows6) -> MutexGuard<'_, Flow6Table> {
    // A worker that panicked while holding it took the process down with it: a
    // poisoned lock is never seen by a live worker, but is not a reason to stop either.
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The engine's IPv6 state.
#[derive(Debug)]
pub struct V6 {
    /// Shared by the workers (a reply may reach another worker's socket than its
    /// client's packets: a Pod's veth has one queue); locked once per IPv6 packet.
    pub(super) flows: SharedFlows6,
    pub(super) services: Services6,
    /// Per IPv6 service, indexed like `services`.
    counters: Vec<ServiceCounters>,
    /// IPv6 next hops to resolve, taken by the I/O loop after a batch.
    missing: super::MissingNeighbours<[u8; 16]>,
    /// This worker's ClientIP affinity entries of IPv6 clients (new flows only).
    affinity: crate::affinity::AffinityTable6,
}

impl V6 {
    pub(super) fn new(flows: Flow6Table) -> Self {
        V6 {
            flows: Arc::new(Mutex::new(flows)),
            services: Services6::default(),
            counters: Vec::new(),
            missing: Default::default(),
            affinity: Default::default(),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        lock(&self.flows).capacity()
    }
}

/// The Maglev hash of an IPv6 5-tuple (or of the client's address alone): SipHash-1-3
/// under the fixed Maglev seed, so every node and every restart picks alike.
pub(super) fn maglev_hash6(k: &Flow6Key, client_only: bool) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher13::new_with_keys(MAGLEV_HASH_SEED, !MAGLEV_HASH_SEED);
    h.write(&k.src);
    if !client_only {
        h.write(&k.dst);
        h.write(&[(k.src_port >> 8) as u8, k.src_port as u8]);
        h.write(&[(k.dst_port >> 8) as u8, k.dst_port as u8, k.proto]);
    }
    h.finish()
}

pub(super) fn key_of(v: &Ipv6View, proto: u8) -> Option<Flow6Key> {
    let l4 = v.l4?;
    Some(Flow6Key {
        src: v.src,
        dst: v.dst,
        src_port: l4.src_port,
        dst_port: l4.dst_port,
        proto,
    })
}

impl Engine {
    /// Installs the IPv6 service table of a new state generation.
    /// A frontend's counters carry over to the new table.
    pub fn set_services6(&mut self, services: Services6) {
        let mut counters = vec![ServiceCounters::default(); services.services().len()];
        for (old, c) in self.v6.services.services().iter().zip(&self.v6.counters) {
            if let Some(j) = services.find(old.vip, old.proto, old.port) {
                counters[j as usize] = *c;
            }
        }
        self.v6.services = services;
        self.v6.counters = counters;
    }

    /// The IPv6 service table in use.
    pub fn services6(&self) -> &Services6 {
        &self.v6.services
    }

    /// The IPv6 flow table (to mirror it into the steering program's map, to read it).
    pub fn flows6_mut(&mut self) -> MutexGuard<'_, Flow6Table> {
        lock(&self.v6.flows)
    }

    /// IPv6 flows held and the table's capacity.
    pub fn flows6_counts(&self) -> (usize, usize) {
        let t = lock(&self.v6.flows);
        (t.len(), t.capacity())
    }

    /// The IPv6 flow table, to share with the other workers.
    pub fn flows6_shared(&self) -> SharedFlows6 {
        Arc::clone(&self.v6.flows)
    }

    /// Uses `flows` (another worker's, shared) as this engine's IPv6 flow table.
    pub fn share_flows6(&mut self, flows: SharedFlows6) {
        self.v6.flows = flows;
    }

    /// Per IPv6 service counters, indexed like [`Engine::services6`].
    pub fn service_counters6(&self) -> &[ServiceCounters] {
        &self.v6.counters
    }

    /// Takes the IPv6 next hops whose resolution the engine needs.
    pub fn take_missing6(&mut self) -> impl Iterator<Item = ([u8; 16], u32)> + '_ {
        self.v6.missing.take()
    }

    /// Ends up to `budget` expired IPv6 flows.
    pub fn sweep6(&mut self, now_ms: u64, budget: usize) -> usize {
        lock(&self.v6.flows).sweep(now_ms, budget)
    }

    pub(super) fn drop6(&mut self, r: DropReason, service: Option<u32>) -> Verdict {
        if let Some(c) = service.and_then(|s| self.v6.counters.get_mut(s as usize)) {
            c.drops += 1;
        }
        self.counters.drop(r);
        Verdict::Drop(r)
    }

    /// An IPv6 frame (the general path's dispatch on the ethertype; a redirected packet's
    /// inner one).
    pub(super) fn process6(
        &mut self,
        frame: &mut [u8],
        ingress: Side,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let Ok(v) = packet6::parse6(frame) else {
            return self.drop6(DropReason::Malformed, None);
        };
        if ingress == Side::Uplink && !self.v6.services.is_vip(v.dst) {
            return self.pass(PassReason::NotForUs);
        }
        if v.hop_limit <= 1 {
            return self.pass(PassReason::TtlExpired);
        }
        let shared = Arc::clone(&self.v6.flows);
        let t = &mut *lock(&shared);
        match v.upper {
            Upper::Other(_) => self.drop6(DropReason::Ipv6ExtensionHeader, None),
            Upper::LaterFragment(_) => self.drop6(DropReason::Fragment, None),
            Upper::Transport(_) if v.fragment => self.drop6(DropReason::Fragment, None),
            Upper::Transport(p) => match ingress {
                Side::Uplink => self.forward6(t, frame, v, p, nb, now_ms),
                Side::Pod(_) => self.reverse6(t, frame, v, p, nb, now_ms),
            },
            Upper::Icmp => match packet6::parse_icmp6_error(frame, &v) {
                Some(e) => self.relay_icmp6_error(t, frame, v, e, ingress, nb, now_ms),
                None if ingress == Side::Uplink => {
                    self.drop6(DropReason::UnsupportedProtocol, None)
                }
                None => self.pass(PassReason::NotForUs),
            },
        }
    }

    /// A client's packet to a VIP: its flow's backend, or a new flow's.
    fn forward6(
        &mut self,
        t: &mut Flow6Table,
        frame: &mut [u8],
        mut v: Ipv6View,
        proto: u8,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let Some(key) = key_of(&v, proto) else {
            return self.drop6(DropReason::Malformed, None);
        };
        let flags = v.l4.map_or(0, |l| l.tcp_flags);
        if let Some(r) = self.redirect_hook6(t, frame.len(), &key, flags, nb, now_ms) {
            return r;
        }
        let syn_only = proto == crate::proto::IPPROTO_TCP && tcp_flags::lone_syn(flags);
        let found = match t.lookup(&key, now_ms) {
            Some((id, Direction::Forward)) if syn_only && self.syn_reopens6(t, id) => None,
            other => other,
        };
        let id = match found {
            Some((id, Direction::Forward)) => match self.revalidate6(t, id) {
                Ok(id) => id,
                Err(r) => return r,
            },
            Some((_, Direction::Reverse)) => return self.drop6(DropReason::FlowConflict, None),
            None => match self.open6(t, (&key, flags), (frame.len(), nb), now_ms) {
                Ok(id) => {
                    let mss = crate::segment::tcp_mss_option(frame, v.l4_offset());
                    if let (crate::proto::IPPROTO_TCP, Some(m)) = (proto, mss) {
                        t.note_client_mss(id, m, false);
                    }
                    id
                }
                Err(r) => return r,
            },
        };
        t.touch(id, Direction::Forward, flags, now_ms);
        let f = *t.get(id).expect("a live flow");
        let len = frame.len();
        packet6::rewrite6(frame, &mut v, Side6::Destination, f.backend, f.backend_port);
        let verdict = self.egress6(frame, &mut v, f.backend, nb, f.service);
        self.count_forwarded(verdict, f.service, true, len)
    }

    /// Whether a lone SYN that found forward flow `id` opens a new connection, as IPv4's
    /// `syn_reopens`: the client re-uses the 4-tuple of a connection that ended (its port
    /// is free again at once when the server closed first, while the record waits out
    /// its FIN timeout), or the flow's backend no longer takes new connections — a
    /// draining Pod's closed listener would answer with a reset. The old record is
    /// removed then, and the SYN goes where any new connection goes. A SYN retransmitted
    /// during a handshake to a backend that is still Ready stays on its flow, and so does
    /// every flow before the first service table (kept for it, as `revalidate6` says).
    #[cold]
    fn syn_reopens6(&self, t: &mut Flow6Table, id: u32) -> bool {
        if self.v6.services.generation() == 0 {
            return false;
        }
        let Some(f) = t.get(id) else {
            return true;
        };
        let handshake = matches!(
            f.state,
            crate::flow::FlowState::SynSent | crate::flow::FlowState::SynReceived
        );
        if handshake && self.backend_ready6(f) {
            return false;
        }
        t.remove(id);
        true
    }

    /// Whether flow `f`'s backend is a Ready one of its frontend in the current table.
    fn backend_ready6(&self, f: &Flow6) -> bool {
        let b = Backend6 {
            ip: f.backend,
            port: f.backend_port,
        };
        self.v6
            .services
            .find(f.vip, f.proto, f.vip_port)
            .and_then(|s| self.v6.services.service(s))
            .is_some_and(|s| s.ready_backends().contains(&b))
    }

    /// A new flow for a client's first packet: the frontend, its admission, a backend
    /// (none here: handed to a peer, [`Engine::no_backend6`]).
    fn open6(
        &mut self,
        t: &mut Flow6Table,
        (key, flags): (&Flow6Key, u8),
        (frame_len, nb): (usize, &Neighbours),
        now_ms: u64,
    ) -> Result<u32, Verdict> {
        let Some(s) = self.v6.services.find(key.dst, key.proto, key.dst_port) else {
            return Err(self.drop6(DropReason::PortNotExposed, None));
        };
        let svc = self.v6.services.service(s).expect("found above");
        if !svc.admits(key.src) {
            return Err(self.drop6(DropReason::SourceRangeDenied, Some(s)));
        }
        if !self.admitted(crate::admission::key_v6(&key.src)) {
            return Err(self.drop6(DropReason::NewFlowPrefixRateLimited, Some(s)));
        }
        let syn = flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN;
        if key.proto == crate::proto::IPPROTO_TCP && !syn {
            return Err(self.drop6(DropReason::NonSynWithoutFlow, Some(s)));
        }
        let Some(b) = self.pick_backend6(s, key, now_ms) else {
            return Err(self.no_backend6(frame_len, key, syn, s, nb, now_ms));
        };
        let generation = self.v6.services.generation();
        let f = Flow6::new(
            (key.src, key.src_port),
            (key.dst, key.dst_port),
            (b.ip, b.port),
            key.proto,
            flags,
            s,
            generation,
        );
        match t.insert(f, now_ms) {
            Ok(id) => {
                if let Some(c) = self.v6.counters.get_mut(s as usize) {
                    c.new_flows += 1;
                }
                Ok(id)
            }
            Err(e) => Err(self.drop6(
                match e {
                    Insert6Error::Full => DropReason::FlowTableFull,
                    Insert6Error::Conflict => DropReason::FlowConflict,
                    Insert6Error::NotPublished => DropReason::FlowNotPublished,
                },
                Some(s),
            )),
        }
    }

    /// The Ready backend a new flow of `key` to service `s` goes to: Maglev of its
    /// 5-tuple, or with ClientIP affinity the client's kept backend, else Maglev of the
    /// client's address alone ([`crate::affinity`]), as IPv4's `pick_backend`.
    fn pick_backend6(&mut self, s: u32, key: &Flow6Key, now_ms: u64) -> Option<Backend6> {
        let svc = self.v6.services.service(s)?;
        let Some(timeout_ms) = svc.client_ip_affinity_ms else {
            return svc.pick(maglev_hash6(key, false));
        };
        let hashed = svc.pick_index(maglev_hash6(key, true));
        let ready = svc.ready_backends();
        let i = self.v6.affinity.pick(
            (svc.vip, svc.proto, svc.port),
            key.src,
            timeout_ms,
            now_ms,
            ready,
            hashed,
        )?;
        Some(ready[i])
    }

    /// Checks a flow against the current IPv6 service table: its frontend, its backend
    /// (Ready or draining) and its client's admission; a stale flow ends.
    fn revalidate6(&mut self, t: &mut Flow6Table, id: u32) -> Result<u32, Verdict> {
        let f = *t.get(id).expect("a live flow");
        let generation = self.v6.services.generation();
        if f.generation == generation {
            return Ok(id);
        }
        if generation == 0 {
            // No service table yet (just started, the node state not read): the flow
            // (restored from the pinned map) is kept for when it comes, as IPv4's; this
            // packet is dropped. Ending it here would withdraw its keys, and the
            // backend's next replies would reach the kernel and leave un-translated.
            return Err(self.drop6(DropReason::NoServiceTable, None));
        }
        let found = self.v6.services.find(f.vip, f.proto, f.vip_port);
        let verdict = match found.and_then(|s| Some((s, self.v6.services.service(s)?))) {
            Some((s, svc)) if !svc.admits(f.client) => Some((DropReason::SourceRangeDenied, s)),
            Some((s, svc))
                if svc.has_backend(Backend6 {
                    ip: f.backend,
                    port: f.backend_port,
                }) =>
            {
                t.revalidated(id, s, generation);
                None
            }
            Some((s, _)) => Some((DropReason::BackendRemoved, s)),
            None => {
                t.remove(id);
                return Err(self.drop6(DropReason::BackendRemoved, None));
            }
        };
        match verdict {
            None => Ok(id),
            Some((r, s)) => {
                t.remove(id);
                Err(self.drop6(r, Some(s)))
            }
        }
    }

    /// A backend's reply: the source becomes the VIP again.
    fn reverse6(
        &mut self,
        t: &mut Flow6Table,
        frame: &mut [u8],
        mut v: Ipv6View,
        proto: u8,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let Some(key) = key_of(&v, proto) else {
            return self.drop6(DropReason::Malformed, None);
        };
        let id = match t.lookup(&key, now_ms) {
            Some((id, Direction::Reverse)) => match self.revalidate6(t, id) {
                Ok(id) => id,
                Err(r) => return r,
            },
            _ => return self.drop6(DropReason::NoFlow, None),
        };
        let flags = v.l4.map_or(0, |l| l.tcp_flags);
        t.touch(id, Direction::Reverse, flags, now_ms);
        let f = *t.get(id).expect("a live flow");
        let len = frame.len();
        packet6::rewrite6(frame, &mut v, Side6::Source, f.vip, f.vip_port);
        if self.pod_checksum == super::PodChecksums::Detect {
            // A Pod's veth may hand over a partial (offload) checksum: computed in full.
            packet6::fill_upper_checksum(frame, &v);
        }
        let verdict = self.egress6(frame, &mut v, f.client, nb, f.service);
        self.count_forwarded(verdict, f.service, false, len)
    }

    /// An ICMPv6 error about a flow's packet, to the flow's other end: from the uplink
    /// (a router about a reply: the quote is VIP -> client) to the backend, from a Pod
    /// (the backend about a client's packet: the quote is client -> backend) to the
    /// client. The outer address and the quoted one are rewritten, the checksum computed
    /// again over the whole message (a cold path).
    #[allow(clippy::too_many_arguments)]
    fn relay_icmp6_error(
        &mut self,
        t: &mut Flow6Table,
        frame: &mut [u8],
        mut v: Ipv6View,
        e: Icmp6ErrorView,
        ingress: Side,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let uplink = ingress == Side::Uplink;
        // The quote reversed is the flow's key as its own packets hold it: from the
        // uplink the forward key (client -> VIP), from a Pod the reverse key.
        let key = Flow6Key {
            src: e.inner_dst,
            dst: e.inner_src,
            src_port: e.inner_dst_port,
            dst_port: e.inner_src_port,
            proto: e.inner_protocol,
        };
        let want = if uplink {
            Direction::Forward
        } else {
            Direction::Reverse
        };
        if uplink {
            // A flow another node holds (a redirect record, or none known here): the
            // error goes where the flow's packets go.
            if let Some(r) = self.redirect_icmp6_error(t, frame.len(), &key, nb, now_ms) {
                return r;
            }
        }
        let (id, f) = match t.lookup(&key, now_ms) {
            Some((id, d)) if d == want => (id, *t.get(id).expect("a live flow")),
            _ if uplink => return self.drop6(DropReason::NoFlow, None),
            _ => return self.pass(PassReason::NotForUs),
        };
        // A path MTU towards the client: its segments carry at most that less the IPv6
        // and TCP headers (a Pod's super-segments are cut to it).
        if let (true, Some(mtu), crate::proto::IPPROTO_TCP) = (uplink, e.mtu, f.proto) {
            let mss = mtu.saturating_sub(60).min(u32::from(u16::MAX)) as u16;
            t.note_client_mss(id, mss, true);
        }
        let q = e.inner_offset;
        let (outer, quoted_addr, quoted_port, addr, port, to) = if uplink {
            // Outer dst VIP -> backend; the quote's source VIP:port -> backend:port.
            (24, q + 8, 0, f.backend, f.backend_port, f.backend)
        } else {
            // Outer src backend -> VIP; the quote's destination backend:port -> VIP:port.
            (8, q + 24, 2, f.vip, f.vip_port, f.client)
        };
        let eth = crate::packet::ETH_HEADER_LEN;
        frame[eth + outer..eth + outer + 16].copy_from_slice(&addr);
        frame[quoted_addr..quoted_addr + 16].copy_from_slice(&addr);
        let qport = q + packet6::IPV6_HEADER_LEN + quoted_port;
        if let Some(p) = frame.get_mut(qport..qport + 2) {
            p.copy_from_slice(&port.to_be_bytes());
        }
        if uplink {
            v.dst = addr;
        } else {
            v.src = addr;
        }
        packet6::fill_upper_checksum(frame, &v);
        self.egress6(frame, &mut v, to, nb, f.service)
    }

    /// [`Engine::client_mss`] for an IPv6 reply just reverse-NATed (`VIP:port -> client`).
    pub(super) fn client_mss6(&mut self, frame: &[u8], now_ms: u64) -> Option<u16> {
        let v = packet6::parse6(frame).ok()?;
        let l4 =
            v.l4.filter(|_| v.upper == Upper::Transport(crate::proto::IPPROTO_TCP))?;
        let key = Flow6Key {
            src: v.dst,
            dst: v.src,
            src_port: l4.dst_port,
            dst_port: l4.src_port,
            proto: crate::proto::IPPROTO_TCP,
        };
        let mut t = lock(&self.v6.flows);
        let (id, _) = t.lookup(&key, now_ms)?;
        t.get(id).map(|f| f.client_mss).filter(|&m| m > 0)
    }

    /// Counts a frame of `len` bytes sent on by service `service` (towards the backend or
    /// the client), if it was.
    fn count_forwarded(
        &mut self,
        v: Verdict,
        service: u32,
        to_backend: bool,
        len: usize,
    ) -> Verdict {
        if let (Verdict::Tx(_), Some(c)) = (v, self.v6.counters.get_mut(service as usize)) {
            c.forwarded(to_backend, len);
        }
        v
    }

    /// The hop limit, the next hop's MACs, the egress side.
    fn egress6(
        &mut self,
        frame: &mut [u8],
        v: &mut Ipv6View,
        to: [u8; 16],
        nb: &Neighbours,
        service: u32,
    ) -> Verdict {
        if !packet6::decrement_hop_limit(frame, v) {
            return self.pass(PassReason::TtlExpired);
        }
        match nb.resolve6(to) {
            Resolve6::Found { side, src, dst } => {
                // `tx_packets` is the worker's count of what its TX ring took, as for IPv4.
                set_macs(frame, src, dst);
                Verdict::Tx(side)
            }
            Resolve6::Miss { ip, ifindex } => {
                self.v6.missing.push(ip, ifindex);
                self.drop6(DropReason::NoNeighbour, Some(service))
            }
            Resolve6::NoRoute => self.drop6(DropReason::NoRoute, Some(service)),
        }
    }
}

#[cfg(test)]
#[path = "engine6/tests.rs"]
mod tests;
