//! The dataplane's counters: one per drop reason, one set per service, and the I/O
//! layer's own; exported as the JSON stats file and (through [`crate::metrics`], with
//! `prometheus-client`) as Prometheus metrics.
//!
//! Counters are plain `u64`s owned by the single forwarding thread (no atomics on the
//! packet path); the thread publishes a copy ([`Stats`]) about once a second.

use serde::Serialize;

/// Why the dataplane dropped a frame. Every variant has its own counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum DropReason {
    /// The frame failed to parse (truncated, bad lengths, bad version).
    Malformed,
    /// An IPv4 fragment that cannot be followed: a first fragment too short to hold its
    /// transport header (RFC 1858), or one of another protocol than TCP/UDP.
    Fragment,
    /// An IPv4 header with options to a VIP or from a backend: not forwarded.
    IpOptions,
    /// Neither TCP nor UDP (e.g. ICMP or SCTP to a VIP).
    UnsupportedProtocol,
    /// TCP/UDP to a VIP on a port/protocol the Service does not expose.
    PortNotExposed,
    /// The frontend has no local Ready backend.
    NoBackend,
    /// The flow's backend was removed from the Service; the flow is dropped, never moved.
    BackendRemoved,
    /// A reply from a backend port with no flow (expired, or never seen).
    NoFlow,
    /// Two flows would share the same reverse key (same client ip:port to the same
    /// backend ip:port through two frontends).
    FlowConflict,
    /// The flow table is full of live flows.
    FlowTableFull,
    /// A new flow (or a redirect record) for a client whose address or /24 already
    /// holds its quota of flows (`--source-flow-quota`, `--prefix-flow-quota`).
    SourceOverQuota,
    /// No route out of the dataplane's interfaces for the next hop.
    NoRoute,
    /// The next hop's MAC is not known yet (resolution was triggered).
    NoNeighbour,
    /// The frame should have gone to the kernel (TTL expiry, not for us, a host-network
    /// backend's frontend) but reached userspace; AF_XDP cannot hand it back, so it is dropped. The steering program
    /// passes these to the kernel itself, so this stays at zero in normal operation.
    KernelBound,
    /// The egress TX ring was full.
    TxRingFull,
    /// The backend's Pod interface is routed but has no AF_XDP socket yet (just
    /// appeared, or attaching it failed and is being retried).
    PodIfaceNotAttached,
    /// A TCP segment to a VIP that is not a SYN and belongs to no flow (a spoofed ACK,
    /// or a connection this node never saw): never sent to a Pod, never creates a flow.
    NonSynWithoutFlow,
    /// A packet of an unknown flow not redirected to another node: the redirect token
    /// bucket was empty (`--redirect-rate`, `--redirect-burst`).
    RedirectRateLimited,
    /// A packet of an unknown flow with no node left to ask (every peer visited or the
    /// hop budget spent, or no peer configured): the last node drops it.
    RedirectNoPeer,
    /// A packet from a client the Service's `loadBalancerSourceRanges` do not admit (in
    /// the steering program for packets of no held flow; in userspace for a held flow
    /// whose client new ranges leave out, which ends it).
    SourceRangeDenied,
    /// A redirect frame with a bad header.
    RedirectMalformed,
    /// A redirect frame or notice from an address that is not a peer node.
    RedirectNotFromPeer,
    /// A packet of an unknown flow not redirected: the bucket of its client's /24 was
    /// empty (`--redirect-prefix-rate`, `--redirect-prefix-burst`).
    RedirectPrefixRateLimited,
    /// A notice refused: its sender is not a peer of the flow's VIP, or it answers no
    /// question of this node's (its cookie does not match).
    RedirectNoticeRefused,
    /// A redirect frame or notice refused while a redirect key is in force:
    /// no tag (wire version 2), a key id this node does not hold, or a tag that no key
    /// in force gives (forged, altered, or under a retired or foreign key).
    RedirectBadMac,
    /// A redirected packet to a VIP/port this node does not serve.
    RedirectNotServed,
    /// The encapsulated packet would exceed the node network's MTU or the frame.
    RedirectTooBig,
    /// Larger than the egress interface takes and not cut to fit: a non-TCP packet with
    /// DF set (or one already fragmented), a multi-buffer packet larger than the
    /// dataplane's reassembly buffer, or one whose verdict cannot carry several frames.
    TooBig,
    /// A packet being cut into segments or fragments found no free UMEM frame for a
    /// piece (the pieces written so far leave; TCP retransmits the rest).
    NoFreeFrame,
    /// The kernel dropped a frame on an AF_XDP socket: no free UMEM frame in the fill
    /// ring, or a packet longer than the socket can take (kernel `rx_dropped`).
    SocketRxDropped,
    /// The kernel dropped a frame because the socket's RX ring was full (kernel
    /// `rx_ring_full`).
    SocketRxRingFull,
    /// The kernel refused a descriptor on a TX ring (kernel `tx_invalid_descs`).
    SocketTxInvalid,
    /// A later IPv4 fragment held for its datagram's first fragment, which did not come
    /// in time (or newer datagrams evicted it from the bounded fragment table).
    FragmentExpired,
    /// A later IPv4 fragment not held: the bytes held for its datagram or for all
    /// datagrams are at their limit.
    FragmentHeldFull,
    /// A packet of no flow to an exposed VIP:port beyond its source prefix's new-flow
    /// admission (`--new-flow-prefix-rate`, [`crate::admission`]): dropped by the
    /// steering program before it reached userspace, or by a worker for the few already
    /// queued when the bucket emptied.
    NewFlowPrefixRateLimited,
    /// A packet for userspace while no AF_XDP socket was registered on its queue (the
    /// dataplane restarting or handing over to its successor): dropped by the steering
    /// program, counted in its pinned map across the restart.
    NoSocket,
    /// IPv6 to a VIP whose extension headers the dataplane does not walk past (ESP, a
    /// routing header with segments left, a misplaced Hop-by-Hop header, a chain longer
    /// than `packet6::MAX_EXTENSION_HEADERS`, any other next header).
    Ipv6ExtensionHeader,
    /// A new IPv6 flow whose keys the steering program's `flows6` map refused (its
    /// replies would have reached the kernel un-NATed): not created.
    FlowNotPublished,
    /// A packet of a flow restored from the pinned maps, before the (re)started process
    /// has read the node state: the flow is kept for when it comes, the packet dropped.
    NoServiceTable,
}

