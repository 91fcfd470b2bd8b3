//! The dataplane process: set-up (interfaces, the steering program, UMEMs, sockets,
//! flow tables), then its threads until a signal or a decommission request.
//!
//! - The **workers** (`worker`, one type, N of them) only forward. With `--workers N`,
//!   worker `w` owns the sockets of RX queues `q % N == w` of every interface (one AF_XDP
//!   socket per queue), one UMEM shared by them, its own TX queues and its own flow
//!   table (docs/dataplane.md, "More than one worker"). A frame received on the uplink
//!   is rewritten in place and handed to a Pod interface's TX ring of the same worker
//!   without a copy in userspace; frames cycle free → fill ring → RX → (TX →
//!   completion ring) → free. Packets larger than their egress: `large`.
//! - The **node thread** (`node`, this process's main thread) does the rest: the control
//!   state and the status juneau-bgp reads (`control`), Pod interfaces discovered
//!   through routes (`pods`, attached and detached while the workers forward), the
//!   process-wide statistics.
//! - The neighbour **resolver** and the **stats** thread (merging reports, writing the
//!   JSON file, feeding `/metrics`).
//!
//! The workers run `SCHED_FIFO` (`crate::sched`, `--worker-priority`) and sleep in
//! `poll(2)` on their sockets as soon as their rings are empty (a packet wakes them at
//! once; at most `idle_sleep_ms`). A worker the kernel keeps under the normal policy
//! busy-polls while traffic comes steadily (several batches per 10 ms) and sleeps when
//! nothing arrived for `busy_poll_us` or the traffic is only a trickle (as userspace sees
//! it while the XDP fast path forwards established flows), so a quiet node does not burn
//! a core; `--busy-poll-us 0` sleeps as soon as it is idle.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, ensure, Context, Result};
use arc_swap::ArcSwap;
use xsk_rs::config::{
    BindFlags, FrameSize, Interface, LibxdpFlags, QueueSize, SocketConfig, UmemConfig,
};
use xsk_rs::socket::SocketCreateError;
use xsk_rs::{CompQueue, FillQueue, FrameDesc, RxQueue, Socket, TxQueue, Umem};

use crate::counters::Stats;
use crate::engine::{Engine, EngineConfig};
use crate::flow::{FlowTable, Opened};
use crate::frames::FramePool;
use crate::neigh::{Iface, Side};
use crate::netlink::{self, Netlink, PodSource, SharedNeighbours};
use crate::privileges::Forwarding;
use crate::region::monotonic_ms;
use crate::steering::{SteeredIface, Steering};

mod control;
mod large;
mod node;
mod pods;
mod probes;
pub mod ready_file;
mod worker;
use worker::Reporter;

/// Bytes of every UMEM frame.
pub const FRAME_SIZE: u32 = 4096;
/// `--ring-size`'s default: every AF_XDP ring's entries.
pub const DEFAULT_RING_SIZE: u32 = 2048;
/// `--frames-per-iface`'s default: UMEM frames per socket.
pub const DEFAULT_FRAMES_PER_IFACE: u32 = 4096;

/// Frames taken from one RX ring per loop iteration.
const RX_BATCH: usize = 64;
/// Copy-mode TX sends at most this many frames per `sendto`.
const COPY_MODE_TX_BATCH: u32 = 32;

/// Runtime settings (the CLI maps onto these; see `docs/dataplane.md`).
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The uplink interface.
    pub uplink: String,
    /// Pod-facing interfaces.
    pub pod_ifaces: Vec<String>,
    /// The node-state file published by the node agent.
    pub state_file: PathBuf,
    /// Where the steering program's maps (with the flow table) and links are pinned.
    pub pin_dir: PathBuf,
    /// JSON stats file, rewritten atomically about once a second.
    pub stats_file: Option<PathBuf>,
    /// The dataplane status juneau-bgp reads (`juneau_control::dataplane_status`):
    /// heartbeat, programmed generation and VIPs.
    pub status_file: PathBuf,
    /// The `nft` binary that programs host-network backends' DNAT (`host_network.rs`).
    pub nft: PathBuf,
    /// The node Pod's decommission directory (`juneau_control::decommission`): when the
    /// node agent's request stands there, the dataplane detaches, removes its pins and
    /// files, and idles (`None`: never decommissioned; stopping keeps the pins).
    pub decommission_dir: Option<PathBuf>,
    /// The Pod-private readiness file the kubelet's probe reads ([`ready_file`]).
    pub ready_file: ready_file::ReadyFile,
    /// Address of `/metrics`, `/healthz`, `/readyz` (must bind); `None`: the default
    /// [`crate::metrics::DEFAULT_METRICS_ADDR`], only warned about when taken.
    pub metrics_addr: Option<SocketAddr>,
    /// Engine settings.
    pub engine: EngineConfig,
    /// UMEM frames per interface.
    pub frames_per_iface: u32,
    /// Size of each ring (fill, completion, RX, TX).
    pub ring_size: u32,
    /// Keep spinning this long after the last packet before sleeping (workers under the
    /// normal policy only: a realtime worker sleeps at once, `crate::sched`).
    pub busy_poll_us: u64,
    /// `SCHED_FIFO` priority of the forwarding workers; 0: the normal policy.
    pub worker_priority: u8,
    /// Longest sleep in `poll(2)` while idle.
    pub idle_sleep_ms: i32,
    /// Attach XDP in generic (skb) mode.
    pub generic_xdp: bool,
    /// Let the steering program forward established flows itself where the egress
    /// takes XDP frames (docs/dataplane.md, "XDP fast path").
    pub xdp_fast_path: bool,
    /// Packets of no flow admitted per source /24 (the workers debit the buckets, the
    /// steering program drops beyond them: [`crate::admission`]).
    pub new_flow_admission: crate::admission::Limit,
    /// Bind sockets in zero-copy mode (NICs that support it; veth does not).
    pub zero_copy: bool,
    /// Re-probe stale neighbour entries this often (seconds).
    pub neighbour_keepalive_s: u64,
    /// Also serve the interfaces the kernel routes backends out of (per-Pod veths),
    /// attaching and detaching them as they come and go.
    pub pod_ifaces_from_routes: bool,
    /// Most AF_XDP sockets on discovered Pod interfaces at once.
    pub max_pod_sockets: u32,
    /// UMEM frames reserved per socket on a discovered Pod interface (half of them sit
    /// in its fill ring).
    pub pod_iface_frames: u32,
    /// Redirects between nodes; `None`: off (non-SYN segments of unknown
    /// flows are dropped).
    pub redirect: Option<crate::redirect::RedirectConfig>,
    /// Largest IPv4 packet sent to another node (the node network's MTU).
    pub redirect_mtu: usize,
    /// AF_XDP busy polling (`crate::busy_poll`): frames per poll; 0 = off.
    pub xsk_busy_poll_budget: u32,
    /// Forwarding workers (threads), each serving the RX queues `q` with
    /// `q % workers == worker` of every interface and transmitting on its own; 0: one per
    /// RX queue of the uplink.
    pub workers: u32,
}

