//! The TCP bulk download: a real TCP server in the backend namespace, a client in the
//! client namespace that downloads `bytes` on each of `streams` connections to
//! `VIP:BULK_PORT`, through `juneau` (the real dataplane, its default path) or
//! `nft-dnat` (the same nftables rules as the UDP rows), on the same topology and core.
//!
//! What is measured per run (one path, one stream count, a fresh topology): every byte
//! the client received (checked against the pattern the server sends: a short, long or
//! altered body fails the run), the wall time from the first connect to the last EOF,
//! and over exactly that window the node's forwarding work the way the UDP rows measure
//! it: the path core's busy time from `/proc/stat` (user + system + irq + softirq), the
//! path's own threads beside it. Gbit per CPU-second = bits delivered / 1e9 / (busy share
//! x window). A run is saturated when the path core is >= 95 % busy: the forwarding core
//! is the bottleneck; else the endpoints (one core for server and client) were, and the
//! ratio is refused as for the UDP rows. Ratios juneau / nft-dnat are paired per round.
//!
//! The server and client are threads of this process inside the namespaces (setns),
//! pinned to the endpoint core (the generator's core of the UDP rows) at nice -20; the
//! node's work stays on the path core (see `topology::Ends::Bulk` for how the ends' receive
//! work is kept off it).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub use crate::bulk_data::{markdown, ratios, rows, BulkRatio, BulkRow, BulkRun, Moved};
use crate::cpu::CoreTimes;
use crate::harness;
use crate::plan::{self, Plan, Scenario, INTERRUPTED};
pub use crate::plan::{bulk_expected as expected, BulkPlan, BULK_PATHS as PATHS};
use crate::topology::{Ends, Topology, BACKEND_BULK_PORT, BULK_PORT, VIP};

/// Period of the byte pattern the server sends (a prime, so that no power-of-two
/// misplacement of data lines up with it).
pub const PERIOD: usize = 1_048_573;

/// The byte pattern of every stream: byte `i` is `pattern[i % PERIOD]` (pseudo-random
/// bytes, so a lost, duplicated or misplaced piece of data shows).
pub struct Pattern {
    /// Two periods back to back: any window of up to a period is one slice.
    doubled: Vec<u8>,
}

impl Pattern {
    /// The process-wide pattern (built once: 2 MiB).
    pub fn get() -> &'static Pattern {
        static P: OnceLock<Pattern> = OnceLock::new();
        P.get_or_init(|| {
            let one = juneau_tests::http::pattern(PERIOD);
            let mut doubled = one.clone();
            doubled.extend_from_slice(&one);
            Pattern { doubled }
        })
    }

    /// A memory file holding [`Pattern::doubled`], built once: the server `sendfile`s
    /// from it, so the kernel sends page references instead of copying the body from
    /// userspace (the endpoints' core stays as free as it can for their TCP work).
    fn memfd() -> Result<&'static std::fs::File> {
        static F: OnceLock<std::result::Result<std::fs::File, String>> = OnceLock::new();
        F.get_or_init(|| {
            // SAFETY: a NUL-terminated name; the returned descriptor is owned by the File.
            let fd = unsafe { libc::memfd_create(c"juneau-perf-bulk".as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            f.write_all(&Pattern::get().doubled)
                .map_err(|e| format!("filling the memfd: {e}"))?;
            Ok(f)
        })
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// The stream's bytes from offset `off`, at most a period of them.
    pub fn at(&self, off: u64, len: usize) -> &[u8] {
        let start = (off % PERIOD as u64) as usize;
        &self.doubled[start..start + len.min(PERIOD)]
    }

    /// Checks `got` as the stream's bytes from offset `off`: `Err(offset)` of the first
    /// byte that differs.
    pub fn check(&self, mut off: u64, mut got: &[u8]) -> std::result::Result<(), u64> {
        while !got.is_empty() {
            let want = self.at(off, got.len());
            let n = want.len();
            if want != &got[..n] {
                let i = want.iter().zip(got).position(|(a, b)| a != b).unwrap_or(0);
                return Err(off + i as u64);
            }
            off += n as u64;
            got = &got[n..];
        }
        Ok(())
    }
}

/// Runs `f` on a new thread inside network namespace `ns` (`None`: this one); threads it
/// starts are inside it too.
pub(crate) fn spawn_in<T: Send + 'static>(
    ns: Option<&str>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<Result<T>>> {
    let ns = ns.map(str::to_string);
    Ok(std::thread::spawn(move || -> Result<T> {
        if let Some(ns) = ns {
            let file = std::fs::File::open(format!("/var/run/netns/{ns}"))
                .with_context(|| format!("opening netns {ns}"))?;
            // SAFETY: a valid namespace file descriptor; only this thread changes namespace.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
            if rc != 0 {
                bail!("setns({ns}): {}", std::io::Error::last_os_error());
            }
        }
        Ok(f())
    }))
}

/// Pins the calling thread to `cpu` (if given) and gives it nice -20, as the harness does
/// for the path's threads: on a shared machine, other work yields the core to it.
pub(crate) fn pin_here(cpu: Option<u32>) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    if let Some(cpu) = cpu {
        if let Err(e) = crate::cpu::pin(tid, cpu) {
            tracing::warn!("{e:#}");
        }
    }
    // SAFETY: setpriority on this thread's id, no memory involved.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, -20) };
}