impl DropReason {
    /// Every reason, in counter order.
    pub const ALL: [DropReason; 39] = [
        DropReason::Malformed,
        DropReason::Fragment,
        DropReason::IpOptions,
        DropReason::UnsupportedProtocol,
        DropReason::PortNotExposed,
        DropReason::NoBackend,
        DropReason::BackendRemoved,
        DropReason::NoFlow,
        DropReason::FlowConflict,
        DropReason::FlowTableFull,
        DropReason::SourceOverQuota,
        DropReason::NoRoute,
        DropReason::NoNeighbour,
        DropReason::KernelBound,
        DropReason::TxRingFull,
        DropReason::PodIfaceNotAttached,
        DropReason::NonSynWithoutFlow,
        DropReason::RedirectRateLimited,
        DropReason::RedirectNoPeer,
        DropReason::SourceRangeDenied,
        DropReason::RedirectMalformed,
        DropReason::RedirectNotFromPeer,
        DropReason::RedirectNotServed,
        DropReason::RedirectTooBig,
        DropReason::RedirectPrefixRateLimited,
        DropReason::RedirectNoticeRefused,
        DropReason::RedirectBadMac,
        DropReason::TooBig,
        DropReason::NoFreeFrame,
        DropReason::SocketRxDropped,
        DropReason::SocketRxRingFull,
        DropReason::SocketTxInvalid,
        DropReason::FragmentExpired,
        DropReason::FragmentHeldFull,
        DropReason::NewFlowPrefixRateLimited,
        DropReason::NoSocket,
        DropReason::Ipv6ExtensionHeader,
        DropReason::FlowNotPublished,
        DropReason::NoServiceTable,
    ];

