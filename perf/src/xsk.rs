//! The AF_XDP pieces of the harness: the TX traffic generator and the raw AF_XDP
//! forwarder baseline (`afxdp-l2fwd`). Both run as subprocesses of `juneau-perf` inside
//! a namespace (`juneau-perf gen ...`, `juneau-perf l2fwd ...`).

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use xsk_rs::config::{BindFlags, FrameSize, LibxdpFlags, QueueSize, SocketConfig, UmemConfig};
use xsk_rs::{FrameDesc, Socket, Umem};

use crate::gen::{GenConfig, GenResult, Generator};
// The forwarder's frames and rings are juneau-dataplane's (its frame size and default
// `--ring-size`, at most a ring of frames in the fill and RX rings), so that the two cycle
// the same frames through the kernel and differ only in the work done on each (with rings
// of its own it was slower: perf/README.md, "Scenarios").
use juneau_dataplane::runtime::{
    DEFAULT_FRAMES_PER_IFACE, DEFAULT_RING_SIZE as L2FWD_RING, FRAME_SIZE as L2FWD_FRAME_SIZE,
};

/// The generator's frames and rings.
const FRAME_SIZE: u32 = 2048;
const GEN_RING: u32 = 4096;
/// Copy-mode TX takes at most 32 frames per sendto() (FACTS.md).
const BATCH: usize = 32;

fn umem(frames: u32, frame_size: u32, ring: u32) -> Result<(Umem, Vec<FrameDesc>)> {
    let cfg = UmemConfig::builder()
        .frame_size(FrameSize::new(frame_size).map_err(|e| anyhow!("{e}"))?)
        .fill_queue_size(QueueSize::new(ring).map_err(|e| anyhow!("{e}"))?)
        .comp_queue_size(QueueSize::new(ring).map_err(|e| anyhow!("{e}"))?)
        .build()
        .map_err(|e| anyhow!("UMEM config: {e}"))?;
    Umem::new(cfg, NonZeroU32::new(frames).expect("non-zero"), false)
        .map_err(|e| anyhow!("creating UMEM: {e}"))
}

fn socket_config(need_wakeup: bool, ring: u32) -> Result<SocketConfig> {
    let mut b = SocketConfig::builder();
    let bind = if need_wakeup {
        BindFlags::XDP_COPY | BindFlags::XDP_USE_NEED_WAKEUP
    } else {
        BindFlags::XDP_COPY
    };
    b.rx_queue_size(QueueSize::new(ring).map_err(|e| anyhow!("{e}"))?)
        .tx_queue_size(QueueSize::new(ring).map_err(|e| anyhow!("{e}"))?)
        .bind_flags(bind)
        .libxdp_flags(LibxdpFlags::XSK_LIBXDP_FLAGS_INHIBIT_PROG_LOAD);
    Ok(b.build())
}

