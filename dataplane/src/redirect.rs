//! Second-chance redirects between nodes: the pure decisions, no I/O, no clock.
//!
//! When the router's ECMP group changes, packets of established TCP connections arrive
//! at a node that has never seen them. Instead of answering them (a Pod would send a
//! RST), the node forwards the packet, encapsulated ([`crate::redirect_wire`]), to the
//! other nodes that serve the VIP, one after another, until the node that holds the flow
//! takes it (Beamer's daisy chaining, GLB's second chance). The owner DNATs it to its
//! backend as usual (the reply leaves from the owner: no SNAT anywhere) and, when the
//! sender asked, tells the sender "I own this flow" with a notice; the sender then keeps
//! a *redirect record* for the flow in its one flow table ([`crate::flow::FlowState::Redirect`])
//! and sends the flow's later packets straight to the owner.
//!
//! This module holds what decides:
//! - [`HopList`]: the nodes a packet has already visited (the sender first); the next
//!   node to ask is never one of them ([`next_hop`]), so there is no loop, and a packet
//!   visits at most [`MAX_HOPS`] nodes;
//! - [`TokenBucket`]: what a node spends on packets of *unknown* flows (a flood of random
//!   ACKs must not become a flood between nodes); redirects of flows an owner vouched for
//!   are not charged;
//! - [`Redirector`]: this node's address (given, or published by the node agent), its
//!   peers — per VIP as the agent publishes them ([`Redirector::set_from_state`]), plus
//!   the static ones — and their counters per peer node, the bucket, and the outputs the
//!   I/O loop takes after each packet or batch ([`RedirectOut`], [`Notice`]).
//!
//! Must not touch: packets' bytes (that is [`crate::redirect_wire`]), sockets, the clock
//! (time is passed in, so the property tests run in virtual time).

use crate::counters::DropReason;
use crate::flow::FlowKey;
use crate::flow6::Flow6Key;

/// Most nodes a redirected packet visits (the sender included); also the most
/// addresses in the encapsulation header.
pub const MAX_HOPS: usize = 8;

/// Default UDP port redirected packets and notices are sent to.
pub const DEFAULT_PORT: u16 = 7411;

/// The nodes a packet has visited, the first one being the node it arrived at from the
/// router (the one that asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HopList {
    nodes: [u32; MAX_HOPS],
    len: u8,
}

impl HopList {
    /// An empty list.
    pub fn new() -> Self {
        HopList::default()
    }

    /// A list from addresses (at most [`MAX_HOPS`]; `None` for more).
    pub fn from_slice(nodes: &[u32]) -> Option<Self> {
        if nodes.len() > MAX_HOPS {
            return None;
        }
        let mut h = HopList::new();
        h.nodes[..nodes.len()].copy_from_slice(nodes);
        h.len = nodes.len() as u8;
        Some(h)
    }

    /// The visited nodes, in order.
    pub fn as_slice(&self) -> &[u32] {
        &self.nodes[..usize::from(self.len)]
    }

    /// Whether `node` already had the packet.
    pub fn contains(&self, node: u32) -> bool {
        self.as_slice().contains(&node)
    }

    /// Appends `node` (no-op if present); `false` when the list is full.
    pub fn push(&mut self, node: u32) -> bool {
        if self.contains(node) {
            return true;
        }
        if usize::from(self.len) == MAX_HOPS {
            return false;
        }
        self.nodes[usize::from(self.len)] = node;
        self.len += 1;
        true
    }

    /// The node the packet first arrived at (the one waiting for a notice).
    pub fn origin(&self) -> Option<u32> {
        self.as_slice().first().copied()
    }

    /// Number of visited nodes.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether no node is listed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The next node to ask about a flow: the first of `peers`, in an order that starts at
/// a place given by the flow's hash (so the first question spreads over the peers), that
/// is neither this node nor already visited. `None` when every peer was asked or the
/// hop budget is spent: the packet is dropped.
pub fn next_hop(peers: &[u32], me: u32, visited: &HopList, flow_hash: u64) -> Option<u32> {
    if visited.len() >= MAX_HOPS || peers.is_empty() {
        return None;
    }
    let n = peers.len();
    let start = (flow_hash % n as u64) as usize;
    (0..n)
        .map(|i| peers[(start + i) % n])
        .find(|&p| p != me && p != 0 && !visited.contains(p))
}

/// The peer a **new** connection or UDP flow that finds no Ready backend here is handed
/// to: weighted rendezvous hashing over the peers of `peers` with a nonzero weight in
/// `weights` (the peer's Ready endpoints of the VIP; a peer past its end weighs 0) that
/// are neither this node nor
/// already visited — each endpoint cluster-wide gets an equal share, and a peer joining,
/// leaving or changing weight moves only the flows it gains or loses. A list without
/// weights (an older agent's, or no weighted peer left) falls back to [`next_hop`].
pub fn next_hop_weighted(
    (peers, weights): (&[u32], &[u32]),
    me: u32,
    visited: &HopList,
    flow_hash: u64,
) -> Option<u32> {
    if visited.len() >= MAX_HOPS {
        return None;
    }
    peers
        .iter()
        .zip(weights)
        .filter(|&(&p, &w)| w > 0 && p != me && p != 0 && !visited.contains(p))
        .map(|(&p, &w)| (rendezvous_score(flow_hash, p, w), p))
        .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(_, p)| p)
        .or_else(|| next_hop(peers, me, visited, flow_hash))
}

/// Weighted rendezvous score of `peer` for a flow: `w / -ln(u)` with `u` uniform in
/// (0, 1] from the flow's hash mixed with the peer's address (splitmix64), so the
/// highest score falls on each peer with probability `w / sum(w)`.
fn rendezvous_score(flow_hash: u64, peer: u32, weight: u32) -> f64 {
    let mut z = flow_hash ^ u64::from(peer).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let u = ((z >> 11) + 1) as f64 / (1u64 << 53) as f64;
    f64::from(weight) / -u.ln().min(-f64::MIN_POSITIVE)
}

