//! # juneau-k8s-sync — Juneau's face to Kubernetes
//!
//! Owns: the CRD types, the leader-elected cluster controller (VIP allocation,
//! ServiceLoadBalancer, statuses, Events), the per-node agent that publishes the node's
//! state into `juneau_control::shm`, and the `kubectl-juneau` plugin.
//!
//! Must not touch: packets or BGP sessions; decisions (IPAM, advertisement, Maglev) are
//! made by `juneau_control`, this crate only feeds and reports them.
//!
//! Layout: pure decisions with unit tests ([`reconcile`], [`node_state`], [`vips`],
//! [`pools`], [`endpoints`], [`families`]: which IP families a Service is served on, [`selection`]: which advertisements apply to a Service's VIP, [`source_ranges`]: the clients a Service admits, [`sharing`]: which Services share a VIP, [`describe`], [`report`], [`peers`], [`pacing`], [`fence`]: when a
//! leader may still write, [`status_patch`]: status writes as merge patches, [`event_budget`]: which Events are written, [`departures`]: which Services a watch shows deleted, [`maintenance`]: what puts a node in graceful maintenance, [`redirect_key`]: the redirect channel's MAC keys from their
//! Secret) and thin glue that watches and writes ([`controller`], [`agent`],
//! [`records`]: how a ServiceLoadBalancer is written, [`speaker_status`]: the node's BGP
//! sessions into a NodeBGPStatus; [`decommission`]:
//! `helm uninstall`'s request, the hook that makes it and the agents that carry it out,
//! its pure decisions unit-tested); [`metrics`] serves both processes' Prometheus metrics
//! and probes; [`caches`]: the one watch pipeline both processes' caches use. [`crd`]
//! holds the resource types; `crdgen` prints them.
#![warn(missing_docs)]

pub mod agent;
pub mod caches;
pub mod controller;
pub mod crd;
pub mod decommission;
pub mod departures;
pub mod describe;
pub mod endpoints;
pub mod event_budget;
pub mod families;
pub mod fence;
pub mod maintenance;
pub mod metrics;
pub mod node_state;
pub mod pacing;
pub mod peers;
pub mod pools;
pub mod reconcile;
pub mod records;
pub mod redirect_key;
pub mod report;
pub mod selection;
pub mod sharing;
pub mod source_ranges;
pub mod speaker_status;
pub mod status_patch;
pub mod vips;

/// Everything that can go wrong while talking to Kubernetes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a request.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A patch could not be built.
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A watch cache did not fill in time.
    #[error("{0} are not loaded yet")]
    NotReady(&'static str),
    /// This replica may not write: it no longer holds the leader Lease.
    #[error("write fenced: {0}")]
    Fenced(String),
    /// A write was refused because the object changed since the watch cache read it.
    #[error("stale read: {0}")]
    Stale(String),
}
