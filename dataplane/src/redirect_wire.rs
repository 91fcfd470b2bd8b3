//! The encapsulation of redirected packets between nodes: a view over frame bytes.
//!
//! ```text
//! Ethernet | IPv4 (node → node, DF, TTL 64, proto 17) | UDP (→ redirect port, checksum 0)
//!          | header: "JR" | version 2 | kind | flags | hop count n | 0 0 | cookie (8 bytes)
//!          | n × IPv4 address
//!          | kind 1 (packet): the original IPv4 packet, unchanged
//!          | kind 2 (notice): client, VIP (4 bytes each), client port, VIP port (2 each),
//!            protocol, 3 zero bytes — "the sender of this notice owns this flow"
//! ```
//!
//! The cookie (version 2, issue 25) is the first node's: a keyed hash of the flow it
//! asks about, carried unchanged by the nodes that pass the question on and echoed by
//! the owner in its notice, which the first node accepts only if the cookie is the one
//! it would compute (so a notice answers a question it asked). 0 when no notice is
//! wanted. Version 1 (no cookie) is refused as malformed.
//!
//! The header grows by 4 bytes per visited node (at most [`MAX_HOPS`]), so a packet
//! gains 28 + 16 + 4 × hops ≤ 76 bytes: the node network's MTU must exceed the clients'
//! by that much (docs/dataplane.md, "Redirects between nodes"). The UDP checksum is 0
//! (allowed for IPv4, RFC 768): the inner packet keeps its own checksums.
//!
//! Must not touch: decisions (that is [`crate::redirect`]) or I/O.

use crate::flow::FlowKey;
use crate::packet;
use crate::redirect::{HopList, RedirectOut, MAX_HOPS};

/// First bytes of the header.
pub const MAGIC: [u8; 2] = *b"JR";
/// Header version (2: with the cookie).
pub const VERSION: u8 = 2;
/// Kind: an encapsulated packet.
pub const KIND_PACKET: u8 = 1;
/// Kind: an "I own this flow" notice.
pub const KIND_NOTICE: u8 = 2;
/// Flag: the sender wants a notice from the owner.
pub const FLAG_ASK: u8 = 1;
/// Outer IPv4 + UDP header bytes.
pub const OUTER: usize = 20 + 8;
/// Fixed part of the header (with the cookie).
pub const FIXED: usize = 16;
/// Bytes of a notice's body.
pub const NOTICE_BODY: usize = 16;
/// Most bytes encapsulation adds to a packet.
pub const MAX_OVERHEAD: usize = OUTER + FIXED + 4 * MAX_HOPS;

const ETH: usize = 14;

/// Why a received redirect frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than its headers say, wrong magic or version, unknown kind, too many hops.
    #[error("malformed redirect header")]
    Malformed,
}

/// A received redirect frame, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// [`KIND_PACKET`] or [`KIND_NOTICE`].
    pub kind: u8,
    /// Header flags ([`FLAG_ASK`]).
    pub flags: u8,
    /// Visited nodes.
    pub hops: HopList,
    /// The first node's cookie (a question), or the one echoed (a notice).
    pub cookie: u64,
    /// Offset of the body (the inner IPv4 packet, or the notice) in the frame.
    pub body: usize,
    /// Length of the body (from the outer UDP length).
    pub body_len: usize,
}

/// Whether `frame` (Ethernet, IPv4 without options, not a fragment) is a UDP datagram
/// to `node:port`; reads fixed offsets only.
pub fn is_redirect(frame: &[u8], node: u32, port: u16) -> bool {
    frame.len() >= ETH + OUTER + FIXED
        && frame[12..14] == [0x08, 0x00]
        && frame[14] == 0x45
        && frame[23] == packet::IPPROTO_UDP
        && frame[20] & 0x3f == 0
        && frame[21] == 0
        && frame[30..34] == node.to_be_bytes()
        && frame[36..38] == port.to_be_bytes()
}

