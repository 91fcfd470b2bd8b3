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

/// Records that the test `name` did not run, and why (the machine cannot run it: not a
/// pass). Printed at once and appended to `$JUNEAU_DID_NOT_RUN` (default
/// `/tmp/juneau-tests-did-not-run.txt`), which `tests/run-all` lists at the end of the
/// run under "did not run" — never counted among the tests that passed.
pub fn did_not_run(name: &str, why: &str) {
    let line = format!("{name}: {why}");
    eprintln!("DID NOT RUN {line}");
    let path = std::env::var_os("JUNEAU_DID_NOT_RUN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/tmp/juneau-tests-did-not-run.txt".into());
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes()));
    if let Err(e) = appended {
        eprintln!("(could not record it in {}: {e})", path.display());
    }
}

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

/// The checkout this harness works on: `JUNEAU_REPO` (which `lab/lab` sets), else the
/// one cargo runs it from (`CARGO_MANIFEST_DIR` at run time: `cargo test`, `cargo run`),
/// else the one it was compiled in. Not the compile-time path first: with a shared
/// `CARGO_TARGET_DIR`, cargo reuses a binary built in another checkout of the same
/// sources, whose baked-in path may no longer exist (a CI checkout, a worktree).
pub fn repo_root() -> std::path::PathBuf {
    use std::path::{Path, PathBuf};
    if let Some(r) = std::env::var_os("JUNEAU_REPO") {
        return PathBuf::from(r);
    }
    let tests_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .filter(|d| d.join("src/lab.rs").exists())
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    tests_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}
