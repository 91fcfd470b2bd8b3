//! The scale targets (and the TCP bulk download's, from "carry real traffic"), checked
//! against one run's report: each target with this run's
//! figure and whether it was met, missed, refused or not measured. Pure (reads a
//! [`Report`]), so `render` re-checks an old report.json the same way.

use crate::report_data::{
    Report, JUNEAU_FLOW_SCALE, JUNEAU_VS_AFXDP_L2FWD, JUNEAU_VS_NFT_DNAT,
    JUNEAU_XDP_FAST_VS_XDP_DNAT,
};
use crate::results::{rounds_label, ScenarioResult, MIN_PAIRED_ROUNDS};
use crate::scale_data::{LIVE_GOAL_RATIO, WRITES_GOAL};

/// Whether one target was reached in this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The figure reaches the target.
    Met,
    /// The figure was measured and does not reach the target.
    Missed,
    /// Measured, but a side was not saturated in every run: no ratio is computed.
    Refused,
    /// Measured and saturated, but no round in which both sides' windows were of one
    /// kind (both paced or both flooded): no ratio is computed.
    RefusedNoLikeKind,
    /// Fewer than [`MIN_PAIRED_ROUNDS`] rounds paired within one kind (the most of any
    /// kind): too few for a verdict.
    RefusedFewRounds(usize),
    /// This run did not measure it.
    NotMeasured,
}

impl Verdict {
    /// As the report prints it.
    pub fn label(self) -> String {
        match self {
            Verdict::Met => "met".into(),
            Verdict::Missed => "**MISSED**".into(),
            Verdict::Refused => "refused (unsaturated runs)".into(),
            Verdict::RefusedNoLikeKind => "refused (no like-kind windows)".into(),
            Verdict::RefusedFewRounds(n) => {
                format!("refused ({n} paired rounds < {MIN_PAIRED_ROUNDS})")
            }
            Verdict::NotMeasured => "not measured".into(),
        }
    }
}

/// One target's row.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// What is asked, with its bound.
    pub what: String,
    /// This run's figure.
    pub figure: String,
    /// Met or not.
    pub verdict: Verdict,
}

/// At least `bound`; `None` is refused when `measured` (both sides ran), else not measured.
fn at_least(what: &str, v: Option<f64>, bound: f64, measured: bool) -> Target {
    let verdict = match v {
        Some(x) if x >= bound => Verdict::Met,
        Some(_) => Verdict::Missed,
        None if measured => Verdict::Refused,
        None => Verdict::NotMeasured,
    };
    Target {
        what: what.to_string(),
        figure: v.map_or_else(|| "—".into(), |x| format!("{x:.2}")),
        verdict,
    }
}