/// Parses the header of a frame [`is_redirect`] accepted.
pub fn parse(frame: &[u8]) -> Result<Received, WireError> {
    let udp_len = usize::from(u16::from_be_bytes([frame[38], frame[39]]));
    let end = ETH + 20 + udp_len;
    if udp_len < 8 + FIXED || end > frame.len() {
        return Err(WireError::Malformed);
    }
    let h = ETH + OUTER;
    if frame[h..h + 2] != MAGIC || frame[h + 2] != VERSION {
        return Err(WireError::Malformed);
    }
    let (kind, flags, n) = (frame[h + 3], frame[h + 4], usize::from(frame[h + 5]));
    if n > MAX_HOPS || !(kind == KIND_PACKET || kind == KIND_NOTICE) {
        return Err(WireError::Malformed);
    }
    let body = h + FIXED + 4 * n;
    if body > end {
        return Err(WireError::Malformed);
    }
    let mut addrs = [0u32; MAX_HOPS];
    for (i, a) in addrs.iter_mut().take(n).enumerate() {
        let o = h + FIXED + 4 * i;
        *a = u32::from_be_bytes([frame[o], frame[o + 1], frame[o + 2], frame[o + 3]]);
    }
    let hops = HopList::from_slice(&addrs[..n]).ok_or(WireError::Malformed)?;
    let mut c = [0u8; 8];
    c.copy_from_slice(&frame[h + 8..h + 16]);
    let cookie = u64::from_be_bytes(c);
    let body_len = end - body;
    if kind == KIND_NOTICE && body_len < NOTICE_BODY {
        return Err(WireError::Malformed);
    }
    if kind == KIND_PACKET && (body_len < 20 || frame[body] >> 4 != 4) {
        return Err(WireError::Malformed);
    }
    Ok(Received {
        kind,
        flags,
        hops,
        cookie,
        body,
        body_len,
    })
}

/// The outer source address of a received frame.
pub fn outer_source(frame: &[u8]) -> u32 {
    u32::from_be_bytes([frame[26], frame[27], frame[28], frame[29]])
}

/// Moves the inner packet of a [`KIND_PACKET`] frame behind the frame's Ethernet header
/// (in place); returns the new frame length.
pub fn decapsulate(frame: &mut [u8], r: &Received) -> usize {
    frame.copy_within(r.body..r.body + r.body_len, ETH);
    ETH + r.body_len
}

/// The forward key a notice names.
pub fn notice_key(frame: &[u8], r: &Received) -> FlowKey {
    let b = &frame[r.body..r.body + NOTICE_BODY];
    FlowKey {
        src: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        dst: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
        src_port: u16::from_be_bytes([b[8], b[9]]),
        dst_port: u16::from_be_bytes([b[10], b[11]]),
        proto: b[12],
    }
}

