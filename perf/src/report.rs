//! The report: `report.json`, `report.md` and PNG plots (drawn by Debian's
//! python3-matplotlib from the JSON, see `perf/plot.py`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::latency::ProbeResult;

/// One scenario's throughput.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScenarioResult {
    /// Scenario name.
    pub name: String,
    /// Flows offered.
    pub flows: u32,
    /// Delivered packets/s of each run.
    pub runs_pps: Vec<f64>,
    /// Smallest run.
    pub min_pps: f64,
    /// Median run.
    pub median_pps: f64,
    /// Largest run.
    pub max_pps: f64,
    /// What the generator offered in each run (its own send rate); a delivered rate close
    /// to it means the generator, not the path, was the limit.
    pub offered_pps: Vec<f64>,
    /// Every run's figures (delivered, offered, the path's CPU time, saturation).
    #[serde(default)]
    pub runs: Vec<RunFigures>,
    /// Whether every run was saturated (ratios are computed only from saturated rows).
    #[serde(default)]
    pub saturated: bool,
    /// Median CPU time of the path per delivered packet, ns: the path core's busy time
    /// over the window / packets delivered in the window (older reports: the path's
    /// threads' run time).
    #[serde(default)]
    pub ns_per_packet: Option<f64>,
    /// Median of the path's own threads' run time per delivered packet, ns.
    #[serde(default)]
    pub thread_ns_per_packet: Option<f64>,
    /// The same in cycles of the TSC clock (`cycles_clock_mhz`).
    #[serde(default)]
    pub cycles_per_packet: Option<f64>,
    /// Packets delivered per CPU-second of the path (1e9 / ns_per_packet).
    #[serde(default)]
    pub pps_per_cpu_second: Option<f64>,
}

/// One throughput run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunFigures {
    /// Packets/s counted by the sink in the window.
    pub delivered_pps: f64,
    /// Packets/s the generator offered (its own count over its whole run).
    pub offered_pps: f64,
    /// The rate the generator was asked to offer (paced; 0 = as fast as it could), found
    /// by the calibration.
    #[serde(default)]
    pub rate_pps: u64,
    /// CPU time of the path's threads per second of window (1.0 = one full core).
    pub path_cores: f64,
    /// The path core's time shares from /proc/stat (other processes on the shared
    /// machine included).
    pub path_core: crate::cpu::CoreLoad,
    /// The generator core's time shares (a kernel path whose work leaked onto the
    /// generator's core would show here as softirq).
    #[serde(default)]
    pub gen_core: crate::cpu::CoreLoad,
    /// CPU time of the path's own threads per delivered packet, ns.
    pub ns_per_packet: f64,
    /// Busy time of the path core (user + system + irq + softirq, /proc/stat) per
    /// delivered packet, ns: the cost figure of the report (on a quiet machine the path's
    /// threads are nearly all of it; the difference is other work on that core).
    #[serde(default)]
    pub core_ns_per_packet: f64,
    /// Delivered < 97 % of offered, or the path core >= 95 % busy.
    pub saturated: bool,
    /// Why it counts as saturated, or why not.
    pub saturation: String,
    /// The calibration's steps before the window: (offered, delivered) packets/s; the
    /// first is the unpaced flood.
    #[serde(default)]
    pub calibration: Vec<(f64, f64)>,
}

impl RunFigures {
    /// The per-packet cost the report uses: the path core's busy time per packet when
    /// measured (newer reports), else the path's threads' time.
    pub fn cost_ns(&self) -> f64 {
        if self.core_ns_per_packet > 0.0 {
            self.core_ns_per_packet
        } else {
            self.ns_per_packet
        }
    }
}

/// Median of a list (mean of the middle two for even lengths).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

impl ScenarioResult {
    /// Summarizes runs.
    pub fn new(name: &str, flows: u32, runs_pps: Vec<f64>) -> ScenarioResult {
        ScenarioResult {
            name: name.into(),
            flows,
            min_pps: runs_pps.iter().copied().fold(f64::INFINITY, f64::min),
            max_pps: runs_pps.iter().copied().fold(0.0, f64::max),
            median_pps: median(&runs_pps),
            runs_pps,
            offered_pps: Vec::new(),
            runs: Vec::new(),
            saturated: false,
            ns_per_packet: None,
            thread_ns_per_packet: None,
            cycles_per_packet: None,
            pps_per_cpu_second: None,
        }
    }

    /// Summarizes measured runs: medians, saturation of every run, CPU cost.
    pub fn from_runs(name: &str, flows: u32, runs: Vec<RunFigures>) -> ScenarioResult {
        let mut r =
            ScenarioResult::new(name, flows, runs.iter().map(|f| f.delivered_pps).collect());
        r.offered_pps = runs.iter().map(|f| f.offered_pps).collect();
        r.saturated = !runs.is_empty() && runs.iter().all(|f| f.saturated);
        let ns: Vec<f64> = runs
            .iter()
            .map(|f| f.cost_ns())
            .filter(|x| x.is_finite() && *x > 0.0)
            .collect();
        let tns: Vec<f64> = runs
            .iter()
            .map(|f| f.ns_per_packet)
            .filter(|x| x.is_finite() && *x > 0.0)
            .collect();
        if !tns.is_empty() {
            r.thread_ns_per_packet = Some(median(&tns));
        }
        if !ns.is_empty() {
            let m = median(&ns);
            r.ns_per_packet = Some(m);
            r.cycles_per_packet = crate::cpu::tsc_mhz().map(|mhz| m * mhz / 1e3);
            r.pps_per_cpu_second = Some(1e9 / m);
        }
        r.runs = runs;
        r
    }
}

