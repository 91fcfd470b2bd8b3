//! The IPv6 flow table (issue #28): which backend each IPv6 connection was given, found
//! from either direction.
//!
//! The IPv4 table ([`crate::flow`]) is a fixed-layout open-addressing index the XDP program
//! reads through mmap; an IPv6 key is 37 bytes and does not fit its 8-byte slots. IPv6 flows
//! are held here instead: records in a fixed-capacity vector (a free list, no allocation
//! after start), both keys of a flow — forward `(client, VIP, client port, VIP port,
//! proto)` and reverse `(backend, client, backend port, client port, proto)` — in a hash
//! map reserved to twice the capacity, keyed with a per-process random SipHash key (the
//! keys are chosen by clients). The same TCP state machine and timeouts as IPv4
//! ([`FlowState::next`], [`Timeouts`]).
//!
//! A flow another node holds (it said so in a notice, docs/dataplane.md "Redirects between
//! nodes") is kept here as a *redirect record* ([`FlowState::Redirect`],
//! [`Flow6Table::insert_redirect`]): its backend is the owner's IPv4 redirect address as an
//! IPv4-mapped IPv6 address with port 0, so its reverse key is one no real packet carries,
//! and a restart pairs its keys back into a record.
//!
//! The steering program learns which IPv6 packets are replies of held flows from a pinned
//! BPF hash map the table mirrors (a [`Flow6Mirror`]: one map update per new flow, one
//! delete per ended flow — never per packet). A flow whose keys the mirror refuses is not
//! created: its replies would reach the kernel un-NATed.

use std::collections::HashMap;

use crate::flow::{timeout_for, Direction, FlowState, Timeouts};
use crate::occupied::Occupied;
use crate::proto::IPPROTO_TCP;

/// An IPv6 5-tuple as a packet holds it (ports in host order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow6Key {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// IP protocol (TCP or UDP).
    pub proto: u8,
}

/// One IPv6 connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow6 {
    /// Client address.
    pub client: [u8; 16],
    /// VIP.
    pub vip: [u8; 16],
    /// Backend Pod address.
    pub backend: [u8; 16],
    /// Client port.
    pub client_port: u16,
    /// VIP port.
    pub vip_port: u16,
    /// Backend port.
    pub backend_port: u16,
    /// IP protocol.
    pub proto: u8,
    /// Connection state.
    pub state: FlowState,
    /// Index of the flow's service in the IPv6 service table of `generation`.
    pub service: u32,
    /// The service-table generation the flow was last checked against.
    pub generation: u64,
    /// The most a TCP segment towards the client may carry (payload + options): its
    /// SYN's MSS, lowered by a Packet Too Big for the flow; 0: unknown.
    pub client_mss: u16,
    /// Expiry, milliseconds on the caller's clock.
    expires_ms: u64,
    /// A redirect record's end as its packets told it: 0 none, 1 a FIN, 2 a RST.
    redirect_end: u8,
}

/// `a` as an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`): where a redirect record keeps
/// its owner.
pub fn v4_mapped(a: u32) -> [u8; 16] {
    let mut x = [0u8; 16];
    x[10] = 0xff;
    x[11] = 0xff;
    x[12..].copy_from_slice(&a.to_be_bytes());
    x
}

/// The IPv4 address in an IPv4-mapped IPv6 address, if it is one.
pub fn from_v4_mapped(x: &[u8; 16]) -> Option<u32> {
    (x[..10] == [0; 10] && x[10..12] == [0xff, 0xff])
        .then(|| u32::from_be_bytes([x[12], x[13], x[14], x[15]]))
}

