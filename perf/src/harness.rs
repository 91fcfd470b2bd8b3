//! The machinery every measurement of a forwarding path shares: the staged binaries,
//! the node namespace's set-up per scenario (`NodePath`, with the UDP ends: `Active`),
//! the traffic generator (`Gen`), and pinning the path's threads to the path core and
//! checking where they ran. The suite, the TCP bulk download, the floods and the loop cost
//! build on it.

use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use juneau_tests::netns::NsChild;

use crate::bpf::{DnatConfig, PassProgram, XdpDnat};
use crate::gen::GenResult;
use crate::packet::format_mac;
use crate::plan::{check_interrupt, sleep, Plan, Scenario, INTERRUPTED};
use crate::sink::UdpSink;
use crate::topology::*;

static STAGED_SELF: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

pub(crate) fn self_exe() -> Result<PathBuf> {
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

/// A scenario's node setup with the UDP ends (the backend's application: sink and echo
/// server), alive while measuring.
pub(crate) struct Active {
    pub(crate) sink: UdpSink,
    /// `xdp_pass` on the client's end (the generator's frames), and on the backend's for
    /// a path that redirects XDP frames into it.
    _pass: Vec<PassProgram>,
    /// What forwards in the node namespace.
    pub(crate) path: NodePath,
    _echo: NsChild,
    /// Where the load goes (the VIP, or the backend for the paths without NAT; IPv6 ones
    /// for the IPv6 rows).
    pub(crate) dst: (IpAddr, u16),
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

/// nftables DNAT of the IPv6 VIP's load port, shaped as [`NFT_RULES`] (kube-proxy's
/// nftables mode has a table of its own per family: `ip6` for IPv6 Services).
fn nft_rules6() -> String {
    format!(
        r#"
table ip6 juneau_perf6 {{
    map service-ips {{
        type ipv6_addr . inet_proto . inet_service : verdict
        elements = {{ {VIP6} . udp . {LOAD_PORT} : goto service-load }}
    }}
    chain nat-prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        ip6 daddr . meta l4proto . th dport vmap @service-ips
    }}
    chain service-load {{
        numgen random mod 1 vmap {{ 0 : goto endpoint-load }}
    }}
    chain endpoint-load {{
        meta l4proto udp dnat to [{BACKEND_IP6}]:{BACKEND_LOAD_PORT}
    }}
}}
"#
    )
}

/// The node state the `juneau*` paths are given: the IPv4 Services (load, echo, bulk)
/// and, with `ipv6`, the IPv6 load's Service (`NodeService6`) beside them, as a
/// dual-stack node's agent publishes them.
fn node_state(ipv6: bool) -> juneau_control::model::NodeState {
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
        source_ranges: Vec::new(),
        client_ip_affinity: None,
        hand_off: false,
        host_network: false,
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
    if ipv6 {
        st.services6 = vec![NodeService6::new(
            Frontend6 {
                vip: VIP6,
                protocol: Protocol::Udp,
                port: LOAD_PORT,
            },
            vec![LocalBackend6 {
                ip: BACKEND_IP6,
                port: BACKEND_LOAD_PORT,
            }],
        )];
    }
    st.normalize();
    st
}

/// SCHED_FIFO priority of the latency prober and the echo server (both block in `recv`
/// between probes; the kernel's real-time throttling bounds them anyway).
pub(crate) const PROBE_RT_PRIORITY: &str = "20";

pub(crate) fn setup(t: &Topology, sc: Scenario, plan: &Plan, tag: &str) -> Result<Active> {
    let (gen_cpu, _) = cpus();
    let exe = self_exe()?;
    let exe_s = exe.to_string_lossy().into_owned();
    // The backend is an application reading a UDP socket, its veth as a CNI leaves a
    // Pod's (no XDP program, GRO off: no NAPI), so every path delivers into a socket.
    // Only a path that forwards XDP frames (XDP_REDIRECT) needs an XDP program there:
    // a veth hands redirected frames only to a peer with NAPI (the opt-in accelerator's
    // "Pods whose veth takes XDP frames").
    let sink = UdpSink::start(
        t.backend.name(),
        if sc.ipv6() {
            IpAddr::from(Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED)
        },
        BACKEND_LOAD_PORT,
        gen_cpu,
        PROBE_RT_PRIORITY.parse().expect("a number"),
    )?;
    // Frames XDP_REDIRECTed into the client's veth are only delivered with an XDP program
    // on the receiving end (FACTS.md).
    let mut pass = vec![PassProgram::attach(t.client.name(), &t.c_if)?];
    if sc.redirects_xdp_frames() {
        pass.push(PassProgram::attach(t.backend.name(), &t.b_if)?);
    }
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
        Scenario::KernelForward | Scenario::AfxdpL2fwd => (BACKEND_IP.into(), BACKEND_LOAD_PORT),
        Scenario::KernelForward6 => (BACKEND_IP6.into(), BACKEND_LOAD_PORT),
        Scenario::NftDnat6 | Scenario::Juneau6 => (VIP6.into(), LOAD_PORT),
        _ => (VIP.into(), LOAD_PORT),
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
        Scenario::TcpBulk | Scenario::TcpConnect => {
            bail!(
                "{} runs through juneau and nft-dnat, it is no path itself",
                sc.name()
            )
        }
        Scenario::KernelForward | Scenario::KernelForward6 => {}
        Scenario::NftDnat | Scenario::NftDnat6 => {
            let path = plan.out_dir.join(format!("nft-{tag}.nft"));
            if sc.ipv6() {
                std::fs::write(&path, nft_rules6())?;
            } else {
                std::fs::write(&path, NFT_RULES)?;
            }
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
        Scenario::Juneau
        | Scenario::JuneauXdpFast
        | Scenario::JuneauBusyPoll
        | Scenario::Juneau6 => {
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
                .publish(&node_state(sc.ipv6()))
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
    pub(crate) dst: (IpAddr, u16),
    /// Extra arguments (`--reply-from`, `--partial-checksum`, `--kind`).
    pub(crate) extra: Vec<String>,
    /// The generator's nice value: -20 for a load, so other work on a shared machine
    /// yields to it; 0 for a flood, which must not starve the legitimate endpoints.
    pub(crate) nice: i32,
}

impl<'a> GenSpec<'a> {
    /// From the client towards `dst` through the node (the usual load).
    pub(crate) fn forward(t: &'a Topology, dst: (IpAddr, u16)) -> GenSpec<'a> {
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
    /// From the client to `dst` through the node (the usual load): `flows` flows at `rate`
    /// packets/s (0: as fast as it can) for `duration` or `max_packets`, whichever ends first.
    pub(crate) fn start(
        t: &Topology,
        dst: (IpAddr, u16),
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
            // Decided once by this process (the report states it), not probed per child.
            "--generator".into(),
            crate::gen::Generator::for_this_kernel().0.name().into(),
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
            // Its "ready" starts the caller's clock, which runs realtime in a window
            // (`crate::cpu::Realtime`): this thread must not wait a turn either. It
            // blocks in read(2) but for a line or two.
            let _timely = crate::cpu::Realtime::enter(crate::cpu::HARNESS_RT_PRIORITY);
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

    /// The generator's process id (while it runs).
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
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
