//! The AF_XDP forwarding loop: sockets, shared UMEM, rings, state and neighbour
//! refresh, stats. Everything per packet is delegated to [`Engine`].
//!
//! One AF_XDP socket per interface (queue 0; veth has one queue), all sharing one UMEM,
//! so a frame received on the uplink is rewritten in place and handed to a Pod
//! interface's TX ring without a copy in userspace. Frames cycle through a free stack:
//! free → fill ring → RX → (TX → completion ring) → free.
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

use anyhow::{anyhow, bail, ensure, Context, Result};
use juneau_control::shm::NodeStateReader;
use xsk_rs::config::{
    BindFlags, FrameSize, Interface, LibxdpFlags, QueueSize, SocketConfig, UmemConfig,
};
use xsk_rs::{CompQueue, FillQueue, FrameDesc, RxQueue, Socket, TxQueue, Umem};

use crate::counters::{DropReason, ServiceStats, Stats};
use crate::engine::{Engine, EngineConfig, Verdict};
use crate::neigh::{Iface, Neighbours, Resolve, Side};
use crate::netlink::{self, Netlink, SharedNeighbours};
use crate::services::ServiceTable;
use crate::steering::{SteeredIface, Steering};

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
    /// JSON stats file, rewritten atomically about once a second.
    pub stats_file: Option<PathBuf>,
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
}