/// `juneau` at one flow count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FlowScalePoint {
    /// Concurrent flows offered.
    pub flows: u32,
    /// Delivered packets/s of each run.
    pub runs_pps: Vec<f64>,
    /// Median run.
    pub median_pps: f64,
    /// Saturation and CPU cost of the runs.
    #[serde(default)]
    pub summary: Option<ScenarioResult>,
}

impl FlowScalePoint {
    /// Its row in the report's flow-scale table, `label` after the flow count.
    fn row(&self, label: &str) -> String {
        let runs: Vec<String> = self.runs_pps.iter().map(|x| format!("{x:.0}")).collect();
        format!(
            "| {}{label} | {} | {:.0} |\n",
            self.flows,
            runs.join(", "),
            self.median_pps
        )
    }
}

/// Latency through the VIP at one offered load.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyPoint {
    /// Scenario name.
    pub scenario: String,
    /// Offered background load as a fraction of the scenario's median throughput.
    pub load_fraction: f64,
    /// Offered background load, packets/s.
    pub offered_pps: f64,
    /// Which latency round (every round measures every scenario at every load, in
    /// turn, so slow drift of the machine's load spreads over all of them).
    #[serde(default)]
    pub round: u32,
    /// Round-trip figures.
    #[serde(flatten)]
    pub result: ProbeResult,
}

/// One scenario at one load over every latency round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Scenario name.
    pub scenario: String,
    /// Offered background load as a fraction of the scenario's median throughput.
    pub load_fraction: f64,
    /// Rounds measured.
    pub rounds: usize,
    /// p99 over the rounds: median, lowest, highest (microseconds).
    pub p99_us: [f64; 3],
    /// p99.9 over the rounds: median, lowest, highest (microseconds).
    pub p999_us: [f64; 3],
    /// Median over the rounds measured by both of this p99 / nft-dnat's p99 in the same
    /// round at the same load (a paired comparison: the machine's noise of that moment
    /// hits both); `None` for nft-dnat itself or without a common round.
    pub p99_vs_nft_dnat: Option<f64>,
    /// The same for p99.9.
    pub p999_vs_nft_dnat: Option<f64>,
}

/// Summarises latency points by (scenario, load), in the order first seen.
pub fn latency_summary(points: &[LatencyPoint]) -> Vec<LatencySummary> {
    let mut keys: Vec<(&str, f64)> = Vec::new();
    for l in points {
        if !keys.contains(&(l.scenario.as_str(), l.load_fraction)) {
            keys.push((l.scenario.as_str(), l.load_fraction));
        }
    }
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        [median(v), lo, hi]
    };
    let at = |sc: &str, load: f64, round: u32| {
        points
            .iter()
            .find(|l| l.scenario == sc && l.load_fraction == load && l.round == round)
    };
    keys.into_iter()
        .map(|(sc, load)| {
            let mine: Vec<&LatencyPoint> = points
                .iter()
                .filter(|l| l.scenario == sc && l.load_fraction == load)
                .collect();
            let p99: Vec<f64> = mine.iter().map(|l| l.result.p99_us).collect();
            let p999: Vec<f64> = mine.iter().map(|l| l.result.p999_us).collect();
            let paired = |f: fn(&ProbeResult) -> f64| {
                if sc == "nft-dnat" {
                    return None;
                }
                let r: Vec<f64> = mine
                    .iter()
                    .filter_map(|l| {
                        let n = at("nft-dnat", load, l.round)?;
                        (f(&n.result) > 0.0).then(|| f(&l.result) / f(&n.result))
                    })
                    .collect();
                (!r.is_empty()).then(|| median(&r))
            };
            LatencySummary {
                scenario: sc.to_string(),
                load_fraction: load,
                rounds: mine.len(),
                p99_us: spread(&p99),
                p999_us: spread(&p999),
                p99_vs_nft_dnat: paired(|r| r.p99_us),
                p999_vs_nft_dnat: paired(|r| r.p999_us),
            }
        })
        .collect()
}

/// Userspace cost of the dataplane's packet path.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Cost {
    /// What was measured, or why nothing was.
    pub status: String,
    /// Instructions per packet, established flow (engine only: harness loop subtracted).
    pub established_instructions_per_packet: Option<f64>,
    /// Instructions per packet, new flow (first packet of a flow).
    pub new_flow_instructions_per_packet: Option<f64>,
    /// Instructions per packet, a backend's reply (reverse NAT) on an established flow.
    pub reply_instructions_per_packet: Option<f64>,
    /// Build profile of the measured code.
    pub profile: String,
    /// Instructions per packet of the harness loop alone (frame copy, verdict branch),
    /// subtracted from the established and reply figures.
    #[serde(default)]
    pub baseline_instructions_per_packet: Option<f64>,
    /// Instructions per packet of the new-flow harness loop alone (writes a fresh frame
    /// per packet), subtracted from the new-flow figure.
    #[serde(default)]
    pub new_flow_baseline_instructions_per_packet: Option<f64>,
    /// Instructions per packet at the node the router sends another node's connection
    /// to (issue 12): redirect-record look-up and encapsulation in place.
    #[serde(default)]
    pub redirect_ask_instructions_per_packet: Option<f64>,
    /// Instructions per packet at the owner of a redirected packet: outer headers
    /// stripped, then served as its own established flow.
    #[serde(default)]
    pub redirect_own_instructions_per_packet: Option<f64>,
}

