//! The report: `report.json`, `report.md` and PNG plots (drawn by Debian's
//! python3-matplotlib from the JSON, see `perf/plot.py`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

pub use crate::prereq::PYTHON;
pub use crate::report_data::Report;
use crate::results::rounds_label;
pub use crate::results::{
    latency_summary, median, Cost, FlowScalePoint, LatencyPoint, LatencySummary, Ratios,
    RunFigures, ScenarioResult,
};

/// Rendering: `report.md` and the files of a report directory (the record itself is
/// [`crate::report_data`]).
impl Report {
    /// The Markdown report.
    pub fn markdown(&self) -> String {
        let mut m = String::new();
        m += &format!("# Juneau benchmark report ({})\n\n", self.mode);
        m += &format!(
            "- date: {}\n- machine: {}\n- load average (1/5/15 min) at start: {}, at end: {}\n- config: `{}`\n\n",
            self.date, self.machine, self.load_average_start, self.load_average_end, self.config
        );
        m += &crate::targets::markdown(self);
        if !self.profiles.is_empty() || !self.profile_note.is_empty() {
            m += &crate::profile::markdown(&self.profiles, &self.profile_note);
        }
        m += "\n";
        m += &self.method_md();
        m += &self.throughput_md();
        m += &self.ratios_md();
        m += &self.ipv6_md();
        m += &crate::bulk_data::markdown(&self.bulk, &self.bulk_ratios);
        m += &crate::connect::markdown(&self.connect, self.connect_ratio.as_ref());
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

    /// The TSC clock the run measured with (from its rows' cycles and ns per packet, so
    /// that `render` on another machine states the run's), else this machine's.
    fn tsc_mhz(&self) -> Option<f64> {
        self.throughput_rows()
            .find_map(|s| match (s.cycles_per_packet, s.ns_per_packet) {
                (Some(c), Some(ns)) if ns > 0.0 => Some(c / ns * 1e3),
                _ => None,
            })
            .or_else(crate::cpu::tsc_mhz)
    }

    /// The method paragraph: how the rates and costs were measured.
    fn method_md(&self) -> String {
        let mut m = String::new();
        m += "Delivered packets/s = datagrams the backend's application read (`recvmmsg` on a UDP socket in the\n";
        m += "backend namespace; its thread on CPU 0, real-time; the backend's veth as a CNI leaves a Pod's: no XDP\n";
        m += "program, GRO off; only the paths that XDP_REDIRECT into it, xdp-dnat and juneau-xdp-fast, get an\n";
        m += "`xdp_pass` there so that it takes their frames; datagrams its socket dropped are listed per run); 64-byte UDP\n";
        m += "offered by the generator (`generator` in the config: live frames, or AF_XDP copy-mode TX where the\n";
        m += "kernel refuses them, each frame then reaching the node's veth as an skb) alone on CPU 0; every forwarding\n";
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
            self.tsc_mhz()
                .map(|m| format!("{m:.0} MHz"))
                .unwrap_or_else(|| "unknown".into()),
            100.0 * crate::results::SATURATION_DELIVERED_BELOW
        );
        m += &format!(
            "of offered or the path core is >= {:.0} % busy (/proc/stat); ratios come only from rows saturated in every run.\n",
            100.0 * crate::results::SATURATION_CORE_BUSY
        );
        m += "A measured window is *paced* (offered at the calibrated rate) or *flooded* (the generator unpaced: pacing\n";
        m += "gave up, or the last retry of a carried window); the two measure different things and never share a median:\n";
        m += "a row's medians are per kind, its figure (ratios, plots) is the median of its paced windows, of its flooded\n";
        m += "windows when none was paced. A ratio pairs the two paths round by round only where both windows are of one\n";
        m += "kind, one line per kind; a round with one paced and one flooded window is left out and listed; a ratio with\n";
        m += "no such round is refused (no like-kind windows). A round's *common kind* is paced when every window of the\n";
        m += "round was paced, else flooded; each path paced in a flooded round then runs one extra flooded window (the\n";
        m += "paced one kept and listed), its window of that kind in that round. Every window states its loss\n";
        m += "(1 - delivered / offered) and its path core's busy share, and which of the two made it saturated.\n";
        m += &format!(
            "A ratio target's verdict rests on the kinds paired in at least {} rounds (each must meet it; the figure\n",
            crate::results::MIN_PAIRED_ROUNDS
        );
        m += "gives the paired rounds and the spread of the per-round ratios); with fewer it is refused.\n\n";
        m
    }

