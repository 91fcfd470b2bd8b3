//! The XDP fast path's shared state: one worker's part of the `fast_slots` map of
//! `bpf/steer.c` (docs/dataplane.md, "XDP fast path").
//!
//! The steering program forwards packets of established flows itself -- client to
//! backend (DNAT) and backend to client (reverse NAT): addresses, ports, TTL, checksums,
//! MACs, `XDP_REDIRECT` -- when the flow's record was checked against the service table
//! this part was last published for. The part is:
//! - a head ([`FastHead`]: a sequence word, the service-table generation, the timeouts the
//!   program refreshes expiries with, whether replies' partial checksums are completed,
//!   and the reply-egress epoch);
//! - one [`FastSlot`] per `(service, backend)` slot of that table: the egress interface
//!   and MACs towards the backend, and the packets and bytes the program forwarded for it
//!   in each direction, which the worker folds into its service counters;
//! - [`EGRESS_ENTRIES`] reply-egress entries ([`ReplyEgress`]), the worker's reply next-hop
//!   cache as the program may use it: where replies to a client address go. An entry is
//!   valid while its epoch equals the head's; the worker bumps the epoch whenever its own
//!   cache is cleared (new neighbours or routes).
//!
//! One writer per part (its worker); the program only reads the head, the entries' first
//! fields and adds to the slots' counters. Publishing is a seqlock: the sequence word is
//! odd while the slots are rewritten, and the program, which reads it before and after its
//! decision, then leaves the packet to userspace. Each reply-egress entry has its own
//! sequence word, for the same reason.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::flow::Timeouts;
use crate::region::Region;

/// Entries of one worker's part.
pub const STRIDE: usize = crate::abi::FAST_STRIDE;
/// Reply-egress entries at the end of each part: the engine's reply next-hop cache size.
pub const EGRESS_ENTRIES: usize = crate::abi::FAST_EGRESS;
/// Slots per worker's part after its head. Flows of a slot beyond it take the userspace
/// path.
pub const SLOTS_PER_TABLE: usize = crate::abi::FAST_SLOTS;

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
    /// Client-to-backend traffic: packets and bytes packed ([`TRAFFIC_PACKET`]).
    traffic_in: u64,
    /// Replies, packed the same way.
    traffic_out: u64,
    reserved2: [u64; 3],
}

/// One packet in a packed traffic counter: packets in the high 28 bits, bytes in the low
/// 36, so the program counts a packet and its bytes with one atomic add. The worker takes
/// the counters once a second (and at each table change): 2^28 packets and 64 GiB per slot
/// in between, 5 s of a 100 Gb/s link in bytes. A byte overflow would add one packet.
pub const TRAFFIC_PACKET: u64 = crate::abi::TRAFFIC_PACKET;

/// `(packets, bytes)` of a packed traffic counter.
#[inline]
pub fn unpack_traffic(v: u64) -> (u64, u64) {
    (v >> 36, v & (TRAFFIC_PACKET - 1))
}

const _: () = assert!(std::mem::size_of::<FastSlot>() == crate::abi::FAST_ENTRY_BYTES);

/// The head of a part (`struct fast_head`), stored in its first [`FastSlot`].
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct FastHead {
    /// Odd while the slots are rewritten; 0 before the first publication.
    seq: u32,
    generation: u32,
    established_ms: u32,
    udp_ms: u32,
    /// Reply-egress entries of another epoch are not used.
    egress_epoch: u32,
    /// 1: a reply whose L4 checksum is partial (pseudo-header only, as a Pod veth with tx
    /// offload hands it over) gets it completed; 0: every checksum is updated
    /// incrementally (`--trust-pod-checksums`).
    complete_partial: u32,
    reserved: [u32; 10],
}

const _: () = assert!(std::mem::size_of::<FastHead>() == std::mem::size_of::<FastSlot>());

/// One reply-egress entry (`struct fast_egress`), stored in a [`FastSlot`]'s place.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct ReplyEgress {
    /// Odd while the worker rewrites the entry.
    seq: u32,
    /// Equal to the head's `egress_epoch`: the entry may be used.
    epoch: u32,
    /// The client address (host order) replies go to.
    client: u32,
    /// Egress interface towards the client (one that takes XDP frames); 0: none.
    ifindex: u32,
    /// Destination MAC then source MAC.
    macs: [u8; 12],
    reserved: [u32; 9],
}

const _: () = assert!(std::mem::size_of::<ReplyEgress>() == std::mem::size_of::<FastSlot>());

/// The reply-egress entry of a client address: the engine's cache index
/// (`egress_index` in `bpf/steer.c`).
#[inline]
pub fn egress_index(client: u32) -> usize {
    (client.wrapping_mul(0x9e37_79b1) >> 24) as usize % EGRESS_ENTRIES
}

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
    /// Of those, replies.
    replies: u64,
}