/// The ratios the product is held to.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ratios {
    /// juneau (the default, userspace path) / nft-dnat (target >= 1.0).
    pub juneau_vs_nft_dnat: Option<f64>,
    /// juneau-xdp-fast (the opt-in XDP fast path) / xdp-dnat (target >= 1.0). Reports
    /// written before the fast path became opt-in call it `juneau_vs_xdp_dnat` (their
    /// `juneau` row was the fast path).
    #[serde(alias = "juneau_vs_xdp_dnat")]
    pub juneau_xdp_fast_vs_xdp_dnat: Option<f64>,
    /// juneau / afxdp-l2fwd (target >= 1.0).
    pub juneau_vs_afxdp_l2fwd: Option<f64>,
    /// juneau at the largest flow count / at the smallest (target >= 0.9 for 1M vs 1k).
    pub juneau_flow_scale_largest_vs_smallest: Option<f64>,
    /// Packets per CPU-second of the path, juneau / nft-dnat (target >= 1.0).
    #[serde(default)]
    pub cpu_juneau_vs_nft_dnat: Option<f64>,
    /// Packets per CPU-second, juneau-xdp-fast / xdp-dnat (target >= 1.0).
    #[serde(default, alias = "cpu_juneau_vs_xdp_dnat")]
    pub cpu_juneau_xdp_fast_vs_xdp_dnat: Option<f64>,
    /// Packets per CPU-second, juneau / afxdp-l2fwd (target >= 1.0).
    #[serde(default)]
    pub cpu_juneau_vs_afxdp_l2fwd: Option<f64>,
    /// Packets per CPU-second, juneau at the largest flow count / at the smallest.
    #[serde(default)]
    pub cpu_juneau_flow_scale_largest_vs_smallest: Option<f64>,
    /// xdp-dnat at the largest flow count / at the throughput rows' flow count: what the
    /// in-kernel baseline loses at that many flows (no target; the reference for juneau's).
    #[serde(default)]
    pub xdp_dnat_flow_scale: Option<f64>,
    /// The same in packets per CPU-second.
    #[serde(default)]
    pub cpu_xdp_dnat_flow_scale: Option<f64>,
    /// Ratios not computed, and why (a side not saturated, or not measured).
    #[serde(default)]
    pub refused: Vec<String>,
}

/// Everything one `juneau-perf run` measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    /// UTC start time.
    pub date: String,
    /// Machine description (CPU model, cores, kernel).
    pub machine: String,
    /// /proc/loadavg when the run started (other work on the machine skews results).
    pub load_average_start: String,
    /// /proc/loadavg when the run ended.
    pub load_average_end: String,
    /// `run` or `smoke`.
    pub mode: String,
    /// Runs per scenario, window and warm-up seconds, flows.
    pub config: serde_json::Value,
    /// Throughput per scenario.
    pub scenarios: Vec<ScenarioResult>,
    /// The ratios (absent where a side is missing).
    pub ratios: Ratios,
    /// `juneau` at several flow counts.
    pub flow_scale: Vec<FlowScalePoint>,
    /// `xdp-dnat` at the largest of those flow counts (the in-kernel baseline's own loss
    /// at that many flows, for reference), when measured.
    #[serde(default)]
    pub flow_scale_reference: Option<FlowScalePoint>,
    /// Latency through the VIP.
    pub latency: Vec<LatencyPoint>,
    /// Latency by scenario and load over the rounds ([`latency_summary`]), with the
    /// paired comparison to nft-dnat.
    #[serde(default)]
    pub latency_summary: Vec<LatencySummary>,
    /// Userspace cost.
    pub cost: Cost,
    /// Whole userspace cost (the real dataplane under callgrind), when measured.
    #[serde(default)]
    pub loop_cost: Option<crate::loopcost::LoopCost>,
    /// Control-plane convergence: a one-line summary (or why it was not measured).
    pub convergence: String,
    /// Control-plane convergence distributions, when measured.
    #[serde(default)]
    pub convergence_results: Option<crate::convergence::ConvergenceReport>,
    /// Control-plane scale (N Services at once), when measured.
    #[serde(default)]
    pub scale: Option<crate::scale::ScaleReport>,
    /// juneau-dataplane's own counters after each `juneau` run (cumulative since its
    /// start): AF_XDP ring drops show where packets were lost.
    pub dataplane_counters: Vec<serde_json::Value>,
    /// The TCP bulk download's rows (`tcp-bulk-<streams>`, juneau and nft-dnat).
    #[serde(default)]
    pub bulk: Vec<crate::bulk::BulkRow>,
    /// juneau / nft-dnat of the TCP bulk download per stream count, paired per round.
    #[serde(default)]
    pub bulk_ratios: Vec<crate::bulk::BulkRatio>,
    /// Scenarios that failed, with the reason.
    pub errors: Vec<(String, String)>,
}

impl Report {
    /// The throughput table's rows: every scenario, then `juneau` at each flow count.
    pub fn throughput_rows(&self) -> impl Iterator<Item = &ScenarioResult> {
        self.scenarios
            .iter()
            .chain(self.flow_scale.iter().filter_map(|p| p.summary.as_ref()))
    }

    /// Records a failed scenario.
    pub fn add_error(&mut self, scenario: &str, msg: String) {
        self.errors.push((scenario.into(), msg));
    }

