//! New TCP connections per second through the VIP: client threads in the client namespace
//! each open a connection to `VIP:BULK_PORT`, ask the bulk server for a short body
//! ([`CONNECT_BODY`] bytes), read it to EOF, check it, close, and start over, until the
//! window has passed — a new flow per request, with its handshake and teardown, through
//! `juneau` (its defaults, the new-flow admission included) or `nft-dnat` on the same
//! topology and cores as the TCP bulk download (`bulk::run_once`'s set-up).
//!
//! Per run: connections completed and failed (a refused, reset or timed-out connect, a
//! short or altered body: every failure is counted, the first one named, and a run with
//! one refuses the ratio), the path core's busy time over the window, connections per
//! CPU-second of it. Saturated, as for the bulk download, when the path core is >= 95 %
//! busy and the endpoint core is not; on two cores the endpoints' TCP work (both stacks,
//! connect, accept, close) outweighs the path's few packets per connection, so the
//! ratio is usually refused: the figure per CPU-second is shown as measured.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::bulk::{self, DownloadSpec, TcpBed};
use crate::cpu::{CoreLoad, CoreTimes};
use crate::harness;
use crate::plan::{Plan, Scenario, INTERRUPTED};
use crate::results::paired_median;
use crate::topology::{BULK_PORT, VIP};

/// Bytes each connection asks for (one request, one short answer).
pub const CONNECT_BODY: u64 = 512;
/// Client threads, each one connection at a time.
pub const CONNECT_WORKERS: u32 = 48;

/// One measured run: one path, a fresh topology.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConnectRun {
    /// `juneau` or `nft-dnat`.
    pub path: String,
    /// The round of the suite (0-based): runs of the same round are paired.
    pub round: u32,
    /// Connections that completed (whole body, clean close) in the window.
    pub connections: u64,
    /// Connections that failed in the window, with the first failure.
    pub failed: u64,
    /// The first failure, if any.
    #[serde(default)]
    pub first_failure: Option<String>,
    /// The window, seconds.
    pub wall_s: f64,
    /// Connections per second.
    pub per_s: f64,
    /// The path core's time shares over the window.
    pub path_core: CoreLoad,
    /// The endpoint core's.
    pub endpoint_core: CoreLoad,
    /// Connections per busy CPU-second of the path core (the cost figure).
    pub per_cpu_s: f64,
    /// The path core was the bottleneck (see `bulk::saturation`).
    pub saturated: bool,
    /// Why it counts as saturated, or why not.
    pub saturation: String,
    /// juneau-dataplane's non-zero drops after the run (its stats file); `None` for
    /// nft-dnat.
    #[serde(default)]
    pub dataplane_drops: Option<serde_json::Value>,
}

/// juneau / nft-dnat, paired per round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectRatio {
    /// Rounds with both paths measured.
    pub rounds: usize,
    /// Median over the rounds of juneau's connections/s / nft-dnat's.
    pub per_s: Option<f64>,
    /// The same per CPU-second; `None` when refused.
    pub per_cpu_s: Option<f64>,
    /// The per-CPU-second ratio as measured, also when refused (for the record only).
    pub per_cpu_s_as_measured: Option<f64>,
    /// Why the ratio is refused, if it is.
    pub refused: Option<String>,
}

