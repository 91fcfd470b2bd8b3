//! The XDP fast path's shared state: one worker's part of the `fast_slots` map of
//! `bpf/steer.c` (docs/dataplane.md, "XDP fast path").
//!
//! The steering program forwards packets of established flows itself (client to
//! backend: DNAT, TTL, checksums, MACs, `XDP_REDIRECT`) when the flow's record was checked
//! against the service table this part was last published for. The part is a head
//! ([`FastHead`]: a sequence word, the service-table generation, the timeouts the program
//! refreshes expiries with) and one [`FastSlot`] per `(service, backend)` slot of that
//! table: the egress interface and MACs towards the backend, and the packets and bytes the
//! program forwarded for it, which the worker folds into its service counters.
//!
//! One writer per part (its worker); the program only reads the head and the slots' first
//! fields and adds to their counters. Publishing is a seqlock: the sequence word is odd
//! while the slots are rewritten, and the program, which reads it before and after its
//! decision, then leaves the packet to userspace.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::flow::Timeouts;
use crate::region::Region;

/// Slots per worker's part after its head (`FAST_SLOTS` in `bpf/steer.c`). Flows of a
/// slot beyond it take the userspace path.
pub const SLOTS_PER_TABLE: usize = 32_767;
/// Entries of one worker's part (`FAST_STRIDE`).
pub const STRIDE: usize = SLOTS_PER_TABLE + 1;

/// One `(service, backend)` slot (`struct fast_slot`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct FastSlot {
    /// Equal to the head's generation: the slot may be used.
    generation: u32,
    /// Egress interface towards the backend (one that takes XDP frames).
    ifindex: u32,
    /// Destination MAC then source MAC.
    macs: [u8; 12],
    reserved: u32,
    packets_in: u64,
    bytes_in: u64,
    packets_out: u64,
    bytes_out: u64,
    reserved2: u64,
}

const _: () = assert!(std::mem::size_of::<FastSlot>() == 64);

/// The head of a part (`struct fast_head`), stored in its first [`FastSlot`].
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct FastHead {
    /// Odd while the slots are rewritten; 0 before the first publication.
    seq: u32,
    generation: u32,
    established_ms: u32,
    udp_ms: u32,
    reserved: [u32; 12],
}

const _: () = assert!(std::mem::size_of::<FastHead>() == std::mem::size_of::<FastSlot>());

/// Where the program may send a slot's packets: `(ifindex, destination + source MAC)`;
/// `None` leaves the slot's flows to userspace.
pub type Egress = Option<(u32, [u8; 12])>;

/// A worker's part of `fast_slots`.
#[derive(Debug)]
pub struct FastPath {
    part: Region<FastSlot>,
    /// What was last published (generation, slots), to skip identical publications.
    published: Option<(u32, Vec<Egress>)>,
    /// Packets the program forwarded, folded so far.
    packets: u64,
}

impl FastPath {
    /// Takes a part ([`STRIDE`] entries) and turns it off until [`FastPath::publish`].
    pub fn new(part: Region<FastSlot>) -> Self {
        assert_eq!(part.len(), STRIDE, "a fast-path part has {STRIDE} entries");
        let mut f = FastPath {
            part,
            published: None,
            packets: 0,
        };
        f.disable();
        f
    }

    /// A part in heap memory (tests, and runs without the steering program).
    pub fn heap() -> Self {
        Self::new(Region::heap(STRIDE, FastSlot::default()))
    }

    /// Entry `i` of the part (0: the head). Entries are only ever accessed through raw
    /// pointers, field by field: the program writes the counters of the same entries
    /// concurrently, so no Rust reference to a whole entry is made.
    fn entry(&self, i: usize) -> *mut FastSlot {
        assert!(i < STRIDE, "entry {i} of a {STRIDE}-entry part");
        (self.part.as_ptr() as *mut FastSlot).wrapping_add(i)
    }

    fn seq(&self) -> &AtomicU32 {
        let p = self.entry(0) as *mut FastHead;
        // SAFETY: entry 0 is a `FastHead` (same size, alignment of u32 satisfied by the
        // 64-byte entry); the region lives as long as `self`; the program reads the word
        // concurrently, so it is only accessed atomically.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*p).seq)) }
    }

    /// Whether the program may use this part now.
    pub fn is_published(&self) -> bool {
        let s = self.seq().load(Ordering::Acquire);
        s != 0 && s & 1 == 0
    }

    /// Stops the program from using this part (the service table is about to change).
    pub fn disable(&mut self) {
        let s = self.seq();
        let v = s.load(Ordering::Relaxed);
        if v & 1 == 0 {
            s.store(v.wrapping_add(1), Ordering::Relaxed);
            // Orders the odd word before any slot write that follows.
            fence(Ordering::Release);
        }
    }