struct Port {
    /// Unique for the life of the process (frame ownership, see `frames.rs`).
    id: u32,
    name: String,
    ifindex: u32,
    side: Side,
    /// Most frames this socket's fill ring holds.
    fill_budget: u32,
    /// Frames in its fill ring or RX ring (handed over, not yet received back).
    fill_held: u32,
    tx: TxQueue,
    rx: RxQueue,
    fq: FillQueue,
    cq: CompQueue,
    /// Frames produced on TX not yet completed (while non-zero, every iteration — also
    /// after an idle sleep — kicks the kernel with a `sendto`).
    in_flight: u32,
    /// Frames produced on TX since the last `sendto`.
    unsent: u32,
    /// Frames received on this socket.
    rx_packets: u64,
    /// The largest frame the interface takes (its MTU and Ethernet header; at most one
    /// UMEM frame without `XDP_USE_SG`), read when the socket opens.
    max_frame: usize,
    /// Frames of a multi-buffer packet received so far (its last frame not yet).
    chain: Vec<FrameDesc>,
}

static STOP: AtomicBool = AtomicBool::new(false);
/// Set with [`STOP`] when the loop stops for a decommission request.
static DECOMMISSION: AtomicBool = AtomicBool::new(false);
/// SIGINT/SIGTERM arrived (what a decommissioned, idle process waits for).
static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::Relaxed);
    STOP.store(true, Ordering::Relaxed);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installing an async-signal-safe handler that only stores an atomic.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Number of RX queues of an interface (from sysfs; 1 when unknown).
fn rx_queues(name: &str) -> u32 {
    std::fs::read_dir(format!("/sys/class/net/{name}/queues"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
                .count() as u32
        })
        .unwrap_or(1)
        .max(1)
}

/// Sockets: what it takes to open an AF_XDP socket on an interface that appears later.
struct SocketFactory<'a> {
    umem: &'a Umem,
    cfg: xsk_rs::config::SocketConfig,
    next_id: u32,
    /// `RuntimeConfig::xsk_busy_poll_budget`.
    busy_poll_budget: u32,
}

/// A new AF_XDP socket's rings (xsk-rs `Socket::new`).
type NewSocket = (TxQueue, RxQueue, Option<(FillQueue, CompQueue)>);

/// How long a queue may stay bound to a socket of the process this one replaced: the
/// kernel releases an exited process's AF_XDP sockets from a work queue, a moment after
/// the process (and its succession lock) is gone.
const QUEUE_RELEASE_PATIENCE: Duration = Duration::from_secs(2);

impl SocketFactory<'_> {
    /// One AF_XDP socket on queue `q` of `ifname`, trying again while the queue is still
    /// bound (`EBUSY`) for up to [`QUEUE_RELEASE_PATIENCE`].
    fn create(&self, ifname: &Interface, q: u32) -> Result<NewSocket, SocketCreateError> {
        let asked = Instant::now();
        loop {
            // SAFETY: the UMEM outlives the socket (both live until `run` returns, sockets
            // are dropped first) and every frame handed to its rings comes from this UMEM.
            match unsafe { Socket::new(self.cfg, self.umem, ifname, q) } {
                Err(e) if queue_busy(&e) && asked.elapsed() < QUEUE_RELEASE_PATIENCE => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                r => return r,
            }
        }
    }
    /// One socket per RX queue of `si`, registered in the redirect map.
    fn open(
        &mut self,
        si: &SteeredIface,
        side: Side,
        fill_budget: u32,
        steering: &mut Steering,
        (worker, workers): (u32, u32),
    ) -> Result<Vec<Port>> {
        let name = &si.name;
        let sg = self.cfg.bind_flags().contains(BindFlags::XDP_USE_SG);
        let ifname: Interface = name
            .parse()
            .map_err(|e| anyhow!("interface name {name}: {e:?}"))?;
        let mut out = Vec::new();
        for q in (0..si.queues).filter(|q| q % workers == worker) {
            // SAFETY: the UMEM outlives the socket (both live until `run` returns, sockets
            // are dropped first) and every frame handed to its rings comes from this UMEM.
            let (tx, rx, rings) = self
                .create(&ifname, q)
                .map_err(|e| anyhow!("creating the AF_XDP socket on {name} queue {q}: {e}"))?;
            let (fq, cq) = rings.ok_or_else(|| {
                anyhow!("{name} queue {q}: no fill/completion ring for the socket")
            })?;
            if self.busy_poll_budget > 0 {
                crate::busy_poll::enable(rx.fd().as_raw_fd(), self.busy_poll_budget)
                    .with_context(|| format!("busy polling on {name} queue {q}"))?;
            }
            steering.register_socket(si.slot_base + q, rx.fd())?;
            self.next_id += 1;
            out.push(Port {
                id: self.next_id,
                name: format!("{name}/{q}"),
                ifindex: si.ifindex,
                side,
                fill_budget,
                fill_held: 0,
                tx,
                rx,
                fq,
                cq,
                in_flight: 0,
                unsent: 0,
                rx_packets: 0,
                max_frame: large::frame_limit(name, sg),
                chain: Vec::new(),
            });
        }
        Ok(out)
    }
}