impl Flow6 {
    /// A new flow in the state its first packet (`tcp_flags`, client -> VIP) gives it.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: ([u8; 16], u16),
        vip: ([u8; 16], u16),
        backend: ([u8; 16], u16),
        proto: u8,
        tcp_flags: u8,
        service: u32,
        generation: u64,
    ) -> Self {
        let state = if proto == IPPROTO_TCP {
            FlowState::SynSent.next(proto, Direction::Forward, tcp_flags)
        } else {
            FlowState::Udp
        };
        Flow6 {
            client: client.0,
            client_port: client.1,
            vip: vip.0,
            vip_port: vip.1,
            backend: backend.0,
            backend_port: backend.1,
            proto,
            state,
            service,
            generation,
            client_mss: 0,
            expires_ms: 0,
            redirect_end: 0,
        }
    }

    /// A redirect record's owner (its IPv4 redirect address); `None` for a flow served
    /// here.
    pub fn redirect_owner(&self) -> Option<u32> {
        if self.state != FlowState::Redirect {
            return None;
        }
        from_v4_mapped(&self.backend)
    }

    /// The client's packets: client -> VIP.
    pub fn forward_key(&self) -> Flow6Key {
        Flow6Key {
            src: self.client,
            dst: self.vip,
            src_port: self.client_port,
            dst_port: self.vip_port,
            proto: self.proto,
        }
    }

    /// The backend's replies: backend -> client.
    pub fn reverse_key(&self) -> Flow6Key {
        Flow6Key {
            src: self.backend,
            dst: self.client,
            src_port: self.backend_port,
            dst_port: self.client_port,
            proto: self.proto,
        }
    }
}

/// Where the table publishes its keys for the steering program (the pinned `flows6` map).
pub trait Flow6Mirror: Send {
    /// Publishes a key; `false` if it could not (the flow is then not created).
    fn publish(&mut self, key: &Flow6Key) -> bool;
    /// Withdraws a key (absent keys are fine).
    fn withdraw(&mut self, key: &Flow6Key);
}

/// Why a flow was not created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Insert6Error {
    /// Every record is in use.
    #[error("the IPv6 flow table is full")]
    Full,
    /// Another flow already holds the reverse key (two clients' connections would share
    /// a backend-side 5-tuple).
    #[error("another IPv6 flow holds the reply key")]
    Conflict,
    /// The steering program's map refused the keys.
    #[error("the steering program's IPv6 flow map refused the keys")]
    NotPublished,
}

/// The IPv6 flow table.
pub struct Flow6Table {
    records: Vec<Option<Flow6>>,
    free: Vec<u32>,
    /// The records that hold a flow (the sweep skips free stretches).
    occupied: Occupied,
    index: HashMap<Flow6Key, (u32, Direction)>,
    timeouts: Timeouts,
    half_open: usize,
    half_open_max: usize,
    cursor: usize,
    mirror: Option<Box<dyn Flow6Mirror>>,
}

impl std::fmt::Debug for Flow6Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flow6Table")
            .field("capacity", &self.records.len())
            .field("len", &self.len())
            .field("half_open", &self.half_open)
            .field("mirrored", &self.mirror.is_some())
            .finish()
    }
}

impl Flow6Table {
    /// A table of `capacity` flows, at most a quarter of them half-open TCP.
    pub fn new(capacity: usize, timeouts: Timeouts) -> Self {
        let capacity = capacity.clamp(1, u32::MAX as usize);
        Flow6Table {
            records: vec![None; capacity],
            free: (0..capacity as u32).rev().collect(),
            occupied: Occupied::new(capacity),
            index: HashMap::with_capacity(2 * capacity),
            timeouts,
            half_open: 0,
            half_open_max: (capacity / 4).max(1),
            cursor: 0,
            mirror: None,
        }
    }

    /// Publishes every key from now on (and the keys held so far) through `mirror`.
    pub fn set_mirror(&mut self, mut mirror: Box<dyn Flow6Mirror>) {
        for k in self.index.keys() {
            mirror.publish(k);
        }
        self.mirror = Some(mirror);
    }

    /// Most flows held at once.
    pub fn capacity(&self) -> usize {
        self.records.len()
    }

    /// Flows held.
    pub fn len(&self) -> usize {
        self.records.len() - self.free.len()
    }

    /// No flow held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Half-open TCP flows held.
    pub fn half_open(&self) -> usize {
        self.half_open
    }

    /// The flow with this id (as `lookup` or `insert` returned it).
    pub fn get(&self, id: u32) -> Option<&Flow6> {
        self.records.get(id as usize)?.as_ref()
    }

