//! The record of one `juneau-perf run` ([`Report`]): every section's rows and the
//! ratios computed from them. Rendering (Markdown, JSON files, plots) is in
//! the `report` module.

use serde::{Deserialize, Serialize};

use crate::bulk_data::{BulkRatio, BulkRow};
use crate::convergence_data::ConvergenceReport;
use crate::loopcost_data::LoopCost;
use crate::results::{
    latency_summary, paired_ratios, Cost, FlowScalePoint, LatencyPoint, LatencySummary, Ratios,
    ScenarioResult,
};
use crate::scale_data::ScaleReport;

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
    pub loop_cost: Option<LoopCost>,
    /// Control-plane convergence: a one-line summary (or why it was not measured).
    pub convergence: String,
    /// Control-plane convergence distributions, when measured.
    #[serde(default)]
    pub convergence_results: Option<ConvergenceReport>,
    /// Control-plane scale (N Services at once), when measured.
    #[serde(default)]
    pub scale: Option<ScaleReport>,
    /// juneau-dataplane's own counters after each `juneau` run (cumulative since its
    /// start): AF_XDP ring drops show where packets were lost.
    pub dataplane_counters: Vec<serde_json::Value>,
    /// The TCP bulk download's rows (`tcp-bulk-<streams>`, juneau and nft-dnat).
    #[serde(default)]
    pub bulk: Vec<BulkRow>,
    /// juneau / nft-dnat of the TCP bulk download per stream count, paired per round.
    #[serde(default)]
    pub bulk_ratios: Vec<BulkRatio>,
    /// Where the time goes: a profile of the path core per path (juneau, afxdp-l2fwd,
    /// nft-dnat), when profiled.
    #[serde(default)]
    pub profiles: Vec<crate::profile::Profile>,
    /// Why nothing was profiled (e.g. ": perf not installed"), if so.
    #[serde(default)]
    pub profile_note: String,
    /// New TCP connections: every run of both paths.
    #[serde(default)]
    pub connect: Vec<crate::connect::ConnectRun>,
    /// juneau / nft-dnat of the new TCP connections, paired per round.
    #[serde(default)]
    pub connect_ratio: Option<crate::connect::ConnectRatio>,
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

    /// Summarises the latency rounds ([`latency_summary`]) and computes the ratios, only
    /// between rows whose every run was saturated (an unsaturated row measures the
    /// generator, not the path): paired round by round (the median of the per-round
    /// ratios, their spread in `ratios.spread`) when both rows have one run per round,
    /// else from the rows' medians (older reports). Refusals are listed in
    /// `ratios.refused`.
    pub fn compute_ratios(&mut self) {
        self.latency_summary = latency_summary(&self.latency);
        let mut refused = Vec::new();
        let mut spread = Vec::new();
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
                    if let Some((pps, cpu, s)) = paired_ratios(what, &a.runs, &b.runs) {
                        spread.push(s);
                        return (Some(pps), Some(cpu));
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
        self.ratios.spread = spread;
        self.bulk_ratios = crate::bulk_data::ratios(&self.bulk);
        self.connect_ratio = crate::connect::ratio(&self.connect);
    }
}