/// Whether creating a socket failed because its queue is still bound to another socket.
fn queue_busy(e: &SocketCreateError) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .and_then(std::io::Error::raw_os_error)
        == Some(libc::EBUSY)
}

/// Whether the node agent's decommission request stands (`cfg.decommission_dir`).
fn decommission_requested(cfg: &RuntimeConfig) -> Option<String> {
    juneau_control::decommission::requested(cfg.decommission_dir.as_deref()?)
}

/// Undoes what the dataplane did on the node (helm uninstall): removes the pins —
/// the XDP links, so the program is detached from every interface, the maps and the
/// flow table — and its files in /run/juneau, acknowledges, and idles until
/// SIGINT/SIGTERM, answering /healthz (live) and /readyz (not ready) meanwhile. A
/// restarted dataplane comes here before attaching anything.
fn decommission_and_idle(
    cfg: &RuntimeConfig,
    token: &str,
    serving: Option<Arc<crate::metrics::Exporter>>,
) -> Result<()> {
    use juneau_control::decommission::{self, Component};
    let removed = Steering::remove_pins(&cfg.pin_dir)?;
    // The parent (/sys/fs/bpf/juneau) goes too once no other instance uses it (not in
    // the chart's container, where the parent is its /sys/fs/bpf mount point: the
    // host's empty /sys/fs/bpf/juneau stays).
    if let Some(parent) = cfg.pin_dir.parent() {
        let _ = std::fs::remove_dir(parent);
    }
    decommission::finish(
        std::iter::once(cfg.status_file.as_path()).chain(cfg.stats_file.as_deref()),
        cfg.decommission_dir.as_deref(),
        Component::Dataplane,
    )?;
    tracing::info!(token, pin_dir = %cfg.pin_dir.display(), pins_removed = removed, "decommissioned: XDP program detached, pins and files removed; idle until stopped");
    // Idling needs no capability (the metrics port is unprivileged).
    let none = caps::CapsHashSet::new();
    crate::privileges::restrict_current_thread(&none, &none)
        .context("dropping every capability to idle")?;
    match serving {
        Some(exporter) => exporter.set_decommissioned(),
        None => {
            let exporter = crate::metrics::Exporter::new(&cfg.status_file);
            exporter.set_decommissioned();
            exporter.serve(cfg.metrics_addr)?;
        }
    }
    while !SIGNALLED.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
    }
    tracing::info!("juneau-dataplane stopped (decommissioned)");
    Ok(())
}

