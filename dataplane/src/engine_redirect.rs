//! The engine's side of redirects between nodes: where the general path hands
//! packets of flows this node does not hold to another node, and what it does with the
//! redirected packets and notices it receives. A child module of `engine` (it reads the
//! engine's tables); the decisions are [`crate::redirect`]'s, the bytes
//! [`crate::redirect_wire`]'s. Off the established-flow fast path: a redirect record
//! never passes the fast path's generation check, so only the general path sees it.

use super::{macs, Engine, Verdict};
use crate::counters::DropReason;
use crate::flow::{hash_key, Direction, FlowKey, FlowState};
use crate::flow6::Flow6Key;
use crate::neigh::{Neighbours, Resolve, Side};
use crate::packet::{self, tcp_flags, Parsed};
use crate::redirect::{next_hop, next_hop_weighted, HopList, Notice, RedirectOut, Redirector};
use crate::redirect_wire::{
    self as wire, NoticeKey, FLAG_ASK, KIND_ANSWER, KIND_NOTICE, KIND_NOTICE6, KIND_PROBE,
};

/// What asking the peers about a flow needs of its key, IPv4 ([`FlowKey`]) or IPv6
/// ([`Flow6Key`]): the same buckets, hop budget, cookie and wire for both families.
pub(super) trait AskedFlow {
    /// The peers of the flow's VIP, with their weights for new flows handed on.
    fn peers<'r>(&self, r: &'r Redirector) -> (&'r [u32], &'r [u32]);
    /// This node's cookie for a question about the flow.
    fn cookie(&self, r: &Redirector) -> u64;
    /// A token of the client's prefix bucket, then of the node's.
    fn take_token(&self, r: &mut Redirector, now_ms: u64) -> Result<(), DropReason>;
    /// The 5-tuple's hash (the node network's source-port entropy).
    fn flow_hash(&self) -> u64;
    /// What picks the first peer asked: the 5-tuple's hash, or the client's address
    /// alone for a Service with ClientIP affinity ([`Engine::peer_choice_key`]).
    fn choice_hash(&self, e: &Engine) -> u64;
    /// The client's prefix in the new-flow admission ([`crate::admission`]).
    fn admission_key(&self) -> u32;
}

impl AskedFlow for FlowKey {
    fn peers<'r>(&self, r: &'r Redirector) -> (&'r [u32], &'r [u32]) {
        r.weighted_peers_for(self.dst)
    }
    fn cookie(&self, r: &Redirector) -> u64 {
        r.cookie_for(self)
    }
    fn take_token(&self, r: &mut Redirector, now_ms: u64) -> Result<(), DropReason> {
        r.take_token(self.src, now_ms)
    }
    fn admission_key(&self) -> u32 {
        crate::admission::key_v4(self.src)
    }
    fn flow_hash(&self) -> u64 {
        hash_key(self, super::MAGLEV_HASH_SEED)
    }
    fn choice_hash(&self, e: &Engine) -> u64 {
        hash_key(&e.peer_choice_key(self), super::MAGLEV_HASH_SEED)
    }
}

impl AskedFlow for Flow6Key {
    fn peers<'r>(&self, r: &'r Redirector) -> (&'r [u32], &'r [u32]) {
        r.weighted_peers_for6(&self.dst)
    }
    fn cookie(&self, r: &Redirector) -> u64 {
        r.cookie_for6(self)
    }
    fn take_token(&self, r: &mut Redirector, now_ms: u64) -> Result<(), DropReason> {
        r.take_token6(&self.src, now_ms)
    }
    fn admission_key(&self) -> u32 {
        crate::admission::key_v6(&self.src)
    }
    fn flow_hash(&self) -> u64 {
        super::ipv6_path::maglev_hash6(self, false)
    }
    fn choice_hash(&self, e: &Engine) -> u64 {
        let s = e.v6.services.find(self.dst, self.proto, self.dst_port);
        let affinity = s
            .and_then(|s| e.v6.services.service(s))
            .is_some_and(|s| s.client_ip_affinity_ms.is_some());
        super::ipv6_path::maglev_hash6(self, affinity)
    }
}

/// How [`Engine::ask_next_peer`] sends a packet on.
#[derive(Debug, Clone, Copy)]
pub(super) struct Handing {
    /// Whether the first node wants a notice (a redirected packet keeps the first node's
    /// choice).
    pub ask: bool,
    /// Whether it takes a token of the client's bucket (a Cluster-policy connection does
    /// not).
    pub charged: bool,
    /// A new connection or UDP flow no node holds yet: it goes to a peer weighed by its
    /// Ready endpoints ([`next_hop_weighted`]). Else a flow some node may hold: peers in
    /// the order the flow's hash starts ([`next_hop`]), every one a candidate.
    pub new_flow: bool,
}

impl Handing {
    /// A new connection (or UDP flow) without a Ready backend here, handed to a peer:
    /// charged unless the frontend hands flows on by policy (`hand_off`, the Cluster
    /// policy: handing new connections on is this node's job, not a transient to bound).
    pub(super) fn new_flow(hand_off: bool) -> Handing {
        Handing {
            ask: true,
            charged: !hand_off,
            new_flow: true,
        }
    }
}

impl Engine {
    /// Why a new flow without a Ready backend here that no peer took is dropped: no peer
    /// left for a redirected packet, no backend for one of this node's own.
    pub(super) fn no_backend_reason(&self) -> DropReason {
        if self.redirect_ctx.is_some() {
            DropReason::RedirectNoPeer
        } else {
            DropReason::NoBackend
        }
    }

    /// Turns redirects on (this node's address, its peers, the bucket).
    pub fn set_redirect(&mut self, r: Redirector) {
        self.redirect = Some(r);
    }

    /// The redirect state, if redirects are on.
    pub fn redirect(&self) -> Option<&Redirector> {
        self.redirect.as_ref()
    }

    /// The redirect state, mutable (the I/O loop takes notices from it).
    pub fn redirect_mut(&mut self) -> Option<&mut Redirector> {
        self.redirect.as_mut()
    }

    /// Whether redirects are on and `key` is a TCP flow (all are looked up in the
    /// redirect records and asked about).
    pub(super) fn redirects_tcp(&self, key: &FlowKey) -> bool {
        self.redirect.as_ref().is_some_and(|r| r.active()) && key.proto == packet::IPPROTO_TCP
    }

    /// Whether redirects are on and `key` is a UDP flow of a frontend that hands its
    /// flows on (`hand_off`, the caller's look-up of the frontend: the Cluster policy, a
    /// shared VIP's port whose Pods are elsewhere). Datagrams carry no SYN: a flow held
    /// nowhere here is new, served here if it can be, else handed on
    /// ([`Engine::no_backend`]); only the redirect record the owner's notice leaves is
    /// followed.
    pub(super) fn redirects_udp(&self, key: &FlowKey, hand_off: bool) -> bool {
        hand_off
            && key.proto == packet::IPPROTO_UDP
            && self.redirect.as_ref().is_some_and(|r| r.active())
    }

    /// Whether `key`'s frontend hands flows on (`NodeService::hand_off`).
    fn hands_off(&self, key: &FlowKey) -> bool {
        self.table
            .find(key.dst, key.proto, key.dst_port)
            .is_some_and(|s| self.table.service(s).hand_off)
    }

    /// The packet to encapsulate after a [`Verdict::Redirect`].
    pub fn take_redirect(&mut self) -> Option<RedirectOut> {
        self.redirect.as_mut()?.out.take()
    }

    /// Called by the general forward path for a TCP/UDP packet to a VIP, before the
    /// flow look-up. `Some` when the packet goes to another node (or is dropped on the
    /// way); `None` lets the normal path handle it: a flow held here, a SYN (a new
    /// connection is served here if it can be: a SYN finding a redirect record removes
    /// it; without a Ready backend the normal path hands it on, `Engine::no_backend`),
    /// UDP (no SYN to tell new from old: created here), or redirects off. `hand_off`:
    /// whether `key`'s frontend hands flows on.
    pub(super) fn redirect_hook(
        &mut self,
        frame_len: usize,
        (key, hand_off): (&FlowKey, bool),
        flags: u8,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        let udp = self.redirects_udp(key, hand_off);
        if !self.redirects_tcp(key) && !udp {
            return None;
        }
        let syn_only = !udp && tcp_flags::lone_syn(flags);
        match self.flows.lookup(key, now_ms) {
            Some((id, Direction::Forward)) if self.flows.get(id).state() == FlowState::Redirect => {
                if syn_only && self.redirect_ctx.is_none() {
                    // A new connection re-using the 5-tuple: served here from now on.
                    self.flows.remove(id);
                    return None;
                }
                let owner = self.flows.get(id).backend;
                let hops = match self.hops_to_owner(owner)? {
                    Ok(hops) => hops,
                    Err(dropped) => return Some(dropped),
                };
                self.flows.touch_redirect(id, (key.proto, flags), now_ms);
                let question = self.question_carried_on();
                Some(self.send_to(owner, hops, question, frame_len, key.flow_hash(), nb))
            }
            Some(_) => None,
            None if syn_only || udp => None,
            None => Some(self.redirect_unknown(true, frame_len, key, nb, now_ms)),
        }
    }

