//! # juneau-k8s-sync — Juneau's face to Kubernetes
//!
//! Owns: the CRD types, the leader-elected cluster controller (VIP allocation,
//! ServiceLoadBalancer, statuses, Events), the per-node agent that publishes the node's
//! state into `juneau_control::shm`, and the `kubectl-juneau` plugin.
//!
//! Must not touch: packets or BGP sessions; decisions (IPAM, advertisement, Maglev) are
//! made by `juneau_control`, this crate only feeds and reports them.