    /// The live flow one of whose keys is `k`, and which key matched; an expired flow
    /// found on the way is removed.
    pub fn lookup(&mut self, k: &Flow6Key, now_ms: u64) -> Option<(u32, Direction)> {
        let (id, dir) = *self.index.get(k)?;
        if self.records[id as usize].is_some_and(|f| f.expires_ms <= now_ms) {
            self.remove(id);
            return None;
        }
        Some((id, dir))
    }

    /// Creates a flow (its keys published first).
    pub fn insert(&mut self, mut f: Flow6, now_ms: u64) -> Result<u32, Insert6Error> {
        let (fwd, rev) = (f.forward_key(), f.reverse_key());
        if self.index.contains_key(&rev) || self.index.contains_key(&fwd) {
            return Err(Insert6Error::Conflict);
        }
        if f.state.is_half_open() && self.half_open >= self.half_open_max {
            return Err(Insert6Error::Full);
        }
        let Some(&id) = self.free.last() else {
            return Err(Insert6Error::Full);
        };
        if let Some(m) = self.mirror.as_mut() {
            if !m.publish(&fwd) {
                return Err(Insert6Error::NotPublished);
            }
            if !m.publish(&rev) {
                m.withdraw(&fwd);
                return Err(Insert6Error::NotPublished);
            }
        }
        self.free.pop();
        f.expires_ms = now_ms + u64::from(timeout_for(&self.timeouts, f.state));
        self.half_open += usize::from(f.state.is_half_open());
        self.records[id as usize] = Some(f);
        self.occupied.set(id as usize);
        self.index.insert(fwd, (id, Direction::Forward));
        self.index.insert(rev, (id, Direction::Reverse));
        Ok(id)
    }

    /// Inserts a redirect record: packets with forward key `key` go to node `owner` (its
    /// IPv4 redirect address). Its reverse key is `(::ffff:owner, client, 0, client port,
    /// proto)`, which no real packet carries (port 0); it expires like an established flow
    /// and follows FIN/RST ([`Flow6Table::touch_redirect`]). The caller looked the key up
    /// first and found nothing.
    pub fn insert_redirect(
        &mut self,
        key: &Flow6Key,
        owner: u32,
        now_ms: u64,
    ) -> Result<u32, Insert6Error> {
        let mut f = Flow6::new(
            (key.src, key.src_port),
            (key.dst, key.dst_port),
            (v4_mapped(owner), 0),
            key.proto,
            0,
            u32::MAX,
            u64::MAX,
        );
        f.state = FlowState::Redirect;
        let id = self.insert(f, now_ms)?;
        self.touch_redirect(id, 0, now_ms);
        Ok(id)
    }

    /// Points redirect record `id` at another owner (a notice from the node that holds
    /// the flow now); its keys change, so they are withdrawn and published again.
    pub fn set_redirect_owner(&mut self, id: u32, owner: u32, now_ms: u64) {
        let Some(f) = self.get(id).copied() else {
            return;
        };
        if f.redirect_owner() == Some(owner) {
            self.touch_redirect(id, 0, now_ms);
            return;
        }
        self.remove(id);
        // (The record just freed is taken again: no room is needed.)
        let _ = self.insert_redirect(&f.forward_key(), owner, now_ms);
    }

    /// A packet sent along redirect record `id`: its expiry moves out by the timeout its
    /// TCP flags call for (a FIN or RST seen is remembered, so later ACKs do not lengthen
    /// it again); a datagram's, by the UDP timeout.
    pub fn touch_redirect(&mut self, id: u32, tcp_flags: u8, now_ms: u64) {
        let Some(f) = self.records.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        if tcp_flags & crate::proto::tcp_flags::RST != 0 {
            f.redirect_end = 2;
        } else if tcp_flags & crate::proto::tcp_flags::FIN != 0 && f.redirect_end == 0 {
            f.redirect_end = 1;
        }
        let t = &self.timeouts;
        let timeout = match (f.proto, f.redirect_end) {
            (crate::proto::IPPROTO_UDP, _) => t.udp_ms,
            (_, 0) => t.tcp_established_ms,
            (_, 1) => t.tcp_fin_ms,
            _ => t.tcp_rst_ms,
        };
        f.expires_ms = now_ms + u64::from(timeout);
    }