    /// Publishes the slots of service-table `generation` (slot `i` of the table is
    /// `slots[i]`; slots past [`SLOTS_PER_TABLE`] are not published). Nothing is written
    /// when the same content is already published.
    pub fn publish(&mut self, generation: u32, timeouts: &Timeouts, slots: &[Egress]) {
        let slots = &slots[..slots.len().min(SLOTS_PER_TABLE)];
        if self.is_published()
            && self
                .published
                .as_ref()
                .is_some_and(|(g, s)| *g == generation && s == slots)
        {
            return;
        }
        self.disable();
        let old = self.published.as_ref().map_or(0, |(_, s)| s.len());
        for i in 0..slots.len().max(old) {
            let e = self.entry(1 + i);
            let (g, ifindex, macs) = match slots.get(i).copied().flatten() {
                Some((ifindex, macs)) => (generation, ifindex, macs),
                None => (generation.wrapping_add(1), 0, [0; 12]),
            };
            // Field by field: the counters of the same entry are the program's.
            // SAFETY: `e` points into the region we own (checked index); plain stores to
            // fields only this writer stores to; the program only reads them (and the
            // seqlock makes it ignore torn values).
            unsafe {
                std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).ifindex), ifindex);
                std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).macs), macs);
                std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).generation), g);
            }
        }
        let head = self.entry(0) as *mut FastHead;
        // SAFETY: entry 0 is the head (see `seq`); only this writer stores to these
        // fields.
        unsafe {
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*head).generation), generation);
            std::ptr::write_volatile(
                std::ptr::addr_of_mut!((*head).established_ms),
                timeouts.tcp_established_ms,
            );
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*head).udp_ms), timeouts.udp_ms);
        }
        let s = self.seq();
        let v = s.load(Ordering::Relaxed);
        s.store(v.wrapping_add(1), Ordering::Release);
        self.published = Some((generation, slots.to_vec()));
    }

    /// Takes the packets and bytes the program forwarded per slot since the last fold:
    /// `add(slot, packets, bytes)` for each slot with packets, in the numbering of the
    /// table last published.
    pub fn fold(&mut self, mut add: impl FnMut(usize, u64, u64)) {
        let n = self.published.as_ref().map_or(0, |(_, s)| s.len());
        let mut total = 0;
        for i in 0..n {
            let (p, b) = self.counters(1 + i);
            if p.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let packets = p.swap(0, Ordering::Relaxed);
            let bytes = b.swap(0, Ordering::Relaxed);
            total += packets;
            add(i, packets, bytes);
        }
        self.packets += total;
    }

    /// Entry `i`'s forward counters (packets, bytes).
    fn counters(&self, i: usize) -> (&AtomicU64, &AtomicU64) {
        let e = self.entry(i);
        // SAFETY: 8-byte aligned counters in memory we own for as long as `self`; the
        // program adds to them atomically, so they are only accessed atomically.
        unsafe {
            (
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*e).packets_in)),
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*e).bytes_in)),
            )
        }
    }

    /// Packets the program forwarded through this part, as folded so far.
    pub fn packets(&self) -> u64 {
        self.packets
    }

    /// The program's view of slot `i`: `(usable for generation, ifindex, macs)`.
    #[cfg(test)]
    fn slot(&self, i: usize) -> (bool, u32, [u8; 12]) {
        let head = self.entry(0) as *const FastHead;
        let e = self.entry(1 + i);
        // SAFETY: entries of the region we own (checked indexes); volatile reads of
        // fields only this writer stores to.
        unsafe {
            let g = std::ptr::read_volatile(std::ptr::addr_of!((*head).generation));
            (
                std::ptr::read_volatile(std::ptr::addr_of!((*e).generation)) == g,
                std::ptr::read_volatile(std::ptr::addr_of!((*e).ifindex)),
                std::ptr::read_volatile(std::ptr::addr_of!((*e).macs)),
            )
        }
    }

    /// Adds to slot `i`'s counters as the program does.
    #[cfg(test)]
    fn count(&mut self, i: usize, packets: u64, bytes: u64) {
        let (p, b) = self.counters(1 + i);
        p.fetch_add(packets, Ordering::Relaxed);
        b.fetch_add(bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MACS: [u8; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

    #[test]
    fn a_new_part_is_off_until_published_and_off_again_while_rewritten() {
        let mut f = FastPath::heap();
        assert!(!f.is_published());
        f.publish(7, &Timeouts::default(), &[Some((3, MACS)), None]);
        assert!(f.is_published());
        assert_eq!(f.slot(0), (true, 3, MACS));
        assert!(!f.slot(1).0, "a slot without egress is never usable");
        f.disable();
        assert!(!f.is_published());
        f.publish(8, &Timeouts::default(), &[None]);
        assert!(f.is_published());
        assert!(!f.slot(0).0);
        assert!(!f.slot(1).0, "a slot past the new table is not usable");
    }

    #[test]
    fn an_identical_publication_writes_nothing() {
        let mut f = FastPath::heap();
        f.publish(7, &Timeouts::default(), &[Some((3, MACS))]);
        let seq = f.seq().load(Ordering::Relaxed);
        f.publish(7, &Timeouts::default(), &[Some((3, MACS))]);
        assert_eq!(f.seq().load(Ordering::Relaxed), seq);
        f.publish(7, &Timeouts::default(), &[Some((4, MACS))]);
        assert_eq!(f.seq().load(Ordering::Relaxed), seq.wrapping_add(2));
        assert_eq!(f.slot(0), (true, 4, MACS));
    }

    #[test]
    fn folding_takes_each_count_once_and_keeps_the_total() {
        let mut f = FastPath::heap();
        f.publish(1, &Timeouts::default(), &[Some((3, MACS)), Some((3, MACS))]);
        f.count(1, 5, 500);
        let mut got = vec![];
        f.fold(|i, p, b| got.push((i, p, b)));
        assert_eq!(got, vec![(1, 5, 500)]);
        got.clear();
        f.fold(|i, p, b| got.push((i, p, b)));
        assert!(got.is_empty());
        assert_eq!(f.packets(), 5);
    }

    #[test]
    fn slots_past_the_part_are_left_to_userspace() {
        let mut f = FastPath::heap();
        let many = vec![Some((3, MACS)); SLOTS_PER_TABLE + 10];
        f.publish(1, &Timeouts::default(), &many);
        assert!(f.slot(SLOTS_PER_TABLE - 1).0);
        assert_eq!(
            f.published.as_ref().map(|(_, s)| s.len()),
            Some(SLOTS_PER_TABLE)
        );
    }
}
