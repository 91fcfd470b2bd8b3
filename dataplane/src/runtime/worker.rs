//! The forwarding worker: one type, N of them, each on its own thread, doing nothing
//! but forwarding. Every worker has its own UMEM, frame pool, sockets (the RX queues `q`
//! with `q % workers == worker` of every interface, and the discovered Pod interfaces
//! the node thread hands it), TX queues and flow table; between batches it picks up what
//! others publish — the service table ([`Published`]), the neighbours, socket changes
//! ([`PortChange`]) — and once a second it sends its statistics. Control-state sync,
//! interface attach and process-wide statistics run on the node thread
//! (`super::node`).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use xsk_rs::{FrameDesc, Umem};

use super::{
    large, now_unix, LoopTiming, Port, RuntimeConfig, StatsSender, COPY_MODE_TX_BATCH, RX_BATCH,
    STOP,
};
use crate::counters::{DropReason, RedirectPeerStats, ServiceStats, Stats};
use crate::engine::{Engine, Verdict};
use crate::frames::FramePool;
use crate::neigh::{Neighbours, Side};
use crate::netlink::SharedNeighbours;
use crate::privileges::Forwarding;
use crate::region::monotonic_ms;
use crate::services::ServiceTable;

/// A worker's per-iteration buffers.
pub(super) struct Bufs {
    rx: Vec<FrameDesc>,
    hashes: [u32; RX_BATCH],
    cq: Vec<FrameDesc>,
    /// Frames to transmit, by socket (index into the worker's ports).
    pub pending: Vec<Vec<FrameDesc>>,
    /// The largest frame each socket's interface takes (refreshed every pass).
    limits: Vec<usize>,
    /// A multi-buffer or oversized packet, gathered contiguously.
    gathered: Vec<u8>,
    /// A piece of a cut packet, before it is spread over frames.
    piece: Vec<u8>,
    /// The node's source addresses for ICMP errors to Pods.
    sources: large::NodeSources,
}

impl Bufs {
    pub fn new(ring_size: u32, sockets: usize) -> Self {
        let mut pending = Vec::new();
        pending.resize_with(sockets, || Vec::with_capacity(RX_BATCH * 4));
        Bufs {
            rx: vec![FrameDesc::default(); RX_BATCH],
            hashes: [0; RX_BATCH],
            cq: vec![FrameDesc::default(); ring_size as usize],
            pending,
            limits: Vec::new(),
            gathered: vec![0; super::large::GATHER_MAX],
            piece: vec![0; super::large::GATHER_MAX],
            sources: large::NodeSources::default(),
        }
    }

    /// Per-socket buffers for `sockets` sockets, after Pod interfaces were attached or
    /// detached (between passes, when every per-socket buffer is empty).
    pub fn fit(&mut self, sockets: usize) {
        self.pending
            .resize_with(sockets, || Vec::with_capacity(RX_BATCH * 4));
    }
}

/// What a worker's rings need per batch.
pub(super) struct Rings<'p, 'u> {
    pub ports: &'p mut [Port],
    pub pool: &'p mut FramePool<FrameDesc>,
    pub umem: &'u Umem,
}

/// One pass over a worker's rings — RX and the engine's verdicts, "I own this flow"
/// notices, TX, neighbour requests, a clock-paced sweep of its own flow table. Returns the
/// frames received and completed.
#[allow(clippy::too_many_arguments)]
pub(super) fn step(
    r: &mut Rings<'_, '_>,
    engine: &mut Engine,
    nb: &Neighbours,
    egress: &[Option<usize>],
    b: &mut Bufs,
    now_ms: u64,
    cfg: &RuntimeConfig,
    timing: &mut LoopTiming,
    miss_tx: &crate::netlink::MissSender,
) -> (usize, usize) {
    let (received, completed) = receive(r, engine, nb, egress, b, now_ms, cfg);
    send_notices(engine, r.umem, r.pool, &mut b.pending[0]);
    timing.received(received);
    transmit(r, engine, b, cfg, timing);
    for (ip, ifindex) in engine.missing.take() {
        let _ = miss_tx.try_send(crate::netlink::miss4(ip, ifindex));
    }
    for (ip, ifindex) in engine.take_missing6() {
        let _ = miss_tx.try_send((std::net::Ipv6Addr::from(ip).into(), ifindex));
    }
    engine.sweep_paced(now_ms);
    (received, completed)
}

