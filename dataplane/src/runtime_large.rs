//! Packets that do not fit one frame of their egress: multi-buffer packets (a Pod's
//! TSO/GSO super-segment or a GRO'd segment reaches the steering program as one packet
//! of up to 64 KiB; the sockets are bound with `XDP_USE_SG`, so the kernel hands it over
//! as a chain of frames, `XDP_PKT_CONTD` on all but the last), and single frames longer
//! than the egress interface takes. Either is gathered into the worker's contiguous
//! buffer, decided by the engine like any packet, and leaves as frames cut to the
//! egress ([`crate::segment`]). Off the common path: a frame that fits its egress never
//! comes here.

use super::*;
use crate::segment::{Cut, CutError};

/// Bytes of the worker's gathering buffer: the largest IPv4 packet plus its Ethernet
/// header (BIG TCP, above 64 KiB, is not supported: such a chain is dropped as
/// `too_big`).
pub(super) const GATHER_MAX: usize = 65_535 + packet::ETH_HEADER_LEN;

/// Usable bytes of one UMEM frame (4 KiB less the kernel's XDP headroom).
pub(super) const FRAME_CAPACITY: usize = 4096 - 256;

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

/// Queues `frame` (already rewritten) on socket `j`: as one frame when it fits the
/// interface, otherwise cut into TCP segments (at most the client's MSS for a reply)
/// or IPv4 fragments. Whatever cannot leave is counted under a named reason.
pub(super) fn emit(
    engine: &mut Engine,
    frame: &[u8],
    j: usize,
    now_ms: u64,
    out: &mut Out<'_, '_>,
) {
    let limit = out.limits.get(j).copied().unwrap_or(FRAME_CAPACITY);
    if frame.len() <= limit {
        let Some(mut d) = out.pool.free.pop() else {
            engine.counters_mut().drop(DropReason::NoFreeFrame);
            return;
        };
        put(out.umem, &mut d, |buf| {
            buf[..frame.len()].copy_from_slice(frame);
            frame.len()
        });
        out.pending[j].push(d);
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
        Err(CutError::DontFragment | CutError::NoRoom) => {
            return engine.counters_mut().drop(DropReason::TooBig)
        }
    };
    for i in 0..cut.pieces() {
        let Some(mut d) = out.pool.free.pop() else {
            engine.counters_mut().drop(DropReason::NoFreeFrame);
            return;
        };
        put(out.umem, &mut d, |buf| cut.write(frame, i, buf));
        out.pending[j].push(d);
    }
    engine.counters_mut().segmented += 1;
    engine.counters_mut().segments += cut.pieces() as u64;
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

/// The largest frame an interface takes: its MTU plus the Ethernet header, at most a
/// frame's capacity (a jumbo interface gets TCP segments and fragments of one frame).
pub(super) fn frame_limit(ifname: &str) -> usize {
    let mtu = std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(1500);
    (mtu + packet::ETH_HEADER_LEN).min(FRAME_CAPACITY)
}