    /// A packet of flow `id` went `dir` with these TCP flags: state and expiry follow.
    pub fn touch(&mut self, id: u32, dir: Direction, tcp_flags: u8, now_ms: u64) {
        let Some(f) = self.records.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        let before = f.state.is_half_open();
        f.state = f.state.next(f.proto, dir, tcp_flags);
        f.expires_ms = now_ms + u64::from(timeout_for(&self.timeouts, f.state));
        self.half_open = self.half_open + usize::from(f.state.is_half_open()) - usize::from(before);
    }

    /// Marks flow `id` as checked against service-table `generation` (service `service`).
    pub fn revalidated(&mut self, id: u32, service: u32, generation: u64) {
        if let Some(f) = self.records.get_mut(id as usize).and_then(Option::as_mut) {
            f.service = service;
            f.generation = generation;
        }
    }

    /// Sets flow `id`'s client MSS, or (`lower_only`) lowers it.
    pub fn note_client_mss(&mut self, id: u32, mss: u16, lower_only: bool) {
        if let Some(f) = self.records.get_mut(id as usize).and_then(Option::as_mut) {
            if !lower_only || f.client_mss == 0 || mss < f.client_mss {
                f.client_mss = mss;
            }
        }
    }

    /// Ends flow `id` (its keys withdrawn).
    pub fn remove(&mut self, id: u32) {
        let Some(f) = self.records.get_mut(id as usize).and_then(Option::take) else {
            return;
        };
        for k in [f.forward_key(), f.reverse_key()] {
            self.index.remove(&k);
            if let Some(m) = self.mirror.as_mut() {
                m.withdraw(&k);
            }
        }
        self.half_open -= usize::from(f.state.is_half_open());
        self.free.push(id);
        self.occupied.clear(id as usize);
    }

    /// Rebuilds the flows a previous process held from the keys it left in the
    /// steering program's map (a restart): a forward key `(client -> VIP)` and a reverse
    /// key `(backend -> client)` with the same client address, port and protocol make one
    /// flow, taken as established (its state is not in the map) and checked against the
    /// service table at its next packet. Keys that pair with none, or ambiguously, are
    /// left out (and withdrawn by the caller). Returns the flows restored.
    pub fn restore(
        &mut self,
        keys: &[Flow6Key],
        is_vip: impl Fn(&[u8; 16]) -> bool,
        now_ms: u64,
    ) -> usize {
        type Client = ([u8; 16], u16, u8);
        let mut forward: HashMap<Client, Vec<&Flow6Key>> = HashMap::new();
        let mut reverse: HashMap<Client, Vec<&Flow6Key>> = HashMap::new();
        for k in keys {
            if is_vip(&k.dst) {
                forward
                    .entry((k.src, k.src_port, k.proto))
                    .or_default()
                    .push(k);
            } else {
                reverse
                    .entry((k.dst, k.dst_port, k.proto))
                    .or_default()
                    .push(k);
            }
        }
        let mut restored = 0;
        for (client, f) in forward {
            let (Some(r), [f]) = (reverse.get(&client), f.as_slice()) else {
                continue;
            };
            let [r] = r.as_slice() else { continue };
            // A redirect record's reverse key: the owner IPv4-mapped, port 0.
            let owner = from_v4_mapped(&r.src).filter(|_| r.src_port == 0);
            let mut flow = Flow6::new(
                (client.0, client.1),
                (f.dst, f.dst_port),
                (r.src, r.src_port),
                client.2,
                crate::proto::tcp_flags::ACK,
                u32::MAX,
                u64::MAX,
            );
            flow.state = if owner.is_some() {
                FlowState::Redirect
            } else if client.2 == IPPROTO_TCP {
                FlowState::Established
            } else {
                FlowState::Udp
            };
            if self.insert(flow, now_ms).is_ok() {
                restored += 1;
            }
        }
        restored
    }

