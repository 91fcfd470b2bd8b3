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
    /// Delivered packets/s of each run (of every kind).
    pub runs_pps: Vec<f64>,
    /// Smallest run of the row's figure kind (see `median_pps`).
    pub min_pps: f64,
    /// The row's figure: the median of its paced windows, of its flooded windows when
    /// none was paced (older reports: of every run). Paced and flooded windows never
    /// share a median: each kind's is in `kinds`.
    pub median_pps: f64,
    /// Largest run of the row's figure kind.
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
    /// Median (over the windows of the row's figure kind) CPU time of the path per
    /// delivered packet, ns: the path core's busy time over the window / packets
    /// delivered in the window (older reports: the path's threads' run time).
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
    /// The row's windows by kind, paced first: each kind's own medians (empty in reports
    /// written before the kinds were told apart, until `render` re-derives them).
    #[serde(default)]
    pub kinds: Vec<KindSummary>,
}

/// How a measured window was offered. Paced and flooded windows measure different
/// things (a flood many times the path's capacity bounces the receive ring between the
/// cores and makes the path look dearer; pacing can make a path that wakes per frame
/// look slower): they never share a median, a ratio or a verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowKind {
    /// The generator paced at the rate the calibration found.
    Paced,
    /// The generator unpaced: pacing gave up, or the last retry of a carried window.
    Flooded,
    /// A report written before the rate asked was recorded.
    Unrecorded,
}

impl WindowKind {
    /// Every kind, in the order a row lists them (the first present is the row's figure).
    pub const ALL: [WindowKind; 3] = [
        WindowKind::Paced,
        WindowKind::Flooded,
        WindowKind::Unrecorded,
    ];

    /// As the report prints it.
    pub fn label(self) -> &'static str {
        match self {
            WindowKind::Paced => "paced",
            WindowKind::Flooded => "flooded",
            WindowKind::Unrecorded => "kind not recorded",
        }
    }
}

/// The windows of one kind of a throughput row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindSummary {
    /// Their kind.
    pub kind: WindowKind,
    /// Their rounds, from 1.
    pub rounds: Vec<usize>,
    /// Every one of them saturated.
    pub saturated: bool,
    /// Delivered packets/s: smallest, median, largest.
    pub min_pps: f64,
    /// See `min_pps`.
    pub median_pps: f64,
    /// See `min_pps`.
    pub max_pps: f64,
    /// Median path-core ns per delivered packet.
    pub ns_per_packet: Option<f64>,
    /// Median of the path's threads' ns per delivered packet.
    pub thread_ns_per_packet: Option<f64>,
    /// `ns_per_packet` in TSC cycles.
    pub cycles_per_packet: Option<f64>,
    /// 1e9 / `ns_per_packet`.
    pub pps_per_cpu_second: Option<f64>,
}

impl KindSummary {
    /// Summarises `runs` (with their 0-based rounds), all of `kind`; `mhz`: the TSC clock.
    fn new(kind: WindowKind, runs: &[(usize, &RunFigures)], mhz: Option<f64>) -> KindSummary {
        let pps: Vec<f64> = runs.iter().map(|(_, f)| f.delivered_pps).collect();
        let finite = |v: Vec<f64>| -> Option<f64> {
            let v: Vec<f64> = v
                .into_iter()
                .filter(|x| x.is_finite() && *x > 0.0)
                .collect();
            (!v.is_empty()).then(|| median(&v))
        };
        let ns = finite(runs.iter().map(|(_, f)| f.cost_ns()).collect());
        KindSummary {
            kind,
            rounds: runs.iter().map(|(i, _)| i + 1).collect(),
            saturated: runs.iter().all(|(_, f)| f.saturated),
            min_pps: pps.iter().copied().fold(f64::INFINITY, f64::min),
            median_pps: median(&pps),
            max_pps: pps.iter().copied().fold(0.0, f64::max),
            ns_per_packet: ns,
            thread_ns_per_packet: finite(runs.iter().map(|(_, f)| f.ns_per_packet).collect()),
            cycles_per_packet: ns.and_then(|m| mhz.map(|mhz| m * mhz / 1e3)),
            pps_per_cpu_second: ns.map(|m| 1e9 / m),
        }
    }
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
    /// The same path's window of the round's common kind, when this window was of
    /// another (see [`common_kind`]): run after every path of the round had its window,
    /// on a fresh topology, and paired in that kind's ratios; this window stays on
    /// record beside it. At most one (flooded: a path paced while another was flooded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<RunFigures>,
    /// Run as a round's extra window (flooded, no calibration): see `also`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub extra: bool,
}

