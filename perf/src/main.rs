//! `juneau-perf`: runs Juneau's benchmark suite (see perf/README.md).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use juneau_perf::bulk::BulkPlan;
use juneau_perf::packet::{parse_mac, Template};
use juneau_perf::report::Report;
use juneau_perf::suite::{self, Plan, Progress, Scenario, INTERRUPTED};
use juneau_perf::{convergence, latency, prereq, xsk};

#[derive(Parser)]
#[command(
    name = "juneau-perf",
    about = "Juneau's benchmark harness: the dataplane against kernel and XDP baselines"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// Directory for report.json, report.md, the PNGs and logs.
    #[arg(long, default_value = "perf-report")]
    out: PathBuf,
    /// The juneau-dataplane binary (default: $JUNEAU_DATAPLANE, else next to juneau-perf).
    #[arg(long)]
    dataplane: Option<PathBuf>,
    /// Scenarios to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    scenarios: Option<Vec<Scenario>>,
    /// Runs per scenario.
    #[arg(long)]
    runs: Option<u32>,
    /// Measurement window per run, seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Latency rounds (default 3 in `run`, 1 in `smoke`; 0 skips latency): each
    /// measures every scenario at every load, the scenarios in turn.
    #[arg(long)]
    latency_rounds: Option<u32>,
    /// Skip the callgrind cost measurement.
    #[arg(long)]
    no_cost: bool,
    /// The juneau-k8s-sync binary (default: $JUNEAU_K8S_SYNC, else next to juneau-perf).
    #[arg(long)]
    k8s_sync: Option<PathBuf>,
    /// The juneau-bgp binary (default: $JUNEAU_BGP, else next to juneau-perf).
    #[arg(long)]
    bgp: Option<PathBuf>,
    /// Control-plane convergence repetitions (default: 30 in `run` and `convergence`).
    #[arg(long)]
    convergence_reps: Option<u32>,
    /// Skip the control-plane convergence measurement.
    #[arg(long)]
    no_convergence: bool,
    /// Skip the profile of the path core ("Where the time goes": one extra window of
    /// juneau, afxdp-l2fwd and nft-dnat under `perf record`).
    #[arg(long)]
    no_profile: bool,
    /// An extra argument for every juneau-dataplane the run starts (repeatable, e.g.
    /// `--dataplane-arg=--busy-poll-us=0`).
    #[arg(long, allow_hyphen_values = true)]
    dataplane_arg: Vec<String>,
    /// Services of the control-plane scale measurement (default: 10000 in `run` and
    /// `scale`, 20 in `smoke`; 0 skips it).
    #[arg(long)]
    scale_services: Option<u32>,
    /// Longest wait for the scale measurement's Services to converge, seconds.
    #[arg(long, default_value_t = 300)]
    scale_timeout_s: u64,
    /// TCP bulk download: MiB per connection (default 64 in `run`, 4 in `smoke`).
    #[arg(long)]
    bulk_mib: Option<u64>,
    /// TCP bulk download: connections at once, one row each (default 1,16 in `run`, 1,4
    /// in `smoke`).
    #[arg(long, value_delimiter = ',')]
    bulk_streams: Option<Vec<u32>>,
    /// Flow counts of the `juneau` flow-scale rows (default 1000,100000,1000000 in `run`,
    /// 1000,100000 in `smoke`; `0` runs none).
    #[arg(long, value_delimiter = ',')]
    flow_scale: Option<Vec<u32>>,
    /// TCP bulk download: longest time one round of downloads may take, seconds.
    #[arg(long, default_value_t = 120)]
    bulk_timeout_s: u64,
    /// Scale measurement: create every Service before the Juneau daemons start and
    /// measure from their start (Juneau's own convergence, without the apiserver's
    /// creation rate); only that mode (short for `--scale-modes precreated`).
    #[arg(long, conflicts_with = "scale_modes")]
    scale_precreated: bool,
    /// Scale measurement modes, in order (`live`: created while Juneau runs, against the
    /// apiserver alone; `precreated`): default both in `run`, `live` in `scale`, `live` in
    /// `smoke`.
    #[arg(long, value_delimiter = ',')]
    scale_modes: Option<Vec<ScaleMode>>,
}