/// A token bucket in integer milli-tokens on a millisecond clock: `rate` tokens per
/// second, at most `burst` saved up.
#[derive(Debug, Clone, Copy)]
pub struct TokenBucket {
    rate_per_s: u64,
    burst_milli: u64,
    milli: u64,
    last_ms: Option<u64>,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate_per_s: u32, burst: u32) -> Self {
        let burst_milli = u64::from(burst.max(1)) * 1000;
        TokenBucket {
            rate_per_s: u64::from(rate_per_s),
            burst_milli,
            milli: burst_milli,
            last_ms: None,
        }
    }

    /// Takes one token if there is one.
    pub fn take(&mut self, now_ms: u64) -> bool {
        if let Some(last) = self.last_ms {
            let dt = now_ms.saturating_sub(last);
            self.milli = (self.milli + dt.saturating_mul(self.rate_per_s)).min(self.burst_milli);
        }
        self.last_ms = Some(now_ms.max(self.last_ms.unwrap_or(0)));
        if self.milli >= 1000 {
            self.milli -= 1000;
            true
        } else {
            false
        }
    }
}

pub use crate::counters::PeerCounters;

/// Redirect settings.
#[derive(Debug, Clone)]
pub struct RedirectConfig {
    /// This node's address on the node network (source of what it sends, destination
    /// of what it receives).
    pub node: u32,
    /// UDP port of redirected packets and notices (the same on every node).
    pub port: u16,
    /// The other nodes' addresses (this node's own address may be listed; it is never
    /// asked).
    pub peers: Vec<u32>,
    /// Redirects of packets of unknown flows per second (sent or passed on).
    pub rate_per_s: u32,
    /// Burst of such redirects.
    pub burst: u32,
    /// Of those, at most this many per second about clients of one /24 (and notices
    /// about them), so that a flood from one prefix cannot take the whole bucket.
    pub prefix_rate_per_s: u32,
    /// Burst of those per /24.
    pub prefix_burst: u32,
    /// Take this node's address from the node state (the agent publishes it,
    /// [`juneau_control::model::Redirects::node_address`]) instead of `node`; `node` is 0
    /// until the state gives one, and redirects stay off until then.
    pub node_from_state: bool,
}

/// Most peer nodes whose counters are kept after they left every peer list (so a peer
/// that comes back keeps counting where it was); beyond it, the stale ones are forgotten.
pub const MAX_STALE_PEER_COUNTERS: usize = 1024;

/// A packet to encapsulate and send to `peer` (taken by the I/O loop after a
/// [`crate::engine::Verdict::Redirect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedirectOut {
    /// The node it goes to.
    pub peer: u32,
    /// Ethernet destination then source MAC towards that node.
    pub macs: [u8; 12],
    /// Visited nodes, this one included.
    pub hops: HopList,
    /// Ask the owner for a notice (a packet of an unknown flow).
    pub ask: bool,
    /// Length of the frame to encapsulate (Ethernet header + the IPv4 packet).
    pub frame_len: usize,
    /// Source-port entropy for the node network's own ECMP.
    pub entropy: u16,
    /// The first node's cookie for the flow when it asks for a notice, else 0.
    pub cookie: u64,
}

/// An "I own this flow" notice to send to `to` (the node that asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notice {
    /// The node that asked.
    pub to: u32,
    /// Ethernet destination then source MAC towards it.
    pub macs: [u8; 12],
    /// The flow's forward key (client → VIP), IPv4 or IPv6.
    pub key: crate::redirect_wire::NoticeKey,
    /// The question's cookie, echoed.
    pub cookie: u64,
}

/// An answer to a peer's liveness probe, to send to `to` (the prober).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    /// The node that probed.
    pub to: u32,
    /// Ethernet destination then source MAC towards it.
    pub macs: [u8; 12],
    /// The probe's nonce, echoed.
    pub nonce: u64,
}

/// What a redirector has queued to send after a batch ([`Redirector::take_outgoing`]).
pub struct Outgoing<'a> {
    /// "I own this flow" notices.
    pub notices: std::vec::Drain<'a, Notice>,
    /// Answers to peers' liveness probes.
    pub answers: std::vec::Drain<'a, Answer>,
    /// The key to tag them under (none: version 2).
    pub key: Option<&'a juneau_control::model::RedirectKey>,
}

/// Most notices queued between two batches; more are not sent (the asker asks again
/// with its next packet, within its bucket).
pub const MAX_NOTICES: usize = 64;

/// The key of every worker's [`Redirector::cookie_for`] (random per process).
static COOKIE_KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
    std::sync::OnceLock::new();

/// Token buckets per client /24 (hashed with a per-process key into this many).
pub const PREFIX_BUCKETS: usize = 1024;

/// This node's redirect state.
#[derive(Debug, Clone)]
pub struct Redirector {
    cfg: RedirectConfig,
    bucket: TokenBucket,
    /// [`PREFIX_BUCKETS`] buckets, one per hash of a client /24.
    prefix_buckets: Vec<TokenBucket>,
    /// The same for notices received (so that answers never take the tokens of
    /// questions, nor a flood of notices those of questions).
    notice_bucket: TokenBucket,
    notice_prefix_buckets: Vec<TokenBucket>,
    /// Key of the /24 hash (random per process, so that no one can aim a flood at
    /// another prefix's bucket).
    prefix_key: std::collections::hash_map::RandomState,
    /// Per VIP (sorted by VIP): the nodes the agent published for it (each once), then
    /// the static `--redirect-peer` ones not among them, and each one's weight for new
    /// connections handed on (its Ready endpoints of the VIP; 0: none, or not published).
    vip_peers: Vec<(u32, Vec<u32>, Vec<u32>)>,
    /// The same for IPv6 VIPs.
    vip6_peers: Vec<([u8; 16], Vec<u32>, Vec<u32>)>,
    /// Peers the probes found unreachable (sorted; [`crate::peer_liveness`]).
    unreachable: Vec<u32>,
    /// What new connections and questions go to: `vip_peers`, `vip6_peers` and the
    /// static peers without the unreachable ones — a list whose every peer is
    /// unreachable kept whole (no better choice then).
    live: LivePeers,
    /// Every peer (static and published), sorted: redirected packets and notices are
    /// accepted from these.
    all_peers: Vec<u32>,
    /// Counters per peer node, sorted by address; peers that left the lists keep theirs.
    counters: Vec<(u32, PeerCounters)>,
    /// Set by the engine with [`crate::engine::Verdict::Redirect`].
    pub out: Option<RedirectOut>,
    notices: Vec<Notice>,
    /// Notices not queued because the queue was full.
    pub notices_dropped: u64,
    /// Answers to peers' probes to send (at most [`MAX_NOTICES`]).
    answers: Vec<Answer>,
    /// Answers received from peers (peer, nonce), for the node thread's
    /// [`crate::peer_liveness::PeerLiveness`] (at most [`MAX_NOTICES`]).
    answered: Vec<(u32, u64)>,
    /// The redirect channel's MAC keys published by the agent, the one to
    /// send with first; empty: no key, frames go out as wire version 2 and any frame
    /// from a peer is taken without a tag check.
    keys: Vec<juneau_control::model::RedirectKey>,
}

