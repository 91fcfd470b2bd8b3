//! Packets that do not fit one frame of their egress: multi-buffer packets (a Pod's
//! TSO/GSO super-segment or a GRO'd segment reaches the steering program as one packet
//! of up to 64 KiB; the sockets are bound with `XDP_USE_SG`, so the kernel hands it over
//! as a chain of frames, `XDP_PKT_CONTD` on all but the last), and single frames longer
//! than the egress interface takes. Either is gathered into the worker's contiguous
//! buffer, decided by the engine like any packet, and leaves as frames cut to the
//! egress ([`crate::segment`]). Off the common path: a frame that fits its egress never
//! comes here.

use xsk_rs::{FrameDesc, Umem};

use crate::counters::DropReason;
use crate::engine::{Engine, Verdict};
use crate::frames::FramePool;
use crate::neigh::{Neighbours, Side};
use crate::segment::{Cut, CutError};

/// Bytes of the worker's gathering buffer: the largest IPv4 packet plus its Ethernet
/// header (BIG TCP, above 64 KiB, is not supported: such a chain is dropped as
/// `too_big`).
pub(super) const GATHER_MAX: usize = 65_535 + packet::ETH_HEADER_LEN;

/// Usable bytes of one UMEM frame (less the kernel's XDP headroom).
pub(super) const FRAME_CAPACITY: usize = super::FRAME_SIZE as usize - 256;

/// `XDP_PKT_CONTD` in a descriptor's options: more frames of this packet follow.
pub(super) const XDP_PKT_CONTD: u32 = 1;

use crate::packet;

/// Where the frames a large packet becomes go.
pub(super) struct Out<'a, 'u> {
    pub pool: &'a mut FramePool<FrameDesc>,
    pub umem: &'u Umem,
    pub pending: &'a mut [Vec<FrameDesc>],
    /// Largest frame each of the worker's sockets' interface takes, by socket.
    pub limits: &'a [usize],
    /// A piece of a cut packet longer than one UMEM frame, before it is spread.
    pub scratch: &'a mut [u8],
    pub nb: &'a Neighbours,
    pub egress: &'a [Option<usize>],
    pub sources: &'a mut NodeSources,
}

/// Copies a chain's frames, in order, into `buf` and returns them to the free stack
/// (options cleared). `None` when the packet is larger than `buf`.
pub(super) fn gather(
    chain: &mut Vec<FrameDesc>,
    umem: &Umem,
    pool: &mut FramePool<FrameDesc>,
    buf: &mut [u8],
) -> Option<usize> {
    let mut len = 0;
    let mut fits = true;
    for d in chain.iter_mut() {
        // SAFETY: the frame came off the RX ring: the kernel no longer touches it and
        // nothing else in userspace refers to it until it goes back to the free stack
        // below.
        let data = unsafe { umem.data(d) };
        let c = data.contents();
        match buf.get_mut(len..len + c.len()) {
            Some(dst) if fits => {
                dst.copy_from_slice(c);
                len += c.len();
            }
            _ => fits = false,
        }
        d.set_options(0);
        pool.free.push(*d);
    }
    chain.clear();
    fits.then_some(len)
}

/// A gathered multi-buffer packet: the engine's verdict, then the frames that leave.
#[allow(clippy::too_many_arguments)]
pub(super) fn chain(
    engine: &mut Engine,
    packet: &mut [u8],
    ingress: Side,
    nb: &Neighbours,
    egress: &[Option<usize>],
    now_ms: u64,
    out: &mut Out<'_, '_>,
) {
    let verdict = engine.process(packet, ingress, nb, now_ms);
    let j = match verdict {
        Verdict::Tx(side) => super::worker::socket_of(engine, side, egress),
        Verdict::Pass(_) => {
            engine.counters_mut().drop(DropReason::KernelBound);
            None
        }
        // A redirect (a lone SYN, or a decapsulated packet) never spans frames.
        Verdict::Redirect | Verdict::TxResized(..) => {
            engine.counters_mut().drop(DropReason::TooBig);
            None
        }
        Verdict::Drop(_) | Verdict::Consumed => None,
    };
    if let Some(j) = j {
        emit(engine, packet, j, now_ms, out);
    }
}

/// Queues `frame` (already rewritten) on socket `j`: whole when it fits the interface
/// (over several descriptors when longer than a UMEM frame), otherwise cut into TCP
/// segments (at most the client's MSS for a reply) or IPv4 fragments; a non-TCP packet
/// with DF set is dropped and its sender told the MTU. Whatever cannot leave is counted
/// under a named reason.
pub(super) fn emit(
    engine: &mut Engine,
    frame: &[u8],
    j: usize,
    now_ms: u64,
    out: &mut Out<'_, '_>,
) {
    let limit = out.limits.get(j).copied().unwrap_or(FRAME_CAPACITY);
    if frame.len() <= limit {
        if !queue(out.pool, out.umem, &mut out.pending[j], frame) {
            engine.counters_mut().drop(DropReason::NoFreeFrame);
        }
        return;
    }
    // A reply towards a client: its SYN said how much a segment may carry.
    let mss = if j == 0 {
        engine.client_mss(frame, now_ms)
    } else {
        None
    };
    let cut = match Cut::plan(frame, limit, mss) {
        Ok(c) => c,
        Err(CutError::Malformed) => return engine.counters_mut().drop(DropReason::Malformed),
        Err(CutError::DontFragment) => {
            engine.counters_mut().drop(DropReason::TooBig);
            return tell_the_mtu(engine, frame, j, limit, now_ms, out);
        }
        Err(CutError::NoRoom) => return engine.counters_mut().drop(DropReason::TooBig),
    };
    for i in 0..cut.pieces() {
        let queued = if limit <= FRAME_CAPACITY {
            match out.pool.free.pop() {
                Some(mut d) => {
                    put(out.umem, &mut d, |buf| cut.write(frame, i, buf));
                    out.pending[j].push(d);
                    true
                }
                None => false,
            }
        } else {
            let n = cut.write(frame, i, out.scratch);
            let piece = &out.scratch[..n];
            queue(out.pool, out.umem, &mut out.pending[j], piece)
        };
        if !queued {
            engine.counters_mut().drop(DropReason::NoFreeFrame);
            return;
        }
    }
    engine.counters_mut().segmented += 1;
    engine.counters_mut().segments += cut.pieces() as u64;
}