    /// Called for an ICMP error to a VIP about a packet of flow `key` (forward key; e.g.
    /// "fragmentation needed" for a reply the owner sent): `Some` when the flow is another
    /// node's — a redirect record is followed (uncharged), an unknown TCP flow is asked
    /// about like its packets (charged to the bucket, no notice: the error names no
    /// connection the owner could vouch for by serving it). `None`: handled here.
    pub(super) fn redirect_icmp_error(
        &mut self,
        frame_len: usize,
        key: &FlowKey,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        let udp = self.redirects_udp(key, self.hands_off(key));
        if !self.redirects_tcp(key) && !udp {
            return None;
        }
        match self.flows.lookup(key, now_ms) {
            Some((id, Direction::Forward)) if self.flows.get(id).state() == FlowState::Redirect => {
                let owner = self.flows.get(id).backend;
                let hops = match self.hops_to_owner(owner)? {
                    Ok(hops) => hops,
                    Err(dropped) => return Some(dropped),
                };
                Some(self.send_to(owner, hops, (false, 0), frame_len, key.flow_hash(), nb))
            }
            Some(_) => None,
            // A datagram's error about no flow here: handled here (dropped, `no_flow`).
            None if udp => None,
            None => Some(self.redirect_unknown(false, frame_len, key, nb, now_ms)),
        }
    }

    /// The nodes a packet following a redirect record to `owner` has visited, this one
    /// added: `Err` with the drop (`redirect_no_peer`) when it would visit the owner again
    /// or a node too many; `None` when redirects are off. One rule for every family and
    /// for ICMP errors.
    pub(super) fn hops_to_owner(&mut self, owner: u32) -> Option<Result<HopList, Verdict>> {
        let mut hops = self.redirect_ctx.map(|c| c.0).unwrap_or_default();
        let me = self.redirect.as_ref()?.node();
        if !hops.push(me) || hops.contains(owner) {
            return Some(Err(self.drop(DropReason::RedirectNoPeer, None)));
        }
        Some(Ok(hops))
    }

    /// The question a packet following a record carries on: the first node's `ASK` and
    /// cookie when it came with one, else none.
    pub(super) fn question_carried_on(&self) -> (bool, u64) {
        match self.redirect_ctx {
            Some((_, f, c)) if f & FLAG_ASK != 0 => (true, c),
            _ => (false, 0),
        }
    }

    /// A TCP segment that is not a SYN, of a flow this node neither holds nor has a
    /// redirect record for: ask the next peer (charged to the bucket). A client's segment
    /// is a packet of no flow to the new-flow admission first, as the steering program
    /// counts on (so that a flood of such segments is dropped there once its prefix's
    /// bucket is empty).
    pub(super) fn redirect_unknown<K: AskedFlow>(
        &mut self,
        segment: bool,
        frame_len: usize,
        key: &K,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        if segment && self.redirect_ctx.is_none() && !self.admitted(key.admission_key()) {
            return self.drop(DropReason::NewFlowPrefixRateLimited, None);
        }
        if self.redirect.is_none() {
            return self.drop(DropReason::NonSynWithoutFlow, None);
        }
        // Only a TCP segment asks for a notice (an ICMP error carries no connection the
        // owner vouches for by serving it).
        let how = Handing {
            ask: segment,
            charged: true,
            new_flow: false,
        };
        match self.ask_next_peer(how, frame_len, key, nb, now_ms) {
            Some(v) => v,
            // Nobody to ask at all: a segment without a flow.
            None if self.redirect_ctx.is_none() => self.drop(DropReason::NonSynWithoutFlow, None),
            None => self.drop(DropReason::RedirectNoPeer, None),
        }
    }

    /// Sends the packet to the next peer of its VIP not yet visited, as `how` says.
    /// `None` when no peer is left.
    pub(super) fn ask_next_peer<K: AskedFlow>(
        &mut self,
        Handing {
            ask,
            charged,
            new_flow,
        }: Handing,
        frame_len: usize,
        key: &K,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        let r = self.redirect.as_mut()?;
        // A question keeps the first node's cookie; the first node makes it.
        let (mut hops, ask, cookie) = match self.redirect_ctx {
            Some((h, f, c)) => (h, f & FLAG_ASK != 0, c),
            None if ask => (HopList::new(), true, key.cookie(r)),
            None => (HopList::new(), false, 0),
        };
        let me = r.node();
        let h = key.choice_hash(self);
        let r = self.redirect.as_mut()?;
        if !hops.push(me) {
            return None;
        }
        let peer = if new_flow {
            next_hop_weighted(key.peers(r), me, &hops, h)?
        } else {
            next_hop(key.peers(r).0, me, &hops, h)?
        };
        if charged {
            if let Err(empty) = key.take_token(r, now_ms) {
                return Some(self.drop(empty, None));
            }
        }
        Some(self.send_to(peer, hops, (ask, cookie), frame_len, key.flow_hash(), nb))
    }

    /// What picks the peer a packet of `key` is sent to first: the 5-tuple, or the
    /// client's address alone for a Service with ClientIP affinity — every connection of
    /// a client a node hands on then goes to the same peer, whose affinity keeps it on
    /// one Pod (with an L3-hashing router, one client, one Pod, across the hand-off).
    fn peer_choice_key(&self, key: &FlowKey) -> FlowKey {
        let affinity = self
            .table
            .find(key.dst, key.proto, key.dst_port)
            .is_some_and(|s| self.table.service(s).client_ip_affinity_ms.is_some());
        if !affinity {
            return *key;
        }
        FlowKey {
            src: key.src,
            dst: 0,
            src_port: 0,
            dst_port: 0,
            proto: 0,
        }
    }

    /// `question`: whether the first node wants a notice, and its cookie; `h`: the
    /// flow's hash ([`AskedFlow::flow_hash`]).
    pub(super) fn send_to(
        &mut self,
        peer: u32,
        hops: HopList,
        question: (bool, u64),
        frame_len: usize,
        h: u64,
        nb: &Neighbours,
    ) -> Verdict {
        let m = match self.macs_towards(peer, nb) {
            Ok(m) => m,
            Err(reason) => return self.drop(reason, None),
        };
        let Some(r) = self.redirect.as_mut() else {
            return self.drop(DropReason::RedirectNoPeer, None);
        };
        if let Some(c) = r.peer_mut(peer) {
            c.redirected_to += 1;
        }
        r.out = Some(RedirectOut {
            peer,
            macs: m,
            hops,
            ask: question.0,
            frame_len,
            entropy: (h ^ (h >> 16)) as u16,
            cookie: if question.0 { question.1 } else { 0 },
        });
        Verdict::Redirect
    }

    /// A frame from the uplink not addressed to a VIP: if it is a redirect frame to this
    /// node's redirect port, handle it (`Some`), else `None` (the caller passes it on).
    pub(super) fn redirect_in(
        &mut self,
        frame: &mut [u8],
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        let r = self.redirect.as_ref()?;
        if !r.active()
            || self.redirect_ctx.is_some()
            || !wire::is_redirect(frame, r.node(), r.port())
        {
            return None;
        }
        let from = wire::outer_source(frame);
        if !r.is_peer(from) {
            return Some(self.drop(DropReason::RedirectNotFromPeer, None));
        }
        let Ok(rx) = wire::parse(frame) else {
            return Some(self.drop(DropReason::RedirectMalformed, None));
        };
        // Once a key is in force, only a frame tagged under one of the keys:
        // checked before anything else is done with it. Without a key, version 2 and 3
        // are both taken unchecked (the rollout: version 3 everywhere, then the key).
        if let Some(r) = self.redirect.as_ref() {
            if !r.keys().is_empty() && !wire::verify(frame, &rx, r.keys()) {
                return Some(self.drop(DropReason::RedirectBadMac, None));
            }
        }
        if rx.kind == KIND_NOTICE {
            return Some(self.notice_in(frame, &rx, from, now_ms));
        }
        if rx.kind == KIND_NOTICE6 {
            return Some(self.notice_in6(frame, &rx, from, now_ms));
        }
        if rx.kind == KIND_PROBE || rx.kind == KIND_ANSWER {
            return Some(self.liveness_in(rx.kind, rx.cookie, from, nb));
        }
        if let Some(c) = self.redirect.as_mut().and_then(|r| r.peer_mut(from)) {
            c.received_from += 1;
        }
        let ipv6 = wire::inner_is_ipv6(frame, &rx);
        let len = wire::decapsulate(frame, &rx);
        if ipv6 {
            return Some(self.redirect_in6(frame, len, &rx, nb, now_ms));
        }
        let inner = &mut frame[..len];
        let v = match packet::parse(inner) {
            Ok(Parsed::Ipv4(v)) => v,
            _ => return Some(self.drop(DropReason::RedirectMalformed, None)),
        };
        let icmp_error = v.l4.is_none() && packet::parse_icmp_error(inner, &v).is_some();
        if (v.l4.is_none() && !icmp_error) || !self.table.is_vip(v.dst) {
            return Some(self.drop(DropReason::RedirectNotServed, None));
        }
        let key = v.l4.map(|l4| FlowKey {
            src: v.src,
            dst: v.dst,
            src_port: l4.src_port,
            dst_port: l4.dst_port,
            proto: v.protocol,
        });
        self.redirect_ctx = Some((rx.hops, rx.flags, rx.cookie));
        let verdict = self.forward(inner, v, nb, now_ms);
        self.redirect_ctx = None;
        Some(match verdict {
            Verdict::Tx(side) => {
                // Served here: this node owns the flow; tell the node that asked — if
                // it is a peer of the VIP (the hop list is the sender's word: never
                // send a notice where a stranger's hop list points).
                if rx.flags & FLAG_ASK != 0 {
                    if let (Some(origin), Some(key)) = (rx.hops.origin(), key) {
                        if self
                            .redirect
                            .as_ref()
                            .is_some_and(|r| r.is_peer_of(key.dst, origin))
                        {
                            self.queue_notice(origin, NoticeKey::V4(key), rx.cookie, nb);
                        }
                    }
                }
                Verdict::TxResized(side, len as u16)
            }
            Verdict::Pass(_) => self.drop(DropReason::RedirectNotServed, None),
            other => other,
        })
    }