/// The peer lists without the unreachable peers ([`Redirector::set_unreachable`]).
#[derive(Debug, Clone, Default)]
struct LivePeers {
    vips: Vec<(u32, Vec<u32>, Vec<u32>)>,
    vips6: Vec<([u8; 16], Vec<u32>, Vec<u32>)>,
    statics: Vec<u32>,
}

/// `list` (with its weights) without the peers in `out` (sorted); the whole list when
/// that would leave no peer but this node (`me`).
fn without(out: &[u32], me: u32, list: &[u32], weights: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let keep = |p: &u32| out.binary_search(p).is_err();
    if !list.iter().any(|p| keep(p) && *p != me && *p != 0) {
        return (list.to_vec(), weights.to_vec());
    }
    let mut l = Vec::with_capacity(list.len());
    let mut w = Vec::with_capacity(weights.len());
    for (i, p) in list.iter().enumerate() {
        if keep(p) {
            l.push(*p);
            if let Some(x) = weights.get(i) {
                w.push(*x);
            }
        }
    }
    (l, w)
}

/// Every peer node a redirector with `cfg` has once `published` is in force (static
/// and published, without this node), sorted: the nodes whose next hops are kept
/// resolved ahead of the first redirect.
pub fn peers_of(cfg: &RedirectConfig, published: &juneau_control::model::Redirects) -> Vec<u32> {
    let mut r = Redirector::new(cfg.clone());
    r.set_from_state(published);
    r.all_peers
}

impl Redirector {
    /// A redirector for `cfg` (duplicate peers removed, order kept).
    pub fn new(mut cfg: RedirectConfig) -> Self {
        let mut seen = std::collections::HashSet::new();
        cfg.peers.retain(|p| *p != 0 && seen.insert(*p));
        if cfg.node_from_state {
            cfg.node = 0;
        }
        let mut r = Redirector {
            bucket: TokenBucket::new(cfg.rate_per_s, cfg.burst),
            prefix_buckets: vec![
                TokenBucket::new(cfg.prefix_rate_per_s, cfg.prefix_burst);
                PREFIX_BUCKETS
            ],
            notice_bucket: TokenBucket::new(cfg.rate_per_s, cfg.burst),
            notice_prefix_buckets: vec![
                TokenBucket::new(cfg.prefix_rate_per_s, cfg.prefix_burst);
                PREFIX_BUCKETS
            ],
            prefix_key: std::collections::hash_map::RandomState::new(),
            vip_peers: Vec::new(),
            vip6_peers: Vec::new(),
            unreachable: Vec::new(),
            live: LivePeers::default(),
            all_peers: Vec::new(),
            counters: Vec::new(),
            cfg,
            out: None,
            notices: Vec::with_capacity(MAX_NOTICES),
            notices_dropped: 0,
            answers: Vec::new(),
            answered: Vec::new(),
            keys: Vec::new(),
        };
        r.rebuild_peers();
        r
    }

    /// Takes what the node agent published: this node's address (when
    /// [`RedirectConfig::node_from_state`]; a state without one keeps the address in use)
    /// and the peers of each VIP, and the MAC keys. Called when a new service
    /// table is installed, never per packet.
    pub fn set_from_state(&mut self, published: &juneau_control::model::Redirects) {
        if self.keys != published.keys {
            self.keys = published.keys.clone();
        }
        if self.cfg.node_from_state {
            if let Some(a) = published.node_address {
                self.cfg.node = u32::from(a);
            }
        }
        self.vip_peers = published
            .vips
            .iter()
            .map(|v| {
                let (list, weights) = self.weighted_list(&v.nodes);
                (u32::from(v.vip), list, weights)
            })
            .collect();
        self.vip_peers.sort_by_key(|v| v.0);
        self.vip_peers.dedup_by_key(|v| v.0);
        self.vip6_peers = published
            .vips6
            .iter()
            .map(|v| {
                let (list, weights) = self.weighted_list(&v.nodes);
                (v.vip.octets(), list, weights)
            })
            .collect();
        self.vip6_peers.sort_by_key(|v| v.0);
        self.vip6_peers.dedup_by_key(|v| v.0);
        self.rebuild_peers();
    }

    /// A VIP's peers as the agent published them (each once) then the static ones not
    /// among them, and each one's weight: a node listed once may hold connections; each
    /// further listing is one Ready endpoint of the VIP there
    /// (`VipRedirectPeers::nodes`).
    fn weighted_list(&self, nodes: &[std::net::Ipv4Addr]) -> (Vec<u32>, Vec<u32>) {
        let (mut list, mut weights) = (Vec::<u32>::new(), Vec::<u32>::new());
        for a in nodes.iter().map(|a| u32::from(*a)).filter(|a| *a != 0) {
            match list.iter().position(|p| *p == a) {
                Some(i) => weights[i] += 1,
                None => {
                    list.push(a);
                    weights.push(0);
                }
            }
        }
        for p in &self.cfg.peers {
            if *p != 0 && !list.contains(p) {
                list.push(*p);
                weights.push(0);
            }
        }
        (list, weights)
    }

    /// Leaves `peers` out of hand-offs and questions (the probes found them unreachable;
    /// any order) until the next call; notices and redirected packets from them are still
    /// taken. Called when the set changes, never per packet.
    pub fn set_unreachable(&mut self, peers: &[u32]) {
        let mut out = peers.to_vec();
        out.sort_unstable();
        out.dedup();
        self.unreachable = out;
        self.rebuild_live();
    }