/// How the scale measurement's Services are created (`--scale-modes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ScaleMode {
    /// Created while the Juneau daemons run; the apiserver alone is the baseline.
    Live,
    /// Created before the Juneau daemons start.
    Precreated,
}

impl RunArgs {
    /// The scale modes to measure, in order; `full`: a full run (both by default).
    fn scale_modes(&self, full: bool) -> Vec<ScaleMode> {
        if self.scale_precreated {
            vec![ScaleMode::Precreated]
        } else if let Some(m) = &self.scale_modes {
            m.clone()
        } else if full {
            vec![ScaleMode::Live, ScaleMode::Precreated]
        } else {
            vec![ScaleMode::Live]
        }
    }
}

/// `juneau-perf gen`'s arguments.
#[derive(clap::Args)]
struct GenArgs {
    #[arg(long)]
    iface: String,
    /// The generator (default: live frames, or AF_XDP copy-mode TX where this kernel
    /// refuses live frames).
    #[arg(long, value_enum)]
    generator: Option<juneau_perf::gen::Generator>,
    #[arg(long)]
    src_mac: String,
    #[arg(long)]
    dst_mac: String,
    /// The destination: an IPv4 address (64-byte frames), or an IPv6 one (the IPv6 load:
    /// 70-byte UDP frames from the IPv6 flows).
    #[arg(long)]
    dst_ip: IpAddr,
    #[arg(long)]
    dst_port: u16,
    #[arg(long, default_value_t = 256)]
    flows: u32,
    /// Packets/s, 0 = as fast as possible.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    #[arg(long)]
    duration_ms: u64,
    #[arg(long, default_value_t = u64::MAX)]
    max_packets: u64,
    /// Replies: the flows are the destinations, this the fixed source.
    #[arg(long)]
    reply_from: Option<SocketAddr>,
    /// Partial UDP checksums (as a Pod with tx offload sends them).
    #[arg(long)]
    partial_checksum: bool,
    /// What each frame is (floods: syn, ack, fragment).
    #[arg(long, value_enum, default_value = "udp")]
    kind: juneau_perf::packet::FrameKind,
}

#[derive(Subcommand)]
enum Cmd {
    /// The full suite (5 rounds of every scenario, 5 s windows, flow scale, latency, cost).
    Run(RunArgs),
    /// A very short pass over every part of the harness (what CI runs).
    Smoke(RunArgs),
    /// Only the control-plane convergence measurement (real kube-apiserver, k8s-sync,
    /// juneau-bgp, BIRD 2): EndpointSlice change -> shared memory and -> BIRD.
    Convergence(RunArgs),
    /// Only the control-plane scale measurement: N Services (3 endpoints each) at once
    /// against the real apiserver, controller, agent, juneau-bgp and BIRD.
    Scale(RunArgs),
    /// Only the userspace cost: the engine alone and the whole loop (the dataplane)
    /// under callgrind (instruction counts: meaningful on a loaded machine too).
    LoopCost(RunArgs),
    /// Floods at generator rate (random-source SYN, ACK, UDP, first fragments, UDP to the
    /// redirect port from strangers) against
    /// the default path while a real TCP client keeps one connection and opens new ones
    /// (docs/security.md); writes flood.json and flood.md.
    Flood {
        #[command(flatten)]
        run: RunArgs,
        /// The floods, each on a fresh topology after a baseline without one.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "syn,ack,udp,fragment,redirect-port"
        )]
        kinds: Vec<juneau_perf::flood::FloodKind>,
        /// Seconds each flood lasts.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
    },
    /// Lists missing prerequisites and exits.
    Check(RunArgs),
    /// Re-renders report.md and the plots from DIR/report.json, the throughput rows and
    /// their ratios re-derived from the recorded runs with today's rule (paced and
    /// flooded windows apart); report.json stays as the run wrote it.
    Render {
        /// The report directory.
        dir: PathBuf,
    },
    /// (internal) traffic generator (live-frames BPF_PROG_RUN, or AF_XDP copy-mode TX
    /// where the kernel refuses live frames); prints a JSON result.
    #[command(hide = true)]
    Gen(GenArgs),
    /// (internal) raw AF_XDP forwarder baseline.
    #[command(hide = true)]
    L2fwd {
        #[arg(long)]
        rx_iface: String,
        #[arg(long)]
        tx_iface: String,
        #[arg(long)]
        src_mac: String,
        #[arg(long)]
        dst_mac: String,
        #[arg(long)]
        port: u16,
        #[arg(long)]
        duration_s: u64,
        /// SCHED_FIFO priority, as juneau-dataplane's `--worker-priority` (same default):
        /// the same wake-up policy as juneau's workers; 0: the normal policy, spinning.
        #[arg(long, default_value_t = 10)]
        worker_priority: u8,
    },
    /// (internal) UDP echo server.
    #[command(hide = true)]
    Echo {
        #[arg(long)]
        port: u16,
        #[arg(long)]
        duration_s: u64,
    },
    /// (internal) latency prober; prints a JSON result.
    #[command(hide = true)]
    Probe {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 1000)]
        rate: u32,
        #[arg(long)]
        duration_ms: u64,
    },
}

