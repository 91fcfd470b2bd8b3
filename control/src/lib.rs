//! # juneau-control — the meeting point of every Juneau process
//!
//! Owns: the domain model operators think in ([`model`]: Vip, Frontend, Backend, node
//! service tables, BGP peer settings), the pure decisions made on it ([`ipam`] VIP
//! allocation, [`advertise`] which nodes announce a VIP, [`maglev`] backend choice for new
//! flows) and the shared-memory ABI ([`shm`]) through which the node agent publishes a
//! node's [`model::NodeState`] to the dataplane and the BGP speaker, and the small
//! [`dataplane_status`] file through which the dataplane tells the BGP speaker it is alive
//! and which VIPs it has programmed, and [`secret::Secret`], the type every password or
//! key is held in so it never shows in logs, `Debug` output or serialized status, and
//! [`decommission`]: how the agent asks the node's components to undo what they did on
//! the node (`helm uninstall`), how they acknowledge, and which files are the node's, and
//! [`succession`]: the lock through which a node component's new process (an upgrade's
//! surge Pod) waits for the one it replaces, and [`node_dir`]: the group and modes of the
//! directory those files live in.
//!
//! Must not touch: the network, Kubernetes, clocks other than the heartbeat stamps, threads,
//! or any I/O other than the shared-memory file, the decommission files, the locks and
//! the node directory's ownership. Everything here is deterministic and
//! unit-testable; the processes around it are thin glue.
#![warn(missing_docs)]

pub mod advertise;
pub mod dataplane_status;
pub mod decommission;
pub mod ipam;
pub mod maglev;
pub mod mapped;
pub mod model;
pub mod node_dir;
pub mod secret;
pub mod shm;
pub mod succession;

pub use model::*;