impl RunFigures {
    /// How its window was offered: paced when a rate was asked; flooded when none was
    /// (a calibrated run always records its steps, an extra window says so); else an
    /// older report's.
    pub fn kind(&self) -> WindowKind {
        if self.rate_pps > 0 {
            WindowKind::Paced
        } else if !self.calibration.is_empty() || self.extra {
            WindowKind::Flooded
        } else {
            WindowKind::Unrecorded
        }
    }

    /// Its round's window of `kind`: this one, or the extra one of that kind (`also`).
    pub fn window(&self, kind: WindowKind) -> Option<&RunFigures> {
        std::iter::once(self)
            .chain(&self.also)
            .find(|f| f.kind() == kind)
    }

    /// Its windows: this one, then the extra one (if any).
    pub fn windows(&self) -> impl Iterator<Item = &RunFigures> {
        std::iter::once(self).chain(&self.also)
    }

    /// 1 - delivered / offered (0 when nothing was offered).
    pub fn loss(&self) -> f64 {
        if self.offered_pps > 0.0 {
            (1.0 - self.delivered_pps / self.offered_pps).max(0.0)
        } else {
            0.0
        }
    }

    /// Saturated by loss: delivered below [`SATURATION_DELIVERED_BELOW`] of offered.
    pub fn saturated_by_loss(&self) -> bool {
        self.delivered_pps < SATURATION_DELIVERED_BELOW * self.offered_pps
    }

    /// Saturated by a busy core: the path core at least [`SATURATION_CORE_BUSY`] busy.
    pub fn saturated_by_core(&self) -> bool {
        self.path_core.busy >= SATURATION_CORE_BUSY
    }

