//! Compiles the C XDP programs in `bpf/` with clang into OUT_DIR, where `src/bpf.rs`
//! embeds them. A missing clang or libbpf-dev fails the build with the package to install.

use std::path::PathBuf;
use std::process::Command;

const PROGRAMS: &[&str] = &["pass", "xdp_dnat", "xsk_steer", "gen"];

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=bpf/common.h");
    for name in PROGRAMS {
        let src = format!("bpf/{name}.c");
        println!("cargo:rerun-if-changed={src}");
        let obj = out.join(format!("{name}.o"));
        let status = Command::new("clang")
            .args(["-O2", "-g", "-target", "bpf", "-I/usr/include/x86_64-linux-gnu", "-c", &src, "-o"])
            .arg(&obj)
            .status()
            .unwrap_or_else(|e| {
                panic!("juneau-perf needs clang to build its XDP programs ({e}): apt-get install clang llvm libbpf-dev")
            });
        assert!(
            status.success(),
            "clang failed on {src}; is libbpf-dev installed (bpf/bpf_helpers.h)? apt-get install libbpf-dev"
        );
    }
}