/// Runs the dataplane until SIGINT/SIGTERM, or until a decommission request.
pub fn run(cfg: RuntimeConfig) -> Result<()> {
    install_signal_handlers();
    cfg.ready_file.clear();
    if let Some(token) = decommission_requested(&cfg) {
        return decommission_and_idle(&cfg, &token, None);
    }
    let started = std::time::Instant::now();
    ensure!(
        !cfg.pod_ifaces.is_empty() || cfg.pod_ifaces_from_routes,
        "no Pod interfaces: give --pod-iface or --pod-ifaces-from-routes"
    );
    let ifs = Interfaces::resolve(&cfg)?;
    // What forwarding keeps of the process's capabilities (crate::privileges); the rest
    // goes once set-up is done, below.
    let forwarding = Forwarding::needs(
        cfg.pod_ifaces_from_routes,
        cfg.worker_priority > 0,
        crate::privileges::running_kernel(),
    );
    let resolver = Resolver::start(&cfg, &ifs, &forwarding)?;
    let layout = Layout::of(&cfg, &ifs)?;
    let workers = worker_count(&cfg, &layout.steered)?;
    // What does not disturb a dataplane still running here is done before taking over
    // from it, so that its exit is followed by a short gap only (sockets, flow tables,
    // the program swapped in): the steering program and its pinned maps (read, and
    // replaced only where they no longer fit), the UMEMs.
    let (mut steering, regions, replaced) = Steering::load(
        &cfg.pin_dir,
        cfg.engine.flow_capacity,
        workers as usize,
        cfg.generic_xdp,
    )?;
    let program_reused = steering.program_reused();
    let umems = layout.umems(&cfg, workers)?;
    let prepared_ms = started.elapsed().as_millis();
    // An upgrade's new Pod starts beside the old one: the node's queues, flow tables and
    // status are the old dataplane's until it lets go. Held until the sockets are closed.
    // Ready from now on: the DaemonSet may delete the old Pod, whose exit is all this
    // process still waits for (ready_file: why not before).
    cfg.ready_file.say(ready_file::PREPARED);
    let succession = juneau_telemetry::take_over(&cfg.state_file, "dataplane")?;
    let took_over = std::time::Instant::now();
    if let Some(reason) = &replaced {
        tracing::warn!(pin_dir = %cfg.pin_dir.display(), reason, "pinned maps not reusable: replaced by fresh ones (flows of the previous run are lost)");
    }
    let admission = steering.set_new_flow_admission(cfg.new_flow_admission)?;
    // Off until this process's workers publish it (a previous run's may be in force).
    let fast_parts = steering.take_fast_parts(workers as usize);
    let (tables, flows_restored) = open_flow_tables(&cfg, regions, workers);
    let flows_ms = took_over.elapsed().as_millis();
    steering.attach_all(&layout.steered)?;
    for (name, mode) in &steering.modes {
        tracing::info!(iface = %name, mode, "XDP steering attached");
    }
    let mut built = build_workers(&cfg, &layout, tables, &umems, &mut steering, workers)?;
    built[0].engine.counters_mut().flows_restored += flows_restored;
    for b in built.iter_mut() {
        b.engine.set_admission(admission.clone());
    }
    if cfg.xdp_fast_path {
        for (b, part) in built.iter_mut().zip(fast_parts) {
            b.engine.set_xdp_fast_path(part);
        }
    }
    if let Some(r) = &cfg.redirect {
        if r.node_from_state {
            tracing::info!(
                port = r.port,
                static_peers = r.peers.len(),
                "redirects between nodes start when the node agent publishes this node's address"
            );
        }
    }
    let control = control::Control::new(&cfg)?;
    control.listen_redirects(&mut steering)?;
    // Set-up is done: sockets bound, programs attached. Before any other thread starts,
    // drop what only set-up needed (the threads started below inherit the rest).
    drop_setup_capabilities(&forwarding)?;
    tracing::info!(
        uplink = %cfg.uplink,
        pods = ?cfg.pod_ifaces,
        pod_ifaces_from_routes = cfg.pod_ifaces_from_routes,
        workers,
        frames_per_worker = ?umems.iter().map(|u| u.1.len()).collect::<Vec<_>>(),
        flow_capacity = cfg.engine.flow_capacity,
        "juneau-dataplane forwarding"
    );
    // What a restart costs: the set-up done before taking over (ms since the process
    // began), and the gap after it, while nothing forwards on this node (ms since the
    // predecessor exited).
    tracing::info!(
        prepared_ms,
        waited_for_predecessor_ms = took_over
            .duration_since(started)
            .as_millis()
            .saturating_sub(prepared_ms),
        flow_tables_ms = flows_ms,
        forwarding_ms = took_over.elapsed().as_millis(),
        program_reused,
        "start took"
    );
    let exporter = start_exporter(&cfg, &forwarding)?;
    let (stats_tx, stats_writer) =
        spawn_stats_writer(&cfg, exporter.clone(), workers as usize, forwarding.clone())?;
    let (node, workers) = hand_out_workers(&cfg, built, control, steering, &layout, &ifs);
    run_workers(&cfg, node, workers, &resolver, &stats_tx, &forwarding)?;
    // Every socket is closed with its worker, and the queues with the UMEMs: a successor
    // may take over now, not after this process's last stats and threads.
    drop(umems);
    if !DECOMMISSION.load(Ordering::Relaxed) {
        drop(succession);
    }
    drop(stats_tx);
    let _ = stats_writer.join();
    cfg.ready_file.say(ready_file::STOPPED);
    resolver.stop();
    if DECOMMISSION.load(Ordering::Relaxed) {
        // Every socket and program handle is closed: the pins are the last references.
        let token = decommission_requested(&cfg).unwrap_or_default();
        return decommission_and_idle(&cfg, &token, Some(exporter));
    }
    tracing::info!(pin_dir = %cfg.pin_dir.display(), "juneau-dataplane stopped; XDP links and flow table stay pinned (juneau-dataplane --remove-pins removes them)");
    Ok(())
}

/// Drops the capabilities only set-up needed (`forwarding` says what is kept) and says
/// which are left.
fn drop_setup_capabilities(forwarding: &Forwarding) -> Result<()> {
    let dropped = forwarding
        .enter()
        .context("dropping the capabilities only set-up needs")?;
    tracing::info!(
        kept = ?crate::privileges::names(&forwarding.keep),
        sys_nice_until_workers_start = forwarding.nice_at_start,
        dropped = ?crate::privileges::names(&dropped),
        "capabilities after set-up"
    );
    Ok(())
}

/// Starts serving /metrics, /healthz, /readyz and returns the exporter.
fn start_exporter(
    cfg: &RuntimeConfig,
    forwarding: &Forwarding,
) -> Result<Arc<crate::metrics::Exporter>> {
    // /metrics, /healthz, /readyz on their own thread (crate::metrics); the stats thread
    // hands it the merged counters.
    let exporter = crate::metrics::Exporter::new(&cfg.status_file);
    // Started from a thread of its own that first drops CAP_SYS_NICE (kept by this one
    // for the workers' start), so the metrics thread never holds it.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            forwarding.settle_thread();
            exporter.serve(cfg.metrics_addr)
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })?;
    Ok(exporter)
}

