//! # juneau-tests — the end-to-end test harness
//!
//! Owns: helpers that build real test environments — network namespaces and veth pairs
//! ([`netns`]), real BGP daemons, a real etcd + kube-apiserver — and the cross-crate
//! end-to-end tests in `tests/tests/`.
//!
//! Must not touch: product logic. Everything here starts, wires and inspects the real
//! binaries; nothing here stands in for them.

pub mod kube;
pub mod netns;