/// Sends `cfg`'s frames ([`GenConfig::write_frame`]) until the duration or packet
/// bound is reached (or `stop` is set): the generator where the kernel refuses live
/// frames (`gen.rs`). `ready` is called once the socket is bound.
pub fn generate(cfg: &GenConfig, stop: &AtomicBool, ready: &dyn Fn()) -> Result<GenResult> {
    const FRAMES: u32 = 4096;
    let (umem, mut descs) = umem(FRAMES, FRAME_SIZE, GEN_RING)?;
    let iface = cfg
        .iface
        .parse()
        .map_err(|e| anyhow!("interface name: {e:?}"))?;
    // The previous generator's socket on this queue may still be going away (EBUSY):
    // retry for a while.
    let mut attempt = 0;
    let (mut tx, _rx, fq_cq) = loop {
        // SAFETY: the UMEM outlives the socket (both live until the end of this function)
        // and this is the only socket bound to (iface, queue 0) in this process.
        match unsafe { Socket::new(socket_config(false, GEN_RING)?, &umem, &iface, 0) } {
            Ok(s) => break s,
            Err(e) if attempt < 50 => {
                tracing::debug!("AF_XDP socket on {}: {e}; retrying", cfg.iface);
                attempt += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => bail!("creating AF_XDP socket on {}: {e}", cfg.iface),
        }
    };
    let (_fq, mut cq) = fq_cq.context("AF_XDP socket without a completion queue")?;

    // Give every frame its length once; each is rewritten whole before it is sent.
    let zeros = vec![0u8; cfg.frame_len()];
    for d in descs.iter_mut() {
        // SAFETY: `d` belongs to `umem` and is not in any ring yet.
        let mut data = unsafe { umem.data_mut(d) };
        let mut cur = data.cursor();
        std::io::Write::write_all(&mut cur, &zeros)?;
    }
    let mut free: Vec<usize> = (0..descs.len()).collect();
    let mut done_buf = vec![FrameDesc::default(); BATCH * 4];
    let mut batch: Vec<FrameDesc> = Vec::with_capacity(BATCH);
    let mut sent = 0u64;
    let prebuilt = cfg.frames_by_flow();
    let (len, flows) = (cfg.frame_len(), u64::from(cfg.flows.max(1)));
    ready();
    let start = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) || sent >= cfg.max_packets {
            break;
        }
        let elapsed = start.elapsed();
        if elapsed >= cfg.duration {
            break;
        }
        // Reclaim completed frames.
        // SAFETY: the completion queue hands back frames of this UMEM.
        let n = unsafe { cq.consume(&mut done_buf) };
        for d in &done_buf[..n] {
            free.push(d.addr() / FRAME_SIZE as usize);
        }
        let mut want = BATCH.min(free.len()) as u64;
        want = want.min(cfg.max_packets - sent);
        if cfg.rate_pps > 0 {
            let allowed = (elapsed.as_secs_f64() * cfg.rate_pps as f64) as u64;
            let budget = allowed.saturating_sub(sent);
            if budget == 0 {
                // Ahead of schedule: nap for about one batch's worth of time.
                let nap = Duration::from_secs_f64((BATCH as f64 / cfg.rate_pps as f64).min(0.001));
                std::thread::sleep(nap);
                continue;
            }
            want = want.min(budget);
        }
        if want == 0 {
            // Ring full: kick the kernel so it completes frames.
            let _ = tx.wakeup();
            continue;
        }
        batch.clear();
        for k in 0..want {
            let idx = free.pop().expect("counted");
            let d = &mut descs[idx];
            // SAFETY: this frame is owned by us (reclaimed or never submitted).
            let mut data = unsafe { umem.data_mut(d) };
            match &prebuilt {
                Some(table) => {
                    let at = ((sent + k) % flows) as usize * len;
                    data.contents_mut()[..len].copy_from_slice(&table[at..at + len]);
                }
                None => {
                    cfg.write_frame(data.contents_mut(), sent + k);
                }
            }
            batch.push(*d);
        }
        // SAFETY: the frames belong to this UMEM and are not in any other ring.
        let produced = unsafe { tx.produce(&batch) };
        // Copy mode needs a sendto() to transmit; EAGAIN/ENOBUFS just mean "busy".
        let _ = tx.wakeup();
        // Frames not taken go back unsent; the next batch rewrites them with its numbers.
        for d in &batch[produced..] {
            free.push(d.addr() / FRAME_SIZE as usize);
        }
        sent += produced as u64;
    }
    Ok(GenResult {
        sent,
        elapsed_s: start.elapsed().as_secs_f64(),
        generator: Generator::AfxdpTx,
    })
}

/// What the forwarder needs: receive on `rx_iface` (an XDP program there redirects the
/// benchmark traffic into the socket's XSKMAP slot), rewrite MACs, transmit on `tx_iface`.
#[derive(Debug, Clone)]
pub struct L2fwdConfig {
    /// Receiving interface (the node's client-facing end).
    pub rx_iface: String,
    /// Transmitting interface (the node's backend-facing end).
    pub tx_iface: String,
    /// Source MAC to write (the tx interface's).
    pub src_mac: [u8; 6],
    /// Destination MAC to write (the backend's).
    pub dst_mac: [u8; 6],
    /// Stop after this long.
    pub duration: Duration,
    /// `SCHED_FIFO` priority (juneau-dataplane's `--worker-priority`): realtime, it sleeps
    /// in `poll(2)` when its RX ring is empty, as juneau's workers do; 0: normal policy,
    /// busy spinning.
    pub worker_priority: u8,
}

/// Counters of the forwarder.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct L2fwdResult {
    /// Frames received.
    pub received: u64,
    /// Frames transmitted.
    pub forwarded: u64,
}

