//! The TCP bulk download's record: what a download moved, every run, the rows per (stream
//! count, path), the paired ratios juneau / nft-dnat, and the report's section for them.
//! The `bulk` module measures them.

use serde::{Deserialize, Serialize};

use crate::cpu::CoreLoad;
use crate::results::{median, paired_median};

/// What a download moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Moved {
    /// Rounds of `streams` connections.
    pub rounds: u32,
    /// Connections that received their whole body.
    pub downloads: u64,
    /// Bytes received (and checked) over all connections.
    pub bytes: u64,
    /// From the first connect to the last EOF, seconds.
    pub wall_s: f64,
}

/// One measured run: one path, one stream count, a fresh topology.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BulkRun {
    /// `juneau` or `nft-dnat`.
    pub path: String,
    /// Connections at once.
    pub streams: u32,
    /// The round of the suite (0-based): runs of the same round are paired.
    pub round: u32,
    /// Bytes per connection.
    pub bytes_each: u64,
    /// The round of downloads before the window, every byte checked against the
    /// pattern.
    pub verified: Moved,
    /// What the client received in the window (every byte counted).
    pub moved: Moved,
    /// Gbit/s delivered (bytes x 8 / wall time).
    pub gbps: f64,
    /// The path core's time shares over the window.
    pub path_core: CoreLoad,
    /// The endpoint core's (server, client and their receive work).
    pub endpoint_core: CoreLoad,
    /// Busy CPU-seconds of the path core over the window (the cost figure).
    pub path_cpu_s: f64,
    /// Run time of the path's own threads (NAPI kthreads of the node's veths,
    /// ksoftirqd of the path core, the forwarder's threads), seconds.
    pub threads_cpu_s: f64,
    /// Run time of the endpoints' threads (this process's: server and client; the
    /// client veth's NAPI kthread; ksoftirqd of the endpoint core), seconds.
    #[serde(default)]
    pub endpoint_threads_cpu_s: f64,
    /// Gbit delivered per busy CPU-second of the path core (the cost figure).
    pub gbps_per_cpu_s: f64,
    /// Gbit delivered per CPU-second of the path's own threads (beside it: on a quiet
    /// machine close to the core's figure; a spinning forwarder's idle polls count).
    #[serde(default)]
    pub gbps_per_thread_cpu_s: f64,
    /// The path core >= 95 % busy: the forwarding core was the bottleneck.
    pub saturated: bool,
    /// Why it counts as saturated, or why not.
    pub saturation: String,
    /// The backend (Pod) veth's TSO, GSO and tx checksum offload during the run.
    #[serde(default)]
    pub backend_offloads: String,
    /// juneau-dataplane's counters after the run (stats file; cumulative since its start,
    /// readiness check included) and its loop timing totals; `None` for nft-dnat.
    #[serde(default)]
    pub dataplane: Option<serde_json::Value>,
}

/// One path at one stream count over the rounds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BulkRow {
    /// `tcp-bulk-<streams>`.
    pub name: String,
    /// `juneau` or `nft-dnat`.
    pub path: String,
    /// Connections at once.
    pub streams: u32,
    /// Every run saturated.
    pub saturated: bool,
    /// Median Gbit/s.
    pub median_gbps: f64,
    /// Median Gbit per CPU-second.
    pub median_gbps_per_cpu_s: f64,
    /// The runs.
    pub runs: Vec<BulkRun>,
}

/// juneau / nft-dnat at one stream count, paired per round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BulkRatio {
    /// Connections at once.
    pub streams: u32,
    /// Rounds with both paths measured.
    pub rounds: usize,
    /// Median over the rounds of juneau's Gbit/s / nft-dnat's in the same round.
    pub gbps: Option<f64>,
    /// The same for Gbit per CPU-second; `None` when refused.
    pub per_cpu_s: Option<f64>,
    /// The per-CPU-second ratio as measured, also when refused (for the record only).
    pub per_cpu_s_as_measured: Option<f64>,
    /// Why the ratio is refused (a run not saturated), if it is.
    pub refused: Option<String>,
}