/// Splits what set-up built: the node thread's part (control state, steering, Pod
/// interfaces discovered later, on worker 0's UMEM) and the workers, each with the
/// channel its socket changes come by.
fn hand_out_workers<'u>(
    cfg: &RuntimeConfig,
    built: Vec<Built<'u>>,
    control: control::Control,
    steering: Steering,
    layout: &Layout,
    ifs: &Interfaces,
) -> (node::Node<'u>, Vec<worker::Worker<'u>>) {
    let mut pods = None;
    let mut workers = Vec::new();
    for (id, b) in built.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel();
        let umem = b.factory.umem;
        if id == 0 && cfg.pod_ifaces_from_routes {
            pods = Some(pods::PodInterfaces::new(
                b.factory,
                (layout.slots, layout.max_discovered),
                (cfg.pod_iface_frames.max(2) / 2).clamp(1, cfg.ring_size),
                ifs.pods.iter().map(|p| p.1.ifindex).collect(),
                tx,
            ));
        }
        workers.push(worker::Worker {
            id,
            umem,
            pool: b.pool,
            ports: b.ports,
            engine: b.engine,
            changes: rx,
        });
    }
    let node = node::Node {
        control,
        steering,
        pods,
        backend_ips: ifs.backend_ips.clone(),
    };
    (node, workers)
}

/// The interfaces named on the command line.
struct Interfaces {
    uplink: Iface,
    /// `--pod-iface` names and interfaces, in order (`Side::Pod` index).
    pods: Vec<(String, Iface)>,
    /// Backend addresses handed to the resolver (route discovery on).
    backend_ips: Option<Arc<ArcSwap<Vec<u32>>>>,
}

impl Interfaces {
    fn resolve(cfg: &RuntimeConfig) -> Result<Self> {
        let uplink =
            netlink::iface(&cfg.uplink).with_context(|| format!("uplink {}", cfg.uplink))?;
        let mut pods = Vec::new();
        for name in &cfg.pod_ifaces {
            pods.push((
                name.clone(),
                netlink::iface(name).with_context(|| format!("Pod interface {name}"))?,
            ));
        }
        let backend_ips = cfg
            .pod_ifaces_from_routes
            .then(|| Arc::new(ArcSwap::from_pointee(Vec::new())));
        Ok(Interfaces {
            uplink,
            pods,
            backend_ips,
        })
    }

    fn pod_ifaces(&self) -> Vec<Iface> {
        self.pods.iter().map(|p| p.1).collect()
    }
}

/// The neighbour resolver thread and what the workers use to talk to it.
struct Resolver {
    shared: Arc<SharedNeighbours>,
    miss_tx: crate::netlink::MissSender,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl Resolver {
    /// Neighbours: a resolver thread keeps a copy fresh.
    fn start(cfg: &RuntimeConfig, ifs: &Interfaces, forwarding: &Forwarding) -> Result<Self> {
        let pod_ifaces = ifs.pod_ifaces();
        let source = PodSource {
            explicit: pod_ifaces.clone(),
            from_routes: ifs.backend_ips.clone(),
        };
        let mut nl = Netlink::open().context("opening a netlink socket")?;
        let first = nl
            .snapshot(ifs.uplink, &pod_ifaces)
            .context("reading routes and neighbours")?;
        let shared = Arc::new(SharedNeighbours::new(first));
        let (miss_tx, miss_rx) = mpsc::sync_channel::<crate::netlink::Miss>(256);
        let stop = Arc::new(AtomicBool::new(false));
        let keepalive = Duration::from_secs(cfg.neighbour_keepalive_s.max(1));
        let uplink = ifs.uplink;
        let handle = {
            let (shared, stop) = (shared.clone(), stop.clone());
            let forwarding = forwarding.clone();
            std::thread::Builder::new()
                .name("neighbours".into())
                .spawn(move || {
                    // Started before set-up ends: keeps only what forwarding needs
                    // (CAP_NET_ADMIN for the neighbour table) from the start.
                    if let Err(e) = forwarding.enter_early_thread() {
                        // As when the main thread cannot: the process stops.
                        tracing::error!(error = %e, "the neighbour resolver could not drop the capabilities only set-up needs");
                        std::process::exit(1);
                    }
                    netlink::run_resolver(
                        nl,
                        uplink,
                        source,
                        shared,
                        miss_rx,
                        stop,
                        Duration::from_secs(1),
                        keepalive,
                    )
                })?
        };
        Ok(Resolver {
            shared,
            miss_tx,
            stop,
            handle,
        })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        drop(self.miss_tx);
        let _ = self.handle.join();
    }
}

/// The fixed interfaces' redirect-map slots: one socket per RX queue of every interface
/// (veth: one queue unless created with more), then room for discovered Pod interfaces.
struct Layout {
    steered: Vec<SteeredIface>,
    sides: Vec<Side>,
    /// Slots of the fixed interfaces (the first discovered one's base).
    slots: u32,
    max_discovered: u32,
}

impl Layout {
    fn of(cfg: &RuntimeConfig, ifs: &Interfaces) -> Result<Self> {
        let mut steered = Vec::new();
        let mut slot = 0u32;
        let all = std::iter::once((cfg.uplink.clone(), ifs.uplink, Side::Uplink)).chain(
            ifs.pods
                .iter()
                .enumerate()
                .map(|(i, (n, f))| (n.clone(), *f, Side::Pod(i as u16))),
        );
        let mut sides = Vec::new();
        for (name, iface, side) in all {
            let queues = rx_queues(&name);
            steered.push(SteeredIface {
                name: name.clone(),
                ifindex: iface.ifindex,
                uplink: side == Side::Uplink,
                slot_base: slot,
                queues,
            });
            sides.push(side);
            slot += queues;
        }
        let max_discovered = if cfg.pod_ifaces_from_routes {
            cfg.max_pod_sockets
        } else {
            0
        };
        ensure!(
            slot + max_discovered <= 4096,
            "at most 4096 AF_XDP sockets (interfaces x RX queues, plus --max-pod-sockets) are supported"
        );
        ensure!(
            steered.len() + max_discovered as usize <= 256,
            "at most 256 interfaces (uplink, --pod-iface and --max-pod-sockets) are supported"
        );
        Ok(Layout {
            steered,
            sides,
            slots: slot,
            max_discovered,
        })
    }