    /// Throughput and CPU cost per packet, per scenario and per run: a line per kind of
    /// window (paced, flooded), each with its own medians.
    fn throughput_md(&self) -> String {
        let mut m = String::new();
        m += "## Throughput and CPU cost per packet\n\nOne line per row and kind of window (paced: offered at the calibrated rate; flooded: the generator unpaced); each line's medians are over its own windows only. The row's figure (ratios, plots) is its paced line's, its flooded line's when no window was paced.\n\n| scenario | flows | windows | saturated | median delivered pps | offered pps (runs) | loss (runs) | path cores (runs) | path core busy (runs) | ns/packet | cycles/packet | packets per CPU-second | threads ns/packet |\n|---|---:|---|---|---:|---|---|---|---|---:|---:|---:|---:|\n";
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.0}"));
        for s in self.throughput_rows() {
            let join = |v: Vec<String>| v.join(", ");
            // A kind's window of each of its rounds (an extra window where it was one).
            let of = |k: &crate::results::KindSummary, f: &dyn Fn(&RunFigures) -> String| {
                join(
                    k.rounds
                        .iter()
                        .filter_map(|&i| s.runs.get(i - 1)?.window(k.kind))
                        .map(f)
                        .collect(),
                )
            };
            if s.kinds.is_empty() {
                // No windows on record (an older report): the row as it was.
                m += &format!(
                    "| {} | {} | not recorded | not recorded | {:.0} | {} | | | | {} | {} | {} | {} |\n",
                    s.name,
                    s.flows,
                    s.median_pps,
                    join(s.offered_pps.iter().map(|p| format!("{p:.0}")).collect()),
                    opt(s.ns_per_packet),
                    opt(s.cycles_per_packet),
                    opt(s.pps_per_cpu_second),
                    opt(s.thread_ns_per_packet),
                );
                continue;
            }
            for k in &s.kinds {
                let n = k.rounds.len();
                let sat = k
                    .rounds
                    .iter()
                    .filter(|&&i| {
                        s.runs
                            .get(i - 1)
                            .and_then(|r| r.window(k.kind))
                            .is_some_and(|r| r.saturated)
                    })
                    .count();
                m += &format!(
                    "| {} | {} | {} ({} of {}: {}) | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    s.name,
                    s.flows,
                    k.kind.label(),
                    n,
                    s.runs.len(),
                    rounds_label(&k.rounds),
                    if k.saturated {
                        "**yes** (all)".to_string()
                    } else {
                        format!("NO ({sat} of {n})")
                    },
                    k.median_pps,
                    of(k, &|r| format!("{:.0}", r.offered_pps)),
                    of(k, &|r| format!("{:.0}%", 100.0 * r.loss())),
                    of(k, &|r| format!("{:.2}", r.path_cores)),
                    of(k, &|r| format!("{:.0}%", 100.0 * r.path_core.busy)),
                    opt(k.ns_per_packet),
                    opt(k.cycles_per_packet),
                    opt(k.pps_per_cpu_second),
                    opt(k.thread_ns_per_packet),
                );
            }
        }
        m += "\nPer run: \n\n";
        for s in self.throughput_rows() {
            let windows = s.runs.iter().enumerate().flat_map(|(i, r)| {
                r.windows().map(move |w| {
                    let extra = if w.extra {
                        ", extra window of the round's common kind"
                    } else {
                        ""
                    };
                    (i, w, extra)
                })
            });
            for (i, r, extra) in windows {
                m += &format!(
                    "- {} @ {} flows, run {} ({}{extra}): {:.0} of {:.0} pps (rate asked {}), {:.0} ns/packet (threads {:.0}), path core user {:.0}% / system {:.0}% / softirq {:.0}% / steal {:.0}%, generator core busy {:.0}% (softirq {:.0}%), backend socket drops {}: {}; calibration (offered -> delivered): {}\n",
                    s.name,
                    s.flows,
                    i + 1,
                    r.kind().label(),
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
                    r.backend_socket_drops,
                    r.saturation_stated(),
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
        m += "\n## Ratios (only from saturated rows; paired round by round, only rounds whose two windows are of one kind: the median of the per-round ratios, lowest – highest in brackets)\n\nA round in which one side's window was paced and the other's flooded is left out (listed below); paced and flooded pairs give separate lines, never one median.\n\n| ratio | windows | delivered pps | packets per CPU-second | target |\n|---|---|---:|---:|---:|\n";
        let q = &self.ratios;
        for (name, label, a, b, t) in [
            (
                crate::report_data::JUNEAU_VS_NFT_DNAT,
                "juneau / nft-dnat",
                q.juneau_vs_nft_dnat,
                q.cpu_juneau_vs_nft_dnat,
                ">= 1.0",
            ),
            (
                crate::report_data::JUNEAU_XDP_FAST_VS_XDP_DNAT,
                "juneau-xdp-fast / xdp-dnat",
                q.juneau_xdp_fast_vs_xdp_dnat,
                q.cpu_juneau_xdp_fast_vs_xdp_dnat,
                ">= 1.0",
            ),
            (
                crate::report_data::JUNEAU_VS_AFXDP_L2FWD,
                "juneau / afxdp-l2fwd",
                q.juneau_vs_afxdp_l2fwd,
                q.cpu_juneau_vs_afxdp_l2fwd,
                ">= 1.0",
            ),
            (
                crate::report_data::JUNEAU_FLOW_SCALE,
                "juneau largest / smallest flow count",
                q.juneau_flow_scale_largest_vs_smallest,
                q.cpu_juneau_flow_scale_largest_vs_smallest,
                ">= 0.9",
            ),
            (
                crate::report_data::XDP_DNAT_FLOW_SCALE,
                "(reference) xdp-dnat largest flow count / throughput rows' flows",
                q.xdp_dnat_flow_scale,
                q.cpu_xdp_dnat_flow_scale,
                "—",
            ),
        ] {
            let kinds: Vec<_> = q.by_kind.iter().filter(|k| k.ratio == name).collect();
            if kinds.is_empty() {
                let windows = if q.no_like_kind.iter().any(|n| n == name) {
                    "no like-kind windows"
                } else if a.is_some() || b.is_some() {
                    "the rows' medians (not paired)"
                } else {
                    "—"
                };
                m += &format!(
                    "| {label} | {windows} | {} | {} | {t} |\n",
                    not_measured(a),
                    not_measured(b)
                );
            }
            for k in kinds {
                m += &format!("| {label} | {} | {t} |\n", kind_ratio_cells(k));
            }
        }
        if !q.left_out.is_empty() {
            m += "\nRounds left out of a ratio (one window paced, the other flooded):\n\n";
            for r in &q.left_out {
                m += &format!("- {r}\n");
            }
        }
        if !q.refused.is_empty() {
            m += "\nRefused (a ratio of unsaturated runs measures the generator, not the paths; one of a paced and a flooded window compares two different measurements):\n\n";
            for r in &q.refused {
                m += &format!("- {r}\n");
            }
        }
        if !self.dataplane_counters.is_empty() {
            m += "\njuneau-dataplane's own counters after each `juneau` run (its stats file, written about once a second, so up to ~1 s stale; cumulative since its start, warm-up included):\n\n";
            m += "| scenario | flows | flows in its table (IPv4 / IPv6) | rx | tx | engine drops | xsk rx ring full | xsk fill ring empty | xsk rx dropped | received by busy polling (node netns) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
            for c in &self.dataplane_counters {
                m += &format!(
                    "| {} | {} | {} / {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    c["scenario"].as_str().unwrap_or("juneau"),
                    c["flows"],
                    c["flows_in_table"],
                    c.get("ipv6_flows_in_table")
                        .filter(|v| !v.is_null())
                        .map_or_else(|| "-".to_string(), |v| v.to_string()),
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

    /// The IPv6 rows (`kernel-forward6`, `nft-dnat6`, `juneau6`) and juneau6 / nft-dnat6,
    /// paired per round as the IPv4 ratios, without a target; nothing when the run
    /// measured no IPv6 row.
    fn ipv6_md(&self) -> String {
        let rows: Vec<&ScenarioResult> = self
            .scenarios
            .iter()
            .filter(|s| crate::plan::Scenario::by_name(&s.name).is_some_and(|sc| sc.ipv6()))
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        let mut m = String::new();
        m += &format!(
            "\n## IPv6\n\nThe same topology over IPv6 (2001:2::/48, RFC 5180; static neighbours), the same flows, ports, calibration and saturation rules as the IPv4 rows (their windows are in the tables above); UDP over IPv6 in {}-byte frames ({} on the wire with the FCS: Ethernet 14 + IPv6 40 + UDP 8 + the generator's 8-byte payload, the smallest that holds them; the IPv4 rows' are 64). No target: the ratio is reported as measured, with its spread.\n\n| row | windows | saturated | median delivered pps | ns/packet | packets per CPU-second |\n|---|---|---|---:|---:|---:|\n",
            crate::packet::FRAME6_LEN,
            crate::packet::FRAME6_LEN + 4
        );
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.0}"));
        for s in rows {
            for k in &s.kinds {
                m += &format!(
                    "| {} | {} ({}) | {} | {:.0} | {} | {} |\n",
                    s.name,
                    k.kind.label(),
                    rounds_label(&k.rounds),
                    if k.saturated { "yes (all)" } else { "NO" },
                    k.median_pps,
                    opt(k.ns_per_packet),
                    opt(k.pps_per_cpu_second)
                );
            }
        }
        let name = crate::report_data::JUNEAU6_VS_NFT_DNAT6;
        let q = &self.ratios;
        m += "\n| ratio (paired per round: median, lowest – highest) | windows | delivered pps | packets per CPU-second |\n|---|---|---:|---:|\n";
        let kinds: Vec<_> = q.by_kind.iter().filter(|k| k.ratio == name).collect();
        for k in &kinds {
            m += &format!("| {name} | {} |\n", kind_ratio_cells(k));
        }
        if kinds.is_empty() {
            let why: Vec<&str> = q
                .refused
                .iter()
                .filter_map(|r| r.strip_prefix(name).and_then(|r| r.strip_prefix(": ")))
                .collect();
            let windows = if why.is_empty() {
                "the rows' medians (not paired)".to_string()
            } else {
                format!("refused: {}", why.join("; "))
            };
            m += &format!(
                "| {name} | {windows} | {} | {} |\n",
                not_measured(q.juneau6_vs_nft_dnat6),
                not_measured(q.cpu_juneau6_vs_nft_dnat6)
            );
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
            m += "| flows | runs (pps) | median (per kind of window) |\n|---:|---|---:|\n";
            for p in &self.flow_scale {
                m += &p.row("");
            }
            if let Some(r) = &self.flow_scale_reference {
                m += &r.row(" (xdp-dnat, reference)");
            }
            // plot.py draws juneau's points only: no plot (and no link) without them.
            if !self.flow_scale.is_empty() {
                m += "\n![flow scale](flow_scale.png)\n";
            }
        }
        m
    }

    /// Latency through the VIP.
    fn latency_md(&self) -> String {
        let background = |pps: Option<u64>, fraction: f64| match pps {
            Some(r) => format!("{r} pps ({:.0}% of its median)", fraction * 100.0),
            None => format!("{:.0}%", fraction * 100.0),
        };
        let mut m = String::new();
        m += "\n## Latency through the VIP (UDP request/response, one outstanding)\n\n";
        if self.latency.is_empty() {
            m += "Not measured in this run.\n";
        } else {
            let ratio = |r: Option<f64>| r.map_or_else(|| "—".to_string(), |x| format!("{x:.2}"));
            m += "Every round measures every scenario at every load in turn; per scenario and load: the median over the rounds (lowest–highest), and the paired comparison to nft-dnat (median over the rounds of this scenario's figure / nft-dnat's in the same round; ≤ 1.00: no worse).\n\n";
            m += "A lost probe (no reply within its timeout) counts as the timeout in the percentiles, slower than any answered one; \"background\" is either a fraction of that path's own median throughput or the same rate for every path.\n\n";
            m += "| scenario | background | rounds | p99 us | p99.9 us | p99 / nft-dnat | p99.9 / nft-dnat |\n|---|---:|---:|---:|---:|---:|---:|\n";
            for l in &self.latency_summary {
                m += &format!(
                    "| {} | {} | {} | {:.1} ({:.1}–{:.1}) | {:.1} ({:.1}–{:.1}) | {} | {} |\n",
                    l.scenario,
                    background(l.background_pps, l.load_fraction),
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
            m += "| round | scenario | background | offered pps | replies | p50 us | p99 us | p99.9 us | max us |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
            for l in &self.latency {
                m += &format!(
                    "| {} | {} | {} | {:.0} | {}/{} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                    l.round + 1,
                    l.scenario,
                    background(l.background_pps, l.load_fraction),
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
            count_or_not_measured(self.cost.established_instructions_per_packet),
            count_or_not_measured(self.cost.new_flow_instructions_per_packet),
            count_or_not_measured(self.cost.reply_instructions_per_packet),
        );
        m += &format!(
            "| redirected, at the node the router picked: record look-up + encapsulation | {} | |
| redirected, at the owner: decapsulation + its established flow | {} | |
",
            count_or_not_measured(self.cost.redirect_ask_instructions_per_packet),
            count_or_not_measured(self.cost.redirect_own_instructions_per_packet),
        );
        m += &format!(
            "| harness loop alone (baseline, subtracted above) | {} (new flow: {}) | |\n",
            count_or_not_measured(self.cost.baseline_instructions_per_packet),
            count_or_not_measured(self.cost.new_flow_baseline_instructions_per_packet),
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
        for sc in self.scales() {
            m += if sc.precreated {
                "\n## Control-plane scale (precreated)\n\n"
            } else {
                "\n## Control-plane scale (created live)\n\n"
            };
            m += &crate::scale_data::markdown(sc);
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
        let plots = plot(dir, &json)?;
        let mut files = vec![json, dir.join("report.md")];
        files.extend(plots);
        Ok(files)
    }

    /// `render`: report.md and the plots into `dir` from this (re-derived) report,
    /// leaving the recorded report.json as it is (the plots read a temporary copy).
    pub fn render(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::write(dir.join("report.md"), self.markdown())?;
        let tmp = dir.join("report.rendered.json");
        std::fs::write(&tmp, serde_json::to_string_pretty(self)?)?;
        let plots = plot(dir, &tmp);
        let _ = std::fs::remove_file(&tmp);
        let mut files = vec![dir.join("report.md")];
        files.extend(plots?);
        Ok(files)
    }
}

/// The plotting script (run with Debian's python3 and python3-matplotlib).
pub const PLOT_PY: &str = include_str!("../plot.py");

fn plot(dir: &Path, json: &Path) -> Result<Vec<PathBuf>> {
    for stale in ["throughput.png", "flow_scale.png", "latency.png"] {
        let _ = std::fs::remove_file(dir.join(stale));
    }
    let script = dir.join("plot.py");
    std::fs::write(&script, PLOT_PY)?;
    let out = Command::new(PYTHON)
        .arg(&script)
        .arg(json)
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

/// A paired ratio's cells: windows (kind and rounds), delivered pps and packets per
/// CPU-second, each the median with the lowest and highest round.
fn kind_ratio_cells(k: &crate::results::KindRatio) -> String {
    format!(
        "{} ({}) | {:.2} ({:.2} – {:.2}) | {:.2} ({:.2} – {:.2})",
        k.kind.label(),
        rounds_label(&k.rounds),
        k.pps,
        k.pps_range.0,
        k.pps_range.1,
        k.cpu,
        k.cpu_range.0,
        k.cpu_range.1
    )
}

/// A figure with two decimals, or "not measured".
fn not_measured(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2}"))
        .unwrap_or_else(|| "not measured".into())
}

/// A whole count (instructions per packet), or "not measured".
fn count_or_not_measured(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.0}"))
        .unwrap_or_else(|| "not measured".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::latency::ProbeResult;
    use crate::results::WindowKind;

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
    fn ratios_pair_the_rounds_of_saturated_rows_and_are_absent_without_juneau() {
        let mut r = Report::default();
        r.scenarios
            .push(row("nft-dnat", 256, &[100.0, 200.0, 300.0], 1000.0, true));
        r.compute_ratios();
        assert!(r.ratios.juneau_vs_nft_dnat.is_none());
        assert!(r
            .markdown()
            .contains("| juneau / nft-dnat | — | not measured | not measured |"));
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
        // Round by round 3.0, 2.5, 1.33 (the medians' ratio would be 2.0).
        assert_eq!(r.ratios.juneau_vs_nft_dnat, Some(2.5));
        assert_eq!(r.ratios.cpu_juneau_vs_nft_dnat, Some(4.0));
        let spread = &r.ratios.by_kind[0];
        assert_eq!(
            (spread.ratio.as_str(), spread.rounds.clone()),
            ("juneau / nft-dnat", vec![1, 2, 3])
        );
        assert_eq!(spread.pps_range, (400.0 / 300.0, 3.0));
        let md = r.markdown();
        assert!(
            md.contains("| juneau / nft-dnat | kind not recorded (rounds 1, 2, 3) | 2.50 (1.33 – 3.00) | 4.00 (4.00 – 4.00) | >= 1.0 |"),
            "{md}"
        );
        assert!(r.ratios.juneau_xdp_fast_vs_xdp_dnat.is_none());
        assert_eq!(r.ratios.juneau_flow_scale_largest_vs_smallest, Some(0.9));
        let s = &r.scenarios[1];
        assert_eq!((s.min_pps, s.median_pps, s.max_pps), (300.0, 400.0, 500.0));
        assert_eq!(s.pps_per_cpu_second, Some(4_000_000.0));
    }

    #[test]
    fn the_ipv6_rows_have_their_own_section_and_ratio_paired_per_round() {
        let mut r = Report::default();
        r.scenarios.push(row("juneau", 256, &[300.0], 250.0, true));
        r.scenarios
            .push(row("nft-dnat", 256, &[100.0], 1000.0, true));
        r.compute_ratios();
        assert!(!r.markdown().contains("## IPv6"), "no IPv6 row, no section");
        assert!(
            !r.ratios.refused.iter().any(|x| x.contains("juneau6")),
            "no IPv6 row, no IPv6 ratio refused: {:?}",
            r.ratios.refused
        );
        r.scenarios
            .push(row("nft-dnat6", 256, &[100.0, 200.0, 300.0], 2000.0, true));
        r.scenarios
            .push(row("juneau6", 256, &[150.0, 200.0, 150.0], 1000.0, true));
        r.compute_ratios();
        // Round by round 1.5, 1.0, 0.5: the median 1.0 (the medians' ratio would be 0.75).
        assert_eq!(r.ratios.juneau6_vs_nft_dnat6, Some(1.0));
        assert_eq!(r.ratios.cpu_juneau6_vs_nft_dnat6, Some(2.0));
        assert_eq!(r.ratios.juneau_vs_nft_dnat, Some(3.0), "IPv4 pairs IPv4");
        let md = r.markdown();
        let v6 = &md[md.find("## IPv6").expect("an IPv6 section")..];
        assert!(v6.contains("70-byte frames (74 on the wire"), "{v6}");
        assert!(v6.contains("| juneau6 | "), "{v6}");
        assert!(v6.contains("| nft-dnat6 | "), "{v6}");
        assert!(
            v6.contains("| juneau6 / nft-dnat6 | kind not recorded (rounds 1, 2, 3) | 1.00 (0.50 – 1.50) | 2.00 (2.00 – 2.00) |"),
            "{v6}"
        );
        // Not among the IPv4 ratios' targets.
        let ipv4_ratios = &md[md.find("## Ratios").expect("ratios")..md.find("## IPv6").unwrap()];
        assert!(!ipv4_ratios.contains("juneau6"), "{ipv4_ratios}");
        // The same saturation rule: an unsaturated row refuses the ratio, and says so.
        r.scenarios[2] = row("nft-dnat6", 256, &[100.0, 200.0, 300.0], 2000.0, false);
        r.compute_ratios();
        assert_eq!(r.ratios.juneau6_vs_nft_dnat6, None);
        let md = r.markdown();
        assert!(
            md.contains("| juneau6 / nft-dnat6 | refused: not all runs saturated: nft-dnat6 (256 flows) | not measured | not measured |"),
            "{md}"
        );
    }

    fn lat(sc: &str, load: f64, round: u32, p99: f64, p999: f64) -> LatencyPoint {
        LatencyPoint {
            scenario: sc.into(),
            load_fraction: load,
            background_pps: None,
            offered_pps: 1.0,
            round,
            result: ProbeResult {
                sent: 10,
                received: 10,
                lost_counts_as_us: 100_000.0,
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
    fn latency_at_the_same_absolute_rate_is_paired_apart_from_the_fractions() {
        let abs = |sc: &str, fraction: f64, p99: f64| LatencyPoint {
            background_pps: Some(100_000),
            ..lat(sc, fraction, 0, p99, p99)
        };
        // The same rate is 10 % of nft-dnat's median and 20 % of juneau's.
        let points = vec![
            lat("nft-dnat", 0.1, 0, 100.0, 100.0),
            lat("juneau", 0.1, 0, 300.0, 300.0),
            abs("nft-dnat", 0.1, 100.0),
            abs("juneau", 0.2, 150.0),
        ];
        let s = latency_summary(&points);
        assert_eq!(s.len(), 4);
        assert_eq!(
            (s[1].background_pps, s[1].p99_vs_nft_dnat),
            (None, Some(3.0))
        );
        assert_eq!(
            (s[3].background_pps, s[3].p99_vs_nft_dnat),
            (Some(100_000), Some(1.5))
        );
        assert_eq!(s[3].load_fraction, 0.2);
        let mut r = Report {
            latency: points,
            ..Default::default()
        };
        r.compute_ratios();
        assert!(r
            .markdown()
            .contains("| juneau | 100000 pps (20% of its median) | 1 |"));
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
        assert!(md.contains("| (reference) xdp-dnat largest flow count / throughput rows' flows | the rows' medians (not paired) | 0.45 | 0.50 | — |"), "{md}");
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
        assert!(md.contains("NO (0 of 1)"), "{md}");
        assert!(md.contains("Refused"), "{md}");
    }

    #[test]
    fn a_kept_report_json_loads_and_render_tells_the_kinds_apart() {
        // A fragment of perf/results/2026-12-05-s/report.json as that run wrote it
        // (juneau and nft-dnat at 256 flows, juneau at 1 k and 1 M flows).
        let mut r: Report =
            serde_json::from_str(include_str!("testdata/2026-12-05-s-fragment.json"))
                .expect("an old report.json loads");
        let by_name =
            |r: &Report, n: &str| r.scenarios.iter().find(|s| s.name == n).cloned().unwrap();
        let j = by_name(&r, "juneau");
        assert_eq!(j.kinds.len(), 0);
        assert_eq!(
            j.median_pps.round(),
            644800.0,
            "as recorded: a mixed median"
        );
        assert_eq!(
            r.ratios.cpu_juneau_vs_nft_dnat.map(|x| (x * 100.0).round()),
            Some(71.0)
        );
        r.rederive_throughput();
        let j = by_name(&r, "juneau");
        let kinds: Vec<_> = j.kinds.iter().map(|k| (k.kind, k.rounds.clone())).collect();
        assert_eq!(
            kinds,
            vec![
                (WindowKind::Paced, vec![4, 5]),
                (WindowKind::Flooded, vec![1, 2, 3])
            ]
        );
        let paced = (j.runs[3].delivered_pps + j.runs[4].delivered_pps) / 2.0;
        assert_eq!(j.median_pps, paced, "the row's figure: its paced windows");
        assert_eq!(j.kinds[1].median_pps, j.runs[2].delivered_pps);
        // Kept at the run's TSC clock (about 2600 MHz), not this machine's.
        let mhz = j.kinds[1].cycles_per_packet.unwrap() / j.kinds[1].ns_per_packet.unwrap();
        assert!((mhz * 1e3 - 2600.0).abs() < 1.0, "{mhz}");
        // nft-dnat: rounds 1, 4, 5 flooded, 2, 3 paced; juneau 1-3 flooded, 4-5 paced:
        // only round 1 has two windows of one kind.
        let n = by_name(&r, "nft-dnat");
        let q: Vec<_> = r
            .ratios
            .by_kind
            .iter()
            .filter(|k| k.ratio == "juneau / nft-dnat")
            .collect();
        assert_eq!(q.len(), 1);
        assert_eq!(
            (q[0].kind, q[0].rounds.clone()),
            (WindowKind::Flooded, vec![1])
        );
        assert_eq!(q[0].cpu, n.runs[0].cost_ns() / j.runs[0].cost_ns());
        assert_eq!(r.ratios.cpu_juneau_vs_nft_dnat, Some(q[0].cpu));
        assert_eq!(
            r.ratios.left_out[0],
            "juneau / nft-dnat: round 2 (juneau flooded, nft-dnat paced), round 3 (juneau flooded, nft-dnat paced), round 4 (juneau paced, nft-dnat flooded), round 5 (juneau paced, nft-dnat flooded)"
        );
        // 1 k flows all flooded, 1 M all paced: no like-kind round at all.
        assert_eq!(
            r.ratios.no_like_kind,
            vec!["juneau largest / smallest flow count"]
        );
        assert!(r.ratios.cpu_juneau_flow_scale_largest_vs_smallest.is_none());
        let md = r.markdown();
        assert!(
            md.contains("| juneau at the largest / the smallest flow count, packets per CPU-second >= 0.9 | no round with both windows paced or both flooded | refused (no like-kind windows) |"),
            "{md}"
        );
        assert!(
            md.contains("| juneau | 256 | paced (2 of 5: rounds 4, 5) | **yes** (all) |"),
            "{md}"
        );
        assert!(
            md.contains("| juneau | 256 | flooded (3 of 5: rounds 1, 2, 3) | **yes** (all) |"),
            "{md}"
        );
        assert!(md.contains("| 1000 | 617583 flooded, "), "{md}");
        assert!(md.contains("| flooded 617583 (5 of 5) |"), "{md}");
        // The run's TSC clock (from its rows), not the rendering machine's.
        assert!(md.contains("clock (2600 MHz;"), "{md}");
        // One paired round (no extra windows in that run): too few for a verdict.
        assert!(
            md.contains("| flooded 0.65 over 1 paired round (round 1), spread 0.65 – 0.65 (< 5: no verdict) | refused (1 paired rounds < 5) |"),
            "{md}"
        );
        // Every window states its loss and its busy core, and which saturated it.
        assert!(
            md.contains("| juneau | 256 | paced (2 of 5: rounds 4, 5) | **yes** (all) | 614316 | 619073, 721764 | 8%, 9% | 0.85, 0.88 | 85%, 88% |"),
            "{md}"
        );
        assert!(
            md.contains("backend socket drops 0: loss 8%, path core 85% busy: saturated by loss;"),
            "{md}"
        );
        assert!(
            md.contains("juneau @ 256 flows: by loss 5, by busy core 0 of 5 windows"),
            "{md}"
        );
    }

    #[test]
    fn a_rounds_extra_window_is_listed_and_pairs_in_its_kind() {
        let w = |pps: f64, rate: u64| RunFigures {
            delivered_pps: pps,
            offered_pps: 2.0 * pps,
            core_ns_per_packet: 1e9 / pps,
            rate_pps: rate,
            calibration: vec![(2.0 * pps, pps)],
            saturated: true,
            ..Default::default()
        };
        // Five rounds: juneau paced, nft-dnat flooded; juneau's extra flooded windows.
        let juneau: Vec<RunFigures> = (0..5)
            .map(|_| RunFigures {
                also: vec![RunFigures {
                    extra: true,
                    calibration: Vec::new(),
                    ..w(450.0, 0)
                }],
                ..w(500.0, 600)
            })
            .collect();
        let nft = vec![w(500.0, 0); 5];
        let mut r = Report::default();
        r.scenarios
            .push(ScenarioResult::from_runs_at("juneau", 256, juneau, None));
        r.scenarios
            .push(ScenarioResult::from_runs_at("nft-dnat", 256, nft, None));
        r.compute_ratios();
        assert!(r.ratios.left_out.is_empty(), "{:?}", r.ratios.left_out);
        let cpu = r.ratios.cpu_juneau_vs_nft_dnat.expect("paired");
        assert!((cpu - 0.9).abs() < 1e-9, "{cpu}");
        let md = r.markdown();
        assert!(
            md.contains("| juneau (default, userspace path) / nft-dnat, packets per CPU-second >= 1.0 | flooded 0.90 over 5 paired rounds (rounds 1, 2, 3, 4, 5), spread 0.90 – 0.90 | **MISSED** |"),
            "{md}"
        );
        assert!(
            md.contains("| juneau | 256 | flooded (5 of 5: rounds 1, 2, 3, 4, 5) | **yes** (all) | 450 | 900, 900, 900, 900, 900 | 50%, 50%, 50%, 50%, 50% |"),
            "{md}"
        );
        assert!(
            md.contains("- juneau @ 256 flows, run 3 (flooded, extra window of the round's common kind): 450 of 900 pps"),
            "{md}"
        );
        assert!(
            md.contains("- juneau @ 256 flows, run 3 (paced): 500 of 1000 pps"),
            "{md}"
        );
        // The same at a flow count: its row lists the extra windows too.
        let p = FlowScalePoint {
            flows: 1000,
            runs_pps: vec![500.0; 5],
            median_pps: 450.0,
            summary: Some(r.scenarios[0].clone()),
        };
        assert!(
            p.row("")
                .starts_with("| 1000 | 500 paced, 450 flooded (extra), 500 paced, "),
            "{}",
            p.row("")
        );
    }
}
