//! Who holds each UMEM frame, so the frames of a torn-down AF_XDP socket come back.
//!
//! All sockets share one UMEM. A frame is either on the free stack (userspace) or handed
//! to the kernel through one socket's fill ring or TX ring. When a socket is closed
//! (its interface went away), the frames it held — in its fill ring, in its RX ring not
//! yet read, in its TX ring or completion ring — are never returned by the kernel. The
//! pool records the socket (`owner`) a frame was last handed to; closing socket `s`
//! reclaims every frame whose owner is `s` and which is not on the free stack. Handing a
//! frame over costs one store; reclaiming is O(frames) and happens only on close.
//!
//! Frames are identified by their UMEM address (`addr >> log2(frame_size)` is the frame
//! number); the pool is generic over the descriptor type so it is unit-tested without a
//! kernel.

/// A frame descriptor: anything with a UMEM address.
pub trait FrameAddr: Copy {
    /// Offset of the frame's data in the UMEM.
    fn addr(&self) -> usize;
}

impl FrameAddr for xsk_rs::FrameDesc {
    #[inline]
    fn addr(&self) -> usize {
        xsk_rs::FrameDesc::addr(self)
    }
}

impl FrameAddr for usize {
    #[inline]
    fn addr(&self) -> usize {
        *self
    }
}

/// The owner of a frame nobody in the kernel holds.
pub const NO_OWNER: u32 = u32::MAX;

/// The free stack and the last holder of every frame.
#[derive(Debug)]
pub struct FramePool<D: FrameAddr> {
    /// log2 of the frame size (a power of two, as AF_XDP's aligned chunks are): a frame's
    /// number is a shift of its address, not a 64-bit division per frame handed over.
    frame_shift: u32,
    /// One descriptor per frame, by frame number (used to rebuild reclaimed ones).
    all: Vec<D>,
    /// The socket each frame was last handed to (`NO_OWNER` if never).
    owner: Vec<u32>,
    /// Frames in userspace, ready to hand out.
    pub free: Vec<D>,
    /// Frames reclaimed from closed sockets, in total.
    pub reclaimed: u64,
}

impl<D: FrameAddr> FramePool<D> {
    /// A pool holding every frame of `descs` (all free); `frame_size` a power of two.
    pub fn new(descs: Vec<D>, frame_size: usize) -> Self {
        assert!(frame_size.is_power_of_two(), "frame size {frame_size}");
        let mut all = descs.clone();
        all.sort_by_key(|d| d.addr());
        FramePool {
            frame_shift: frame_size.trailing_zeros(),
            owner: vec![NO_OWNER; all.len()],
            all,
            free: descs,
            reclaimed: 0,
        }
    }

    /// Number of frames in the UMEM.
    pub fn total(&self) -> usize {
        self.all.len()
    }

    #[inline]
    fn index(&self, d: &D) -> usize {
        d.addr() >> self.frame_shift
    }

    /// Records that these frames were handed to the kernel through socket `socket`.
    #[inline]
    pub fn hand_over(&mut self, socket: u32, frames: &[D]) {
        for d in frames {
            let i = d.addr() >> self.frame_shift;
            if let Some(o) = self.owner.get_mut(i) {
                *o = socket;
            }
        }
    }

    /// Moves the last `n` frames of the free stack to socket `socket` (after the
    /// socket's fill ring took them).
    #[inline]
    pub fn take_free_tail(&mut self, socket: u32, n: usize) {
        let from = self.free.len() - n.min(self.free.len());
        for k in from..self.free.len() {
            let i = self.index(&self.free[k]);
            if let Some(o) = self.owner.get_mut(i) {
                *o = socket;
            }
        }
        self.free.truncate(from);
    }

    /// Socket `socket` was closed: every frame it held that is not on the free stack
    /// (nor in `in_transit`, frames userspace holds elsewhere at this moment) goes back
    /// on the free stack. Returns how many.
    pub fn reclaim(&mut self, socket: u32, in_transit: &[D]) -> usize {
        let mut in_userspace = vec![false; self.all.len()];
        for d in self.free.iter().chain(in_transit) {
            if let Some(u) = in_userspace.get_mut(d.addr() >> self.frame_shift) {
                *u = true;
            }
        }
        let mut n = 0;
        for ((o, d), used) in self.owner.iter_mut().zip(&self.all).zip(&in_userspace) {
            if *o == socket {
                *o = NO_OWNER;
                if !used {
                    self.free.push(*d);
                    n += 1;
                }
            }
        }
        self.reclaimed += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_of_a_closed_socket_come_back_and_nothing_else() {
        let fs = 4096;
        let mut p = FramePool::new((0..16).map(|i| i * fs + 256).collect(), fs);
        assert_eq!(p.total(), 16);
        // Socket 1's fill ring takes 6 frames, socket 2's takes 4.
        p.take_free_tail(1, 6);
        p.take_free_tail(2, 4);
        assert_eq!(p.free.len(), 6);
        // Socket 1 receives 3 frames: one is dropped (back to free), two are sent on
        // socket 2's TX ring; one of those completes (back to free).
        let rx: Vec<usize> = (10..13).map(|i| i * fs + 256).collect();
        p.free.push(rx[0]);
        p.hand_over(2, &rx[1..]);
        p.free.push(rx[1]);
        // Socket 2 goes away: it held its 4 fill frames and rx[2] (in its TX ring).
        assert_eq!(p.reclaim(2, &[]), 5);
        assert_eq!(p.free.len(), 6 + 2 + 5);
        // Socket 1 goes away: 3 of its 6 fill frames were received and moved on.
        assert_eq!(p.reclaim(1, &[]), 3);
        assert_eq!(p.free.len(), 16);
        let mut addrs: Vec<usize> = p.free.clone();
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), 16, "no frame twice");
        assert_eq!(p.reclaim(1, &[]), 0, "idempotent");
        assert_eq!(p.reclaimed, 8);
    }

    #[test]
    fn frames_in_transit_are_not_reclaimed() {
        let fs = 2048;
        let mut p = FramePool::new((0..4).map(|i| i * fs).collect(), fs);
        p.take_free_tail(7, 4);
        let transit = [fs];
        assert_eq!(p.reclaim(7, &transit), 3);
        assert_eq!(p.free.len(), 3);
    }
}
