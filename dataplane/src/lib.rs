//! # juneau-dataplane — the node's AF_XDP load-balancing dataplane
//!
//! Owns: the XDP steering program, the AF_XDP sockets and UMEM, packet parsing, the flow
//! table, DNAT / reverse NAT with incremental checksums, and the dataplane's counters.
//! Reads the node's service table from `juneau_control::shm`; never writes it.
//!
//! Must not touch: Kubernetes, BGP, or any lock or allocation on the packet path.
//!
//! Layers, from pure to I/O:
//! - [`abi`]: what the steering program and Rust share (constants, struct sizes), the
//!   one definition `build.rs` makes the program's header from;
//! - [`proto`]: protocol numbers and TCP flags (a leaf both below use);
//! - [`packet`]: views over frame bytes and in-place NAT rewrites (RFC 1624 checksums);
//!   [`packet6`] the same for IPv6 (extension headers, ICMPv6 errors);
//! - [`flow`]: the fixed-capacity flow table, shared with the XDP program and pinned
//!   ([`region`]: its heap or mmapped-BPF-map memory, the only `unsafe` around it);
//! - [`flow6`]: the IPv6 flow table (process memory; its keys mirrored into a pinned
//!   BPF map for the steering program); [`occupied`]: which of a table's records hold
//!   a flow, so that their sweep skips the free ones;
//! - [`admission`]: the new-flow admission per source prefix (buckets userspace debits
//!   and the steering program reads);
//! - [`frag`]: IPv4 fragments following their datagram's first fragment (bounded);
//! - [`services`], [`services6`], [`neigh`]: read-only tables the packet path consults;
//! - [`affinity`]: `sessionAffinity: ClientIP`, which backend a client's new
//!   connections keep;
//! - [`engine`]: frame + ingress side → verdict, no I/O (IPv6 in `engine6.rs`);
//! - [`segment`]: packets larger than their egress takes, cut into TCP segments or
//!   IPv4 fragments that fit;
//! - [`fast`]: the XDP program's established-flow fast path, as the engine publishes it;
//! - [`redirect`], [`redirect_wire`]: second-chance redirects between nodes;
//!   [`peer_liveness`]: which redirect peers still answer (probes, virtual time);
//! - [`counters`]: drop reasons, per-service counters, the JSON stats;
//! - [`sched`]: the forwarding workers' `SCHED_FIFO` policy (why: its module doc);
//! - [`metrics`]: `/metrics` (`prometheus-client`), `/healthz`, `/readyz`, off the packet path.
#![warn(missing_docs)]

pub mod abi;
pub mod admission;
pub mod affinity;
pub mod busy_poll;
pub mod counters;
pub mod engine;
pub mod fast;
pub mod flow;
pub mod flow6;
pub mod frag;
pub mod frames;
pub mod host_network;
pub mod icmp;
pub mod metrics;
pub mod neigh;
pub mod netlink;
pub mod occupied;
pub mod packet;
pub mod packet6;
pub mod peer_liveness;
pub mod privileges;
pub mod proto;
pub mod redirect;
pub mod redirect_wire;
pub mod region;
pub mod runtime;
pub mod sched;
pub mod segment;
pub mod services;
pub mod services6;
pub mod steering;

pub use steering::{Flow6MapKey, Flows6};