/// Completions back to the free stack, fill-ring refill, then RX and the engine's
/// verdict for every socket. Returns the frames received and completed.
fn receive(
    r: &mut Rings<'_, '_>,
    engine: &mut Engine,
    nb: &Neighbours,
    egress: &[Option<usize>],
    b: &mut Bufs,
    now_ms: u64,
    cfg: &RuntimeConfig,
) -> (usize, usize) {
    let mtu = cfg.redirect_mtu;
    let (mut received, mut completed) = (0, 0);
    let umem = r.umem;
    b.limits.clear();
    b.limits.extend(r.ports.iter().map(|p| p.max_frame));
    for p in r.ports.iter_mut() {
        completed += refill(p, r.pool, &mut b.cq);
        // SAFETY: `rx` receives descriptors of frames of our UMEM that the kernel filled
        // and handed over.
        let mut n = unsafe { p.rx.consume(&mut b.rx) };
        if n == 0 && cfg.xsk_busy_poll_budget > 0 {
            crate::busy_poll::poll_rx(p.rx.fd().as_raw_fd());
            // SAFETY: as above.
            n = unsafe { p.rx.consume(&mut b.rx) };
        }
        received += n;
        p.rx_packets += n as u64;
        p.fill_held = p.fill_held.saturating_sub(n as u32);
        if n > 1 {
            // Pull the batch's flow-table memory into the cache first, so its cache
            // misses overlap instead of stalling each packet in turn.
            for (h, d) in b.hashes.iter_mut().zip(&b.rx[..n]) {
                // SAFETY: as below; this only reads the frame.
                *h = engine.flow_hash(unsafe { umem.data(d) }.contents());
            }
            std::hint::black_box(engine.warm(&b.hashes[..n]));
        }
        let mut out = large::Out {
            pool: r.pool,
            umem,
            pending: &mut b.pending,
            limits: &b.limits,
            scratch: &mut b.piece,
            nb,
            egress,
            sources: &mut b.sources,
        };
        for d in b.rx.iter_mut().take(n) {
            if !p.chain.is_empty() || d.options() & large::XDP_PKT_CONTD != 0 {
                p.chain.push(*d);
                if d.options() & large::XDP_PKT_CONTD == 0 {
                    let buf = &mut b.gathered;
                    match large::gather(&mut p.chain, umem, out.pool, buf) {
                        Some(len) => {
                            let pkt = &mut buf[..len];
                            large::chain(engine, pkt, p.side, nb, egress, now_ms, &mut out)
                        }
                        None => engine.counters_mut().drop(DropReason::TooBig),
                    }
                }
                continue;
            }
            // SAFETY: the frame came off the RX ring, so the kernel no longer touches it
            // and nothing else in userspace refers to it until we hand it on.
            let mut data = unsafe { umem.data_mut(d) };
            let verdict = engine.process(data.contents_mut(), p.side, nb, now_ms);
            let to = dispatch(engine, verdict, &mut data, egress, mtu);
            match to {
                Some(j) if data.contents().len() > out.limits[j] => {
                    let len = data.contents().len();
                    b.gathered[..len].copy_from_slice(data.contents());
                    out.pool.free.push(*d);
                    large::emit(engine, &b.gathered[..len], j, now_ms, &mut out);
                }
                Some(j) => out.pending[j].push(*d),
                None => out.pool.free.push(*d),
            }
        }
        if engine.has_released() {
            // Early IPv4 fragments released by their first fragment (cold).
            for (f, side) in engine.take_released() {
                if let Some(j) = socket_of(engine, side, egress) {
                    large::emit(engine, &f, j, now_ms, &mut out);
                }
            }
        }
    }
    (received, completed)
}

/// Completions of one socket back to the free stack, and a generous refill of its fill
/// ring (as many frames as it takes, up to its budget). Returns the completions.
fn refill(p: &mut Port, pool: &mut FramePool<FrameDesc>, cq: &mut [FrameDesc]) -> usize {
    // SAFETY: `cq` entries are overwritten with addresses of frames of our UMEM that the
    // kernel has finished transmitting.
    let done = unsafe { p.cq.consume(cq) };
    p.in_flight = p.in_flight.saturating_sub(done as u32);
    pool.free.extend_from_slice(&cq[..done]);
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
    done
}

/// The socket a verdict sends the frame out of (index into the worker's ports; the
/// uplink socket is 0), or `None` when the frame goes back to the free stack (counted).
fn dispatch(
    engine: &mut Engine,
    verdict: Verdict,
    data: &mut xsk_rs::umem::frame::DataMut<'_>,
    egress: &[Option<usize>],
    mtu: usize,
) -> Option<usize> {
    let out = match verdict {
        Verdict::Tx(out) => out,
        Verdict::TxResized(out, len) => {
            data.cursor().set_pos(usize::from(len));
            out
        }
        Verdict::Pass(_) => {
            engine.counters_mut().drop(DropReason::KernelBound);
            return None;
        }
        Verdict::Drop(_) | Verdict::Consumed => return None,
        Verdict::Redirect => return redirect_encapsulate(engine, data, mtu).then_some(0),
    };
    socket_of(engine, out, egress)
}

/// The socket (index into the worker's ports; the uplink's is 0) a frame for `side`
/// leaves by; `None`, counted, while a Pod interface has no socket.
pub(super) fn socket_of(
    engine: &mut Engine,
    side: Side,
    egress: &[Option<usize>],
) -> Option<usize> {
    let j = match side {
        Side::Uplink => Some(0),
        Side::Pod(k) => egress.get(usize::from(k)).copied().flatten(),
    };
    if j.is_none() {
        engine.counters_mut().drop(DropReason::PodIfaceNotAttached);
    }
    j
}

/// Produces every socket's pending frames on its TX ring and kicks the kernel.
fn transmit(
    r: &mut Rings<'_, '_>,
    engine: &mut Engine,
    b: &mut Bufs,
    cfg: &RuntimeConfig,
    timing: &mut LoopTiming,
) {
    for (j, p) in r.ports.iter_mut().enumerate() {
        let q = &mut b.pending[j];
        if !q.is_empty() {
            // SAFETY: frames from our UMEM, now owned by nobody but this queue. The ring
            // takes all of them or none.
            let mut sent = unsafe { p.tx.produce(q) };
            if sent < q.len() {
                sent = produce_whole_packets(p, q);
                leftovers(engine, r.pool, &q[sent..]);
            }
            r.pool.hand_over(p.id, &q[..sent]);
            engine.counters_mut().tx_packets += packets_in(&q[..sent]);
            p.in_flight += sent as u32;
            p.unsent += sent as u32;
            q.clear();
        }
        kick(p, cfg, timing);
    }
}

/// The TX ring had no room for every pending frame: produces the longest run of whole
/// packets it has room for (never the first descriptors of a packet without the rest).
/// Returns the descriptors produced.
fn produce_whole_packets(p: &mut Port, q: &[FrameDesc]) -> usize {
    let whole = whole_packets(q, p.tx.nb_free_exact() as usize);
    if whole == 0 {
        return 0;
    }
    // SAFETY: as in `transmit`; the ring has room for `whole` descriptors.
    unsafe { p.tx.produce(&q[..whole]) }
}

