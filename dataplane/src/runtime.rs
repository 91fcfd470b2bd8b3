//! The AF_XDP forwarding loop: sockets, shared UMEM, rings, state and neighbour
//! refresh, stats. Everything per packet is delegated to [`Engine`].
//!
//! One AF_XDP socket per interface (queue 0; veth has one queue), all sharing one UMEM,
//! so a frame received on the uplink is rewritten in place and handed to a Pod
//! interface's TX ring without a copy in userspace. Frames cycle through a free stack:
//! free → fill ring → RX → (TX → completion ring) → free.
//!
//! Pod interfaces named on the command line are fixed; with route discovery on, the
//! resolver thread lists the interfaces the kernel routes backends out of, and the loop
//! attaches sockets + steering to new ones and detaches vanished ones between batches,
//! reclaiming the UMEM frames a closed socket held (`crate::frames`).
//!
//! The loop busy-polls. When nothing arrived for `busy_poll_us`, it sleeps in `poll(2)`
//! on the sockets for at most `idle_sleep_ms` (a packet wakes it at once), so a quiet node
//! does not burn a core; `--busy-poll-us 0` sleeps as soon as it is idle, a very large
//! value never sleeps.

use std::io::Write as _;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, ensure, Context, Result};
use arc_swap::ArcSwap;
use juneau_control::dataplane_status::DataplaneStatusWriter;
use juneau_control::shm::NodeStateReader;
use xsk_rs::config::{
    BindFlags, FrameSize, Interface, LibxdpFlags, QueueSize, SocketConfig, UmemConfig,
};
use xsk_rs::{CompQueue, FillQueue, FrameDesc, RxQueue, Socket, TxQueue, Umem};

use crate::counters::{DropReason, ServiceStats, Stats};
use crate::engine::{Engine, EngineConfig, Verdict};
use crate::flow::{FlowTable, Opened};
use crate::frames::FramePool;
use crate::neigh::{Iface, Neighbours, Resolve, Side};
use crate::netlink::{self, Netlink, PodSource, SharedNeighbours};
use crate::region::monotonic_ms;
use crate::services::ServiceTable;
use crate::steering::{IfaceLink, SteeredIface, Steering};

/// Frames taken from one RX ring per loop iteration.
const RX_BATCH: usize = 64;
/// Copy-mode TX sends at most this many frames per `sendto`.
const COPY_MODE_TX_BATCH: u32 = 32;
/// Expired flows examined per loop iteration.
const SWEEP_BUDGET: usize = 64;

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
    /// Address to serve Prometheus metrics on (`GET /metrics`).
    pub metrics_addr: Option<SocketAddr>,
    /// Engine settings.
    pub engine: EngineConfig,
    /// UMEM frames per interface.
    pub frames_per_iface: u32,
    /// Size of each ring (fill, completion, RX, TX).
    pub ring_size: u32,
    /// Keep spinning this long after the last packet before sleeping.
    pub busy_poll_us: u64,
    /// Longest sleep in `poll(2)` while idle.
    pub idle_sleep_ms: i32,
    /// Attach XDP in generic (skb) mode.
    pub generic_xdp: bool,
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
    /// Redirects between nodes (issue 12); `None`: off (non-SYN segments of unknown
    /// flows are dropped).
    pub redirect: Option<crate::redirect::RedirectConfig>,
    /// Largest IPv4 packet sent to another node (the node network's MTU).
    pub redirect_mtu: usize,
    /// AF_XDP busy polling (`crate::busy_poll`): frames per poll; 0 = off.
    pub xsk_busy_poll_budget: u32,
}

struct Port {
    /// Unique for the life of the process (frame ownership, see `frames.rs`).
    id: u32,
    name: String,
    ifindex: u32,
    queue: u32,
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
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
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

/// Writes `contents` to `path` atomically (temporary file in the same directory, then
/// rename).
pub fn write_atomically(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents)?;
    }
    std::fs::rename(&tmp, path)
}

fn serve_metrics(addr: SocketAddr, text: Arc<Mutex<String>>) -> Result<()> {
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("binding metrics address {addr}"))?;
    tracing::info!(%addr, "serving Prometheus metrics on /metrics");
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let mut req = [0u8; 1024];
            let n = std::io::Read::read(&mut conn, &mut req).unwrap_or(0);
            let line = String::from_utf8_lossy(&req[..n]);
            let ok = line.starts_with("GET /metrics") || line.starts_with("GET / ");
            let body = if ok { text.lock().map(|t| t.clone()).unwrap_or_default() } else { "not found\n".into() };
            let status = if ok { "200 OK" } else { "404 Not Found" };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    })?;
    Ok(())
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

fn open_state(path: &Path) -> Option<NodeStateReader> {
    match NodeStateReader::open(path) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "node state not readable yet; forwarding nothing until it is");
            None
        }
    }
}

/// Sockets: what it takes to open an AF_XDP socket on an interface that appears later.
struct SocketFactory<'a> {
    umem: &'a Umem,
    cfg: xsk_rs::config::SocketConfig,
    next_id: u32,
    /// `RuntimeConfig::xsk_busy_poll_budget`.
    busy_poll_budget: u32,
}