    /// Both saturation figures, always stated, then which made it saturated: "loss 12%,
    /// path core 97% busy: saturated by loss and busy core" (or "NOT saturated").
    pub fn saturation_stated(&self) -> String {
        let by = match (self.saturated_by_loss(), self.saturated_by_core()) {
            (true, true) => "saturated by loss and busy core",
            (true, false) => "saturated by loss",
            (false, true) => "saturated by busy core",
            (false, false) => "NOT saturated",
        };
        format!(
            "loss {:.0}%, path core {:.0}% busy: {by}",
            100.0 * self.loss(),
            100.0 * self.path_core.busy
        )
    }

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

/// The kind every path of a round has a window of, given the kinds of the round's
/// windows (one per path): paced when all were paced, else flooded (a flooded window can
/// always be run: the generator unpaced). `None` for no window. The suite runs one extra
/// flooded window for each path paced in a round whose common kind is flooded.
pub fn common_kind(kinds: impl IntoIterator<Item = WindowKind>) -> Option<WindowKind> {
    let mut any = false;
    let mut all_paced = true;
    for k in kinds {
        any = true;
        all_paced &= k == WindowKind::Paced;
    }
    any.then_some(if all_paced {
        WindowKind::Paced
    } else {
        WindowKind::Flooded
    })
}

/// The paths of one round (indices into the round's windows) that lack a window of its
/// common kind ([`common_kind`]): the ones the suite runs an extra window for.
pub fn needs_extra_window(round: &[&RunFigures]) -> Vec<usize> {
    let Some(k) = common_kind(round.iter().map(|f| f.kind())) else {
        return Vec::new();
    };
    (0..round.len())
        .filter(|&i| round[i].window(k).is_none())
        .collect()
}

/// [`needs_extra_window`] for each family of a round apart (`round`: whether the path is
/// IPv6, its window): no ratio pairs an IPv4 row with an IPv6 one, so a flooded IPv6
/// window gives no IPv4 path an extra window, nor the reverse. Indices into `round`.
pub fn needs_extra_window_per_family(round: &[(bool, &RunFigures)]) -> Vec<usize> {
    let mut missing: Vec<usize> = [false, true]
        .into_iter()
        .flat_map(|ipv6| {
            let of: Vec<usize> = (0..round.len()).filter(|&i| round[i].0 == ipv6).collect();
            let windows: Vec<&RunFigures> = of.iter().map(|&i| round[i].1).collect();
            needs_extra_window(&windows).into_iter().map(move |k| of[k])
        })
        .collect();
    missing.sort_unstable();
    missing
}

/// A ratio target's verdict needs at least this many rounds paired within one kind.
pub const MIN_PAIRED_ROUNDS: usize = 5;

/// The windows of `runs` of the kind a row's figure is taken from (paced, else flooded,
/// else an older report's): what a later pass takes a median from (the latency loads,
/// the profile's rate), so that it never mixes kinds either.
pub fn figure_runs(runs: &[RunFigures]) -> Vec<&RunFigures> {
    let Some(k) = WindowKind::ALL
        .into_iter()
        .find(|k| runs.iter().any(|f| f.window(*k).is_some()))
    else {
        return Vec::new();
    };
    runs.iter().filter_map(|f| f.window(k)).collect()
}

/// "round 3" or "rounds 1, 2, 5" (rounds from 1).
pub fn rounds_label(rounds: &[usize]) -> String {
    let list: Vec<String> = rounds.iter().map(|r| r.to_string()).collect();
    format!(
        "round{} {}",
        if rounds.len() == 1 { "" } else { "s" },
        list.join(", ")
    )
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
            kinds: Vec::new(),
        }
    }

    /// Summarizes measured runs: each kind's medians apart ([`KindSummary`]), the row's
    /// figures from the first kind present (paced, else flooded), saturation of every run.
    pub fn from_runs(name: &str, flows: u32, runs: Vec<RunFigures>) -> ScenarioResult {
        ScenarioResult::from_runs_at(name, flows, runs, crate::cpu::tsc_mhz())
    }

    /// [`ScenarioResult::from_runs`] with the TSC clock given (`mhz`).
    pub fn from_runs_at(
        name: &str,
        flows: u32,
        runs: Vec<RunFigures>,
        mhz: Option<f64>,
    ) -> ScenarioResult {
        let mut r =
            ScenarioResult::new(name, flows, runs.iter().map(|f| f.delivered_pps).collect());
        r.offered_pps = runs.iter().map(|f| f.offered_pps).collect();
        r.saturated =
            !runs.is_empty() && runs.iter().flat_map(|f| f.windows()).all(|f| f.saturated);
        r.kinds = WindowKind::ALL
            .into_iter()
            .filter_map(|k| {
                let mine: Vec<(usize, &RunFigures)> = runs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, f)| Some((i, f.window(k)?)))
                    .collect();
                (!mine.is_empty()).then(|| KindSummary::new(k, &mine, mhz))
            })
            .collect();
        if let Some(k) = r.kinds.first() {
            (r.min_pps, r.median_pps, r.max_pps) = (k.min_pps, k.median_pps, k.max_pps);
            r.ns_per_packet = k.ns_per_packet;
            r.thread_ns_per_packet = k.thread_ns_per_packet;
            r.cycles_per_packet = k.cycles_per_packet;
            r.pps_per_cpu_second = k.pps_per_cpu_second;
        }
        r.runs = runs;
        r
    }

    /// The row summarised again from its runs with today's rule (what `render` does to a
    /// kept report), at the TSC clock it was measured with; a row without runs (older
    /// reports) as it was.
    pub fn rederived(&self) -> ScenarioResult {
        if self.runs.is_empty() {
            return self.clone();
        }
        let mhz = match (self.cycles_per_packet, self.ns_per_packet) {
            (Some(c), Some(ns)) if ns > 0.0 => Some(c / ns * 1e3),
            _ => crate::cpu::tsc_mhz(),
        };
        ScenarioResult::from_runs_at(&self.name, self.flows, self.runs.clone(), mhz)
    }

    /// The kind of its figure (the first of `kinds`), if known.
    pub fn figure_kind(&self) -> Option<WindowKind> {
        self.kinds.first().map(|k| k.kind)
    }
}

/// `juneau` at one flow count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FlowScalePoint {
    /// Concurrent flows offered.
    pub flows: u32,
    /// Delivered packets/s of each run.
    pub runs_pps: Vec<f64>,
    /// Median run of the figure's kind (`ScenarioResult::median_pps`).
    pub median_pps: f64,
    /// Saturation and CPU cost of the runs.
    #[serde(default)]
    pub summary: Option<ScenarioResult>,
}

