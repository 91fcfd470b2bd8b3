//! CI test of the benchmark harness: `juneau-perf smoke` (very short durations, one run
//! per scenario) must run every scenario end to end — including the real juneau-dataplane
//! fed by a real NodeStateWriter — and write the report, the plots and the cost figures,
//! measure control-plane convergence (3 repetitions against a real kube-apiserver, the
//! real juneau-k8s-sync and juneau-bgp, and BIRD 2), then leave no namespace or process
//! behind; Ctrl-C in the middle (of the traffic part and of convergence) must clean up too.
//!
//! No assertion is about speed (shared noisy machine): only that each part delivered
//! packets and produced its output (new TCP connections: every one completed; the TCP
//! bulk download: every byte, through juneau
//! and nft-dnat). Needs root, iproute2, nftables, ethtool, valgrind,
//! python3-matplotlib, bird2, kubectl (tests/setup/apt-packages.txt, tests/setup.sh) and
//! etcd + kube-apiserver (tests/k8s/build.sh); a missing one fails the test with the
//! harness's own list of what is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PERF: &str = env!("CARGO_BIN_EXE_juneau-perf");

/// The tests that measure traffic run one at a time: both pin their generator and path
/// to the same two cores, and the flood test asserts what a client got.
static TRAFFIC: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Builds a binary of the workspace (same profile as this test) and returns its path.
fn workspace_binary(package: &str, bin: &str) -> PathBuf {
    let dir = Path::new(PERF).parent().expect("bin dir");
    build_binary(package, bin, dir.ends_with("release"))
}

/// `bin` of `package` built by cargo, optimised or not, in this build's target
/// directory.
fn build_binary(package: &str, bin: &str, release: bool) -> PathBuf {
    let target = Path::new(PERF)
        .parent()
        .and_then(Path::parent)
        .expect("target dir");
    let dir = target.join(if release { "release" } else { "debug" });
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", package, "--bin", bin]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running cargo to build {bin}: {e}"));
    assert!(status.success(), "building {bin} failed: {status}");
    let p = dir.join(bin);
    assert!(p.exists(), "{bin} not at {} after building it", p.display());
    p
}

fn dataplane_binary() -> PathBuf {
    workspace_binary("juneau-dataplane", "juneau-dataplane")
}

/// `--k8s-sync PATH --bgp PATH` for the convergence measurement.
fn control_plane_args() -> Vec<std::ffi::OsString> {
    vec![
        "--k8s-sync".into(),
        workspace_binary("juneau-k8s-sync", "juneau-k8s-sync").into(),
        "--bgp".into(),
        workspace_binary("juneau-bgp", "juneau-bgp").into(),
    ]
}