/// Queues `bytes` as one packet: one frame, or — longer than a frame, on a socket bound
/// with `XDP_USE_SG` — consecutive frames, `XDP_PKT_CONTD` on all but the last (the TX
/// ring takes them together, see `worker::transmit`). `false`, nothing queued, when the
/// free stack holds too few frames.
fn queue(
    pool: &mut FramePool<FrameDesc>,
    umem: &Umem,
    pending: &mut Vec<FrameDesc>,
    bytes: &[u8],
) -> bool {
    let n = bytes.len().div_ceil(FRAME_CAPACITY).max(1);
    if pool.free.len() < n {
        return false;
    }
    for (k, chunk) in bytes.chunks(FRAME_CAPACITY).enumerate() {
        let Some(mut d) = pool.free.pop() else {
            return false; // checked above
        };
        put(umem, &mut d, |buf| {
            buf[..chunk.len()].copy_from_slice(chunk);
            chunk.len()
        });
        if k + 1 < n {
            d.set_options(XDP_PKT_CONTD);
        }
        pending.push(d);
    }
    true
}

/// An oversized packet with DF set was dropped: its sender gets an ICMP "fragmentation
/// needed" with the egress MTU (rate-limited per worker, see `Engine::frag_needed`).
fn tell_the_mtu(
    engine: &mut Engine,
    frame: &[u8],
    j: usize,
    limit: usize,
    now_ms: u64,
    out: &mut Out<'_, '_>,
) {
    let mtu = limit
        .saturating_sub(packet::ETH_HEADER_LEN)
        .min(usize::from(u16::MAX)) as u16;
    let mut err = [0u8; crate::icmp::FRAG_NEEDED_MAX];
    let sources = &mut *out.sources;
    let source = |pod: u32| sources.toward(pod, now_ms);
    let Some((side, n)) = engine.frag_needed(frame, j != 0, mtu, source, out.nb, now_ms, &mut err)
    else {
        return;
    };
    let Some(k) = super::worker::socket_of(engine, side, out.egress) else {
        return;
    };
    if !queue(out.pool, out.umem, &mut out.pending[k], &err[..n]) {
        engine.counters_mut().drop(DropReason::NoFreeFrame);
    }
}

/// The node's address the kernel picks as the source towards a Pod (what Linux's
/// `icmp_send` uses for an error about a forwarded packet), by Pod address, kept 10 s.
/// Looked up with a connected UDP socket (no packet sent); only for ICMP errors, which
/// are rate-limited, so the syscalls are bounded.
#[derive(Default)]
pub(super) struct NodeSources {
    /// (Pod, source, when looked up).
    entries: Vec<(u32, u32, u64)>,
}

impl NodeSources {
    const KEEP_MS: u64 = 10_000;
    const MAX: usize = 64;

    fn toward(&mut self, pod: u32, now_ms: u64) -> Option<u32> {
        self.entries
            .retain(|e| now_ms.saturating_sub(e.2) < Self::KEEP_MS);
        if let Some(e) = self.entries.iter().find(|e| e.0 == pod) {
            return Some(e.1);
        }
        let s = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).ok()?;
        s.connect((std::net::Ipv4Addr::from(pod), 9)).ok()?;
        let std::net::SocketAddr::V4(a) = s.local_addr().ok()? else {
            return None;
        };
        if self.entries.len() >= Self::MAX {
            self.entries.remove(0);
        }
        self.entries.push((pod, u32::from(*a.ip()), now_ms));
        Some(u32::from(*a.ip()))
    }
}

/// Writes a free frame's contents with `write` (which returns the length written).
fn put(umem: &Umem, d: &mut FrameDesc, write: impl FnOnce(&mut [u8]) -> usize) {
    d.set_options(0);
    // SAFETY: a frame from the free stack is in no ring and referenced by nothing else.
    let mut data = unsafe { umem.data_mut(d) };
    let mut c = data.cursor();
    let cap = c.buf_len();
    c.set_pos(cap);
    let n = write(data.contents_mut());
    data.cursor().set_pos(n);
}

/// Most descriptors one transmitted packet spans: copy mode builds an skb of one linear
/// part and at most `MAX_SKB_FRAGS` (17 by default) pages and refuses a packet of more
/// (`net/xdp/xsk.c`); 16 keeps a margin.
pub(super) const MAX_TX_DESCS: usize = 16;

/// The largest frame an interface takes: its MTU plus the Ethernet header, at most one
/// frame's capacity on a socket bound without `XDP_USE_SG` (a jumbo interface then gets
/// TCP segments and fragments of one frame), at most [`MAX_TX_DESCS`] frames with it.
pub(super) fn frame_limit(ifname: &str, sg: bool) -> usize {
    let mtu = std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(1500);
    let most = if sg { MAX_TX_DESCS } else { 1 } * FRAME_CAPACITY;
    (mtu + packet::ETH_HEADER_LEN).min(most)
}