/// Summarises runs into rows: one per (stream count, path), in the order first seen.
pub fn rows(runs: &[BulkRun]) -> Vec<BulkRow> {
    let mut keys: Vec<(u32, &str)> = Vec::new();
    for r in runs {
        if !keys.contains(&(r.streams, r.path.as_str())) {
            keys.push((r.streams, r.path.as_str()));
        }
    }
    keys.sort_by_key(|(s, _)| *s);
    keys.into_iter()
        .map(|(streams, path)| {
            let mine: Vec<BulkRun> = runs
                .iter()
                .filter(|r| r.streams == streams && r.path == path)
                .cloned()
                .collect();
            BulkRow {
                name: format!("tcp-bulk-{streams}"),
                path: path.to_string(),
                streams,
                saturated: !mine.is_empty() && mine.iter().all(|r| r.saturated),
                median_gbps: median(&mine.iter().map(|r| r.gbps).collect::<Vec<_>>()),
                median_gbps_per_cpu_s: median(
                    &mine.iter().map(|r| r.gbps_per_cpu_s).collect::<Vec<_>>(),
                ),
                runs: mine,
            }
        })
        .collect()
}

/// juneau / nft-dnat per stream count, paired round by round; refused unless every run
/// of both rows was saturated.
pub fn ratios(rows: &[BulkRow]) -> Vec<BulkRatio> {
    let mut streams: Vec<u32> = rows.iter().map(|r| r.streams).collect();
    streams.dedup();
    streams
        .into_iter()
        .filter_map(|s| {
            let j = rows.iter().find(|r| r.streams == s && r.path == "juneau")?;
            let n = rows
                .iter()
                .find(|r| r.streams == s && r.path == "nft-dnat")?;
            let pairs: Vec<(&BulkRun, &BulkRun)> = j
                .runs
                .iter()
                .filter_map(|a| Some((a, n.runs.iter().find(|b| b.round == a.round)?)))
                .collect();
            let paired = |f: fn(&BulkRun) -> f64| paired_median(&pairs, f);
            let unsat: Vec<String> = [j, n]
                .iter()
                .filter(|r| !r.saturated)
                .map(|r| {
                    format!(
                        "{} {} ({} of {} runs saturated)",
                        r.name,
                        r.path,
                        r.runs.iter().filter(|x| x.saturated).count(),
                        r.runs.len()
                    )
                })
                .collect();
            let as_measured = paired(|r| r.gbps_per_cpu_s);
            let refused = if pairs.is_empty() {
                Some("no round measured both paths".to_string())
            } else if !unsat.is_empty() {
                Some(format!("not all runs saturated: {}", unsat.join(", ")))
            } else {
                None
            };
            Some(BulkRatio {
                streams: s,
                rounds: pairs.len(),
                gbps: paired(|r| r.gbps),
                per_cpu_s: if refused.is_none() { as_measured } else { None },
                per_cpu_s_as_measured: as_measured,
                refused,
            })
        })
        .collect()
}