/// Every scale target against `r`.
pub fn check(r: &Report) -> Vec<Target> {
    let has = |n: &str| r.scenarios.iter().any(|s| s.name == n);
    let mut t = Vec::new();
    let rows: Vec<_> = r
        .throughput_rows()
        .chain(
            r.flow_scale_reference
                .iter()
                .filter_map(|p| p.summary.as_ref()),
        )
        .collect();
    let unsat: Vec<String> = rows
        .iter()
        .filter(|s| !s.saturated)
        .map(|s| format!("{} @ {} flows", s.name, s.flows))
        .collect();
    let by: Vec<String> = rows.iter().map(|s| saturated_by(s)).collect();
    t.push(Target {
        what: "every throughput row saturated in every run".into(),
        figure: if unsat.is_empty() {
            format!("{} of {} rows: {}", rows.len(), rows.len(), by.join("; "))
        } else {
            format!("not: {}. {}", unsat.join(", "), by.join("; "))
        },
        verdict: if rows.is_empty() {
            Verdict::NotMeasured
        } else if unsat.is_empty() {
            Verdict::Met
        } else {
            Verdict::Missed
        },
    });
    let q = &r.ratios;
    t.push(ratio(
        r,
        JUNEAU_VS_NFT_DNAT,
        at_least(
            "juneau (default, userspace path) / nft-dnat, packets per CPU-second >= 1.0",
            q.cpu_juneau_vs_nft_dnat,
            1.0,
            has("juneau") && has("nft-dnat"),
        ),
        1.0,
    ));
    t.push(ratio(
        r,
        JUNEAU_XDP_FAST_VS_XDP_DNAT,
        at_least(
            "juneau-xdp-fast (opt-in) / xdp-dnat, packets per CPU-second >= 1.0",
            q.cpu_juneau_xdp_fast_vs_xdp_dnat,
            1.0,
            has("juneau-xdp-fast") && has("xdp-dnat"),
        ),
        1.0,
    ));
    t.push(ratio(
        r,
        JUNEAU_VS_AFXDP_L2FWD,
        at_least(
            "juneau / afxdp-l2fwd, packets per CPU-second >= 1.0",
            q.cpu_juneau_vs_afxdp_l2fwd,
            1.0,
            has("juneau") && has("afxdp-l2fwd"),
        ),
        1.0,
    ));
    let mut fs = ratio(
        r,
        JUNEAU_FLOW_SCALE,
        at_least(
            "juneau at the largest / the smallest flow count, packets per CPU-second >= 0.9",
            q.cpu_juneau_flow_scale_largest_vs_smallest,
            0.9,
            r.flow_scale.len() >= 2,
        ),
        0.9,
    );
    let smallest = r.flow_scale.iter().min_by_key(|p| p.flows);
    let largest = r.flow_scale.iter().max_by_key(|p| p.flows);
    if let (Verdict::Refused, Some(lo), Some(hi)) = (fs.verdict, smallest, largest) {
        // Refused for unsaturated runs: the medians as measured, if of one kind.
        let kind =
            |p: &crate::results::FlowScalePoint| p.summary.as_ref().and_then(|s| s.figure_kind());
        if kind(lo) == kind(hi) {
            fs.figure = format!("delivered pps medians {:.2}", hi.median_pps / lo.median_pps);
        }
    }
    t.push(fs);
    t.push(bulk(r));
    t.push(connect(r));
    t.push(latency(r));
    t.push(at_most(
        "engine instructions per established packet <= 150",
        r.cost.established_instructions_per_packet,
        150.0,
        "",
    ));
    t.extend(scale(r));
    t
}

/// Which of the two made a row's windows saturated: "juneau @ 256 flows: by loss 5,
/// by busy core 2 of 5 windows" (every window, extra ones included).
fn saturated_by(s: &ScenarioResult) -> String {
    let w: Vec<_> = s.runs.iter().flat_map(|f| f.windows()).collect();
    if w.is_empty() {
        return format!("{} @ {} flows: windows not recorded", s.name, s.flows);
    }
    let loss = w.iter().filter(|f| f.saturated_by_loss()).count();
    let core = w.iter().filter(|f| f.saturated_by_core()).count();
    format!(
        "{} @ {} flows: by loss {loss}, by busy core {core} of {} windows",
        s.name,
        s.flows,
        w.len()
    )
}