impl FastPath {
    /// Takes a part ([`STRIDE`] entries) and turns it off until [`FastPath::publish`].
    pub fn new(part: Region<FastSlot>) -> Self {
        assert_eq!(part.len(), STRIDE, "a fast-path part has {STRIDE} entries");
        let mut f = FastPath {
            part,
            published: None,
            packets: 0,
            replies: 0,
        };
        f.disable();
        // A pinned part may hold another layout's entries here (slots of an older
        // version): no entry is usable until this worker publishes it.
        for i in 0..EGRESS_ENTRIES {
            let e = f.egress_entry(i);
            // SAFETY: an entry of the region we own (index below STRIDE); the part is off
            // (odd sequence word), so the program reads none of it.
            unsafe {
                std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).seq), 0);
                std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).ifindex), 0);
                std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).client), 0);
            }
        }
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
        self.enable();
        self.published = Some((generation, slots.to_vec()));
    }

    /// Ends a rewrite started by [`FastPath::disable`]: the sequence word even again.
    fn enable(&mut self) {
        let s = self.seq();
        let v = s.load(Ordering::Relaxed);
        if v & 1 == 1 {
            s.store(v.wrapping_add(1), Ordering::Release);
        }
    }

    /// Sets whether the program completes replies' partial checksums (the engine's
    /// `--trust-pod-checksums` off) or always updates them incrementally.
    pub fn set_complete_partial(&mut self, on: bool) {
        let head = self.entry(0) as *mut FastHead;
        let on = u32::from(on);
        // SAFETY: entry 0 is the head (see `seq`); only this writer stores to it.
        if unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*head).complete_partial)) } == on {
            return;
        }
        // SAFETY: as above.
        self.rewrite_head(|| unsafe {
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*head).complete_partial), on)
        });
    }

    /// Runs `write` (stores to head fields) with the part off, then turns it back on if
    /// it was on: a part never published stays off.
    fn rewrite_head(&mut self, write: impl FnOnce()) {
        let was_on = self.is_published();
        self.disable();
        write();
        if was_on {
            self.enable();
        }
    }

    /// The reply-egress entry `i` (`0..EGRESS_ENTRIES`), after the slots.
    fn egress_entry(&self, i: usize) -> *mut ReplyEgress {
        self.entry(1 + SLOTS_PER_TABLE + i) as *mut ReplyEgress
    }

    /// Makes every reply-egress entry unusable (the worker's own cache was cleared).
    pub fn clear_egress(&mut self) {
        let head = self.entry(0) as *mut FastHead;
        // SAFETY: entry 0 is the head (see `seq`); only this writer stores to it.
        self.rewrite_head(|| unsafe {
            let p = std::ptr::addr_of_mut!((*head).egress_epoch);
            std::ptr::write_volatile(p, std::ptr::read_volatile(p).wrapping_add(1));
        });
    }

    /// Publishes where replies to `client` go (the worker just resolved it): `None`
    /// leaves them to userspace. Overwrites the entry of another client with the same
    /// [`egress_index`].
    pub fn publish_egress(&mut self, client: u32, egress: Egress) {
        let e = self.egress_entry(egress_index(client));
        let head = self.entry(0) as *const FastHead;
        let (ifindex, macs) = egress.unwrap_or((0, [0; 12]));
        // SAFETY: `e` is a reply-egress entry of the region we own (index below STRIDE);
        // only this writer stores to it, the program reads it under its sequence word,
        // which is only accessed atomically.
        unsafe {
            let seq = AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).seq));
            let v = seq.load(Ordering::Relaxed) | 1;
            seq.store(v, Ordering::Relaxed);
            fence(Ordering::Release);
            let epoch = std::ptr::read_volatile(std::ptr::addr_of!((*head).egress_epoch));
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).client), client);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).ifindex), ifindex);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).macs), macs);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).epoch), epoch);
            seq.store(v.wrapping_add(1), Ordering::Release);
        }
    }

    /// Takes the packets and bytes the program forwarded per slot since the last fold:
    /// `add(slot, in, out)` for each slot with packets, `in` (client to backend) and
    /// `out` (replies) as `(packets, bytes)`, in the numbering of the table last
    /// published.
    pub fn fold(&mut self, mut add: impl FnMut(usize, (u64, u64), (u64, u64))) {
        let n = self.published.as_ref().map_or(0, |(_, s)| s.len());
        let (mut total, mut replies) = (0, 0);
        for i in 0..n {
            let [ti, to] = self.counters(1 + i);
            if ti.load(Ordering::Relaxed) == 0 && to.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let inward = unpack_traffic(ti.swap(0, Ordering::Relaxed));
            let outward = unpack_traffic(to.swap(0, Ordering::Relaxed));
            total += inward.0 + outward.0;
            replies += outward.0;
            add(i, inward, outward);
        }
        self.packets += total;
        self.replies += replies;
    }

    /// Entry `i`'s packed traffic counters: in, out.
    fn counters(&self, i: usize) -> [&AtomicU64; 2] {
        let e = self.entry(i);
        // SAFETY: 8-byte aligned counters in memory we own for as long as `self`; the
        // program adds to them atomically, so they are only accessed atomically.
        unsafe {
            [
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*e).traffic_in)),
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*e).traffic_out)),
            ]
        }
    }

    /// Packets the program forwarded through this part, as folded so far.
    pub fn packets(&self) -> u64 {
        self.packets
    }

    /// Of [`FastPath::packets`], the backends' replies.
    pub fn replies(&self) -> u64 {
        self.replies
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
        // As the program adds: one packet at a time.
        let [ti, to] = self.counters(1 + i);
        for _ in 0..packets {
            ti.fetch_add(TRAFFIC_PACKET | (bytes / packets), Ordering::Relaxed);
            to.fetch_add(
                (2 * TRAFFIC_PACKET) | (2 * bytes / packets),
                Ordering::Relaxed,
            );
        }
    }

    /// The program's view of the reply-egress entry for `client`: usable, ifindex, MACs.
    #[cfg(test)]
    fn egress(&self, client: u32) -> Option<(u32, [u8; 12])> {
        let e = self.egress_entry(egress_index(client)) as *const ReplyEgress;
        let head = self.entry(0) as *const FastHead;
        // SAFETY: entries of the region we own; volatile reads.
        unsafe {
            let usable = std::ptr::read_volatile(std::ptr::addr_of!((*e).seq)) & 1 == 0
                && std::ptr::read_volatile(std::ptr::addr_of!((*e).epoch))
                    == std::ptr::read_volatile(std::ptr::addr_of!((*head).egress_epoch))
                && std::ptr::read_volatile(std::ptr::addr_of!((*e).client)) == client
                && std::ptr::read_volatile(std::ptr::addr_of!((*e).ifindex)) != 0;
            usable.then(|| {
                (
                    std::ptr::read_volatile(std::ptr::addr_of!((*e).ifindex)),
                    std::ptr::read_volatile(std::ptr::addr_of!((*e).macs)),
                )
            })
        }
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
        f.fold(|i, a, b| got.push((i, a, b)));
        assert_eq!(got, vec![(1, (5, 500), (10, 1000))]);
        got.clear();
        f.fold(|i, a, b| got.push((i, a, b)));
        assert!(got.is_empty());
        assert_eq!((f.packets(), f.replies()), (15, 10));
    }

    #[test]
    fn packed_traffic_keeps_packets_and_bytes_apart() {
        assert_eq!(unpack_traffic(0), (0, 0));
        let v = 3 * TRAFFIC_PACKET + 1500 + 64 + 9000;
        assert_eq!(unpack_traffic(v), (3, 10_564));
        // A whole second of a 100 Gb/s link in 64-byte packets fits both fields.
        let pps = 148_809_524u64;
        let v = pps * (TRAFFIC_PACKET | 64);
        assert_eq!(unpack_traffic(v), (pps, pps * 64));
    }

    #[test]
    fn reply_egress_entries_hold_one_client_each_and_die_with_the_epoch() {
        let mut f = FastPath::heap();
        f.publish(1, &Timeouts::default(), &[]);
        let a: u32 = 0x0a00_0001;
        // Another client with the same entry.
        let b = (1..u32::MAX)
            .map(|i| a.wrapping_add(i))
            .find(|&c| egress_index(c) == egress_index(a))
            .expect("a colliding address");
        assert_eq!(f.egress(a), None, "nothing published yet");
        f.publish_egress(a, Some((3, MACS)));
        assert_eq!(f.egress(a), Some((3, MACS)));
        f.publish_egress(b, Some((4, MACS)));
        assert_eq!(f.egress(a), None, "overwritten by a colliding client");
        assert_eq!(f.egress(b), Some((4, MACS)));
        f.publish_egress(b, None);
        assert_eq!(
            f.egress(b),
            None,
            "an egress without XDP frames is not usable"
        );
        f.publish_egress(a, Some((3, MACS)));
        f.clear_egress();
        assert_eq!(f.egress(a), None, "cleared with the worker's cache");
        assert!(f.is_published(), "clearing keeps the part on");
        f.publish_egress(a, Some((3, MACS)));
        assert_eq!(f.egress(a), Some((3, MACS)));
    }

    #[test]
    fn the_partial_checksum_mode_is_in_the_head_and_keeps_the_part_on() {
        let mut f = FastPath::heap();
        f.set_complete_partial(true);
        assert!(!f.is_published(), "setting the mode does not publish");
        f.publish(1, &Timeouts::default(), &[]);
        f.set_complete_partial(false);
        assert!(f.is_published());
        let head = f.entry(0) as *const FastHead;
        // SAFETY: the head of a heap part.
        assert_eq!(unsafe { (*head).complete_partial }, 0);
        f.set_complete_partial(true);
        // SAFETY: as above.
        assert_eq!(unsafe { (*head).complete_partial }, 1);
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
