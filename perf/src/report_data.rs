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
    /// Control-plane scale (N Services at once), when measured: created live (in reports
    /// before 2026-12-06 also a precreated measurement, its `precreated` set).
    #[serde(default)]
    pub scale: Option<ScaleReport>,
    /// The same with the Services created before the Juneau daemons start, when measured.
    #[serde(default)]
    pub scale_precreated: Option<ScaleReport>,
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

    /// The scale measurements, live first.
    pub fn scales(&self) -> impl Iterator<Item = &ScaleReport> {
        self.scale.iter().chain(self.scale_precreated.iter())
    }

    /// Records a failed scenario.
    pub fn add_error(&mut self, scenario: &str, msg: String) {
        self.errors.push((scenario.into(), msg));
    }

    /// Summarises the latency rounds ([`latency_summary`]) and computes every ratio
    /// ([`Report::compute_throughput_ratios`], the TCP bulk download's, new connections').
    pub fn compute_ratios(&mut self) {
        self.latency_summary = latency_summary(&self.latency);
        self.compute_throughput_ratios();
        self.bulk_ratios = crate::bulk_data::ratios(&self.bulk);
        self.connect_ratio = crate::connect::ratio(&self.connect);
    }

    /// What `render` does to a kept report.json: every throughput row summarised again
    /// from its runs with today's rule (paced and flooded windows apart) and the
    /// throughput ratios computed again; the other sections stay as recorded.
    pub fn rederive_throughput(&mut self) {
        for s in &mut self.scenarios {
            *s = s.rederived();
        }
        for p in self
            .flow_scale
            .iter_mut()
            .chain(self.flow_scale_reference.iter_mut())
        {
            if let Some(s) = &p.summary {
                let s = s.rederived();
                p.median_pps = s.median_pps;
                p.summary = Some(s);
            }
        }
        self.compute_throughput_ratios();
    }

    /// The throughput ratios, only between rows whose every run was saturated (an
    /// unsaturated row measures the generator, not the path), paired round by round and
    /// only within a kind of window ([`paired_ratios`]: a round whose two windows are
    /// one paced, one flooded is left out and listed in `ratios.left_out`; without any
    /// like-kind round the ratio is refused and listed in `ratios.no_like_kind`). Rows
    /// without runs (older reports), or not with one run per round: from the rows'
    /// medians, when their figures are of one kind. Refusals are listed in
    /// `ratios.refused`.
    pub fn compute_throughput_ratios(&mut self) {
        let mut refused = Vec::new();
        let mut by_kind = Vec::new();
        let mut left_out = Vec::new();
        let mut no_like_kind = Vec::new();
        let find = |n: &str| self.scenarios.iter().find(|s| s.name == n).cloned();
        let label = |s: &ScenarioResult, other: &ScenarioResult| {
            if s.name == other.name {
                format!("{} flows", s.flows)
            } else {
                s.name.clone()
            }
        };
        let medians = |a: &ScenarioResult, b: &ScenarioResult| {
            let pps = (b.median_pps > 0.0).then(|| a.median_pps / b.median_pps);
            let cpu = match (a.pps_per_cpu_second, b.pps_per_cpu_second) {
                (Some(x), Some(y)) if y > 0.0 => Some(x / y),
                _ => None,
            };
            (pps, cpu)
        };
        let mut pair = |a: Option<ScenarioResult>, b: Option<ScenarioResult>, what: &str| match (
            a, b,
        ) {
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
                if a.runs.is_empty() || b.runs.is_empty() {
                    // An older report: no windows on record, only the medians.
                    return medians(&a, &b);
                }
                let Some((kinds, out)) = paired_ratios(what, &a.runs, &b.runs) else {
                    // Not one run per round: the rows' medians, if of one kind.
                    if a.figure_kind() != b.figure_kind() {
                        refused.push(format!(
                                "{what}: no like-kind windows: not one run per round, and the rows' figures are of different kinds"
                            ));
                        no_like_kind.push(what.to_string());
                        return (None, None);
                    }
                    return medians(&a, &b);
                };
                let (la, lb) = (label(&a, &b), label(&b, &a));
                if !out.is_empty() {
                    left_out.push(format!(
                        "{what}: {}",
                        out.iter()
                            .map(|(i, ka, kb)| format!(
                                "round {} ({la} {}, {lb} {})",
                                i + 1,
                                ka.label(),
                                kb.label()
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                let Some(first) = kinds.first().cloned() else {
                    refused.push(format!(
                            "{what}: no like-kind windows: no round in which both were paced or both flooded"
                        ));
                    no_like_kind.push(what.to_string());
                    return (None, None);
                };
                by_kind.extend(kinds);
                (Some(first.pps), Some(first.cpu))
            }
            _ => {
                refused.push(format!("{what}: a side was not measured"));
                (None, None)
            }
        };
        let j = find("juneau");
        let (a, b) = pair(j.clone(), find("nft-dnat"), JUNEAU_VS_NFT_DNAT);
        self.ratios.juneau_vs_nft_dnat = a;
        self.ratios.cpu_juneau_vs_nft_dnat = b;
        let (a, b) = pair(
            find("juneau-xdp-fast"),
            find("xdp-dnat"),
            JUNEAU_XDP_FAST_VS_XDP_DNAT,
        );
        self.ratios.juneau_xdp_fast_vs_xdp_dnat = a;
        self.ratios.cpu_juneau_xdp_fast_vs_xdp_dnat = b;
        let (a, b) = pair(j, find("afxdp-l2fwd"), JUNEAU_VS_AFXDP_L2FWD);
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
            (Some(s), Some(l)) if s.flows != l.flows => {
                pair(Some(summary(l)), Some(summary(s)), JUNEAU_FLOW_SCALE)
            }
            _ => (None, None),
        };
        self.ratios.juneau_flow_scale_largest_vs_smallest = a;
        self.ratios.cpu_juneau_flow_scale_largest_vs_smallest = b;
        let (a, b) = match &self.flow_scale_reference {
            Some(r) => pair(r.summary.clone(), find("xdp-dnat"), XDP_DNAT_FLOW_SCALE),
            None => (None, None),
        };
        self.ratios.xdp_dnat_flow_scale = a;
        self.ratios.cpu_xdp_dnat_flow_scale = b;
        // The IPv6 rows, when a run measured any (no target: as measured).
        let (j6, n6) = (find("juneau6"), find("nft-dnat6"));
        let (a, b) = if j6.is_some() || n6.is_some() {
            pair(j6, n6, JUNEAU6_VS_NFT_DNAT6)
        } else {
            (None, None)
        };
        self.ratios.juneau6_vs_nft_dnat6 = a;
        self.ratios.cpu_juneau6_vs_nft_dnat6 = b;
        self.ratios.refused = refused;
        self.ratios.by_kind = by_kind;
        self.ratios.left_out = left_out;
        self.ratios.no_like_kind = no_like_kind;
    }
}

/// The ratios' names (in `Ratios::by_kind`, `no_like_kind`, the report's tables).
pub const JUNEAU_VS_NFT_DNAT: &str = "juneau / nft-dnat";
/// See [`JUNEAU_VS_NFT_DNAT`].
pub const JUNEAU_XDP_FAST_VS_XDP_DNAT: &str = "juneau-xdp-fast / xdp-dnat";
/// See [`JUNEAU_VS_NFT_DNAT`].
pub const JUNEAU_VS_AFXDP_L2FWD: &str = "juneau / afxdp-l2fwd";
/// See [`JUNEAU_VS_NFT_DNAT`].
pub const JUNEAU_FLOW_SCALE: &str = "juneau largest / smallest flow count";
/// See [`JUNEAU_VS_NFT_DNAT`] (the IPv6 rows; no target).
pub const JUNEAU6_VS_NFT_DNAT6: &str = "juneau6 / nft-dnat6";
/// See [`JUNEAU_VS_NFT_DNAT`] (no target).
pub const XDP_DNAT_FLOW_SCALE: &str = "xdp-dnat largest flow count / throughput rows";