/// Largest body one request may ask for (a bad request cannot make the server send
/// forever).
const MAX_REQUEST: u64 = 1 << 40;
/// Size of one read or write.
const CHUNK: usize = 256 << 10;

/// The bulk server: each connection sends an 8-byte little-endian byte count, the server
/// answers with that many bytes of [`Pattern`], shuts its side down and waits for the
/// client to close. Stops (every thread) on drop.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<Result<Result<()>>>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Bytes written to clients so far.
    pub sent: Arc<AtomicU64>,
}

impl Server {
    /// Listens on `addr` inside `ns` (`None`: this namespace); connection threads run on
    /// `cpu`.
    pub fn start(ns: Option<&str>, addr: SocketAddr, cpu: Option<u32>) -> Result<Server> {
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let sent = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::channel();
        let (s, c, n) = (stop.clone(), conns.clone(), sent.clone());
        let accept = spawn_in(ns, move || -> Result<()> {
            pin_here(cpu);
            let l = match TcpListener::bind(addr) {
                Ok(l) => l,
                Err(e) => {
                    let _ = tx.send(Err(format!("binding {addr}: {e}")));
                    return Ok(());
                }
            };
            let _ = tx.send(l.local_addr().map_err(|e| e.to_string()));
            l.set_nonblocking(true)?;
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((conn, _)) => {
                        let (s, n) = (s.clone(), n.clone());
                        let h = std::thread::spawn(move || {
                            pin_here(cpu);
                            if let Err(e) = serve(conn, &s, &n) {
                                tracing::debug!("bulk server connection: {e:#}");
                            }
                        });
                        let mut v = c.lock().expect("not poisoned");
                        v.retain(|h| !h.is_finished());
                        v.push(h);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
            Ok(())
        })?;
        let addr = rx
            .recv_timeout(Duration::from_secs(10))
            .context("the bulk server did not start")?
            .map_err(anyhow::Error::msg)?;
        Ok(Server {
            addr,
            stop,
            accept: Some(accept),
            conns,
            sent,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        let v = std::mem::take(&mut *self.conns.lock().expect("not poisoned"));
        for h in v {
            let _ = h.join();
        }
    }
}

fn serve(mut conn: TcpStream, stop: &AtomicBool, sent: &AtomicU64) -> Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_millis(200)))?;
    conn.set_write_timeout(Some(Duration::from_millis(200)))?;
    let mut req = [0u8; 8];
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while got < 8 {
        match conn.read(&mut req[got..]) {
            Ok(0) => return Ok(()),
            Ok(n) => got += n,
            Err(e) if retry(&e) && !stop.load(Ordering::Relaxed) && Instant::now() < deadline => {}
            Err(e) => return Err(e).context("reading the request"),
        }
    }
    let want = u64::from_le_bytes(req).min(MAX_REQUEST);
    let file = std::os::fd::AsRawFd::as_raw_fd(Pattern::memfd()?);
    let sock = std::os::fd::AsRawFd::as_raw_fd(&conn);
    let mut off = 0u64;
    while off < want {
        if stop.load(Ordering::Relaxed) {
            bail!("stopped at {off} of {want} bytes");
        }
        let len = (want - off).min(CHUNK as u64) as usize;
        let mut from = (off % PERIOD as u64) as libc::off_t;
        // SAFETY: both descriptors are open for the call; `from` is a valid offset
        // pointer; the file holds two periods, so `from + len` stays inside it.
        let n = unsafe { libc::sendfile(sock, file, &mut from, len) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if retry(&e) {
                continue;
            }
            return Err(e).with_context(|| format!("sending at {off} of {want}"));
        }
        off += n as u64;
        sent.fetch_add(n as u64, Ordering::Relaxed);
    }
    conn.shutdown(Shutdown::Write)?;
    // Wait for the client's close (it has read everything), so that no RST cuts data.
    let mut sink = [0u8; 512];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        match conn.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if retry(&e) => {}
            Err(_) => break,
        }
    }
    Ok(())
}