    /// The label used in metrics and the stats file.
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::Fragment => "fragment",
            DropReason::IpOptions => "ip_options",
            DropReason::UnsupportedProtocol => "unsupported_protocol",
            DropReason::PortNotExposed => "port_not_exposed",
            DropReason::NoBackend => "no_backend",
            DropReason::BackendRemoved => "backend_removed",
            DropReason::NoFlow => "no_flow",
            DropReason::FlowConflict => "flow_conflict",
            DropReason::FlowTableFull => "flow_table_full",
            DropReason::SourceOverQuota => "source_over_quota",
            DropReason::NoRoute => "no_route",
            DropReason::NoNeighbour => "no_neighbour",
            DropReason::KernelBound => "kernel_bound",
            DropReason::TxRingFull => "tx_ring_full",
            DropReason::PodIfaceNotAttached => "pod_iface_not_attached",
            DropReason::NonSynWithoutFlow => "non_syn_without_flow",
            DropReason::RedirectRateLimited => "redirect_rate_limited",
            DropReason::RedirectNoPeer => "redirect_no_peer",
            DropReason::SourceRangeDenied => "source_range_denied",
            DropReason::RedirectMalformed => "redirect_malformed",
            DropReason::RedirectNotFromPeer => "redirect_not_from_peer",
            DropReason::RedirectNotServed => "redirect_not_served",
            DropReason::RedirectTooBig => "redirect_too_big",
            DropReason::RedirectPrefixRateLimited => "redirect_prefix_rate_limited",
            DropReason::RedirectNoticeRefused => "redirect_notice_refused",
            DropReason::RedirectBadMac => "redirect_bad_mac",
            DropReason::TooBig => "too_big",
            DropReason::NoFreeFrame => "no_free_frame",
            DropReason::SocketRxDropped => "socket_rx_dropped",
            DropReason::SocketRxRingFull => "socket_rx_ring_full",
            DropReason::SocketTxInvalid => "socket_tx_invalid",
            DropReason::FragmentExpired => "fragment_expired",
            DropReason::FragmentHeldFull => "fragment_held_full",
            DropReason::NewFlowPrefixRateLimited => "new_flow_prefix_rate_limited",
            DropReason::NoSocket => "no_socket",
            DropReason::Ipv6ExtensionHeader => "ipv6_extension_header",
            DropReason::FlowNotPublished => "flow_not_published",
            DropReason::NoServiceTable => "no_service_table",
        }
    }
}

/// Per-service counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ServiceCounters {
    /// Client -> backend packets forwarded.
    pub packets_in: u64,
    /// Client -> backend bytes forwarded (Ethernet frame lengths).
    pub bytes_in: u64,
    /// Backend -> client packets forwarded.
    pub packets_out: u64,
    /// Backend -> client bytes forwarded.
    pub bytes_out: u64,
    /// Flows created.
    pub new_flows: u64,
    /// Packets dropped for this service (no backend, backend removed, ...).
    pub drops: u64,
}

impl ServiceCounters {
    /// Counts a frame of `len` bytes forwarded toward the backend (`to_backend`) or
    /// toward the client.
    #[inline]
    pub fn forwarded(&mut self, to_backend: bool, len: usize) {
        if to_backend {
            self.packets_in += 1;
            self.bytes_in += len as u64;
        } else {
            self.packets_out += 1;
            self.bytes_out += len as u64;
        }
    }
}