    /// One UMEM per worker: frames for each of its sockets, and worker 0's for
    /// discovered Pod interfaces.
    fn umems(&self, cfg: &RuntimeConfig, workers: u32) -> Result<Vec<(Umem, Vec<FrameDesc>)>> {
        let per_socket = cfg.frames_per_iface.max(2 * cfg.ring_size);
        let pod_frames = cfg.pod_iface_frames.max(2);
        (0..workers)
            .map(|w| {
                let sockets: u32 = self
                    .steered
                    .iter()
                    .map(|si| (0..si.queues).filter(|q| q % workers == w).count() as u32)
                    .sum();
                let extra = if w == 0 {
                    self.max_discovered * pod_frames
                } else {
                    0
                };
                new_umem(cfg, sockets * per_socket + extra)
            })
            .collect()
    }
}

/// One worker's parts, before its loop starts.
struct Built<'u> {
    factory: SocketFactory<'u>,
    pool: FramePool<FrameDesc>,
    ports: Vec<Port>,
    engine: Engine,
}

/// Every worker's sockets (its queues of every interface, registered in the redirect
/// map), frame pool and engine over its flow table.
fn build_workers<'u>(
    cfg: &RuntimeConfig,
    layout: &Layout,
    tables: Vec<FlowTable>,
    umems: &'u [(Umem, Vec<FrameDesc>)],
    steering: &mut Steering,
    workers: u32,
) -> Result<Vec<Built<'u>>> {
    let sock_cfg = socket_config(cfg)?;
    let mut out = Vec::new();
    let mut shared6: Option<crate::engine::SharedFlows6> = None;
    for (w, (table, (umem, descs))) in tables.into_iter().zip(umems).enumerate() {
        let mut factory = SocketFactory {
            umem,
            cfg: sock_cfg,
            next_id: 0,
            busy_poll_budget: cfg.xsk_busy_poll_budget,
        };
        let mut ports = Vec::new();
        for (si, side) in layout.steered.iter().zip(&layout.sides) {
            let mine = (w as u32, workers);
            ports.extend(factory.open(si, *side, cfg.ring_size, steering, mine)?);
        }
        let mut engine = Engine::with_flows(cfg.engine, table);
        match &shared6 {
            // One IPv6 flow table for every worker (`engine6.rs`).
            Some(t) => engine.share_flows6(t.clone()),
            None => {
                adopt_ipv6_flows(&mut engine, steering);
                shared6 = Some(engine.flows6_shared());
            }
        }
        if let Some(r) = &cfg.redirect {
            engine.set_redirect(crate::redirect::Redirector::new(r.clone()));
        }
        out.push(Built {
            factory,
            pool: FramePool::new(descs.clone(), FRAME_SIZE as usize),
            ports,
            engine,
        });
    }
    Ok(out)
}

/// The IPv6 flow table the workers share: the previous run's flows rebuilt from the keys
/// it left in the steering map (keys that pair with none withdrawn), then every key it
/// adds or ends mirrored into the map.
fn adopt_ipv6_flows(engine: &mut Engine, steering: &Steering) {
    let keys: Vec<crate::flow6::Flow6Key> = match steering.flows6().entries() {
        Ok(entries) => entries
            .iter()
            .map(|(k, _)| crate::steering::ipv6::flow_key(k))
            .collect(),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "reading the previous run's IPv6 flows failed; they are lost");
            Vec::new()
        }
    };
    let now = crate::region::monotonic_ms();
    let restored = {
        let mut table = engine.flows6_mut();
        let restored = table.restore(&keys, |ip| steering.is_vip6(ip), now);
        for k in &keys {
            if table.lookup(k, now).is_none() {
                let _ = steering.flows6().remove(&crate::steering::ipv6::map_key(k));
            }
        }
        table.set_mirror(Box::new(crate::steering::ipv6::Flows6Mirror::new(
            steering.flows6().clone(),
            0,
        )));
        restored
    };
    if !keys.is_empty() {
        tracing::info!(
            restored,
            keys = keys.len(),
            "IPv6 flows of the previous run"
        );
    }
    engine.counters_mut().flows_restored += restored as u64;
}

/// Every worker on a thread of its own, the node thread's loop on this one; returns
/// once they all stopped (signal, decommission, or a worker failing to start).
fn run_workers(
    cfg: &RuntimeConfig,
    node: node::Node<'_>,
    workers: Vec<worker::Worker<'_>>,
    resolver: &Resolver,
    stats_tx: &StatsSender,
    forwarding: &Forwarding,
) -> Result<()> {
    let published = worker::Published::new(workers.len());
    let (prober, answers_tx) = probes::Prober::new();
    let unreachable = probes::Unreachable::default();
    std::thread::scope(|sc| -> Result<()> {
        for wk in workers {
            let ctx = worker::Shared {
                cfg,
                neighbours: &resolver.shared,
                published: &published,
                unreachable: &unreachable,
                answers_tx: answers_tx.clone(),
                miss_tx: resolver.miss_tx.clone(),
                stats_tx: stats_tx.clone(),
                forwarding,
            };
            let id = wk.id;
            let spawned = std::thread::Builder::new()
                .name(format!("worker-{id}"))
                .spawn_scoped(sc, move || worker::worker_loop(wk, ctx));
            if let Err(e) = spawned {
                STOP.store(true, Ordering::Relaxed);
                return Err(e).with_context(|| format!("starting forwarding worker {id}"));
            }
        }
        // Realtime like the workers, then no CAP_SYS_NICE any more.
        crate::sched::enter_node_thread(cfg.worker_priority);
        forwarding.settle_thread();
        drop(answers_tx);
        node.run(
            &node::NodeShared {
                cfg,
                neighbours: &resolver.shared,
                miss_tx: &resolver.miss_tx,
                published: &published,
                unreachable: &unreachable,
                stats_tx,
            },
            prober,
        );
        // The node thread stops (signal or decommission): the workers with it.
        STOP.store(true, Ordering::Relaxed);
        Ok(())
    })
}

