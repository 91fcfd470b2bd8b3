//! # juneau-perf — the benchmark harness
//!
//! Owns: the benchmark topology, traffic generator, the backend's UDP application, baselines (kernel forwarding,
//! nftables DNAT, in-kernel XDP DNAT, raw AF_XDP forwarder), the TCP bulk download and
//! new TCP connections (juneau against nftables DNAT), the control-plane
//! convergence measurement (real apiserver, k8s-sync, juneau-bgp, BIRD) and the reports.
//!
//! Must not touch: product code paths other than by running the real binaries.
#![warn(missing_docs)]

pub mod bpf;
pub mod bulk;
pub mod bulk_data;
pub mod calibrate;
pub mod connect;
pub mod convergence;
pub mod convergence_data;
pub mod cost;
pub mod cpu;
pub mod flood;
pub mod gen;
pub mod harness;
pub mod latency;
pub mod livegen;
pub mod loopcost;
pub mod loopcost_data;
pub mod packet;
pub mod plan;
pub mod prereq;
pub mod profile;
pub mod report;
pub mod report_data;
pub mod results;
pub mod scale;
pub mod scale_data;
pub mod sink;
pub mod suite;
pub mod targets;
pub mod topology;
pub mod xsk;