    /// The peers the probes found unreachable, sorted.
    pub fn unreachable(&self) -> &[u32] {
        &self.unreachable
    }

    fn rebuild_live(&mut self) {
        let (out, me) = (&self.unreachable, self.cfg.node);
        self.live = LivePeers {
            vips: self
                .vip_peers
                .iter()
                .map(|(v, l, w)| {
                    let (l, w) = without(out, me, l, w);
                    (*v, l, w)
                })
                .collect(),
            vips6: self
                .vip6_peers
                .iter()
                .map(|(v, l, w)| {
                    let (l, w) = without(out, me, l, w);
                    (*v, l, w)
                })
                .collect(),
            statics: without(out, me, &self.cfg.peers, &[]).0,
        };
    }

    /// Recomputes the union of peers and keeps a counter per peer (stale ones bounded).
    fn rebuild_peers(&mut self) {
        let me = self.cfg.node;
        let mut all: Vec<u32> = self
            .cfg
            .peers
            .iter()
            .chain(self.vip_peers.iter().flat_map(|v| v.1.iter()))
            .chain(self.vip6_peers.iter().flat_map(|v| v.1.iter()))
            .copied()
            .filter(|p| *p != 0 && *p != me)
            .collect();
        all.sort_unstable();
        all.dedup();
        let mut counters: Vec<(u32, PeerCounters)> = all
            .iter()
            .map(|p| (*p, self.counter_of(*p).unwrap_or_default()))
            .collect();
        let stale: Vec<(u32, PeerCounters)> = self
            .counters
            .iter()
            .filter(|(a, _)| all.binary_search(a).is_err())
            .take(MAX_STALE_PEER_COUNTERS)
            .copied()
            .collect();
        counters.extend(stale);
        counters.sort_unstable_by_key(|c| c.0);
        self.counters = counters;
        self.all_peers = all;
        self.rebuild_live();
    }

    fn counter_of(&self, addr: u32) -> Option<PeerCounters> {
        let i = self.counters.binary_search_by_key(&addr, |c| c.0).ok()?;
        Some(self.counters[i].1)
    }

    /// The settings.
    pub fn config(&self) -> &RedirectConfig {
        &self.cfg
    }

    /// This node's address.
    pub fn node(&self) -> u32 {
        self.cfg.node
    }

    /// The redirect port.
    pub fn port(&self) -> u16 {
        self.cfg.port
    }

    /// Whether redirects are active: this node's address is known (given, or published
    /// by the agent when taken from the state).
    pub fn active(&self) -> bool {
        self.cfg.node != 0
    }

    /// The MAC keys in force (the one to send with first); empty: none.
    pub fn keys(&self) -> &[juneau_control::model::RedirectKey] {
        &self.keys
    }

    /// The key frames are sent with (`current`), if any.
    pub fn send_key(&self) -> Option<&juneau_control::model::RedirectKey> {
        self.keys.first()
    }

    /// The static peers (`--redirect-peer`).
    pub fn peers(&self) -> &[u32] {
        &self.cfg.peers
    }

    /// The nodes asked about a flow to `vip`, in order: the ones the agent published for
    /// the VIP then the static ones; only the static ones for a VIP without a list. The
    /// unreachable ones left out ([`Self::set_unreachable`]).
    pub fn peers_for(&self, vip: u32) -> &[u32] {
        self.weighted_peers_for(vip).0
    }

    /// [`Self::peers_for`] with each peer's weight for new connections handed on (its
    /// Ready endpoints of the VIP as the agent published them); none (an empty slice)
    /// for the static peers of a VIP without a list, whose endpoints are not known.
    pub fn weighted_peers_for(&self, vip: u32) -> (&[u32], &[u32]) {
        match self.live.vips.binary_search_by_key(&vip, |v| v.0) {
            Ok(i) => (&self.live.vips[i].1, &self.live.vips[i].2),
            Err(_) => (&self.live.statics, &[]),
        }
    }

    /// Every peer of `vip`, reachable or not (whom notices are taken from and sent to).
    fn listed_peers_for(&self, vip: u32) -> &[u32] {
        match self.vip_peers.binary_search_by_key(&vip, |v| v.0) {
            Ok(i) => &self.vip_peers[i].1,
            Err(_) => &self.cfg.peers,
        }
    }

    /// Every peer node (static and published), sorted.
    pub fn all_peers(&self) -> &[u32] {
        &self.all_peers
    }

    /// Whether `addr` is a peer (notices and redirected packets are accepted only from
    /// peers: a static one, or one the agent published for any VIP).
    pub fn is_peer(&self, addr: u32) -> bool {
        addr != self.cfg.node && self.all_peers.binary_search(&addr).is_ok()
    }

    /// A peer's counters, mutable.
    pub fn peer_mut(&mut self, addr: u32) -> Option<&mut PeerCounters> {
        let i = self.counters.binary_search_by_key(&addr, |c| c.0).ok()?;
        self.counters.get_mut(i).map(|c| &mut c.1)
    }