impl SocketFactory<'_> {
    /// One socket per RX queue of `si`, registered in the redirect map.
    fn open(
        &mut self,
        si: &SteeredIface,
        side: Side,
        fill_budget: u32,
        steering: &mut Steering,
    ) -> Result<Vec<Port>> {
        let name = &si.name;
        let ifname: Interface = name
            .parse()
            .map_err(|e| anyhow!("interface name {name}: {e:?}"))?;
        let mut out = Vec::new();
        for q in 0..si.queues {
            // SAFETY: the UMEM outlives the socket (both live until `run` returns, sockets
            // are dropped first) and every frame handed to its rings comes from this UMEM.
            let (tx, rx, rings) = unsafe { Socket::new(self.cfg, self.umem, &ifname, q) }
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
                queue: q,
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
            });
        }
        Ok(out)
    }
}

/// A Pod interface found through the routing table and attached while running.
struct DiscoveredPod {
    steered: SteeredIface,
    link: IfaceLink,
}

/// Discovered Pod interfaces: their redirect-map slots and sockets' frame budget.
struct Discovery {
    /// First redirect-map slot for discovered interfaces.
    slot_base: u32,
    /// Slots in use (relative to `slot_base`).
    slots_used: Vec<bool>,
    fill_budget: u32,
    attached: Vec<DiscoveredPod>,
    /// Interfaces whose attach failed, and when to try again.
    retry_after: std::collections::HashMap<u32, Instant>,
    attaches: u64,
    detaches: u64,
}

impl Discovery {
    fn alloc_slots(&mut self, n: u32) -> Option<u32> {
        let n = n as usize;
        let free_run = (0..self.slots_used.len().saturating_sub(n - 1))
            .find(|&i| self.slots_used[i..i + n].iter().all(|u| !u))?;
        for u in &mut self.slots_used[free_run..free_run + n] {
            *u = true;
        }
        Some(self.slot_base + free_run as u32)
    }

    fn free_slots(&mut self, base: u32, n: u32) {
        let from = (base - self.slot_base) as usize;
        for u in self.slots_used.iter_mut().skip(from).take(n as usize) {
            *u = false;
        }
    }
}