/// Writes Ethernet, outer IPv4, UDP and the fixed header + hops at the start of `buf`
/// for a body of `body_len` bytes; returns the header length.
#[allow(clippy::too_many_arguments)]
fn write_headers(
    buf: &mut [u8],
    macs: &[u8; 12],
    src: u32,
    dst: u32,
    sport: u16,
    port: u16,
    kind: u8,
    flags: u8,
    hops: &HopList,
    cookie: u64,
    body_len: usize,
) -> usize {
    let hdr = FIXED + 4 * hops.len();
    let ip_len = OUTER + hdr + body_len;
    buf[..12].copy_from_slice(macs);
    buf[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip = &mut buf[ETH..ETH + 20];
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    ip[4..6].copy_from_slice(&[0, 0]);
    ip[6..8].copy_from_slice(&[0x40, 0x00]); // DF
    ip[8] = 64;
    ip[9] = packet::IPPROTO_UDP;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src.to_be_bytes());
    ip[16..20].copy_from_slice(&dst.to_be_bytes());
    let c = packet::ipv4_header_checksum(ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let udp = &mut buf[ETH + 20..ETH + 28];
    udp[0..2].copy_from_slice(&sport.to_be_bytes());
    udp[2..4].copy_from_slice(&port.to_be_bytes());
    udp[4..6].copy_from_slice(&((8 + hdr + body_len) as u16).to_be_bytes());
    udp[6..8].copy_from_slice(&[0, 0]);
    let h = &mut buf[ETH + OUTER..ETH + OUTER + hdr];
    h[0..2].copy_from_slice(&MAGIC);
    h[2] = VERSION;
    h[3] = kind;
    h[4] = flags;
    h[5] = hops.len() as u8;
    h[6..8].copy_from_slice(&[0, 0]);
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    for (i, a) in hops.as_slice().iter().enumerate() {
        h[FIXED + 4 * i..FIXED + 4 * i + 4].copy_from_slice(&a.to_be_bytes());
    }
    ETH + OUTER + hdr
}

/// Encapsulates the frame in `buf[..out.frame_len]` (Ethernet + IPv4 packet) in place
/// for `out.peer`; `buf` is the whole frame buffer. Returns the new length, or `None`
/// when the result does not fit the buffer or would exceed `mtu` (IPv4 bytes).
pub fn encapsulate(
    buf: &mut [u8],
    out: &RedirectOut,
    node: u32,
    port: u16,
    mtu: usize,
) -> Option<usize> {
    let inner = out.frame_len.checked_sub(ETH)?;
    let head = ETH + OUTER + FIXED + 4 * out.hops.len();
    let total = head + inner;
    if total > buf.len() || total - ETH > mtu {
        return None;
    }
    buf.copy_within(ETH..out.frame_len, head);
    let flags = if out.ask { FLAG_ASK } else { 0 };
    let h = write_headers(
        buf,
        &out.macs,
        node,
        out.peer,
        0xc000 | (out.entropy & 0x3fff),
        port,
        KIND_PACKET,
        flags,
        &out.hops,
        out.cookie,
        inner,
    );
    debug_assert_eq!(h, head);
    Some(total)
}

/// Writes a notice into `buf`, echoing the question's `cookie`; returns its length
/// (`None` if `buf` is too small).
pub fn build_notice(
    buf: &mut [u8],
    macs: &[u8; 12],
    node: u32,
    to: u32,
    port: u16,
    key: &FlowKey,
    cookie: u64,
) -> Option<usize> {
    let hops = HopList::new();
    let total = ETH + OUTER + FIXED + NOTICE_BODY;
    if buf.len() < total {
        return None;
    }
    let h = write_headers(
        buf,
        macs,
        node,
        to,
        port,
        port,
        KIND_NOTICE,
        0,
        &hops,
        cookie,
        NOTICE_BODY,
    );
    let b = &mut buf[h..h + NOTICE_BODY];
    b[0..4].copy_from_slice(&key.src.to_be_bytes());
    b[4..8].copy_from_slice(&key.dst.to_be_bytes());
    b[8..10].copy_from_slice(&key.src_port.to_be_bytes());
    b[10..12].copy_from_slice(&key.dst_port.to_be_bytes());
    b[12] = key.proto;
    b[13..16].copy_from_slice(&[0, 0, 0]);
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: u32 = 0x0a00_0001;
    const B: u32 = 0x0a00_0002;

    fn inner_frame(payload: usize) -> Vec<u8> {
        let mut f = vec![0u8; ETH + 20 + 20 + payload];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        let len = (20 + 20 + payload) as u16;
        f[16..18].copy_from_slice(&len.to_be_bytes());
        f[22] = 64;
        f[23] = packet::IPPROTO_TCP;
        for (i, b) in f[34..].iter_mut().enumerate() {
            *b = i as u8;
        }
        f
    }

    #[test]
    fn encapsulate_then_parse_and_decapsulate_gives_the_packet_back() {
        for hops in [&[A][..], &[A, B, 7, 8, 9, 10, 11, 12][..]] {
            let orig = inner_frame(100);
            let mut buf = vec![0u8; 2048];
            buf[..orig.len()].copy_from_slice(&orig);
            let out = RedirectOut {
                peer: B,
                macs: [1; 12],
                hops: HopList::from_slice(hops).unwrap(),
                ask: true,
                frame_len: orig.len(),
                entropy: 77,
                cookie: 0x0123_4567_89ab_cdef,
            };
            let n = encapsulate(&mut buf, &out, A, 7411, 1500).unwrap();
            assert_eq!(n, orig.len() + OUTER + FIXED + 4 * hops.len());
            let f = &mut buf[..n];
            assert!(is_redirect(f, B, 7411));
            assert!(!is_redirect(f, A, 7411));
            assert!(!is_redirect(f, B, 7412));
            assert_eq!(
                packet::ipv4_header_checksum(&f[14..34]),
                u16::from_be_bytes([f[24], f[25]])
            );
            assert_eq!(outer_source(f), A);
            let r = parse(f).unwrap();
            assert_eq!((r.kind, r.flags), (KIND_PACKET, FLAG_ASK));
            assert_eq!(r.hops.as_slice(), hops);
            assert_eq!(r.cookie, 0x0123_4567_89ab_cdef);
            let m = decapsulate(f, &r);
            assert_eq!(&f[14..m], &orig[14..]);
        }
    }

    #[test]
    fn too_big_for_the_mtu_or_the_buffer_is_refused() {
        let orig = inner_frame(1460);
        let mut buf = vec![0u8; 4096];
        buf[..orig.len()].copy_from_slice(&orig);
        let out = RedirectOut {
            peer: B,
            macs: [1; 12],
            hops: HopList::from_slice(&[A]).unwrap(),
            ask: false,
            frame_len: orig.len(),
            entropy: 0,
            cookie: 0,
        };
        assert_eq!(encapsulate(&mut buf, &out, A, 7411, 1500), None);
        assert!(encapsulate(&mut buf[..1600], &out, A, 7411, 9000).is_some());
        assert_eq!(encapsulate(&mut buf[..1538], &out, A, 7411, 9000), None);
    }

    #[test]
    fn notices_round_trip() {
        let key = FlowKey {
            src: 0x0a64_0102,
            dst: 0x0ac8_000a,
            src_port: 40000,
            dst_port: 80,
            proto: packet::IPPROTO_TCP,
        };
        let mut buf = [0u8; 128];
        let n = build_notice(&mut buf, &[2; 12], A, B, 7411, &key, 42).unwrap();
        let f = &mut buf[..n];
        assert!(is_redirect(f, B, 7411));
        let r = parse(f).unwrap();
        assert_eq!((r.kind, r.cookie), (KIND_NOTICE, 42));
        assert_eq!(notice_key(f, &r), key);
        // Version 1 (no cookie) is refused.
        f[14 + 28 + 2] = 1;
        assert_eq!(parse(f), Err(WireError::Malformed));
    }

    proptest! {
        /// Any bytes behind a valid outer header: parse never panics, and what it
        /// accepts has its body inside the frame.
        #[test]
        fn parse_never_panics(body in prop::collection::vec(any::<u8>(), 0..120), udp_len in 0u16..200) {
            let mut f = vec![0u8; ETH + OUTER];
            f[12..14].copy_from_slice(&[0x08, 0x00]);
            f[14] = 0x45;
            f[23] = packet::IPPROTO_UDP;
            f[30..34].copy_from_slice(&B.to_be_bytes());
            f[36..38].copy_from_slice(&7411u16.to_be_bytes());
            f[38..40].copy_from_slice(&udp_len.to_be_bytes());
            f.extend_from_slice(&body);
            if is_redirect(&f, B, 7411) {
                if let Ok(r) = parse(&f) {
                    prop_assert!(r.body + r.body_len <= f.len());
                }
            }
        }
    }
}