struct Port {
    name: String,
    side: Side,
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

/// Runs the dataplane until SIGINT/SIGTERM.
pub fn run(cfg: RuntimeConfig) -> Result<()> {
    install_signal_handlers();
    let uplink = netlink::iface(&cfg.uplink).with_context(|| format!("uplink {}", cfg.uplink))?;
    let mut pods = Vec::new();
    for name in &cfg.pod_ifaces {
        pods.push((
            name.clone(),
            netlink::iface(name).with_context(|| format!("Pod interface {name}"))?,
        ));
    }
    if pods.len() > 255 {
        bail!("at most 255 Pod interfaces are supported");
    }
    let pod_ifaces: Vec<Iface> = pods.iter().map(|p| p.1).collect();

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
        let (shared, stop, pods) = (shared.clone(), stop_resolver.clone(), pod_ifaces.clone());
        std::thread::Builder::new()
            .name("neighbours".into())
            .spawn(move || {
                netlink::run_resolver(
                    nl,
                    uplink,
                    pods,
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
    ensure!(
        slot <= 4096,
        "at most 4096 AF_XDP sockets (interfaces x RX queues) are supported"
    );

    // XDP steering, then sockets.
    let mut steering = Steering::attach(&steered, cfg.generic_xdp)?;
    for (name, mode) in &steering.modes {
        tracing::info!(iface = %name, mode, "XDP steering attached");
    }
    let n_ports = slot as usize;
    let total_frames = cfg.frames_per_iface.max(2 * cfg.ring_size) * n_ports as u32;
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
    let mut ports = Vec::with_capacity(n_ports);
    for (si, side) in steered.iter().zip(&sides) {
        let name = &si.name;
        let ifname: Interface = name
            .parse()
            .map_err(|e| anyhow!("interface name {name}: {e:?}"))?;
        for q in 0..si.queues {
            // SAFETY: the UMEM outlives the socket (both live until `run` returns, sockets
            // are dropped first) and every frame handed to its rings comes from this UMEM.
            let (tx, rx, rings) = unsafe { Socket::new(sock_cfg, &umem, &ifname, q) }
                .map_err(|e| anyhow!("creating the AF_XDP socket on {name} queue {q}: {e}"))?;
            let (fq, cq) = rings.ok_or_else(|| {
                anyhow!("{name} queue {q}: no fill/completion ring for the socket")
            })?;
            steering.register_socket(si.slot_base + q, rx.fd())?;
            ports.push(Port {
                name: format!("{name}/{q}"),
                side: *side,
                tx,
                rx,
                fq,
                cq,
                in_flight: 0,
                unsent: 0,
                rx_packets: 0,
            });
        }
    }
    tracing::info!(
        uplink = %cfg.uplink,
        pods = ?cfg.pod_ifaces,
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

    let result = forward_loop(
        &cfg,
        &umem,
        descs,
        &mut ports,
        &mut steering,
        &shared,
        &miss_tx,
        &stats_tx,
    );
    drop(stats_tx);
    let _ = stats_writer.join();
    stop_resolver.store(true, Ordering::Relaxed);
    drop(miss_tx);
    let _ = resolver.join();
    drop(ports);
    drop(steering);
    tracing::info!("juneau-dataplane stopped; XDP programs detached");
    result
}

#[allow(clippy::too_many_arguments)]
fn forward_loop(
    cfg: &RuntimeConfig,
    umem: &Umem,
    descs: Vec<FrameDesc>,
    ports: &mut [Port],
    steering: &mut Steering,
    shared: &SharedNeighbours,
    miss_tx: &mpsc::SyncSender<(u32, u32)>,
    stats_tx: &mpsc::SyncSender<Stats>,
) -> Result<()> {
    let n_ports = ports.len();
    // Egress: the queue-0 socket of each interface.
    let mut tx_port_of_pod: Vec<usize> = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        if let Side::Pod(k) = p.side {
            if usize::from(k) == tx_port_of_pod.len() {
                tx_port_of_pod.push(i);
            }
        }
    }
    let mut engine = Engine::new(cfg.engine);
    let mut free: Vec<FrameDesc> = descs;
    let mut rx_buf = vec![FrameDesc::default(); RX_BATCH];
    let mut hashes = [0u32; RX_BATCH];
    let mut cq_buf = vec![FrameDesc::default(); cfg.ring_size as usize];
    let mut pending: Vec<Vec<FrameDesc>> = (0..n_ports)
        .map(|_| Vec::with_capacity(RX_BATCH * n_ports))
        .collect();
    let mut nb: Arc<Neighbours> = shared.get();
    let mut nb_version = shared.version();

    let mut reader = open_state(&cfg.state_file);
    let mut seen_generation = 0u64;
    let mut last_open_try = Instant::now();

    let start = Instant::now();
    let mut last_stats = Instant::now();
    let mut last_activity = Instant::now();
    let busy = Duration::from_micros(cfg.busy_poll_us);
    let mut pollfds: Vec<libc::pollfd> = ports
        .iter()
        .map(|p| libc::pollfd {
            fd: p.rx.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();

    while !STOP.load(Ordering::Relaxed) {
        let now = Instant::now();
        let now_ms = now.duration_since(start).as_millis() as u64;

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
                        if let Err(e) = steering.sync(&table) {
                            // E.g. more VIPs than the map holds: keep forwarding what is
                            // steered rather than stop serving every VIP.
                            tracing::error!(error = %e, "updating the steering maps failed; some VIPs may not be steered");
                        }
                        tracing::info!(
                            generation = snap.generation,
                            services = table.services().len(),
                            "service table updated"
                        );
                        // Start resolving new backends now rather than on their first packet.
                        for s in table.services() {
                            for b in &s.backends {
                                if let Resolve::Miss { ip, ifindex } = nb.resolve(u32::from(b.ip)) {
                                    let _ = miss_tx.try_send((ip, ifindex));
                                }
                            }
                        }
                        engine.set_services(table);
                        seen_generation = g;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the node state failed; keeping the previous table")
                    }
                }
            }
        }
        // Neighbours: one atomic load per iteration.
        let v = shared.version();
        if v != nb_version {
            nb_version = v;
            nb = shared.get();
        }

        let mut received = 0usize;
        let mut completed = 0usize;
        for p in ports.iter_mut() {
            // Completions back to the free stack.
            // SAFETY: `cq_buf` entries are overwritten with addresses of frames of our
            // UMEM that the kernel has finished transmitting.
            let done = unsafe { p.cq.consume(&mut cq_buf) };
            completed += done;
            p.in_flight = p.in_flight.saturating_sub(done as u32);
            free.extend_from_slice(&cq_buf[..done]);
            // Generous refill: as many frames as the fill ring takes.
            let room = p.fq.nb_free(free.len() as u32) as usize;
            let give = room.min(free.len());
            if give > 0 {
                let from = free.len() - give;
                // SAFETY: these frames are in no ring and not referenced elsewhere.
                let put = unsafe { p.fq.produce(&free[from..]) };
                free.truncate(free.len() - put);
            }
            // RX.
            // SAFETY: `rx_buf` receives descriptors of frames of our UMEM that the kernel
            // filled and handed over.
            let n = unsafe { p.rx.consume(&mut rx_buf) };
            received += n;
            p.rx_packets += n as u64;
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
                            Side::Uplink => 0,
                            Side::Pod(k) => tx_port_of_pod[usize::from(k)],
                        };
                        pending[j].push(*d);
                    }
                    Verdict::Pass(_) => {
                        engine.counters_mut().drop(DropReason::KernelBound);
                        free.push(*d);
                    }
                    Verdict::Drop(_) => free.push(*d),
                }
            }
        }
        // TX.
        for (j, p) in ports.iter_mut().enumerate() {
            let q = &mut pending[j];
            if !q.is_empty() {
                // SAFETY: frames from our UMEM, now owned by nobody but this queue.
                let sent = unsafe { p.tx.produce(q) };
                for d in &q[sent..] {
                    engine.counters_mut().drop(DropReason::TxRingFull);
                    free.push(*d);
                }
                engine.counters_mut().tx_packets += sent as u64;
                p.in_flight += sent as u32;
                p.unsent += sent as u32;
                q.clear();
            }
            if p.in_flight > 0 {
                // Copy mode transmits at most 32 frames per sendto().
                let calls = p.unsent.div_ceil(COPY_MODE_TX_BATCH).max(1);
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
            let _ = stats_tx.try_send(collect_stats(&engine, ports, seen_generation, &nb, shared));
        }

        // Activity: frames received, or TX completions still coming in (a frame the
        // kernel did not take yet is retried on every iteration while we spin).
        if received > 0 || completed > 0 {
            last_activity = now;
        } else if now.duration_since(last_activity) >= busy {
            // Idle back-off: sleep until a packet arrives or the timeout passes.
            for pfd in pollfds.iter_mut() {
                pfd.revents = 0;
            }
            // SAFETY: `pollfds` is a valid array of pollfd for its length.
            unsafe {
                libc::poll(
                    pollfds.as_mut_ptr(),
                    pollfds.len() as libc::nfds_t,
                    cfg.idle_sleep_ms,
                );
            }
        }
    }
    // Final stats so a short-lived run leaves them behind.
    let _ = stats_tx.send(collect_stats(&engine, ports, seen_generation, &nb, shared));
    Ok(())
}

fn collect_stats(
    engine: &Engine,
    ports: &[Port],
    generation: u64,
    nb: &Neighbours,
    shared: &SharedNeighbours,
) -> Stats {
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
        neighbours: nb.neighbour_count() as u64,
        neighbour_requests: shared.requests.load(Ordering::Relaxed),
        ..Default::default()
    };
    for r in DropReason::ALL {
        st.drops.insert(r.name().to_string(), c.drops_for(r));
    }
    for (i, s) in engine.services().services().iter().enumerate() {
        st.services.push(ServiceStats {
            vip: s.frontend.vip.to_string(),
            protocol: s.frontend.protocol.to_string(),
            port: s.frontend.port,
            backends: s.backends.len(),
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