fn retry(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

/// One measured download: `streams` connections at once to `target`, `bytes_each` on
/// each; repeated (new connections each round) until `min_window` has passed, at least
/// once. Every connection must receive exactly `bytes_each` bytes of the pattern within
/// `timeout` of its round's start.
#[derive(Debug, Clone)]
pub struct DownloadSpec {
    /// The server (VIP and service port).
    pub target: SocketAddr,
    /// Connections at once.
    pub streams: u32,
    /// Bytes on each connection.
    pub bytes_each: u64,
    /// Rounds go on until this much time has passed.
    pub min_window: Duration,
    /// Longest time one round may take.
    pub timeout: Duration,
    /// The core of the client's threads.
    pub cpu: Option<u32>,
    /// Check every byte against the pattern (copied into userspace); else count them
    /// only (`recv` with `MSG_TRUNC`: the kernel discards the data without copying it,
    /// and says how much).
    pub verify: bool,
}

/// Runs `spec` from namespace `ns` (`None`: this one); `probe` is called on the client's
/// thread right before the first connect and right after the last EOF, so that what it
/// reads (CPU counters) covers exactly the transfer. Fails on any short, long or altered
/// body, a connection that fails, a round over its timeout, or Ctrl-C.
pub fn download<T: Send + 'static>(
    ns: Option<&str>,
    spec: &DownloadSpec,
    probe: impl Fn() -> Result<T> + Send + 'static,
) -> Result<(Moved, T, T)> {
    let spec = spec.clone();
    spawn_in(ns, move || -> Result<(Moved, T, T)> {
        pin_here(spec.cpu);
        let _ = Pattern::get();
        let before = probe()?;
        let start = Instant::now();
        let mut moved = Moved::default();
        loop {
            let round_end = Instant::now() + spec.timeout;
            let handles: Vec<_> = (0..spec.streams)
                .map(|_| {
                    let s = spec.clone();
                    std::thread::spawn(move || -> Result<u64> {
                        pin_here(s.cpu);
                        one_stream(&s, round_end)
                    })
                })
                .collect();
            let mut errors = Vec::new();
            for (i, h) in handles.into_iter().enumerate() {
                match h.join() {
                    Ok(Ok(n)) => {
                        moved.downloads += 1;
                        moved.bytes += n;
                    }
                    Ok(Err(e)) => errors.push(format!("connection {i}: {e:#}")),
                    Err(_) => errors.push(format!("connection {i}: its thread panicked")),
                }
            }
            moved.rounds += 1;
            if !errors.is_empty() {
                bail!(
                    "round {} of {} x {} bytes to {}: {}",
                    moved.rounds,
                    spec.streams,
                    spec.bytes_each,
                    spec.target,
                    errors.join("; ")
                );
            }
            if start.elapsed() >= spec.min_window {
                break;
            }
        }
        moved.wall_s = start.elapsed().as_secs_f64();
        let after = probe()?;
        Ok((moved, before, after))
    })?
    .join()
    .map_err(|_| anyhow::anyhow!("the bulk client's thread panicked"))?
    .and_then(|r| r)
}