/// The counters the forwarding thread keeps.
#[derive(Debug, Clone)]
pub struct Counters {
    /// Indexed by `DropReason as usize`.
    pub drops: [u64; DropReason::ALL.len()],
    /// Frames received from AF_XDP sockets.
    pub rx_packets: u64,
    /// Frames sent.
    pub tx_packets: u64,
    /// Frames that were not for userspace (see [`DropReason::KernelBound`]).
    pub kernel_bound: u64,
    /// Flows found in the pinned flow table at start.
    pub flows_restored: u64,
    /// Packets the steering program forwarded itself (XDP fast path), as folded so far;
    /// they are in the per-service counters too, not in `rx_packets` / `tx_packets`.
    pub xdp_fast_packets: u64,
    /// Of `xdp_fast_packets`, the backends' replies.
    pub xdp_fast_replies: u64,
    /// Packets larger than their egress takes (a Pod's TSO/GSO super-segment, a GRO'd
    /// segment) cut into TCP segments or IPv4 fragments.
    pub segmented: u64,
    /// Frames those packets became.
    pub segments: u64,
    /// ICMP "fragmentation needed" sent for packets dropped as too big with DF set.
    pub icmp_frag_needed_sent: u64,
    /// Such errors not sent: over the per-worker rate.
    pub icmp_frag_needed_limited: u64,
    /// Indexed like the current service table.
    pub services: Vec<ServiceCounters>,
}

// By hand: `Default` of arrays stops at 32 elements, and there are more drop reasons.
impl Default for Counters {
    fn default() -> Self {
        Counters {
            drops: [0; DropReason::ALL.len()],
            rx_packets: 0,
            tx_packets: 0,
            kernel_bound: 0,
            flows_restored: 0,
            xdp_fast_packets: 0,
            xdp_fast_replies: 0,
            segmented: 0,
            segments: 0,
            icmp_frag_needed_sent: 0,
            icmp_frag_needed_limited: 0,
            services: Vec::new(),
        }
    }
}

impl Counters {
    /// Counts a drop.
    #[inline]
    pub fn drop(&mut self, r: DropReason) {
        self.drops[r as usize] += 1;
    }

    /// The count for one reason.
    pub fn drops_for(&self, r: DropReason) -> u64 {
        self.drops[r as usize]
    }
}

/// One service's counters with its frontend, for export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceStats {
    /// `VIP`.
    pub vip: String,
    /// `TCP` / `UDP`.
    pub protocol: String,
    /// The Service port.
    pub port: u16,
    /// Local Ready backends now (the ones new flows go to).
    pub backends: usize,
    /// Local draining backends now (`serving` but `terminating`: existing flows only).
    pub draining_backends: usize,
    /// Counters (carried over across service-table updates, by frontend).
    #[serde(flatten)]
    pub counters: ServiceCounters,
}

/// Upper bounds (µs) of the loop-gap histogram's buckets; a last bucket holds the rest.
pub const LOOP_GAP_BOUNDS_US: [u64; 8] = [10, 50, 100, 500, 1_000, 5_000, 10_000, 100_000];

/// How long a forwarding worker's loop went between two iterations beyond its own idle
/// sleep (processing a batch, preemption, a slow syscall): the most a packet arriving
/// meanwhile waited before the loop looked at its ring. Cumulative since start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GapHistogram {
    /// Observations per bucket (not cumulative): `LOOP_GAP_BOUNDS_US`, then the rest.
    pub buckets: [u64; 9],
    /// Sum of the observed gaps, µs.
    pub sum_us: u64,
    /// Number of observations.
    pub count: u64,
}

impl GapHistogram {
    /// Records one gap.
    pub fn observe(&mut self, us: u64) {
        let i = LOOP_GAP_BOUNDS_US.partition_point(|&b| b < us);
        self.buckets[i] += 1;
        self.sum_us += us;
        self.count += 1;
    }

    /// Adds another worker's observations.
    pub fn add(&mut self, other: &GapHistogram) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.sum_us += other.sum_us;
        self.count += other.count;
    }
}

