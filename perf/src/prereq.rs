//! What `juneau-perf` needs on the machine. It never installs anything: it lists what is
//! missing with the Debian package (or build step) that provides it, and stops.

use std::path::Path;
use std::process::Command;

/// The interpreter that has Debian's matplotlib.
pub const PYTHON: &str = "/usr/bin/python3";

/// One missing prerequisite.
#[derive(Debug, Clone)]
pub struct Missing {
    /// What is missing.
    pub what: String,
    /// How to get it.
    pub fix: String,
}

fn has_cmd(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Checks everything a run needs. `dataplane` is checked only when the juneau scenario
/// runs; `callgrind` only when the cost measurement runs.
pub fn check(dataplane: Option<&Path>, callgrind: bool) -> Vec<Missing> {
    let mut m = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        m.push(Missing {
            what: "root (namespaces, XDP, AF_XDP)".into(),
            fix: "run as root".into(),
        });
    }
    for (cmd, pkg) in [
        ("ip", "iproute2"),
        ("nft", "nftables"),
        ("ethtool", "ethtool"),
        ("taskset", "util-linux"),
        ("chrt", "util-linux"),
        ("sysctl", "procps"),
    ] {
        if !has_cmd(cmd) {
            m.push(Missing {
                what: format!("`{cmd}`"),
                fix: format!("apt-get install {pkg}"),
            });
        }
    }
    let mpl = Command::new(PYTHON)
        .args(["-c", "import matplotlib"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !mpl {
        m.push(Missing {
            what: format!("{} with matplotlib (for the PNG plots)", PYTHON),
            fix: "apt-get install python3-matplotlib".into(),
        });
    }
    if callgrind && !has_cmd("valgrind") {
        m.push(Missing {
            what: "`valgrind` (callgrind instruction counts)".into(),
            fix: "apt-get install valgrind".into(),
        });
    }
    if let Some(dp) = dataplane {
        if !dp.exists() {
            m.push(Missing {
                what: format!("the juneau-dataplane binary at {}", dp.display()),
                fix: "cargo build --release -p juneau-dataplane (or pass --dataplane PATH)".into(),
            });
        }
    }
    m
}

/// A one-line description of the machine.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_string())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| format!("{:.0} GiB", kb as f64 / 1024.0 / 1024.0))
        .unwrap_or_default();
    format!("{cpu}, {n} vCPU, {mem}, Linux {kernel}")
}

/// The first three fields of /proc/loadavg.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
