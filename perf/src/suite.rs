//! The suite runner: builds a fresh topology per scenario, sets the node namespace up as
//! the scenario says ([`crate::harness`]), drives the generator, reads the sink, and
//! collects everything into a [`crate::report_data::Report`]. The scenarios and the plan
//! are in [`crate::plan`] (re-exported here).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::calibrate::{window_retry_rate, RateSearch, PACED_BELOW_FLOOD, WINDOW_RETRIES};
use crate::latency::ProbeResult;
use crate::report_data::Report;
use crate::results::{self, FlowScalePoint, LatencyPoint, RunFigures, ScenarioResult};
use crate::topology::*;

pub use crate::harness::stage_binaries;
use crate::harness::{
    check_placement, cpus, path_threads, pin_path, self_exe, setup, thread_run_ns,
    wait_until_delivering, Active, Gen, PROBE_RT_PRIORITY,
};
use crate::plan::{check_interrupt, fill_duration, FILL_PASSES, FILL_RATE};
pub use crate::plan::{sleep, Plan, Progress, Scenario, INTERRUPTED};

/// Creates a run's flows before anything is measured: the generator offers every flow's
/// packet [`FILL_PASSES`] times at [`FILL_RATE`], paced, then stops.
fn fill_flows(t: &Topology, a: &Active, flows: u32) -> Result<()> {
    let frames = (FILL_PASSES * f64::from(flows)) as u64;
    // `finish` waits for the generator to send its frames (or its duration to end).
    Gen::start(t, a.dst, flows, FILL_RATE, fill_duration(flows), frames)?.finish()?;
    Ok(())
}

/// The backend namespace's UDP and UDP-Lite counters (`/proc/net/snmp`: InErrors,
/// InCsumErrors, NoPorts...), so that a window whose datagrams never reached the
/// application names where the kernel put them.
fn backend_udp_counters(ns: &juneau_tests::netns::Netns) -> String {
    let v4 = match ns.exec(&["cat", "/proc/net/snmp"]) {
        Ok(snmp) => nonzero_udp_counters(&snmp),
        Err(e) => format!("/proc/net/snmp unreadable: {e:#}"),
    };
    let v6 = match ns.exec(&["cat", "/proc/net/snmp6"]) {
        Ok(snmp6) => nonzero_udp6_counters(&snmp6),
        Err(e) => format!("/proc/net/snmp6 unreadable: {e:#}"),
    };
    format!("{v4}; {v6}")
}