/// Everything exported, as written to the stats file (JSON) and served as metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Seconds since the UNIX epoch when this was taken.
    pub timestamp: u64,
    /// Generation of the shared state in force.
    pub generation: u64,
    /// Frames received from the AF_XDP sockets.
    pub rx_packets: u64,
    /// Frames transmitted.
    pub tx_packets: u64,
    /// Packets the steering program forwarded itself (XDP fast path).
    pub xdp_fast_packets: u64,
    /// Of `xdp_fast_packets`, the backends' replies.
    #[serde(default)]
    pub xdp_fast_replies: u64,
    /// IPv4 datagrams whose fragments are being followed (first fragment decided, or
    /// early fragments held).
    #[serde(default)]
    pub fragment_datagrams: u64,
    /// Packets larger than their egress takes, cut into segments or fragments.
    #[serde(default)]
    pub segmented: u64,
    /// Frames those packets became.
    #[serde(default)]
    pub segments: u64,
    /// ICMP "fragmentation needed" sent for oversized packets with DF set (each one is
    /// also a `too_big` drop).
    #[serde(default)]
    pub icmp_frag_needed_sent: u64,
    /// Such errors not sent because the worker's rate limit was reached.
    #[serde(default)]
    pub icmp_frag_needed_limited: u64,
    /// Frames received per AF_XDP socket (`interface/queue`).
    pub rx_packets_per_socket: std::collections::BTreeMap<String, u64>,
    /// Per served interface, what its kernel counted as dropped on receive
    /// (`/sys/class/net/<iface>/statistics/rx_dropped`, since the interface was created):
    /// frames lost before the steering program ran (a full receive queue), which no
    /// reason of `drops` can count.
    #[serde(default)]
    pub interface_rx_dropped: std::collections::BTreeMap<String, u64>,
    /// Drops by reason (every reason present, zero or not).
    pub drops: std::collections::BTreeMap<String, u64>,
    /// Flows held now.
    pub flows: u64,
    /// Flow table capacity.
    pub flow_capacity: u64,
    /// IPv6 flows held now (one table shared by the workers).
    pub flows6: u64,
    /// IPv6 flow table capacity.
    pub flow6_capacity: u64,
    /// Bytes of memory per flow slot (records + index + free list).
    pub flow_table_bytes: u64,
    /// Half-open TCP flows held now (SYN seen, handshake not completed).
    pub half_open_flows: u64,
    /// Most half-open TCP flows held at once (`--half-open-max`).
    pub half_open_max: u64,
    /// Half-open flows evicted (oldest first) to make room for newer ones.
    pub half_open_evicted: u64,
    /// UDP flows and redirect records evicted (least recently seen first) to make room
    /// in a full table.
    pub idle_evicted: u64,
    /// Flows found in the pinned flow table at start (kept across the restart).
    pub flows_restored: u64,
    /// Per service.
    pub services: Vec<ServiceStats>,
    /// Kernel AF_XDP socket statistics, summed over sockets.
    pub xsk_rx_dropped: u64,
    /// Kernel: frames lost to a full RX ring.
    pub xsk_rx_ring_full: u64,
    /// Kernel: times the fill ring was empty.
    pub xsk_fill_ring_empty: u64,
    /// Neighbour entries known.
    pub neighbours: u64,
    /// Resolution requests sent to the kernel.
    pub neighbour_requests: u64,
    /// Service tables held back until their new backends' or peers' next hops were
    /// resolved (docs/dataplane.md, "Neighbours and routes").
    pub tables_held: u64,
    /// Held tables replaced by a newer one before they went in (the newer one keeps
    /// waiting for what the held one still waited for).
    pub held_tables_replaced: u64,
    /// Held tables installed with a next hop still unresolved after the longest hold.
    pub held_tables_timed_out: u64,
    /// UMEM frames in total.
    pub umem_frames: u64,
    /// UMEM frames in userspace, ready for fill rings.
    pub umem_frames_free: u64,
    /// UMEM frames the kernel holds through live sockets (fill/RX and TX/completion).
    pub umem_frames_in_kernel: u64,
    /// UMEM frames taken back from closed sockets, in total.
    pub umem_frames_reclaimed: u64,
    /// Pod interfaces discovered through the routing table and attached now.
    pub pod_ifaces: Vec<String>,
    /// Discovered Pod interfaces attached, in total.
    pub pod_iface_attaches: u64,
    /// Discovered Pod interfaces detached, in total.
    pub pod_iface_detaches: u64,
    /// Redirects between nodes, per peer node (empty when redirects are off).
    pub redirect_peers: Vec<RedirectPeerStats>,
    /// Owner notices and answers to probes not sent because the per-batch queue was full.
    pub redirect_notices_dropped: u64,
    /// Per forwarding worker (one per RX queue group; docs/dataplane.md, "More than one
    /// worker"): its packets and rates. The totals above are their sums.
    pub workers: Vec<WorkerStats>,
    /// Packets whose flow was found in another worker's table (a connection's two
    /// directions arrived on queues of different workers).
    pub cross_worker_lookups: u64,
    /// Gaps between loop iterations of every worker (latency the loop adds).
    pub loop_gap: GapHistogram,
}