/// Forwarding workers: `--workers`, or one per RX queue of the uplink (0). More than one
/// needs every interface to have a queue for each worker (a worker transmits only on its
/// own sockets) and fixed Pod interfaces.
fn worker_count(cfg: &RuntimeConfig, steered: &[SteeredIface]) -> Result<u32> {
    let max = crate::flow::MAX_WORKERS as u32;
    let n = match cfg.workers {
        0 if cfg.pod_ifaces_from_routes => 1,
        0 => steered.iter().map(|s| s.queues).min().unwrap_or(1).min(max),
        n => n,
    };
    ensure!(
        n <= max,
        "at most {max} forwarding workers are supported (--workers {n})"
    );
    if n > 1 {
        ensure!(
            !cfg.pod_ifaces_from_routes,
            "--workers {n} with --pod-ifaces-from-routes is not supported yet (per-Pod veths have one queue, which only one worker could transmit on): use --workers 1"
        );
        for si in steered {
            ensure!(
                si.queues >= n,
                "{} has {} RX queue(s); {n} workers need at least {n} (each worker receives and transmits on its own queues)",
                si.name,
                si.queues
            );
        }
    }
    Ok(n)
}

/// The group of flow tables (one per worker) in the pinned maps, and how many flows a
/// previous run left that were kept.
fn open_flow_tables(
    cfg: &RuntimeConfig,
    regions: crate::flow::SharedRegions,
    workers: u32,
) -> (Vec<FlowTable>, u64) {
    let (tables, opened) = FlowTable::open_group(
        regions,
        workers as usize,
        cfg.engine.timeouts,
        cfg.engine.hash_seed,
        monotonic_ms(),
    );
    let restored = match &opened {
        Opened::Adopted { flows, expired } => {
            tracing::info!(pin_dir = %cfg.pin_dir.display(), flows, expired, workers, "flow table found again; its flows are kept");
            *flows as u64
        }
        Opened::Fresh { reason } => {
            tracing::info!(pin_dir = %cfg.pin_dir.display(), reason, workers, "starting with an empty flow table");
            0
        }
    };
    (tables, restored)
}

/// One worker's UMEM of `frames` frames ([`FRAME_SIZE`]), with their descriptors.
fn new_umem(cfg: &RuntimeConfig, frames: u32) -> Result<(Umem, Vec<FrameDesc>)> {
    let umem_cfg = UmemConfig::builder()
        .frame_size(FrameSize::new(FRAME_SIZE).map_err(|e| anyhow!("{e}"))?)
        .fill_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .comp_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .build()
        .map_err(|e| anyhow!("UMEM config: {e}"))?;
    Umem::new(
        umem_cfg,
        NonZeroU32::new(frames.max(1)).expect("non-zero"),
        false,
    )
    .map_err(|e| anyhow!("creating the UMEM ({frames} frames): {e}"))
}

fn socket_config(cfg: &RuntimeConfig) -> Result<SocketConfig> {
    // Copy mode takes packets of any length as chains of frames (`XDP_USE_SG`, Linux
    // >= 6.6): a Pod's TSO super-segment reaches userspace whole instead of dying at the
    // socket. Zero-copy needs the driver's multi-buffer support, so it is left out there.
    let bind = if cfg.zero_copy {
        BindFlags::XDP_ZEROCOPY
    } else {
        BindFlags::XDP_COPY | BindFlags::XDP_USE_SG
    };
    Ok(SocketConfig::builder()
        .rx_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .tx_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .libxdp_flags(LibxdpFlags::XSK_LIBXDP_FLAGS_INHIBIT_PROG_LOAD)
        .bind_flags(bind)
        .build())
}

/// Where the node thread and the workers send their statistics.
type StatsSender = mpsc::SyncSender<(Reporter, Stats)>;