    /// Looks at up to `budget` records from a rotating cursor and ends the expired ones;
    /// returns how many ended.
    pub fn sweep(&mut self, now_ms: u64, budget: usize) -> usize {
        let mut left = budget.min(self.records.len());
        let mut ended = 0;
        while left > 0 {
            for id in self.occupied.stretch(&mut self.cursor, &mut left) {
                if self.records[id].is_some_and(|f| f.expires_ms <= now_ms) {
                    self.remove(id as u32);
                    ended += 1;
                }
            }
        }
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{tcp_flags, IPPROTO_UDP};
    use std::sync::{Arc, Mutex};

    fn a(last: u8) -> [u8; 16] {
        let mut x = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        x[15] = last;
        x
    }

    fn syn_flow(client_port: u16) -> Flow6 {
        Flow6::new(
            (a(9), client_port),
            (a(1), 80),
            (a(50), 8080),
            IPPROTO_TCP,
            tcp_flags::SYN,
            0,
            1,
        )
    }

    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<(Vec<Flow6Key>, bool)>>);

    impl Flow6Mirror for Recorder {
        fn publish(&mut self, key: &Flow6Key) -> bool {
            let mut g = self.0.lock().unwrap();
            if g.1 {
                return false;
            }
            g.0.push(*key);
            true
        }
        fn withdraw(&mut self, key: &Flow6Key) {
            self.0.lock().unwrap().0.retain(|k| k != key);
        }
    }

    #[test]
    fn a_flow_is_found_from_both_directions_and_follows_the_handshake() {
        let mut t = Flow6Table::new(8, Timeouts::default());
        let f = syn_flow(40000);
        let id = t.insert(f, 0).unwrap();
        assert_eq!(
            t.lookup(&f.forward_key(), 1),
            Some((id, Direction::Forward))
        );
        assert_eq!(
            t.lookup(&f.reverse_key(), 1),
            Some((id, Direction::Reverse))
        );
        assert_eq!(t.half_open(), 1);
        t.touch(id, Direction::Reverse, tcp_flags::SYN | tcp_flags::ACK, 2);
        t.touch(id, Direction::Forward, tcp_flags::ACK, 3);
        assert_eq!(t.get(id).unwrap().state, FlowState::Established);
        assert_eq!(t.half_open(), 0);
        // An established flow lives for the established timeout, then is gone.
        let later = 3 + u64::from(Timeouts::default().tcp_established_ms);
        assert!(t.lookup(&f.forward_key(), later - 1).is_some());
        assert!(t.lookup(&f.forward_key(), later).is_none());
        assert!(t.is_empty());
    }