/// One connection: asks for `bytes_each`, reads and checks until EOF.
pub(crate) fn one_stream(s: &DownloadSpec, deadline: Instant) -> Result<u64> {
    let mut conn = TcpStream::connect_timeout(&s.target, Duration::from_secs(5))
        .with_context(|| format!("connecting to {}", s.target))?;
    conn.set_read_timeout(Some(Duration::from_millis(200)))?;
    conn.write_all(&s.bytes_each.to_le_bytes())?;
    let p = Pattern::get();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    loop {
        if INTERRUPTED.load(Ordering::Relaxed) {
            bail!("interrupted (Ctrl-C) at {off} of {} bytes", s.bytes_each);
        }
        if Instant::now() > deadline {
            bail!(
                "short body: {off} of {} bytes when the round's time ({} s) ran out",
                s.bytes_each,
                s.timeout.as_secs_f64()
            );
        }
        let got = if s.verify {
            conn.read(&mut buf)
        } else {
            // SAFETY: `buf` is valid for CHUNK bytes (MSG_TRUNC does not even write them).
            let n = unsafe {
                libc::recv(
                    std::os::fd::AsRawFd::as_raw_fd(&conn),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_TRUNC,
                )
            };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        };
        match got {
            Ok(0) => break,
            Ok(n) => {
                if off + n as u64 > s.bytes_each {
                    bail!("long body: more than {} bytes", s.bytes_each);
                }
                if s.verify {
                    if let Err(at) = p.check(off, &buf[..n]) {
                        bail!("byte {at} of {} differs from what was sent", s.bytes_each);
                    }
                }
                off += n as u64;
            }
            Err(e) if retry(&e) => {}
            Err(e) => {
                return Err(e).with_context(|| format!("reading at {off} of {}", s.bytes_each))
            }
        }
    }
    if off != s.bytes_each {
        bail!("short body: {off} of {} bytes before EOF", s.bytes_each);
    }
    Ok(off)
}

/// What is read at both ends of the window.
struct Sample {
    path: CoreTimes,
    endpoint: CoreTimes,
    threads_ns: u64,
    endpoint_threads_ns: u64,
}

/// Whether a run was saturated, and why (not): the forwarding core was the bottleneck
/// when it was >= 95 % busy (the UDP rows' bound) while the endpoints' core was not — a
/// TCP sender slows to the slowest stage, and a forwarder that spins on empty rings (the
/// dataplane) shows a full core either way, so a busy path core alone proves nothing
/// when the endpoints' core was full too.
pub fn saturation(path_busy: f64, endpoint_busy: f64) -> (bool, String) {
    let bound = crate::results::SATURATION_CORE_BUSY;
    let (p, e) = (100.0 * path_busy, 100.0 * endpoint_busy);
    if path_busy < bound {
        (
            false,
            format!(
                "NOT saturated: path core {p:.0}% busy (endpoint core {e:.0}%): the forwarding core had room"
            ),
        )
    } else if endpoint_busy >= bound {
        (
            false,
            format!(
                "NOT saturated: path core {p:.0}% busy but the endpoint core too ({e:.0}%): the endpoints may have been the limit"
            ),
        )
    } else {
        (
            true,
            format!("path core {p:.0}% busy, endpoint core {e:.0}%"),
        )
    }
}

