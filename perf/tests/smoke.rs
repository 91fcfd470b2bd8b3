//! CI test of the benchmark harness: `juneau-perf smoke` (very short durations, one run
//! per scenario) must run every scenario end to end — including the real juneau-dataplane
//! fed by a real NodeStateWriter — and write the report, the plots and the cost figures,
//! then leave no namespace behind; Ctrl-C in the middle must clean up too.
//!
//! No assertion is about speed (shared noisy machine): only that each part delivered
//! packets and produced its output. Needs root, iproute2, nftables, ethtool, valgrind,
//! python3-matplotlib (tests/setup/apt-packages.txt); a missing one fails the test with
//! the harness's own list of what is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PERF: &str = env!("CARGO_BIN_EXE_juneau-perf");

/// Builds juneau-dataplane's binary (same profile as this test) and returns its path.
fn dataplane_binary() -> PathBuf {
    let dir = Path::new(PERF).parent().expect("bin dir");
    let release = dir.ends_with("release");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args([
        "build",
        "-p",
        "juneau-dataplane",
        "--bin",
        "juneau-dataplane",
    ]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .status()
        .expect("running cargo to build juneau-dataplane");
    assert!(
        status.success(),
        "building juneau-dataplane failed: {status}"
    );
    let p = dir.join("juneau-dataplane");
    assert!(
        p.exists(),
        "juneau-dataplane not at {} after building it",
        p.display()
    );
    p
}

fn netns_with_prefix(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(String::from)
        .collect()
}

fn prefix_of(pid: u32) -> String {
    format!("jprf{}", pid % 100_000)
}

fn is_png(p: &Path) -> bool {
    std::fs::read(p)
        .map(|b| b.len() > 1000 && b.starts_with(b"\x89PNG\r\n\x1a\n"))
        .unwrap_or(false)
}

#[test]
fn smoke_runs_every_scenario_and_writes_the_report() {
    let dp = dataplane_binary();
    let out = std::env::temp_dir().join(format!("juneau-perf-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let child = Command::new(PERF)
        .args(["smoke", "--out"])
        .arg(&out)
        .arg("--dataplane")
        .arg(&dp)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting juneau-perf smoke");
    let pid = child.id();
    let res = child.wait_with_output().expect("waiting for juneau-perf");
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(
        res.status.success(),
        "juneau-perf smoke failed ({}):\n{stderr}",
        res.status
    );
    assert!(
        stderr.contains("expected duration"),
        "no duration estimate up front:\n{stderr}"
    );
    assert!(
        netns_with_prefix(&prefix_of(pid)).is_empty(),
        "namespaces left behind: {:?}",
        netns_with_prefix(&prefix_of(pid))
    );

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).expect("report.json"))
            .expect("report.json parses");
    let scenarios = report["scenarios"].as_array().expect("scenarios");
    for name in [
        "kernel-forward",
        "nft-dnat",
        "xdp-dnat",
        "afxdp-l2fwd",
        "juneau",
    ] {
        let s = scenarios
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("scenario {name} missing from report: {report:#}"));
        let runs = s["runs_pps"].as_array().expect("runs_pps");
        assert!(!runs.is_empty(), "{name}: no runs");
        assert!(
            s["median_pps"].as_f64().unwrap() > 0.0,
            "{name}: nothing delivered"
        );
    }
    for r in [
        "juneau_vs_nft_dnat",
        "juneau_vs_xdp_dnat",
        "juneau_vs_afxdp_l2fwd",
    ] {
        assert!(
            report["ratios"][r].as_f64().is_some(),
            "ratio {r} missing: {:#}",
            report["ratios"]
        );
    }
    let scale = report["flow_scale"].as_array().expect("flow_scale");
    assert!(scale.len() >= 2, "flow scale points: {scale:?}");
    let lat = report["latency"].as_array().expect("latency");
    for sc in ["nft-dnat", "juneau"] {
        let p = lat
            .iter()
            .find(|l| l["scenario"] == sc)
            .unwrap_or_else(|| panic!("no latency point for {sc}"));
        assert!(p["received"].as_u64().unwrap() > 0, "{sc}: no echo replies");
        assert!(p["p99_us"].as_f64().unwrap() >= p["p50_us"].as_f64().unwrap());
    }
    let cost = &report["cost"];
    for k in [
        "established_instructions_per_packet",
        "new_flow_instructions_per_packet",
    ] {
        assert!(
            cost[k].as_f64().unwrap_or(0.0) > 0.0,
            "cost {k} not measured: {cost:#}"
        );
    }
    let md = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    assert!(
        md.contains("| juneau |") && md.contains("juneau / nft-dnat"),
        "report.md:\n{md}"
    );
    for png in ["throughput.png", "flow_scale.png", "latency.png"] {
        assert!(is_png(&out.join(png)), "{png} missing or not a PNG");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn ctrl_c_removes_the_namespaces() {
    let out = std::env::temp_dir().join(format!("juneau-perf-int-{}", std::process::id()));
    let mut child = Command::new(PERF)
        .args(["smoke", "--no-cost", "--scenarios", "nft-dnat", "--out"])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting juneau-perf smoke");
    let prefix = prefix_of(child.id());
    let start = Instant::now();
    while netns_with_prefix(&prefix).is_empty() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "juneau-perf exited before building its topology"
        );
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no namespace {prefix}* appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: sending SIGINT to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "juneau-perf did not stop after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "an interrupted run must not report success"
    );
    assert!(
        netns_with_prefix(&prefix).is_empty(),
        "namespaces left behind after Ctrl-C: {:?}",
        netns_with_prefix(&prefix)
    );
    let _ = std::fs::remove_dir_all(&out);
}
