//! Userspace cost of the dataplane's packet path: instructions per packet, counted by
//! `valgrind --tool=callgrind` on a small bench binary (`juneau-perf-cost`) that feeds
//! recorded frames to the dataplane's pure packet-processing function inlined into a
//! packet loop, net of that loop (stable on noisy shared machines).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::results::Cost;

/// Time the cost measurement adds to a run (estimate).
pub const EXPECTED: Duration = Duration::from_secs(30);

/// Instructions of the whole program for `n` packets of `mode`.
fn callgrind_ir(bench: &Path, out_dir: &Path, mode: &str, n: u32) -> Result<u64> {
    let out_file = out_dir.join(format!("callgrind-{mode}-{n}.out"));
    let out = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(bench)
        .arg(mode)
        .arg(n.to_string())
        .output()
        .context("running valgrind (apt-get install valgrind)")?;
    if !out.status.success() {
        bail!(
            "callgrind run of {} {mode} {n} failed: {}",
            bench.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" / ")
        );
    }
    let text = std::fs::read_to_string(&out_file)?;
    let _ = std::fs::remove_file(&out_file);
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next().and_then(|x| x.parse().ok()))
        .with_context(|| format!("no instruction total in callgrind output for {mode}"))
}

/// Instructions per packet of `mode`: the difference between runs of `2n` and `n`
/// packets, divided by `n` (program start and the set-up packets cancel out).
fn per_packet(bench: &Path, out_dir: &Path, mode: &str, n: u32) -> Result<f64> {
    let a = callgrind_ir(bench, out_dir, mode, n)?;
    let b = callgrind_ir(bench, out_dir, mode, 2 * n)?;
    Ok(b.saturating_sub(a) as f64 / f64::from(n))
}

/// Per-packet figures of one measurement, harness loop included.
struct Gross {
    established: f64,
    reply: f64,
    new: f64,
    baseline: f64,
    baseline_new: f64,
    redirect_ask: f64,
    redirect_own: f64,
    baseline_redirect: f64,
}

/// Measures the cost, or says why it could not.
///
/// Measured as `dataplane/examples/engine_cost.rs` measures (docs/dataplane.md): the
/// engine inlined into a packet loop like the forwarding loop's, whole-program
/// instruction counts, `(Ir(2N) - Ir(N)) / N`, minus the same figure for the loop alone.
pub fn measure(bench: &Path, out_dir: &Path, smoke: bool) -> Cost {
    let profile = if cfg!(debug_assertions) {
        "debug (unoptimised: not comparable to the target)"
    } else {
        "release"
    };
    let n = if smoke { 2_000 } else { 20_000 };
    let run = || -> Result<Gross> {
        if !bench.exists() {
            bail!(
                "{} is missing (cargo build -p juneau-perf)",
                bench.display()
            );
        }
        Ok(Gross {
            established: per_packet(bench, out_dir, "established", n)?,
            reply: per_packet(bench, out_dir, "reply", n)?,
            new: per_packet(bench, out_dir, "new", n)?,
            baseline: per_packet(bench, out_dir, "baseline", n)?,
            baseline_new: per_packet(bench, out_dir, "baseline-new", n)?,
            redirect_ask: per_packet(bench, out_dir, "redirect-ask", n)?,
            redirect_own: per_packet(bench, out_dir, "redirect-own", n)?,
            baseline_redirect: per_packet(bench, out_dir, "baseline-redirect", n)?,
        })
    };
    match run() {
        Ok(g) => Cost {
            status: format!(
                "Engine only: callgrind instructions of juneau_dataplane::engine::Engine::process inlined into a packet \
                 loop as the forwarding loop inlines it (recorded 64-byte UDP frames, {profile} build), per packet as \
                 (Ir({}) - Ir({n})) / {n} so start-up cancels, minus the same figure for the loop alone without the \
                 engine (the baseline: {:.0} instructions/packet for the recorded-frame loop, {:.0} for the new-flow \
                 loop, which writes a fresh frame per packet, {:.0} for the redirected-path loop, which copies a \
                 TCP frame of the encapsulated size); the method of dataplane/examples/engine_cost.rs. The redirected \
                 path is a TCP connection node B owns that the router sends to node A: A follows its \
                 redirect record and encapsulates (the verdict, `take_redirect` and `redirect_wire::encapsulate`), B \
                 strips the outer headers and serves it as its established flow. Where \
                 the instructions go: docs/dataplane.md, \"Established-flow fast path\".",
                2 * n,
                g.baseline,
                g.baseline_new,
                g.baseline_redirect
            ),
            established_instructions_per_packet: Some(g.established - g.baseline),
            new_flow_instructions_per_packet: Some(g.new - g.baseline_new),
            reply_instructions_per_packet: Some(g.reply - g.baseline),
            baseline_instructions_per_packet: Some(g.baseline),
            new_flow_baseline_instructions_per_packet: Some(g.baseline_new),
            redirect_ask_instructions_per_packet: Some(g.redirect_ask - g.baseline_redirect),
            redirect_own_instructions_per_packet: Some(g.redirect_own - g.baseline_redirect),
            profile: profile.into(),
        },
        Err(e) => Cost {
            status: format!("Not measured: {e:#}"),
            profile: profile.into(),
            ..Default::default()
        },
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}
