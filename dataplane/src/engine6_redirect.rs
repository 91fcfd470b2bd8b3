//! Redirects between nodes for IPv6 flows (issue #28): the same channel, buckets, hop
//! budget, cookie and MAC as IPv4's (`engine_redirect.rs`, docs/dataplane.md "Redirects
//! between nodes"). The outer packet stays IPv4 UDP between the nodes' redirect
//! addresses; the inner packet is the client's IPv6 packet, unchanged; a notice about an
//! IPv6 flow is a [`wire::KIND_NOTICE6`]. The first node keeps a redirect record in the
//! IPv6 flow table ([`Flow6Table::insert_redirect`]: mirrored to the steering program's
//! map like every IPv6 flow, so it survives a restart).

use super::redirect_path::{AskedFlow, Handing};
use super::{Engine, Verdict};
use crate::counters::DropReason;
use crate::flow::Direction;
use crate::flow6::{Flow6Key, Flow6Table, Insert6Error};
use crate::neigh::{Neighbours, Side};
use crate::packet::tcp_flags;
use crate::packet6::{self, Upper};
use crate::proto::{IPPROTO_TCP, IPPROTO_UDP};
use crate::redirect_wire::{self as wire, NoticeKey, FLAG_ASK};

impl Engine {
    /// Whether redirects are on (this node's redirect address known).
    fn redirects_on(&self) -> bool {
        self.redirect.as_ref().is_some_and(|r| r.active())
    }

    /// Whether a packet of `key` may take the redirect channel: redirects on, and TCP, or
    /// UDP to a frontend that hands flows on (the Cluster policy).
    fn redirectable6(&self, key: &Flow6Key) -> bool {
        self.redirects_on()
            && (key.proto == IPPROTO_TCP || (key.proto == IPPROTO_UDP && self.hands_off6(key)))
    }

    /// Whether `key`'s IPv6 frontend hands flows on (the Cluster policy).
    fn hands_off6(&self, key: &Flow6Key) -> bool {
        let s = self.v6.services.find(key.dst, key.proto, key.dst_port);
        s.and_then(|s| self.v6.services.service(s))
            .is_some_and(|s| s.hand_off)
    }

    /// Called by the IPv6 forward path for a TCP/UDP packet to a VIP, before the flow
    /// look-up, as [`Engine::redirect_hook`] is for IPv4: `Some` when the packet goes to
    /// another node (a redirect record followed, uncharged; an unknown TCP flow's segment
    /// asked about, charged) or is dropped on the way; `None` lets the normal path handle
    /// it (a flow held here, a SYN, a UDP datagram, a client the ranges leave out,
    /// redirects off).
    pub(super) fn redirect_hook6(
        &mut self,
        t: &mut Flow6Table,
        frame_len: usize,
        key: &Flow6Key,
        flags: u8,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        if !self.redirectable6(key) {
            return None;
        }
        let udp = key.proto == IPPROTO_UDP;
        // A client the Service's source ranges leave out: the normal path drops it (and
        // ends what it held).
        let s = self.v6.services.find(key.dst, key.proto, key.dst_port);
        if s.and_then(|s| self.v6.services.service(s))
            .is_some_and(|s| !s.admits(key.src))
        {
            return None;
        }
        let syn_only = !udp && tcp_flags::lone_syn(flags);
        match t.lookup(key, now_ms) {
            Some((id, Direction::Forward)) => {
                let owner = t.get(id)?.redirect_owner()?;
                if syn_only && self.redirect_ctx.is_none() {
                    // A new connection re-using the 5-tuple: served here from now on.
                    t.remove(id);
                    return None;
                }
                let hops = match self.hops_to_owner(owner)? {
                    Ok(hops) => hops,
                    Err(dropped) => return Some(dropped),
                };
                t.touch_redirect(id, flags, now_ms);
                let question = self.question_carried_on();
                Some(self.send_to(owner, hops, question, frame_len, key.flow_hash(), nb))
            }
            Some(_) => None,
            None if syn_only || udp => None,
            None => Some(self.redirect_unknown(true, frame_len, key, nb, now_ms)),
        }
    }

    /// No Ready backend here for a new IPv6 flow of service `service`, as
    /// [`Engine::no_backend`] for IPv4: a lone SYN goes to a peer (charged, except under
    /// the Cluster policy), a datagram too under the Cluster policy (uncharged); else
    /// `no_backend` (`redirect_no_peer` on a later node).
    pub(super) fn no_backend6(
        &mut self,
        frame_len: usize,
        key: &Flow6Key,
        syn_only: bool,
        service: u32,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let hand_off = self
            .v6
            .services
            .service(service)
            .is_some_and(|s| s.hand_off);
        let tcp = syn_only && key.proto == IPPROTO_TCP;
        let udp = hand_off && key.proto == IPPROTO_UDP;
        if self.redirects_on() && (tcp || udp) {
            let how = Handing::new_flow(hand_off);
            if let Some(v) = self.ask_next_peer(how, frame_len, key, nb, now_ms) {
                return v;
            }
        }
        self.drop6(self.no_backend_reason(), Some(service))
    }