/// One forwarding worker's share of the traffic.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WorkerStats {
    /// Worker number (it serves the RX queues `q` with `q % workers == worker`).
    pub worker: u32,
    /// Packets received on its sockets.
    pub rx_packets: u64,
    /// Packets it transmitted.
    pub tx_packets: u64,
    /// Flows in its table (it created them).
    pub flows: u64,
    /// Packets of its flows the steering program forwarded itself (XDP fast path).
    pub xdp_fast_packets: u64,
    /// Packets received per second over the last interval.
    pub rx_pps: u64,
    /// Packets transmitted per second over the last interval.
    pub tx_pps: u64,
}

/// Counters of one peer node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PeerCounters {
    /// Packets this node redirected to the peer.
    pub redirected_to: u64,
    /// Redirected packets received from the peer (then served here or passed on).
    pub received_from: u64,
    /// "I own this flow" notices sent to the peer.
    pub notices_sent: u64,
    /// Notices received from the peer (redirect records made or refreshed).
    pub notices_received: u64,
    /// Liveness probes sent to the peer (the node thread, every 100 ms).
    pub probes_sent: u64,
    /// Probes received from the peer (each answered).
    pub probes_received: u64,
    /// Answers to this node's probes received from the peer.
    pub probe_answers_received: u64,
}

/// One peer node's redirect counters, for export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RedirectPeerStats {
    /// The peer's address on the node network.
    pub peer: String,
    /// The counters.
    #[serde(flatten)]
    pub counters: PeerCounters,
    /// What the probes tell of it: `true` it answers, `false` it answered once and
    /// then stopped (left out of hand-offs and questions), `null` it never answered
    /// (a candidate; e.g. a node older than probes).
    pub reachable: Option<bool>,
}

impl Stats {
    /// The total of every drop reason.
    pub fn total_drops(&self) -> u64 {
        self.drops.values().sum()
    }
}

#[cfg(test)]
mod gap_tests {
    use super::*;

    #[test]
    fn gaps_land_in_their_buckets_and_add_up() {
        let mut h = GapHistogram::default();
        for us in [0, 10, 11, 100, 150_000] {
            h.observe(us);
        }
        assert_eq!(h.buckets, [2, 1, 1, 0, 0, 0, 0, 0, 1]);
        assert_eq!((h.count, h.sum_us), (5, 150_121));
        let mut t = h.clone();
        t.add(&h);
        assert_eq!(t.buckets[0], 4);
        assert_eq!(t.count, 10);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_reasons_have_distinct_names_and_sum() {
        let mut st = Stats::default();
        for r in DropReason::ALL {
            st.drops.insert(r.name().into(), r as u64);
        }
        st.services.push(ServiceStats {
            vip: "203.0.113.10".into(),
            protocol: "TCP".into(),
            port: 80,
            backends: 2,
            draining_backends: 1,
            counters: ServiceCounters {
                packets_in: 5,
                new_flows: 1,
                ..Default::default()
            },
        });
        assert_eq!(
            st.total_drops(),
            (0..DropReason::ALL.len() as u64).sum::<u64>()
        );
        let names: std::collections::HashSet<_> =
            DropReason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), DropReason::ALL.len());
    }
}