    /// A peer's liveness probe (answered, its nonce echoed, through the uplink) or its
    /// answer to one of this node's probes (handed to the node thread).
    fn liveness_in(&mut self, kind: u8, nonce: u64, from: u32, nb: &Neighbours) -> Verdict {
        if kind == KIND_ANSWER {
            if let Some(r) = self.redirect.as_mut() {
                r.answer_received(from, nonce);
            }
            return Verdict::Consumed;
        }
        // Not before this worker took a table: its answer would go out without the key
        // the table brings, and the prober would count it as `redirect_bad_mac`.
        if self.table.generation32() == 0 {
            return self.drop(DropReason::NoServiceTable, None);
        }
        let macs = match self.macs_towards(from, nb) {
            Ok(m) => m,
            Err(reason) => return self.drop(reason, None),
        };
        if let Some(r) = self.redirect.as_mut() {
            r.queue_answer(crate::redirect::Answer {
                to: from,
                macs,
                nonce,
            });
        }
        Verdict::Consumed
    }

    /// The MACs towards another node, out of the uplink: `NoNeighbour` (its resolution
    /// queued) or `NoRoute` else.
    fn macs_towards(&mut self, to: u32, nb: &Neighbours) -> Result<[u8; 12], DropReason> {
        match nb.resolve(to) {
            Resolve::Found {
                side: Side::Uplink,
                src,
                dst,
            } => Ok(macs(src, dst)),
            Resolve::Miss { ip, ifindex } => {
                self.missing.push(ip, ifindex);
                Err(DropReason::NoNeighbour)
            }
            Resolve::Found { .. } | Resolve::NoRoute => Err(DropReason::NoRoute),
        }
    }

    pub(super) fn queue_notice(&mut self, to: u32, key: NoticeKey, cookie: u64, nb: &Neighbours) {
        let Ok(m) = self.macs_towards(to, nb) else {
            return;
        };
        if let Some(r) = self.redirect.as_mut() {
            r.queue_notice(Notice {
                to,
                macs: m,
                key,
                cookie,
            });
        }
    }

    /// "`from` owns this flow": make (or point) the redirect record, unless this node
    /// holds the flow itself.
    fn notice_in(&mut self, frame: &[u8], rx: &wire::Received, from: u32, now_ms: u64) -> Verdict {
        let key = wire::notice_key(frame, rx);
        if let Some(c) = self.redirect.as_mut().and_then(|r| r.peer_mut(from)) {
            c.notices_received += 1;
        }
        let handed_off = self.hands_off(&key);
        let udp_handed_off = key.proto == packet::IPPROTO_UDP && handed_off;
        if (key.proto != packet::IPPROTO_TCP && !udp_handed_off) || !self.table.is_vip(key.dst) {
            return self.drop(DropReason::RedirectNotServed, None);
        }
        let Some(r) = self.redirect.as_mut() else {
            return self.drop(DropReason::RedirectNoticeRefused, None);
        };
        // Only a node asked about the VIP's flows may claim one (the outer source was
        // checked against every peer; a peer of another VIP is not enough).
        if !r.is_peer_of(key.dst, from) {
            return self.drop(DropReason::RedirectNoticeRefused, None);
        }
        // Only the answer to a question this node asked (its cookie for the flow).
        if rx.cookie != r.cookie_for(&key) {
            return self.drop(DropReason::RedirectNoticeRefused, None);
        }
        // Charged like a question about the client (its /24's bucket, then the node's;
        // the notice buckets) — unless the question was not charged either: a
        // Cluster-policy connection this node handed on.
        if !handed_off {
            if let Err(empty) = r.take_notice_token(key.src, now_ms) {
                return self.drop(empty, None);
            }
        }
        match self.flows.lookup(&key, now_ms) {
            Some((id, Direction::Forward)) if self.flows.get(id).state() == FlowState::Redirect => {
                if let Some(f) = self.flows.get_mut(id) {
                    f.backend = from; // (another worker's record keeps its owner's view)
                }
                self.flows.touch_redirect(id, (key.proto, 0), now_ms);
            }
            Some(_) => {} // held here (or a conflicting reverse key): keep it
            None => match self.flows.insert_redirect(&key, from, now_ms) {
                Ok(_) => {}
                Err(crate::flow::InsertError::Full) => {
                    return self.drop(DropReason::FlowTableFull, None)
                }
                Err(crate::flow::InsertError::SourceOverQuota) => {
                    return self.drop(DropReason::SourceOverQuota, None)
                }
            },
        }
        Verdict::Consumed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, Verdict};
    use crate::flow::Timeouts;
    use crate::neigh::{Iface, Route};
    use crate::packet::MacAddr;
    use crate::redirect::{RedirectConfig, DEFAULT_PORT};
    use crate::services::ServiceTable;
    use juneau_control::model::{
        Frontend, LocalBackend, NodeService, NodeState, Protocol, Redirects, VipRedirectPeers,
    };

    const VIP: u32 = 0x0ac8_000a;
    const CLIENT: u32 = 0x0a64_0102;
    const NODES: [u32; 3] = [0x0a01_0001, 0x0a01_0002, 0x0a01_0003];
    const POD: [u32; 3] = [0x0a0a_0101, 0x0a0a_0201, 0x0a0a_0301];

    fn nb() -> Neighbours {
        let mut nb = Neighbours::new(
            Iface {
                ifindex: 2,
                mac: MacAddr([2, 0, 0, 0, 0, 1]),
            },
            vec![Iface {
                ifindex: 10,
                mac: MacAddr([2, 0, 0, 0, 0, 2]),
            }],
        );
        nb.add_route(Route {
            prefix: 0x0a01_0000,
            len: 16,
            gateway: None,
            ifindex: 2,
        });
        nb.add_route(Route {
            prefix: 0x0a0a_0000,
            len: 16,
            gateway: None,
            ifindex: 10,
        });
        nb.add_route(Route {
            prefix: 0,
            len: 0,
            gateway: Some(0x0a01_00fe),
            ifindex: 2,
        });
        for (i, n) in NODES.iter().enumerate() {
            nb.add_neighbour(*n, 2, MacAddr([4, 0, 0, 0, 0, i as u8]));
        }
        nb.add_neighbour(0x0a01_00fe, 2, MacAddr([4, 0, 0, 0, 0, 0xfe]));
        for p in POD {
            nb.add_neighbour(p, 10, MacAddr([6, 0, 0, 0, 0, p as u8]));
        }
        nb
    }

    /// Node `i` with its own Pod as the VIP's only backend (`has_backend`), or none.
    fn node(i: usize, has_backend: bool, rate: u32) -> Engine {
        node_with(i, has_backend, rate, false)
    }

    /// As [`node`]; `from_state`: no static peers, no `--node-address`: both come from
    /// the published state (the agent's per-VIP peers and this node's address).
    fn node_with(i: usize, has_backend: bool, rate: u32, from_state: bool) -> Engine {
        node_policy(i, has_backend, rate, from_state, false)
    }

    /// As [`node_with`], the Service's policy Cluster when `cluster_policy`.
    fn node_policy(
        i: usize,
        has_backend: bool,
        rate: u32,
        from_state: bool,
        cluster_policy: bool,
    ) -> Engine {
        node_full(i, has_backend, rate, (from_state, cluster_policy, None))
    }

    /// As [`node_policy`], with ClientIP affinity (`affinity`: its timeout, s).
    fn node_full(
        i: usize,
        has_backend: bool,
        rate: u32,
        (from_state, cluster_policy, affinity): (bool, bool, Option<u32>),
    ) -> Engine {
        let mut e = Engine::new(EngineConfig {
            flow_capacity: 1024,
            timeouts: Timeouts::default(),
            ..EngineConfig::default()
        });
        // The same Service's TCP/80 and UDP/53 (`udp`).
        let service = |protocol, port| NodeService {
            frontend: Frontend {
                vip: VIP.into(),
                protocol,
                port,
            },
            backends: if has_backend {
                vec![LocalBackend {
                    ip: POD[i].into(),
                    port: 8080,
                }]
            } else {
                vec![]
            },
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: affinity,
            hand_off: cluster_policy,
            host_network: false,
        };
        let state = NodeState {
            services: vec![service(Protocol::Tcp, 80), service(Protocol::Udp, 53)],
            redirects: if from_state {
                redirects_for(i)
            } else {
                Redirects::default()
            },
            ..NodeState::default()
        };
        let maglev: Vec<Vec<u16>> = state
            .services
            .iter()
            .map(|s| {
                juneau_control::maglev::MaglevTable::new(&s.backends, 251)
                    .unwrap()
                    .slots()
                    .to_vec()
            })
            .collect();
        e.set_redirect(Redirector::new(RedirectConfig {
            node: if from_state { 0 } else { NODES[i] },
            port: DEFAULT_PORT,
            peers: if from_state { vec![] } else { NODES.to_vec() },
            rate_per_s: rate,
            burst: rate,
            prefix_rate_per_s: rate,
            prefix_burst: rate,
            node_from_state: from_state,
        }));
        e.set_services(ServiceTable::new(1, &state, &maglev));
        e
    }

