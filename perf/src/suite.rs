//! The scenarios and the suite runner: builds a fresh topology per scenario, sets the node
//! namespace up as the scenario says, drives the generator, reads the sink, and collects
//! everything into a [`crate::report_data::Report`].

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use juneau_tests::netns::NsChild;

use crate::bpf::{DnatConfig, PassProgram, Sink, XdpDnat};
use crate::calibrate::{window_retry_rate, RateSearch, PACED_BELOW_FLOOD, WINDOW_RETRIES};
use crate::latency::ProbeResult;
use crate::packet::format_mac;
use crate::report_data::Report;
use crate::results::{self, FlowScalePoint, LatencyPoint, RunFigures, ScenarioResult};
use crate::topology::*;
use crate::xsk::GenResult;

/// Set by the Ctrl-C handler; every wait checks it, so the run unwinds and cleans up.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The benchmark scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Plain IPv4 forwarding in the node namespace.
    KernelForward,
    /// nftables DNAT of the VIP to the backend, structured like kube-proxy's nftables mode.
    NftDnat,
    /// In-kernel XDP DNAT + XDP_REDIRECT (perf/bpf/xdp_dnat.c).
    XdpDnat,
    /// Raw AF_XDP forwarder without NAT (MAC rewrite only): the userspace ceiling.
    AfxdpL2fwd,
    /// The real juneau-dataplane binary with its defaults, fed by a real
    /// NodeStateWriter: every packet through the AF_XDP sockets and userspace, the path
    /// every Pod of a bridge CNI gets. The headline.
    Juneau,
    /// The same with the opt-in accelerator `--xdp-fast-path`: the steering program
    /// forwards established flows itself where the egress takes XDP frames (here: the
    /// backend veth, whose peer runs an XDP program).
    JuneauXdpFast,
    /// The same with AF_XDP busy polling (`--xsk-busy-poll-budget`, and the node's veths
    /// deferring their NAPI to the busy poller: `napi_defer_hard_irqs`,
    /// `gro_flush_timeout`).
    JuneauBusyPoll,
    /// The TCP bulk download through the VIP (the `bulk` module): `juneau` and `nft-dnat` at
    /// each stream count of the plan, rows `tcp-bulk-<streams>`.
    TcpBulk,
}

impl Scenario {
    /// Every scenario, in report order.
    /// (`juneau-busy-poll` is not among them: on Linux >= 6.13 an AF_XDP socket gets a
    /// NAPI id to busy-poll only when bound in zero-copy mode, which veth lacks — measured:
    /// `BusyPollRxPackets` stays 0 — so on this topology it measures the same loop as
    /// `juneau`; run it with `--scenarios` on a kernel or NIC where it can work.)
    pub const ALL: [Scenario; 7] = [
        Scenario::KernelForward,
        Scenario::NftDnat,
        Scenario::XdpDnat,
        Scenario::AfxdpL2fwd,
        Scenario::Juneau,
        Scenario::JuneauXdpFast,
        Scenario::TcpBulk,
    ];

    /// The report name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::KernelForward => "kernel-forward",
            Scenario::NftDnat => "nft-dnat",
            Scenario::XdpDnat => "xdp-dnat",
            Scenario::AfxdpL2fwd => "afxdp-l2fwd",
            Scenario::Juneau => "juneau",
            Scenario::JuneauXdpFast => "juneau-xdp-fast",
            Scenario::JuneauBusyPoll => "juneau-busy-poll",
            Scenario::TcpBulk => "tcp-bulk",
        }
    }

    /// Whether traffic goes to the VIP (and so latency through the VIP can be measured).
    pub fn uses_vip(self) -> bool {
        matches!(
            self,
            Scenario::NftDnat
                | Scenario::XdpDnat
                | Scenario::Juneau
                | Scenario::JuneauXdpFast
                | Scenario::JuneauBusyPoll
        )
    }
}