/// A ratio's target from its per-kind figures (`Ratios::by_kind`, named `name`): the
/// kinds paired in at least [`MIN_PAIRED_ROUNDS`] rounds decide, each must reach `bound`
/// (the figure lists every kind with its rounds and the spread of its per-round ratios);
/// with no such kind, refused (N paired rounds < 5); without a like-kind round, refused
/// (no like-kind windows); a report without per-kind ratios (older: the rows' medians,
/// nothing paired) keeps `old`'s figure, refused (0 paired rounds) if it had a verdict.
fn ratio(r: &Report, name: &str, old: Target, bound: f64) -> Target {
    let kinds: Vec<_> = r
        .ratios
        .by_kind
        .iter()
        .filter(|k| k.ratio == name)
        .collect();
    if !kinds.is_empty() {
        let deciding: Vec<_> = kinds
            .iter()
            .filter(|k| k.rounds.len() >= MIN_PAIRED_ROUNDS)
            .collect();
        let most = kinds.iter().map(|k| k.rounds.len()).max().unwrap_or(0);
        return Target {
            figure: kinds
                .iter()
                .map(|k| {
                    format!(
                        "{} {:.2} over {} paired round{} ({}), spread {:.2} – {:.2}{}",
                        k.kind.label(),
                        k.cpu,
                        k.rounds.len(),
                        if k.rounds.len() == 1 { "" } else { "s" },
                        rounds_label(&k.rounds),
                        k.cpu_range.0,
                        k.cpu_range.1,
                        if k.rounds.len() < MIN_PAIRED_ROUNDS {
                            format!(" (< {MIN_PAIRED_ROUNDS}: no verdict)")
                        } else {
                            String::new()
                        }
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
            verdict: if deciding.is_empty() {
                Verdict::RefusedFewRounds(most)
            } else if deciding.iter().all(|k| k.cpu >= bound) {
                Verdict::Met
            } else {
                Verdict::Missed
            },
            ..old
        };
    }
    if r.ratios.no_like_kind.iter().any(|n| n == name) {
        return Target {
            figure: "no round with both windows paced or both flooded".into(),
            verdict: Verdict::RefusedNoLikeKind,
            ..old
        };
    }
    match old.verdict {
        // The rows' medians: no round paired, too few for a verdict.
        Verdict::Met | Verdict::Missed => Target {
            figure: format!("{} (the rows' medians, not paired)", old.figure),
            verdict: Verdict::RefusedFewRounds(0),
            ..old
        },
        _ => old,
    }
}

/// The control-plane scale targets: created live, every ServiceLoadBalancer Ready within
/// [`LIVE_GOAL_RATIO`] x the apiserver alone creating them (same run); precreated, Ready
/// within the run's goal (60 s); Juneau's API writes per Service at most [`WRITES_GOAL`].
/// A mode the run did not measure is not measured.
fn scale(r: &Report) -> Vec<Target> {
    let live = r.scales().find(|s| !s.precreated);
    let pre = r.scales().find(|s| s.precreated);
    // Writes per Service: from the live measurement when there is one (it includes the
    // creates' own churn), else the precreated one.
    let s = live.or(pre);
    let services = s.map_or(10_000, |s| s.services);
    let not_reached = |b: &str| format!("not reached in time{b}");

    let mut lv = Target {
        what: format!(
            "{services} Services created live: every ServiceLoadBalancer Ready <= {LIVE_GOAL_RATIO} x \
             the apiserver alone creating them"
        ),
        figure: "—".into(),
        verdict: Verdict::NotMeasured,
    };
    if let Some(s) = live {
        (lv.figure, lv.verdict) = match (s.all_ready_s, s.apiserver_alone_create_s) {
            (Some(x), Some(b)) if b > 0.0 => (
                format!("{x:.1} s vs baseline {b:.1} s = {:.2} x", x / b),
                if x <= LIVE_GOAL_RATIO * b {
                    Verdict::Met
                } else {
                    Verdict::Missed
                },
            ),
            (None, Some(b)) => (
                not_reached(&format!(" (baseline {b:.1} s)")),
                Verdict::Missed,
            ),
            (Some(x), _) => (format!("{x:.1} s, no baseline"), Verdict::NotMeasured),
            (None, None) => (not_reached(", no baseline"), Verdict::NotMeasured),
        };
    }

    let goal = pre.map_or(60.0, |s| s.goal_s);
    let mut pr = at_most(
        &format!("{services} Services precreated: every ServiceLoadBalancer Ready <= {goal:.0} s"),
        pre.and_then(|s| s.all_ready_s),
        goal,
        " s",
    );
    if pre.is_some_and(|s| s.all_ready_s.is_none()) {
        pr.figure = not_reached("");
        pr.verdict = Verdict::Missed;
    }

    let mut wr = at_most(
        &format!("{services} Services: Juneau's API writes per Service <= {WRITES_GOAL:.0}"),
        s.and_then(|s| s.juneau_writes_per_service),
        WRITES_GOAL,
        "",
    );
    if let (Some(s), Some(w)) = (s, s.and_then(|s| s.juneau_writes_per_service)) {
        wr.figure = format!(
            "{w:.2} ({})",
            if s.precreated { "precreated" } else { "live" }
        );
    }
    vec![lv, pr, wr]
}

/// At most `bound`.
fn at_most(what: &str, v: Option<f64>, bound: f64, unit: &str) -> Target {
    Target {
        what: what.to_string(),
        figure: v.map_or_else(|| "—".into(), |x| format!("{x:.1}{unit}")),
        verdict: match v {
            Some(x) if x <= bound => Verdict::Met,
            Some(_) => Verdict::Missed,
            None => Verdict::NotMeasured,
        },
    }
}

/// The TCP bulk download: juneau / nft-dnat in Gbit per CPU-second, paired per round, at
/// least 1.0 at every stream count measured. Missed when a computed ratio is below;
/// refused when a row was not saturated in every run (the figure shows the ratio as
/// measured, for the record) — except where juneau's row was saturated in every run and
/// only nft-dnat's was not, and the ratio as measured is below 1.0: that is missed too
/// (an unsaturated nft-dnat spent its CPU at a lower load, where it batches less; at
/// saturation its Gbit per CPU-second would not fall, so the ratio would not rise).
fn bulk(r: &Report) -> Target {
    let what = "TCP bulk download: juneau / nft-dnat, Gbit per CPU-second >= 1.0".to_string();
    let q = &r.bulk_ratios;
    if q.is_empty() {
        return Target {
            what,
            figure: "—".into(),
            verdict: Verdict::NotMeasured,
        };
    }
    let figure = q
        .iter()
        .map(|x| {
            let n = format!(
                "{} stream{}",
                x.streams,
                if x.streams == 1 { "" } else { "s" }
            );
            match (x.per_cpu_s, x.per_cpu_s_as_measured) {
                (Some(v), _) => format!("{n} {v:.2}"),
                (None, Some(v)) if missed_against_unsaturated(r, x) => format!(
                    "{n} at most {v:.2} (juneau saturated in every run, nft-dnat not: its \
                     figure at saturation would not be lower)"
                ),
                (None, Some(v)) => format!("{n} refused (as measured {v:.2})"),
                (None, None) => format!("{n} refused"),
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let verdict = if q
        .iter()
        .any(|x| x.per_cpu_s.is_some_and(|v| v < 1.0) || missed_against_unsaturated(r, x))
    {
        Verdict::Missed
    } else if q.iter().any(|x| x.per_cpu_s.is_none()) {
        Verdict::Refused
    } else {
        Verdict::Met
    };
    Target {
        what,
        figure,
        verdict,
    }
}

/// Whether the bulk ratio `x`, refused, is below 1.0 as measured with juneau's row
/// saturated in every run (only nft-dnat's was not).
fn missed_against_unsaturated(r: &Report, x: &crate::bulk_data::BulkRatio) -> bool {
    let saturated = |path: &str| {
        r.bulk
            .iter()
            .any(|row| row.streams == x.streams && row.path == path && row.saturated)
    };
    x.per_cpu_s.is_none()
        && x.per_cpu_s_as_measured.is_some_and(|v| v < 1.0)
        && saturated("juneau")
        && !saturated("nft-dnat")
}

/// New TCP connections: juneau / nft-dnat per CPU-second of the path core, paired per
/// round, at least 1.0; refused (with the figure as measured) unless saturated without a
/// failed connection.
fn connect(r: &Report) -> Target {
    let what = "new TCP connections: juneau / nft-dnat, connections per CPU-second >= 1.0";
    let Some(q) = &r.connect_ratio else {
        return Target {
            what: what.into(),
            figure: "—".into(),
            verdict: Verdict::NotMeasured,
        };
    };
    let mut t = at_least(what, q.per_cpu_s, 1.0, true);
    if let (None, Some(reason)) = (q.per_cpu_s, &q.refused) {
        t.figure = match q.per_cpu_s_as_measured {
            Some(v) => format!("{reason} (as measured {v:.2})"),
            None => reason.clone(),
        };
    }
    t
}

/// juneau's p99 and p99.9 no worse than nft-dnat's (paired ratio <= 1.00) at every load.
fn latency(r: &Report) -> Target {
    let what = "juneau's p99 and p99.9 no worse than nft-dnat's at every load".to_string();
    let rows: Vec<_> = r
        .latency_summary
        .iter()
        .filter(|l| l.scenario == "juneau")
        .collect();
    let pairs: Vec<(f64, f64, f64)> = rows
        .iter()
        .filter_map(|l| Some((l.load_fraction, l.p99_vs_nft_dnat?, l.p999_vs_nft_dnat?)))
        .collect();
    if pairs.is_empty() {
        return Target {
            what,
            figure: "—".into(),
            verdict: Verdict::NotMeasured,
        };
    }
    let worse: Vec<String> = pairs
        .iter()
        .flat_map(|&(load, a, b)| {
            [("p99", a), ("p99.9", b)]
                .into_iter()
                .filter(|(_, x)| *x > 1.0)
                .map(move |(n, x)| format!("{n} {x:.2} at {:.0}%", 100.0 * load))
        })
        .collect();
    let worst = pairs
        .iter()
        .map(|&(_, a, b)| a.max(b))
        .fold(0.0f64, f64::max);
    Target {
        what,
        figure: if worse.is_empty() {
            format!("worst ratio {worst:.2} ({} loads)", pairs.len())
        } else {
            format!("worse: {}", worse.join(", "))
        },
        verdict: if worse.is_empty() && pairs.len() == rows.len() {
            Verdict::Met
        } else {
            Verdict::Missed
        },
    }
}

/// The report's "Targets" section.
pub fn markdown(r: &Report) -> String {
    let mut m =
        String::from("## Targets (the TCP bulk download: \"carry real traffic\")\n\n| target | this run | verdict |\n|---|---|---|\n");
    for t in check(r) {
        m += &format!("| {} | {} | {} |\n", t.what, t.figure, t.verdict.label());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{KindRatio, LatencySummary, ScenarioResult, WindowKind};

    fn sat(name: &str, pps: f64, saturated: bool) -> ScenarioResult {
        let mut s = ScenarioResult::new(name, 256, vec![pps]);
        s.saturated = saturated;
        s
    }

    fn verdict(r: &Report, prefix: &str) -> Verdict {
        check(r)
            .into_iter()
            .find(|t| t.what.starts_with(prefix))
            .unwrap()
            .verdict
    }

    #[test]
    fn an_empty_report_measured_nothing() {
        let r = Report::default();
        assert!(check(&r).iter().all(|t| t.verdict == Verdict::NotMeasured));
    }

    #[test]
    fn ratios_are_met_missed_or_refused() {
        let mut r = Report {
            scenarios: vec![
                sat("juneau", 2e6, true),
                sat("nft-dnat", 1e6, false),
                sat("juneau-xdp-fast", 3e6, true),
                sat("xdp-dnat", 3e6, true),
            ],
            ..Report::default()
        };
        let five = vec![1, 2, 3, 4, 5];
        r.ratios.cpu_juneau_xdp_fast_vs_xdp_dnat = Some(0.99);
        r.ratios.by_kind = vec![kind_ratio(
            JUNEAU_XDP_FAST_VS_XDP_DNAT,
            WindowKind::Paced,
            0.99,
            five.clone(),
        )];
        assert_eq!(verdict(&r, "juneau (default"), Verdict::Refused);
        assert_eq!(verdict(&r, "juneau-xdp-fast (opt-in)"), Verdict::Missed);
        assert_eq!(verdict(&r, "every throughput row"), Verdict::Missed);
        r.ratios.cpu_juneau_vs_nft_dnat = Some(1.0);
        r.ratios.by_kind.push(kind_ratio(
            JUNEAU_VS_NFT_DNAT,
            WindowKind::Flooded,
            1.0,
            five.clone(),
        ));
        assert_eq!(verdict(&r, "juneau (default"), Verdict::Met);
        r.ratios.cpu_juneau_xdp_fast_vs_xdp_dnat = None;
        r.ratios.by_kind.remove(0);
        assert_eq!(verdict(&r, "juneau-xdp-fast (opt-in)"), Verdict::Refused);
        r.scenarios.retain(|s| s.name != "juneau-xdp-fast");
        assert_eq!(
            verdict(&r, "juneau-xdp-fast (opt-in)"),
            Verdict::NotMeasured,
            "the fast-path target is the fast-path row's, not the default path's"
        );
    }

    #[test]
    fn a_ratio_of_the_rows_medians_paired_no_round_and_is_refused() {
        // An older report: its ratio from the rows' medians, no per-round pairs.
        let mut r = Report {
            scenarios: vec![sat("juneau", 2e6, true), sat("nft-dnat", 1e6, true)],
            ..Report::default()
        };
        r.ratios.cpu_juneau_vs_nft_dnat = Some(1.2);
        let t = target(&r, "juneau (default");
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (
                Verdict::RefusedFewRounds(0),
                "1.20 (the rows' medians, not paired)"
            )
        );
        assert_eq!(t.verdict.label(), "refused (0 paired rounds < 5)");
    }

    #[test]
    fn every_row_saturated_says_by_loss_or_by_busy_core() {
        use crate::results::RunFigures;
        let w = |delivered: f64, busy: f64| {
            let mut f = RunFigures {
                delivered_pps: delivered,
                offered_pps: 100.0,
                rate_pps: 100,
                ..RunFigures::default()
            };
            f.path_core.busy = busy;
            f.saturated = f.saturated_by_loss() || f.saturated_by_core();
            f
        };
        let row =
            |name: &str, runs: Vec<RunFigures>| ScenarioResult::from_runs_at(name, 256, runs, None);
        let mut r = Report {
            scenarios: vec![
                row("juneau", vec![w(80.0, 0.5), w(80.0, 0.99)]),
                row("nft-dnat", vec![w(100.0, 0.99), w(100.0, 0.97)]),
            ],
            ..Report::default()
        };
        let t = target(&r, "every throughput row");
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (
                Verdict::Met,
                "2 of 2 rows: juneau @ 256 flows: by loss 2, by busy core 1 of 2 windows; \
                 nft-dnat @ 256 flows: by loss 0, by busy core 2 of 2 windows"
            )
        );
        r.scenarios[1] = row("nft-dnat", vec![w(100.0, 0.99), w(100.0, 0.5)]);
        let t = target(&r, "every throughput row");
        assert_eq!(t.verdict, Verdict::Missed);
        assert!(
            t.figure
                .starts_with("not: nft-dnat @ 256 flows. juneau @ 256 flows: by loss 2"),
            "{}",
            t.figure
        );
    }

    #[test]
    fn one_worse_latency_figure_misses() {
        let row = |load, a, b| LatencySummary {
            scenario: "juneau".into(),
            load_fraction: load,
            rounds: 3,
            p99_vs_nft_dnat: Some(a),
            p999_vs_nft_dnat: Some(b),
            ..LatencySummary::default()
        };
        let mut r = Report {
            latency_summary: vec![row(0.1, 0.5, 0.9), row(0.9, 1.0, 0.7)],
            ..Report::default()
        };
        assert_eq!(verdict(&r, "juneau's p99"), Verdict::Met);
        r.latency_summary.push(row(0.5, 0.8, 1.17));
        let t = check(&r)
            .into_iter()
            .find(|t| t.what.starts_with("juneau's p99"))
            .unwrap();
        assert_eq!(t.verdict, Verdict::Missed);
        assert!(t.figure.contains("p99.9 1.17 at 50%"), "{}", t.figure);
    }

    #[test]
    fn tcp_bulk_is_met_missed_or_refused_over_every_stream_count() {
        use crate::bulk_data::BulkRatio;
        let q = |streams, v: Option<f64>, measured| BulkRatio {
            streams,
            rounds: 3,
            gbps: Some(1.0),
            per_cpu_s: v,
            per_cpu_s_as_measured: Some(measured),
            refused: v.is_none().then(|| "not all runs saturated".to_string()),
        };
        let mut r = Report::default();
        assert_eq!(verdict(&r, "TCP bulk"), Verdict::NotMeasured);
        r.bulk_ratios = vec![q(1, Some(1.2), 1.2), q(16, Some(1.0), 1.0)];
        assert_eq!(verdict(&r, "TCP bulk"), Verdict::Met);
        r.bulk_ratios[1] = q(16, None, 0.4);
        let t = check(&r)
            .into_iter()
            .find(|t| t.what.starts_with("TCP bulk"))
            .unwrap();
        assert_eq!(t.verdict, Verdict::Refused);
        assert_eq!(
            t.figure,
            "1 stream 1.20, 16 streams refused (as measured 0.40)"
        );
        r.bulk_ratios[0] = q(1, Some(0.6), 0.6);
        assert_eq!(verdict(&r, "TCP bulk"), Verdict::Missed);
    }

    #[test]
    fn tcp_bulk_below_one_with_only_nft_dnat_unsaturated_is_missed() {
        use crate::bulk_data::{BulkRatio, BulkRow};
        let ratio = |measured| BulkRatio {
            streams: 1,
            rounds: 5,
            gbps: Some(0.1),
            per_cpu_s: None,
            per_cpu_s_as_measured: Some(measured),
            refused: Some("nft-dnat not saturated".into()),
        };
        let row = |path: &str, saturated| BulkRow {
            name: "tcp-bulk-1".into(),
            path: path.into(),
            streams: 1,
            saturated,
            ..BulkRow::default()
        };
        let mut r = Report {
            bulk: vec![row("juneau", true), row("nft-dnat", false)],
            bulk_ratios: vec![ratio(0.06)],
            ..Report::default()
        };
        let t = target(&r, "TCP bulk");
        assert_eq!(t.verdict, Verdict::Missed);
        assert!(
            t.figure.starts_with("1 stream at most 0.06"),
            "{}",
            t.figure
        );
        // Above 1.0 as measured: nothing can be said (a saturated nft-dnat may do better).
        r.bulk_ratios = vec![ratio(1.3)];
        assert_eq!(verdict(&r, "TCP bulk"), Verdict::Refused);
        // juneau not saturated in every run: its own figure may still improve.
        r.bulk_ratios = vec![ratio(0.06)];
        r.bulk[0].saturated = false;
        assert_eq!(verdict(&r, "TCP bulk"), Verdict::Refused);
    }

    fn scale_report(precreated: bool) -> Report {
        Report {
            scale: Some(crate::scale_data::ScaleReport {
                services: 10_000,
                goal_s: 60.0,
                precreated,
                ..Default::default()
            }),
            ..Report::default()
        }
    }

    fn target(r: &Report, prefix: &str) -> Target {
        check(r)
            .into_iter()
            .find(|t| t.what.starts_with(prefix))
            .unwrap()
    }

    const LIVE: &str = "10000 Services created live";
    const PRE: &str = "10000 Services precreated";
    const WRITES: &str = "10000 Services: Juneau's API writes";

    #[test]
    fn scale_live_is_against_the_apiserver_alone() {
        let mut r = scale_report(false);
        let s = r.scale.as_mut().unwrap();
        s.apiserver_alone_create_s = Some(50.0);
        s.all_ready_s = Some(59.9);
        let t = target(&r, LIVE);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::Met, "59.9 s vs baseline 50.0 s = 1.20 x")
        );
        assert!(
            t.what.contains("Ready <= 1.2 x the apiserver alone"),
            "{}",
            t.what
        );
        r.scale.as_mut().unwrap().all_ready_s = Some(61.0);
        assert_eq!(verdict(&r, LIVE), Verdict::Missed);
        r.scale.as_mut().unwrap().all_ready_s = None;
        let t = target(&r, LIVE);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::Missed, "not reached in time (baseline 50.0 s)")
        );
        // An older live report, without a baseline: nothing to compare with.
        let s = r.scale.as_mut().unwrap();
        (s.all_ready_s, s.apiserver_alone_create_s) = (Some(30.0), None);
        let t = target(&r, LIVE);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::NotMeasured, "30.0 s, no baseline")
        );
        // Live: the precreated target was not measured.
        assert_eq!(verdict(&r, PRE), Verdict::NotMeasured);
    }

    #[test]
    fn scale_precreated_is_against_60_s_and_not_reached_is_missed() {
        let mut r = scale_report(true);
        r.scale.as_mut().unwrap().all_ready_s = Some(200.7);
        assert_eq!(verdict(&r, PRE), Verdict::Missed);
        r.scale.as_mut().unwrap().all_ready_s = None;
        let t = target(&r, PRE);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::Missed, "not reached in time")
        );
        r.scale.as_mut().unwrap().all_ready_s = Some(59.0);
        assert_eq!(verdict(&r, PRE), Verdict::Met);
        // Precreated: the live target was not measured, even with a (stray) baseline.
        r.scale.as_mut().unwrap().apiserver_alone_create_s = Some(100.0);
        assert_eq!(verdict(&r, LIVE), Verdict::NotMeasured);
    }

    #[test]
    fn scale_writes_per_service_are_met_missed_or_not_measured() {
        let mut r = scale_report(true);
        assert_eq!(verdict(&r, WRITES), Verdict::NotMeasured);
        r.scale.as_mut().unwrap().juneau_writes_per_service = Some(6.08);
        let t = target(&r, WRITES);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::Missed, "6.08 (precreated)")
        );
        let mut r = scale_report(false);
        r.scale.as_mut().unwrap().juneau_writes_per_service = Some(3.0);
        let t = target(&r, WRITES);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::Met, "3.00 (live)")
        );
    }

    #[test]
    fn one_run_with_both_scale_modes_gives_every_scale_verdict() {
        let mut r = scale_report(false);
        let s = r.scale.as_mut().unwrap();
        (s.apiserver_alone_create_s, s.all_ready_s) = (Some(80.0), Some(500.0));
        s.juneau_writes_per_service = Some(4.2);
        r.scale_precreated = scale_report(true).scale;
        let p = r.scale_precreated.as_mut().unwrap();
        (p.all_ready_s, p.juneau_writes_per_service) = (Some(45.0), Some(2.5));
        assert_eq!(verdict(&r, LIVE), Verdict::Missed);
        assert_eq!(verdict(&r, PRE), Verdict::Met);
        // The writes come from the live measurement (the creates' churn included).
        let t = target(&r, WRITES);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (Verdict::Missed, "4.20 (live)")
        );
        // The report shows both measurements, each under its own heading.
        let md = r.markdown();
        assert!(md.contains("## Control-plane scale (created live)"), "{md}");
        assert!(md.contains("## Control-plane scale (precreated)"), "{md}");
    }

    #[test]
    fn no_scale_run_measured_no_scale_target() {
        let r = Report::default();
        let t = check(&r);
        let scale: Vec<_> = t
            .iter()
            .filter(|t| t.what.starts_with("10000 Services"))
            .collect();
        assert_eq!(scale.len(), 3);
        assert!(scale.iter().all(|t| t.verdict == Verdict::NotMeasured));
    }

    fn kind_ratio(name: &str, kind: WindowKind, cpu: f64, rounds: Vec<usize>) -> KindRatio {
        KindRatio {
            ratio: name.into(),
            kind,
            rounds,
            pps: cpu,
            cpu,
            pps_range: (cpu, cpu),
            cpu_range: (cpu, cpu),
        }
    }

    #[test]
    fn a_ratio_target_needs_five_paired_rounds_of_a_kind_and_prints_their_spread() {
        let mut r = Report {
            scenarios: vec![sat("juneau", 2e6, true), sat("nft-dnat", 1e6, true)],
            ..Report::default()
        };
        const T: &str = "juneau (default";
        // Fewer than 5 rounds of every kind: refused, whatever the figures say.
        r.ratios.cpu_juneau_vs_nft_dnat = Some(1.2);
        r.ratios.by_kind = vec![
            kind_ratio(JUNEAU_VS_NFT_DNAT, WindowKind::Paced, 1.2, vec![1, 2]),
            kind_ratio(JUNEAU_VS_NFT_DNAT, WindowKind::Flooded, 0.8, vec![4]),
        ];
        let t = target(&r, T);
        assert_eq!(
            (t.verdict, t.figure.as_str()),
            (
                Verdict::RefusedFewRounds(2),
                "paced 1.20 over 2 paired rounds (rounds 1, 2), spread 1.20 – 1.20 (< 5: no verdict); \
                 flooded 0.80 over 1 paired round (round 4), spread 0.80 – 0.80 (< 5: no verdict)"
            )
        );
        assert!(markdown(&r).contains("| refused (2 paired rounds < 5) |"));
        // Five flooded rounds decide (the paced line with 2 is shown, not counted).
        r.ratios.by_kind[1].rounds = vec![1, 2, 3, 4, 5];
        r.ratios.by_kind[1].cpu_range = (0.7, 0.9);
        let t = target(&r, T);
        assert_eq!(t.verdict, Verdict::Missed);
        assert!(
            t.figure.ends_with(
                "flooded 0.80 over 5 paired rounds (rounds 1, 2, 3, 4, 5), spread 0.70 – 0.90"
            ),
            "{}",
            t.figure
        );
        r.ratios.by_kind[1].cpu = 1.0;
        assert_eq!(verdict(&r, T), Verdict::Met);
        // No round with two windows of one kind: refused, whatever the old figure.
        r.ratios.by_kind.clear();
        r.ratios.no_like_kind = vec![JUNEAU_VS_NFT_DNAT.into()];
        let t = target(&r, T);
        assert_eq!(t.verdict, Verdict::RefusedNoLikeKind);
        assert_eq!(t.verdict.label(), "refused (no like-kind windows)");
        assert!(markdown(&r).contains(
            "| no round with both windows paced or both flooded | refused (no like-kind windows) |"
        ));
        // The other ratios are not touched by it.
        assert_eq!(verdict(&r, "juneau / afxdp-l2fwd"), Verdict::NotMeasured);
    }
}