fn plan_for(args: &RunArgs, smoke: bool) -> Result<Plan> {
    let out = std::path::absolute(&args.out)?;
    let mut plan = if smoke {
        Plan {
            scenarios: Scenario::ALL.to_vec(),
            runs: 1,
            warmup: Duration::from_millis(300),
            duration: Duration::from_millis(700),
            flows: 256,
            flow_scale: vec![1_000, 100_000],
            profile: true,
            latency_loads: vec![0.5],
            latency_background_pps: vec![50_000],
            latency_duration: Duration::from_millis(700),
            latency_rounds: 1,
            probe_rate: 500,
            calibrate_window: Duration::from_millis(300),
            calibrate_steps: 2,
            dataplane: suite::default_dataplane(),
            dataplane_wrapper: Vec::new(),
            dataplane_args: Vec::new(),
            out_dir: out,
            bulk: BulkPlan {
                bytes: 4 << 20,
                streams: vec![1, 4],
                timeout: Duration::from_secs(args.bulk_timeout_s),
            },
        }
    } else {
        Plan {
            scenarios: Scenario::ALL.to_vec(),
            runs: 5,
            warmup: Duration::from_secs(1),
            duration: Duration::from_secs(5),
            flows: 256,
            flow_scale: vec![1_000, 100_000, 1_000_000],
            profile: true,
            latency_loads: vec![0.1, 0.5, 0.9],
            latency_background_pps: vec![100_000, 400_000],
            latency_duration: Duration::from_secs(5),
            latency_rounds: 3,
            probe_rate: 1000,
            calibrate_window: Duration::from_secs(1),
            calibrate_steps: 7,
            dataplane: suite::default_dataplane(),
            dataplane_wrapper: Vec::new(),
            dataplane_args: Vec::new(),
            out_dir: out,
            bulk: BulkPlan {
                bytes: 64 << 20,
                streams: vec![1, 16],
                timeout: Duration::from_secs(args.bulk_timeout_s),
            },
        }
    };
    if let Some(m) = args.bulk_mib {
        if m == 0 {
            bail!("--bulk-mib must be at least 1");
        }
        plan.bulk.bytes = m << 20;
    }
    if let Some(s) = &args.bulk_streams {
        if s.is_empty() || s.contains(&0) {
            bail!("--bulk-streams takes stream counts of at least 1");
        }
        plan.bulk.streams = s.clone();
    }
    plan.profile = !args.no_profile;
    if let Some(f) = &args.flow_scale {
        plan.flow_scale = f.iter().copied().filter(|&n| n > 0).collect();
    }
    if let Some(s) = &args.scenarios {
        plan.scenarios = s.clone();
    }
    if let Some(r) = args.runs {
        if r == 0 {
            bail!("--runs must be at least 1");
        }
        plan.runs = r;
    }
    if let Some(d) = args.duration_s {
        plan.duration = Duration::from_secs_f64(d);
    }
    if let Some(r) = args.latency_rounds {
        plan.latency_rounds = r;
    }
    if let Some(dp) = &args.dataplane {
        plan.dataplane = std::path::absolute(dp)?;
    }
    plan.dataplane_args
        .extend(args.dataplane_arg.iter().cloned());
    Ok(plan)
}

fn convergence_binaries(args: &RunArgs) -> Result<convergence::Binaries> {
    let mut b = convergence::Binaries::default_paths();
    if let Some(p) = &args.k8s_sync {
        b.k8s_sync = std::path::absolute(p)?;
    }
    if let Some(p) = &args.bgp {
        b.bgp = std::path::absolute(p)?;
    }
    Ok(b)
}