/// One run: `sc` (juneau or nft-dnat) at `streams` connections, round `round`, on a
/// fresh topology: a readiness download, one round of full-size downloads with every
/// byte checked, then the measured window (bytes counted, not copied).
pub fn run_once(plan: &Plan, sc: Scenario, streams: u32, round: u32) -> Result<BulkRun> {
    let (ecpu, pcpu) = harness::cpus();
    let tag = format!(
        "bulk-{}-{streams}-r{round}-{}",
        sc.name(),
        std::process::id()
    );
    let TcpBed {
        t,
        mut path,
        server: _server,
        client_napi,
    } = TcpBed::start(plan, sc, &tag)?;
    let mut endpoint_tids = client_napi;
    endpoint_tids.extend(crate::cpu::ksoftirqd(ecpu));
    endpoint_tids.push(std::process::id());
    let tids = harness::pin_path(&t, &path)?;
    let pinned: Vec<(u32, u64)> = harness::path_threads(&t, &path)
        .into_iter()
        .filter_map(|(x, _)| Some((x, harness::thread_run_ns(x)?)))
        .collect();
    let target = SocketAddr::V4(SocketAddrV4::new(VIP, BULK_PORT));
    wait_until_serving(&t, &mut path, target, ecpu)?;
    // As the kernel left the Pod's veth with this path in place (an XDP program on the
    // node's end turns the Pod end's TSO off: the Pod's kernel then cuts its
    // super-segments itself, GSO, before they cross the veth).
    let backend_offloads = offloads(&t.backend, &t.b_if)?;
    let mut spec = DownloadSpec {
        target,
        streams,
        bytes_each: plan.bulk.bytes,
        min_window: Duration::ZERO,
        timeout: plan.bulk.timeout,
        cpu: Some(ecpu),
        verify: true,
    };
    let (verified, _, _) = download(Some(t.client.name()), &spec, || Ok(()))?;
    spec.min_window = plan.duration;
    spec.verify = false;
    let probe_tids = tids.clone();
    let (moved, a, b) = download(Some(t.client.name()), &spec, move || {
        Ok(Sample {
            path: CoreTimes::read(pcpu)?,
            endpoint: CoreTimes::read(ecpu)?,
            threads_ns: crate::cpu::run_time_ns(&probe_tids),
            endpoint_threads_ns: crate::cpu::run_time_ns(&endpoint_tids),
        })
    })?;
    path.check_forwarder()?;
    harness::check_placement(&t, &path, &pinned)?;
    let core = a.path.busy_since(&b.path);
    let wall = moved.wall_s.max(1e-9);
    let path_cpu_s = core.busy * wall;
    let threads_cpu_s = b.threads_ns.saturating_sub(a.threads_ns) as f64 / 1e9;
    let gbit = moved.bytes as f64 * 8.0 / 1e9;
    let endpoint_core = a.endpoint.busy_since(&b.endpoint);
    let (saturated, why) = saturation(core.busy, endpoint_core.busy);
    let dataplane = path.stats_file.clone().map(|f| {
        // The stats file is rewritten about once a second: wait for one after the window.
        let _ = plan::sleep(Duration::from_millis(1200));
        dataplane_figures(&f, path.forwarder_log())
    });
    Ok(BulkRun {
        path: sc.name().to_string(),
        streams,
        round,
        bytes_each: plan.bulk.bytes,
        verified,
        moved,
        gbps: gbit / wall,
        path_core: core,
        endpoint_core,
        path_cpu_s,
        threads_cpu_s,
        endpoint_threads_cpu_s: b.endpoint_threads_ns.saturating_sub(a.endpoint_threads_ns) as f64
            / 1e9,
        gbps_per_cpu_s: if path_cpu_s > 0.0 {
            gbit / path_cpu_s
        } else {
            0.0
        },
        gbps_per_thread_cpu_s: if threads_cpu_s > 0.0 {
            gbit / threads_cpu_s
        } else {
            0.0
        },
        saturated,
        saturation: why,
        backend_offloads,
        dataplane,
    })
}

/// The TCP workloads' bed (the bulk download, new connections): a fresh topology with
/// its ends on the endpoint core, `sc`'s path in the node namespace, the bulk server in
/// the backend namespace, the client veth's NAPI kthreads pinned to the endpoint core.
pub(crate) struct TcpBed {
    pub t: Topology,
    pub path: harness::NodePath,
    pub server: Server,
    /// The client veth's threaded-NAPI kthreads.
    pub client_napi: Vec<u32>,
}

impl TcpBed {
    pub(crate) fn start(plan: &Plan, sc: Scenario, tag: &str) -> Result<TcpBed> {
        let (ecpu, pcpu) = harness::cpus();
        let t = Topology::build_for(Ends::Bulk {
            endpoint_cpu: ecpu,
            path_cpu: pcpu,
        })?;
        let path = harness::start_path(&t, sc, plan, tag)?;
        let server = Server::start(
            Some(t.backend.name()),
            SocketAddr::from(([0, 0, 0, 0], BACKEND_BULK_PORT)),
            Some(ecpu),
        )?;
        // The client's receive work (its veth's NAPI kthread) on the endpoint core.
        let client_napi = crate::cpu::napi_threads(&t.c_if);
        if client_napi.is_empty() {
            bail!("no threaded-NAPI kthread for the client's {}", t.c_if);
        }
        for &tid in &client_napi {
            crate::cpu::pin(tid, ecpu)?;
            crate::cpu::boost(tid)?;
        }
        Ok(TcpBed {
            t,
            path,
            server,
            client_napi,
        })
    }
}