impl FlowScalePoint {
    /// Its row in the report's flow-scale table, `label` after the flow count: each run
    /// with its kind, each kind's median apart (older reports: the runs and the median).
    pub(crate) fn row(&self, label: &str) -> String {
        let kinds = self
            .summary
            .as_ref()
            .map(|s| s.kinds.as_slice())
            .unwrap_or_default();
        let told = kinds.iter().any(|k| k.kind != WindowKind::Unrecorded);
        let runs: Vec<String> = match &self.summary {
            Some(s) if told => s
                .runs
                .iter()
                .flat_map(|r| r.windows())
                .map(|r| {
                    let extra = if r.extra { " (extra)" } else { "" };
                    format!("{:.0} {}{extra}", r.delivered_pps, r.kind().label())
                })
                .collect(),
            _ => self.runs_pps.iter().map(|x| format!("{x:.0}")).collect(),
        };
        let median = if told {
            kinds
                .iter()
                .map(|k| {
                    format!(
                        "{} {:.0} ({} of {})",
                        k.kind.label(),
                        k.median_pps,
                        k.rounds.len(),
                        self.runs_pps.len()
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        } else {
            format!("{:.0}", self.median_pps)
        };
        format!(
            "| {}{label} | {} | {median} |\n",
            self.flows,
            runs.join(", "),
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

/// One ratio from the rounds in which both sides' windows were of one kind: the median
/// of the per-round ratios, with their lowest and highest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindRatio {
    /// The ratio's name as the report's table shows it.
    pub ratio: String,
    /// The kind of both windows of every round paired.
    pub kind: WindowKind,
    /// The rounds paired, from 1.
    pub rounds: Vec<usize>,
    /// Delivered packets/s: median of the per-round ratios.
    pub pps: f64,
    /// Packets per CPU-second: median of the per-round ratios.
    pub cpu: f64,
    /// Delivered packets/s: lowest and highest per-round ratio.
    pub pps_range: (f64, f64),
    /// Packets per CPU-second: lowest and highest per-round ratio.
    pub cpu_range: (f64, f64),
}

/// `a` / `b` paired round by round (run `i` of each came from round `i`), only within a
/// kind: one [`KindRatio`] per kind of which some round has both windows (paced first;
/// a round's extra window of its common kind, `RunFigures::also`, counts as that round's
/// window of that kind), and the rounds left out (0-based, with `a`'s and `b`'s kinds) because their windows
/// were of different kinds. `None` unless both have the same, non-zero number of runs.
#[allow(clippy::type_complexity)]
pub fn paired_ratios(
    name: &str,
    a: &[RunFigures],
    b: &[RunFigures],
) -> Option<(Vec<KindRatio>, Vec<(usize, WindowKind, WindowKind)>)> {
    if a.is_empty() || a.len() != b.len() {
        return None;
    }
    let range = |v: &[f64]| {
        (
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    let shared = |i: usize| {
        WindowKind::ALL
            .into_iter()
            .any(|k| a[i].window(k).is_some() && b[i].window(k).is_some())
    };
    let left_out = (0..a.len())
        .filter(|&i| !shared(i))
        .map(|i| (i, a[i].kind(), b[i].kind()))
        .collect();
    let by_kind = WindowKind::ALL
        .into_iter()
        .filter_map(|k| {
            let pairs: Vec<(usize, &RunFigures, &RunFigures)> = (0..a.len())
                .filter_map(|i| Some((i, a[i].window(k)?, b[i].window(k)?)))
                .collect();
            if pairs.is_empty() {
                return None;
            }
            let rounds: Vec<usize> = pairs.iter().map(|(i, _, _)| *i).collect();
            let pps: Vec<f64> = pairs
                .iter()
                .map(|(_, x, y)| x.delivered_pps / y.delivered_pps.max(1e-9))
                .collect();
            // Packets per CPU-second is 1 / cost: a's over b's is b's cost over a's.
            let cpu: Vec<f64> = pairs
                .iter()
                .map(|(_, x, y)| y.cost_ns() / x.cost_ns().max(1e-9))
                .collect();
            Some(KindRatio {
                ratio: name.to_string(),
                kind: k,
                rounds: rounds.iter().map(|i| i + 1).collect(),
                pps: median(&pps),
                cpu: median(&cpu),
                pps_range: range(&pps),
                cpu_range: range(&cpu),
            })
        })
        .collect();
    Some((by_kind, left_out))
}

/// The ratios the product is held to.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ratios {
    /// The ratios below are each the figure of their first kind in `by_kind` (paced
    /// pairs, else flooded); `by_kind` has every kind's.
    ///
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
    /// The IPv6 rows: juneau6 / nft-dnat6, delivered packets/s (no target: as measured).
    #[serde(default)]
    pub juneau6_vs_nft_dnat6: Option<f64>,
    /// The same in packets per CPU-second.
    #[serde(default)]
    pub cpu_juneau6_vs_nft_dnat6: Option<f64>,
    /// Every ratio per kind of window, paired round by round within the kind (older
    /// reports: empty, their ratios from the rows' medians).
    #[serde(default)]
    pub by_kind: Vec<KindRatio>,
    /// Rounds left out of a ratio because its two windows were of different kinds.
    #[serde(default)]
    pub left_out: Vec<String>,
    /// Ratios whose rows were measured and saturated, but without a single round whose
    /// two windows were of one kind: refused (no like-kind windows).
    #[serde(default)]
    pub no_like_kind: Vec<String>,
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

    /// A calibrated window: paced at `rate` (0: flooded).
    fn window(pps: f64, ns: f64, rate: u64) -> RunFigures {
        RunFigures {
            rate_pps: rate,
            calibration: vec![(2.0 * pps, pps)],
            saturated: true,
            ..run(pps, ns)
        }
    }

    fn one_kind(
        a: &[RunFigures],
        b: &[RunFigures],
    ) -> (KindRatio, Vec<(usize, WindowKind, WindowKind)>) {
        let (mut k, left_out) = paired_ratios("a / b", a, b).expect("paired");
        assert_eq!(k.len(), 1, "{k:?}");
        (k.remove(0), left_out)
    }

    #[test]
    fn ratios_pair_runs_of_the_same_round() {
        // Round 2 was slow for both paths: pairing keeps it from skewing the ratio.
        let a = [run(100.0, 10.0), run(50.0, 20.0), run(110.0, 9.0)];
        let b = [run(200.0, 5.0), run(100.0, 10.0), run(220.0, 4.5)];
        let (k, left_out) = one_kind(&a, &b);
        assert_eq!((k.pps, k.cpu), (0.5, 0.5));
        assert_eq!(k.rounds, vec![1, 2, 3]);
        assert_eq!(k.pps_range, (0.5, 0.5));
        assert!(left_out.is_empty());
        let b = [run(200.0, 5.0), run(25.0, 40.0), run(220.0, 4.5)];
        let (k, _) = one_kind(&a, &b);
        assert_eq!(k.pps, 0.5);
        assert_eq!(k.pps_range, (0.5, 2.0));
        assert_eq!(k.cpu_range, (0.5, 2.0));
    }

    #[test]
    fn a_round_with_mixed_kinds_gets_an_extra_flooded_window_for_each_paced_path() {
        let paced = window(100.0, 10.0, 500);
        let flooded = window(90.0, 11.0, 0);
        // Every path paced: the round's kind is paced, nothing more to run.
        assert_eq!(
            common_kind([WindowKind::Paced, WindowKind::Paced]),
            Some(WindowKind::Paced)
        );
        assert!(needs_extra_window(&[&paced, &paced]).is_empty());
        // One flooded: the round's kind is flooded; each paced path needs a flooded one.
        let round = [&paced, &flooded, &paced];
        assert_eq!(
            common_kind(round.iter().map(|f| f.kind())),
            Some(WindowKind::Flooded)
        );
        assert_eq!(needs_extra_window(&round), vec![0, 2]);
        // Once it ran (kept beside the paced window), nothing is missing.
        let with_extra = RunFigures {
            also: vec![flooded.clone()],
            ..paced.clone()
        };
        assert_eq!(with_extra.kind(), WindowKind::Paced, "the original is kept");
        assert!(needs_extra_window(&[&with_extra, &flooded, &with_extra]).is_empty());
        assert_eq!(common_kind([]), None);
    }

    #[test]
    fn a_flooded_ipv6_window_gives_no_ipv4_path_an_extra_window() {
        let paced = window(100.0, 10.0, 500);
        let flooded = window(90.0, 11.0, 0);
        // IPv4 all paced, IPv6 one flooded: only the paced IPv6 path runs again.
        let round = [
            (false, &paced),
            (false, &paced),
            (true, &paced),
            (true, &flooded),
        ];
        assert_eq!(needs_extra_window_per_family(&round), vec![2]);
        // Across the families it would have been every paced path.
        let all: Vec<&RunFigures> = round.iter().map(|(_, f)| *f).collect();
        assert_eq!(needs_extra_window(&all), vec![0, 1, 2]);
        // And the reverse.
        let round = [(false, &flooded), (false, &paced), (true, &paced)];
        assert_eq!(needs_extra_window_per_family(&round), vec![1]);
    }

    #[test]
    fn pairing_uses_the_rounds_common_kind_with_the_extra_windows() {
        // Round 1: both paced. Round 2: a paced (with its extra flooded window), b
        // flooded: paired flooded. Round 3: a flooded, b paced without an extra window
        // (an older report): left out.
        let extra = |f: RunFigures, also: RunFigures| RunFigures {
            also: vec![also],
            ..f
        };
        let a = [
            window(100.0, 10.0, 500),
            extra(window(1000.0, 1.0, 500), window(60.0, 20.0, 0)),
            window(1.0, 1.0, 0),
        ];
        let b = [
            window(50.0, 20.0, 500),
            window(30.0, 40.0, 0),
            window(1.0, 1.0, 500),
        ];
        let (k, left_out) = paired_ratios("a / b", &a, &b).expect("paired");
        assert_eq!(
            k.iter()
                .map(|k| (k.kind, k.rounds.clone(), k.pps, k.cpu))
                .collect::<Vec<_>>(),
            vec![
                (WindowKind::Paced, vec![1], 2.0, 2.0),
                (WindowKind::Flooded, vec![2], 2.0, 2.0)
            ]
        );
        assert_eq!(left_out, vec![(2, WindowKind::Flooded, WindowKind::Paced)]);
        // The row's kinds take the extra window as round 2's flooded one; its paced
        // window stays in the paced median; every window counts for saturation.
        let s = ScenarioResult::from_runs_at("a", 256, a.to_vec(), None);
        let kinds: Vec<_> = s.kinds.iter().map(|k| (k.kind, k.rounds.clone())).collect();
        assert_eq!(
            kinds,
            vec![
                (WindowKind::Paced, vec![1, 2]),
                (WindowKind::Flooded, vec![2, 3])
            ]
        );
        assert_eq!(s.kinds[1].median_pps, 30.5);
        assert!(s.saturated);
        let mut unsat = a.to_vec();
        unsat[1].also[0].saturated = false;
        assert!(!ScenarioResult::from_runs_at("a", 256, unsat, None).saturated);
    }

    #[test]
    fn saturation_states_the_loss_and_the_busy_core() {
        let mut f = RunFigures {
            delivered_pps: 880.0,
            offered_pps: 1000.0,
            ..Default::default()
        };
        f.path_core.busy = 0.5;
        assert_eq!(
            f.saturation_stated(),
            "loss 12%, path core 50% busy: saturated by loss"
        );
        f.path_core.busy = 0.99;
        assert_eq!(
            f.saturation_stated(),
            "loss 12%, path core 99% busy: saturated by loss and busy core"
        );
        f.delivered_pps = 1000.0;
        assert_eq!(
            f.saturation_stated(),
            "loss 0%, path core 99% busy: saturated by busy core"
        );
        f.path_core.busy = 0.2;
        assert_eq!(
            f.saturation_stated(),
            "loss 0%, path core 20% busy: NOT saturated"
        );
    }

    #[test]
    fn ratios_are_not_paired_across_unequal_rounds() {
        let a = [run(100.0, 10.0)];
        let b = [run(200.0, 5.0), run(100.0, 10.0)];
        assert!(paired_ratios("a / b", &a, &b).is_none());
        assert!(paired_ratios("a / b", &[], &[]).is_none());
    }

    #[test]
    fn a_window_is_paced_flooded_or_of_an_older_report() {
        assert_eq!(window(1.0, 1.0, 1000).kind(), WindowKind::Paced);
        assert_eq!(window(1.0, 1.0, 0).kind(), WindowKind::Flooded);
        assert_eq!(run(1.0, 1.0).kind(), WindowKind::Unrecorded);
    }

    #[test]
    fn a_row_of_paced_and_flooded_windows_has_a_figure_per_kind() {
        // As juneau @ 256 flows in run 2026-12-05-s: rounds 1-3 flooded, 4-5 paced.
        let runs = vec![
            window(630.0, 1425.0, 0),
            window(664.0, 1313.0, 0),
            window(645.0, 1369.0, 0),
            window(569.0, 1496.0, 767),
            window(660.0, 1341.0, 1010),
        ];
        let s = ScenarioResult::from_runs_at("juneau", 256, runs, Some(2600.0));
        let kinds: Vec<(WindowKind, Vec<usize>)> =
            s.kinds.iter().map(|k| (k.kind, k.rounds.clone())).collect();
        assert_eq!(
            kinds,
            vec![
                (WindowKind::Paced, vec![4, 5]),
                (WindowKind::Flooded, vec![1, 2, 3])
            ]
        );
        let (p, f) = (&s.kinds[0], &s.kinds[1]);
        assert_eq!((p.min_pps, p.median_pps, p.max_pps), (569.0, 614.5, 660.0));
        assert_eq!(p.ns_per_packet, Some(1418.5));
        assert_eq!((f.min_pps, f.median_pps, f.max_pps), (630.0, 645.0, 664.0));
        assert_eq!(f.ns_per_packet, Some(1369.0));
        assert_eq!(f.cycles_per_packet, Some(1369.0 * 2600.0 / 1e3));
        // The row's figure is its paced windows' (the mixed median would be 645, 1369).
        assert_eq!((s.median_pps, s.ns_per_packet), (614.5, Some(1418.5)));
        assert_eq!(s.figure_kind(), Some(WindowKind::Paced));
        assert_eq!((s.min_pps, s.max_pps), (569.0, 660.0));
        assert_eq!(s.runs_pps.len(), 5, "every run stays on record");
        // Re-derived at the clock it was measured with, not this machine's.
        let again = s.rederived();
        assert_eq!(again.median_pps, s.median_pps);
        let (c0, c1) = (
            again.cycles_per_packet.unwrap(),
            s.cycles_per_packet.unwrap(),
        );
        assert!((c0 - c1).abs() < 1e-6, "{c0} {c1}");
        // A later pass (latency loads, the profile's rate) takes the same windows.
        let paced: Vec<f64> = figure_runs(&s.runs)
            .iter()
            .map(|f| f.delivered_pps)
            .collect();
        assert_eq!(paced, vec![569.0, 660.0]);
        assert_eq!(median(&paced), s.median_pps);
        // Only flooded windows: the figure is theirs.
        let s = ScenarioResult::from_runs_at(
            "juneau",
            1000,
            vec![window(618.0, 1414.0, 0), window(642.0, 1334.0, 0)],
            None,
        );
        assert_eq!(s.figure_kind(), Some(WindowKind::Flooded));
        assert_eq!(s.median_pps, 630.0);
    }

    #[test]
    fn a_ratio_never_pairs_a_paced_window_with_a_flooded_one() {
        // Round 1 both flooded, round 2 paced against flooded, round 3 both paced,
        // round 4 flooded against paced.
        let a = [
            window(100.0, 10.0, 0),
            window(1000.0, 1.0, 500),
            window(300.0, 10.0, 500),
            window(1.0, 1000.0, 0),
        ];
        let b = [
            window(200.0, 20.0, 0),
            window(1.0, 1000.0, 0),
            window(100.0, 5.0, 500),
            window(1000.0, 1.0, 500),
        ];
        let (k, left_out) = paired_ratios("a / b", &a, &b).expect("paired");
        assert_eq!(k.len(), 2);
        assert_eq!(
            (k[0].kind, k[0].rounds.clone(), k[0].pps, k[0].cpu),
            (WindowKind::Paced, vec![3], 3.0, 0.5)
        );
        assert_eq!(
            (k[1].kind, k[1].rounds.clone(), k[1].pps, k[1].cpu),
            (WindowKind::Flooded, vec![1], 0.5, 2.0)
        );
        assert_eq!(
            left_out,
            vec![
                (1, WindowKind::Paced, WindowKind::Flooded),
                (3, WindowKind::Flooded, WindowKind::Paced)
            ]
        );
        // No round of one kind: nothing paired, every round left out.
        let (k, left_out) = paired_ratios("a / b", &a[1..2], &b[1..2]).expect("paired");
        assert!(k.is_empty());
        assert_eq!(left_out.len(), 1);
    }
}