/// One run of `sc` in round `round` on a fresh topology.
pub fn run_once(plan: &Plan, sc: Scenario, round: u32) -> Result<ConnectRun> {
    let (ecpu, pcpu) = harness::cpus();
    let tag = format!("connect-{}-r{round}-{}", sc.name(), std::process::id());
    let TcpBed {
        t,
        mut path,
        server: _server,
        ..
    } = TcpBed::start(plan, sc, &tag)?;
    harness::pin_path(&t, &path)?;
    let target = SocketAddr::V4(SocketAddrV4::new(VIP, BULK_PORT));
    bulk::wait_until_serving(&t, &mut path, target, ecpu)?;
    let spec = DownloadSpec {
        target,
        streams: 1,
        bytes_each: CONNECT_BODY,
        min_window: plan.duration,
        timeout: Duration::from_secs(5),
        cpu: Some(ecpu),
        verify: true,
    };
    let (before_p, before_e) = (CoreTimes::read(pcpu)?, CoreTimes::read(ecpu)?);
    let (done, failed, first, wall_s) = churn(t.client.name(), &spec)?;
    let (after_p, after_e) = (CoreTimes::read(pcpu)?, CoreTimes::read(ecpu)?);
    path.check_forwarder()?;
    let core = before_p.busy_since(&after_p);
    let endpoint_core = before_e.busy_since(&after_e);
    let (saturated, saturation) = bulk::saturation(core.busy, endpoint_core.busy);
    let path_cpu_s = core.busy * wall_s;
    let dataplane_drops = path.stats_file.clone().map(|f| {
        // The stats file is rewritten about once a second: wait for one after the window.
        let _ = crate::plan::sleep(Duration::from_millis(1200));
        bulk::dataplane_figures(&f, None)["drops"].take()
    });
    Ok(ConnectRun {
        path: sc.name().to_string(),
        round,
        connections: done,
        failed,
        first_failure: first,
        wall_s,
        per_s: done as f64 / wall_s.max(1e-9),
        path_core: core,
        endpoint_core,
        per_cpu_s: if path_cpu_s > 0.0 {
            done as f64 / path_cpu_s
        } else {
            0.0
        },
        saturated,
        saturation,
        dataplane_drops,
    })
}

/// [`CONNECT_WORKERS`] threads in namespace `ns`, each opening one connection after
/// another (`spec.bytes_each` bytes each, checked) until `spec.min_window` has passed.
/// Returns (completed, failed, the first failure, wall seconds).
fn churn(ns: &str, spec: &DownloadSpec) -> Result<(u64, u64, Option<String>, f64)> {
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first = Arc::new(std::sync::Mutex::new(None::<String>));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let deadline = start + spec.min_window;
    let workers: Vec<_> = (0..CONNECT_WORKERS)
        .map(|_| {
            let (done, failed, first, stop) =
                (done.clone(), failed.clone(), first.clone(), stop.clone());
            let spec = spec.clone();
            bulk::spawn_in(Some(ns), move || {
                bulk::pin_here(spec.cpu);
                while Instant::now() < deadline
                    && !stop.load(Ordering::Relaxed)
                    && !INTERRUPTED.load(Ordering::Relaxed)
                {
                    match bulk::one_stream(&spec, Instant::now() + spec.timeout) {
                        Ok(_) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            let mut f = first.lock().expect("not poisoned");
                            f.get_or_insert_with(|| format!("{e:#}"));
                        }
                    }
                }
            })
        })
        .collect::<Result<_>>()?;
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a connecting thread panicked"))??;
    }
    let wall_s = start.elapsed().as_secs_f64();
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (Ctrl-C)");
    }
    let first = first.lock().expect("not poisoned").clone();
    Ok((
        done.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        first,
        wall_s,
    ))
}

/// juneau / nft-dnat paired round by round; refused unless every run of both was
/// saturated and without a failed connection.
pub fn ratio(runs: &[ConnectRun]) -> Option<ConnectRatio> {
    fn of<'a>(runs: &'a [ConnectRun], p: &'a str) -> impl Iterator<Item = &'a ConnectRun> {
        runs.iter().filter(move |r| r.path == p)
    }
    let pairs: Vec<(&ConnectRun, &ConnectRun)> = of(runs, "juneau")
        .filter_map(|a| Some((a, of(runs, "nft-dnat").find(|b| b.round == a.round)?)))
        .collect();
    if of(runs, "juneau").next().is_none() || of(runs, "nft-dnat").next().is_none() {
        return None;
    }
    let paired = |f: fn(&ConnectRun) -> f64| paired_median(&pairs, f);
    let unsat = runs.iter().filter(|r| !r.saturated).count();
    let failing = runs.iter().filter(|r| r.failed > 0).count();
    let refused = if pairs.is_empty() {
        Some("no round measured both paths".to_string())
    } else if failing > 0 {
        Some(format!("{failing} run(s) with failed connections"))
    } else if unsat > 0 {
        Some(format!(
            "{unsat} of {} runs not saturated (the endpoints' core was the limit)",
            runs.len()
        ))
    } else {
        None
    };
    let as_measured = paired(|r| r.per_cpu_s);
    Some(ConnectRatio {
        rounds: pairs.len(),
        per_s: paired(|r| r.per_s),
        per_cpu_s: if refused.is_none() { as_measured } else { None },
        per_cpu_s_as_measured: as_measured,
        refused,
    })
}