    /// An ICMPv6 error from the uplink about flow `key` (forward key): `Some` when the
    /// flow is another node's — a redirect record is followed (uncharged), an unknown TCP
    /// flow is asked about (charged, no notice), as [`Engine::redirect_icmp_error`].
    pub(super) fn redirect_icmp6_error(
        &mut self,
        t: &mut Flow6Table,
        frame_len: usize,
        key: &Flow6Key,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Option<Verdict> {
        if !self.redirectable6(key) {
            return None;
        }
        let udp = key.proto == IPPROTO_UDP;
        match t.lookup(key, now_ms) {
            Some((id, Direction::Forward)) => {
                let owner = t.get(id)?.redirect_owner()?;
                let hops = match self.hops_to_owner(owner)? {
                    Ok(hops) => hops,
                    Err(dropped) => return Some(dropped),
                };
                Some(self.send_to(owner, hops, (false, 0), frame_len, key.flow_hash(), nb))
            }
            Some(_) => None,
            None if udp => None,
            None => Some(self.redirect_unknown(false, frame_len, key, nb, now_ms)),
        }
    }

    /// A redirected IPv6 packet, decapsulated into `frame[..len]`: served here if this
    /// node holds its flow (or opens it: a SYN handed on), else passed to the next peer;
    /// served with `ASK`, a notice goes to the first node if it is a peer of the VIP.
    pub(super) fn redirect_in6(
        &mut self,
        frame: &mut [u8],
        len: usize,
        rx: &wire::Received,
        nb: &Neighbours,
        now_ms: u64,
    ) -> Verdict {
        let inner = &mut frame[..len];
        let Ok(v) = packet6::parse6(inner) else {
            return self.drop(DropReason::RedirectMalformed, None);
        };
        let key = match v.upper {
            Upper::Transport(p) if !v.fragment => super::ipv6_path::key_of(&v, p),
            Upper::Icmp if packet6::parse_icmp6_error(inner, &v).is_some() => None,
            _ => return self.drop(DropReason::RedirectNotServed, None),
        };
        if !self.v6.services.is_vip(v.dst) {
            return self.drop(DropReason::RedirectNotServed, None);
        }
        self.redirect_ctx = Some((rx.hops, rx.flags, rx.cookie));
        let verdict = self.process6(inner, Side::Uplink, nb, now_ms);
        self.redirect_ctx = None;
        match verdict {
            Verdict::Tx(side) => {
                // Served here: tell the node that asked, if it is a peer of the VIP (the
                // hop list is the sender's word).
                if let (true, Some(origin), Some(key)) =
                    (rx.flags & FLAG_ASK != 0, rx.hops.origin(), key)
                {
                    if self
                        .redirect
                        .as_ref()
                        .is_some_and(|r| r.is_peer_of6(&key.dst, origin))
                    {
                        self.queue_notice(origin, NoticeKey::V6(key), rx.cookie, nb);
                    }
                }
                Verdict::TxResized(side, len as u16)
            }
            Verdict::Pass(_) => self.drop(DropReason::RedirectNotServed, None),
            other => other,
        }
    }

    /// "`from` owns this IPv6 flow": make (or point) the redirect record, unless this
    /// node holds the flow itself; the same checks as [`Engine::notice_in`].
    pub(super) fn notice_in6(
        &mut self,
        frame: &[u8],
        rx: &wire::Received,
        from: u32,
        now_ms: u64,
    ) -> Verdict {
        let key = wire::notice_key6(frame, rx);
        if let Some(c) = self.redirect.as_mut().and_then(|r| r.peer_mut(from)) {
            c.notices_received += 1;
        }
        let handed_off = self.hands_off6(&key);
        let udp_handed_off = key.proto == IPPROTO_UDP && handed_off;
        if (key.proto != IPPROTO_TCP && !udp_handed_off) || !self.v6.services.is_vip(key.dst) {
            return self.drop(DropReason::RedirectNotServed, None);
        }
        let Some(r) = self.redirect.as_mut() else {
            return self.drop(DropReason::RedirectNoticeRefused, None);
        };
        if !r.is_peer_of6(&key.dst, from) || rx.cookie != r.cookie_for6(&key) {
            return self.drop(DropReason::RedirectNoticeRefused, None);
        }
        if !handed_off {
            if let Err(empty) = r.take_notice_token6(&key.src, now_ms) {
                return self.drop(empty, None);
            }
        }
        let shared = std::sync::Arc::clone(&self.v6.flows);
        let t = &mut *super::ipv6_path::lock(&shared);
        let refused = match t.lookup(&key, now_ms) {
            Some((id, Direction::Forward))
                if t.get(id).is_some_and(|f| f.redirect_owner().is_some()) =>
            {
                t.set_redirect_owner(id, from, now_ms);
                None
            }
            Some(_) => None, // held here (or a conflicting reverse key): keep it
            None => match t.insert_redirect(&key, from, now_ms) {
                Ok(_) => None,
                Err(Insert6Error::Full) => Some(DropReason::FlowTableFull),
                Err(Insert6Error::Conflict) => Some(DropReason::FlowConflict),
                Err(Insert6Error::NotPublished) => Some(DropReason::FlowNotPublished),
            },
        };
        match refused {
            Some(r) => self.drop(r, None),
            None => Verdict::Consumed,
        }
    }
}

#[cfg(test)]
#[path = "engine6_redirect/tests.rs"]
mod tests;
