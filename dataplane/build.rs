//! Compiles the XDP steering program (`bpf/steer.c`) with clang into `OUT_DIR/steer.o`,
//! which `src/bpf.rs` embeds. Needs `clang` and `libbpf-dev` (see
//! `tests/setup/apt-packages.txt`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("steer.o");
    let src = "bpf/steer.c";
    println!("cargo:rerun-if-changed={src}");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let status = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-I/usr/include/x86_64-linux-gnu", "-c", src, "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {clang} to build {src} failed ({e}); install clang and libbpf-dev (tests/setup.sh)"));
    assert!(
        status.success(),
        "{clang} failed to compile {src}; install clang and libbpf-dev (tests/setup.sh)"
    );
}