/// TSO, GSO and tx checksum offload of `iface` as `ethtool -k` reports them, e.g.
/// `tso off, gso on, tx-csum on`.
fn offloads(ns: &juneau_tests::netns::Netns, iface: &str) -> Result<String> {
    let out = ns.exec(&["ethtool", "-k", iface])?;
    Ok(parse_offloads(&out))
}

fn parse_offloads(ethtool_k: &str) -> String {
    [
        ("tcp-segmentation-offload:", "tso"),
        ("generic-segmentation-offload:", "gso"),
        ("tx-checksumming:", "tx-csum"),
    ]
    .iter()
    .map(|(key, short)| {
        let v = ethtool_k
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .unwrap_or("?");
        format!("{short} {v}")
    })
    .collect::<Vec<_>>()
    .join(", ")
}

/// Downloads 64 KiB until one succeeds (a forwarder still starting is not measured), at
/// most 30 s.
pub(crate) fn wait_until_serving(
    t: &Topology,
    path: &mut harness::NodePath,
    target: SocketAddr,
    cpu: u32,
) -> Result<()> {
    let spec = DownloadSpec {
        target,
        streams: 1,
        bytes_each: 64 << 10,
        min_window: Duration::ZERO,
        timeout: Duration::from_secs(2),
        cpu: Some(cpu),
        verify: true,
    };
    let start = Instant::now();
    loop {
        plan::check_interrupt()?;
        path.check_forwarder()?;
        match download(Some(t.client.name()), &spec, || Ok(())) {
            Ok(_) => return Ok(()),
            Err(e) if start.elapsed() > Duration::from_secs(30) => {
                return Err(e).context("no download through the VIP within 30 s")
            }
            Err(_) => plan::sleep(Duration::from_millis(200))?,
        }
    }
}

/// The dataplane's counters that say where a bulk run's packets went: from its stats
/// file (`segmented`, `segments`, RX/TX, the fast path's packets, every non-zero drop
/// reason) and the totals of its `loop timing` log lines (iterations, empty RX batches,
/// yields, sleeps: how much of the loop's time found nothing to do).
pub(crate) fn dataplane_figures(
    stats: &std::path::Path,
    log: Option<&std::path::Path>,
) -> serde_json::Value {
    let v: serde_json::Value = std::fs::read_to_string(stats)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null);
    let pick = |k: &str| v.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let drops: serde_json::Map<String, serde_json::Value> = v
        .get("drops")
        .and_then(|d| d.as_object())
        .map(|d| {
            d.iter()
                .filter(|(_, x)| x.as_u64().unwrap_or(0) > 0)
                .map(|(k, x)| (k.clone(), x.clone()))
                .collect()
        })
        .unwrap_or_default();
    let mut m = serde_json::json!({
        "rx_packets": pick("rx_packets"),
        "tx_packets": pick("tx_packets"),
        "segmented": pick("segmented"),
        "segments": pick("segments"),
        "xdp_fast_packets": pick("xdp_fast_packets"),
        "xdp_fast_replies": pick("xdp_fast_replies"),
        "xsk_rx_dropped": pick("xsk_rx_dropped"),
        "drops": drops,
    });
    if let Some(text) = log.and_then(|p| std::fs::read_to_string(p).ok()) {
        m["loop"] = loop_totals(&text);
    }
    m
}

/// Sums the fields of every `loop timing` line of a dataplane log.
pub fn loop_totals(log: &str) -> serde_json::Value {
    const KEYS: [&str; 7] = [
        "iterations",
        "rx_batches_empty",
        "rx_batches_1_8",
        "rx_batches_9_32",
        "rx_batches_33_64",
        "yields",
        "sleeps",
    ];
    let mut sums = [0u64; KEYS.len()];
    let mut lines = 0u64;
    for l in log.lines().filter(|l| l.contains("loop timing")) {
        lines += 1;
        // tracing's fmt writes `key=value`, perhaps with colour codes around the key.
        for tok in strip_ansi(l).split_whitespace() {
            if let Some((k, v)) = tok.split_once('=') {
                if let (Some(i), Ok(v)) = (KEYS.iter().position(|x| *x == k), v.parse::<u64>()) {
                    sums[i] += v;
                }
            }
        }
    }
    let mut m = serde_json::Map::new();
    m.insert("seconds".into(), lines.into());
    for (k, v) in KEYS.iter().zip(sums) {
        m.insert((*k).into(), v.into());
    }
    serde_json::Value::Object(m)
}