/// Processes still running whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        if !e
            .file_name()
            .to_string_lossy()
            .chars()
            .all(|c| c.is_ascii_digit())
        {
            continue;
        }
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            let c = String::from_utf8_lossy(&c).replace('\0', " ");
            if c.contains(needle) {
                v.push(c);
            }
        }
    }
    v
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
    let _one_at_a_time = TRAFFIC.lock().unwrap_or_else(|e| e.into_inner());
    let dp = dataplane_binary();
    let cp = control_plane_args();
    let out = std::env::temp_dir().join(format!("juneau-perf-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let child = Command::new(PERF)
        .args(["smoke", "--out"])
        .arg(&out)
        .arg("--dataplane")
        .arg(&dp)
        .args(&cp)
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
    let cvg = format!("jcvg{}", pid % 100_000);
    assert!(
        netns_with_prefix(&cvg).is_empty(),
        "convergence namespaces left behind: {:?}",
        netns_with_prefix(&cvg)
    );
    let kube_dir = format!("juneau-kube-{pid}-");
    assert!(
        processes_mentioning(&kube_dir).is_empty(),
        "etcd/kube-apiserver left running: {:?}",
        processes_mentioning(&kube_dir)
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
        "juneau-xdp-fast",
        "nft-dnat6",
        "juneau6",
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
    // A ratio is computed only between saturated rows; otherwise the report says why.
    // (A refusal names its ratio first: "juneau / nft-dnat: ...".)
    for (r, other) in [
        ("juneau_vs_nft_dnat", "juneau / nft-dnat:"),
        ("juneau_xdp_fast_vs_xdp_dnat", "juneau-xdp-fast / xdp-dnat:"),
        ("juneau_vs_afxdp_l2fwd", "juneau / afxdp-l2fwd:"),
        ("juneau6_vs_nft_dnat6", "juneau6 / nft-dnat6:"),
    ] {
        let refused = report["ratios"]["refused"]
            .as_array()
            .expect("ratios.refused")
            .iter()
            .any(|x| x.as_str().unwrap_or("").starts_with(other));
        assert!(
            report["ratios"][r].as_f64().is_some() != refused,
            "ratio {r}: neither computed nor refused (or both): {:#}",
            report["ratios"]
        );
    }
    // juneau6 forwarded over IPv6: the dataplane held the IPv6 flows and dropped nothing.
    let j6 = report["dataplane_counters"]
        .as_array()
        .expect("dataplane_counters")
        .iter()
        .find(|c| c["scenario"] == "juneau6")
        .unwrap_or_else(|| panic!("no counters of juneau6: {report:#}"));
    assert_eq!(j6["ipv6_flows_in_table"], 256, "{j6}");
    assert_eq!(j6["engine_drops"], 0, "{j6}");
    let (rx, tx) = (j6["rx_packets"].as_u64(), j6["tx_packets"].as_u64());
    assert!(
        rx.zip(tx).is_some_and(|(rx, tx)| tx > 0 && tx <= rx),
        "each IPv6 frame sent once: {j6}"
    );
    for s in scenarios {
        let runs = s["runs"].as_array().expect("per-run figures");
        for run in runs {
            assert!(run["ns_per_packet"].as_f64().unwrap() > 0.0, "{run}");
            assert!(run["core_ns_per_packet"].as_f64().unwrap() > 0.0, "{run}");
            // The backend's socket drops are named per run (a number, zero or not).
            assert!(run["backend_socket_drops"].as_u64().is_some(), "{run}");
            // The offered rate was calibrated: a flood, then at least one paced step.
            assert!(
                run["calibration"].as_array().is_some_and(|c| c.len() >= 2),
                "{run}"
            );
            assert!(
                run["saturation"].as_str().is_some_and(|x| !x.is_empty()),
                "{run}"
            );
        }
    }
    // Every path of the round (one round in smoke) has a window of one common kind (per
    // family: IPv4, IPv6): a path paced while another was flooded ran an extra flooded
    // window (its paced one kept), so every ratio pairs like with like (issue #26).
    let kinds = |run: &serde_json::Value| -> Vec<&'static str> {
        std::iter::once(run)
            .chain(run["also"].as_array().into_iter().flatten())
            .map(|w| match w["rate_pps"].as_u64() {
                Some(r) if r > 0 => "paced",
                _ => "flooded",
            })
            .collect()
    };
    let rows: Vec<&serde_json::Value> = scenarios
        .iter()
        .chain(
            report["flow_scale"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| &p["summary"]),
        )
        .chain(std::iter::once(&report["flow_scale_reference"]["summary"]))
        .filter(|s| s["runs"].as_array().is_some_and(|r| !r.is_empty()))
        .collect();
    // Per family: the IPv6 rows pair only among themselves, so they have their own kind.
    let ipv6 = |s: &serde_json::Value| {
        ["nft-dnat6", "juneau6", "kernel-forward6"].contains(&s["name"].as_str().unwrap_or(""))
    };
    for family in [false, true] {
        let round: Vec<Vec<&str>> = rows
            .iter()
            .filter(|s| ipv6(s) == family)
            .map(|s| kinds(&s["runs"][0]))
            .collect();
        assert!(
            ["paced", "flooded"]
                .iter()
                .any(|k| round.iter().all(|w| w.contains(k))),
            "round 1 has no kind every path's windows share (IPv6: {family}): {round:?}"
        );
    }
    // The TCP bulk download: 4 MiB per connection, 1 and 4 streams, through juneau and
    // nft-dnat; every byte of the checked round and of the window arrived.
    let bulk = report["bulk"].as_array().expect("bulk rows");
    for streams in [1u64, 4] {
        for path in ["juneau", "nft-dnat"] {
            let row = bulk
                .iter()
                .find(|r| r["streams"] == streams && r["path"] == path)
                .unwrap_or_else(|| {
                    panic!("no tcp-bulk-{streams} {path} row: {:#}", report["bulk"])
                });
            assert_eq!(row["name"], format!("tcp-bulk-{streams}"));
            let runs = row["runs"].as_array().expect("bulk runs");
            assert_eq!(runs.len(), 1, "{row}");
            for run in runs {
                let each = run["bytes_each"].as_u64().unwrap();
                assert_eq!(each, 4 << 20, "{run}");
                let v = &run["verified"];
                assert_eq!(v["downloads"].as_u64(), Some(streams), "{run}");
                assert_eq!(v["bytes"].as_u64(), Some(streams * each), "{run}");
                let m = &run["moved"];
                let downloads = m["downloads"].as_u64().unwrap();
                assert!(downloads >= streams, "{run}");
                assert_eq!(m["bytes"].as_u64(), Some(downloads * each), "{run}");
                assert!(run["gbps"].as_f64().unwrap() > 0.0, "{run}");
                assert!(run["path_cpu_s"].as_f64().unwrap() > 0.0, "{run}");
                assert!(
                    run["saturation"].as_str().is_some_and(|x| !x.is_empty()),
                    "{run}"
                );
                // The dataplane's counters are kept for juneau's runs.
                assert_eq!(run["dataplane"].is_object(), path == "juneau", "{run}");
            }
        }
    }
    let bulk_ratios = report["bulk_ratios"].as_array().expect("bulk_ratios");
    assert_eq!(bulk_ratios.len(), 2, "{bulk_ratios:?}");
    for q in bulk_ratios {
        assert!(
            q["per_cpu_s"].as_f64().is_some() != q["refused"].is_string(),
            "a bulk ratio neither computed nor refused (or both): {q}"
        );
    }
    // Where the time goes: a profile of the path core per path (perf is a test
    // dependency: tests/setup/apt-packages.txt).
    // And juneau at the largest flow count of its flow-scale rows.
    let profiles = report["profiles"].as_array().expect("profiles");
    let largest = report["flow_scale"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["flows"].as_u64())
        .max()
        .expect("flow-scale rows");
    let at_scale = format!("juneau @ {largest} flows");
    for sc in ["juneau", "afxdp-l2fwd", "nft-dnat", at_scale.as_str()] {
        let p = profiles
            .iter()
            .find(|p| p["scenario"] == sc)
            .unwrap_or_else(|| panic!("no profile of {sc}: {:#}", report["profile_note"]));
        assert!(p["samples"].as_u64().unwrap_or(0) > 0, "{p}");
        assert!(!p["parts"].as_array().unwrap().is_empty(), "{p}");
    }
    // New TCP connections: both paths measured, every connection completed.
    let connect = report["connect"].as_array().expect("connect runs");
    for path in ["juneau", "nft-dnat"] {
        let r = connect
            .iter()
            .find(|r| r["path"] == path)
            .unwrap_or_else(|| panic!("no tcp-connect run through {path}: {connect:?}"));
        assert!(r["connections"].as_u64().unwrap_or(0) > 0, "{r}");
        assert_eq!(r["failed"].as_u64(), Some(0), "failed connections: {r}");
    }
    let q = &report["connect_ratio"];
    assert!(
        q["per_cpu_s"].as_f64().is_some() != q["refused"].is_string(),
        "the connection ratio neither computed nor refused (or both): {q}"
    );
    let scale = report["flow_scale"].as_array().expect("flow_scale");
    assert!(scale.len() >= 2, "flow scale points: {scale:?}");
    // xdp-dnat at the largest flow count, the reference.
    let reference = &report["flow_scale_reference"];
    assert_eq!(reference["flows"], 100_000, "{reference}");
    assert!(
        reference["median_pps"].as_f64().unwrap_or(0.0) > 0.0,
        "{reference}"
    );
    let lat = report["latency"].as_array().expect("latency");
    for sc in ["nft-dnat", "juneau"] {
        let p = lat
            .iter()
            .find(|l| l["scenario"] == sc)
            .unwrap_or_else(|| panic!("no latency point for {sc}"));
        assert!(p["received"].as_u64().unwrap() > 0, "{sc}: no echo replies");
        assert!(p["p99_us"].as_f64().unwrap() >= p["p50_us"].as_f64().unwrap());
    }
    // Latency also at the same absolute background rate for every path.
    for sc in ["nft-dnat", "juneau"] {
        assert!(
            lat.iter()
                .any(|l| l["scenario"] == sc && l["background_pps"] == 50_000),
            "{sc}: no latency point at an absolute background rate"
        );
    }
    // The summary compares juneau to nft-dnat round by round.
    let summary = report["latency_summary"]
        .as_array()
        .expect("latency_summary");
    let j = summary
        .iter()
        .find(|l| l["scenario"] == "juneau")
        .expect("juneau in the latency summary");
    assert_eq!(j["rounds"], 1, "{j}");
    assert!(j["p99_vs_nft_dnat"].as_f64().unwrap_or(0.0) > 0.0, "{j}");
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
    // Convergence: 3 withdraw/announce cycles seen in shared memory and at BIRD.
    let conv = &report["convergence_results"];
    let series = conv["series"]
        .as_array()
        .unwrap_or_else(|| panic!("no convergence: {:#}", report["convergence"]));
    for name in [
        "withdraw: apiserver -> shared memory",
        "withdraw: apiserver -> BIRD",
        "announce: apiserver -> shared memory",
        "announce: apiserver -> BIRD",
    ] {
        let s = series
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("convergence series {name} missing: {conv:#}"));
        assert_eq!(s["count"], 3, "{name}: {s}");
        assert_eq!(
            s["samples_ms"].as_array().map(|a| a.len()),
            Some(3),
            "{name}"
        );
        assert!(s["max_ms"].as_f64().unwrap() >= s["p50_ms"].as_f64().unwrap());
        assert!(s["min_ms"].as_f64().unwrap() > 0.0, "{name}: {s}");
    }
    let md = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    assert!(
        md.contains("| announce: apiserver -> BIRD | 3 |"),
        "convergence table missing from report.md:\n{md}"
    );
    assert!(
        md.contains("| juneau |") && md.contains("juneau / nft-dnat"),
        "report.md:\n{md}"
    );
    assert!(
        md.contains("## TCP bulk download")
            && md.contains("| tcp-bulk-4 | juneau |")
            && md.contains("| TCP bulk download: juneau / nft-dnat, Gbit per CPU-second >= 1.0 |"),
        "the TCP bulk section or target missing from report.md:\n{md}"
    );
    for png in [
        "throughput.png",
        "flow_scale.png",
        "latency.png",
        "convergence.png",
    ] {
        assert!(is_png(&out.join(png)), "{png} missing or not a PNG");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn ctrl_c_removes_the_namespaces() {
    let out = std::env::temp_dir().join(format!("juneau-perf-int-{}", std::process::id()));
    let mut child = Command::new(PERF)
        .args([
            "smoke",
            "--no-cost",
            "--no-convergence",
            "--scenarios",
            "nft-dnat",
            "--out",
        ])
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

#[test]
fn ctrl_c_during_convergence_stops_everything() {
    let cp = control_plane_args();
    let out = std::env::temp_dir().join(format!("juneau-perf-cvg-int-{}", std::process::id()));
    let mut child = Command::new(PERF)
        .args(["convergence", "--convergence-reps", "100000", "--out"])
        .arg(&out)
        .args(&cp)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting juneau-perf convergence");
    let pid = child.id();
    let prefix = format!("jcvg{}", pid % 100_000);
    let start = Instant::now();
    while netns_with_prefix(&prefix).is_empty() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "juneau-perf convergence exited before building its namespaces"
        );
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "no namespace {prefix}* appeared"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let the daemons come up (or the repetitions start), then interrupt.
    std::thread::sleep(Duration::from_secs(4));
    assert!(child.try_wait().unwrap().is_none(), "exited early");
    // SAFETY: sending SIGINT to our own child process.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "juneau-perf did not stop after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !child.wait().unwrap().success(),
        "an interrupted run must not report success"
    );
    assert!(
        netns_with_prefix(&prefix).is_empty(),
        "namespaces left behind after Ctrl-C: {:?}",
        netns_with_prefix(&prefix)
    );
    let kube_dir = format!("juneau-kube-{pid}-");
    assert!(
        processes_mentioning(&kube_dir).is_empty(),
        "etcd/kube-apiserver left running after Ctrl-C: {:?}",
        processes_mentioning(&kube_dir)
    );
    let staged = out.join("bin");
    assert!(
        processes_mentioning(staged.to_str().unwrap()).is_empty(),
        "juneau-k8s-sync / juneau-bgp left running after Ctrl-C: {:?}",
        processes_mentioning(staged.to_str().unwrap())
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// `juneau-perf flood` with SYN and ACK floods and UDP to the redirect port from
/// strangers at generator rate (2 s each, after a baseline): the legitimate client's new
/// connections are all served and its kept-alive connection carries on through each (the
/// command fails otherwise), the ACK flood ends in the dataplane's drop counters, the
/// redirect-port flood is dropped by the steering program (it never reaches userspace),
/// and nothing is left behind. The dataplane is an optimised build, as shipped: a debug
/// build's userspace path is several times slower, and the ACK flood's packets that
/// reach it (within the new-flow admission's burst) cut the client there — a
/// measurement of the build, not of the product. (The UDP and first-
/// fragment floods are at the edge of this machine's one path core and run only in
/// `juneau-perf flood`'s default set: docs/security.md, "Floods at generator rate".)
#[test]
fn syn_ack_and_redirect_port_floods_at_generator_rate_spare_the_legitimate_client() {
    let _one_at_a_time = TRAFFIC.lock().unwrap_or_else(|e| e.into_inner());
    let out = std::env::temp_dir().join(format!("juneau-perf-flood-{}", std::process::id()));
    let output = Command::new(PERF)
        .args([
            "flood",
            "--kinds",
            "syn,ack,redirect-port",
            "--seconds",
            "2",
            "--dataplane",
        ])
        .arg(build_binary("juneau-dataplane", "juneau-dataplane", true))
        .arg("--out")
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .expect("running juneau-perf flood");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "juneau-perf flood failed:\n{stderr}"
    );
    let rows: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("flood.json")).expect("flood.json"))
            .expect("flood.json parses");
    let rows = rows.as_array().expect("rows");
    let names: Vec<&str> = rows.iter().filter_map(|r| r["flood"].as_str()).collect();
    assert_eq!(names, ["none", "syn", "ack", "redirect-port"], "{rows:?}");
    for r in &rows[1..] {
        assert!(r["offered_pps"].as_f64().unwrap_or(0.0) > 10_000.0, "{r}");
        assert!(r["new_connections"].as_u64().unwrap_or(0) > 0, "{r}");
        assert_eq!(r["new_connections_failed"], 0, "{r}");
        assert_eq!(r["kept_alive_ok"], true, "{r}");
    }
    let ack_drops = &rows[2]["drops"];
    let dropped = ack_drops["non_syn_without_flow"].as_u64().unwrap_or(0)
        + ack_drops["new_flow_prefix_rate_limited"]
            .as_u64()
            .unwrap_or(0);
    assert!(dropped > 10_000, "the ACK flood's packets: {ack_drops}");
    // Strangers' datagrams to the redirect port: dropped before userspace, which
    // receives only the legitimate traffic (it received every one before).
    let r = &rows[3];
    let strangers = r["drops"]["redirect_not_from_peer"].as_u64().unwrap_or(0);
    let to_userspace = r["rx_packets"].as_u64().unwrap_or(u64::MAX);
    assert!(strangers > 10_000, "{r}");
    assert!(to_userspace < strangers / 10, "{r}");
    let table = std::fs::read_to_string(out.join("flood.md")).expect("flood.md");
    assert!(table.contains("| ack |"), "{table}");
    assert!(
        processes_mentioning(out.to_str().unwrap()).is_empty(),
        "processes left behind"
    );
    let _ = std::fs::remove_dir_all(&out);
}