    /// What the agent publishes for node `i`: its address, the VIP's other nodes.
    fn redirects_for(i: usize) -> Redirects {
        Redirects {
            node_address: Some(NODES[i].into()),
            vips: vec![VipRedirectPeers {
                vip: VIP.into(),
                nodes: NODES
                    .iter()
                    .filter(|n| **n != NODES[i])
                    .map(|n| (*n).into())
                    .collect(),
            }],
            vips6: Vec::new(),
            keys: Vec::new(),
        }
    }

    fn tcp(cport: u16, flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20 + 10];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&50u16.to_be_bytes());
        f[20] = 0x40;
        f[22] = 64;
        f[23] = packet::IPPROTO_TCP;
        f[26..30].copy_from_slice(&CLIENT.to_be_bytes());
        f[30..34].copy_from_slice(&VIP.to_be_bytes());
        f[34..36].copy_from_slice(&cport.to_be_bytes());
        f[36..38].copy_from_slice(&80u16.to_be_bytes());
        f[46] = 0x50;
        f[47] = flags;
        let c = packet::ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn udp(cport: u16) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 8 + 16];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&44u16.to_be_bytes());
        f[22] = 64;
        f[23] = packet::IPPROTO_UDP;
        f[26..30].copy_from_slice(&CLIENT.to_be_bytes());
        f[30..34].copy_from_slice(&VIP.to_be_bytes());
        f[34..36].copy_from_slice(&cport.to_be_bytes());
        f[36..38].copy_from_slice(&53u16.to_be_bytes());
        f[38..40].copy_from_slice(&24u16.to_be_bytes());
        let c = packet::ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    }

    /// What the I/O loop does with a verdict, between engines standing for nodes:
    /// returns (the node that sent it to a Pod, frames sent between nodes).
    fn run(
        nodes: &mut [Engine],
        at: usize,
        mut frame: Vec<u8>,
        now: u64,
    ) -> (Option<usize>, usize) {
        let nb = nb();
        let mut cur = at;
        let mut between = 0;
        let original_len = frame.len();
        loop {
            let v = nodes[cur].process(&mut frame, Side::Uplink, &nb, now);
            // Notices go out after the batch.
            let notices: Vec<Notice> = nodes[cur]
                .redirect_mut()
                .map(|r| r.take_notices().collect())
                .unwrap_or_default();
            let key = nodes[cur].redirect().and_then(|r| r.send_key()).cloned();
            for n in notices {
                let mut buf = vec![0u8; 256];
                let len = wire::build_notice(
                    &mut buf,
                    &n.macs,
                    NODES[cur],
                    n.to,
                    DEFAULT_PORT,
                    n.key,
                    n.cookie,
                    key.as_ref(),
                )
                .unwrap();
                buf.truncate(len);
                let to = NODES.iter().position(|x| *x == n.to).unwrap();
                let nv = nodes[to].process(&mut buf, Side::Uplink, &nb, now);
                assert_eq!(nv, Verdict::Consumed);
            }
            match v {
                Verdict::Tx(Side::Pod(_)) => return (Some(cur), between),
                Verdict::TxResized(Side::Pod(_), n) => {
                    assert_eq!(
                        &frame[30..34],
                        &POD[cur].to_be_bytes(),
                        "DNAT to the owner's Pod"
                    );
                    assert_eq!(usize::from(n), original_len);
                    return (Some(cur), between);
                }
                Verdict::Redirect => {
                    let out = nodes[cur].take_redirect().unwrap();
                    let mut buf = frame.clone();
                    buf.resize(4096, 0);
                    let key = nodes[cur].redirect().and_then(|r| r.send_key());
                    let len =
                        wire::encapsulate(&mut buf, &out, NODES[cur], DEFAULT_PORT, 1600, key)
                            .unwrap();
                    buf.truncate(len);
                    frame = buf;
                    between += 1;
                    cur = NODES.iter().position(|x| *x == out.peer).unwrap();
                }
                _ => return (None, between),
            }
        }
    }

    #[test]
    fn established_flow_moved_to_a_new_node_is_served_by_its_owner() {
        let mut nodes = vec![node(0, true, 100), node(1, true, 100), node(2, true, 100)];
        // The connection opens through node 0.
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::ACK), 1).0, Some(0));
        // The router now sends it to node 2: redirected (at most via node 1) to node 0.
        let (served, hops) = run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 2);
        assert_eq!(served, Some(0));
        assert!((1..=2).contains(&hops), "{hops}");
        // Node 0 told node 2: the next packets go straight there, uncharged.
        let rec = nodes[2].flows().len();
        assert_eq!(rec, 1, "a redirect record");
        for t in 0..500 {
            let (served, hops) = run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 3 + t);
            assert_eq!((served, hops), (Some(0), 1));
        }
        let c: Vec<_> = nodes[2].redirect().unwrap().peer_counters().collect();
        assert!(c
            .iter()
            .any(|(a, c)| *a == NODES[0] && c.redirected_to >= 500 && c.notices_received == 1));
        assert_eq!(
            nodes[2]
                .counters()
                .drops_for(DropReason::RedirectRateLimited),
            0
        );
        // A new connection on node 2 is served on node 2 (it has a Ready backend).
        assert_eq!(
            run(&mut nodes, 2, tcp(40001, tcp_flags::SYN), 10_000).0,
            Some(2)
        );
        // The redirect record expires with the flow's idle timeout.
        let late = 10_000 + u64::from(Timeouts::default().tcp_established_ms) + 1;
        let (served, _) = run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), late);
        assert_eq!(
            served, None,
            "the owner's flow expired too: dropped, not reset"
        );
    }

    #[test]
    fn a_node_without_local_backends_redirects_to_the_owner() {
        // Node 2 has no local backend (it announces nothing, or withdrew): the router
        // sends it a packet of node 0's flow anyway.
        let mut nodes = vec![node(0, true, 100), node(1, true, 100), node(2, false, 100)];
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::ACK), 0).0, Some(0));
        let (served, _) = run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 1);
        assert_eq!(served, Some(0));
    }

    #[test]
    fn a_syn_reaching_a_node_without_a_ready_backend_is_served_by_a_peer_that_has_one() {
        // Node 2 just lost its last Ready backend and asked to withdraw; the router has
        // not applied it yet. Node 1 has no Ready backend either: the SYN goes on to 0.
        let mut nodes = vec![node(0, true, 100), node(1, false, 100), node(2, false, 100)];
        let mut served_by_0 = 0;
        for p in 0..64u16 {
            let (served, hops) = run(&mut nodes, 2, tcp(41000 + p, tcp_flags::SYN), 0);
            assert_eq!(served, Some(0), "port {p}");
            assert!((1..=2).contains(&hops), "{hops}");
            // The owner told node 2: the handshake's ACK and the rest follow, no asking.
            let (served, hops) = run(&mut nodes, 2, tcp(41000 + p, tcp_flags::ACK), 1);
            assert_eq!((served, hops), (Some(0), 1), "port {p}");
            served_by_0 += 1;
        }
        assert_eq!(served_by_0, 64);
        for n in &nodes {
            assert_eq!(n.counters().drops_for(DropReason::NoBackend), 0);
        }
        // A retransmitted SYN of a connection already handed off reaches the same owner.
        assert_eq!(run(&mut nodes, 2, tcp(41000, tcp_flags::SYN), 2).0, Some(0));
        // Without any peer that has a Ready backend the SYN is dropped as no_backend on
        // the first node (bounded: each node visited at most once).
        let mut none = vec![
            node(0, false, 100),
            node(1, false, 100),
            node(2, false, 100),
        ];
        let (served, hops) = run(&mut none, 2, tcp(42000, tcp_flags::SYN), 0);
        assert_eq!(served, None);
        assert!(hops <= 2, "{hops}");
        let drops: u64 = none
            .iter()
            .map(|n| {
                n.counters().drops_for(DropReason::NoBackend)
                    + n.counters().drops_for(DropReason::RedirectNoPeer)
            })
            .sum();
        assert_eq!(drops, 1);
    }

    #[test]
    fn under_the_cluster_policy_every_new_connection_is_handed_to_a_node_with_a_backend() {
        // Nodes 1 and 2 have no backend of a Cluster-policy Service: every connection a
        // client opens through them reaches node 0's Pod, whatever the redirect bucket
        // (one a second here) says, and its later packets follow without asking.
        let cluster = |i, has_backend| node_policy(i, has_backend, 1, false, true);
        let mut nodes = vec![cluster(0, true), cluster(1, false), cluster(2, false)];
        for p in 0..200u16 {
            let first = 1 + usize::from(p % 2);
            let (served, hops) = run(&mut nodes, first, tcp(43000 + p, tcp_flags::SYN), 0);
            assert_eq!(served, Some(0), "port {p}");
            assert!((1..=2).contains(&hops), "{hops}");
            let (served, hops) = run(&mut nodes, first, tcp(43000 + p, tcp_flags::ACK), 1);
            assert_eq!((served, hops), (Some(0), 1), "port {p}");
        }
        for n in &nodes {
            for r in [
                DropReason::RedirectRateLimited,
                DropReason::RedirectPrefixRateLimited,
                DropReason::NoBackend,
            ] {
                assert_eq!(n.counters().drops_for(r), 0, "{r:?}");
            }
        }
        // Local: the same client's connections through a node without a backend are
        // a transient, bounded by its bucket.
        let mut local = vec![node(0, true, 1), node(1, false, 1), node(2, false, 1)];
        let served = (0..200u16)
            .filter(|p| run(&mut local, 2, tcp(44000 + p, tcp_flags::SYN), 0).0 == Some(0))
            .count();
        assert!(served < 10, "{served}");
    }

    /// Liveness probes between nodes: a peer's probe is answered (to the prober, its
    /// nonce echoed), a stranger's refused; an answer is kept for the node thread.
    #[test]
    fn a_probe_from_a_peer_is_answered_and_an_answer_is_kept_for_the_node_thread() {
        let nb = nb();
        let mut e = node(1, true, 100);
        let frame = |from: u32, kind: u8, nonce: u64| {
            let mut buf = vec![0u8; 256];
            let len = wire::build_liveness(
                &mut buf,
                &[0; 12],
                from,
                NODES[1],
                DEFAULT_PORT,
                kind,
                nonce,
                None,
            )
            .unwrap();
            buf.truncate(len);
            buf
        };
        let v = e.process(&mut frame(NODES[0], KIND_PROBE, 7), Side::Uplink, &nb, 0);
        assert_eq!(v, Verdict::Consumed);
        let r = e.redirect_mut().unwrap();
        let answers: Vec<_> = r.take_answers().collect();
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].to, answers[0].nonce), (NODES[0], 7));
        assert_eq!(answers[0].macs[..6], [4, 0, 0, 0, 0, 0], "towards node 0");
        let stranger = 0x0a01_0009;
        let v = e.process(&mut frame(stranger, KIND_PROBE, 8), Side::Uplink, &nb, 0);
        assert!(matches!(v, Verdict::Drop(_)), "{v:?}");
        assert_eq!(e.counters().drops_for(DropReason::RedirectNotFromPeer), 1);
        let v = e.process(&mut frame(NODES[2], KIND_ANSWER, 9), Side::Uplink, &nb, 0);
        assert_eq!(v, Verdict::Consumed);
        let r = e.redirect_mut().unwrap();
        assert_eq!(r.take_answered().collect::<Vec<_>>(), vec![(NODES[2], 9)]);
        assert!(
            r.take_answers().next().is_none(),
            "an answer is not answered"
        );
        let c: std::collections::HashMap<_, _> = r.peer_counters().collect();
        assert_eq!(c[&NODES[0]].probes_received, 1);
        assert_eq!(c[&NODES[2]].probe_answers_received, 1);
        // Before its first table a worker does not answer: the key comes with the table.
        let mut fresh = Engine::new(EngineConfig {
            flow_capacity: 64,
            ..EngineConfig::default()
        });
        fresh.set_redirect(Redirector::new(RedirectConfig {
            node: NODES[1],
            port: DEFAULT_PORT,
            peers: NODES.to_vec(),
            rate_per_s: 1,
            burst: 1,
            prefix_rate_per_s: 1,
            prefix_burst: 1,
            node_from_state: false,
        }));
        let v = fresh.process(&mut frame(NODES[0], KIND_PROBE, 10), Side::Uplink, &nb, 0);
        assert!(matches!(v, Verdict::Drop(_)), "{v:?}");
        assert_eq!(fresh.counters().drops_for(DropReason::NoServiceTable), 1);
        let r = fresh.redirect_mut().unwrap();
        assert!(r.take_answers().next().is_none());
    }

    /// Under the Cluster policy a node hands new connections only to peers that answer
    /// its probes: node 2 stopped answering node 1, so node 1 hands every connection to
    /// node 0 until node 2 answers again; with both silent it has no better choice and
    /// hands them to both.
    #[test]
    fn new_connections_are_handed_only_to_peers_that_answer_probes() {
        let cluster = |i, has_backend| node_policy(i, has_backend, 1, false, true);
        let mut nodes = vec![cluster(0, true), cluster(1, false), cluster(2, true)];
        let served_by = |nodes: &mut [Engine], base: u16| {
            (0..100u16)
                .map(|p| run(nodes, 1, tcp(base + p, tcp_flags::SYN), 0))
                .map(|(served, hops)| {
                    assert_eq!(hops, 1);
                    served.unwrap()
                })
                .collect::<std::collections::HashSet<_>>()
        };
        nodes[1]
            .redirect_mut()
            .unwrap()
            .set_unreachable(&[NODES[2]]);
        assert_eq!(served_by(&mut nodes, 45000), [0].into());
        nodes[1]
            .redirect_mut()
            .unwrap()
            .set_unreachable(&[NODES[2], NODES[0]]);
        assert_eq!(served_by(&mut nodes, 46000), [0, 2].into());
        nodes[1].redirect_mut().unwrap().set_unreachable(&[]);
        assert_eq!(served_by(&mut nodes, 47000), [0, 2].into());
    }

    /// Under the Cluster policy a node without a backend hands new connections to the
    /// nodes with one in proportion to their Ready endpoints as the agent published them
    /// (node 0 listed with four, node 2 with one): each endpoint cluster-wide an equal
    /// share (4/5 to node 0; counting entries would give 5/7, nodes 1/2), each
    /// connection in one hop.
    #[test]
    fn handed_connections_follow_the_published_ready_endpoints() {
        let cluster = |i, has_backend| node_full(i, has_backend, 1, (true, true, None));
        let mut nodes = vec![cluster(0, true), cluster(1, false), cluster(2, true)];
        let (n0, n2) = (NODES[0].into(), NODES[2].into());
        nodes[1].redirect_mut().unwrap().set_from_state(&Redirects {
            node_address: Some(NODES[1].into()),
            vips: vec![VipRedirectPeers {
                vip: VIP.into(),
                nodes: vec![n0, n0, n0, n0, n0, n2, n2],
            }],
            vips6: Vec::new(),
            keys: Vec::new(),
        });
        let mut served = [0usize; 3];
        for p in 0..900u16 {
            let (at, hops) = run(&mut nodes, 1, tcp(30000 + p, tcp_flags::SYN), 0);
            assert_eq!(hops, 1, "port {p}");
            served[at.unwrap()] += 1;
        }
        let share = served[0] as f64 / 900.0;
        assert!((share - 0.8).abs() < 0.04, "{served:?}");
    }

    /// UDP under the Cluster policy: a node without a backend hands a new flow's first
    /// datagram to a node with one (uncharged); the owner serves it and tells the first
    /// node, whose record sends the flow's later datagrams straight to the owner. Under
    /// the Local policy the datagram is dropped as `no_backend`.
    #[test]
    fn under_the_cluster_policy_udp_flows_are_handed_on_and_followed() {
        let cluster = |i, has_backend| node_policy(i, has_backend, 1, false, true);
        let mut nodes = vec![cluster(0, true), cluster(1, false), cluster(2, false)];
        for p in 0..100u16 {
            let first = 1 + usize::from(p % 2);
            let (served, hops) = run(&mut nodes, first, udp(46000 + p), 0);
            assert_eq!(served, Some(0), "port {p}");
            assert!((1..=2).contains(&hops), "{hops}");
            for t in 1..3 {
                let (served, hops) = run(&mut nodes, first, udp(46000 + p), t);
                assert_eq!(
                    (served, hops),
                    (Some(0), 1),
                    "port {p}: the record's one hop"
                );
            }
        }
        for n in &nodes {
            for r in [
                DropReason::RedirectRateLimited,
                DropReason::RedirectPrefixRateLimited,
                DropReason::NoBackend,
                DropReason::RedirectNoticeRefused,
            ] {
                assert_eq!(n.counters().drops_for(r), 0, "{r:?}");
            }
        }
        // Node 0 holds every flow once (served, not opened again per datagram).
        assert_eq!(nodes[0].flows().len(), 100);
        // The records expire with UDP's timeout, not TCP's.
        let after = u64::from(Timeouts::default().udp_ms) + 10;
        let (served, hops) = run(&mut nodes, 1, udp(46000), after);
        assert_eq!(served, Some(0));
        assert!(hops >= 1);
        let mut local = vec![node(0, true, 100), node(1, false, 100), node(2, false, 100)];
        assert_eq!(run(&mut local, 1, udp(47000), 0), (None, 0));
        assert_eq!(local[1].counters().drops_for(DropReason::NoBackend), 1);
    }

    #[test]
    fn with_client_ip_affinity_a_node_hands_every_connection_of_a_client_to_one_peer() {
        // Node 1 has no backend; nodes 0 and 2 have one. Per connection, node 1 hands
        // connections to both; with affinity, one client's all go to the same one.
        let served_by = |affinity: Option<u32>| {
            let n = |i, b| node_full(i, b, 1, (false, true, affinity));
            let mut nodes = vec![n(0, true), n(1, false), n(2, true)];
            (0..64u16)
                .filter_map(|p| run(&mut nodes, 1, tcp(45000 + p, tcp_flags::SYN), 0).0)
                .collect::<std::collections::BTreeSet<usize>>()
        };
        assert_eq!(served_by(None).len(), 2, "per connection: both peers");
        assert_eq!(served_by(Some(10_800)).len(), 1, "one client, one peer");
    }

    #[test]
    fn ack_flood_is_bounded_by_the_bucket_and_never_loops() {
        let mut nodes = vec![node(0, true, 50), node(1, true, 50), node(2, true, 50)];
        let mut between = 0;
        for i in 0..5000u16 {
            let (served, b) = run(&mut nodes, 1, tcp(i, tcp_flags::ACK), u64::from(i) / 10);
            assert_eq!(served, None);
            assert!(b <= 2, "at most every other node once");
            between += b;
        }
        // 500 ms of virtual time at 50/s, burst 50: node 1 sent at most 75, and each
        // could be passed on once more (node 0 or 2's own buckets).
        let sent1: u64 = nodes[1]
            .redirect()
            .unwrap()
            .peer_counters()
            .map(|(_, c)| c.redirected_to)
            .sum();
        assert!(sent1 <= 76, "{sent1}");
        assert!(between <= 2 * 76, "{between}");
        let limited = nodes[1]
            .counters()
            .drops_for(DropReason::RedirectRateLimited)
            + nodes[1]
                .counters()
                .drops_for(DropReason::RedirectPrefixRateLimited);
        assert!(limited >= 4900, "{limited}");
        assert_eq!(
            nodes[1].flows().len(),
            0,
            "no flow, no record from unknown packets"
        );
    }

    /// A client's TCP segment of no flow is a packet of no flow to the new-flow admission
    /// before it is asked about (the steering program drops the prefix's next ones once
    /// the bucket is empty); a segment a peer asks about is not charged again there.
    #[test]
    fn a_clients_segment_of_no_flow_is_charged_to_the_new_flow_admission_first() {
        use crate::admission::{Admission, Limit};
        let mut nodes = vec![node(0, true, 50), node(1, true, 50), node(2, true, 50)];
        // One set of buckets for the three: a peer that charged a question would find
        // the bucket node 1 emptied.
        let buckets = std::sync::Arc::new(Admission::on_heap(1, Limit { rate: 1, burst: 3 }));
        for n in nodes.iter_mut() {
            n.set_admission(buckets.clone());
        }
        let mut between = 0;
        for i in 0..10u16 {
            let (served, b) = run(&mut nodes, 1, tcp(i, tcp_flags::ACK), 0);
            assert_eq!(served, None);
            between += b;
        }
        let limited = |e: &Engine| e.counters().drops_for(DropReason::NewFlowPrefixRateLimited);
        assert_eq!(limited(&nodes[1]), 7, "beyond the burst of 3");
        assert_eq!(limited(&nodes[0]) + limited(&nodes[2]), 0);
        assert!(
            (3..=6).contains(&between),
            "the 3 admitted were asked: {between}"
        );
    }

    #[test]
    fn notices_and_redirects_from_strangers_are_refused() {
        let nb = nb();
        let mut e = node(0, true, 100);
        let key = FlowKey {
            src: CLIENT,
            dst: VIP,
            src_port: 1,
            dst_port: 80,
            proto: packet::IPPROTO_TCP,
        };
        let mut buf = vec![0u8; 128];
        let n = wire::build_notice(
            &mut buf,
            &[0; 12],
            0x0a01_0063,
            NODES[0],
            DEFAULT_PORT,
            &key,
            1,
            None,
        )
        .unwrap();
        buf.truncate(n);
        assert_eq!(
            e.process(&mut buf, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::RedirectNotFromPeer)
        );
        assert_eq!(e.flows().len(), 0);
        // A malformed one from a peer.
        let mut buf = vec![0u8; 128];
        let n = wire::build_notice(
            &mut buf,
            &[0; 12],
            NODES[1],
            NODES[0],
            DEFAULT_PORT,
            &key,
            1,
            None,
        )
        .unwrap();
        buf.truncate(n);
        buf[14 + 28] = b'X';
        assert_eq!(
            e.process(&mut buf, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::RedirectMalformed)
        );
        // Other UDP to the node is not ours.
        let mut other = tcp(1, 0);
        other[23] = packet::IPPROTO_UDP;
        other[30..34].copy_from_slice(&NODES[0].to_be_bytes());
        let v = e.process(&mut other, Side::Uplink, &nb, 0);
        assert!(
            !matches!(
                v,
                Verdict::Consumed
                    | Verdict::Drop(
                        DropReason::RedirectMalformed | DropReason::RedirectNotFromPeer
                    )
            ),
            "{v:?}"
        );
    }

    /// A notice from `from` to node `to` (engine `e`) that `from` owns `key`, with the
    /// cookie of `e`'s question about it.
    fn notice(e: &Engine, from: u32, to: u32, key: &FlowKey) -> Vec<u8> {
        let cookie = e.redirect().unwrap().cookie_for(key);
        notice_with_cookie(from, to, key, cookie)
    }

    fn notice_with_cookie(from: u32, to: u32, key: &FlowKey, cookie: u64) -> Vec<u8> {
        let mut buf = vec![0u8; 128];
        let n = wire::build_notice(
            &mut buf,
            &[0; 12],
            from,
            to,
            DEFAULT_PORT,
            key,
            cookie,
            None,
        )
        .unwrap();
        buf.truncate(n);
        buf
    }

    #[test]
    fn a_notice_is_accepted_only_as_the_answer_to_a_question_of_this_node() {
        let nb = nb();
        let mut e = node2_with_split_peers();
        let key = key_of(CLIENT, 40000);
        let other = key_of(CLIENT, 40001);
        let mine = e.redirect().unwrap().cookie_for(&key);
        // No cookie, another flow's cookie, another node's cookie for this flow: refused.
        let theirs = node(1, true, 100).redirect().unwrap().cookie_for(&key);
        assert_ne!(theirs, mine);
        for cookie in [
            0,
            e.redirect().unwrap().cookie_for(&other),
            theirs,
            mine ^ 1,
        ] {
            let mut n = notice_with_cookie(NODES[1], NODES[2], &key, cookie);
            assert_eq!(
                e.process(&mut n, Side::Uplink, &nb, 0),
                Verdict::Drop(DropReason::RedirectNoticeRefused),
                "cookie {cookie:#x}"
            );
        }
        assert_eq!(e.flows().len(), 0);
        // The cookie this node puts in its question about the flow: accepted.
        let mut n = notice_with_cookie(NODES[1], NODES[2], &key, mine);
        assert_eq!(e.process(&mut n, Side::Uplink, &nb, 1), Verdict::Consumed);
        assert_eq!(e.flows().len(), 1);
        // And that is the cookie its question carries.
        let mut ack = tcp(40002, tcp_flags::ACK);
        assert_eq!(e.process(&mut ack, Side::Uplink, &nb, 2), Verdict::Redirect);
        let out = e.take_redirect().unwrap();
        assert!(out.ask);
        assert_eq!(
            out.cookie,
            e.redirect().unwrap().cookie_for(&key_of(CLIENT, 40002))
        );
    }

    /// The live record of `key` (forward).
    fn record(e: &Engine, key: &FlowKey) -> Option<crate::flow::FlowId> {
        let raw = crate::flow::RawKey::from_key(key);
        e.flows().find_live(&raw, Direction::Forward, 10)
    }

    fn key_of(client: u32, cport: u16) -> FlowKey {
        FlowKey {
            src: client,
            dst: VIP,
            src_port: cport,
            dst_port: 80,
            proto: packet::IPPROTO_TCP,
        }
    }

    /// `e` with per-/24 buckets of `prefix` tokens per second and of burst.
    fn with_prefix_rate(mut e: Engine, prefix: u32) -> Engine {
        let mut cfg = e.redirect().unwrap().config().clone();
        cfg.prefix_rate_per_s = prefix;
        cfg.prefix_burst = prefix;
        e.set_redirect(Redirector::new(cfg));
        e
    }

    /// A second VIP whose only peer is node 0.
    const VIP2: u32 = 0x0ac8_000b;

    /// Node 2 with VIP's only peer node 1, and node 0 a peer of VIP2 only.
    fn node2_with_split_peers() -> Engine {
        let mut e = with_prefix_rate(node_with(2, true, 100, true), 25);
        e.redirect_mut().unwrap().set_from_state(&Redirects {
            node_address: Some(NODES[2].into()),
            vips: vec![
                VipRedirectPeers {
                    vip: VIP.into(),
                    nodes: vec![NODES[1].into()],
                },
                VipRedirectPeers {
                    vip: VIP2.into(),
                    nodes: vec![NODES[0].into()],
                },
            ],
            vips6: Vec::new(),
            keys: Vec::new(),
        });
        assert!(e.redirect().unwrap().is_peer(NODES[0]));
        e
    }

    #[test]
    fn a_notice_is_accepted_only_from_a_peer_of_its_vip() {
        let nb = nb();
        let mut e = node2_with_split_peers();
        let key = key_of(CLIENT, 40000);
        let mut n = notice(&e, NODES[0], NODES[2], &key);
        assert_eq!(
            e.process(&mut n, Side::Uplink, &nb, 0),
            Verdict::Drop(DropReason::RedirectNoticeRefused)
        );
        assert_eq!(
            e.flows().len(),
            0,
            "no record from a node that is no peer of VIP"
        );
        let mut n = notice(&e, NODES[1], NODES[2], &key);
        assert_eq!(e.process(&mut n, Side::Uplink, &nb, 1), Verdict::Consumed);
        let id = record(&e, &key).expect("a redirect record");
        assert_eq!(e.flows().get(id).backend, NODES[1]);
        // Nor can such a node re-point the record.
        let mut n = notice(&e, NODES[0], NODES[2], &key);
        assert_eq!(
            e.process(&mut n, Side::Uplink, &nb, 3),
            Verdict::Drop(DropReason::RedirectNoticeRefused)
        );
        let id = record(&e, &key).unwrap();
        assert_eq!(e.flows().get(id).backend, NODES[1]);
    }

    /// A packet of `client:cport` → VIP:80 with `flags`.
    fn tcp_from(client: u32, cport: u16, flags: u8) -> Vec<u8> {
        let mut f = tcp(cport, flags);
        f[26..30].copy_from_slice(&client.to_be_bytes());
        f[24..26].copy_from_slice(&[0, 0]);
        let c = packet::ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    }

    #[test]
    fn a_notice_is_sent_only_to_a_first_hop_that_is_a_peer_of_the_vip() {
        let nb = nb();
        let mut nodes = vec![node(0, true, 100), node(1, true, 100), node(2, true, 100)];
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        // Node 1 (a peer) passes on a question whose first hop is a stranger.
        let stranger = 0x0a01_0063;
        let orig = tcp(40000, tcp_flags::ACK);
        let mut buf = orig.clone();
        buf.resize(4096, 0);
        let out = RedirectOut {
            peer: NODES[0],
            macs: [0; 12],
            hops: HopList::from_slice(&[stranger, NODES[1]]).unwrap(),
            ask: true,
            frame_len: orig.len(),
            entropy: 1,
            cookie: 7,
        };
        let len = wire::encapsulate(&mut buf, &out, NODES[1], DEFAULT_PORT, 1600, None).unwrap();
        buf.truncate(len);
        let v = nodes[0].process(&mut buf, Side::Uplink, &nb, 1);
        assert!(
            matches!(v, Verdict::TxResized(Side::Pod(_), _)),
            "{v:?}: served"
        );
        let sent = nodes[0].redirect_mut().unwrap().take_notices().count();
        assert_eq!(sent, 0, "no notice to a first hop that is no peer");
    }

    #[test]
    fn a_flood_from_one_prefix_leaves_redirects_for_other_prefixes() {
        let mut nodes: Vec<Engine> = (0..3)
            .map(|i| with_prefix_rate(node(i, true, 100), 25))
            .collect();
        // A client of another /24 opens a connection through node 0.
        let other = 0xc633_6407;
        assert_eq!(
            run(&mut nodes, 0, tcp_from(other, 5000, tcp_flags::SYN), 0).0,
            Some(0)
        );
        // Random ACKs from CLIENT's /24 reach node 2 for 500 ms.
        for i in 0..5000u16 {
            let src = CLIENT & !0xff | u32::from(i % 200);
            run(
                &mut nodes,
                2,
                tcp_from(src, i, tcp_flags::ACK),
                u64::from(i) / 10,
            );
        }
        assert!(
            nodes[2]
                .counters()
                .drops_for(DropReason::RedirectPrefixRateLimited)
                >= 4900
        );
        // The other client's connection moves to node 2: still found.
        let (served, _) = run(&mut nodes, 2, tcp_from(other, 5000, tcp_flags::ACK), 500);
        assert_eq!(served, Some(0));
    }

    #[test]
    fn notices_are_charged_and_their_records_make_room_for_new_flows() {
        let nb = nb();
        let mut e = node2_with_split_peers();
        // A burst of notices from a peer of the VIP (a compromised one, or a forged
        // source) about many clients of one /24: at most its prefix's burst becomes records.
        for p in 0..1000u16 {
            let key = key_of(CLIENT, p);
            let mut n = notice(&e, NODES[1], NODES[2], &key);
            e.process(&mut n, Side::Uplink, &nb, 0);
        }
        let held = e.flows().len();
        assert!(held <= 25, "{held} records");
        assert!(
            e.counters()
                .drops_for(DropReason::RedirectPrefixRateLimited)
                >= 975
        );
        // Over time, notices about every prefix fill the table with records...
        for p in 0..5000u32 {
            let key = key_of(0x0b00_0000 + (p << 8), 1);
            let mut n = notice(&e, NODES[1], NODES[2], &key);
            e.process(&mut n, Side::Uplink, &nb, 1000 + u64::from(p) * 20);
        }
        assert_eq!(e.flows().len(), e.flows().capacity());
        // ...yet a new connection still gets a flow: records are displaced first.
        let mut syn = tcp_from(0xc633_6408, 1, tcp_flags::SYN);
        assert_eq!(
            e.process(&mut syn, Side::Uplink, &nb, 200_000),
            Verdict::Tx(Side::Pod(0))
        );
    }

    /// An ICMP "fragmentation needed" from a router to the VIP quoting the reply the
    /// owner sent for the client's connection on `cport` (VIP:80 -> client).
    fn frag_needed(cport: u16) -> Vec<u8> {
        let mut quoted = tcp(cport, tcp_flags::ACK)[14..14 + 28].to_vec();
        // The reply: VIP:80 -> CLIENT:cport.
        quoted[12..16].copy_from_slice(&VIP.to_be_bytes());
        quoted[16..20].copy_from_slice(&CLIENT.to_be_bytes());
        quoted[20..22].copy_from_slice(&80u16.to_be_bytes());
        quoted[22..24].copy_from_slice(&cport.to_be_bytes());
        let mut f = vec![0u8; 14 + 20 + 8 + quoted.len()];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        let total = (f.len() - 14) as u16;
        f[16..18].copy_from_slice(&total.to_be_bytes());
        f[22] = 64;
        f[23] = packet::IPPROTO_ICMP;
        f[26..30].copy_from_slice(&[198, 51, 100, 1]);
        f[30..34].copy_from_slice(&VIP.to_be_bytes());
        let c = packet::ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f[34] = packet::ICMP_DEST_UNREACH;
        f[35] = 4;
        f[40..42].copy_from_slice(&1400u16.to_be_bytes());
        f[42..].copy_from_slice(&quoted);
        let mut sum = 0u32;
        for c in f[34..].chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        f[36..38].copy_from_slice(&(!(sum as u16)).to_be_bytes());
        f
    }

    #[test]
    fn icmp_errors_about_a_redirected_flow_reach_its_owner() {
        let mut nodes = vec![node(0, true, 100), node(1, true, 100), node(2, true, 100)];
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        // Node 2 gets the flow's packets now and learns the owner (a redirect record).
        assert_eq!(run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 1).0, Some(0));
        assert_eq!(nodes[2].flows().len(), 1);
        // A router on the client's path sends "fragmentation needed" for the owner's
        // reply to the VIP; it hashes to node 2: it follows the record to node 0, whose
        // Pod gets it (run checks the DNAT to node 0's Pod).
        let limited = nodes[2]
            .counters()
            .drops_for(DropReason::RedirectRateLimited);
        let (served, between) = run(&mut nodes, 2, frag_needed(40000), 2);
        assert_eq!((served, between), (Some(0), 1));
        // Node 1 has neither the flow nor a record: it asks the peers in turn, like
        // for a segment of an unknown flow, and the error still reaches node 0.
        let (served, between) = run(&mut nodes, 1, frag_needed(40000), 3);
        assert_eq!(served, Some(0));
        assert!((1..=2).contains(&between), "{between}");
        assert_eq!(
            nodes[1].flows().len(),
            0,
            "an ICMP error makes no redirect record"
        );
        assert_eq!(
            nodes[2]
                .counters()
                .drops_for(DropReason::RedirectRateLimited),
            limited
        );
        // An error about no flow anywhere ends at the last node, dropped, not looped.
        let (served, between) = run(&mut nodes, 1, frag_needed(40999), 4);
        assert_eq!(served, None);
        assert!(between <= 2, "{between}");
    }

    #[test]
    fn peers_and_address_published_by_the_agent_turn_redirects_on() {
        let mut nodes = vec![
            node_with(0, true, 100, true),
            node_with(1, true, 100, true),
            node_with(2, true, 100, true),
        ];
        assert!(nodes.iter().all(|n| n.redirect().unwrap().active()));
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        let (served, _) = run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 1);
        assert_eq!(served, Some(0), "found through the published peers");
        // Counters per peer node: node 2 counts what it sent to node 0.
        let r = nodes[2].redirect().unwrap();
        assert_eq!(r.all_peers(), [NODES[0], NODES[1]]);
        let to0 = r.peer_counters().find(|(a, _)| *a == NODES[0]).unwrap().1;
        assert!(
            to0.redirected_to >= 1 && to0.notices_received == 1,
            "{to0:?}"
        );

        // The agent drops node 0 from node 2's list (its endpoints are gone): it is no
        // longer asked, and its counters stay (a peer that comes back keeps counting).
        let mut published = redirects_for(2);
        published.vips[0]
            .nodes
            .retain(|n| u32::from(*n) != NODES[0]);
        nodes[2].redirect_mut().unwrap().set_from_state(&published);
        let r = nodes[2].redirect().unwrap();
        assert_eq!(r.peers_for(VIP), [NODES[1]]);
        assert!(!r.is_peer(NODES[0]));
        assert_eq!(r.peer_counters().count(), 2);

        // Before the agent publishes an address, redirects are off: an unknown segment
        // is dropped as without redirects (never answered with a RST).
        let mut e = node(1, true, 100);
        e.set_redirect(Redirector::new(RedirectConfig {
            node: NODES[1],
            port: DEFAULT_PORT,
            peers: vec![],
            rate_per_s: 100,
            burst: 100,
            prefix_rate_per_s: 100,
            prefix_burst: 100,
            node_from_state: true,
        }));
        assert!(
            !e.redirect().unwrap().active(),
            "a given address is ignored"
        );
        e.redirect_mut()
            .unwrap()
            .set_from_state(&Redirects::default());
        assert!(!e.redirect().unwrap().active());
        assert_eq!(
            e.process(&mut tcp(41000, tcp_flags::ACK), Side::Uplink, &nb(), 0),
            Verdict::Drop(DropReason::NonSynWithoutFlow)
        );
        e.redirect_mut().unwrap().set_from_state(&redirects_for(1));
        assert_eq!(e.redirect().unwrap().node(), NODES[1]);
        // A state without an address keeps the one in use.
        e.redirect_mut()
            .unwrap()
            .set_from_state(&Redirects::default());
        assert_eq!(e.redirect().unwrap().node(), NODES[1]);
    }

    fn mac_key(b: u8) -> juneau_control::model::RedirectKey {
        juneau_control::model::RedirectKey::new(juneau_control::secret::SecretKey::new([b; 16]))
    }

    /// Publishes `keys` (current first) to node `i`'s engine, with its peers, as a new
    /// generation of the state would.
    fn with_keys(mut e: Engine, i: usize, keys: &[u8]) -> Engine {
        e.redirect_mut().unwrap().set_from_state(&Redirects {
            keys: keys.iter().map(|b| mac_key(*b)).collect(),
            ..redirects_for(i)
        });
        e
    }

    /// Three nodes with backends, all holding `keys[i]`.
    fn keyed_nodes(keys: [&[u8]; 3]) -> Vec<Engine> {
        (0..3)
            .map(|i| with_keys(node(i, true, 100), i, keys[i]))
            .collect()
    }

    /// A redirected ACK of `cport` from node 1 to node 0 (first hop node 1, no notice
    /// asked), tagged under `key` (none: version 2).
    fn redirected_ack(cport: u16, key: Option<u8>) -> Vec<u8> {
        let orig = tcp(cport, tcp_flags::ACK);
        let mut buf = orig.clone();
        buf.resize(4096, 0);
        let out = RedirectOut {
            peer: NODES[0],
            macs: [0; 12],
            hops: HopList::from_slice(&[NODES[1]]).unwrap(),
            ask: false,
            frame_len: orig.len(),
            entropy: 1,
            cookie: 0,
        };
        let k = key.map(mac_key);
        let len =
            wire::encapsulate(&mut buf, &out, NODES[1], DEFAULT_PORT, 1600, k.as_ref()).unwrap();
        buf.truncate(len);
        buf
    }

    #[test]
    fn with_a_key_in_force_a_frame_without_a_good_tag_is_dropped_as_bad_mac() {
        let nb = nb();
        let mut nodes = keyed_nodes([&[1], &[1], &[1]]);
        // Redirects work with the key: a moved connection reaches its owner, the notice
        // (tagged) is accepted, later packets go straight there.
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        assert_eq!(run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 1).0, Some(0));
        assert_eq!(
            run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 2),
            (Some(0), 1)
        );
        // At node 0 (owner of port 40000's flow): a redirected packet with no tag
        // (version 2), under a key id node 0 does not hold, under a retired key.
        let other_id = (2..=255u8)
            .find(|b| mac_key(*b).id != mac_key(1).id)
            .unwrap();
        for (what, key) in [("no tag", None), ("unknown key id", Some(other_id))] {
            let mut f = redirected_ack(40000, key);
            assert_eq!(
                nodes[0].process(&mut f, Side::Uplink, &nb, 3),
                Verdict::Drop(DropReason::RedirectBadMac),
                "{what}"
            );
        }
        // A notice with no tag, and one whose tag is under a key with node 2's id but
        // other bytes (a forger who knows the id).
        let key = key_of(CLIENT, 41000);
        let cookie = nodes[2].redirect().unwrap().cookie_for(&key);
        let mut n = notice_with_cookie(NODES[1], NODES[2], &key, cookie);
        assert_eq!(
            nodes[2].process(&mut n, Side::Uplink, &nb, 4),
            Verdict::Drop(DropReason::RedirectBadMac),
            "untagged notice"
        );
        let mut forged = mac_key(9);
        forged.id = mac_key(1).id;
        let mut buf = vec![0u8; 128];
        let len = wire::build_notice(
            &mut buf,
            &[0; 12],
            NODES[1],
            NODES[2],
            DEFAULT_PORT,
            &key,
            cookie,
            Some(&forged),
        )
        .unwrap();
        buf.truncate(len);
        assert_eq!(
            nodes[2].process(&mut buf, Side::Uplink, &nb, 4),
            Verdict::Drop(DropReason::RedirectBadMac),
            "notice under a forged key"
        );
        assert_eq!(nodes[2].flows().len(), 1, "no record from either");
        // Key 1 retired (rotated to key 2 everywhere): its tags are refused.
        let mut rotated = with_keys(node(0, true, 100), 0, &[2]);
        let mut f = redirected_ack(40001, Some(1));
        assert_eq!(
            rotated.process(&mut f, Side::Uplink, &nb, 6),
            Verdict::Drop(DropReason::RedirectBadMac),
            "retired key"
        );
        let bad: u64 = nodes
            .iter()
            .map(|n| n.counters().drops_for(DropReason::RedirectBadMac))
            .sum();
        assert_eq!(bad, 4);
    }

    #[test]
    fn both_keys_are_accepted_during_a_rotation() {
        // Key 2 is being rotated in: node 0 already sends with it, nodes 1 and 2 still
        // send with key 1; every node accepts both.
        let mut nodes = keyed_nodes([&[2, 1], &[1, 2], &[1, 2]]);
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        // Node 2 asks with key 1, node 0 answers (and notices) with key 2.
        assert_eq!(run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 1).0, Some(0));
        assert_eq!(
            run(&mut nodes, 2, tcp(40000, tcp_flags::ACK), 2),
            (Some(0), 1)
        );
        // The other way: a connection of node 2 moved to node 0.
        assert_eq!(run(&mut nodes, 2, tcp(40001, tcp_flags::SYN), 3).0, Some(2));
        assert_eq!(run(&mut nodes, 0, tcp(40001, tcp_flags::ACK), 4).0, Some(2));
        assert_eq!(
            run(&mut nodes, 0, tcp(40001, tcp_flags::ACK), 5),
            (Some(2), 1)
        );
        for n in &nodes {
            assert_eq!(n.counters().drops_for(DropReason::RedirectBadMac), 0);
        }
        // A node that holds only key 1 refuses node 0's frames (under key 2).
        let mut old = keyed_nodes([&[2], &[1], &[1]]);
        assert_eq!(run(&mut old, 0, tcp(40002, tcp_flags::SYN), 0).0, Some(0));
        let (served, _) = run(&mut old, 2, tcp(40002, tcp_flags::ACK), 1);
        assert_eq!(served, None);
        assert!(old[0].counters().drops_for(DropReason::RedirectBadMac) >= 1);
    }

    #[test]
    fn without_a_key_version_2_and_3_frames_are_both_taken() {
        // The rollout: the key reaches some nodes before others; a node without one
        // takes tagged frames unchecked, as it takes untagged ones.
        let nb = nb();
        let mut nodes = keyed_nodes([&[], &[1], &[1]]);
        assert_eq!(run(&mut nodes, 0, tcp(40000, tcp_flags::SYN), 0).0, Some(0));
        for key in [None, Some(1)] {
            let mut f = redirected_ack(40000, key);
            let v = nodes[0].process(&mut f, Side::Uplink, &nb, 1);
            assert!(
                matches!(v, Verdict::TxResized(Side::Pod(_), _)),
                "{key:?}: {v:?}"
            );
        }
        assert!(nodes[0].redirect().unwrap().send_key().is_none());
        assert_eq!(nodes[0].counters().drops_for(DropReason::RedirectBadMac), 0);
    }
}
