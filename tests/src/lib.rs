//! # juneau-tests — the end-to-end test harness
//!
//! Owns: helpers that build real test environments — network namespaces and veth pairs
//! ([`netns`]), long-running processes ([`daemon`]), the one BIRD 2 router ([`bird`]), a
//! real etcd + kube-apiserver + controller-manager + scheduler ([`kube`]), real nodes
//! with their own containerd and kubelet ([`node`]) running locally built images
//! ([`images`]: the one docker-archive writer, also of the `juneau` image that deploy/
//! runs — the `juneau-image` binary, `deploy/image/build.sh`), the lab built from all of
//! these ([`lab`], the `juneau-lab` binary) with Juneau installed by its Helm chart
//! ([`install`]), an
//! HTTP load client ([`load`]), test backends on threads in Pod namespaces with a raw HTTP
//! client ([`http`]), hand-made frames injected by AF_PACKET ([`frames`]), a real
//! Prometheus scraping Juneau's processes ([`prometheus`]) — and the cross-crate
//! end-to-end tests in `tests/tests/`.
//!
//! Must not touch: product logic. Everything here starts, wires and inspects the real
//! binaries; nothing here stands in for them. Everything cleans up on drop, also on
//! panic: processes, namespaces, mounts, cgroups, containerd state.

pub mod bird;
pub mod daemon;
pub mod frames;
pub mod http;
pub mod images;
pub mod install;
pub mod kube;
pub mod lab;
pub mod load;
pub mod netns;
pub mod node;
pub mod prometheus;