    /// Every peer node with its counters (current peers and ones that left the lists),
    /// by address.
    pub fn peer_counters(&self) -> impl Iterator<Item = (u32, PeerCounters)> + '_ {
        self.counters.iter().copied()
    }

    /// Takes a token for a packet of an unknown flow from `client`: one of the
    /// client's /24 first, then one of the node's. `Err` names the bucket that was empty.
    pub fn take_token(&mut self, client: u32, now_ms: u64) -> Result<(), DropReason> {
        let i = self.prefix_of(client);
        Self::take_two(&mut self.prefix_buckets[i], &mut self.bucket, now_ms)
    }

    /// The same for a notice received about a flow of `client`, from the notice
    /// buckets (same rates).
    pub fn take_notice_token(&mut self, client: u32, now_ms: u64) -> Result<(), DropReason> {
        let i = self.prefix_of(client);
        Self::take_two(
            &mut self.notice_prefix_buckets[i],
            &mut self.notice_bucket,
            now_ms,
        )
    }

    fn prefix_of(&self, client: u32) -> usize {
        use std::hash::BuildHasher;
        self.prefix_key.hash_one(client >> 8) as usize % PREFIX_BUCKETS
    }

    fn take_two(
        prefix: &mut TokenBucket,
        node: &mut TokenBucket,
        now_ms: u64,
    ) -> Result<(), DropReason> {
        if !prefix.take(now_ms) {
            return Err(DropReason::RedirectPrefixRateLimited);
        }
        if !node.take(now_ms) {
            return Err(DropReason::RedirectRateLimited);
        }
        Ok(())
    }

    /// This node's cookie for a question about `key`: a keyed hash (SipHash-1-3 under a
    /// key random per process, shared by its workers) of this node's address and the
    /// flow; never 0. A notice is accepted only with the cookie of its flow.
    pub fn cookie_for(&self, key: &FlowKey) -> u64 {
        use std::hash::BuildHasher;
        let k = COOKIE_KEY.get_or_init(std::collections::hash_map::RandomState::new);
        k.hash_one((
            self.cfg.node,
            key.src,
            key.dst,
            key.src_port,
            key.dst_port,
            key.proto,
        ))
        .max(1)
    }

    /// [`Self::cookie_for`] for an IPv6 flow (the family hashed in: no IPv4 flow's
    /// cookie is an IPv6 flow's).
    pub fn cookie_for6(&self, key: &Flow6Key) -> u64 {
        use std::hash::BuildHasher;
        let k = COOKIE_KEY.get_or_init(std::collections::hash_map::RandomState::new);
        k.hash_one((
            6u8,
            self.cfg.node,
            key.src,
            key.dst,
            key.src_port,
            key.dst_port,
            key.proto,
        ))
        .max(1)
    }

    /// [`Self::take_token`] for an IPv6 client: the bucket of its /64 (hashed with the
    /// same per-process key into the same [`PREFIX_BUCKETS`]), then the node's.
    pub fn take_token6(&mut self, client: &[u8; 16], now_ms: u64) -> Result<(), DropReason> {
        let i = self.prefix6_of(client);
        Self::take_two(&mut self.prefix_buckets[i], &mut self.bucket, now_ms)
    }

    /// [`Self::take_notice_token`] for an IPv6 client (its /64).
    pub fn take_notice_token6(&mut self, client: &[u8; 16], now_ms: u64) -> Result<(), DropReason> {
        let i = self.prefix6_of(client);
        Self::take_two(
            &mut self.notice_prefix_buckets[i],
            &mut self.notice_bucket,
            now_ms,
        )
    }

    fn prefix6_of(&self, client: &[u8; 16]) -> usize {
        use std::hash::BuildHasher;
        let mut p = [0u8; 9];
        p[..8].copy_from_slice(&client[..8]);
        p[8] = 6; // never an IPv4 /24's input
        self.prefix_key.hash_one(p) as usize % PREFIX_BUCKETS
    }

    /// The nodes asked about a flow to the IPv6 VIP `vip`: the ones the agent published
    /// for it then the static ones; only the static ones for a VIP without a list.
    pub fn peers_for6(&self, vip: &[u8; 16]) -> &[u32] {
        self.weighted_peers_for6(vip).0
    }

    /// [`Self::weighted_peers_for`] for an IPv6 VIP.
    pub fn weighted_peers_for6(&self, vip: &[u8; 16]) -> (&[u32], &[u32]) {
        match self.live.vips6.binary_search_by_key(vip, |v| v.0) {
            Ok(i) => (&self.live.vips6[i].1, &self.live.vips6[i].2),
            Err(_) => (&self.live.statics, &[]),
        }
    }

    /// [`Self::is_peer_of`] for an IPv6 VIP.
    pub fn is_peer_of6(&self, vip: &[u8; 16], addr: u32) -> bool {
        let listed = match self.vip6_peers.binary_search_by_key(vip, |v| v.0) {
            Ok(i) => &self.vip6_peers[i].1,
            Err(_) => &self.cfg.peers,
        };
        addr != 0 && addr != self.cfg.node && listed.contains(&addr)
    }

    /// Whether `addr` is one of the nodes listed for flows to `vip`, reachable or not (a
    /// notice about such a flow is accepted only from one, and sent only to one).
    pub fn is_peer_of(&self, vip: u32, addr: u32) -> bool {
        addr != 0 && addr != self.cfg.node && self.listed_peers_for(vip).contains(&addr)
    }

    /// Queues a notice; `false` if the queue is full.
    pub fn queue_notice(&mut self, n: Notice) -> bool {
        if self.notices.len() >= MAX_NOTICES {
            self.notices_dropped += 1;
            return false;
        }
        if let Some(c) = self.peer_mut(n.to) {
            c.notices_sent += 1;
        }
        self.notices.push(n);
        true
    }

    /// Queues the answer to a probe from `a.to`; `false` (counted as a dropped notice)
    /// if the queue is full.
    pub fn queue_answer(&mut self, a: Answer) -> bool {
        if self.answers.len() >= MAX_NOTICES {
            self.notices_dropped += 1;
            return false;
        }
        if let Some(c) = self.peer_mut(a.to) {
            c.probes_received += 1;
        }
        self.answers.push(a);
        true
    }

    /// Records an answer `from` a peer to one of this node's probes (beyond
    /// [`MAX_NOTICES`] between two takes: dropped, the next probe asks again).
    pub fn answer_received(&mut self, from: u32, nonce: u64) {
        if let Some(c) = self.peer_mut(from) {
            c.probe_answers_received += 1;
        }
        if self.answered.len() < MAX_NOTICES {
            self.answered.push((from, nonce));
        }
    }

    /// Takes the answers received since the last take.
    pub fn take_answered(&mut self) -> std::vec::Drain<'_, (u32, u64)> {
        self.answered.drain(..)
    }

    /// Takes the queued notices (after a batch).
    pub fn take_notices(&mut self) -> std::vec::Drain<'_, Notice> {
        self.notices.drain(..)
    }

    /// Takes what is queued to send — notices, answers to probes — with the key to tag
    /// them under (none: version 2).
    pub fn take_outgoing(&mut self) -> Outgoing<'_> {
        Outgoing {
            notices: self.notices.drain(..),
            answers: self.answers.drain(..),
            key: self.keys.first(),
        }
    }

    /// Takes the queued answers to peers' probes.
    pub fn take_answers(&mut self) -> std::vec::Drain<'_, Answer> {
        self.answers.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    #[test]
    fn unreachable_peers_are_left_out_of_choices_not_out_of_the_peers() {
        use juneau_control::model::{Redirects, VipRedirectPeers};
        let ip = |d: u8| std::net::Ipv4Addr::new(192, 0, 2, d);
        let a = |d: u8| u32::from(ip(d));
        let vip = std::net::Ipv4Addr::new(203, 0, 113, 1);
        let mut r = Redirector::new(RedirectConfig {
            node: a(11),
            port: 7411,
            peers: vec![a(20), a(21)],
            rate_per_s: 100,
            burst: 10,
            prefix_rate_per_s: 100,
            prefix_burst: 10,
            node_from_state: false,
        });
        let published = Redirects {
            vips: vec![VipRedirectPeers {
                vip,
                // Node 12: one Ready endpoint; node 13: two.
                nodes: vec![ip(12), ip(13), ip(12), ip(13), ip(13)],
            }],
            ..Redirects::default()
        };
        r.set_from_state(&published);
        let v = u32::from(vip);
        let all = (&[a(12), a(13), a(20), a(21)][..], &[1, 2, 0, 0][..]);
        assert_eq!(r.weighted_peers_for(v), all);
        r.set_unreachable(&[a(20), a(13)]);
        assert_eq!(r.weighted_peers_for(v), (&[a(12), a(21)][..], &[1, 0][..]));
        assert_eq!(
            r.peers_for(0),
            &[a(21)][..],
            "a VIP without a list: the static peers"
        );
        assert!(
            r.is_peer_of(v, a(13)) && r.is_peer(a(13)),
            "its notices still taken"
        );
        // A new table keeps the set.
        r.set_from_state(&published);
        assert_eq!(r.peers_for(v), &[a(12), a(21)][..]);
        // Every peer of a list unreachable: no better choice, the whole list.
        r.set_unreachable(&[a(21), a(20), a(13), a(12)]);
        assert_eq!(r.weighted_peers_for(v), all);
        assert_eq!(r.peers_for(0), &[a(20), a(21)][..]);
        r.set_unreachable(&[]);
        assert_eq!(r.weighted_peers_for(v), all);
    }

    #[test]
    fn the_peers_kept_resolved_are_the_static_and_published_ones_without_this_node() {
        use juneau_control::model::{Redirects, VipRedirectPeers};
        let ip = |d: u8| std::net::Ipv4Addr::new(192, 0, 2, d);
        let cfg = RedirectConfig {
            node: 0,
            port: 7411,
            peers: vec![u32::from(ip(20)), u32::from(ip(11))],
            rate_per_s: 100,
            burst: 10,
            prefix_rate_per_s: 100,
            prefix_burst: 10,
            node_from_state: true,
        };
        let published = Redirects {
            node_address: Some(ip(11)),
            vips: vec![
                VipRedirectPeers {
                    vip: std::net::Ipv4Addr::new(203, 0, 113, 1),
                    nodes: vec![ip(13), ip(12)],
                },
                VipRedirectPeers {
                    vip: std::net::Ipv4Addr::new(203, 0, 113, 2),
                    nodes: vec![ip(12)],
                },
            ],
            vips6: Vec::new(),
            keys: Vec::new(),
        };
        let want: Vec<u32> = [12, 13, 20].map(|d| u32::from(ip(d))).to_vec();
        assert_eq!(peers_of(&cfg, &published), want);
        // Without a published address yet, nothing is this node: every listed peer.
        let none = Redirects {
            node_address: None,
            ..published.clone()
        };
        assert_eq!(peers_of(&cfg, &none).len(), 4);
        assert!(peers_of(&cfg, &Redirects::default()).len() == 2);
    }

    #[test]
    fn an_ipv6_vips_peers_are_the_published_ones_then_the_static_ones() {
        use juneau_control::model::{Redirects, VipRedirectPeers6};
        let ip = |d: u8| std::net::Ipv4Addr::new(192, 0, 2, d);
        let vip: std::net::Ipv6Addr = "2001:db8:71::10".parse().unwrap();
        let mut r = Redirector::new(RedirectConfig {
            node: u32::from(ip(1)),
            port: 7411,
            peers: vec![u32::from(ip(20))],
            rate_per_s: 100,
            burst: 10,
            prefix_rate_per_s: 100,
            prefix_burst: 10,
            node_from_state: false,
        });
        assert_eq!(r.peers_for6(&vip.octets()), [u32::from(ip(20))]);
        r.set_from_state(&Redirects {
            vips6: vec![VipRedirectPeers6 {
                vip,
                // Node .3 has two Ready endpoints (listed thrice), .2 none.
                nodes: vec![ip(2), ip(3), ip(3), ip(3)],
            }],
            ..Redirects::default()
        });
        let (peers, weights) = r.weighted_peers_for6(&vip.octets());
        assert_eq!(peers, [2, 3, 20].map(|d| u32::from(ip(d))));
        assert_eq!(weights, [0, 2, 0]);
        assert!(r.is_peer_of6(&vip.octets(), u32::from(ip(3))));
        assert!(r.is_peer(u32::from(ip(3))), "redirects accepted from it");
        // The IPv4 VIPs' lists are apart: an IPv4 VIP without one has the static peers.
        assert_eq!(r.peers_for(0xcb00_710a), [u32::from(ip(20))]);
        // The family is in the cookie: an IPv6 flow's never answers an IPv4 question.
        let k6 = crate::flow6::Flow6Key {
            src: [0; 16],
            dst: vip.octets(),
            src_port: 1,
            dst_port: 80,
            proto: 6,
        };
        let k4 = FlowKey {
            src: 0,
            dst: 0,
            src_port: 1,
            dst_port: 80,
            proto: 6,
        };
        assert_ne!(r.cookie_for6(&k6), r.cookie_for(&k4));
    }

    #[test]
    fn hop_list_is_bounded_and_deduplicated() {
        let mut h = HopList::new();
        for i in 1..=MAX_HOPS as u32 {
            assert!(h.push(i));
        }
        assert!(h.push(3), "already there: no-op");
        assert!(!h.push(99), "full");
        assert_eq!(h.len(), MAX_HOPS);
        assert_eq!(h.origin(), Some(1));
        assert!(HopList::from_slice(&[0; MAX_HOPS + 1]).is_none());
    }

    #[test]
    fn next_hop_skips_self_and_visited_and_ends() {
        let peers = [1, 2, 3];
        let mut h = HopList::new();
        h.push(2);
        let a = next_hop(&peers, 2, &h, 0).unwrap();
        assert_ne!(a, 2);
        h.push(a);
        let b = next_hop(&peers, a, &h, 0).unwrap();
        assert!(b != 2 && b != a);
        h.push(b);
        assert_eq!(next_hop(&peers, b, &h, 0), None);
        assert_eq!(next_hop(&[], 1, &HopList::new(), 0), None);
    }

    /// Weighted rendezvous: each peer's share of new flows follows its weight (its Ready
    /// endpoints), a peer without any gets none while a weighted one is left, and a peer
    /// leaving moves only its own flows.
    #[test]
    fn new_flows_go_to_peers_by_their_ready_endpoints() {
        let peers = [11, 12, 13, 14];
        let weights = [2, 1, 0, 1];
        let me = 99;
        let n = 40_000u64;
        let mut got = std::collections::BTreeMap::new();
        let pick = |peers: &[u32], weights: &[u32], h: u64| {
            let mut visited = HopList::new();
            visited.push(me);
            next_hop_weighted((peers, weights), me, &visited, h).unwrap()
        };
        for i in 0..n {
            let h = i.wrapping_mul(0x2545_f491_4f6c_dd1d);
            *got.entry(pick(&peers, &weights, h)).or_insert(0u64) += 1;
        }
        let share = |p| got.get(&p).copied().unwrap_or(0) as f64 / n as f64;
        assert!((share(11) - 0.5).abs() < 0.02, "{got:?}");
        assert!((share(12) - 0.25).abs() < 0.02, "{got:?}");
        assert!((share(14) - 0.25).abs() < 0.02, "{got:?}");
        assert_eq!(share(13), 0.0, "a peer without Ready endpoints: {got:?}");
        // Peer 12 leaves: flows that went elsewhere stay where they went.
        let (fewer, fewer_w) = ([11, 13, 14], [2, 0, 1]);
        for i in 0..2_000u64 {
            let h = i.wrapping_mul(0x2545_f491_4f6c_dd1d);
            let before = pick(&peers, &weights, h);
            if before != 12 {
                assert_eq!(pick(&fewer, &fewer_w, h), before, "flow {i} moved");
            }
        }
        // Visited and weighted-less: the next weighted one, then the plain order.
        let mut visited = HopList::new();
        visited.push(me);
        visited.push(11);
        visited.push(12);
        visited.push(14);
        assert_eq!(
            next_hop_weighted((&peers, &weights), me, &visited, 7),
            Some(13)
        );
        assert_eq!(
            next_hop_weighted((&peers, &[0; 4]), me, &HopList::new(), 5),
            next_hop(&peers, me, &HopList::new(), 5)
        );
        assert_eq!(next_hop_weighted((&[], &[]), me, &HopList::new(), 5), None);
    }

    /// A node the agent lists k + 1 times has k Ready endpoints: listed once per VIP in
    /// the peers, weighed k; the static peers weigh nothing.
    #[test]
    fn published_repeats_are_weights() {
        use juneau_control::model::{Redirects, VipRedirectPeers};
        let ip = |d: u8| std::net::Ipv4Addr::new(192, 168, 0, d);
        let cfg = RedirectConfig {
            node: u32::from(ip(11)),
            port: 7411,
            peers: vec![u32::from(ip(20))],
            rate_per_s: 100,
            burst: 10,
            prefix_rate_per_s: 100,
            prefix_burst: 10,
            node_from_state: false,
        };
        let mut r = Redirector::new(cfg);
        let vip = std::net::Ipv4Addr::new(203, 0, 113, 1);
        r.set_from_state(&Redirects {
            node_address: None,
            vips: vec![VipRedirectPeers {
                vip,
                nodes: vec![ip(12), ip(12), ip(12), ip(13), ip(14), ip(14)],
            }],
            vips6: Vec::new(),
            keys: Vec::new(),
        });
        let (peers, weights) = r.weighted_peers_for(u32::from(vip));
        let want: Vec<u32> = [12, 13, 14, 20].map(|d| u32::from(ip(d))).to_vec();
        assert_eq!((peers, weights), (&want[..], &[2, 0, 1, 0][..]));
        let other = r.weighted_peers_for(1);
        assert_eq!(other, (&[u32::from(ip(20))][..], &[][..]));
        assert_eq!(r.all_peers().len(), 4);
    }

    #[test]
    fn the_bucket_allows_a_burst_then_the_rate() {
        let mut b = TokenBucket::new(100, 10);
        let t0 = 1_000_000;
        assert_eq!((0..50).filter(|_| b.take(t0)).count(), 10, "the burst");
        assert!(!b.take(t0 + 5), "half a token after 5 ms");
        assert!(b.take(t0 + 10), "one token per 10 ms");
        assert_eq!((0..1000).filter(|i| b.take(t0 + 10 + i)).count(), 99);
        assert_eq!(
            (0..50).filter(|_| b.take(t0 + 60_000)).count(),
            10,
            "never more than the burst after a long pause"
        );
        assert!(!b.take(t0), "a clock that goes back gives nothing");
    }

    #[test]
    fn bucket_refills_at_its_rate_and_caps_at_burst() {
        let mut b = TokenBucket::new(100, 10);
        let mut got = 0;
        for _ in 0..50 {
            got += u32::from(b.take(0));
        }
        assert_eq!(got, 10, "burst");
        assert!(!b.take(5), "0.5 token after 5 ms");
        assert!(b.take(10), "1 token after 10 ms");
        // A long quiet spell saves at most the burst.
        let mut got = 0;
        for _ in 0..50 {
            got += u32::from(b.take(100_000));
        }
        assert_eq!(got, 10);
        // A clock going backwards never mints tokens.
        assert!(!b.take(50_000));
    }

    /// A node in the model: the flows it owns, its redirect records (flow → owner, with
    /// expiry), its peer list (nodes may disagree about it) and its bucket.
    struct Node {
        addr: u32,
        owned: HashSet<u32>,
        records: HashMap<u32, (u32, u64)>,
        peers: Vec<u32>,
        bucket: TokenBucket,
        sent: u64,
    }

    const IDLE_MS: u64 = 10_000;

    /// Delivers a packet of `flow` arriving from the router at node `at`, following the
    /// same rules as the engine: owned → served; a live record → straight to its owner
    /// (uncharged, no question); else ask the peers in turn, each charging its bucket,
    /// never revisiting. Returns (served at, nodes visited in order).
    fn deliver(nodes: &mut [Node], at: usize, flow: u32, now: u64) -> (Option<usize>, Vec<u32>) {
        let idx = |nodes: &[Node], a: u32| nodes.iter().position(|n| n.addr == a);
        let mut hops = HopList::new();
        let mut cur = at;
        let mut path = vec![nodes[cur].addr];
        let mut asked = false;
        loop {
            let me = nodes[cur].addr;
            if nodes[cur].owned.contains(&flow) {
                if asked {
                    let origin = hops.origin().unwrap();
                    if let Some(o) = idx(nodes, origin) {
                        nodes[o].records.insert(flow, (me, now + IDLE_MS));
                    }
                }
                return (Some(cur), path);
            }
            hops.push(me);
            let rec = nodes[cur].records.get(&flow).copied();
            let next = match rec {
                Some((owner, exp)) if exp > now && !hops.contains(owner) => {
                    nodes[cur].records.insert(flow, (owner, now + IDLE_MS));
                    Some(owner)
                }
                _ => {
                    if rec.is_some_and(|(_, exp)| exp <= now) {
                        nodes[cur].records.remove(&flow);
                    }
                    if !nodes[cur].bucket.take(now) {
                        return (None, path);
                    }
                    asked = asked || cur == at;
                    next_hop(&nodes[cur].peers, me, &hops, u64::from(flow))
                }
            };
            let Some(next) = next else {
                return (None, path);
            };
            nodes[cur].sent += 1;
            let Some(n) = idx(nodes, next) else {
                return (None, path);
            };
            assert!(!path.contains(&next), "loop: {path:?} -> {next}");
            path.push(next);
            cur = n;
        }
    }

    proptest! {
        /// Random clusters (2..8 nodes, possibly disagreeing peer lists), random flow
        /// owners, random arrival nodes over virtual time: a packet never visits a node
        /// twice, visits at most MAX_HOPS nodes, reaches its owner whenever the owner is
        /// in every asked node's peer list and tokens last, and a redirect record is used
        /// only until it expires.
        #[test]
        fn no_loop_bounded_and_reaches_the_owner(
            n in 2usize..8,
            owners in prop::collection::vec(0usize..8, 1..20),
            arrivals in prop::collection::vec((0usize..8, 0usize..20, 0u64..30_000), 1..200),
            drop_peer in prop::option::of((0usize..8, 0usize..8)),
        ) {
            let mut nodes: Vec<Node> = (0..n).map(|i| Node {
                addr: 100 + i as u32,
                owned: HashSet::new(),
                records: HashMap::new(),
                peers: (0..n).map(|j| 100 + j as u32).collect(),
                bucket: TokenBucket::new(1_000_000, 1_000_000),
                sent: 0,
            }).collect();
            for (f, o) in owners.iter().enumerate() {
                nodes[o % n].owned.insert(f as u32);
            }
            // One node may miss one peer in its list (a stale view).
            let mut partial = None;
            if let Some((a, b)) = drop_peer {
                let (a, b) = (a % n, b % n);
                let gone = nodes[b].addr;
                nodes[a].peers.retain(|p| *p != gone);
                partial = Some((a, gone));
            }
            let mut arrivals = arrivals;
            arrivals.sort_by_key(|a| a.2);
            for (at, f, now) in arrivals {
                let at = at % n;
                let f = (f % owners.len()) as u32;
                let (served, path) = deliver(&mut nodes, at, f, now);
                let uniq: HashSet<_> = path.iter().collect();
                prop_assert_eq!(uniq.len(), path.len(), "a node visited twice");
                prop_assert!(path.len() <= MAX_HOPS.min(n));
                let owner = owners[f as usize] % n;
                let stale_view = partial.is_some_and(|(a, gone)| gone == nodes[owner].addr && path.iter().any(|p| *p == nodes[a].addr));
                if !stale_view {
                    prop_assert_eq!(served, Some(owner), "path {:?}", path);
                }
                if let Some(s) = served {
                    prop_assert_eq!(s, owner, "served by a node that does not own the flow");
                }
            }
            // Expiry in virtual time: every record is gone for good after the idle time.
            let late = 1_000_000;
            for node in nodes.iter_mut() {
                node.records.retain(|_, (_, exp)| *exp > late);
                prop_assert!(node.records.is_empty());
            }
        }

        /// A flood of packets of unknown flows costs at most the bucket between nodes:
        /// each arrival sends at most (nodes - 1) redirects, and each node sends at most
        /// burst + rate × time of them.
        #[test]
        fn unknown_floods_are_bounded_by_the_bucket(
            n in 2usize..6,
            count in 1usize..3000,
            span_ms in 1u64..5000,
        ) {
            let (rate, burst) = (200u32, 20u32);
            let mut nodes: Vec<Node> = (0..n).map(|i| Node {
                addr: 100 + i as u32,
                owned: HashSet::new(),
                records: HashMap::new(),
                peers: (0..n).map(|j| 100 + j as u32).collect(),
                bucket: TokenBucket::new(rate, burst),
                sent: 0,
            }).collect();
            for i in 0..count {
                let now = span_ms * i as u64 / count as u64;
                let (served, _) = deliver(&mut nodes, i % n, 1_000_000 + i as u32, now);
                prop_assert_eq!(served, None);
            }
            for node in &nodes {
                let bound = u64::from(burst) + u64::from(rate) * span_ms / 1000 + 1;
                prop_assert!(node.sent <= bound, "{} > {}", node.sent, bound);
            }
        }
    }
}
