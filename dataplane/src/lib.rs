//! # juneau-dataplane — the node's AF_XDP load-balancing dataplane
//!
//! Owns: the XDP steering program, the AF_XDP sockets and UMEM, packet parsing, the flow
//! table, DNAT / reverse NAT with incremental checksums, and the dataplane's counters.
//! Reads the node's service table from `juneau_control::shm`; never writes it.
//!
//! Must not touch: Kubernetes, BGP, or any lock or allocation on the packet path.