/// Runs the forwarder. `register` is called with the RX socket's fd so the caller can put
/// it into the steering program's XSKMAP.
pub fn l2fwd(
    cfg: &L2fwdConfig,
    stop: &AtomicBool,
    register: impl FnOnce(std::os::fd::RawFd) -> Result<()>,
) -> Result<L2fwdResult> {
    use std::os::fd::AsRawFd;
    // As juneau's worker: `--frames-per-iface` for each of its two sockets in one UMEM.
    const FRAMES: u32 = 2 * DEFAULT_FRAMES_PER_IFACE;
    let (umem, descs) = umem(FRAMES, L2FWD_FRAME_SIZE, L2FWD_RING)?;
    // SAFETY: the UMEM outlives both sockets; the two sockets are on different interfaces
    // and share the UMEM, each with its own fill and completion queue.
    let (_rx_tx, mut rx, rx_fq_cq) = unsafe {
        Socket::new(
            socket_config(false, L2FWD_RING)?,
            &umem,
            &cfg.rx_iface
                .parse()
                .map_err(|e| anyhow!("interface name: {e:?}"))?,
            0,
        )
    }
    .map_err(|e| anyhow!("creating AF_XDP socket on {}: {e}", cfg.rx_iface))?;
    // SAFETY: as above.
    let (mut tx, _tx_rx, tx_fq_cq) = unsafe {
        Socket::new(
            socket_config(false, L2FWD_RING)?,
            &umem,
            &cfg.tx_iface
                .parse()
                .map_err(|e| anyhow!("interface name: {e:?}"))?,
            0,
        )
    }
    .map_err(|e| anyhow!("creating AF_XDP socket on {}: {e}", cfg.tx_iface))?;
    let (mut fq, _rx_cq) = rx_fq_cq.context("RX socket without fill queue")?;
    let (_tx_fq, mut cq) = tx_fq_cq.context("TX socket without completion queue")?;
    register(rx.fd().as_raw_fd())?;

    // SAFETY: the frames are fresh from this UMEM.
    let filled = unsafe { fq.produce(&descs[..L2FWD_RING as usize]) };
    let mut spare: Vec<FrameDesc> = descs[filled..].to_vec();
    // Frames in the fill ring or the RX ring (handed to the kernel, not received back).
    let mut held = filled;
    let mut rx_buf = vec![FrameDesc::default(); 2 * BATCH];
    let mut cq_buf = vec![FrameDesc::default(); 256];
    let mut res = L2fwdResult::default();
    let start = Instant::now();
    let mut iter = 0u32;
    let mut next_report = Duration::from_secs(1);
    let (mut in_flight, mut unsent) = (0usize, 0usize);
    let realtime = juneau_dataplane::sched::enter_worker(cfg.worker_priority, 0);
    while !stop.load(Ordering::Relaxed) {
        iter = iter.wrapping_add(1);
        if iter & 1023 == 0 {
            let el = start.elapsed();
            if el >= cfg.duration {
                break;
            }
            if el >= next_report {
                next_report += Duration::from_secs(1);
                let st = rx.fd().xdp_statistics().ok();
                eprintln!(
                    "l2fwd: received {} forwarded {} | rx_dropped {:?} rx_ring_full {:?} fill_empty {:?} tx_invalid {:?}",
                    res.received,
                    res.forwarded,
                    st.as_ref().map(|s| s.rx_dropped()),
                    st.as_ref().map(|s| s.rx_ring_full()),
                    st.as_ref().map(|s| s.rx_fill_ring_empty_descs()),
                    st.as_ref().map(|s| s.tx_invalid_descs()),
                );
            }
        }
        // Completed transmissions go back to the fill ring (plus any spare frames).
        // SAFETY: completion descriptors are frames of this UMEM.
        let n = unsafe { cq.consume(&mut cq_buf) };
        in_flight = in_flight.saturating_sub(n);
        spare.extend_from_slice(&cq_buf[..n]);
        let want = (L2FWD_RING as usize).saturating_sub(held).min(spare.len());
        if want > 0 {
            // A produce larger than the free space puts nothing: offer what fits.
            let room = (fq.nb_free(want as u32) as usize).min(want);
            let from = spare.len() - room;
            // SAFETY: spare frames are owned by us and in no ring.
            let put = unsafe { fq.produce(&spare[from..]) };
            spare.truncate(spare.len() - put);
            held += put;
        }
        // (Copy mode on veth fills from the XDP redirect path itself: no fill-ring wakeup.)
        // SAFETY: received descriptors are frames of this UMEM.
        let got = unsafe { rx.consume(&mut rx_buf) };
        if got > 0 {
            res.received += got as u64;
            held = held.saturating_sub(got);
            for d in rx_buf[..got].iter_mut() {
                // SAFETY: a received frame is ours until we hand it to a ring.
                let mut data = unsafe { umem.data_mut(d) };
                let b = data.contents_mut();
                if b.len() >= 12 {
                    b[0..6].copy_from_slice(&cfg.dst_mac);
                    b[6..12].copy_from_slice(&cfg.src_mac);
                }
            }
            // SAFETY: the frames are ours and go to exactly one ring.
            let sent = unsafe { tx.produce(&rx_buf[..got]) };
            res.forwarded += sent as u64;
            in_flight += sent;
            unsent += sent;
            spare.extend_from_slice(&rx_buf[sent..got]);
        }
        // Keep kicking TX while frames are outstanding: copy mode transmits only inside
        // sendto(), at most 32 frames per call.
        if in_flight > 0 {
            for _ in 0..unsent.div_ceil(BATCH).max(1) {
                if tx.wakeup().is_err() {
                    break;
                }
            }
            unsent = 0;
        }
        if got == 0 && realtime {
            // The same wake-up policy as juneau's realtime workers (`runtime::worker::idle`).
            let mut pfd = libc::pollfd {
                fd: rx.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let timeout_ms = if in_flight > 0 { 1 } else { 10 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        }
    }
    Ok(res)
}