/// The report's section.
pub fn markdown(runs: &[ConnectRun], ratio: Option<&ConnectRatio>) -> String {
    let mut m = String::from("\n## New TCP connections (juneau against nft-dnat)\n\n");
    if runs.is_empty() {
        m += "Not measured in this run.\n";
        return m;
    }
    m += &format!("{CONNECT_WORKERS} client threads in the client namespace each open a connection to VIP:9002, ask for {CONNECT_BODY} bytes, read and check them to EOF and close, one connection after another, for the window (every connection a new flow, handshake and teardown included); server and clients on CPU 0, the node's work on CPU 1, a fresh topology per run. A failed connection (refused, reset, timed out, short or altered body) is counted and named. Connections per CPU-second = connections / busy time of the path core over the window. Saturated when the path core is >= 95 % busy and the endpoint core is not.\n\n");
    m += "| path | round | connections | failed | connections/s | per CPU-second | path core busy | endpoint core busy | saturated | juneau's drops |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---|\n";
    for r in runs {
        m += &format!(
            "| {} | {} | {} | {}{} | {:.0} | {:.0} | {:.0}% | {:.0}% | {} | {} |\n",
            r.path,
            r.round + 1,
            r.connections,
            r.failed,
            r.first_failure
                .as_ref()
                .map(|f| format!(" (first: {f})"))
                .unwrap_or_default(),
            r.per_s,
            r.per_cpu_s,
            100.0 * r.path_core.busy,
            100.0 * r.endpoint_core.busy,
            r.saturation,
            r.dataplane_drops
                .as_ref()
                .map(|d| d.to_string())
                .unwrap_or_else(|| "—".into())
        );
    }
    if let Some(q) = ratio {
        let f = |x: Option<f64>| x.map_or_else(|| "—".into(), |v| format!("{v:.2}"));
        m += &format!(
            "\njuneau / nft-dnat over {} paired rounds: connections/s {}, per CPU-second {}.\n",
            q.rounds,
            f(q.per_s),
            match &q.refused {
                Some(r) => format!("refused: {r} (as measured {})", f(q.per_cpu_s_as_measured)),
                None => f(q.per_cpu_s),
            }
        );
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(path: &str, round: u32, per_s: f64, per_cpu_s: f64, saturated: bool) -> ConnectRun {
        ConnectRun {
            path: path.into(),
            round,
            per_s,
            per_cpu_s,
            saturated,
            ..Default::default()
        }
    }

    #[test]
    fn the_ratio_pairs_rounds_and_is_refused_unless_saturated_without_failures() {
        let runs = vec![
            run("juneau", 0, 900.0, 2000.0, true),
            run("nft-dnat", 0, 1000.0, 1000.0, true),
            run("juneau", 1, 450.0, 1500.0, true),
            run("nft-dnat", 1, 500.0, 1000.0, true),
        ];
        let q = ratio(&runs).expect("both paths");
        assert_eq!(q.rounds, 2);
        assert_eq!(q.per_s, Some(0.9));
        assert_eq!(q.per_cpu_s, Some(1.75));
        assert!(q.refused.is_none());
        let mut unsat = runs.clone();
        unsat[1].saturated = false;
        let q = ratio(&unsat).expect("both paths");
        assert_eq!((q.per_cpu_s, q.per_cpu_s_as_measured), (None, Some(1.75)));
        assert!(q.refused.unwrap().contains("not saturated"));
        let mut failing = runs.clone();
        failing[0].failed = 3;
        assert!(ratio(&failing).unwrap().refused.unwrap().contains("failed"));
        assert!(ratio(&runs[..1]).is_none(), "nft-dnat not measured");
        let md = markdown(&runs, ratio(&runs).as_ref());
        assert!(
            md.contains("connections/s 0.90, per CPU-second 1.75."),
            "{md}"
        );
    }
}