/// The UDP counters of a `/proc/net/snmp6` that are not 0 ("Udp6InDatagrams 5, ...").
fn nonzero_udp6_counters(snmp6: &str) -> String {
    snmp6
        .lines()
        .filter_map(|l| l.split_once(char::is_whitespace))
        .map(|(n, v)| (n, v.trim()))
        .filter(|(n, v)| n.starts_with("Udp6") && *v != "0")
        .map(|(n, v)| format!("{n} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The UDP counters of a `/proc/net/snmp` that are not 0, as "Name value, ...".
fn nonzero_udp_counters(snmp: &str) -> String {
    let udp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Udp:")).collect();
    let [names, values] = udp.as_slice() else {
        return "no Udp lines in /proc/net/snmp".into();
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .skip(1)
        .filter(|(_, v)| *v != "0")
        .map(|(n, v)| format!("{n} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Saturation bounds (in [`crate::results`], where the report reads them too).
pub use crate::results::{SATURATION_CORE_BUSY, SATURATION_DELIVERED_BELOW};

/// One measured generator run: the generator offers `rate` (0: as fast as it can) for
/// `warmup` + `window`; the sink, the path's threads and both cores are read around the
/// window.
fn window_run(
    t: &Topology,
    a: &mut Active,
    tids: &[u32],
    flows: u32,
    rate: u64,
    (warmup, window): (Duration, Duration),
    mut recorder: Option<&mut crate::profile::Recorder>,
) -> Result<RunFigures> {
    let (gen_cpu, path_cpu) = cpus();
    // This thread's clock starts and ends the window: it must not wait for a turn on
    // cores the load keeps busy at nice -20.
    let _timely = crate::cpu::Realtime::enter(crate::cpu::HARNESS_RT_PRIORITY)?;
    let g = Gen::start(
        t,
        a.dst,
        flows,
        rate,
        warmup + window + Duration::from_millis(200),
        u64::MAX,
    )?;
    sleep(warmup)?;
    // A profile covers the measured window, nothing before or after it.
    if let Some(r) = recorder.as_deref_mut() {
        r.enable()?;
    }
    // Who had the cores during the window, for a window that delivered nothing (read
    // outside the window's own counters, so they stay as close together as before).
    let watched: Vec<u32> = tids
        .iter()
        .copied()
        .chain(g.pid())
        .chain(a.sink.thread().map(|t| t.tid))
        .collect();
    let threads1 = crate::cpu::ThreadSched::of(&watched);
    let (core1, gcore1, run1) = (
        crate::cpu::CoreTimes::read(path_cpu)?,
        crate::cpu::CoreTimes::read(gen_cpu)?,
        crate::cpu::run_time_ns(tids),
    );
    let (t1, c1, d1) = (Instant::now(), a.sink.count()?, a.sink.socket_drops()?);
    sleep(window)?;
    let (t2, c2, d2) = (Instant::now(), a.sink.count()?, a.sink.socket_drops()?);
    let (core2, gcore2, run2) = (
        crate::cpu::CoreTimes::read(path_cpu)?,
        crate::cpu::CoreTimes::read(gen_cpu)?,
        crate::cpu::run_time_ns(tids),
    );
    let threads2 = crate::cpu::ThreadSched::of(&watched);
    if let Some(r) = recorder {
        r.disable()?;
    }
    let gen = g.finish()?;
    a.check_forwarder()?;
    let secs = (t2 - t1).as_secs_f64();
    let pps = (c2 - c1) as f64 / secs;
    if c2 == c1 {
        let link = |ns: &juneau_tests::netns::Netns, i: &str| {
            ns.exec(&["ip", "-s", "-o", "link", "show", i])
                .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_else(|e| format!("unreadable: {e:#}"))
        };
        bail!(
            "nothing reached the backend's application during the window (generator sent {} frames in {:.2} s; the backend's socket dropped {}; its application had read {c1} before the window and {} by now; the backend's UDP: {}; the threads in the window: {}; the client's interface: {}; the node's uplink: {}; the node's Pod interface: {}; the backend's interface: {})",
            gen.sent,
            gen.elapsed_s,
            d2.saturating_sub(d1),
            a.sink.count()?,
            backend_udp_counters(&t.backend),
            crate::cpu::thread_deltas(&threads1, &threads2),
            link(&t.client, &t.c_if),
            link(&t.node, &t.nc_if),
            link(&t.node, &t.nb_if),
            link(&t.backend, &t.b_if),
        );
    }
    let offered = gen.sent as f64 / gen.elapsed_s.max(1e-9);
    let core = core1.busy_since(&core2);
    let path_cpu_s = run2.saturating_sub(run1) as f64 / 1e9;
    let delivered = (c2 - c1) as f64;
    tracing::debug!(sent = gen.sent, elapsed = gen.elapsed_s, pps, rate, "run");
    let mut f = RunFigures {
        delivered_pps: pps,
        backend_socket_drops: d2.saturating_sub(d1),
        offered_pps: offered,
        rate_pps: rate,
        path_cores: path_cpu_s / secs,
        path_core: core,
        gen_core: gcore1.busy_since(&gcore2),
        ns_per_packet: path_cpu_s * 1e9 / delivered,
        core_ns_per_packet: core.busy * secs * 1e9 / delivered,
        ..Default::default()
    };
    // Saturated by loss or by a busy core; both figures stated either way.
    f.saturated = f.saturated_by_loss() || f.saturated_by_core();
    f.saturation = f.saturation_stated();
    Ok(f)
}

/// One throughput measurement with a calibrated offered rate: a short flood gives a
/// first estimate, then a search over paced rates (doubling while the path carries
/// everything offered, then bisecting, at most `plan.calibrate_steps` steps) finds the
/// lowest rate the path does not carry; the measured window runs there. So the path is
/// saturated without a flood many times its capacity (which bounces the receive ring's
/// cache lines between the cores and inflates the per-packet cost), and the report can
/// show it: delivered < offered.
fn measure(
    t: &Topology,
    a: &mut Active,
    plan: &Plan,
    flows: u32,
    warmup: Duration,
    fill: bool,
) -> Result<RunFigures> {
    let tids = pin_path(t, &a.path)?;
    let pinned: Vec<(u32, u64)> = path_threads(t, &a.path)
        .into_iter()
        .filter_map(|(x, _)| Some((x, thread_run_ns(x)?)))
        .collect();
    let cw = plan.calibrate_window;
    if fill {
        fill_flows(t, a, flows)?;
    }
    let flood = window_run(t, a, &tids, flows, 0, (warmup.min(cw), cw), None)?;
    let mut steps = vec![(flood.offered_pps, flood.delivered_pps)];
    let mut search = RateSearch::new(flood.delivered_pps);
    for _ in 0..plan.calibrate_steps {
        let Some(rate) = search.next_rate() else {
            break;
        };
        let f = window_run(t, a, &tids, flows, rate as u64, (cw / 3, cw), None)?;
        steps.push((f.offered_pps, f.delivered_pps));
        let carried = f.delivered_pps >= SATURATION_DELIVERED_BELOW * f.offered_pps;
        if !carried && f.delivered_pps < PACED_BELOW_FLOOD * flood.delivered_pps {
            // Paced, the path carried less than under the flood: pacing itself hurts
            // (each frame wakes the path's kthread; on a core shared with other work a
            // wake-up can wait a scheduler slice). Measure flooded; the report shows
            // "rate asked: unpaced".
            search.give_up();
            break;
        }
        search.record(rate, f.offered_pps, carried);
    }
    let window = |a: &mut Active, rate: f64| {
        window_run(
            t,
            a,
            &tids,
            flows,
            rate as u64,
            (warmup, plan.duration),
            None,
        )
    };
    let mut rate = search.window_rate();
    let mut r = window(a, rate)?;
    for attempt in 0..WINDOW_RETRIES {
        if r.saturated {
            break;
        }
        // The path carried the whole window: the search's steps were noisy. The
        // unsaturated window stays in the report as a calibration step.
        tracing::info!(
            rate,
            offered = r.offered_pps,
            "window not saturated; runs again higher"
        );
        steps.push((r.offered_pps, r.delivered_pps));
        rate = window_retry_rate(r.offered_pps, attempt);
        r = window(a, rate)?;
    }
    check_placement(t, &a.path, &pinned)?;
    r.calibration = steps;
    Ok(r)
}

/// One latency point: probes through the VIP while the generator offers `rate` packets/s
/// of background. Returns the probes' figures and the rate really offered.
fn latency_point(
    t: &Topology,
    a: &mut Active,
    plan: &Plan,
    rate: u64,
) -> Result<(ProbeResult, f64)> {
    let exe = self_exe()?;
    let bg = Gen::start(
        t,
        a.dst,
        plan.flows,
        rate.max(1),
        plan.latency_duration
            .mul_f64(crate::latency::PROBE_TIME_BUDGET)
            + Duration::from_millis(700),
        u64::MAX,
    )?;
    sleep(Duration::from_millis(300))?;
    // The prober and the echo server share the generator's core (real-time, so they
    // preempt it: see `setup`): the path core runs only the path.
    let (gen_cpu, _) = cpus();
    let out = t.client.output(&[
        "chrt",
        "-f",
        PROBE_RT_PRIORITY,
        "taskset",
        "-c",
        &gen_cpu.to_string(),
        &exe.to_string_lossy(),
        "probe",
        "--target",
        &format!("{VIP}:{ECHO_PORT}"),
        "--rate",
        &plan.probe_rate.to_string(),
        "--duration-ms",
        &plan.latency_duration.as_millis().to_string(),
    ])?;
    let bg = bg.finish()?;
    let offered = bg.sent as f64 / bg.elapsed_s.max(1e-9);
    a.check_forwarder()?;
    if !out.status.success() {
        bail!(
            "prober failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let r: ProbeResult = serde_json::from_slice(&out.stdout).context("prober output")?;
    if r.received == 0 {
        bail!(
            "no echo reply came back through the VIP ({} requests)",
            r.sent
        );
    }
    Ok((r, offered))
}

/// Runs the whole plan in rounds: each round measures every scenario once (each on a
/// fresh topology), so that load from elsewhere on a shared machine spreads over all
/// scenarios instead of skewing one; then the latency points, one topology per scenario.
pub fn run(plan: &Plan, progress: &Progress, report: &mut Report) -> Result<()> {
    let mut runs: Vec<Vec<RunFigures>> = vec![Vec::new(); plan.scenarios.len()];
    let mut failed = vec![false; plan.scenarios.len()];
    let juneau = plan.scenarios.contains(&Scenario::Juneau);
    let mut scale_runs: Vec<Vec<RunFigures>> = vec![Vec::new(); plan.flow_scale.len()];
    let mut scale_failed = false;
    // xdp-dnat at the largest flow count beside juneau's, as the reference for what
    // that many flows cost the in-kernel path.
    let reference = plan
        .scenarios
        .iter()
        .position(|s| *s == Scenario::XdpDnat)
        .zip(plan.flow_scale.iter().copied().max())
        .filter(|_| juneau);
    let mut reference_runs: Vec<RunFigures> = Vec::new();
    let say_run = |what: String, f: &RunFigures| {
        progress.say(format!(
            "{what}: {:.0} pps delivered (offered {:.0}), path {:.2} cores, path core {:.0}% busy, {:.0} ns/packet; {}",
            f.delivered_pps,
            f.offered_pps,
            f.path_cores,
            100.0 * f.path_core.busy,
            f.ns_per_packet,
            f.saturation
        ))
    };
    let bulk = plan.scenarios.contains(&Scenario::TcpBulk);
    let connect = plan.scenarios.contains(&Scenario::TcpConnect);
    let mut connect_failed: Vec<Scenario> = Vec::new();
    let mut bulk_runs: Vec<crate::bulk::BulkRun> = Vec::new();
    let mut bulk_failed: Vec<(u32, Scenario)> = Vec::new();
    for round in 0..plan.runs {
        for (i, sc) in plan.scenarios.iter().enumerate() {
            if failed[i] || matches!(sc, Scenario::TcpBulk | Scenario::TcpConnect) {
                continue;
            }
            check_interrupt()?;
            match throughput_once(plan, *sc, plan.flows, plan.warmup, false) {
                Ok(f) => {
                    say_run(
                        format!("round {}/{}: {}", round + 1, plan.runs, sc.name()),
                        &f,
                    );
                    runs[i].push(f);
                }
                Err(e) => {
                    check_interrupt()?;
                    progress.say(format!("{}: FAILED: {e:#}", sc.name()));
                    report.add_error(sc.name(), format!("{e:#}"));
                    failed[i] = true;
                }
            }
        }
        if juneau && !scale_failed {
            // Each flow count on a fresh topology and a fresh dataplane, so that no flow
            // of an earlier measurement occupies the flow table.
            for (k, &flows) in plan.flow_scale.iter().enumerate() {
                check_interrupt()?;
                match throughput_once(plan, Scenario::Juneau, flows, plan.warmup, true) {
                    Ok(f) => {
                        say_run(
                            format!("round {}/{}: juneau @ {flows} flows", round + 1, plan.runs),
                            &f,
                        );
                        scale_runs[k].push(f);
                    }
                    Err(e) => {
                        check_interrupt()?;
                        progress.say(format!("juneau flow scale: FAILED: {e:#}"));
                        report.add_error("juneau-flow-scale", format!("{e:#}"));
                        scale_failed = true;
                        break;
                    }
                }
            }
        }
        if let Some((xi, flows)) = reference.filter(|(xi, _)| !failed[*xi]) {
            check_interrupt()?;
            reference_run(
                plan,
                progress,
                report,
                round,
                xi,
                flows,
                &mut reference_runs,
            )?;
        }
        // Every window of this round (rows, flow counts, the reference), then the extra
        // windows that give each one of the round's common kind.
        let mut slots = round_windows(
            plan,
            round,
            &mut runs,
            &mut scale_runs,
            scale_failed,
            reference.map(|(xi, flows)| (xi, flows, &mut reference_runs)),
        );
        like_kind_round(plan, progress, report, round, &mut slots)?;
        if connect {
            connect_round(plan, progress, report, round, &mut connect_failed)?;
        }
        if bulk {
            bulk_round(
                plan,
                progress,
                report,
                round,
                &mut bulk_runs,
                &mut bulk_failed,
            )?;
        }
    }
    report.bulk = crate::bulk::rows(&bulk_runs);
    for (i, sc) in plan.scenarios.iter().enumerate() {
        if !failed[i] && !matches!(sc, Scenario::TcpBulk | Scenario::TcpConnect) {
            report.scenarios.push(ScenarioResult::from_runs(
                sc.name(),
                plan.flows,
                runs[i].clone(),
            ));
        }
    }
    if juneau && !scale_failed {
        for (k, &flows) in plan.flow_scale.iter().enumerate() {
            let s = ScenarioResult::from_runs("juneau", flows, scale_runs[k].clone());
            report.flow_scale.push(FlowScalePoint {
                flows,
                runs_pps: s.runs_pps.clone(),
                median_pps: s.median_pps,
                summary: Some(s),
            });
        }
    }
    if let Some((_, flows)) = reference.filter(|_| reference_runs.len() == plan.runs as usize) {
        let s = ScenarioResult::from_runs("xdp-dnat", flows, reference_runs);
        report.flow_scale_reference = Some(FlowScalePoint {
            flows,
            runs_pps: s.runs_pps.clone(),
            median_pps: s.median_pps,
            summary: Some(s),
        });
    }
    if plan.profile {
        // Each at the rate its measured windows were offered (the median of the rates
        // asked by the windows of its figure's kind: paced, else flooded, 0: unpaced).
        let rates: Vec<(Scenario, u64)> = plan
            .scenarios
            .iter()
            .enumerate()
            .filter(|(i, sc)| !failed[*i] && PROFILED.contains(sc) && !runs[*i].is_empty())
            .map(|(i, sc)| {
                let asked: Vec<f64> = results::figure_runs(&runs[i])
                    .iter()
                    .map(|f| f.rate_pps as f64)
                    .collect();
                (*sc, results::median(&asked) as u64)
            })
            .collect();
        // And juneau at the largest flow count, where the flow table leaves the cache.
        let largest = plan
            .flow_scale
            .iter()
            .enumerate()
            .filter(|&(k, &flows)| {
                juneau && !scale_failed && flows > plan.flows && !scale_runs[k].is_empty()
            })
            .max_by_key(|&(_, &flows)| flows)
            .map(|(k, &flows)| {
                let asked: Vec<f64> = results::figure_runs(&scale_runs[k])
                    .iter()
                    .map(|f| f.rate_pps as f64)
                    .collect();
                (flows, results::median(&asked) as u64)
            });
        profile_pass(plan, progress, report, &rates, largest)?;
    }
    // Latency in rounds, scenarios in turn within each: the machine's load drifts over
    // minutes on a shared VM, and a round compares every path in the same few seconds.
    let mut latency_failed = failed.clone();
    for round in 0..plan.latency_rounds {
        for (i, sc) in plan.scenarios.iter().enumerate() {
            let no_load = plan.latency_loads.is_empty() && plan.latency_background_pps.is_empty();
            if latency_failed[i] || !sc.uses_vip() || no_load {
                continue;
            }
            check_interrupt()?;
            // The median of the windows of its figure's kind (never paced and flooded
            // together).
            let median = results::median(
                &results::figure_runs(&runs[i])
                    .iter()
                    .map(|f| f.delivered_pps)
                    .collect::<Vec<_>>(),
            );
            if let Err(e) = latency_pass(plan, progress, *sc, median, round, report) {
                check_interrupt()?;
                progress.say(format!("{} latency: FAILED: {e:#}", sc.name()));
                report.add_error(&format!("{}-latency", sc.name()), format!("{e:#}"));
                latency_failed[i] = true;
            }
        }
    }
    Ok(())
}

/// One window of a round: its path, its flows, whether its flows are created first, the
/// window.
type Slot<'a> = (Scenario, u32, bool, &'a mut RunFigures);

/// Every window of round `round` (0-based): the rows' (`runs`, by scenario), the flow
/// counts' (`scale_runs`, unless the flow scale failed), the xdp-dnat reference's
/// (`reference`: its scenario index, flow count, runs). A path without a window of
/// this round (failed) has none.
fn round_windows<'a>(
    plan: &Plan,
    round: u32,
    runs: &'a mut [Vec<RunFigures>],
    scale_runs: &'a mut [Vec<RunFigures>],
    scale_failed: bool,
    reference: Option<(usize, u32, &'a mut Vec<RunFigures>)>,
) -> Vec<Slot<'a>> {
    let r = round as usize;
    let mut slots: Vec<Slot<'a>> = Vec::new();
    for (i, v) in runs.iter_mut().enumerate() {
        if let Some(f) = v.get_mut(r) {
            slots.push((plan.scenarios[i], plan.flows, false, f));
        }
    }
    for (k, v) in scale_runs.iter_mut().enumerate() {
        if let Some(f) = v.get_mut(r).filter(|_| !scale_failed) {
            slots.push((Scenario::Juneau, plan.flow_scale[k], true, f));
        }
    }
    if let Some((xi, flows, v)) = reference {
        if let Some(f) = v.get_mut(r) {
            slots.push((plan.scenarios[xi], flows, true, f));
        }
    }
    slots
}

/// Gives every window of a round (`slots`, [`round_windows`]) one of the round's common kind
/// ([`results::common_kind`]; the IPv4 and the IPv6 rows each have their own, as no ratio
/// pairs across the families): each path without one gets an extra window of that kind,
/// kept beside its own (`RunFigures::also`). A path lacks one only when the common kind
/// is flooded (a paced common kind means every window was paced), so the extra window
/// is flooded. A failed extra window is reported; the round then pairs without it.
fn like_kind_round(
    plan: &Plan,
    progress: &Progress,
    report: &mut Report,
    round: u32,
    slots: &mut [Slot<'_>],
) -> Result<()> {
    let missing = {
        let windows: Vec<(bool, &RunFigures)> = slots.iter().map(|s| (s.0.ipv6(), &*s.3)).collect();
        results::needs_extra_window_per_family(&windows)
    };
    for i in missing {
        let (sc, flows, fill) = (slots[i].0, slots[i].1, slots[i].2);
        check_interrupt()?;
        match flooded_once(plan, sc, flows, fill) {
            Ok(f) => {
                progress.say(format!(
                    "round {}/{}: {} @ {flows} flows, extra flooded window (the round's common kind): {:.0} pps delivered (offered {:.0}), {:.0} ns/packet; {}",
                    round + 1,
                    plan.runs,
                    sc.name(),
                    f.delivered_pps,
                    f.offered_pps,
                    f.cost_ns(),
                    f.saturation
                ));
                slots[i].3.also.push(f);
            }
            Err(e) => {
                check_interrupt()?;
                let what = format!("{} @ {flows} flows, extra flooded window", sc.name());
                progress.say(format!("{what}: FAILED: {e:#}"));
                report.add_error(&what, format!("{e:#}"));
            }
        }
    }
    Ok(())
}

/// A path's extra flooded window ([`like_kind_round`]): a fresh topology, its flows
/// created first when `fill`, then one window with the generator unpaced (a flooded
/// window needs no calibrated rate).
fn flooded_once(plan: &Plan, sc: Scenario, flows: u32, fill: bool) -> Result<RunFigures> {
    let tag = format!("{}-{flows}-flooded-{}", sc.name(), std::process::id());
    let (t, mut a) = udp_bed(plan, sc, &tag)?;
    let tids = pin_path(&t, &a.path)?;
    let pinned: Vec<(u32, u64)> = path_threads(&t, &a.path)
        .into_iter()
        .filter_map(|(x, _)| Some((x, thread_run_ns(x)?)))
        .collect();
    if fill {
        fill_flows(&t, &a, flows)?;
    }
    let mut f = window_run(
        &t,
        &mut a,
        &tids,
        flows,
        0,
        (plan.warmup, plan.duration),
        None,
    )?;
    check_placement(&t, &a.path, &pinned)?;
    f.extra = true;
    Ok(f)
}

/// One round of the TCP bulk download: every stream count, each through juneau and
/// nft-dnat (which goes first alternates by round). A failed row is reported and skipped
/// in later rounds, not the suite.
fn bulk_round(
    plan: &Plan,
    progress: &Progress,
    report: &mut Report,
    round: u32,
    runs: &mut Vec<crate::bulk::BulkRun>,
    failed: &mut Vec<(u32, Scenario)>,
) -> Result<()> {
    for &streams in &plan.bulk.streams {
        let mut paths = crate::bulk::PATHS;
        if round % 2 == 1 {
            paths.reverse();
        }
        for sc in paths {
            if failed.contains(&(streams, sc)) {
                continue;
            }
            check_interrupt()?;
            match crate::bulk::run_once(plan, sc, streams, round) {
                Ok(r) => {
                    progress.say(format!(
                        "round {}/{}: tcp-bulk-{streams} {}: {} bytes in {:.2} s = {:.2} Gbit/s, path core {:.0}% busy ({:.2} CPU-s), endpoint core {:.0}%: {:.2} Gbit per CPU-second; {}",
                        round + 1,
                        plan.runs,
                        sc.name(),
                        r.moved.bytes,
                        r.moved.wall_s,
                        r.gbps,
                        100.0 * r.path_core.busy,
                        r.path_cpu_s,
                        100.0 * r.endpoint_core.busy,
                        r.gbps_per_cpu_s,
                        r.saturation
                    ));
                    runs.push(r);
                }
                Err(e) => {
                    check_interrupt()?;
                    let what = format!("tcp-bulk-{streams} {}", sc.name());
                    progress.say(format!("{what}: FAILED: {e:#}"));
                    report.add_error(&what, format!("{e:#}"));
                    failed.push((streams, sc));
                }
            }
        }
    }
    Ok(())
}

/// A fresh topology with `sc` set up (the UDP ends, the path) and delivering: what every
/// UDP measurement (throughput, latency, profile) starts from.
fn udp_bed(plan: &Plan, sc: Scenario, tag: &str) -> Result<(Topology, Active)> {
    let t = Topology::build()?;
    let mut a = setup(&t, sc, plan, tag)?;
    wait_until_delivering(&t, &mut a, Duration::from_secs(30))?;
    Ok((t, a))
}

/// The paths profiled after the rounds: the default path and the two it is held to.
const PROFILED: [Scenario; 3] = [Scenario::Juneau, Scenario::AfxdpL2fwd, Scenario::NftDnat];

/// One profiled window per path (`rates`: the path and the rate to offer, 0 unpaced):
/// `perf record` of the path core during the window
/// ([`crate::profile`]). Without `perf`, the report says so; a failed profile is reported,
/// not fatal.
fn profile_pass(
    plan: &Plan,
    progress: &Progress,
    report: &mut Report,
    rates: &[(Scenario, u64)],
    juneau_at_scale: Option<(u32, u64)>,
) -> Result<()> {
    if !crate::profile::available() {
        report.profile_note = ": `perf` is not installed (Debian: linux-perf)".into();
        return Ok(());
    }
    let windows = rates
        .iter()
        .map(|&(sc, rate)| (sc, plan.flows, rate))
        .chain(juneau_at_scale.map(|(flows, rate)| (Scenario::Juneau, flows, rate)));
    for (sc, flows, rate) in windows {
        check_interrupt()?;
        let name = if flows == plan.flows {
            sc.name().to_string()
        } else {
            format!("{} @ {flows} flows", sc.name())
        };
        match profile_once(plan, sc, flows, rate, &name) {
            Ok(p) => {
                progress.say(format!(
                    "{name}: profiled ({} samples of the path core)",
                    p.samples
                ));
                report.profiles.push(p);
            }
            Err(e) => {
                check_interrupt()?;
                progress.say(format!("{name} profile: FAILED: {e:#}"));
                report.add_error(&format!("{name}-profile"), format!("{e:#}"));
            }
        }
    }
    Ok(())
}

/// One profiled window of `sc` at `flows` flows (created first, as the flow-scale rows
/// do, when they are more than the plan's), reported as `name`.
fn profile_once(
    plan: &Plan,
    sc: Scenario,
    flows: u32,
    rate: u64,
    name: &str,
) -> Result<crate::profile::Profile> {
    let tag = format!("{}-profile-{flows}-{}", sc.name(), std::process::id());
    let (t, mut a) = udp_bed(plan, sc, &tag)?;
    let tids = pin_path(&t, &a.path)?;
    if flows > plan.flows {
        fill_flows(&t, &a, flows)?;
    }
    let (_, path_cpu) = cpus();
    let data = plan
        .out_dir
        .join(format!("profile-{}-{flows}.data", sc.name()));
    let mut rec = crate::profile::Recorder::start(path_cpu, &data)?;
    let window = (plan.warmup, plan.duration);
    let f = window_run(&t, &mut a, &tids, flows, rate, window, Some(&mut rec));
    rec.finish()?;
    let f = f?;
    let p = crate::profile::summarise(&data, name, f.delivered_pps, f.cost_ns());
    // The raw samples stay out of the report directory (and of git).
    let _ = std::fs::remove_file(&data);
    p
}

/// One round of new TCP connections: juneau and nft-dnat (which goes first alternates by
/// round). A failed path is reported and skipped in later rounds, not the suite.
fn connect_round(
    plan: &Plan,
    progress: &Progress,
    report: &mut Report,
    round: u32,
    failed: &mut Vec<Scenario>,
) -> Result<()> {
    let mut paths = crate::bulk::PATHS;
    if round % 2 == 1 {
        paths.reverse();
    }
    for sc in paths {
        if failed.contains(&sc) {
            continue;
        }
        check_interrupt()?;
        match crate::connect::run_once(plan, sc, round) {
            Ok(r) => {
                progress.say(format!(
                    "round {}/{}: tcp-connect {}: {} connections ({} failed) in {:.2} s = {:.0}/s, path core {:.0}% busy, endpoint core {:.0}%: {:.0} per CPU-second; {}",
                    round + 1,
                    plan.runs,
                    sc.name(),
                    r.connections,
                    r.failed,
                    r.wall_s,
                    r.per_s,
                    100.0 * r.path_core.busy,
                    100.0 * r.endpoint_core.busy,
                    r.per_cpu_s,
                    r.saturation
                ));
                report.connect.push(r);
            }
            Err(e) => {
                check_interrupt()?;
                let what = format!("tcp-connect {}", sc.name());
                progress.say(format!("{what}: FAILED: {e:#}"));
                report.add_error(&what, format!("{e:#}"));
                failed.push(sc);
            }
        }
    }
    Ok(())
}

/// One round's xdp-dnat run at `flows` flows (the flow-scale reference); a failure is
/// reported and ends the reference (`runs` stays short), not the suite.
fn reference_run(
    plan: &Plan,
    progress: &Progress,
    report: &mut Report,
    round: u32,
    xi: usize,
    flows: u32,
    runs: &mut Vec<RunFigures>,
) -> Result<()> {
    if runs.len() < round as usize {
        return Ok(()); // an earlier round failed
    }
    let sc = plan.scenarios[xi];
    match throughput_once(plan, sc, flows, plan.warmup, true) {
        Ok(f) => {
            progress.say(format!(
                "round {}/{}: xdp-dnat @ {flows} flows (reference): {:.0} pps delivered (offered {:.0}), {:.0} ns/packet; {}",
                round + 1,
                plan.runs,
                f.delivered_pps,
                f.offered_pps,
                f.ns_per_packet,
                f.saturation
            ));
            runs.push(f);
        }
        Err(e) => {
            check_interrupt()?;
            progress.say(format!("xdp-dnat flow-scale reference: FAILED: {e:#}"));
            report.add_error("xdp-dnat-flow-scale", format!("{e:#}"));
        }
    }
    Ok(())
}

/// One throughput run on a fresh topology: calibration, then the window. `fill`: a paced
/// run ([`fill_flows`]) before the first calibration window, so that every flow exists before anything is measured (a new
/// flow takes the userspace path; the flow-scale runs need seconds to create them all;
/// the dataplane's flow count after the run is in the report's counters).
fn throughput_once(
    plan: &Plan,
    sc: Scenario,
    flows: u32,
    warmup: Duration,
    fill: bool,
) -> Result<RunFigures> {
    let tag = format!("{}-{flows}-{}", sc.name(), std::process::id());
    let (t, mut a) = udp_bed(plan, sc, &tag)?;
    let r = measure(&t, &mut a, plan, flows, warmup, fill)?;
    if sc.is_juneau() {
        let busy_polled = busy_poll_rx_packets(&t);
        record_dataplane_counters(plan, sc, &tag, flows, busy_polled);
    }
    Ok(r)
}

/// The dataplane's own counters after a run (its stats file, written about once a
/// second; cumulative since its start, warm-up included): where packets were lost.
static DATAPLANE_COUNTERS: std::sync::Mutex<Vec<serde_json::Value>> =
    std::sync::Mutex::new(Vec::new());

/// Packets the kernel received by busy polling in the node namespace (`BusyPollRxPackets`
/// of /proc/net/netstat, per network namespace): non-zero only when a socket's busy poll
/// really ran the veth's NAPI.
fn busy_poll_rx_packets(t: &Topology) -> Option<u64> {
    let text = t.node.exec(&["cat", "/proc/net/netstat"]).ok()?;
    let mut lines = text.lines();
    while let (Some(names), Some(values)) = (lines.next(), lines.next()) {
        if !names.starts_with("TcpExt:") {
            continue;
        }
        let i = names
            .split_whitespace()
            .position(|n| n == "BusyPollRxPackets")?;
        return values.split_whitespace().nth(i)?.parse().ok();
    }
    None
}

fn record_dataplane_counters(
    plan: &Plan,
    sc: Scenario,
    tag: &str,
    flows: u32,
    busy_polled: Option<u64>,
) {
    let path = plan
        .out_dir
        .join(format!("juneau-dataplane-stats-{tag}.json"));
    let Ok(text) = std::fs::read_to_string(&path) else {
        return;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return;
    };
    let pick = |k: &str| v.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let drops: u64 = v
        .get("drops")
        .and_then(|d| d.as_object())
        .map(|d| d.values().filter_map(|x| x.as_u64()).sum())
        .unwrap_or(0);
    let entry = serde_json::json!({
        "scenario": sc.name(),
        "flows": flows,
        "rx_packets": pick("rx_packets"),
        "tx_packets": pick("tx_packets"),
        "engine_drops": drops,
        "xsk_rx_ring_full": pick("xsk_rx_ring_full"),
        "xsk_fill_ring_empty": pick("xsk_fill_ring_empty"),
        "xsk_rx_dropped": pick("xsk_rx_dropped"),
        "flows_in_table": pick("flows"),
        "ipv6_flows_in_table": pick("flows6"),
        "busy_poll_rx_packets": busy_polled,
    });
    if let Ok(mut l) = DATAPLANE_COUNTERS.lock() {
        l.push(entry);
    }
}

/// Counters collected from the dataplane's stats file after each `juneau` run.
pub fn dataplane_counters() -> Vec<serde_json::Value> {
    DATAPLANE_COUNTERS
        .lock()
        .map(|l| l.clone())
        .unwrap_or_default()
}

fn latency_pass(
    plan: &Plan,
    progress: &Progress,
    sc: Scenario,
    median: f64,
    round: u32,
    report: &mut Report,
) -> Result<()> {
    progress.say(format!(
        "{}: latency through the VIP, round {}/{}",
        sc.name(),
        round + 1,
        plan.latency_rounds
    ));
    let tag = format!("{}-latency-{}", sc.name(), std::process::id());
    let (t, mut a) = udp_bed(plan, sc, &tag)?;
    pin_path(&t, &a.path)?;
    // Fractions of this path's own median, then the same absolute rates for every path.
    let loads = plan
        .latency_loads
        .iter()
        .map(|&f| (f, (median * f).round() as u64, None))
        .chain(
            plan.latency_background_pps
                .iter()
                .map(|&r| (r as f64 / median.max(1.0), r, Some(r))),
        );
    for (load, rate, background_pps) in loads {
        let (p, offered) = latency_point(&t, &mut a, plan, rate.max(1))?;
        progress.say(format!(
            "{}: latency at {:.0}% load ({rate} pps): p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us ({}/{} replies)",
            sc.name(),
            load * 100.0,
            p.p50_us,
            p.p99_us,
            p.p999_us,
            p.received,
            p.sent
        ));
        report.latency.push(LatencyPoint {
            scenario: sc.name().into(),
            load_fraction: load,
            background_pps,
            // What the generator really offered (its own count), not the asked rate.
            offered_pps: offered,
            round,
            result: p,
        });
    }
    Ok(())
}

/// The dataplane binary: `--dataplane`, else `$JUNEAU_DATAPLANE`, else next to juneau-perf.
pub fn default_dataplane() -> PathBuf {
    if let Ok(p) = std::env::var("JUNEAU_DATAPLANE") {
        return PathBuf::from(p);
    }
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("juneau-dataplane")))
        .unwrap_or_else(|| PathBuf::from("juneau-dataplane"))
}

/// Whether `ns` still exists (for tests of cleanup).
pub fn netns_exists(name: &str) -> bool {
    Path::new("/var/run/netns").join(name).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_s_udp_counters_name_what_is_not_zero() {
        let snmp = "Ip: Forwarding\nIp: 1\nUdp: InDatagrams NoPorts InErrors RcvbufErrors InCsumErrors\nUdp: 5 0 7 7 0\nUdpLite: InDatagrams\nUdpLite: 0\n";
        assert_eq!(
            nonzero_udp_counters(snmp),
            "InDatagrams 5, InErrors 7, RcvbufErrors 7"
        );
        assert_eq!(
            nonzero_udp_counters("Ip: x\n"),
            "no Udp lines in /proc/net/snmp"
        );
        let snmp6 = "Ip6InReceives                   \t9\nUdp6InDatagrams                 \t12\nUdp6NoPorts                     \t0\nUdp6RcvbufErrors                \t3\n";
        assert_eq!(
            nonzero_udp6_counters(snmp6),
            "Udp6InDatagrams 12, Udp6RcvbufErrors 3"
        );
    }
}
