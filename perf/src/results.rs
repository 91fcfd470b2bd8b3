//! The plain rows the report records: throughput per scenario and run, flow scale,
//! latency points and their summary, the userspace cost, the ratios, and the figures
//! they share ([`median`], the saturation bounds). Measuring modules fill them; the
//! report renders them.

use serde::{Deserialize, Serialize};

use crate::cpu::CoreLoad;
use crate::latency::ProbeResult;

/// Saturation: the path delivered visibly less than was offered (the receive ring
/// overflowed), or its core was (nearly) fully busy.
pub const SATURATION_DELIVERED_BELOW: f64 = 0.97;
/// Saturation by core time: the path core's busy share at or above this.
pub const SATURATION_CORE_BUSY: f64 = 0.95;

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
    /// Packets/s the backend's application read in the window (older reports: counted
    /// by an XDP sink on the backend's veth).
    pub delivered_pps: f64,
    /// Datagrams the backend's socket dropped in the window (its receive buffer full):
    /// a loss at the application, not the path's.
    #[serde(default)]
    pub backend_socket_drops: u64,
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
    pub path_core: CoreLoad,
    /// The generator core's time shares (a kernel path whose work leaked onto the
    /// generator's core would show here as softirq).
    #[serde(default)]
    pub gen_core: CoreLoad,
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

/// The median over `pairs` (runs of one round, this path's and the baseline's) of
/// `f(a) / f(b)`, leaving out pairs whose baseline figure is 0; `None` without any.
pub fn paired_median<T>(pairs: &[(&T, &T)], f: impl Fn(&T) -> f64) -> Option<f64> {
    let v: Vec<f64> = pairs
        .iter()
        .filter(|(_, b)| f(b) > 0.0)
        .map(|(a, b)| f(a) / f(b))
        .collect();
    (!v.is_empty()).then(|| median(&v))
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
    pub(crate) fn row(&self, label: &str) -> String {
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
    /// The background rate asked, when it was the same for every path (`load_fraction`
    /// is then what that rate was of this path's median); `None`: a fraction of each
    /// path's own median.
    #[serde(default)]
    pub background_pps: Option<u64>,
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
    /// Offered background load as a fraction of the scenario's median throughput (for an
    /// absolute rate: the median over the rounds of what it was).
    pub load_fraction: f64,
    /// The background rate, when the same for every path.
    #[serde(default)]
    pub background_pps: Option<u64>,
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

/// A latency point's load: an absolute background rate, or a fraction of the path's own
/// median (points of the same load are summarised and paired together).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Load {
    Absolute(u64),
    Fraction(f64),
}

impl LatencyPoint {
    fn load(&self) -> Load {
        match self.background_pps {
            Some(r) => Load::Absolute(r),
            None => Load::Fraction(self.load_fraction),
        }
    }
}

/// Summarises latency points by (scenario, load), in the order first seen.
pub fn latency_summary(points: &[LatencyPoint]) -> Vec<LatencySummary> {
    let mut keys: Vec<(&str, Load)> = Vec::new();
    for l in points {
        if !keys.contains(&(l.scenario.as_str(), l.load())) {
            keys.push((l.scenario.as_str(), l.load()));
        }
    }
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        [median(v), lo, hi]
    };
    let at = |sc: &str, load: Load, round: u32| {
        points
            .iter()
            .find(|l| l.scenario == sc && l.load() == load && l.round == round)
    };
    keys.into_iter()
        .map(|(sc, load)| {
            let mine: Vec<&LatencyPoint> = points
                .iter()
                .filter(|l| l.scenario == sc && l.load() == load)
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
            let fractions: Vec<f64> = mine.iter().map(|l| l.load_fraction).collect();
            LatencySummary {
                scenario: sc.to_string(),
                load_fraction: median(&fractions),
                background_pps: match load {
                    Load::Absolute(r) => Some(r),
                    Load::Fraction(_) => None,
                },
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
    /// to: redirect-record look-up and encapsulation in place.
    #[serde(default)]
    pub redirect_ask_instructions_per_packet: Option<f64>,
    /// Instructions per packet at the owner of a redirected packet: outer headers
    /// stripped, then served as its own established flow.
    #[serde(default)]
    pub redirect_own_instructions_per_packet: Option<f64>,
}

/// One ratio's per-round values: the lowest and highest over the rounds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RatioSpread {
    /// The ratio's name as the report's table shows it.
    pub ratio: String,
    /// Rounds paired.
    pub rounds: usize,
    /// Delivered packets/s: lowest and highest per-round ratio.
    pub pps: (f64, f64),
    /// Packets per CPU-second: lowest and highest per-round ratio.
    pub cpu: (f64, f64),
}

/// `a` / `b` paired run by run (run `i` of each came from round `i`): the medians of the
/// per-round ratios of delivered packets/s and of packets per CPU-second, with their
/// spread. `None` unless both have the same, non-zero number of runs.
pub fn paired_ratios(
    name: &str,
    a: &[RunFigures],
    b: &[RunFigures],
) -> Option<(f64, f64, RatioSpread)> {
    if a.is_empty() || a.len() != b.len() {
        return None;
    }
    let pps: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.delivered_pps / y.delivered_pps.max(1e-9))
        .collect();
    // Packets per CPU-second is 1 / cost: a's over b's is b's cost over a's.
    let cpu: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(x, y)| y.cost_ns() / x.cost_ns().max(1e-9))
        .collect();
    let range = |v: &[f64]| {
        (
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    Some((
        median(&pps),
        median(&cpu),
        RatioSpread {
            ratio: name.to_string(),
            rounds: a.len(),
            pps: range(&pps),
            cpu: range(&cpu),
        },
    ))
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
    /// Each ratio's spread over the rounds, when both sides have one run per round (the
    /// ratios are then medians of the per-round ratios, paired round by round).
    #[serde(default)]
    pub spread: Vec<RatioSpread>,
    /// Ratios not computed, and why (a side not saturated, or not measured).
    #[serde(default)]
    pub refused: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pps: f64, ns: f64) -> RunFigures {
        RunFigures {
            delivered_pps: pps,
            core_ns_per_packet: ns,
            ..Default::default()
        }
    }

    #[test]
    fn ratios_pair_runs_of_the_same_round() {
        // Round 2 was slow for both paths: pairing keeps it from skewing the ratio.
        let a = [run(100.0, 10.0), run(50.0, 20.0), run(110.0, 9.0)];
        let b = [run(200.0, 5.0), run(100.0, 10.0), run(220.0, 4.5)];
        let (pps, cpu, s) = paired_ratios("a / b", &a, &b).expect("paired");
        assert_eq!(pps, 0.5);
        assert_eq!(cpu, 0.5);
        assert_eq!(s.rounds, 3);
        assert_eq!(s.pps, (0.5, 0.5));
        let b = [run(200.0, 5.0), run(25.0, 40.0), run(220.0, 4.5)];
        let (pps, _, s) = paired_ratios("a / b", &a, &b).expect("paired");
        assert_eq!(pps, 0.5);
        assert_eq!(s.pps, (0.5, 2.0));
        assert_eq!(s.cpu, (0.5, 2.0));
    }

    #[test]
    fn ratios_are_not_paired_across_unequal_rounds() {
        let a = [run(100.0, 10.0)];
        let b = [run(200.0, 5.0), run(100.0, 10.0)];
        assert!(paired_ratios("a / b", &a, &b).is_none());
        assert!(paired_ratios("a / b", &[], &[]).is_none());
    }
}