    /// Summarises the latency rounds ([`latency_summary`]) and computes the ratios from
    /// the medians, only between rows whose every run was
    /// saturated (an unsaturated row measures the generator, not the path); refusals are
    /// listed in `ratios.refused`.
    pub fn compute_ratios(&mut self) {
        self.latency_summary = latency_summary(&self.latency);
        let mut refused = Vec::new();
        let find = |n: &str| self.scenarios.iter().find(|s| s.name == n).cloned();
        let mut pair =
            |a: Option<ScenarioResult>, b: Option<ScenarioResult>, what: &str| match (a, b) {
                (Some(a), Some(b)) => {
                    let unsat: Vec<String> = [&a, &b]
                        .iter()
                        .filter(|s| !s.saturated)
                        .map(|s| format!("{} ({} flows)", s.name, s.flows))
                        .collect();
                    if !unsat.is_empty() {
                        refused.push(format!(
                            "{what}: not all runs saturated: {}",
                            unsat.join(", ")
                        ));
                        return (None, None);
                    }
                    let pps = (b.median_pps > 0.0).then(|| a.median_pps / b.median_pps);
                    let cpu = match (a.pps_per_cpu_second, b.pps_per_cpu_second) {
                        (Some(x), Some(y)) if y > 0.0 => Some(x / y),
                        _ => None,
                    };
                    (pps, cpu)
                }
                _ => {
                    refused.push(format!("{what}: a side was not measured"));
                    (None, None)
                }
            };
        let j = find("juneau");
        let (a, b) = pair(j.clone(), find("nft-dnat"), "juneau / nft-dnat");
        self.ratios.juneau_vs_nft_dnat = a;
        self.ratios.cpu_juneau_vs_nft_dnat = b;
        let (a, b) = pair(
            find("juneau-xdp-fast"),
            find("xdp-dnat"),
            "juneau-xdp-fast / xdp-dnat",
        );
        self.ratios.juneau_xdp_fast_vs_xdp_dnat = a;
        self.ratios.cpu_juneau_xdp_fast_vs_xdp_dnat = b;
        let (a, b) = pair(j, find("afxdp-l2fwd"), "juneau / afxdp-l2fwd");
        self.ratios.juneau_vs_afxdp_l2fwd = a;
        self.ratios.cpu_juneau_vs_afxdp_l2fwd = b;
        let smallest = self.flow_scale.iter().min_by_key(|p| p.flows);
        let largest = self.flow_scale.iter().max_by_key(|p| p.flows);
        let summary = |p: &FlowScalePoint| {
            p.summary.clone().unwrap_or_else(|| {
                let mut s = ScenarioResult::new("juneau", p.flows, p.runs_pps.clone());
                s.saturated = true; // older reports carry no saturation: as measured then
                s
            })
        };
        let (a, b) = match (smallest, largest) {
            (Some(s), Some(l)) if s.flows != l.flows => pair(
                Some(summary(l)),
                Some(summary(s)),
                "juneau largest / smallest flow count",
            ),
            _ => (None, None),
        };
        self.ratios.juneau_flow_scale_largest_vs_smallest = a;
        self.ratios.cpu_juneau_flow_scale_largest_vs_smallest = b;
        let (a, b) = match &self.flow_scale_reference {
            Some(r) => pair(
                r.summary.clone(),
                find("xdp-dnat"),
                "xdp-dnat largest flow count / throughput rows",
            ),
            None => (None, None),
        };
        self.ratios.xdp_dnat_flow_scale = a;
        self.ratios.cpu_xdp_dnat_flow_scale = b;
        self.ratios.refused = refused;
        self.bulk_ratios = crate::bulk::ratios(&self.bulk);
    }

    /// The Markdown report.
    pub fn markdown(&self) -> String {
        let mut m = String::new();
        m += &format!("# Juneau benchmark report ({})\n\n", self.mode);
        m += &format!(
            "- date: {}\n- machine: {}\n- load average (1/5/15 min) at start: {}, at end: {}\n- config: `{}`\n\n",
            self.date, self.machine, self.load_average_start, self.load_average_end, self.config
        );
        m += &crate::targets::markdown(self);
        m += "\n";
        m += &self.method_md();
        m += &self.throughput_md();
        m += &self.ratios_md();
        m += &crate::bulk::markdown(&self.bulk, &self.bulk_ratios);
        m += &self.flow_scale_md();
        m += &self.latency_md();
        m += &self.userspace_cost_md();
        m += &self.control_plane_md();
        if self.mode == "convergence" || self.mode == "scale" {
            // `juneau-perf convergence` measured nothing else: drop the empty sections.
            if let (Some(a), Some(b)) = (
                m.find("Delivered packets/s"),
                m.find("## Control-plane convergence"),
            ) {
                m.replace_range(a..b, "");
            }
        }
        m
    }

    /// The method paragraph: how the rates and costs were measured.
    fn method_md(&self) -> String {
        let mut m = String::new();
        m += "Delivered packets/s counted by the XDP sink in the backend namespace; 64-byte UDP\n";
        m += "offered by a live-frames XDP generator (BPF_PROG_RUN) alone on CPU 0; every forwarding\n";
        m += "path runs on CPU 1 (the node's threaded-NAPI kthreads and the userspace forwarder pinned\n";
        m += "there, checked after each run). Offered rate: calibrated per run (a short flood, then paced\n";
        m += &format!(
            "steps from {OA:.2}x what the path delivered under it, {SU:.0}x up while the path carried everything, then\n",
            OA = crate::calibrate::OFFER_ABOVE,
            SU = crate::calibrate::STEP_UP
        );
        m += &format!(
            "bisection until the highest carried and lowest not carried rates are within {:.2}x; the window offers {:.1}x the latter;\n",
            crate::calibrate::SEARCH_CLOSE,
            crate::calibrate::WINDOW_ABOVE
        );
        m += &format!(
            "a window the path carried entirely runs again, at most {} times: {:.1}x higher, the last time unpaced;\n",
            crate::calibrate::WINDOW_RETRIES,
            crate::calibrate::WINDOW_RETRY_UP
        );
        m += "the carried window is then listed as a calibration step),\n";
        m += "so the path is saturated without being flooded many times over. ns/packet = busy time of the\n";
        m += "path core (user + system + irq + softirq, /proc/stat) over the window / packets delivered in it;\n";
        m += "the path's own threads' run time per packet (NAPI kthreads, ksoftirqd/1, forwarder; schedstat)\n";
        m += "is listed beside it (\"threads\"). cycles = ns x the TSC\n";
        m += &format!(
            "clock ({}; this VM exposes no PMU cycle counter). A run is *saturated* when delivered < {:.0} %\n",
            crate::cpu::tsc_mhz()
                .map(|m| format!("{m:.0} MHz"))
                .unwrap_or_else(|| "unknown".into()),
            100.0 * crate::suite::SATURATION_DELIVERED_BELOW
        );
        m += &format!(
            "of offered or the path core is >= {:.0} % busy (/proc/stat); ratios come only from rows saturated in every run.\n\n",
            100.0 * crate::suite::SATURATION_CORE_BUSY
        );
        m
    }