/// The report's section.
pub fn markdown(rows: &[BulkRow], ratios: &[BulkRatio]) -> String {
    let mut m = String::from("\n## TCP bulk download (juneau against nft-dnat)\n\n");
    if rows.is_empty() {
        m += "Not measured in this run.\n";
        return m;
    }
    m += "A real TCP server in the backend namespace (its veth as a CNI leaves a Pod's: TSO, GSO and tx checksum offload on, no XDP program, no NAPI) sends each connection the bytes it asks for (`sendfile` from a memory file: no copy from userspace); a client in the client namespace downloads them through VIP:9002 on N connections at once. Per run, on a fresh topology: one round of full-size downloads with every byte checked against the pattern (a short, long or altered body fails the run), then the measured window: rounds of fresh connections until the window has passed, every byte counted (`recv` with `MSG_TRUNC`: counted, not copied), a short or long body failing the run. Server and client run on CPU 0 at nice -20 (their veths' receive work too: RPS on the backend's, a threaded-NAPI kthread on the client's), the node's forwarding work on CPU 1 as in the UDP rows. Gbit per CPU-second = bits delivered / busy time of the path core (/proc/stat) over the window; per CPU-second of the path's own threads (NAPI kthreads, ksoftirqd/1, the forwarder) beside it. Saturated: the path core >= 95 % busy while the endpoint core is not (the forwarding core was the limit; a spinning forwarder shows a full core either way). Ratios juneau / nft-dnat are paired round by round (median), only from rows saturated in every run.\n\n";
    m += "| row | path | saturated | median Gbit/s | median Gbit per CPU-second | runs: Gbit/s, path core busy, endpoint core busy |\n|---|---|---|---:|---:|---|\n";
    for r in rows {
        m += &format!(
            "| {} | {} | {} | {:.2} | {:.2} | {} |\n",
            r.name,
            r.path,
            if r.saturated {
                "**yes** (all runs)".to_string()
            } else {
                format!(
                    "NO ({} of {} runs)",
                    r.runs.iter().filter(|x| x.saturated).count(),
                    r.runs.len()
                )
            },
            r.median_gbps,
            r.median_gbps_per_cpu_s,
            r.runs
                .iter()
                .map(|x| format!(
                    "{:.2} / {:.0}% / {:.0}%",
                    x.gbps,
                    100.0 * x.path_core.busy,
                    100.0 * x.endpoint_core.busy
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    m += "\nPer run:\n\n";
    for r in rows {
        for x in &r.runs {
            m += &format!(
                "- {} {} round {}: checked {} downloads ({} bytes); window: {} downloads of {} bytes in {} rounds, {} bytes in {:.3} s = {:.2} Gbit/s; path core {:.2} CPU-s (user {:.0}% / system {:.0}% / softirq {:.0}% / steal {:.0}%), path threads {:.2} CPU-s, endpoint threads {:.2} CPU-s: {:.2} Gbit per CPU-second (threads: {:.2}); Pod veth {}; {}\n",
                r.name,
                r.path,
                x.round + 1,
                x.verified.downloads,
                x.verified.bytes,
                x.moved.downloads,
                x.bytes_each,
                x.moved.rounds,
                x.moved.bytes,
                x.moved.wall_s,
                x.gbps,
                x.path_cpu_s,
                100.0 * x.path_core.user,
                100.0 * x.path_core.system,
                100.0 * x.path_core.softirq,
                100.0 * x.path_core.steal,
                x.threads_cpu_s,
                x.endpoint_threads_cpu_s,
                x.gbps_per_cpu_s,
                x.gbps_per_thread_cpu_s,
                x.backend_offloads,
                x.saturation
            );
        }
    }
    m += "\n| ratio juneau / nft-dnat | rounds | Gbit/s | Gbit per CPU-second | target |\n|---|---:|---:|---:|---:|\n";
    let f = |v: Option<f64>| v.map_or_else(|| "—".to_string(), |x| format!("{x:.2}"));
    for q in ratios {
        m += &format!(
            "| tcp-bulk-{} | {} | {} | {} | >= 1.0 |\n",
            q.streams,
            q.rounds,
            f(q.gbps),
            match (&q.refused, q.per_cpu_s_as_measured) {
                (Some(_), Some(x)) => format!("refused (as measured {x:.2})"),
                (Some(_), None) => "refused".to_string(),
                (None, v) => f(v),
            }
        );
    }
    let refused: Vec<String> = ratios
        .iter()
        .filter_map(|q| Some(format!("tcp-bulk-{}: {}", q.streams, q.refused.as_ref()?)))
        .collect();
    if !refused.is_empty() {
        m += "\nRefused:\n\n";
        for r in refused {
            m += &format!("- {r}\n");
        }
    }
    let dp: Vec<(&BulkRow, &BulkRun)> = rows
        .iter()
        .flat_map(|r| r.runs.iter().map(move |x| (r, x)))
        .filter(|(_, x)| x.dataplane.is_some())
        .collect();
    if !dp.is_empty() {
        m += "\njuneau-dataplane after each run (stats file, cumulative since its start, the readiness download included; loop: totals of its once-a-second `loop timing` lines):\n\n";
        m += "| row | round | rx | tx | segmented | segments | XDP fast path | drops | loop iterations | empty RX batches | yields | sleeps |\n|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|\n";
        for (r, x) in dp {
            let d = x.dataplane.as_ref().expect("filtered");
            let drops = d["drops"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "none".into());
            m += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.name,
                x.round + 1,
                d["rx_packets"],
                d["tx_packets"],
                d["segmented"],
                d["segments"],
                d["xdp_fast_packets"],
                drops,
                d["loop"]["iterations"],
                d["loop"]["rx_batches_empty"],
                d["loop"]["yields"],
                d["loop"]["sleeps"]
            );
        }
    }
    m
}
