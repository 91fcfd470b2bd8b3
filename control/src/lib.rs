//! # juneau-control — the meeting point of every Juneau process
//!
//! Owns: the domain model operators think in ([`model`]: Vip, Frontend, Backend, node
//! service tables, BGP peer settings), the pure decisions made on it ([`ipam`] VIP
//! allocation, [`advertise`] which nodes announce a VIP, [`maglev`] backend choice for new
//! flows) and the shared-memory ABI ([`shm`]) through which the node agent publishes a
//! node's [`model::NodeState`] to the dataplane and the BGP speaker.
//!
//! Must not touch: the network, Kubernetes, clocks other than the heartbeat stamp, threads,
//! or any I/O other than the shared-memory file. Everything here is deterministic and
//! unit-testable; the processes around it are thin glue.
#![warn(missing_docs)]

pub mod advertise;
pub mod ipam;
pub mod maglev;
pub mod model;
pub mod shm;

pub use model::*;