    #[test]
    fn capacity_half_open_and_conflicts_are_refused_by_name() {
        let mut t = Flow6Table::new(4, Timeouts::default());
        t.insert(syn_flow(1), 0).unwrap();
        // A quarter of 4: one half-open flow at most.
        assert_eq!(t.insert(syn_flow(2), 0), Err(Insert6Error::Full));
        assert_eq!(t.insert(syn_flow(1), 0), Err(Insert6Error::Conflict));
        for p in 2..5 {
            let u = Flow6::new((a(9), p), (a(1), 53), (a(50), 53), IPPROTO_UDP, 0, 0, 1);
            t.insert(u, 0).unwrap();
        }
        let u = Flow6::new((a(9), 9), (a(1), 53), (a(50), 53), IPPROTO_UDP, 0, 0, 1);
        assert_eq!(t.insert(u, 0), Err(Insert6Error::Full));
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn the_mirror_holds_exactly_the_live_keys_and_a_refusal_creates_nothing() {
        let rec = Recorder::default();
        let mut t = Flow6Table::new(16, Timeouts::default());
        let early = t.insert(syn_flow(7), 0).unwrap();
        t.set_mirror(Box::new(rec.clone()));
        assert_eq!(
            rec.0.lock().unwrap().0.len(),
            2,
            "keys held before are published"
        );
        let f = syn_flow(8);
        let id = t.insert(f, 0).unwrap();
        assert_eq!(rec.0.lock().unwrap().0.len(), 4);
        t.remove(id);
        t.remove(early);
        assert!(rec.0.lock().unwrap().0.is_empty());
        rec.0.lock().unwrap().1 = true;
        assert_eq!(t.insert(f, 0), Err(Insert6Error::NotPublished));
        assert!(t.is_empty() && t.lookup(&f.forward_key(), 0).is_none());
    }

    #[test]
    fn a_restart_pairs_the_keys_it_finds_into_flows() {
        let mut old = Flow6Table::new(16, Timeouts::default());
        let a_flow = syn_flow(1);
        old.insert(a_flow, 0).unwrap();
        let udp = Flow6::new((a(9), 2), (a(1), 53), (a(51), 53), IPPROTO_UDP, 0, 0, 1);
        old.insert(udp, 0).unwrap();
        let mut keys: Vec<Flow6Key> = old.index.keys().copied().collect();
        // A lone reverse key (its forward key lost) pairs with nothing.
        keys.push(syn_flow(3).reverse_key());
        let mut t = Flow6Table::new(16, Timeouts::default());
        assert_eq!(t.restore(&keys, |ip| *ip == a(1), 5), 2);
        let (id, dir) = t.lookup(&a_flow.reverse_key(), 6).unwrap();
        assert_eq!(dir, Direction::Reverse);
        let f = t.get(id).unwrap();
        assert_eq!(
            (f.backend, f.backend_port, f.state),
            (a(50), 8080, FlowState::Established)
        );
        assert_eq!(
            f.generation,
            u64::MAX,
            "checked against the table at its next packet"
        );
        let (id, _) = t.lookup(&udp.forward_key(), 6).unwrap();
        assert_eq!(t.get(id).unwrap().state, FlowState::Udp);
        assert!(t.lookup(&syn_flow(3).forward_key(), 6).is_none());
    }

    #[test]
    fn a_redirect_record_survives_a_restart_and_follows_fin_and_rst() {
        let rec = Recorder::default();
        let mut old = Flow6Table::new(16, Timeouts::default());
        old.set_mirror(Box::new(rec.clone()));
        let k = syn_flow(7).forward_key();
        let owner = 0x0a01_0002;
        let id = old.insert_redirect(&k, owner, 0).unwrap();
        let f = *old.get(id).unwrap();
        assert_eq!(
            (f.state, f.redirect_owner()),
            (FlowState::Redirect, Some(owner))
        );
        assert_eq!(
            f.reverse_key().src_port,
            0,
            "a reverse key no packet carries"
        );
        // A restart pairs the keys the mirror held into the record again.
        let keys = rec.0.lock().unwrap().0.clone();
        assert_eq!(keys.len(), 2);
        let mut t = Flow6Table::new(16, Timeouts::default());
        assert_eq!(t.restore(&keys, |ip| *ip == a(1), 5), 1);
        let (id, dir) = t.lookup(&k, 6).unwrap();
        assert_eq!(dir, Direction::Forward);
        assert_eq!(t.get(id).unwrap().redirect_owner(), Some(owner));
        // Lives like an established flow; a FIN shortens it and later ACKs do not
        // lengthen it again; another owner's notice points it elsewhere.
        let to = Timeouts::default();
        t.touch_redirect(id, tcp_flags::ACK, 10);
        assert!(t
            .lookup(&k, 10 + u64::from(to.tcp_established_ms) - 1)
            .is_some());
        t.touch_redirect(id, tcp_flags::FIN | tcp_flags::ACK, 20);
        t.touch_redirect(id, tcp_flags::ACK, 30);
        assert!(t.lookup(&k, 30 + u64::from(to.tcp_fin_ms)).is_none());
        let id = t.insert_redirect(&k, owner, 0).unwrap();
        t.set_redirect_owner(id, owner + 1, 1);
        let (id, _) = t.lookup(&k, 2).unwrap();
        assert_eq!(t.get(id).unwrap().redirect_owner(), Some(owner + 1));
        assert_eq!(t.len(), 1);
        assert_eq!(v4_mapped(owner)[10..12], [0xff, 0xff]);
        assert_eq!(from_v4_mapped(&a(1)), None);
    }

    #[test]
    fn the_sweep_ends_expired_flows_within_its_budget() {
        let mut t = Flow6Table::new(8, Timeouts::default());
        for p in 0..6 {
            let u = Flow6::new((a(9), p), (a(1), 53), (a(50), 53), IPPROTO_UDP, 0, 0, 1);
            t.insert(u, 0).unwrap();
        }
        let end = u64::from(Timeouts::default().udp_ms);
        assert_eq!(t.sweep(end - 1, 8), 0);
        assert_eq!(t.sweep(end, 4), 4);
        assert_eq!(t.sweep(end, 4), 2);
        assert!(t.is_empty());
    }
}