/// `s` without ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_check_finds_the_first_wrong_byte_across_periods() {
        let p = Pattern::get();
        let mut body = Vec::new();
        let mut off = 0u64;
        while body.len() < 3 * PERIOD + 17 {
            let piece = p.at(off, 70_000);
            body.extend_from_slice(piece);
            off += piece.len() as u64;
        }
        assert_eq!(p.check(0, &body), Ok(()));
        assert_eq!(p.check(5, &body[5..]), Ok(()));
        // A piece misplaced by one segment.
        let mut bad = body.clone();
        bad.copy_within(2_000_000..2_001_448, 2_001_448);
        assert_eq!(p.check(0, &bad), Err(2_001_448));
        assert!(p.check(1, &body[..10]).is_err());
    }

    fn ephemeral_server() -> Server {
        Server::start(None, "127.0.0.1:0".parse().unwrap(), None).unwrap()
    }

    #[test]
    fn a_download_counts_and_checks_every_byte_of_every_stream() {
        let s = ephemeral_server();
        let spec = DownloadSpec {
            target: s.addr(),
            streams: 3,
            bytes_each: 3 << 20,
            min_window: Duration::ZERO,
            timeout: Duration::from_secs(30),
            cpu: None,
            verify: true,
        };
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        let (moved, a, b) =
            download(None, &spec, move || Ok(c.fetch_add(1, Ordering::SeqCst))).unwrap();
        assert_eq!(
            (moved.rounds, moved.downloads, moved.bytes),
            (1, 3, 9 << 20)
        );
        assert!(moved.wall_s > 0.0);
        assert_eq!((a, b), (0, 1), "probed once before and once after");
        assert_eq!(s.sent.load(Ordering::Relaxed), 9 << 20);
    }

    #[test]
    fn a_short_or_altered_body_fails_the_download() {
        // A server that sends one byte less than asked, then one with a wrong byte.
        for (cut, flip) in [(1u64, false), (0, true)] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let h = std::thread::spawn(move || {
                let (mut c, _) = l.accept().unwrap();
                let mut req = [0u8; 8];
                c.read_exact(&mut req).unwrap();
                let n = u64::from_le_bytes(req) - cut;
                let mut body = Pattern::get().at(0, n as usize).to_vec();
                if flip {
                    body[1234] ^= 1;
                }
                c.write_all(&body).unwrap();
            });
            let spec = DownloadSpec {
                target: addr,
                streams: 1,
                bytes_each: 100_000,
                min_window: Duration::ZERO,
                timeout: Duration::from_secs(10),
                cpu: None,
                verify: true,
            };
            let e = format!("{:#}", download(None, &spec, || Ok(())).unwrap_err());
            if flip {
                assert!(e.contains("byte 1234 of 100000 differs"), "{e}");
            } else {
                assert!(e.contains("short body: 99999 of 100000"), "{e}");
            }
            h.join().unwrap();
        }
    }

    #[test]
    fn a_count_only_download_counts_every_byte_without_copying() {
        let s = ephemeral_server();
        let spec = DownloadSpec {
            target: s.addr(),
            streams: 2,
            bytes_each: (5 << 20) + 3,
            min_window: Duration::from_millis(50),
            timeout: Duration::from_secs(30),
            cpu: None,
            verify: false,
        };
        let (moved, _, _) = download(None, &spec, || Ok(())).unwrap();
        assert!(moved.rounds >= 1);
        assert_eq!(moved.downloads, 2 * u64::from(moved.rounds));
        assert_eq!(moved.bytes, moved.downloads * ((5 << 20) + 3));
        assert!(moved.wall_s >= 0.05, "{moved:?}");
    }

    #[test]
    fn saturated_only_when_the_path_core_is_full_and_the_endpoints_are_not() {
        assert!(saturation(0.99, 0.70).0);
        let (sat, why) = saturation(0.40, 0.99);
        assert!(!sat && why.contains("forwarding core had room"), "{why}");
        let (sat, why) = saturation(1.0, 0.97);
        assert!(
            !sat && why.contains("endpoints may have been the limit"),
            "{why}"
        );
    }

    #[test]
    fn offloads_are_read_from_ethtool() {
        let k = "Features for x:\nrx-checksumming: on\ntx-checksumming: on\n\ttx-checksum-ipv4: off [fixed]\ntcp-segmentation-offload: off\n\ttx-tcp-segmentation: off\ngeneric-segmentation-offload: on\n";
        assert_eq!(parse_offloads(k), "tso off, gso on, tx-csum on");
    }

    fn run(path: &str, streams: u32, round: u32, gbps: f64, per_cpu: f64, sat: bool) -> BulkRun {
        BulkRun {
            path: path.into(),
            streams,
            round,
            gbps,
            gbps_per_cpu_s: per_cpu,
            saturated: sat,
            ..Default::default()
        }
    }

    #[test]
    fn ratios_are_paired_per_round_and_refused_without_saturation() {
        let runs = vec![
            run("juneau", 1, 0, 2.0, 2.0, true),
            run("nft-dnat", 1, 0, 4.0, 8.0, true),
            run("juneau", 1, 1, 1.0, 1.0, true),
            run("nft-dnat", 1, 1, 1.0, 4.0, true),
            run("juneau", 1, 2, 3.0, 3.0, true),
            run("nft-dnat", 1, 2, 3.0, 6.0, true),
            run("nft-dnat", 16, 0, 9.0, 30.0, false),
            run("juneau", 16, 0, 3.0, 3.0, true),
        ];
        let r = rows(&runs);
        assert_eq!(
            r.iter()
                .map(|x| (x.name.as_str(), x.path.as_str()))
                .collect::<Vec<_>>(),
            [
                ("tcp-bulk-1", "juneau"),
                ("tcp-bulk-1", "nft-dnat"),
                ("tcp-bulk-16", "nft-dnat"),
                ("tcp-bulk-16", "juneau")
            ]
        );
        assert_eq!(r[0].median_gbps, 2.0);
        let q = ratios(&r);
        assert_eq!(q.len(), 2);
        // Per round: 0.25, 0.25, 0.5 (per CPU-second); 0.5, 1.0, 1.0 (Gbit/s).
        assert_eq!(
            (q[0].rounds, q[0].per_cpu_s, q[0].gbps, q[0].refused.clone()),
            (3, Some(0.25), Some(1.0), None)
        );
        assert_eq!(q[1].per_cpu_s, None);
        assert_eq!(q[1].per_cpu_s_as_measured, Some(0.1));
        assert!(
            q[1].refused
                .as_deref()
                .unwrap()
                .contains("tcp-bulk-16 nft-dnat (0 of 1 runs saturated)"),
            "{q:?}"
        );
        let md = markdown(&r, &q);
        assert!(
            md.contains("| tcp-bulk-1 | 3 | 1.00 | 0.25 | >= 1.0 |"),
            "{md}"
        );
        assert!(
            md.contains("| tcp-bulk-16 | 1 | 0.33 | refused (as measured 0.10) |"),
            "{md}"
        );
    }

    #[test]
    fn loop_timing_lines_are_summed() {
        let log = "2026-12-03T01:00:00Z DEBUG juneau_dataplane::runtime: loop timing \u{1b}[3miterations\u{1b}[0m\u{1b}[2m=\u{1b}[0m10 max_gap_us=5 rx_batches_empty=4 rx_batches_1_8=6 yields=3 sleeps=1\n\
                   other line iterations=1000\n\
                   2026-12-03T01:00:01Z DEBUG juneau_dataplane::runtime: loop timing iterations=20 rx_batches_empty=5 yields=2 sleeps=0\n";
        let t = loop_totals(log);
        assert_eq!(t["seconds"], 2);
        assert_eq!(t["iterations"], 30);
        assert_eq!(t["rx_batches_empty"], 9);
        assert_eq!(t["yields"], 5);
        assert_eq!(t["sleeps"], 1);
    }
}