    /// Throughput and CPU cost per packet, per scenario and per run.
    fn throughput_md(&self) -> String {
        let mut m = String::new();
        m += "## Throughput and CPU cost per packet\n\n| scenario | flows | saturated | median delivered pps | offered pps (runs) | path cores (runs) | path core busy (runs) | ns/packet | cycles/packet | packets per CPU-second | threads ns/packet |\n|---|---:|---|---:|---|---|---|---:|---:|---:|---:|\n";
        for s in self.throughput_rows() {
            let join = |v: Vec<String>| v.join(", ");
            m += &format!(
                "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} |\n",
                s.name,
                s.flows,
                if s.runs.is_empty() {
                    "not recorded".to_string()
                } else if s.saturated {
                    "**yes** (all runs)".to_string()
                } else {
                    format!(
                        "NO ({} of {} runs)",
                        s.runs.iter().filter(|r| r.saturated).count(),
                        s.runs.len()
                    )
                },
                s.median_pps,
                join(s.offered_pps.iter().map(|p| format!("{p:.0}")).collect()),
                join(
                    s.runs
                        .iter()
                        .map(|r| format!("{:.2}", r.path_cores))
                        .collect()
                ),
                join(
                    s.runs
                        .iter()
                        .map(|r| format!("{:.0}%", 100.0 * r.path_core.busy))
                        .collect()
                ),
                s.ns_per_packet
                    .map(|x| format!("{x:.0}"))
                    .unwrap_or_else(|| "-".into()),
                s.cycles_per_packet
                    .map(|x| format!("{x:.0}"))
                    .unwrap_or_else(|| "-".into()),
                s.pps_per_cpu_second
                    .map(|x| format!("{x:.0}"))
                    .unwrap_or_else(|| "-".into()),
                s.thread_ns_per_packet
                    .map(|x| format!("{x:.0}"))
                    .unwrap_or_else(|| "-".into()),
            );
        }
        m += "\nPer run: \n\n";
        for s in self.throughput_rows() {
            for (i, r) in s.runs.iter().enumerate() {
                m += &format!(
                    "- {} @ {} flows, run {}: {:.0} of {:.0} pps (rate asked {}), {:.0} ns/packet (threads {:.0}), path core user {:.0}% / system {:.0}% / softirq {:.0}% / steal {:.0}%, generator core busy {:.0}% (softirq {:.0}%): {}; calibration (offered -> delivered): {}\n",
                    s.name,
                    s.flows,
                    i + 1,
                    r.delivered_pps,
                    r.offered_pps,
                    if r.rate_pps == 0 { "unpaced".to_string() } else { r.rate_pps.to_string() },
                    r.cost_ns(),
                    r.ns_per_packet,
                    100.0 * r.path_core.user,
                    100.0 * r.path_core.system,
                    100.0 * r.path_core.softirq,
                    100.0 * r.path_core.steal,
                    100.0 * r.gen_core.busy,
                    100.0 * r.gen_core.softirq,
                    r.saturation,
                    r.calibration
                        .iter()
                        .map(|(o, d)| format!("{o:.0} -> {d:.0}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        // plot.py draws the throughput plot only when there are throughput rows: link it
        // only then (docs_links checks every link of a committed report).
        if !self.scenarios.is_empty() {
            m += "\n![throughput](throughput.png)\n";
        }
        m
    }

    /// The ratios against their targets, what was refused, the dataplane's counters.
    fn ratios_md(&self) -> String {
        let mut m = String::new();
        m += "\n## Ratios (medians of this run; only from saturated rows)\n\n| ratio | delivered pps | packets per CPU-second | target |\n|---|---:|---:|---:|\n";
        for (name, a, b, t) in [
            (
                "juneau / nft-dnat",
                self.ratios.juneau_vs_nft_dnat,
                self.ratios.cpu_juneau_vs_nft_dnat,
                ">= 1.0",
            ),
            (
                "juneau-xdp-fast / xdp-dnat",
                self.ratios.juneau_xdp_fast_vs_xdp_dnat,
                self.ratios.cpu_juneau_xdp_fast_vs_xdp_dnat,
                ">= 1.0",
            ),
            (
                "juneau / afxdp-l2fwd",
                self.ratios.juneau_vs_afxdp_l2fwd,
                self.ratios.cpu_juneau_vs_afxdp_l2fwd,
                ">= 1.0",
            ),
            (
                "juneau largest / smallest flow count",
                self.ratios.juneau_flow_scale_largest_vs_smallest,
                self.ratios.cpu_juneau_flow_scale_largest_vs_smallest,
                ">= 0.9",
            ),
            (
                "(reference) xdp-dnat largest flow count / throughput rows' flows",
                self.ratios.xdp_dnat_flow_scale,
                self.ratios.cpu_xdp_dnat_flow_scale,
                "—",
            ),
        ] {
            m += &format!(
                "| {name} | {} | {} | {t} |\n",
                not_measured(a),
                not_measured(b)
            );
        }
        if !self.ratios.refused.is_empty() {
            m += "\nRefused (a ratio of unsaturated runs measures the generator, not the paths):\n\n";
            for r in &self.ratios.refused {
                m += &format!("- {r}\n");
            }
        }
        if !self.dataplane_counters.is_empty() {
            m += "\njuneau-dataplane's own counters after each `juneau` run (its stats file, written about once a second, so up to ~1 s stale; cumulative since its start, warm-up included):\n\n";
            m += "| scenario | flows | flows in its table | rx | tx | engine drops | xsk rx ring full | xsk fill ring empty | xsk rx dropped | received by busy polling (node netns) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
            for c in &self.dataplane_counters {
                m += &format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    c["scenario"].as_str().unwrap_or("juneau"),
                    c["flows"],
                    c["flows_in_table"],
                    c["rx_packets"],
                    c["tx_packets"],
                    c["engine_drops"],
                    c["xsk_rx_ring_full"],
                    c["xsk_fill_ring_empty"],
                    c["xsk_rx_dropped"],
                    c["busy_poll_rx_packets"]
                );
            }
        }
        m
    }

    /// Throughput by flow count.
    fn flow_scale_md(&self) -> String {
        let mut m = String::new();
        m += "\n## Flow scale (`juneau`)\n\n";
        if self.flow_scale.is_empty() && self.flow_scale_reference.is_none() {
            m += "Not measured in this run.\n";
        } else {
            m += "| flows | runs (pps) | median |\n|---:|---|---:|\n";
            for p in &self.flow_scale {
                m += &p.row("");
            }
            if let Some(r) = &self.flow_scale_reference {
                m += &r.row(" (xdp-dnat, reference)");
            }
            m += "\n![flow scale](flow_scale.png)\n";
        }
        m
    }

    /// Latency through the VIP.
    fn latency_md(&self) -> String {
        let mut m = String::new();
        m += "\n## Latency through the VIP (UDP request/response, one outstanding)\n\n";
        if self.latency.is_empty() {
            m += "Not measured in this run.\n";
        } else {
            let ratio = |r: Option<f64>| r.map_or_else(|| "—".to_string(), |x| format!("{x:.2}"));
            m += "Every round measures every scenario at every load in turn; per scenario and load: the median over the rounds (lowest–highest), and the paired comparison to nft-dnat (median over the rounds of this scenario's figure / nft-dnat's in the same round; ≤ 1.00: no worse).\n\n";
            m += "| scenario | offered load | rounds | p99 us | p99.9 us | p99 / nft-dnat | p99.9 / nft-dnat |\n|---|---:|---:|---:|---:|---:|---:|\n";
            for l in &self.latency_summary {
                m += &format!(
                    "| {} | {:.0}% | {} | {:.1} ({:.1}–{:.1}) | {:.1} ({:.1}–{:.1}) | {} | {} |\n",
                    l.scenario,
                    l.load_fraction * 100.0,
                    l.rounds,
                    l.p99_us[0],
                    l.p99_us[1],
                    l.p99_us[2],
                    l.p999_us[0],
                    l.p999_us[1],
                    l.p999_us[2],
                    ratio(l.p99_vs_nft_dnat),
                    ratio(l.p999_vs_nft_dnat)
                );
            }
            m += "\nEvery point:\n\n";
            m += "| round | scenario | offered load | background pps | replies | p50 us | p99 us | p99.9 us | max us |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
            for l in &self.latency {
                m += &format!(
                    "| {} | {} | {:.0}% | {:.0} | {}/{} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                    l.round + 1,
                    l.scenario,
                    l.load_fraction * 100.0,
                    l.offered_pps,
                    l.result.received,
                    l.result.sent,
                    l.result.p50_us,
                    l.result.p99_us,
                    l.result.p999_us,
                    l.result.max_us
                );
            }
            m += "\n![latency](latency.png)\n";
        }
        m
    }

    /// The userspace cost under callgrind.
    fn userspace_cost_md(&self) -> String {
        let mut m = String::new();
        m += "\n## Userspace cost (callgrind)\n\n";
        m += &format!("{}\n\n", self.cost.status);
        m += &format!(
            "| path (engine only) | instructions/packet | target |\n|---|---:|---:|\n| established flow | {} | <= 150 |\n| new flow | {} | |\n| reply (reverse NAT) | {} | |\n",
            self.cost.established_instructions_per_packet.map(|x| format!("{x:.0}")).unwrap_or_else(|| "not measured".into()),
            self.cost.new_flow_instructions_per_packet.map(|x| format!("{x:.0}")).unwrap_or_else(|| "not measured".into()),
            self.cost.reply_instructions_per_packet.map(|x| format!("{x:.0}")).unwrap_or_else(|| "not measured".into()),
        );
        m += &format!(
            "| redirected (issue 12), at the node the router picked: record look-up + encapsulation | {} | |
| redirected, at the owner: decapsulation + its established flow | {} | |
",
            self.cost.redirect_ask_instructions_per_packet.map(|x| format!("{x:.0}")).unwrap_or_else(|| "not measured".into()),
            self.cost.redirect_own_instructions_per_packet.map(|x| format!("{x:.0}")).unwrap_or_else(|| "not measured".into()),
        );
        m += &format!(
            "| harness loop alone (baseline, subtracted above) | {} (new flow: {}) | |\n",
            self.cost
                .baseline_instructions_per_packet
                .map(|x| format!("{x:.0}"))
                .unwrap_or_else(|| "not measured".into()),
            self.cost
                .new_flow_baseline_instructions_per_packet
                .map(|x| format!("{x:.0}"))
                .unwrap_or_else(|| "not measured".into()),
        );
        m += "\n### Whole userspace cost: forwarding loop + engine (the real dataplane under callgrind)\n\n";
        match &self.loop_cost {
            None => m += "Not measured in this run.\n",
            Some(l) => {
                m += &format!("{}\n\n", l.status);
                if !l.cases.is_empty() {
                    m += "| case | flows | packets | instructions/packet (whole loop, idle subtracted) | gross | engine only (above) |\n|---|---:|---:|---:|---:|---:|\n";
                    let f =
                        |v: Option<f64>| v.map(|x| format!("{x:.0}")).unwrap_or_else(|| "-".into());
                    for k in &l.cases {
                        let engine = if k.name.starts_with("forward, new") {
                            f(self.cost.new_flow_instructions_per_packet)
                        } else if k.name.starts_with("forward") {
                            f(self.cost.established_instructions_per_packet)
                        } else {
                            format!(
                                "{} (complete checksum)",
                                f(self.cost.reply_instructions_per_packet)
                            )
                        };
                        m += &format!(
                            "| {} | {} | {} | {:.0} | {:.0} | {} |\n",
                            k.name,
                            if k.flows == 0 {
                                "new".to_string()
                            } else {
                                k.flows.to_string()
                            },
                            k.packets,
                            k.instructions_per_packet,
                            k.gross_instructions_per_packet,
                            engine
                        );
                    }
                }
            }
        }
        m
    }

    /// Control-plane convergence and scale, and the failures.
    fn control_plane_md(&self) -> String {
        let mut m = String::new();
        m += &format!("\n## Control-plane convergence\n\n{}\n", self.convergence);
        if let Some(c) = &self.convergence_results {
            m += &format!(
                "\n{}.\n\n{} repetitions; BIRD is asked for the route every {:.1} ms over its control socket (one query: {:.2} ms median), so a BIRD figure is late by at most the longest gap seen between two queries, {:.1} ms in this run; shared memory is seen through a futex wake-up (microseconds).\n\n| from the PATCH to | samples | min ms | p50 ms | p90 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|---:|---:|\n",
                c.setup,
                c.repetitions,
                c.bird_poll_interval_ms,
                c.bird_query_p50_ms,
                c.bird_max_gap_ms
            );
            for s in &c.series {
                m += &format!(
                    "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                    s.name, s.count, s.min_ms, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms
                );
            }
            m += "\n![convergence](convergence.png)\n";
        }
        if let Some(sc) = &self.scale {
            m += "\n## Control-plane scale\n\n";
            m += &crate::scale::markdown(sc);
        }
        if !self.errors.is_empty() {
            m += "\n## Failures\n\n";
            for (s, e) in &self.errors {
                m += &format!("- **{s}**: {}\n", e.replace('\n', " / "));
            }
        }
        m
    }

    /// Reads a report.json back (to re-render report.md and the plots).
    pub fn read(dir: &Path) -> Result<Report> {
        let p = dir.join("report.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    }

    /// Writes report.json and report.md into `dir`, then the plots.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)?;
        let json = dir.join("report.json");
        std::fs::write(&json, serde_json::to_string_pretty(self)?)?;
        std::fs::write(dir.join("report.md"), self.markdown())?;
        let mut files = vec![json, dir.join("report.md")];
        files.extend(plot(dir)?);
        Ok(files)
    }
}

/// The plotting script (run with Debian's python3 and python3-matplotlib).
pub const PLOT_PY: &str = include_str!("../plot.py");
/// The interpreter that has Debian's matplotlib.
pub const PYTHON: &str = "/usr/bin/python3";

fn plot(dir: &Path) -> Result<Vec<PathBuf>> {
    for stale in ["throughput.png", "flow_scale.png", "latency.png"] {
        let _ = std::fs::remove_file(dir.join(stale));
    }
    let script = dir.join("plot.py");
    std::fs::write(&script, PLOT_PY)?;
    let out = Command::new(PYTHON)
        .arg(&script)
        .arg(dir.join("report.json"))
        .arg(dir)
        .output()
        .with_context(|| format!("running {PYTHON} (apt-get install python3-matplotlib)"))?;
    if !out.status.success() {
        bail!(
            "plotting failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let _ = std::fs::remove_file(&script);
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect())
}

/// A figure with two decimals, or "not measured".
fn not_measured(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2}"))
        .unwrap_or_else(|| "not measured".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_lists() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    fn row(name: &str, flows: u32, pps: &[f64], ns: f64, saturated: bool) -> ScenarioResult {
        let runs = pps
            .iter()
            .map(|&p| RunFigures {
                delivered_pps: p,
                offered_pps: p * 2.0,
                path_cores: 1.0,
                ns_per_packet: ns,
                saturated,
                ..Default::default()
            })
            .collect();
        ScenarioResult::from_runs(name, flows, runs)
    }

    #[test]
    fn ratios_come_from_saturated_medians_and_are_absent_without_juneau() {
        let mut r = Report::default();
        r.scenarios
            .push(row("nft-dnat", 256, &[100.0, 200.0, 300.0], 1000.0, true));
        r.compute_ratios();
        assert!(r.ratios.juneau_vs_nft_dnat.is_none());
        assert!(r
            .markdown()
            .contains("| juneau / nft-dnat | not measured | not measured |"));
        r.scenarios
            .push(row("juneau", 256, &[300.0, 500.0, 400.0], 250.0, true));
        let point = |flows, pps: f64| {
            let s = row("juneau", flows, &[pps], 300.0, true);
            FlowScalePoint {
                flows,
                runs_pps: s.runs_pps.clone(),
                median_pps: s.median_pps,
                summary: Some(s),
            }
        };
        r.flow_scale = vec![point(1_000_000, 90.0), point(1_000, 100.0)];
        r.compute_ratios();
        assert_eq!(r.ratios.juneau_vs_nft_dnat, Some(2.0));
        assert_eq!(r.ratios.cpu_juneau_vs_nft_dnat, Some(4.0));
        assert!(r.ratios.juneau_xdp_fast_vs_xdp_dnat.is_none());
        assert_eq!(r.ratios.juneau_flow_scale_largest_vs_smallest, Some(0.9));
        let s = &r.scenarios[1];
        assert_eq!((s.min_pps, s.median_pps, s.max_pps), (300.0, 400.0, 500.0));
        assert_eq!(s.pps_per_cpu_second, Some(4_000_000.0));
    }

    fn lat(sc: &str, load: f64, round: u32, p99: f64, p999: f64) -> LatencyPoint {
        LatencyPoint {
            scenario: sc.into(),
            load_fraction: load,
            offered_pps: 1.0,
            round,
            result: ProbeResult {
                sent: 10,
                received: 10,
                p50_us: 1.0,
                p90_us: 1.0,
                p99_us: p99,
                p999_us: p999,
                max_us: p999,
                curve: Vec::new(),
            },
        }
    }

    #[test]
    fn latency_rounds_are_summarised_and_compared_to_nft_dnat_round_by_round() {
        // Round 2 is a noisy moment for both: the paired ratio is not fooled by it.
        let points = vec![
            lat("nft-dnat", 0.1, 0, 100.0, 200.0),
            lat("juneau", 0.1, 0, 50.0, 300.0),
            lat("nft-dnat", 0.1, 1, 1000.0, 2000.0),
            lat("juneau", 0.1, 1, 900.0, 2200.0),
            lat("nft-dnat", 0.1, 2, 120.0, 240.0),
            lat("juneau", 0.1, 2, 60.0, 240.0),
            lat("juneau", 0.5, 0, 70.0, 80.0),
        ];
        let s = latency_summary(&points);
        assert_eq!(s.len(), 3);
        let j = &s[1];
        assert_eq!(
            (j.scenario.as_str(), j.load_fraction, j.rounds),
            ("juneau", 0.1, 3)
        );
        assert_eq!(j.p99_us, [60.0, 50.0, 900.0]);
        assert_eq!(j.p99_vs_nft_dnat, Some(0.5));
        assert_eq!(j.p999_vs_nft_dnat, Some(1.1));
        assert_eq!(s[0].p99_vs_nft_dnat, None, "nft-dnat against itself");
        assert_eq!(s[2].p99_vs_nft_dnat, None, "no nft-dnat point at 50 %");
        let mut r = Report {
            latency: points,
            ..Default::default()
        };
        r.compute_ratios();
        assert_eq!(r.latency_summary, s);
        let md = r.markdown();
        assert!(
            md.contains(
                "| juneau | 10% | 3 | 60.0 (50.0–900.0) | 300.0 (240.0–2200.0) | 0.50 | 1.10 |"
            ),
            "{md}"
        );
    }

    #[test]
    fn the_xdp_dnat_reference_at_scale_is_compared_to_its_own_row() {
        let mut r = Report::default();
        r.scenarios
            .push(row("xdp-dnat", 256, &[1000.0], 500.0, true));
        r.compute_ratios();
        assert!(r.ratios.xdp_dnat_flow_scale.is_none());
        let s = row("xdp-dnat", 1_000_000, &[400.0, 500.0, 450.0], 1000.0, true);
        r.flow_scale_reference = Some(FlowScalePoint {
            flows: 1_000_000,
            runs_pps: s.runs_pps.clone(),
            median_pps: s.median_pps,
            summary: Some(s),
        });
        r.compute_ratios();
        assert_eq!(r.ratios.xdp_dnat_flow_scale, Some(0.45));
        assert_eq!(r.ratios.cpu_xdp_dnat_flow_scale, Some(0.5));
        let md = r.markdown();
        assert!(
            md.contains("| 1000000 (xdp-dnat, reference) | 400, 500, 450 | 450 |"),
            "{md}"
        );
        assert!(md.contains("| (reference) xdp-dnat largest flow count / throughput rows' flows | 0.45 | 0.50 | — |"), "{md}");
    }

    #[test]
    fn no_ratio_from_an_unsaturated_row() {
        let mut r = Report::default();
        r.scenarios
            .push(row("nft-dnat", 256, &[100.0], 1000.0, false));
        r.scenarios.push(row("juneau", 256, &[300.0], 250.0, true));
        r.compute_ratios();
        assert!(r.ratios.juneau_vs_nft_dnat.is_none());
        assert!(r.ratios.cpu_juneau_vs_nft_dnat.is_none());
        assert!(
            r.ratios
                .refused
                .iter()
                .any(|x| x.contains("nft-dnat (256 flows)")),
            "{:?}",
            r.ratios.refused
        );
        let md = r.markdown();
        assert!(md.contains("NO (0 of 1 runs)"), "{md}");
        assert!(md.contains("Refused"), "{md}");
    }
}