/// Serialising and writing the stats happens on its own thread, so the forwarding
/// workers only copy their counters once a second; it merges the workers' reports.
fn spawn_stats_writer(
    cfg: &RuntimeConfig,
    exporter: Arc<crate::metrics::Exporter>,
    workers: usize,
    forwarding: Forwarding,
) -> Result<(StatsSender, std::thread::JoinHandle<()>)> {
    let (stats_tx, stats_rx) = mpsc::sync_channel::<(Reporter, Stats)>(2 * workers + 2);
    let path = cfg.stats_file.clone();
    let ready = cfg.ready_file.clone();
    let decommission_dir = cfg.decommission_dir.clone();
    let h = std::thread::Builder::new().name("stats".into()).spawn(move || {
        forwarding.settle_thread();
        let mut collector = worker::Collector::new(workers);
        for (w, stats) in stats_rx {
            let Some(mut stats) = collector.add(w, stats) else {
                continue;
            };
            stats.interface_rx_dropped = interface_rx_dropped(&stats.rx_packets_per_socket);
            // The node agent's decommission request: checked with each statistics
            // round (a stat a second), off the forwarding threads.
            let request = decommission_dir
                .as_deref()
                .and_then(juneau_control::decommission::requested);
            if let Some(token) = request {
                tracing::info!(token = %token, "decommission requested: stopping forwarding");
                DECOMMISSION.store(true, Ordering::Relaxed);
                STOP.store(true, Ordering::Relaxed);
            }
            if let Some(path) = &path {
                let json = serde_json::to_vec_pretty(&stats).unwrap_or_default();
                if let Err(e) = juneau_control::mapped::write_atomically(path, &json) {
                    tracing::warn!(path = %path.display(), error = %e, "writing the stats file failed");
                }
            }
            exporter.update(stats);
            if ready.0.is_some() {
                use juneau_telemetry::Endpoint;
                let verdict = exporter.ready().map(|()| ready_file::READY.to_string());
                ready.say(&verdict.unwrap_or_else(|why| why));
            }
        }
    })?;
    Ok((stats_tx, h))
}

/// The kernel's receive drops of every interface with a socket (`interface/queue` keys):
/// read from sysfs by the statistics thread, off the forwarding path.
fn interface_rx_dropped(
    sockets: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    let ifaces: std::collections::BTreeSet<&str> =
        sockets.keys().filter_map(|k| k.split('/').next()).collect();
    ifaces
        .into_iter()
        .filter_map(|iface| {
            let path = format!("/sys/class/net/{iface}/statistics/rx_dropped");
            let n = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
            Some((iface.to_string(), n))
        })
        .collect()
}

/// The loop's own timing, logged once a second at debug level (`RUST_LOG=
/// juneau_dataplane=debug`): where a packet's wait comes from. Gaps between iterations
/// that are not the loop's own idle sleep are time the thread was not running (preempted)
/// or stuck in a syscall; the RX batch sizes show how full batches are; kicks with nothing
/// newly produced are `sendto`s spent only on frames the kernel had not taken yet.
#[derive(Default)]
struct LoopTiming {
    last_top: Option<Instant>,
    slept: Duration,
    iterations: u64,
    max_gap: Duration,
    gaps_over_100us: u64,
    gaps_over_1ms: u64,
    /// Frames received per iteration: 0, 1-8, 9-32, 33+.
    batches: [u64; 4],
    kicks: u64,
    idle_kicks: u64,
    sleeps: u64,
    sleep_total: Duration,
    yields: u64,
    nonvoluntary_switches: u64,
    /// Every gap since start (exported as `juneau_dataplane_loop_gap_seconds`).
    gaps: crate::counters::GapHistogram,
}

impl LoopTiming {
    fn top(&mut self, now: Instant) {
        if let Some(l) = self.last_top {
            let gap = now.saturating_duration_since(l).saturating_sub(self.slept);
            self.max_gap = self.max_gap.max(gap);
            self.gaps_over_100us += u64::from(gap > Duration::from_micros(100));
            self.gaps_over_1ms += u64::from(gap > Duration::from_millis(1));
            self.gaps
                .observe(gap.as_micros().min(u128::from(u64::MAX)) as u64);
        }
        self.last_top = Some(now);
        self.slept = Duration::ZERO;
        self.iterations += 1;
    }

    fn received(&mut self, n: usize) {
        self.batches[match n {
            0 => 0,
            1..=8 => 1,
            9..=32 => 2,
            _ => 3,
        }] += 1;
    }

    fn slept_for(&mut self, d: Duration) {
        self.sleeps += 1;
        self.sleep_total += d;
        self.slept += d;
    }

    /// Logs the last second and starts over.
    fn log(&mut self) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            // Nobody reads it: no /proc read on the forwarding thread; the gap
            // histogram keeps counting.
            let gaps = std::mem::take(&mut self.gaps);
            *self = LoopTiming {
                last_top: self.last_top,
                gaps,
                ..Default::default()
            };
            return;
        }
        let switches = std::fs::read_to_string("/proc/thread-self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("nonvoluntary_ctxt_switches"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .unwrap_or(0);
        tracing::debug!(
            iterations = self.iterations,
            max_gap_us = self.max_gap.as_micros() as u64,
            gaps_over_100us = self.gaps_over_100us,
            gaps_over_1ms = self.gaps_over_1ms,
            rx_batches_empty = self.batches[0],
            rx_batches_1_8 = self.batches[1],
            rx_batches_9_32 = self.batches[2],
            rx_batches_33_64 = self.batches[3],
            kicks = self.kicks,
            idle_kicks = self.idle_kicks,
            sleeps = self.sleeps,
            sleep_ms = self.sleep_total.as_millis() as u64,
            yields = self.yields,
            preempted = switches.saturating_sub(self.nonvoluntary_switches),
            "loop timing"
        );
        *self = LoopTiming {
            last_top: self.last_top,
            nonvoluntary_switches: switches,
            gaps: std::mem::take(&mut self.gaps),
            ..Default::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_drops_are_read_per_interface_and_unknown_ones_skipped() {
        let sockets: std::collections::BTreeMap<String, u64> = [
            ("lo/0".to_string(), 1),
            ("lo/1".to_string(), 2),
            ("no-such-iface-7/0".to_string(), 3),
        ]
        .into();
        let d = interface_rx_dropped(&sockets);
        assert_eq!(d.keys().collect::<Vec<_>>(), ["lo"], "{d:?}");
    }
}