/// What to run and for how long.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Scenarios to run.
    pub scenarios: Vec<Scenario>,
    /// Runs per scenario.
    pub runs: u32,
    /// Traffic before the measurement window of each run.
    pub warmup: Duration,
    /// The measurement window of each run.
    pub duration: Duration,
    /// Flows of the throughput scenarios.
    pub flows: u32,
    /// Flow counts for the `juneau` flow-scale measurement (empty: skip).
    pub flow_scale: Vec<u32>,
    /// Offered loads for latency, as fractions of each scenario's median throughput.
    pub latency_loads: Vec<f64>,
    /// Probe duration per latency point.
    pub latency_duration: Duration,
    /// Latency rounds: each measures every scenario at every load, scenarios in turn.
    pub latency_rounds: u32,
    /// Probe requests per second.
    pub probe_rate: u32,
    /// Length of each calibration window (the offered rate's search, before the
    /// measured window).
    pub calibrate_window: Duration,
    /// Most rate steps of the calibration.
    pub calibrate_steps: u32,
    /// The juneau-dataplane binary.
    pub dataplane: PathBuf,
    /// Run the dataplane under this command (e.g. valgrind; empty: directly).
    pub dataplane_wrapper: Vec<String>,
    /// Extra dataplane arguments.
    pub dataplane_args: Vec<String>,
    /// Where logs go.
    pub out_dir: PathBuf,
    /// The TCP bulk download (`tcp-bulk`).
    pub bulk: crate::bulk::BulkPlan,
}

/// Fixed overhead of one topology (build, program loads, readiness check), estimated.
const SETUP_S: f64 = 1.5;

impl Plan {
    /// Estimated wall time of the whole plan.
    pub fn expected(&self) -> Duration {
        // A flood and ~5 rate steps (each with a third of a window of warm-up, and a
        // generator start), then the measured window.
        let cw = self.calibrate_window.as_secs_f64();
        let steps = f64::from(self.calibrate_steps.min(5));
        let calib = (cw + 0.3) + steps * (cw * 4.0 / 3.0 + 0.3);
        let per_run =
            SETUP_S + calib + self.warmup.as_secs_f64() + self.duration.as_secs_f64() + 0.5;
        let mut s = 0.0;
        for sc in &self.scenarios {
            if *sc == Scenario::TcpBulk {
                s += crate::bulk::expected(self).as_secs_f64();
                continue;
            }
            s += f64::from(self.runs) * per_run;
            if sc.uses_vip() && !self.latency_loads.is_empty() {
                s += f64::from(self.latency_rounds)
                    * (SETUP_S
                        + self.latency_loads.len() as f64
                            * (self.latency_duration.as_secs_f64() + 1.2));
            }
            if *sc == Scenario::Juneau {
                for f in &self.flow_scale {
                    s += f64::from(self.runs) * (per_run + fill_duration(*f).as_secs_f64());
                }
            }
            if *sc == Scenario::XdpDnat && self.scenarios.contains(&Scenario::Juneau) {
                if let Some(f) = self.flow_scale.iter().max() {
                    s += f64::from(self.runs) * (per_run + fill_duration(*f).as_secs_f64());
                }
            }
        }
        Duration::from_secs_f64(s)
    }
}

/// How long the paced fill before a flow-scale run takes: every flow's first packet
/// [`FILL_PASSES`] times over at [`FILL_RATE`] (see [`fill_flows`]).
fn fill_duration(flows: u32) -> Duration {
    Duration::from_secs_f64(FILL_PASSES * f64::from(flows) / FILL_RATE as f64)
}

/// Packets per second of the fill that creates a flow-scale run's flows: a new flow
/// takes the userspace path, which carries ~300 000 packets a second of established flows
/// here (`juneau-afxdp`) and fewer new ones (a new flow costs about three times the
/// instructions), and far fewer under a flood, where the path's NAPI work takes its core
/// (run m: after a 6.7 s flood at 1 M flows only 430 000 flows existed, and the window
/// measured the drops of the others' first packets, not forwarding). Run n: 100 000 pps
/// created every flow of every run.
const FILL_RATE: u64 = 100_000;
/// Passes over the flows the fill makes (a first packet lost in one pass is sent again).
const FILL_PASSES: f64 = 2.0;

/// Creates a run's flows before anything is measured: the generator offers every flow's
/// packet [`FILL_PASSES`] times at [`FILL_RATE`], paced, then stops.
fn fill_flows(t: &Topology, a: &Active, flows: u32) -> Result<()> {
    let frames = (FILL_PASSES * f64::from(flows)) as u64;
    // `finish` waits for the generator to send its frames (or its duration to end).
    Gen::start(t, a.dst, flows, FILL_RATE, fill_duration(flows), frames)?.finish()?;
    Ok(())
}

/// Progress output (stderr), with elapsed time against the estimate.
pub struct Progress {
    start: Instant,
    expected: Duration,
}

impl Progress {
    /// Starts the clock.
    pub fn new(expected: Duration) -> Progress {
        Progress {
            start: Instant::now(),
            expected,
        }
    }

    /// Prints one line.
    pub fn say(&self, msg: impl AsRef<str>) {
        let e = self.start.elapsed().as_secs();
        eprintln!(
            "[{:>3}s / ~{}s] {}",
            e,
            self.expected.as_secs(),
            msg.as_ref()
        );
    }
}

