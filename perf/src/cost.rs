//! Userspace cost of the dataplane's packet path: instructions per packet, counted by
//! `valgrind --tool=callgrind` on a small bench binary that feeds recorded frames to the
//! dataplane's pure packet-processing function (stable on noisy shared machines).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::report::Cost;

/// Time the cost measurement adds to a run (estimate).
pub const EXPECTED: Duration = Duration::from_secs(30);

/// Instructions counted inside `process_one` for `n` packets of `mode`.
fn callgrind_ir(bench: &Path, out_dir: &Path, mode: &str, n: u32) -> Result<u64> {
    let out_file = out_dir.join(format!("callgrind-{mode}-{n}.out"));
    let out = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--toggle-collect=*process_one*")
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
    if mode == "established" && n > 1 {
        // Keep the larger established run for the per-function breakdown.
        let keep = out_dir.join("callgrind-established.out");
        let _ = std::fs::rename(&out_file, &keep);
    } else {
        let _ = std::fs::remove_file(&out_file);
    }
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next().and_then(|x| x.parse().ok()))
        .with_context(|| format!("no instruction total in callgrind output for {mode}"))
}

/// Instructions per packet of `mode`: the difference between runs of `2n` and `n`
/// packets, divided by `n` (the set-up packets and program start cancel out).
fn per_packet(bench: &Path, out_dir: &Path, mode: &str, n: u32) -> Result<f64> {
    let a = callgrind_ir(bench, out_dir, mode, n)?;
    let b = callgrind_ir(bench, out_dir, mode, 2 * n)?;
    Ok(b.saturating_sub(a) as f64 / f64::from(n))
}

/// Inclusive instructions per packet of the dataplane's functions in a kept callgrind
/// profile of `calls` packets (from `callgrind_annotate --inclusive=yes`).
fn breakdown(profile: &Path, calls: u64) -> Result<Vec<(String, f64)>> {
    let out = Command::new("callgrind_annotate")
        .arg("--inclusive=yes")
        .arg(profile)
        .output()
        .context("running callgrind_annotate (package valgrind)")?;
    if !out.status.success() {
        bail!(
            "callgrind_annotate failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let mut rows = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.starts_with("-- ") && !rows.is_empty() {
            break; // the per-source annotations follow the function table
        }
        let line = line.trim();
        let Some((count, rest)) = line.split_once(' ') else {
            continue;
        };
        let Ok(ir) = count.replace(',', "").parse::<u64>() else {
            continue;
        };
        // "(12.3%)  /path/file.rs:function [binary]"
        let Some(loc) = rest.split(')').nth(1).map(str::trim) else {
            continue;
        };
        let Some((file, func)) = loc.split_once(':') else {
            continue;
        };
        if !file.contains("/dataplane/src/") || func.contains("x)") {
            continue;
        }
        let func = func.split(" [").next().unwrap_or(func).to_string();
        if rows.iter().any(|(f, _)| *f == func) {
            continue; // the same function listed again under another file attribution
        }
        rows.push((func, ir as f64 / calls as f64));
        if rows.len() == 12 {
            break;
        }
    }
    Ok(rows)
}

/// Measures the cost, or says why it could not.
pub fn measure(bench: &Path, out_dir: &Path, smoke: bool) -> Cost {
    let profile = if cfg!(debug_assertions) {
        "debug (unoptimised: not comparable to the target)"
    } else {
        "release"
    };
    let n = if smoke { 2_000 } else { 20_000 };
    let run = || -> Result<(f64, f64, f64)> {
        if !bench.exists() {
            bail!(
                "{} is missing (cargo build -p juneau-perf)",
                bench.display()
            );
        }
        Ok((
            per_packet(bench, out_dir, "established", n)?,
            per_packet(bench, out_dir, "new", n)?,
            per_packet(bench, out_dir, "reply", n)?,
        ))
    };
    let result = run();
    let kept = out_dir.join("callgrind-established.out");
    // The 2n-packet run: 2n packets plus the first and the final checking packet.
    let where_time_goes = if result.is_ok() {
        breakdown(&kept, 2 * u64::from(n) + 2).unwrap_or_default()
    } else {
        Vec::new()
    };
    match result {
        Ok((est, new, reply)) => Cost {
            established_breakdown: where_time_goes,
            status: format!(
                "Measured with callgrind on juneau_dataplane::engine::Engine::process (recorded 64-byte UDP frames, \
                 {n} packets per mode, difference of {n} and {} packet runs), {profile} build. Reply path (reverse NAT, \
                 established): {reply:.0} instructions/packet.",
                2 * n
            ),
            established_instructions_per_packet: Some(est),
            new_flow_instructions_per_packet: Some(new),
            reply_instructions_per_packet: Some(reply),
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
