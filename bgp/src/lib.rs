//! # juneau-bgp — a standalone BGP-4 speaker that only announces
//!
//! Owns: the wire codec wrapper, the sans-IO session FSM, the per-peer sessions and the
//! speaker's status. Reads what to announce and to whom from `juneau_control::shm`.
//!
//! Must not touch: Kubernetes, the dataplane (it only *reads* the dataplane's status file,
//! [`gate`]), or the kernel's routing table (routes received from peers are discarded,
//! never installed).

//!
//! Modules: [`wire`] (the codec over netgauze-bgp-pkt), [`fsm`] (the sans-IO RFC 4271
//! state machine), [`rib`] (what each peer should have, as UPDATE diffs), [`speaker`]
//! (the tokio daemon), [`gate`] (announce only what a live dataplane has programmed),
//! [`family`] (address families offered and negotiated: IPv4 and IPv6 unicast),
//! [`next_hop`] (the node's IPv6 next hop on a session's link),
//! [`status`] (status file and metrics), [`sockopt`] (TCP-MD5, TTL),
//! [`bfd`] (the sans-IO RFC 5880 session), [`bfd_io`] (BFD over UDP, RFC 5881/5883) and
//! [`maintenance`] (graceful shutdown before a withdrawal, RFC 8326), [`decommission_watch`]
//! (waiting for the uninstall's decommission request), [`daemon`] (a node daemon's start
//! and end: logging, the succession lock, the runtime).

#![warn(missing_docs)]

pub mod bfd;
pub mod bfd_io;
pub mod daemon;
pub mod decommission_watch;
pub mod family;
pub mod fsm;
pub mod gate;
pub mod maintenance;
pub mod next_hop;
pub mod rib;
pub mod sockopt;
pub mod speaker;
pub mod status;
pub mod wire;