pub(crate) fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (Ctrl-C): cleaning up");
    }
    Ok(())
}

/// Sleeps in small steps, failing early on Ctrl-C.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check_interrupt()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(50)));
    }
}

static STAGED_SELF: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn self_exe() -> Result<PathBuf> {
    if let Some(p) = STAGED_SELF.get() {
        return Ok(p.clone());
    }
    std::env::current_exe().context("finding juneau-perf's own path")
}

/// Copies juneau-perf, juneau-perf-cost and the dataplane into `<out>/bin` and runs those
/// copies, so that a rebuild of the target directory during a run (other people build
/// on the same machine) cannot pull a binary away mid-run. Returns the cost bench's path.
pub fn stage_binaries(plan: &mut Plan) -> Result<PathBuf> {
    let bin = plan.out_dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    let me = std::env::current_exe().context("finding juneau-perf's own path")?;
    let copy = |from: &Path, name: &str| -> Result<PathBuf> {
        let to = bin.join(name);
        let _ = std::fs::remove_file(&to);
        std::fs::copy(from, &to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        Ok(to)
    };
    let staged = copy(&me, "juneau-perf")?;
    let _ = STAGED_SELF.set(staged);
    if plan.dataplane.exists() {
        plan.dataplane = copy(&plan.dataplane.clone(), "juneau-dataplane")?;
    }
    let cost = me.with_file_name("juneau-perf-cost");
    if cost.exists() {
        copy(&cost, "juneau-perf-cost")
    } else {
        Ok(cost)
    }
}

pub(crate) fn cpus() -> (u32, u32) {
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as u32;
    (0, if n > 1 { 1 } else { 0 })
}

/// A scenario's node setup with the UDP ends (sink, echo server), alive while measuring.
pub(crate) struct Active {
    pub(crate) sink: Sink,
    _pass: PassProgram,
    /// What forwards in the node namespace.
    pub(crate) path: NodePath,
    _echo: NsChild,
    dst: (Ipv4Addr, u16),
}

/// What forwards in the node namespace for one scenario (nftables rules, an XDP program,
/// a userspace forwarder and its node state), alive while measuring: one set-up for the
/// UDP scenarios and the TCP bulk download alike.
pub(crate) struct NodePath {
    _xdp: Option<XdpDnat>,
    pub(crate) forwarder: Option<NsChild>,
    forwarder_name: &'static str,
    forwarder_log: Option<PathBuf>,
    _state: Option<(juneau_control::shm::NodeStateWriter, tempfile_dir::Dir)>,
    /// The dataplane's stats file, for a `juneau*` scenario.
    pub(crate) stats_file: Option<PathBuf>,
}

mod tempfile_dir {
    use std::path::PathBuf;

    /// A directory removed on drop.
    pub struct Dir(pub PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl NodePath {
    /// The forwarder's log, if it has one.
    pub(crate) fn forwarder_log(&self) -> Option<&Path> {
        self.forwarder_log.as_deref()
    }

    /// Fails with the end of its log if the forwarder (if any) has exited.
    pub(crate) fn check_forwarder(&mut self) -> Result<()> {
        if let Some(f) = &mut self.forwarder {
            if !f.is_running() {
                let log = self
                    .forwarder_log
                    .as_ref()
                    .and_then(|p| std::fs::read_to_string(p).ok())
                    .unwrap_or_default();
                let tail: String = log
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!(
                    "{} exited early; its log ends:\n{tail}",
                    self.forwarder_name
                );
            }
        }
        Ok(())
    }
}

impl Active {
    pub(crate) fn check_forwarder(&mut self) -> Result<()> {
        self.path.check_forwarder()
    }
}

const NFT_RULES: &str = r#"
table ip juneau_perf {
    map service-ips {
        type ipv4_addr . inet_proto . inet_service : verdict
        elements = { 198.19.0.10 . udp . 9000 : goto service-load, 198.19.0.10 . udp . 9001 : goto service-echo, 198.19.0.10 . tcp . 9002 : goto service-bulk }
    }
    chain nat-prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        ip daddr . meta l4proto . th dport vmap @service-ips
    }
    chain service-load {
        numgen random mod 1 vmap { 0 : goto endpoint-load }
    }
    chain endpoint-load {
        meta l4proto udp dnat to 198.18.2.2:9100
    }
    chain service-echo {
        numgen random mod 1 vmap { 0 : goto endpoint-echo }
    }
    chain endpoint-echo {
        meta l4proto udp dnat to 198.18.2.2:9101
    }
    chain service-bulk {
        numgen random mod 1 vmap { 0 : goto endpoint-bulk }
    }
    chain endpoint-bulk {
        meta l4proto tcp dnat to 198.18.2.2:9102
    }
}
"#;

fn node_state() -> juneau_control::model::NodeState {
    use juneau_control::model::*;
    let svc = |protocol, port, bport| NodeService {
        frontend: Frontend {
            vip: VIP,
            protocol,
            port,
        },
        backends: vec![LocalBackend {
            ip: BACKEND_IP,
            port: bport,
        }],
        terminating: Vec::new(),
    };
    let mut st = NodeState {
        node: "perf-node".into(),
        router_id: Some(NODE_CLIENT_IP),
        services: vec![
            svc(Protocol::Udp, LOAD_PORT, BACKEND_LOAD_PORT),
            svc(Protocol::Udp, ECHO_PORT, BACKEND_ECHO_PORT),
            svc(Protocol::Tcp, BULK_PORT, BACKEND_BULK_PORT),
        ],
        ..Default::default()
    };
    st.normalize();
    st
}

/// SCHED_FIFO priority of the latency prober and the echo server (both block in `recv`
/// between probes; the kernel's real-time throttling bounds them anyway).
const PROBE_RT_PRIORITY: &str = "20";

pub(crate) fn setup(t: &Topology, sc: Scenario, plan: &Plan, tag: &str) -> Result<Active> {
    let (gen_cpu, _) = cpus();
    let exe = self_exe()?;
    let exe_s = exe.to_string_lossy().into_owned();
    let sink = Sink::attach(t.backend.name(), &t.b_if, BACKEND_LOAD_PORT)?;
    // Frames XDP_REDIRECTed into the client's veth are only delivered with an XDP program
    // on the receiving end (FACTS.md).
    let pass = PassProgram::attach(t.client.name(), &t.c_if)?;
    // The echo server and the prober share the generator's core, which the generator keeps
    // busy (it paces by spinning in the kernel): as real-time tasks they run as soon as a
    // probe arrives instead of waiting a scheduler slice behind the generator, which would
    // put the generator's slice (milliseconds) into every path's latency tail alike.
    let echo = t.backend.spawn(&[
        "chrt",
        "-f",
        PROBE_RT_PRIORITY,
        "taskset",
        "-c",
        &gen_cpu.to_string(),
        &exe_s,
        "echo",
        "--port",
        &BACKEND_ECHO_PORT.to_string(),
        "--duration-s",
        "86400",
    ])?;
    let path = start_path(t, sc, plan, tag)?;
    let dst = match sc {
        Scenario::KernelForward | Scenario::AfxdpL2fwd => (BACKEND_IP, BACKEND_LOAD_PORT),
        _ => (VIP, LOAD_PORT),
    };
    Ok(Active {
        sink,
        _pass: pass,
        path,
        _echo: echo,
        dst,
    })
}

/// Sets up what forwards in the node namespace for `sc` (nothing for `kernel-forward`,
/// the nftables rules, the XDP DNAT program, or a userspace forwarder pinned to the path
/// core): one implementation for the UDP scenarios and the TCP bulk download.
pub(crate) fn start_path(t: &Topology, sc: Scenario, plan: &Plan, tag: &str) -> Result<NodePath> {
    let (_, fwd_cpu) = cpus();
    let exe = self_exe()?;
    let exe_s = exe.to_string_lossy().into_owned();
    let mut active = NodePath {
        _xdp: None,
        forwarder: None,
        forwarder_name: "",
        forwarder_log: None,
        _state: None,
        stats_file: None,
    };
    match sc {
        Scenario::TcpBulk => {
            bail!("tcp-bulk runs through juneau and nft-dnat, it is no path itself")
        }
        Scenario::KernelForward => {}
        Scenario::NftDnat => {
            let path = plan.out_dir.join(format!("nft-{tag}.nft"));
            std::fs::write(&path, NFT_RULES)?;
            t.node.exec(&["nft", "-f", &path.to_string_lossy()])?;
        }
        Scenario::XdpDnat => {
            active._xdp = Some(XdpDnat::attach(
                t.node.name(),
                DnatConfig {
                    client_iface: t.nc_if.clone(),
                    backend_iface: t.nb_if.clone(),
                    node_client_mac: t.nc_mac,
                    client_mac: t.c_mac,
                    node_backend_mac: t.nb_mac,
                    backend_mac: t.b_mac,
                    services: vec![
                        ((VIP, LOAD_PORT), (BACKEND_IP, BACKEND_LOAD_PORT)),
                        ((VIP, ECHO_PORT), (BACKEND_IP, BACKEND_ECHO_PORT)),
                    ],
                },
            )?);
        }
        Scenario::AfxdpL2fwd => {
            let log = plan.out_dir.join(format!("afxdp-l2fwd-{tag}.log"));
            let child = t.node.spawn_logged(
                &[
                    "taskset",
                    "-c",
                    &fwd_cpu.to_string(),
                    &exe_s,
                    "l2fwd",
                    "--rx-iface",
                    &t.nc_if,
                    "--tx-iface",
                    &t.nb_if,
                    "--src-mac",
                    &format_mac(&t.nb_mac),
                    "--dst-mac",
                    &format_mac(&t.b_mac),
                    "--port",
                    &BACKEND_LOAD_PORT.to_string(),
                    "--duration-s",
                    "86400",
                ],
                &log,
            )?;
            active.forwarder = Some(child);
            active.forwarder_name = "the afxdp-l2fwd forwarder";
            active.forwarder_log = Some(log);
        }
        Scenario::Juneau | Scenario::JuneauXdpFast | Scenario::JuneauBusyPoll => {
            if !plan.dataplane.exists() {
                bail!(
                    "juneau-dataplane binary not found at {} (build it: cargo build --release -p juneau-dataplane, or pass --dataplane PATH)",
                    plan.dataplane.display()
                );
            }
            let dir =
                std::env::temp_dir().join(format!("juneau-perf-{}-{tag}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let dir = tempfile_dir::Dir(dir);
            let state_path = dir.0.join("perf-node.state");
            let mut writer =
                juneau_control::shm::NodeStateWriter::create(&state_path, Default::default())
                    .with_context(|| format!("creating {}", state_path.display()))?;
            writer
                .publish(&node_state())
                .context("publishing the node state")?;
            let log = plan.out_dir.join(format!("juneau-dataplane-{tag}.log"));
            let dp = plan.dataplane.to_string_lossy().into_owned();
            let mut extra: Vec<&str> = plan.dataplane_args.iter().map(String::as_str).collect();
            if sc == Scenario::JuneauXdpFast {
                extra.push("--xdp-fast-path");
            }
            if sc == Scenario::JuneauBusyPoll {
                extra.extend(["--xsk-busy-poll-budget", "64"]);
                // The veths keep their NAPI scheduled for the busy poller instead of
                // waking their kthread on every frame; a 200 us timer takes over when
                // the busy poller stops polling.
                for i in [&t.nc_if, &t.nb_if] {
                    t.node.exec(&[
                        "sh",
                        "-c",
                        &format!(
                            "echo 2 > /sys/class/net/{i}/napi_defer_hard_irqs && echo 200000 > /sys/class/net/{i}/gro_flush_timeout"
                        ),
                    ])?;
                }
            }
            let fwd_cpu_s = fwd_cpu.to_string();
            let stats_file = plan
                .out_dir
                .join(format!("juneau-dataplane-stats-{tag}.json"));
            let child = t.node.spawn_logged(
                // The loop's own timing (once a second, debug level) goes to its log.
                &[
                    "taskset",
                    "-c",
                    &fwd_cpu_s,
                    "env",
                    "RUST_LOG=info,juneau_dataplane::runtime=debug",
                ]
                .into_iter()
                .chain(plan.dataplane_wrapper.iter().map(String::as_str))
                .chain([
                    &dp as &str,
                    "--uplink",
                    &t.nc_if,
                    "--pod-iface",
                    &t.nb_if,
                    "--state-file",
                    &state_path.to_string_lossy(),
                    "--stats-file",
                    &stats_file.to_string_lossy(),
                ])
                .chain(extra)
                .collect::<Vec<_>>(),
                &log,
            )?;
            active.forwarder = Some(child);
            active.forwarder_name = "juneau-dataplane";
            active.forwarder_log = Some(log);
            active._state = Some((writer, dir));
            active.stats_file = Some(stats_file);
        }
    }
    Ok(active)
}

/// Where and what a generator sends (besides flows, rate and bounds).
pub(crate) struct GenSpec<'a> {
    pub(crate) ns: &'a juneau_tests::netns::Netns,
    pub(crate) iface: &'a str,
    pub(crate) src_mac: [u8; 6],
    pub(crate) dst_mac: [u8; 6],
    pub(crate) dst: (Ipv4Addr, u16),
    /// Extra arguments (`--reply-from`, `--partial-checksum`, `--kind`).
    pub(crate) extra: Vec<String>,
    /// The generator's nice value: -20 for a load, so other work on a shared machine
    /// yields to it; 0 for a flood, which must not starve the legitimate endpoints.
    pub(crate) nice: i32,
}

impl<'a> GenSpec<'a> {
    /// From the client towards `dst` through the node (the usual load).
    pub(crate) fn forward(t: &'a Topology, dst: (Ipv4Addr, u16)) -> GenSpec<'a> {
        GenSpec {
            ns: &t.client,
            iface: &t.c_if,
            src_mac: t.c_mac,
            dst_mac: t.nc_mac,
            dst,
            extra: Vec::new(),
            nice: -20,
        }
    }
}

pub(crate) struct Gen {
    child: Option<Child>,
    stdout: Option<std::sync::mpsc::Receiver<String>>,
}

/// Longest wait for a generator to load its program (a busy machine: seconds).
const GEN_READY_TIMEOUT: Duration = Duration::from_secs(60);

impl Gen {
    fn start(
        t: &Topology,
        dst: (Ipv4Addr, u16),
        flows: u32,
        rate: u64,
        duration: Duration,
        max_packets: u64,
    ) -> Result<Gen> {
        Gen::spawn(
            &GenSpec::forward(t, dst),
            flows,
            rate,
            duration,
            max_packets,
        )
    }

    /// Starts a generator and returns once it has loaded its program and is about to
    /// send (its "ready" line): the caller's clocks (warm-up, window) start after the
    /// start-up, however long that took on a busy machine. `duration` counts from there.
    pub(crate) fn spawn(
        spec: &GenSpec<'_>,
        flows: u32,
        rate: u64,
        duration: Duration,
        max_packets: u64,
    ) -> Result<Gen> {
        let (gen_cpu, _) = cpus();
        let exe = self_exe()?;
        let mut argv: Vec<String> = vec![
            "nice".into(),
            "-n".into(),
            spec.nice.to_string(),
            "taskset".into(),
            "-c".into(),
            gen_cpu.to_string(),
            exe.to_string_lossy().into_owned(),
            "gen".into(),
            "--iface".into(),
            spec.iface.into(),
            "--src-mac".into(),
            format_mac(&spec.src_mac),
            "--dst-mac".into(),
            format_mac(&spec.dst_mac),
            "--dst-ip".into(),
            spec.dst.0.to_string(),
            "--dst-port".into(),
            spec.dst.1.to_string(),
            "--flows".into(),
            flows.to_string(),
            "--rate".into(),
            rate.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--max-packets".into(),
            max_packets.to_string(),
        ];
        argv.extend(spec.extra.iter().cloned());
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut child = spec
            .ns
            .command(&argv)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the generator")?;
        let out = child.stdout.take().context("generator stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let g = Gen {
            child: Some(child),
            stdout: Some(rx),
        };
        let deadline = Instant::now() + GEN_READY_TIMEOUT;
        loop {
            check_interrupt()?;
            match g
                .stdout
                .as_ref()
                .expect("set")
                .recv_timeout(Duration::from_millis(50))
            {
                Ok(l) if l == "ready" => return Ok(g),
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    // Exited before it was ready: finish() reports why.
                    g.finish()?;
                    bail!("the generator exited before sending");
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if Instant::now() > deadline {
                        bail!(
                            "the generator was not ready within {} s",
                            GEN_READY_TIMEOUT.as_secs()
                        );
                    }
                }
            }
        }
    }

    pub(crate) fn finish(mut self) -> Result<GenResult> {
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut child = self.child.take().expect("running");
        loop {
            if let Some(_status) = child.try_wait()? {
                break;
            }
            if INTERRUPTED.load(Ordering::Relaxed) || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                check_interrupt()?;
                bail!("generator did not finish in time");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output()?;
        let lines: Vec<String> = self
            .stdout
            .take()
            .map(|rx| {
                let mut v = Vec::new();
                while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
                    v.push(l);
                }
                v
            })
            .unwrap_or_default();
        if !out.status.success() {
            bail!(
                "generator failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let json = lines
            .iter()
            .rev()
            .find(|l| l.starts_with('{'))
            .with_context(|| format!("no result from the generator: {lines:?}"))?;
        serde_json::from_str(json).with_context(|| format!("generator output {json:?}"))
    }
}

impl Drop for Gen {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sends short bursts until the sink sees traffic, so a slow-starting forwarder is not
/// measured while it starts.
pub(crate) fn wait_until_delivering(t: &Topology, a: &mut Active, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        check_interrupt()?;
        a.check_forwarder()?;
        let before = a.sink.count()?;
        let g = Gen::start(t, a.dst, 16, 10_000, Duration::from_millis(100), 1000)?;
        g.finish()?;
        sleep(Duration::from_millis(50))?;
        if a.sink.count()? > before {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!(
                "no packet reached the backend within {}s",
                timeout.as_secs()
            );
        }
        sleep(Duration::from_millis(200))?;
    }
}

/// Pins the node's threaded-NAPI kthreads to the path core and returns every thread whose
/// run time is the path's cost: those kthreads, `ksoftirqd/<path core>` and the userspace
/// forwarder (all its threads), if any.
pub(crate) fn pin_path(t: &Topology, a: &NodePath) -> Result<Vec<u32>> {
    let (_, cpu) = cpus();
    let mut tids = Vec::new();
    for i in [&t.nc_if, &t.nb_if] {
        let v = crate::cpu::napi_threads(i);
        if v.is_empty() {
            bail!("no threaded-NAPI kthread napi/{i}-* found: threaded NAPI did not take on {i}");
        }
        for tid in v {
            if !tids.contains(&tid) {
                crate::cpu::pin(tid, cpu)?;
                tids.push(tid);
            }
        }
    }
    tids.extend(crate::cpu::ksoftirqd(cpu));
    if let Some(f) = &a.forwarder {
        tids.push(f.id());
    }
    // The machine is shared: the path's threads get the core against other work (and
    // share it fairly among themselves).
    for tid in &tids {
        crate::cpu::boost(*tid)?;
    }
    Ok(tids)
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
    warmup: Duration,
    window: Duration,
) -> Result<RunFigures> {
    let (gen_cpu, path_cpu) = cpus();
    let g = Gen::start(
        t,
        a.dst,
        flows,
        rate,
        warmup + window + Duration::from_millis(200),
        u64::MAX,
    )?;
    sleep(warmup)?;
    let (core1, gcore1, run1) = (
        crate::cpu::CoreTimes::read(path_cpu)?,
        crate::cpu::CoreTimes::read(gen_cpu)?,
        crate::cpu::run_time_ns(tids),
    );
    let (t1, c1) = (Instant::now(), a.sink.count()?);
    sleep(window)?;
    let (t2, c2) = (Instant::now(), a.sink.count()?);
    let (core2, gcore2, run2) = (
        crate::cpu::CoreTimes::read(path_cpu)?,
        crate::cpu::CoreTimes::read(gen_cpu)?,
        crate::cpu::run_time_ns(tids),
    );
    let gen = g.finish()?;
    a.check_forwarder()?;
    let secs = (t2 - t1).as_secs_f64();
    let pps = (c2 - c1) as f64 / secs;
    if c2 == c1 {
        bail!(
            "nothing reached the backend during the window (generator sent {} frames in {:.2} s)",
            gen.sent,
            gen.elapsed_s
        );
    }
    let offered = gen.sent as f64 / gen.elapsed_s.max(1e-9);
    let core = core1.busy_since(&core2);
    let path_cpu_s = run2.saturating_sub(run1) as f64 / 1e9;
    let delivered = (c2 - c1) as f64;
    let mut why = Vec::new();
    if pps < SATURATION_DELIVERED_BELOW * offered {
        why.push(format!(
            "delivered {:.0}% of offered",
            100.0 * pps / offered
        ));
    }
    if core.busy >= SATURATION_CORE_BUSY {
        why.push(format!("path core {:.0}% busy", 100.0 * core.busy));
    }
    tracing::debug!(sent = gen.sent, elapsed = gen.elapsed_s, pps, rate, "run");
    Ok(RunFigures {
        delivered_pps: pps,
        offered_pps: offered,
        rate_pps: rate,
        path_cores: path_cpu_s / secs,
        path_core: core,
        gen_core: gcore1.busy_since(&gcore2),
        ns_per_packet: path_cpu_s * 1e9 / delivered,
        core_ns_per_packet: core.busy * secs * 1e9 / delivered,
        saturated: !why.is_empty(),
        saturation: if why.is_empty() {
            format!(
                "NOT saturated: delivered {:.0}% of offered, path core {:.0}% busy",
                100.0 * pps / offered,
                100.0 * core.busy
            )
        } else {
            why.join(", ")
        },
        calibration: Vec::new(),
    })
}

/// Run time (ns) of one thread.
pub(crate) fn thread_run_ns(tid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{tid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The node's NAPI kthreads and the forwarder's threads, with a description each.
pub(crate) fn path_threads(t: &Topology, a: &NodePath) -> Vec<(u32, String)> {
    let mut tids: Vec<(u32, String)> = Vec::new();
    for i in [&t.nc_if, &t.nb_if] {
        for x in crate::cpu::napi_threads(i) {
            if !tids.iter().any(|(y, _)| *y == x) {
                tids.push((x, format!("NAPI kthread {x} of {i}")));
            }
        }
    }
    if let Some(f) = &a.forwarder {
        if let Ok(d) = std::fs::read_dir(format!("/proc/{}/task", f.id())) {
            tids.extend(d.flatten().filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .parse()
                    .ok()
                    .map(|x| (x, format!("{} thread {x}", a.forwarder_name)))
            }));
        }
    }
    tids
}

/// Checks that the path's work ran where it should: every NAPI kthread of the node's
/// interfaces and every forwarder thread that ran since `before` (run times taken after
/// pinning) last ran on the path core. A thread that did not run since (e.g. the Pod
/// side's kthread in a forward-only run) still shows where it ran before it was pinned.
pub(crate) fn check_placement(t: &Topology, a: &NodePath, before: &[(u32, u64)]) -> Result<()> {
    let (_, path_cpu) = cpus();
    for (tid, what) in path_threads(t, a) {
        let ran = match (before.iter().find(|(x, _)| *x == tid), thread_run_ns(tid)) {
            (Some((_, b)), Some(now)) => now > *b,
            // Not seen at pinning time: a thread created since (not pinned by us).
            (None, Some(_)) => true,
            _ => false,
        };
        if !ran {
            continue;
        }
        if let Some(c) = crate::cpu::last_cpu(tid) {
            if c != path_cpu {
                bail!("{what} ran on CPU {c}, not the path core {path_cpu}");
            }
        }
    }
    Ok(())
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
    let flood = window_run(t, a, &tids, flows, 0, warmup.min(cw), cw)?;
    let mut steps = vec![(flood.offered_pps, flood.delivered_pps)];
    let mut search = RateSearch::new(flood.delivered_pps);
    for _ in 0..plan.calibrate_steps {
        let Some(rate) = search.next_rate() else {
            break;
        };
        let f = window_run(t, a, &tids, flows, rate as u64, cw / 3, cw)?;
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
    let mut rate = search.window_rate();
    let mut r = window_run(t, a, &tids, flows, rate as u64, warmup, plan.duration)?;
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
        r = window_run(t, a, &tids, flows, rate as u64, warmup, plan.duration)?;
    }
    check_placement(t, &a.path, &pinned)?;
    r.calibration = steps;
    Ok(r)
}

fn latency_point(
    t: &Topology,
    a: &mut Active,
    plan: &Plan,
    load: f64,
    max_pps: f64,
) -> Result<(ProbeResult, f64)> {
    let exe = self_exe()?;
    let rate = (max_pps * load).round() as u64;
    let bg = Gen::start(
        t,
        a.dst,
        plan.flows,
        rate.max(1),
        plan.latency_duration + Duration::from_millis(700),
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
    let mut bulk_runs: Vec<crate::bulk::BulkRun> = Vec::new();
    let mut bulk_failed: Vec<(u32, Scenario)> = Vec::new();
    for round in 0..plan.runs {
        for (i, sc) in plan.scenarios.iter().enumerate() {
            if failed[i] || *sc == Scenario::TcpBulk {
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
        if !failed[i] && *sc != Scenario::TcpBulk {
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
    // Latency in rounds, scenarios in turn within each: the machine's load drifts over
    // minutes on a shared VM, and a round compares every path in the same few seconds.
    let mut latency_failed = failed.clone();
    for round in 0..plan.latency_rounds {
        for (i, sc) in plan.scenarios.iter().enumerate() {
            if latency_failed[i] || !sc.uses_vip() || plan.latency_loads.is_empty() {
                continue;
            }
            check_interrupt()?;
            let median =
                results::median(&runs[i].iter().map(|f| f.delivered_pps).collect::<Vec<_>>());
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
    let t = Topology::build()?;
    let tag = format!("{}-{flows}-{}", sc.name(), std::process::id());
    let mut a = setup(&t, sc, plan, &tag)?;
    wait_until_delivering(&t, &mut a, Duration::from_secs(30))?;
    let r = measure(&t, &mut a, plan, flows, warmup, fill)?;
    if matches!(
        sc,
        Scenario::Juneau | Scenario::JuneauXdpFast | Scenario::JuneauBusyPoll
    ) {
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
    let t = Topology::build()?;
    let tag = format!("{}-latency-{}", sc.name(), std::process::id());
    let mut a = setup(&t, sc, plan, &tag)?;
    wait_until_delivering(&t, &mut a, Duration::from_secs(30))?;
    pin_path(&t, &a.path)?;
    for &load in &plan.latency_loads {
        let (p, offered) = latency_point(&t, &mut a, plan, load, median)?;
        progress.say(format!(
            "{}: latency at {:.0}% load: p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us ({}/{} replies)",
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