/// Copies the binaries into `<out>/bin` (others rebuild the shared target dir meanwhile).
fn stage_convergence_binaries(
    b: &convergence::Binaries,
    out: &std::path::Path,
) -> Result<convergence::Binaries> {
    let bin = out.join("bin");
    std::fs::create_dir_all(&bin)?;
    let copy = |from: &std::path::Path, name: &str| -> Result<PathBuf> {
        let to = bin.join(name);
        let _ = std::fs::remove_file(&to);
        std::fs::copy(from, &to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        Ok(to)
    };
    Ok(convergence::Binaries {
        k8s_sync: copy(&b.k8s_sync, "juneau-k8s-sync")?,
        bgp: copy(&b.bgp, "juneau-bgp")?,
    })
}

/// Measures convergence into `report` (a failure is recorded as an error of the report).
fn run_convergence(
    bins: &convergence::Binaries,
    reps: u32,
    progress: &Progress,
    report: &mut Report,
) {
    progress.say(format!(
        "control-plane convergence: {reps} repetitions (kube-apiserver, k8s-sync, juneau-bgp, BIRD)"
    ));
    match convergence::measure(bins, reps, &|m| progress.say(m)) {
        Ok(c) => {
            let p50 = |n: &str| {
                c.series
                    .iter()
                    .find(|s| s.name == n)
                    .map(|s| s.p50_ms)
                    .unwrap_or(f64::NAN)
            };
            report.convergence = format!(
                "Median from the EndpointSlice PATCH: withdraw {:.1} ms to shared memory, {:.1} ms to BIRD; announce {:.1} ms to shared memory, {:.1} ms to BIRD.",
                p50("withdraw: apiserver -> shared memory"),
                p50("withdraw: apiserver -> BIRD"),
                p50("announce: apiserver -> shared memory"),
                p50("announce: apiserver -> BIRD"),
            );
            progress.say(format!("convergence: {}", report.convergence));
            report.convergence_results = Some(c);
        }
        Err(e) => {
            report.convergence = format!("Failed: {e:#}");
            report.add_error("convergence", format!("{e:#}"));
        }
    }
}

/// Measures control-plane scale into `report` (a failure is recorded as an error).
fn run_scale(
    bins: &convergence::Binaries,
    n: u32,
    timeout: Duration,
    out: &std::path::Path,
    progress: &Progress,
    report: &mut Report,
    mode: ScaleMode,
) {
    let (creation, name) = match mode {
        ScaleMode::Live => (juneau_perf::scale::Creation::Live, "live"),
        ScaleMode::Precreated => (juneau_perf::scale::Creation::Precreated, "precreated"),
    };
    progress.say(format!(
        "control-plane scale: {n} Services at once ({name})"
    ));
    match juneau_perf::scale::measure(bins, n, timeout, out, &|m| progress.say(m), creation) {
        Ok(r) => {
            progress.say(format!(
                "scale ({name}): all VIPs {:?} s, all Ready {:?} s, shared memory {:?} s, BIRD {:?} s",
                r.all_vips_s, r.all_ready_s, r.shm_all_advertised_s, r.bird_all_routes_s
            ));
            match mode {
                ScaleMode::Live => report.scale = Some(r),
                ScaleMode::Precreated => report.scale_precreated = Some(r),
            }
        }
        Err(e) => report.add_error(&format!("scale ({name})"), format!("{e:#}")),
    }
}

/// Refuses to start with anything `missing` (each listed with its fix), then makes `out`,
/// stages the binaries into it and installs the Ctrl-C handler that stops cleanly.
fn prepare_bed(
    missing: Vec<prereq::Missing>,
    bins: &convergence::Binaries,
    out: &std::path::Path,
) -> Result<convergence::Binaries> {
    if !missing.is_empty() {
        for m in &missing {
            eprintln!("  - {}: {}", m.what, m.fix);
        }
        bail!(
            "{} prerequisite(s) missing (nothing was installed)",
            missing.len()
        );
    }
    std::fs::create_dir_all(out)?;
    let bins = stage_convergence_binaries(bins, out)?;
    ctrlc::set_handler(|| {
        eprintln!("interrupt: stopping and removing the namespaces...");
        INTERRUPTED.store(true, Ordering::Relaxed);
    })
    .context("installing the Ctrl-C handler")?;
    Ok(bins)
}

fn scale_only(args: &RunArgs) -> Result<()> {
    let out = std::path::absolute(&args.out)?;
    let bins = convergence_binaries(args)?;
    let bins = prepare_bed(convergence::missing(&bins), &bins, &out)?;
    let n = args.scale_services.unwrap_or(10_000);
    let timeout = Duration::from_secs(args.scale_timeout_s);
    let progress = Progress::new(timeout);
    let modes = args.scale_modes(false);
    let mut report = Report {
        date: juneau_perf::cost::utc_now(),
        machine: prereq::machine(),
        load_average_start: prereq::loadavg(),
        mode: "scale".into(),
        config: serde_json::json!({ "scale_services": n, "scale_modes": format!("{modes:?}") }),
        ..Default::default()
    };
    report.cost.status = "Not measured (scale only).".into();
    report.convergence = "Not measured (scale only).".into();
    for mode in modes {
        run_scale(&bins, n, timeout, &out, &progress, &mut report, mode);
    }
    report.load_average_end = prereq::loadavg();
    let files = report.write(&out)?;
    for f in files {
        eprintln!("  {}", f.display());
    }
    if let Some((_, e)) = report.errors.first() {
        bail!("scale failed: {e}");
    }
    Ok(())
}

fn loop_cost_plan(smoke: bool) -> juneau_perf::loopcost::LoopCostPlan {
    juneau_perf::loopcost::LoopCostPlan {
        packets: if smoke { 1_000 } else { 20_000 },
        flows: if smoke {
            vec![1_000]
        } else {
            vec![1_000, 1_000_000]
        },
        rate: 50_000,
    }
}

/// The plan of a run on namespaces of its own: its output directory made, the binaries
/// staged (the cost bench's path returned), Ctrl-C turned into a clean stop.
fn namespace_run(args: &RunArgs) -> Result<(Plan, std::path::PathBuf)> {
    let mut plan = plan_for(args, false)?;
    std::fs::create_dir_all(&plan.out_dir)?;
    let cost_bench = suite::stage_binaries(&mut plan)?;
    ctrlc::set_handler(|| {
        eprintln!("interrupt: stopping and removing the namespaces...");
        INTERRUPTED.store(true, Ordering::Relaxed);
    })
    .context("installing the Ctrl-C handler")?;
    Ok((plan, cost_bench))
}

/// The userspace cost alone: the engine-only instruction counts (as the full run
/// measures them, `cost.json`) and the whole loop's (`loop-cost.json`).
fn loop_cost_only(args: &RunArgs) -> Result<()> {
    let (plan, cost_bench) = namespace_run(args)?;
    let c = juneau_perf::cost::measure(&cost_bench, &plan.out_dir, false);
    println!("engine only: {}", c.status);
    write_part(
        &plan,
        "cost.json",
        &c,
        c.established_instructions_per_packet.is_some(),
    )
    .with_context(|| format!("engine cost not measured: {}", c.status))?;
    let progress = Progress::new(juneau_perf::loopcost::EXPECTED);
    let l = juneau_perf::loopcost::measure(&plan, &loop_cost_plan(false), &|m| progress.say(m));
    progress.say(format!("loop cost: {}", l.status));
    write_part(&plan, "loop-cost.json", &l, !l.cases.is_empty())
        .with_context(|| format!("loop cost not measured: {}", l.status))
}

/// Writes a part's result into the run's directory; an error after writing it when it
/// holds no measurement.
fn write_part(plan: &Plan, file: &str, part: &impl serde::Serialize, measured: bool) -> Result<()> {
    std::fs::write(plan.out_dir.join(file), serde_json::to_vec_pretty(part)?)?;
    if !measured {
        bail!("{file} holds no measurement");
    }
    Ok(())
}

fn flood_only(args: &RunArgs, kinds: &[juneau_perf::flood::FloodKind], seconds: f64) -> Result<()> {
    if !(0.5..=600.0).contains(&seconds) {
        bail!("--seconds must be between 0.5 and 600");
    }
    let (plan, _) = namespace_run(args)?;
    let rows = juneau_perf::flood::run(&plan, kinds, Duration::from_secs_f64(seconds))?;
    let md = juneau_perf::flood::markdown(&rows);
    std::fs::write(
        plan.out_dir.join("flood.json"),
        serde_json::to_vec_pretty(&rows)?,
    )?;
    std::fs::write(plan.out_dir.join("flood.md"), &md)?;
    println!("{md}");
    let broken: Vec<&str> = rows
        .iter()
        .filter(|r| !r.held())
        .map(|r| r.flood.as_str())
        .collect();
    if !broken.is_empty() {
        bail!(
            "legitimate traffic not fully served during: {}",
            broken.join(", ")
        );
    }
    Ok(())
}

fn convergence_only(args: &RunArgs) -> Result<()> {
    let out = std::path::absolute(&args.out)?;
    let bins = convergence_binaries(args)?;
    let mut missing = prereq::check(None, false);
    missing.extend(convergence::missing(&bins));
    if !missing.is_empty() {
        eprintln!("juneau-perf convergence cannot run; missing:");
    }
    let bins = prepare_bed(missing, &bins, &out)?;
    let reps = args.convergence_reps.unwrap_or(30).max(1);
    let expected = convergence::expected(reps);
    eprintln!(
        "juneau-perf convergence: {reps} repetitions; expected duration ~{} s. Output: {}",
        expected.as_secs(),
        out.display()
    );
    let progress = Progress::new(expected);
    let mut report = Report {
        date: juneau_perf::cost::utc_now(),
        machine: prereq::machine(),
        load_average_start: prereq::loadavg(),
        mode: "convergence".into(),
        config: serde_json::json!({ "convergence_repetitions": reps }),
        ..Default::default()
    };
    report.cost.status = "Not measured (convergence only).".into();
    run_convergence(&bins, reps, &progress, &mut report);
    report.load_average_end = prereq::loadavg();
    let files = report.write(&out)?;
    progress.say("done; wrote:");
    for f in files {
        eprintln!("  {}", f.display());
    }
    if let Some((_, e)) = report.errors.first() {
        bail!("convergence failed: {e}");
    }
    Ok(())
}

fn run_suite(args: &RunArgs, smoke: bool) -> Result<()> {
    let plan = plan_for(args, smoke)?;
    let with_juneau = plan
        .scenarios
        .iter()
        .any(|s| s.is_juneau() || matches!(s, Scenario::TcpBulk | Scenario::TcpConnect));
    let cost = !args.no_cost;
    let mut missing = prereq::check(with_juneau.then_some(plan.dataplane.as_path()), cost);
    // Convergence: 30 repetitions in `run`, 3 in `smoke` (~10 s more).
    let conv_reps = (!args.no_convergence).then(|| {
        args.convergence_reps
            .unwrap_or(if smoke { 3 } else { 30 })
            .max(1)
    });
    let conv_bins = convergence_binaries(args)?;
    if conv_reps.is_some() {
        missing.extend(convergence::missing(&conv_bins));
    }
    if !missing.is_empty() {
        eprintln!("juneau-perf cannot run; missing:");
        for m in &missing {
            eprintln!("  - {}: {}", m.what, m.fix);
        }
        bail!(
            "{} prerequisite(s) missing (nothing was installed)",
            missing.len()
        );
    }
    std::fs::create_dir_all(&plan.out_dir)?;
    let mut plan = plan;
    let dataplane_source = plan.dataplane.clone();
    let cost_bench = suite::stage_binaries(&mut plan)?;
    let conv_bins = match conv_reps {
        Some(_) => stage_convergence_binaries(&conv_bins, &plan.out_dir)?,
        None => conv_bins,
    };
    ctrlc::set_handler(|| {
        eprintln!("interrupt: stopping and removing the namespaces...");
        INTERRUPTED.store(true, Ordering::Relaxed);
    })
    .context("installing the Ctrl-C handler")?;
    let expected = plan.expected()
        + if cost {
            juneau_perf::cost::EXPECTED + juneau_perf::loopcost::EXPECTED
        } else {
            Duration::ZERO
        }
        + conv_reps.map(convergence::expected).unwrap_or_default();
    eprintln!(
        "juneau-perf {}: {} scenario(s) x {} run(s) of {:.1}s, flow scale {:?}, latency at {:?} of max and at {:?} pps; expected duration ~{} s ({:.1} min). Output: {}",
        if smoke { "smoke" } else { "run" },
        plan.scenarios.len(),
        plan.runs,
        plan.duration.as_secs_f64(),
        plan.flow_scale,
        plan.latency_loads,
        plan.latency_background_pps,
        expected.as_secs(),
        expected.as_secs_f64() / 60.0,
        plan.out_dir.display()
    );
    let progress = Progress::new(expected);
    let generator = {
        let (g, why) = juneau_perf::gen::Generator::for_this_kernel();
        g.describe(why.as_deref())
    };
    let mut report = Report {
        date: juneau_perf::cost::utc_now(),
        machine: prereq::machine(),
        load_average_start: prereq::loadavg(),
        mode: if smoke { "smoke" } else { "run" }.into(),
        config: serde_json::json!({
            "runs": plan.runs,
            "warmup_s": plan.warmup.as_secs_f64(),
            "window_s": plan.duration.as_secs_f64(),
            "flows": plan.flows,
            "flow_scale": plan.flow_scale,
            "latency_loads": plan.latency_loads,
            "latency_background_pps": plan.latency_background_pps,
            "latency_duration_s": plan.latency_duration.as_secs_f64(),
            "latency_rounds": plan.latency_rounds,
            "probe_rate": plan.probe_rate,
            "dataplane": dataplane_source,
            "generator": generator,
            "packet_bytes": 64,
            "packet_bytes_ipv6": juneau_perf::packet::FRAME6_LEN + 4,
            "bulk_bytes_per_connection": plan.bulk.bytes,
            "bulk_streams": plan.bulk.streams,
            "bulk_min_window_s": plan.duration.as_secs_f64(),
        }),
        convergence: "Not measured in this run (--no-convergence).".into(),
        ..Default::default()
    };
    if !with_juneau {
        report.add_error("juneau", "not run (not selected with --scenarios)".into());
    }
    suite::run(&plan, &progress, &mut report)?;
    if cost {
        progress.say("userspace cost: callgrind on the dataplane's packet path");
        report.cost = juneau_perf::cost::measure(&cost_bench, &plan.out_dir, smoke);
        progress.say(format!("cost: {}", report.cost.status));
        if with_juneau {
            let lp = loop_cost_plan(smoke);
            progress.say("whole userspace cost: the dataplane under callgrind");
            let l = juneau_perf::loopcost::measure(&plan, &lp, &|m| progress.say(m));
            progress.say(format!("loop cost: {}", l.status));
            report.loop_cost = Some(l);
        }
    } else {
        report.cost.status = "Not measured (--no-cost).".into();
    }
    if let Some(reps) = conv_reps {
        run_convergence(&conv_bins, reps, &progress, &mut report);
    }
    let scale_n = args
        .scale_services
        .unwrap_or(if smoke { 20 } else { 10_000 });
    if scale_n > 0 && conv_reps.is_some() {
        for mode in args.scale_modes(!smoke) {
            run_scale(
                &conv_bins,
                scale_n,
                Duration::from_secs(args.scale_timeout_s),
                &plan.out_dir,
                &progress,
                &mut report,
                mode,
            );
        }
    }
    finish_report(&mut report, &plan.out_dir, &progress)
}

/// Completes `report` (load average, the dataplane's counters, the ratios), writes it
/// into `out_dir`, and fails naming the parts that failed.
fn finish_report(
    report: &mut Report,
    out_dir: &std::path::Path,
    progress: &Progress,
) -> Result<()> {
    report.load_average_end = prereq::loadavg();
    report.dataplane_counters = suite::dataplane_counters();
    report.compute_ratios();
    let files = report.write(out_dir)?;
    progress.say("done; wrote:");
    for f in files {
        eprintln!("  {}", f.display());
    }
    let r = &report.ratios;
    eprintln!(
        "ratios: juneau/nft-dnat {:?}, juneau-xdp-fast/xdp-dnat {:?}, juneau/afxdp-l2fwd {:?}, flow scale {:?}, juneau6/nft-dnat6 {:?}",
        r.juneau_vs_nft_dnat, r.juneau_xdp_fast_vs_xdp_dnat, r.juneau_vs_afxdp_l2fwd, r.juneau_flow_scale_largest_vs_smallest, r.juneau6_vs_nft_dnat6
    );
    let failed: Vec<_> = report
        .errors
        .iter()
        .filter(|(_, e)| !e.starts_with("not run"))
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} part(s) failed: {}",
            failed.len(),
            failed
                .iter()
                .map(|(s, _)| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let never = std::sync::atomic::AtomicBool::new(false);
    match cli.cmd {
        Cmd::Run(a) => run_suite(&a, false),
        Cmd::Render { dir } => {
            let mut r = Report::read(&dir)?;
            r.rederive_throughput();
            for f in r.render(&dir)? {
                println!("{}", f.display());
            }
            Ok(())
        }
        Cmd::Smoke(a) => run_suite(&a, true),
        Cmd::Convergence(a) => convergence_only(&a),
        Cmd::Scale(a) => scale_only(&a),
        Cmd::LoopCost(a) => loop_cost_only(&a),
        Cmd::Flood {
            run,
            kinds,
            seconds,
        } => flood_only(&run, &kinds, seconds),
        Cmd::Check(a) => {
            let plan = plan_for(&a, false)?;
            let mut missing = prereq::check(Some(&plan.dataplane), !a.no_cost);
            if !a.no_convergence {
                missing.extend(convergence::missing(&convergence_binaries(&a)?));
            }
            for m in &missing {
                println!("missing: {}: {}", m.what, m.fix);
            }
            if missing.is_empty() {
                println!("all prerequisites present");
                Ok(())
            } else {
                bail!("{} prerequisite(s) missing", missing.len())
            }
        }
        Cmd::Gen(a) => generate(a),
        Cmd::L2fwd {
            rx_iface,
            tx_iface,
            src_mac,
            dst_mac,
            port,
            duration_s,
            worker_priority,
        } => {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let s2 = stop.clone();
            ctrlc::set_handler(move || s2.store(true, Ordering::Relaxed))?;
            let mut steer = juneau_perf::bpf::XskSteer::attach_here(&rx_iface, port)?;
            let cfg = xsk::L2fwdConfig {
                rx_iface,
                tx_iface,
                src_mac: parse_mac(&src_mac).context("--src-mac")?,
                dst_mac: parse_mac(&dst_mac).context("--dst-mac")?,
                duration: Duration::from_secs(duration_s),
                worker_priority,
            };
            let r = xsk::l2fwd(&cfg, &stop, |fd| steer.register(0, fd))?;
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }
        Cmd::Echo { port, duration_s } => {
            latency::echo(port, Duration::from_secs(duration_s), &never)?;
            Ok(())
        }
        Cmd::Probe {
            target,
            rate,
            duration_ms,
        } => {
            let r = latency::probe(
                target,
                rate,
                Duration::from_millis(duration_ms),
                Duration::from_millis(100),
                &never,
            )?;
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }
    }
}

/// `juneau-perf gen`: runs the traffic generator and prints its result as JSON.
fn generate(a: GenArgs) -> Result<()> {
    let GenArgs {
        iface,
        generator,
        src_mac,
        dst_mac,
        dst_ip,
        dst_port,
        flows,
        rate,
        duration_ms,
        max_packets,
        reply_from,
        partial_checksum,
        kind,
    } = a;
    let never = std::sync::atomic::AtomicBool::new(false);
    // The caller starts its clock at this line (stdout, before the JSON result).
    let ready = || {
        println!("ready");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    let (dst_ip, ipv6) = match dst_ip {
        IpAddr::V4(ip) => (ip, None),
        IpAddr::V6(ip) => (
            Ipv4Addr::UNSPECIFIED,
            Some(juneau_perf::gen::Ipv6Load {
                dst_ip: ip,
                src_base: juneau_perf::topology::FLOW_BASE6,
            }),
        ),
    };
    let template = Template {
        src_mac: parse_mac(&src_mac).context("--src-mac")?,
        dst_mac: parse_mac(&dst_mac).context("--dst-mac")?,
        dst_ip,
        dst_port,
    };
    let cfg = juneau_perf::gen::GenConfig {
        iface,
        template,
        src_base: juneau_perf::topology::FLOW_BASE,
        flows,
        rate_pps: rate,
        duration: Duration::from_millis(duration_ms),
        max_packets,
        reply_from: match reply_from {
            Some(SocketAddr::V4(a)) => Some((*a.ip(), a.port())),
            Some(a) => bail!("--reply-from {a}: IPv4 only"),
            None => None,
        },
        partial_checksum,
        kind,
        ipv6,
    };
    let r = juneau_perf::gen::generate(&cfg, generator, &never, &ready)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}