/// The most descriptors of `q`, at most `room`, that end on a packet's last descriptor.
fn whole_packets(q: &[FrameDesc], room: usize) -> usize {
    (0..=room.min(q.len()))
        .rev()
        .find(|&k| k == 0 || q[k - 1].options() & large::XDP_PKT_CONTD == 0)
        .unwrap_or(0)
}

/// Packets among `descs`: the descriptors that end one (no `XDP_PKT_CONTD`).
fn packets_in(descs: &[FrameDesc]) -> u64 {
    descs
        .iter()
        .filter(|d| d.options() & large::XDP_PKT_CONTD == 0)
        .count() as u64
}

/// Frames the TX ring had no room for go back to the free stack, each packet counted
/// as `tx_ring_full`.
fn leftovers(engine: &mut Engine, pool: &mut FramePool<FrameDesc>, left: &[FrameDesc]) {
    for _ in 0..packets_in(left) {
        engine.counters_mut().drop(DropReason::TxRingFull);
    }
    for d in left {
        let mut d = *d;
        d.set_options(0);
        pool.free.push(d);
    }
}

/// Kick policy: copy mode transmits only inside sendto(), at most 32 frames per call.
/// Kick for the frames produced since the last kick, and again only while the TX ring
/// still holds frames the kernel has not taken (a kick cut short by its per-call budget
/// or a busy device); completions of frames already taken arrive without a kick.
/// Zero-copy drivers: kick while any are in flight.
fn kick(p: &mut Port, cfg: &RuntimeConfig, timing: &mut LoopTiming) {
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

/// Encapsulates a frame the engine redirects to another node in place, in its whole UMEM
/// frame; `false` (counted) when it does not fit.
fn redirect_encapsulate(
    engine: &mut Engine,
    data: &mut xsk_rs::umem::frame::DataMut<'_>,
    mtu: usize,
) -> bool {
    let (Some(out), Some(r)) = (engine.take_redirect(), engine.redirect()) else {
        return false;
    };
    let (node, port) = (r.node(), r.port());
    let mut c = data.cursor();
    let cap = c.buf_len();
    c.set_pos(cap);
    let key = r.send_key();
    match crate::redirect_wire::encapsulate(data.contents_mut(), &out, node, port, mtu, key) {
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

/// Sends what the engine's redirector queued besides redirected packets — "I own this
/// flow" notices and answers to peers' liveness probes — each in a free frame.
fn send_notices(
    engine: &mut Engine,
    umem: &Umem,
    pool: &mut FramePool<FrameDesc>,
    uplink: &mut Vec<FrameDesc>,
) {
    use crate::redirect_wire::{build_liveness, build_notice, KIND_ANSWER};
    let Some(r) = engine.redirect_mut() else {
        return;
    };
    let (node, port) = (r.node(), r.port());
    let out = r.take_outgoing();
    let key = out.key;
    for n in out.notices {
        let build =
            |buf: &mut [u8]| build_notice(buf, &n.macs, node, n.to, port, n.key, n.cookie, key);
        if !send_in_free_frame(umem, pool, uplink, build) {
            break;
        }
    }
    for a in out.answers {
        let build = |buf: &mut [u8]| {
            build_liveness(buf, &a.macs, node, a.to, port, KIND_ANSWER, a.nonce, key)
        };
        if !send_in_free_frame(umem, pool, uplink, build) {
            break;
        }
    }
}

/// Writes a frame with `build` (its length, `None` when it does not fit) into a free
/// frame and queues it on the uplink; `false` when no frame is free.
fn send_in_free_frame(
    umem: &Umem,
    pool: &mut FramePool<FrameDesc>,
    uplink: &mut Vec<FrameDesc>,
    build: impl FnOnce(&mut [u8]) -> Option<usize>,
) -> bool {
    let Some(mut d) = pool.free.pop() else {
        return false;
    };
    // SAFETY: a free frame is in no ring and referenced by nothing else.
    let mut data = unsafe { umem.data_mut(&mut d) };
    let mut c = data.cursor();
    let cap = c.buf_len();
    c.set_pos(cap);
    match build(data.contents_mut()) {
        Some(len) => {
            data.cursor().set_pos(len);
            uplink.push(d);
        }
        None => pool.free.push(d),
    }
    true
}

/// Iterations with work within one window for the traffic to count as steady.
const STEADY_ITERATIONS: u32 = 4;
/// The window over which the loop's work is counted.
const ACTIVITY_WINDOW: Duration = Duration::from_millis(10);

/// When the loop last had work, and whether work comes steadily enough that yielding
/// the core (and picking the next batch up without a wake-up) is worth it. With the XDP
/// fast path forwarding established flows, userspace sees only a trickle (new flows, the
/// odd reply): spinning for `busy_poll_us` after each of those packets would only take
/// the core from the NAPI work that forwards everything else, so the loop then sleeps at
/// once and a packet wakes it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Activity {
    last: Instant,
    window_start: Instant,
    busy_now: u32,
    busy_before: u32,
}

impl Activity {
    pub(super) fn new(now: Instant) -> Self {
        Activity {
            last: now,
            window_start: now,
            busy_now: 0,
            busy_before: 0,
        }
    }

    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed >= ACTIVITY_WINDOW {
            // A window with nothing in between leaves nothing to carry over.
            self.busy_before = if elapsed >= 2 * ACTIVITY_WINDOW {
                0
            } else {
                self.busy_now
            };
            self.busy_now = 0;
            self.window_start = now;
        }
    }

    /// An iteration that received or completed frames.
    pub(super) fn worked(&mut self, now: Instant) {
        self.roll(now);
        self.busy_now = self.busy_now.saturating_add(1);
        self.last = now;
    }

    /// Whether to keep yielding instead of sleeping: within `busy_poll` of the last work,
    /// and the work steady (at least [`STEADY_ITERATIONS`] iterations with work in this
    /// or the previous window) or frames sent and not completed yet (`tx_in_flight`:
    /// their completions, and a kick for what the kernel did not take, come from
    /// iterations, not from a wake-up).
    pub(super) fn spin(&mut self, now: Instant, busy_poll: Duration, tx_in_flight: bool) -> bool {
        self.roll(now);
        now.saturating_duration_since(self.last) < busy_poll
            && (tx_in_flight || self.busy_now.max(self.busy_before) >= STEADY_ITERATIONS)
    }
}

/// When nothing arrived: with `may_spin` (a worker under the normal policy), yield the
/// core while the traffic is steady (see [`Activity`]); else sleep in `poll(2)` on the
/// sockets for at most `idle_sleep_ms` (a packet wakes it at once). A realtime worker
/// never spins: its `sched_yield` would not let the normal-policy NAPI that fills its
/// rings run (`crate::sched`).
pub(super) fn idle(
    cfg: &RuntimeConfig,
    may_spin: bool,
    pollfds: &mut [libc::pollfd],
    activity: &mut Activity,
    ports: &[Port],
    timing: &mut LoopTiming,
) {
    let tx_in_flight = ports.iter().any(|p| p.in_flight > 0);
    if may_spin
        && activity.spin(
            Instant::now(),
            Duration::from_micros(cfg.busy_poll_us),
            tx_in_flight,
        )
    {
        // Let whatever else is runnable on this core go first. In copy mode that is
        // typically the interface's NAPI (softirq or threaded kthread) that fills our RX
        // rings: spinning on empty rings would take the core from the very work that
        // feeds them. Returns at once when nothing else wants the core.
        std::thread::yield_now();
        timing.yields += 1;
        return;
    }
    for pfd in pollfds.iter_mut() {
        pfd.revents = 0;
    }
    // Frames sent and not completed yet: their completions (and a kick for any the
    // kernel did not take) come from iterations, so a worker that does not spin looks
    // again within a millisecond.
    let timeout_ms = if tx_in_flight && !may_spin {
        cfg.idle_sleep_ms.min(1)
    } else {
        cfg.idle_sleep_ms
    };
    let before = Instant::now();
    // SAFETY: `pollfds` is a valid array of pollfd for its length.
    unsafe {
        libc::poll(
            pollfds.as_mut_ptr(),
            pollfds.len() as libc::nfds_t,
            timeout_ms,
        );
    }
    timing.slept_for(before.elapsed());
    // A socket whose interface vanished reports an error at once; do not spin on it
    // until it is detached.
    if pollfds
        .iter()
        .any(|p| p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0)
    {
        std::thread::sleep(Duration::from_millis(cfg.idle_sleep_ms.max(0) as u64));
    }
}

/// The sockets' poll set.
pub(super) fn pollfds_of(ports: &[Port]) -> Vec<libc::pollfd> {
    ports
        .iter()
        .map(|p| libc::pollfd {
            fd: p.rx.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect()
}

/// Egress socket of each of `nb`'s Pod interfaces among `ports` (the first socket of
/// this worker on that interface), by `Side::Pod` index; `None` while it has none.
pub(super) fn egress_map(ports: &[Port], nb: &Neighbours) -> Vec<Option<usize>> {
    nb.pods()
        .iter()
        .map(|i| {
            ports
                .iter()
                .position(|p| p.ifindex == i.ifindex && p.side != Side::Uplink)
        })
        .collect()
}

/// What the node thread publishes for the workers — the service table in force: a
/// version word they check once per iteration, the table they clone when it moved —
/// and what the workers publish back ([`Signs`]).
#[derive(Default)]
pub(super) struct Published {
    version: AtomicU64,
    table: Mutex<Option<ServiceTable>>,
    signs: Vec<Signs>,
}

/// One worker's signs, on a cache line of its own (each worker stores to it every
/// iteration).
#[derive(Default)]
#[repr(align(64))]
struct Signs {
    /// `CLOCK_MONOTONIC` ms of its latest iteration.
    alive: AtomicU64,
    /// The table version it forwards with.
    table: AtomicU64,
    /// Socket changes ([`PortChange`]) it has applied.
    changes: AtomicU64,
}

impl Published {
    pub fn new(workers: usize) -> Self {
        Published {
            signs: (0..workers)
                .map(|_| Signs {
                    alive: AtomicU64::new(monotonic_ms()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Worker `w` is looping.
    fn beat(&self, w: usize, now_ms: u64) {
        if let Some(s) = self.signs.get(w) {
            s.alive.store(now_ms, Ordering::Relaxed);
        }
    }

    /// Whether every worker looped within `max_ms` (a worker stuck in the kernel or a
    /// panic stops the process's heartbeat, so juneau-bgp withdraws the node).
    pub fn all_alive(&self, now_ms: u64, max_ms: u64) -> bool {
        self.signs
            .iter()
            .all(|s| now_ms.saturating_sub(s.alive.load(Ordering::Relaxed)) <= max_ms)
    }

    /// The node thread: a new table is in force. Returns its version.
    pub fn publish(&self, table: &ServiceTable) -> u64 {
        *self.table.lock().unwrap_or_else(|p| p.into_inner()) = Some(table.clone());
        self.version.fetch_add(1, Ordering::Release) + 1
    }

    /// The table, when its version is not `seen` (which is updated).
    fn newer(&self, seen: &mut u64) -> Option<ServiceTable> {
        let v = self.version.load(Ordering::Acquire);
        if v == *seen {
            return None;
        }
        *seen = v;
        self.table.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Worker `w` forwards with table `version`.
    fn took(&self, w: usize, version: u64) {
        if let Some(s) = self.signs.get(w) {
            s.table.store(version, Ordering::Release);
        }
    }

    /// Whether every worker forwards with table `version` or a later one.
    pub fn all_took(&self, version: u64) -> bool {
        self.signs
            .iter()
            .all(|s| s.table.load(Ordering::Acquire) >= version)
    }

    /// Socket changes worker `w` has applied.
    pub fn changes_applied(&self, w: usize) -> u64 {
        self.signs
            .get(w)
            .map_or(0, |s| s.changes.load(Ordering::Acquire))
    }

    fn applied(&self, w: usize, n: u64) {
        if let Some(s) = self.signs.get(w) {
            s.changes.fetch_add(n, Ordering::Release);
        }
    }
}

/// A change to a worker's sockets, from the node thread (discovered Pod interfaces).
pub(super) enum PortChange {
    /// Sockets opened on a new interface: the worker fills their fill rings at once;
    /// the node thread attaches the steering program once the worker applied this.
    Add(Vec<Port>),
    /// The interface's sockets close (its program already detached): the worker drops
    /// them and takes their frames back.
    Close(u32),
}

/// Who sends statistics to the stats thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reporter {
    /// The node thread: the process-wide part.
    Node,
    /// A worker: its engine, sockets and frames.
    Worker(usize),
}

/// A worker: its sockets, frames and engine.
pub(super) struct Worker<'u> {
    pub id: usize,
    pub umem: &'u Umem,
    pub pool: FramePool<FrameDesc>,
    pub ports: Vec<Port>,
    pub engine: Engine,
    /// Socket changes from the node thread.
    pub changes: mpsc::Receiver<PortChange>,
}

impl Worker<'_> {
    /// Applies the node thread's socket changes (between passes, when no frame is
    /// pending on any socket). Returns whether the sockets changed.
    fn take_changes(&mut self, published: &Published) -> bool {
        let mut n = 0u64;
        while let Ok(change) = self.changes.try_recv() {
            match change {
                PortChange::Add(ports) => {
                    for mut p in ports {
                        refill(&mut p, &mut self.pool, &mut []);
                        self.ports.push(p);
                    }
                }
                PortChange::Close(ifindex) => self.close(ifindex),
            }
            n += 1;
        }
        if n > 0 {
            published.applied(self.id, n);
        }
        n > 0
    }

    /// Closes the interface's sockets and takes back every frame they held.
    fn close(&mut self, ifindex: u32) {
        let (gone, kept): (Vec<Port>, Vec<Port>) = std::mem::take(&mut self.ports)
            .into_iter()
            .partition(|p| p.ifindex == ifindex && p.side != Side::Uplink);
        self.ports = kept;
        for p in gone {
            let id = p.id;
            drop(p);
            let n = self.pool.reclaim(id, &[]);
            tracing::debug!(socket = id, frames = n, "socket closed, frames reclaimed");
        }
    }
}

/// What every worker shares (read-only on the packet path).
pub(super) struct Shared<'a> {
    pub cfg: &'a RuntimeConfig,
    pub neighbours: &'a SharedNeighbours,
    pub published: &'a Published,
    /// The redirect peers the probes found unreachable (the node thread's).
    pub unreachable: &'a super::probes::Unreachable,
    /// Answers to the node thread's probes, handed to it.
    pub answers_tx: super::probes::AnswerSender,
    pub miss_tx: crate::netlink::MissSender,
    pub stats_tx: StatsSender,
    /// What this worker keeps once it runs (it drops CAP_SYS_NICE after its start).
    pub forwarding: &'a Forwarding,
}

/// A worker's loop: follow the service table, the neighbours and the socket changes
/// others publish, forward, sweep its own flow table, send stats once a second.
pub(super) fn worker_loop(mut w: Worker<'_>, s: Shared<'_>) {
    let cfg = s.cfg;
    let mut b = Bufs::new(cfg.ring_size, w.ports.len());
    let mut nb: Arc<Neighbours> = s.neighbours.get();
    let mut nb_version = s.neighbours.version();
    let mut egress = egress_map(&w.ports, &nb);
    let mut pollfds = pollfds_of(&w.ports);
    let mut seen_table = 0u64;
    let mut seen_unreachable = 0u64;
    let (mut last_stats, mut activity) = (Instant::now(), Activity::new(Instant::now()));
    let mut timing = LoopTiming::default();
    let realtime = crate::sched::enter_worker(cfg.worker_priority, w.id);
    s.forwarding.settle_thread();
    while !STOP.load(Ordering::Relaxed) {
        let now = Instant::now();
        timing.top(now);
        // The flow table's clock: CLOCK_MONOTONIC, shared with the XDP program and
        // unaffected by a restart of this process.
        let now_ms = monotonic_ms();
        s.published.beat(w.id, now_ms);
        let version = seen_table;
        if let Some(t) = s.published.newer(&mut seen_table) {
            w.engine.set_services(t);
        }
        if seen_table != version {
            s.published.took(w.id, seen_table);
        }
        let sockets_changed = w.take_changes(s.published);
        if sockets_changed {
            pollfds = pollfds_of(&w.ports);
            b.fit(w.ports.len());
        }
        if s.neighbours.version() != nb_version || sockets_changed {
            nb_version = s.neighbours.version();
            nb = s.neighbours.get();
            egress = egress_map(&w.ports, &nb);
        }
        w.engine.refresh_xdp(&nb);
        follow_liveness(&mut w.engine, &s, &mut seen_unreachable);
        let mut rings = Rings {
            ports: &mut w.ports,
            pool: &mut w.pool,
            umem: w.umem,
        };
        let (received, completed) = step(
            &mut rings,
            &mut w.engine,
            &nb,
            &egress,
            &mut b,
            now_ms,
            cfg,
            &mut timing,
            &s.miss_tx,
        );
        if now.duration_since(last_stats) >= Duration::from_secs(1) {
            last_stats = now;
            w.engine.fold_xdp_counters();
            let mut st = worker_stats(&w.engine, &w.ports, &w.pool);
            st.loop_gap = timing.gaps.clone();
            let _ = s.stats_tx.try_send((Reporter::Worker(w.id), st));
            timing.log();
        }
        // Activity: frames received, or TX completions still coming in (a frame the
        // kernel did not take yet is retried on every iteration while we spin).
        if received > 0 || completed > 0 {
            activity.worked(now);
        } else {
            idle(
                cfg,
                !realtime,
                &mut pollfds,
                &mut activity,
                &w.ports,
                &mut timing,
            );
        }
    }
    // Final stats so a short-lived run leaves them behind.
    w.engine.fold_xdp_counters();
    let st = worker_stats(&w.engine, &w.ports, &w.pool);
    let _ = s.stats_tx.send((Reporter::Worker(w.id), st));
}

/// Hands the answers to liveness probes this worker received to the node thread, and
/// takes the unreachable set it published (kept across new service tables). One atomic
/// load when nothing changed.
fn follow_liveness(engine: &mut Engine, s: &Shared<'_>, seen: &mut u64) {
    let Some(r) = engine.redirect_mut() else {
        return;
    };
    for a in r.take_answered() {
        let _ = s.answers_tx.try_send(a);
    }
    let v = s.unreachable.version();
    if v != *seen {
        *seen = v;
        r.set_unreachable(&s.unreachable.get());
    }
}

/// The statistics one worker contributes: its engine's counters and flow table, its
/// sockets and frames.
pub(super) fn worker_stats(engine: &Engine, ports: &[Port], pool: &FramePool<FrameDesc>) -> Stats {
    let c = engine.counters();
    let flows = engine.flows();
    let (flows6, flow6_capacity) = engine.flows6_counts();
    let mut st = Stats {
        timestamp: now_unix(),
        rx_packets: c.rx_packets,
        tx_packets: c.tx_packets,
        xdp_fast_packets: c.xdp_fast_packets,
        xdp_fast_replies: c.xdp_fast_replies,
        segmented: c.segmented,
        fragment_datagrams: engine.fragment_datagrams() as u64,
        segments: c.segments,
        icmp_frag_needed_sent: c.icmp_frag_needed_sent,
        icmp_frag_needed_limited: c.icmp_frag_needed_limited,
        flows: flows.len() as u64,
        flow_capacity: flows.capacity() as u64,
        flows6: flows6 as u64,
        flow6_capacity: flow6_capacity as u64,
        flow_table_bytes: flows.memory_bytes() as u64,
        half_open_flows: flows.half_open() as u64,
        half_open_max: flows.half_open_max() as u64,
        half_open_evicted: flows.half_open_evicted(),
        idle_evicted: flows.idle_evicted(),
        flows_restored: c.flows_restored,
        cross_worker_lookups: flows.remote_hits(),
        umem_frames: pool.total() as u64,
        umem_frames_free: pool.free.len() as u64,
        umem_frames_in_kernel: ports
            .iter()
            .map(|p| u64::from(p.fill_held) + u64::from(p.in_flight))
            .sum(),
        umem_frames_reclaimed: pool.reclaimed,
        ..Default::default()
    };
    for r in DropReason::ALL {
        st.drops.insert(r.name().to_string(), c.drops_for(r));
    }
    if let Some(r) = engine.redirect() {
        st.redirect_notices_dropped = r.notices_dropped;
        st.redirect_peers = r
            .peer_counters()
            .map(|(a, c)| RedirectPeerStats {
                peer: std::net::Ipv4Addr::from(a).to_string(),
                counters: c,
                reachable: None,
            })
            .collect();
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
    let counters6 = engine.service_counters6();
    for (i, s) in engine.services6().services().iter().enumerate() {
        st.services.push(ServiceStats {
            vip: std::net::Ipv6Addr::from(s.vip).to_string(),
            protocol: crate::proto::protocol_name(s.proto).to_string(),
            port: s.port,
            backends: s.ready,
            draining_backends: s.backends.len() - s.ready,
            counters: counters6.get(i).copied().unwrap_or_default(),
        });
    }
    for p in ports {
        st.rx_packets_per_socket
            .insert(p.name.clone(), p.rx_packets);
        if let Ok(x) = p.rx.fd().xdp_statistics() {
            st.xsk_rx_dropped += x.rx_dropped();
            st.xsk_rx_ring_full += x.rx_ring_full();
            st.xsk_fill_ring_empty += x.rx_fill_ring_empty_descs();
            // What the kernel drops at the sockets is a drop like any other: named.
            for (r, n) in [
                (DropReason::SocketRxDropped, x.rx_dropped()),
                (DropReason::SocketRxRingFull, x.rx_ring_full()),
                (DropReason::SocketTxInvalid, x.tx_invalid_descs()),
            ] {
                *st.drops.entry(r.name().to_string()).or_default() += n;
            }
        }
    }
    st
}

/// Adds worker `other`'s statistics to `total` (the node thread's, which carries the
/// process-wide parts: generation, neighbours, interfaces, steering drops, plus the
/// workers added so far).
pub(super) fn merge(total: &mut Stats, other: &Stats) {
    total.rx_packets += other.rx_packets;
    total.xdp_fast_packets += other.xdp_fast_packets;
    total.xdp_fast_replies += other.xdp_fast_replies;
    total.tx_packets += other.tx_packets;
    total.segmented += other.segmented;
    total.fragment_datagrams += other.fragment_datagrams;
    total.segments += other.segments;
    total.icmp_frag_needed_sent += other.icmp_frag_needed_sent;
    total.icmp_frag_needed_limited += other.icmp_frag_needed_limited;
    total.flows += other.flows;
    total.flow_capacity += other.flow_capacity;
    // One IPv6 table for all workers: each reports it whole.
    total.flows6 = total.flows6.max(other.flows6);
    total.flow6_capacity = total.flow6_capacity.max(other.flow6_capacity);
    total.flow_table_bytes += other.flow_table_bytes;
    total.half_open_flows += other.half_open_flows;
    total.half_open_max += other.half_open_max;
    total.half_open_evicted += other.half_open_evicted;
    total.idle_evicted += other.idle_evicted;
    total.flows_restored += other.flows_restored;
    total.cross_worker_lookups += other.cross_worker_lookups;
    total.loop_gap.add(&other.loop_gap);
    total.xsk_rx_dropped += other.xsk_rx_dropped;
    total.xsk_rx_ring_full += other.xsk_rx_ring_full;
    total.xsk_fill_ring_empty += other.xsk_fill_ring_empty;
    total.umem_frames += other.umem_frames;
    total.umem_frames_free += other.umem_frames_free;
    total.umem_frames_in_kernel += other.umem_frames_in_kernel;
    total.umem_frames_reclaimed += other.umem_frames_reclaimed;
    total.redirect_notices_dropped += other.redirect_notices_dropped;
    for p in &other.redirect_peers {
        match total.redirect_peers.iter_mut().find(|t| t.peer == p.peer) {
            Some(t) => {
                let (a, b) = (&mut t.counters, &p.counters);
                a.redirected_to += b.redirected_to;
                a.received_from += b.received_from;
                a.notices_sent += b.notices_sent;
                a.notices_received += b.notices_received;
                a.probes_sent += b.probes_sent;
                a.probes_received += b.probes_received;
                a.probe_answers_received += b.probe_answers_received;
                t.reachable = t.reachable.or(p.reachable);
            }
            None => total.redirect_peers.push(p.clone()),
        }
    }
    for (k, v) in &other.drops {
        *total.drops.entry(k.clone()).or_default() += v;
    }
    for (k, v) in &other.rx_packets_per_socket {
        *total.rx_packets_per_socket.entry(k.clone()).or_default() += v;
    }
    for s in &other.services {
        let same =
            |t: &&mut ServiceStats| t.vip == s.vip && t.protocol == s.protocol && t.port == s.port;
        match total.services.iter_mut().find(same) {
            Some(t) => {
                let (a, b) = (&mut t.counters, &s.counters);
                a.packets_in += b.packets_in;
                a.bytes_in += b.bytes_in;
                a.packets_out += b.packets_out;
                a.bytes_out += b.bytes_out;
                a.new_flows += b.new_flows;
                a.drops += b.drops;
            }
            None => total.services.push(s.clone()),
        }
    }
}

/// The stats thread's view of the process: the node thread's latest statistics and
/// each worker's, merged, with per-worker rates from the previous merge.
#[derive(Default)]
pub(super) struct Collector {
    node: Option<Stats>,
    latest: Vec<Option<Stats>>,
    previous: Vec<(Instant, u64, u64)>,
}

impl Collector {
    pub fn new(workers: usize) -> Self {
        Collector {
            node: None,
            latest: vec![None; workers],
            previous: vec![(Instant::now(), 0, 0); workers],
        }
    }

    /// Records a report; returns the merged whole once the node thread has reported
    /// (it carries the process-wide parts).
    pub fn add(&mut self, from: Reporter, st: Stats) -> Option<Stats> {
        let w = match from {
            Reporter::Node => {
                self.node = Some(st);
                return self.merged();
            }
            Reporter::Worker(w) => w,
        };
        let now = Instant::now();
        let (t0, rx0, tx0) = self.previous[w];
        let secs = now.duration_since(t0).as_secs_f64().max(1e-3);
        let rate = |a: u64, b: u64| (a.saturating_sub(b) as f64 / secs) as u64;
        let ws = crate::counters::WorkerStats {
            worker: w as u32,
            rx_packets: st.rx_packets,
            tx_packets: st.tx_packets,
            flows: st.flows,
            xdp_fast_packets: st.xdp_fast_packets,
            rx_pps: rate(st.rx_packets, rx0),
            tx_pps: rate(st.tx_packets, tx0),
        };
        self.previous[w] = (now, st.rx_packets, st.tx_packets);
        let mut st = st;
        st.workers = vec![ws];
        self.latest[w] = Some(st);
        self.merged()
    }

    /// The whole, stamped with its oldest part's time: every counter in it is at least
    /// that recent (a reader waiting for counters to settle compares two stamps).
    fn merged(&self) -> Option<Stats> {
        let mut total = self.node.clone()?;
        for s in self.latest.iter().flatten() {
            merge(&mut total, s);
            total.workers.extend(s.workers.iter().cloned());
            total.timestamp = total.timestamp.min(s.timestamp);
        }
        Some(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In virtual time: the loop keeps yielding only after steady work, for at most
    /// `busy_poll` after the last of it; a lone packet (or a trickle) lets it sleep.
    #[test]
    fn the_loop_spins_only_while_work_comes_steadily() {
        let t0 = Instant::now();
        let ms = |x: u64| t0 + Duration::from_micros(x * 1000);
        let poll = Duration::from_millis(10);
        let mut a = Activity::new(t0);
        assert!(!a.spin(t0, poll, false), "nothing yet");
        a.worked(ms(1));
        assert!(
            !a.spin(ms(1), poll, false),
            "one packet is a trickle: sleep at once"
        );
        for i in 0..STEADY_ITERATIONS as u64 {
            a.worked(ms(2) + Duration::from_micros(i * 10));
        }
        assert!(a.spin(ms(3), poll, false), "steady work: keep the core");
        assert!(
            a.spin(ms(12), poll, false),
            "the window rolled; the previous one was steady"
        );
        assert!(
            !a.spin(ms(13), poll, false),
            "busy_poll after the last work: sleep"
        );
        assert!(!a.spin(ms(40), poll, false), "long idle: sleep");
        a.worked(ms(41));
        assert!(
            !a.spin(ms(41), poll, false),
            "one packet after a long idle is a trickle again"
        );
        assert!(
            !a.spin(ms(41), Duration::ZERO, false),
            "--busy-poll-us 0 never spins"
        );
        assert!(
            a.spin(ms(42), poll, true),
            "frames in flight: reap them without a wake-up"
        );
        assert!(
            !a.spin(ms(52), poll, true),
            "but not past busy_poll after the last work"
        );
        // A packet every 5 ms (200 pps): never steady.
        let mut b = Activity::new(t0);
        for i in 0..20 {
            b.worked(ms(5 * i));
            assert!(!b.spin(ms(5 * i), poll, false), "200 pps at {} ms", 5 * i);
        }
    }

    #[test]
    fn the_tx_ring_never_gets_part_of_a_packet() {
        // Packets of 1, 3 and 2 descriptors.
        let q: Vec<FrameDesc> = [0, 1, 1, 0, 1, 0]
            .iter()
            .map(|&c| {
                let mut d = FrameDesc::default();
                d.set_options(c * large::XDP_PKT_CONTD);
                d
            })
            .collect();
        let got: Vec<usize> = (0..8).map(|room| whole_packets(&q, room)).collect();
        assert_eq!(got, vec![0, 1, 1, 1, 4, 4, 6, 6]);
    }

    fn stats(rx: u64, flows: u64, drops: u64) -> Stats {
        let mut s = Stats {
            timestamp: 10 + flows,
            rx_packets: rx,
            tx_packets: rx,
            flows,
            cross_worker_lookups: 1,
            ..Default::default()
        };
        s.drops.insert("no_flow".into(), drops);
        s.rx_packets_per_socket.insert(format!("up0/{flows}"), rx);
        s
    }

    #[test]
    fn a_worker_that_stops_looping_is_noticed() {
        let p = Published::new(3);
        for w in 0..3 {
            p.beat(w, 10_000);
        }
        assert!(p.all_alive(10_200, 250));
        p.beat(0, 10_400);
        p.beat(1, 10_400);
        assert!(!p.all_alive(10_400, 250), "worker 2 silent for 400 ms");
        p.beat(2, 10_400);
        assert!(p.all_alive(10_400, 250));
        p.beat(1, 10_800);
        p.beat(2, 10_800);
        assert!(!p.all_alive(10_800, 250), "worker 0 counts like any other");
    }

    #[test]
    fn workers_stats_are_summed_once_the_node_thread_reported() {
        let mut c = Collector::new(2);
        let mut w1 = stats(30, 1, 2);
        w1.services.push(service("10.0.0.1", 3));
        w1.redirect_peers.push(peer("192.0.2.2", 4));
        assert!(
            c.add(Reporter::Worker(1), w1).is_none(),
            "the node thread carries the process-wide parts"
        );
        let mut w0 = stats(70, 0, 5);
        w0.services.push(service("10.0.0.1", 7));
        w0.redirect_peers.push(peer("192.0.2.2", 1));
        w0.redirect_peers.push(peer("192.0.2.3", 2));
        assert!(c.add(Reporter::Worker(0), w0).is_none());
        let mut node = Stats {
            generation: 9,
            timestamp: 20,
            ..Default::default()
        };
        node.drops.insert("steer_no_socket".into(), 4);
        let total = c.add(Reporter::Node, node).expect("merged");
        assert_eq!(total.rx_packets, 100);
        assert_eq!(total.flows, 1);
        assert_eq!(total.generation, 9);
        assert_eq!(total.cross_worker_lookups, 2);
        assert_eq!(total.drops["no_flow"], 7);
        assert_eq!(total.drops["steer_no_socket"], 4);
        assert_eq!(total.rx_packets_per_socket.len(), 2);
        assert_eq!(total.services.len(), 1, "{:?}", total.services);
        assert_eq!(total.services[0].counters.packets_in, 10);
        let peers: Vec<(&str, u64)> = total
            .redirect_peers
            .iter()
            .map(|p| (p.peer.as_str(), p.counters.redirected_to))
            .collect();
        assert_eq!(peers, vec![("192.0.2.2", 5), ("192.0.2.3", 2)]);
        let per: Vec<(u32, u64)> = total
            .workers
            .iter()
            .map(|w| (w.worker, w.rx_packets))
            .collect();
        assert_eq!(per, vec![(0, 70), (1, 30)]);
        assert_eq!(total.timestamp, 10, "as old as its oldest part");
        // A later report of worker 1 replaces its earlier one (counters are totals).
        let total = c.add(Reporter::Worker(1), stats(50, 1, 2)).expect("merged");
        assert_eq!(total.rx_packets, 120);
    }

    fn service(vip: &str, packets_in: u64) -> ServiceStats {
        ServiceStats {
            vip: vip.into(),
            protocol: "TCP".into(),
            port: 80,
            backends: 1,
            draining_backends: 0,
            counters: crate::counters::ServiceCounters {
                packets_in,
                ..Default::default()
            },
        }
    }

    fn peer(addr: &str, redirected_to: u64) -> RedirectPeerStats {
        RedirectPeerStats {
            peer: addr.into(),
            counters: crate::counters::PeerCounters {
                redirected_to,
                ..Default::default()
            },
            reachable: None,
        }
    }

    #[test]
    fn the_node_thread_announces_a_table_only_once_every_worker_took_it() {
        let p = Published::new(2);
        let v = p.publish(&ServiceTable::default());
        assert!(!p.all_took(v));
        let mut seen = 0;
        assert!(p.newer(&mut seen).is_some());
        p.took(0, seen);
        assert!(!p.all_took(v), "worker 1 still forwards with the old table");
        p.took(1, seen);
        assert!(p.all_took(v));
        assert!(p.newer(&mut seen).is_none(), "taken once");
    }
}