/// Runs the dataplane until SIGINT/SIGTERM.
pub fn run(cfg: RuntimeConfig) -> Result<()> {
    install_signal_handlers();
    ensure!(
        !cfg.pod_ifaces.is_empty() || cfg.pod_ifaces_from_routes,
        "no Pod interfaces: give --pod-iface or --pod-ifaces-from-routes"
    );
    let uplink = netlink::iface(&cfg.uplink).with_context(|| format!("uplink {}", cfg.uplink))?;
    let mut pods = Vec::new();
    for name in &cfg.pod_ifaces {
        pods.push((
            name.clone(),
            netlink::iface(name).with_context(|| format!("Pod interface {name}"))?,
        ));
    }
    let pod_ifaces: Vec<Iface> = pods.iter().map(|p| p.1).collect();
    let backend_ips: Option<Arc<ArcSwap<Vec<u32>>>> = cfg
        .pod_ifaces_from_routes
        .then(|| Arc::new(ArcSwap::from_pointee(Vec::new())));
    let source = PodSource {
        explicit: pod_ifaces.clone(),
        from_routes: backend_ips.clone(),
    };

    // Neighbours: a resolver thread keeps a copy fresh.
    let mut nl = Netlink::open().context("opening a netlink socket")?;
    let first = nl
        .snapshot(uplink, &pod_ifaces)
        .context("reading routes and neighbours")?;
    let shared = Arc::new(SharedNeighbours::new(first));
    let (miss_tx, miss_rx) = mpsc::sync_channel::<(u32, u32)>(256);
    let stop_resolver = Arc::new(AtomicBool::new(false));
    let keepalive = Duration::from_secs(cfg.neighbour_keepalive_s.max(1));
    let resolver = {
        let (shared, stop) = (shared.clone(), stop_resolver.clone());
        std::thread::Builder::new()
            .name("neighbours".into())
            .spawn(move || {
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

    // One socket per RX queue of every interface (veth: one queue).
    let mut steered = Vec::new();
    let mut slot = 0u32;
    let all = std::iter::once((cfg.uplink.clone(), uplink, Side::Uplink)).chain(
        pods.iter()
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

    // XDP steering (pinned maps and flow table, found again after a restart), then
    // sockets.
    let (mut steering, regions, replaced) =
        Steering::load(&cfg.pin_dir, cfg.engine.flow_capacity, cfg.generic_xdp)?;
    if let Some(reason) = &replaced {
        tracing::warn!(pin_dir = %cfg.pin_dir.display(), reason, "pinned maps not reusable: replaced by fresh ones (flows of the previous run are lost)");
    }
    let (flows, opened) = FlowTable::open_shared(
        regions,
        cfg.engine.timeouts,
        cfg.engine.hash_seed,
        monotonic_ms(),
    );
    let flows_restored = match &opened {
        Opened::Adopted { flows, expired } => {
            tracing::info!(pin_dir = %cfg.pin_dir.display(), flows, expired, "flow table found again; its flows are kept");
            *flows as u64
        }
        Opened::Fresh { reason } => {
            tracing::info!(pin_dir = %cfg.pin_dir.display(), reason, "starting with an empty flow table");
            0
        }
    };
    steering.attach_all(&steered)?;
    for (name, mode) in &steering.modes {
        tracing::info!(iface = %name, mode, "XDP steering attached");
    }
    let fixed_frames = cfg.frames_per_iface.max(2 * cfg.ring_size) * slot;
    let pod_frames = cfg.pod_iface_frames.max(2);
    let total_frames = fixed_frames + max_discovered * pod_frames;
    let umem_cfg = UmemConfig::builder()
        .frame_size(FrameSize::new(4096).map_err(|e| anyhow!("{e}"))?)
        .fill_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .comp_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .build()
        .map_err(|e| anyhow!("UMEM config: {e}"))?;
    let (umem, descs) = Umem::new(
        umem_cfg,
        NonZeroU32::new(total_frames).expect("non-zero"),
        false,
    )
    .map_err(|e| anyhow!("creating the UMEM ({total_frames} frames): {e}"))?;
    let bind = if cfg.zero_copy {
        BindFlags::XDP_ZEROCOPY
    } else {
        BindFlags::XDP_COPY
    };
    let sock_cfg = SocketConfig::builder()
        .rx_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .tx_queue_size(QueueSize::new(cfg.ring_size).map_err(|e| anyhow!("{e}"))?)
        .libxdp_flags(LibxdpFlags::XSK_LIBXDP_FLAGS_INHIBIT_PROG_LOAD)
        .bind_flags(bind)
        .build();
    let mut factory = SocketFactory {
        umem: &umem,
        cfg: sock_cfg,
        next_id: 0,
        busy_poll_budget: cfg.xsk_busy_poll_budget,
    };
    let mut ports = Vec::with_capacity(slot as usize);
    for (si, side) in steered.iter().zip(&sides) {
        ports.extend(factory.open(si, *side, cfg.ring_size, &mut steering)?);
    }
    let discovery = Discovery {
        slot_base: slot,
        slots_used: vec![false; max_discovered as usize],
        fill_budget: (pod_frames / 2).clamp(1, cfg.ring_size),
        attached: Vec::new(),
        retry_after: Default::default(),
        attaches: 0,
        detaches: 0,
    };
    tracing::info!(
        uplink = %cfg.uplink,
        pods = ?cfg.pod_ifaces,
        pod_ifaces_from_routes = cfg.pod_ifaces_from_routes,
        frames = total_frames,
        flow_capacity = cfg.engine.flow_capacity,
        "juneau-dataplane forwarding"
    );

    let metrics_text = Arc::new(Mutex::new(String::new()));
    if let Some(addr) = cfg.metrics_addr {
        serve_metrics(addr, metrics_text.clone())?;
    }
    // Serialising and writing the stats happens on its own thread, so the forwarding
    // loop only copies its counters once a second.
    let (stats_tx, stats_rx) = mpsc::sync_channel::<Stats>(2);
    let stats_writer = {
        let (path, text) = (cfg.stats_file.clone(), metrics_text.clone());
        std::thread::Builder::new().name("stats".into()).spawn(move || {
            for stats in stats_rx {
                *text.lock().unwrap_or_else(|p| p.into_inner()) = stats.prometheus();
                if let Some(path) = &path {
                    let json = serde_json::to_vec_pretty(&stats).unwrap_or_default();
                    if let Err(e) = write_atomically(path, &json) {
                        tracing::warn!(path = %path.display(), error = %e, "writing the stats file failed");
                    }
                }
            }
        })?
    };

    let mut io = Io {
        pool: FramePool::new(descs, 4096),
        ports,
        steering,
        factory,
        discovery,
        explicit: pod_ifaces.iter().map(|p| p.ifindex).collect(),
        backend_ips,
    };
    let mut engine = Engine::with_flows(cfg.engine, flows);
    engine.counters_mut().flows_restored = flows_restored;
    if let Some(r) = &cfg.redirect {
        let node = std::net::Ipv4Addr::from(r.node);
        io.steering.listen_redirects(node, r.port)?;
        tracing::info!(node = %node, port = r.port, peers = r.peers.len(), "redirects between nodes on");
        engine.set_redirect(crate::redirect::Redirector::new(r.clone()));
    }
    let result = forward_loop(&cfg, &mut io, &mut engine, &shared, &miss_tx, &stats_tx);
    drop(stats_tx);
    let _ = stats_writer.join();
    stop_resolver.store(true, Ordering::Relaxed);
    drop(miss_tx);
    let _ = resolver.join();
    drop(io);
    tracing::info!(pin_dir = %cfg.pin_dir.display(), "juneau-dataplane stopped; XDP links and flow table stay pinned (juneau-dataplane --remove-pins removes them)");
    result
}

/// The loop's I/O state: frames, sockets, steering, discovered Pod interfaces.
struct Io<'a> {
    pool: FramePool<FrameDesc>,
    ports: Vec<Port>,
    steering: Steering,
    factory: SocketFactory<'a>,
    discovery: Discovery,
    /// `--pod-iface` interfaces (never detached).
    explicit: Vec<u32>,
    /// Backend addresses handed to the resolver (route discovery on).
    backend_ips: Option<Arc<ArcSwap<Vec<u32>>>>,
}

impl Io<'_> {
    /// Egress socket (queue 0) of each of `nb`'s Pod interfaces, by `Side::Pod` index;
    /// `None` while the interface has no socket yet.
    fn egress_map(&self, nb: &Neighbours) -> Vec<Option<usize>> {
        nb.pods()
            .iter()
            .map(|i| {
                self.ports
                    .iter()
                    .position(|p| p.ifindex == i.ifindex && p.queue == 0 && p.side != Side::Uplink)
            })
            .collect()
    }

    /// Attaches the Pod interfaces `nb` lists that have no sockets yet and detaches
    /// discovered ones it no longer lists (their routes went away, e.g. the veth was
    /// deleted). Returns whether the socket set changed.
    fn reconcile_pods(&mut self, nb: &Neighbours, now: Instant) -> bool {
        if self.backend_ips.is_none() {
            return false;
        }
        let mut changed = false;
        // Detach first: frees slots and frames for the new ones.
        let gone: Vec<usize> = self
            .discovery
            .attached
            .iter()
            .enumerate()
            .filter(|(_, d)| {
                !nb.pods().iter().any(|p| p.ifindex == d.steered.ifindex)
                    || netlink::iface_name(d.steered.ifindex).is_err()
            })
            .map(|(i, _)| i)
            .collect();
        for i in gone.into_iter().rev() {
            let d = self.discovery.attached.remove(i);
            self.detach(d);
            changed = true;
        }
        for p in nb.pods() {
            if self.explicit.contains(&p.ifindex)
                || self
                    .discovery
                    .attached
                    .iter()
                    .any(|d| d.steered.ifindex == p.ifindex)
            {
                continue;
            }
            if self
                .discovery
                .retry_after
                .get(&p.ifindex)
                .is_some_and(|t| now < *t)
            {
                continue;
            }
            match self.attach(p.ifindex) {
                Ok(()) => {
                    self.discovery.retry_after.remove(&p.ifindex);
                    changed = true;
                }
                Err(e) => {
                    tracing::warn!(ifindex = p.ifindex, error = %format!("{e:#}"), "attaching a discovered Pod interface failed; retrying in 1 s");
                    self.discovery
                        .retry_after
                        .insert(p.ifindex, now + Duration::from_secs(1));
                }
            }
        }
        self.discovery
            .retry_after
            .retain(|ifindex, _| nb.pods().iter().any(|p| p.ifindex == *ifindex));
        changed
    }

    fn attach(&mut self, ifindex: u32) -> Result<()> {
        let name = netlink::iface_name(ifindex).context("interface gone")?;
        let queues = rx_queues(&name);
        let slot_base = self
            .discovery
            .alloc_slots(queues)
            .with_context(|| format!("{name}: no free AF_XDP socket (raise --max-pod-sockets)"))?;
        let si = SteeredIface {
            name: name.clone(),
            ifindex,
            uplink: false,
            slot_base,
            queues,
        };
        // Sockets first (the program passes packets to the kernel until they are in
        // the redirect map), then the program.
        let opened = self.factory.open(
            &si,
            Side::Pod(0),
            self.discovery.fill_budget,
            &mut self.steering,
        );
        let ports = match opened {
            Ok(p) => p,
            Err(e) => {
                self.discovery.free_slots(slot_base, queues);
                return Err(e);
            }
        };
        match self.steering.attach_iface(&si) {
            Ok(link) => {
                tracing::info!(iface = %name, ifindex, queues, "Pod interface attached");
                self.ports.extend(ports);
                self.discovery
                    .attached
                    .push(DiscoveredPod { steered: si, link });
                self.discovery.attaches += 1;
                Ok(())
            }
            Err(e) => {
                for p in ports {
                    self.close_port(p);
                }
                self.discovery.free_slots(slot_base, queues);
                Err(e)
            }
        }
    }

    fn detach(&mut self, d: DiscoveredPod) {
        tracing::info!(iface = %d.steered.name, ifindex = d.steered.ifindex, "Pod interface detached");
        let si = d.steered.clone();
        self.steering.detach_iface(&si, d.link);
        let mine: Vec<usize> = self
            .ports
            .iter()
            .enumerate()
            .filter(|(_, p)| p.ifindex == si.ifindex && p.side != Side::Uplink)
            .map(|(i, _)| i)
            .collect();
        for i in mine.into_iter().rev() {
            let p = self.ports.remove(i);
            self.close_port(p);
        }
        self.discovery.free_slots(si.slot_base, si.queues);
        self.discovery.detaches += 1;
    }

    /// Closes a socket and takes back every frame it held.
    fn close_port(&mut self, p: Port) {
        let id = p.id;
        drop(p);
        let n = self.pool.reclaim(id, &[]);
        tracing::debug!(socket = id, frames = n, "socket closed, frames reclaimed");
    }

    /// Frames the kernel holds through live sockets.
    fn frames_in_kernel(&self) -> u64 {
        self.ports
            .iter()
            .map(|p| u64::from(p.fill_held) + u64::from(p.in_flight))
            .sum()
    }
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
}

impl LoopTiming {
    fn top(&mut self, now: Instant) {
        if let Some(l) = self.last_top {
            let gap = now.saturating_duration_since(l).saturating_sub(self.slept);
            self.max_gap = self.max_gap.max(gap);
            self.gaps_over_100us += u64::from(gap > Duration::from_micros(100));
            self.gaps_over_1ms += u64::from(gap > Duration::from_millis(1));
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
            ..Default::default()
        };
    }
}

fn forward_loop(
    cfg: &RuntimeConfig,
    io: &mut Io<'_>,
    engine: &mut Engine,
    shared: &SharedNeighbours,
    miss_tx: &mpsc::SyncSender<(u32, u32)>,
    stats_tx: &mpsc::SyncSender<Stats>,
) -> Result<()> {
    let mut rx_buf = vec![FrameDesc::default(); RX_BATCH];
    let mut hashes = [0u32; RX_BATCH];
    let mut cq_buf = vec![FrameDesc::default(); cfg.ring_size as usize];
    let mut pending: Vec<Vec<FrameDesc>> = Vec::new();
    let mut nb: Arc<Neighbours> = shared.get();
    let mut nb_version = shared.version();
    // Egress: the queue-0 socket of each interface.
    let mut egress = io.egress_map(&nb);

    let mut reader = open_state(&cfg.state_file);
    let mut seen_generation = 0u64;
    // What juneau-bgp may announce: our heartbeat and the VIPs steered to us.
    let mut status = DataplaneStatusWriter::create(&cfg.status_file).with_context(|| {
        format!(
            "creating the dataplane status {}",
            cfg.status_file.display()
        )
    })?;
    let mut programmed: Vec<std::net::Ipv4Addr> = Vec::new();
    let mut last_beat = Instant::now();
    // Backend addresses of the table in force (to spot new ones).
    let mut known_backends: std::collections::HashSet<u32> = Default::default();
    let mut last_open_try = Instant::now();

    let mut last_stats = Instant::now();
    let mut last_reconcile = Instant::now();
    let mut last_activity = Instant::now();
    let busy = Duration::from_micros(cfg.busy_poll_us);
    let pollfds_of = |ports: &[Port]| -> Vec<libc::pollfd> {
        ports
            .iter()
            .map(|p| libc::pollfd {
                fd: p.rx.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect()
    };
    let mut pollfds = pollfds_of(&io.ports);
    pending.resize_with(io.ports.len(), || Vec::with_capacity(RX_BATCH * 4));

    let mut timing = LoopTiming::default();
    while !STOP.load(Ordering::Relaxed) {
        let now = Instant::now();
        timing.top(now);
        // The flow table's clock: CLOCK_MONOTONIC, shared with the XDP program and
        // unaffected by a restart of this process.
        let now_ms = monotonic_ms();

        // Control state: one atomic load per iteration; a snapshot only on change.
        if reader.is_none() && now.duration_since(last_open_try) > Duration::from_secs(1) {
            last_open_try = now;
            reader = open_state(&cfg.state_file);
        }
        if let Some(r) = reader.as_mut() {
            let g = r.generation();
            if g != seen_generation && g != 0 {
                match r.snapshot() {
                    Ok(snap) => {
                        let table = ServiceTable::from_snapshot(&snap);
                        let vips: Vec<std::net::Ipv4Addr> = table.vips().collect();
                        if let Err(e) = io.steering.sync(&table) {
                            // E.g. more VIPs than the map holds: keep forwarding what is
                            // steered rather than stop serving every VIP.
                            tracing::error!(error = %e, "updating the steering maps failed; some VIPs may not be steered");
                            // Only VIPs steered before and still wanted are surely in
                            // the map: announce no other.
                            programmed.retain(|v| vips.contains(v));
                        } else {
                            programmed = vips;
                        }
                        tracing::info!(
                            generation = snap.generation,
                            services = table.services().len(),
                            "service table updated"
                        );
                        if let Some(b) = &io.backend_ips {
                            // The resolver finds their interfaces (route look-up).
                            let mut ips: Vec<u32> = table
                                .services()
                                .iter()
                                .flat_map(|s| s.backends.iter().map(|b| u32::from(b.ip)))
                                .collect();
                            ips.sort_unstable();
                            ips.dedup();
                            b.store(Arc::new(ips));
                            let _ = miss_tx.try_send((0, 0));
                        }
                        // Start resolving new backends now rather than on their first
                        // packet. A backend address new to the table is re-resolved even
                        // when the kernel has an entry: a new Pod may reuse the address
                        // (and not the MAC) of a deleted one.
                        let mut reverify = Vec::new();
                        let mut now_backends = std::collections::HashSet::new();
                        for s in table.services() {
                            for b in &s.backends {
                                let ip = u32::from(b.ip);
                                now_backends.insert(ip);
                                if !known_backends.contains(&ip) {
                                    if let Some(r) = nb.route(ip) {
                                        if matches!(nb.side_of(r.ifindex), Some((Side::Pod(_), _)))
                                        {
                                            reverify.push((r.gateway.unwrap_or(ip), r.ifindex));
                                        }
                                    }
                                }
                                if let Resolve::Miss { ip, ifindex } = nb.resolve(ip) {
                                    let _ = miss_tx.try_send((ip, ifindex));
                                }
                            }
                        }
                        known_backends = now_backends;
                        if !reverify.is_empty() {
                            for k in reverify {
                                // Full queue: that backend is resolved on its first miss.
                                let _ = shared.reverify.push(k);
                            }
                            let _ = miss_tx.try_send((0, 0));
                        }
                        engine.set_services(table);
                        seen_generation = g;
                        if let Err(e) = status.publish(snap.generation, programmed.iter().copied())
                        {
                            tracing::error!(error = %e, "writing the dataplane status failed; juneau-bgp keeps the previous VIP set");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the node state failed; keeping the previous table")
                    }
                }
            }
        }
        // Neighbours: one atomic load per iteration. Discovered Pod interfaces follow
        // the table (and are re-checked every second, e.g. to retry a failed attach).
        // Sign of life for juneau-bgp: a clock read and a store, at most every 20 ms
        // (an idle loop wakes at least every `idle_sleep_ms`).
        if now.duration_since(last_beat) >= Duration::from_millis(20) {
            last_beat = now;
            status.heartbeat();
        }
        let v = shared.version();
        let nb_changed = v != nb_version;
        if nb_changed {
            nb_version = v;
            nb = shared.get();
        }
        if nb_changed || now.duration_since(last_reconcile) >= Duration::from_secs(1) {
            last_reconcile = now;
            if io.reconcile_pods(&nb, now) {
                pollfds = pollfds_of(&io.ports);
                pending.resize_with(io.ports.len(), || Vec::with_capacity(RX_BATCH * 4));
            }
            egress = io.egress_map(&nb);
        }

        let mut received = 0usize;
        let mut completed = 0usize;
        let Io {
            pool,
            ports,
            factory,
            ..
        } = &mut *io;
        let umem = factory.umem;
        for p in ports.iter_mut() {
            // Completions back to the free stack.
            // SAFETY: `cq_buf` entries are overwritten with addresses of frames of our
            // UMEM that the kernel has finished transmitting.
            let done = unsafe { p.cq.consume(&mut cq_buf) };
            completed += done;
            p.in_flight = p.in_flight.saturating_sub(done as u32);
            pool.free.extend_from_slice(&cq_buf[..done]);
            // Generous refill: as many frames as the fill ring takes, up to the
            // socket's budget.
            let want = p.fill_budget.saturating_sub(p.fill_held);
            let room = p.fq.nb_free(want.min(pool.free.len() as u32)) as usize;
            let give = room.min(pool.free.len()).min(want as usize);
            if give > 0 {
                let from = pool.free.len() - give;
                // SAFETY: these frames are in no ring and not referenced elsewhere.
                let put = unsafe { p.fq.produce(&pool.free[from..]) };
                pool.take_free_tail(p.id, put);
                p.fill_held += put as u32;
            }
            // RX.
            // SAFETY: `rx_buf` receives descriptors of frames of our UMEM that the kernel
            // filled and handed over.
            let mut n = unsafe { p.rx.consume(&mut rx_buf) };
            if n == 0 && cfg.xsk_busy_poll_budget > 0 {
                crate::busy_poll::poll_rx(p.rx.fd().as_raw_fd());
                // SAFETY: as above.
                n = unsafe { p.rx.consume(&mut rx_buf) };
            }
            received += n;
            p.rx_packets += n as u64;
            p.fill_held = p.fill_held.saturating_sub(n as u32);
            let side = p.side;
            if n > 1 {
                // Pull the batch's flow-table memory into the cache first, so its
                // cache misses overlap instead of stalling each packet in turn.
                for (h, d) in hashes.iter_mut().zip(&rx_buf[..n]) {
                    // SAFETY: as below; this only reads the frame.
                    *h = engine.flow_hash(unsafe { umem.data(d) }.contents());
                }
                std::hint::black_box(engine.warm(&hashes[..n]));
            }
            for d in rx_buf.iter_mut().take(n) {
                // SAFETY: the frame came off the RX ring, so the kernel no longer touches
                // it and nothing else in userspace refers to it until we hand it on.
                let mut data = unsafe { umem.data_mut(d) };
                let verdict = engine.process(data.contents_mut(), side, &nb, now_ms);
                match verdict {
                    Verdict::Tx(out) => {
                        let j = match out {
                            Side::Uplink => Some(0),
                            Side::Pod(k) => egress.get(usize::from(k)).copied().flatten(),
                        };
                        match j {
                            Some(j) => pending[j].push(*d),
                            None => {
                                engine.counters_mut().drop(DropReason::PodIfaceNotAttached);
                                pool.free.push(*d);
                            }
                        }
                    }
                    Verdict::Pass(_) => {
                        engine.counters_mut().drop(DropReason::KernelBound);
                        pool.free.push(*d);
                    }
                    Verdict::Drop(_) | Verdict::Consumed => pool.free.push(*d),
                    Verdict::TxResized(out, len) => {
                        data.cursor().set_pos(usize::from(len));
                        let j = match out {
                            Side::Uplink => Some(0),
                            Side::Pod(k) => egress.get(usize::from(k)).copied().flatten(),
                        };
                        match j {
                            Some(j) => pending[j].push(*d),
                            None => {
                                engine.counters_mut().drop(DropReason::PodIfaceNotAttached);
                                pool.free.push(*d);
                            }
                        }
                    }
                    Verdict::Redirect => {
                        if redirect_encapsulate(engine, &mut data, cfg.redirect_mtu) {
                            pending[0].push(*d);
                        } else {
                            pool.free.push(*d);
                        }
                    }
                }
            }
        }
        send_notices(engine, umem, pool, &mut pending[0]);
        timing.received(received);
        // TX.
        for (j, p) in ports.iter_mut().enumerate() {
            let q = &mut pending[j];
            if !q.is_empty() {
                // SAFETY: frames from our UMEM, now owned by nobody but this queue.
                let sent = unsafe { p.tx.produce(q) };
                pool.hand_over(p.id, &q[..sent]);
                for d in &q[sent..] {
                    engine.counters_mut().drop(DropReason::TxRingFull);
                    pool.free.push(*d);
                }
                engine.counters_mut().tx_packets += sent as u64;
                p.in_flight += sent as u32;
                p.unsent += sent as u32;
                q.clear();
            }
            // Kick policy: copy mode transmits only inside sendto(), at most 32 frames per
            // call. Kick for the frames produced since the last kick, and again only while
            // the TX ring still holds frames the kernel has not taken (a kick cut short by
            // its per-call budget or a busy device); completions of frames already taken
            // arrive without a kick. Zero-copy drivers: kick while any are in flight.
            let queued = cfg.ring_size.saturating_sub(p.tx.nb_free_exact());
            if p.unsent > 0 || queued > 0 || (cfg.zero_copy && p.in_flight > 0) {
                let calls = p.unsent.max(queued).div_ceil(COPY_MODE_TX_BATCH).max(1);
                timing.kicks += u64::from(calls);
                timing.idle_kicks += u64::from(p.unsent == 0);
                for _ in 0..calls {
                    if let Err(e) = p.tx.wakeup() {
                        tracing::debug!(iface = %p.name, error = %e, "TX wakeup failed");
                        break;
                    }
                }
                p.unsent = 0;
            }
        }
        for (ip, ifindex) in engine.missing.take() {
            let _ = miss_tx.try_send((ip, ifindex));
        }
        engine.sweep(now_ms, SWEEP_BUDGET);

        if now.duration_since(last_stats) >= Duration::from_secs(1) {
            last_stats = now;
            let _ = stats_tx.try_send(collect_stats(engine, io, seen_generation, &nb, shared));
            timing.log();
        }

        // Activity: frames received, or TX completions still coming in (a frame the
        // kernel did not take yet is retried on every iteration while we spin).
        if received > 0 || completed > 0 {
            last_activity = now;
        } else if now.duration_since(last_activity) < busy {
            // Nothing arrived: let whatever else is runnable on this core go first. In
            // copy mode that is typically the interface's NAPI (softirq or threaded
            // kthread) that fills our RX rings: spinning on empty rings would take the
            // core from the very work that feeds them. Returns at once when nothing else
            // wants the core.
            std::thread::yield_now();
            timing.yields += 1;
        } else {
            // Idle back-off: sleep until a packet arrives or the timeout passes.
            for pfd in pollfds.iter_mut() {
                pfd.revents = 0;
            }
            let before = Instant::now();
            // SAFETY: `pollfds` is a valid array of pollfd for its length.
            unsafe {
                libc::poll(
                    pollfds.as_mut_ptr(),
                    pollfds.len() as libc::nfds_t,
                    cfg.idle_sleep_ms,
                );
            }
            timing.slept_for(before.elapsed());
            // A socket whose interface vanished reports an error at once; do not spin
            // on it until it is detached.
            if pollfds
                .iter()
                .any(|p| p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0)
            {
                std::thread::sleep(Duration::from_millis(cfg.idle_sleep_ms.max(0) as u64));
            }
        }
    }
    // Final stats so a short-lived run leaves them behind.
    let _ = stats_tx.send(collect_stats(engine, io, seen_generation, &nb, shared));
    Ok(())
}

/// Encapsulates a frame the engine redirects (issue 12) in place, in its whole UMEM
/// frame; `false` (counted) when it does not fit.
fn redirect_encapsulate(
    engine: &mut Engine,
    data: &mut xsk_rs::umem::frame::DataMut<'_>,
    mtu: usize,
) -> bool {
    let (Some(out), Some((node, port))) = (
        engine.take_redirect(),
        engine.redirect().map(|r| (r.node(), r.port())),
    ) else {
        return false;
    };
    let mut c = data.cursor();
    let cap = c.buf_len();
    c.set_pos(cap);
    match crate::redirect_wire::encapsulate(data.contents_mut(), &out, node, port, mtu) {
        Some(n) => {
            data.cursor().set_pos(n);
            true
        }
        None => {
            engine.counters_mut().drop(DropReason::RedirectTooBig);
            false
        }
    }
}

/// Sends the "I own this flow" notices the engine queued, each in a free frame.
fn send_notices(
    engine: &mut Engine,
    umem: &Umem,
    pool: &mut FramePool<FrameDesc>,
    uplink: &mut Vec<FrameDesc>,
) {
    let Some(r) = engine.redirect_mut() else {
        return;
    };
    let (node, port) = (r.node(), r.port());
    for n in r.take_notices() {
        let Some(mut d) = pool.free.pop() else {
            break;
        };
        // SAFETY: a free frame is in no ring and referenced by nothing else.
        let mut data = unsafe { umem.data_mut(&mut d) };
        let mut c = data.cursor();
        let cap = c.buf_len();
        c.set_pos(cap);
        match crate::redirect_wire::build_notice(
            data.contents_mut(),
            &n.macs,
            node,
            n.to,
            port,
            &n.key,
        ) {
            Some(len) => {
                data.cursor().set_pos(len);
                uplink.push(d);
            }
            None => pool.free.push(d),
        }
    }
}

fn collect_stats(
    engine: &Engine,
    io: &Io<'_>,
    generation: u64,
    nb: &Neighbours,
    shared: &SharedNeighbours,
) -> Stats {
    let ports = &io.ports;
    let c = engine.counters();
    let flows = engine.flows();
    let mut st = Stats {
        timestamp: now_unix(),
        generation,
        rx_packets: c.rx_packets,
        tx_packets: c.tx_packets,
        flows: flows.len() as u64,
        flow_capacity: flows.capacity() as u64,
        flow_table_bytes: flows.memory_bytes() as u64,
        half_open_flows: flows.half_open() as u64,
        half_open_max: flows.half_open_max() as u64,
        half_open_evicted: flows.half_open_evicted(),
        flows_restored: c.flows_restored,
        neighbours: nb.neighbour_count() as u64,
        neighbour_requests: shared.requests.load(Ordering::Relaxed),
        umem_frames: io.pool.total() as u64,
        umem_frames_free: io.pool.free.len() as u64,
        umem_frames_in_kernel: io.frames_in_kernel(),
        umem_frames_reclaimed: io.pool.reclaimed,
        pod_ifaces: io
            .discovery
            .attached
            .iter()
            .map(|d| d.steered.name.clone())
            .collect(),
        pod_iface_attaches: io.discovery.attaches,
        pod_iface_detaches: io.discovery.detaches,
        ..Default::default()
    };
    if let Some(r) = engine.redirect() {
        st.redirect_notices_dropped = r.notices_dropped;
        st.redirect_peers = r
            .peer_counters()
            .map(|(a, c)| crate::counters::RedirectPeerStats {
                peer: std::net::Ipv4Addr::from(a).to_string(),
                counters: c,
            })
            .collect();
    }
    let sd = io.steering.drops();
    for r in DropReason::ALL {
        let in_kernel = match r {
            DropReason::PortNotExposed => sd.port_not_exposed,
            DropReason::UnsupportedProtocol => sd.unsupported_protocol,
            _ => 0,
        };
        st.drops
            .insert(r.name().to_string(), c.drops_for(r) + in_kernel);
    }
    for (i, s) in engine.services().services().iter().enumerate() {
        st.services.push(ServiceStats {
            vip: s.frontend.vip.to_string(),
            protocol: s.frontend.protocol.to_string(),
            port: s.frontend.port,
            backends: s.ready,
            draining_backends: s.backends.len() - s.ready,
            counters: c.services.get(i).copied().unwrap_or_default(),
        });
    }
    for p in ports {
        st.rx_packets_per_socket
            .insert(p.name.clone(), p.rx_packets);
        if let Ok(x) = p.rx.fd().xdp_statistics() {
            st.xsk_rx_dropped += x.rx_dropped();
            st.xsk_rx_ring_full += x.rx_ring_full();
            st.xsk_fill_ring_empty += x.rx_fill_ring_empty_descs();
        }
    }
    st
}
