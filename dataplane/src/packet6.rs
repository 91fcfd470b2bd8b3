//! Thin views over Ethernet / IPv6 frames: the fixed header, the extension headers a
//! router may put on a packet to a VIP, TCP / UDP ports, ICMPv6 errors (Packet Too Big
//! above all: IPv6 routers never fragment), and in-place NAT rewrites with RFC 1624
//! incremental checksums over the IPv6 pseudo-header (issue #28).
//!
//! The engine's IPv6 path (`engine6.rs`) reads frames through these views. Like
//! [`crate::packet`], [`parse6`] validates a frame once
//! and returns offsets and fields; nothing here allocates, copies the frame or panics on
//! any input (property tests; the `packet` fuzz target runs it too).
//!
//! Extension headers (RFC 8200 §4): Hop-by-Hop Options (first only), Destination Options,
//! Routing with no segment left, Fragment, and Authentication (RFC 4302) are skipped —
//! at most [`MAX_EXTENSION_HEADERS`], within the payload. A routing header with segments
//! left (the packet is not at its final destination), a Hop-by-Hop header that is not
//! first, ESP and any other next header end the walk as [`Upper::Other`]: the engine
//! drops those under one named reason rather than guess.

use crate::packet::{csum_delta, csum_delta_add, ETHERTYPE_IPV6, ETH_HEADER_LEN};
use crate::proto::{IPPROTO_TCP, IPPROTO_UDP};

/// The fixed IPv6 header's length.
pub const IPV6_HEADER_LEN: usize = 40;
/// Most extension headers walked before the packet is refused as [`Upper::Other`].
pub const MAX_EXTENSION_HEADERS: usize = 8;
/// ICMPv6's next-header number.
pub const IPPROTO_ICMPV6: u8 = 58;
/// Hop-by-Hop Options.
const NH_HOP_BY_HOP: u8 = 0;
/// Routing.
const NH_ROUTING: u8 = 43;
/// Fragment.
const NH_FRAGMENT: u8 = 44;
/// Authentication Header.
const NH_AUTH: u8 = 51;
/// Destination Options.
const NH_DEST_OPTS: u8 = 60;
/// ICMPv6 Destination Unreachable.
pub const ICMP6_DEST_UNREACH: u8 = 1;
/// ICMPv6 Packet Too Big.
pub const ICMP6_PACKET_TOO_BIG: u8 = 2;
/// ICMPv6 Time Exceeded.
pub const ICMP6_TIME_EXCEEDED: u8 = 3;
/// ICMPv6 Parameter Problem.
pub const ICMP6_PARAM_PROBLEM: u8 = 4;

/// Why a frame could not be read as an IPv6 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Parse6Error {
    /// Not an IPv6 frame (the EtherType), or shorter than an Ethernet header.
    #[error("not an IPv6 frame")]
    NotIpv6,
    /// Fewer than 40 bytes after the Ethernet header.
    #[error("IPv6 header truncated")]
    TruncatedIpv6,
    /// The version nibble is not 6.
    #[error("IPv6 version field is not 6")]
    BadIpVersion,
    /// The payload length runs past the frame (or is 0: jumbograms are not taken).
    #[error("IPv6 payload length invalid")]
    BadPayloadLength,
    /// An extension header runs past the payload.
    #[error("IPv6 extension header truncated")]
    TruncatedExtension,
    /// A TCP/UDP header that does not fit in the payload.
    #[error("TCP/UDP header truncated")]
    TruncatedL4,
    /// TCP data offset below 5 or past the payload; UDP length inconsistent.
    #[error("TCP/UDP header length invalid")]
    BadL4Length,
}

/// What follows the extension headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upper {
    /// TCP or UDP, its ports and flags (not for a non-first fragment).
    Transport(u8),
    /// ICMPv6.
    Icmp,
    /// A non-first fragment: the upper-layer header is in the first one.
    LaterFragment(u8),
    /// What the dataplane does not serve: ESP, No Next Header, a routing header with
    /// segments left, a misplaced Hop-by-Hop header, a chain longer than
    /// [`MAX_EXTENSION_HEADERS`], any other protocol. The number that stopped the walk.
    Other(u8),
}

/// Offsets and fields of a validated IPv6 frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6View {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// Hop limit.
    pub hop_limit: u8,
    /// The payload length from the header (bytes after the fixed header).
    pub payload_len: usize,
    /// Bytes of extension headers before the upper-layer header.
    pub ext_len: usize,
    /// What follows them.
    pub upper: Upper,
    /// The packet carries a Fragment header that is not atomic (RFC 6946: offset 0 and
    /// no more fragments is an unfragmented packet).
    pub fragment: bool,
    /// The TCP/UDP header, when there is one to read.
    pub l4: Option<crate::packet::L4View>,
}

impl Ipv6View {
    /// Offset of the upper-layer header in the frame.
    pub const fn l4_offset(&self) -> usize {
        ETH_HEADER_LEN + IPV6_HEADER_LEN + self.ext_len
    }

    /// Offset of the end of the packet in the frame.
    pub const fn end(&self) -> usize {
        ETH_HEADER_LEN + IPV6_HEADER_LEN + self.payload_len
    }

    /// Length of the upper-layer packet (what the pseudo-header counts).
    pub const fn upper_len(&self) -> usize {
        self.payload_len - self.ext_len
    }

    /// The upper-layer protocol number (for the pseudo-header).
    pub const fn protocol(&self) -> u8 {
        match self.upper {
            Upper::Transport(p) | Upper::LaterFragment(p) | Upper::Other(p) => p,
            Upper::Icmp => IPPROTO_ICMPV6,
        }
    }
}

#[inline]
fn be16(b: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([b[off], b[off + 1]])
}

fn addr(b: &[u8], off: usize) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[off..off + 16]);
    a
}

/// The extension-header walk from `nh` over `payload`: bytes skipped, what follows,
/// whether a (non-atomic) Fragment header was met (a later fragment ends the walk as
/// [`Upper::LaterFragment`]).
fn walk(mut nh: u8, payload: &[u8]) -> Result<(usize, Upper, bool), Parse6Error> {
    let mut off = 0usize;
    let mut fragment = false;
    for n in 0..=MAX_EXTENSION_HEADERS {
        match nh {
            IPPROTO_TCP | IPPROTO_UDP => return Ok((off, Upper::Transport(nh), fragment)),
            IPPROTO_ICMPV6 => return Ok((off, Upper::Icmp, fragment)),
            _ if n == MAX_EXTENSION_HEADERS => break,
            NH_HOP_BY_HOP if n > 0 => break,
            NH_HOP_BY_HOP | NH_DEST_OPTS | NH_ROUTING | NH_FRAGMENT | NH_AUTH => {}
            _ => break,
        }
        let h = payload
            .get(off..off + 8)
            .ok_or(Parse6Error::TruncatedExtension)?;
        let len = match nh {
            NH_FRAGMENT => 8,
            NH_AUTH => (usize::from(h[1]) + 2) * 4,
            _ => (usize::from(h[1]) + 1) * 8,
        };
        if off + len > payload.len() {
            return Err(Parse6Error::TruncatedExtension);
        }
        if nh == NH_ROUTING && h[3] != 0 {
            // Segments left: this node is not the packet's final destination.
            break;
        }
        if nh == NH_FRAGMENT {
            let offset_flags = be16(h, 2);
            let (offset, more) = (offset_flags >> 3, offset_flags & 1 != 0);
            if offset != 0 {
                return Ok((off + len, Upper::LaterFragment(h[0]), true));
            }
            fragment |= more;
        }
        nh = h[0];
        off += len;
    }
    Ok((off, Upper::Other(nh), fragment))
}

/// Validates an IPv6 frame once; every later accessor and rewrite relies on what this
/// checked.
pub fn parse6(frame: &[u8]) -> Result<Ipv6View, Parse6Error> {
    if crate::packet::ethertype(frame) != Some(ETHERTYPE_IPV6) {
        return Err(Parse6Error::NotIpv6);
    }
    let ip = &frame[ETH_HEADER_LEN..];
    if ip.len() < IPV6_HEADER_LEN {
        return Err(Parse6Error::TruncatedIpv6);
    }
    if ip[0] >> 4 != 6 {
        return Err(Parse6Error::BadIpVersion);
    }
    let payload_len = usize::from(be16(ip, 4));
    if payload_len == 0 || IPV6_HEADER_LEN + payload_len > ip.len() {
        return Err(Parse6Error::BadPayloadLength);
    }
    let payload = &ip[IPV6_HEADER_LEN..IPV6_HEADER_LEN + payload_len];
    let (ext_len, upper, fragment) = walk(ip[6], payload)?;
    let mut view = Ipv6View {
        src: addr(ip, 8),
        dst: addr(ip, 24),
        hop_limit: ip[7],
        payload_len,
        ext_len,
        upper,
        fragment,
        l4: None,
    };
    // A fragment's UDP length covers the whole datagram: no ports read from it here.
    if let (Upper::Transport(p), false) = (upper, fragment) {
        view.l4 = Some(
            crate::packet::read_l4(p, &payload[ext_len..]).map_err(|e| match e {
                crate::packet::ParseError::TruncatedL4 => Parse6Error::TruncatedL4,
                _ => Parse6Error::BadL4Length,
            })?,
        );
    }
    Ok(view)
}

/// An ICMPv6 error and what it quotes: the packet that caused it, as far as the error
/// carries it (its addresses, protocol and — if quoted — ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Icmp6ErrorView {
    /// Type (1 to 4).
    pub icmp_type: u8,
    /// Code.
    pub code: u8,
    /// Packet Too Big's MTU.
    pub mtu: Option<u32>,
    /// The quoted packet's source.
    pub inner_src: [u8; 16],
    /// The quoted packet's destination.
    pub inner_dst: [u8; 16],
    /// Its upper-layer protocol (TCP or UDP: others are not followed).
    pub inner_protocol: u8,
    /// Its source port.
    pub inner_src_port: u16,
    /// Its destination port.
    pub inner_dst_port: u16,
    /// Offset of the quoted IPv6 header in the frame.
    pub inner_offset: usize,
}

/// The ICMPv6 error in `v` (a frame [`parse6`] took), if it is one about a TCP or UDP
/// packet whose ports it quotes; `None` for any other ICMPv6 message.
pub fn parse_icmp6_error(frame: &[u8], v: &Ipv6View) -> Option<Icmp6ErrorView> {
    if v.upper != Upper::Icmp {
        return None;
    }
    let icmp = frame.get(v.l4_offset()..v.end())?;
    let (icmp_type, code) = (*icmp.first()?, *icmp.get(1)?);
    if !(ICMP6_DEST_UNREACH..=ICMP6_PARAM_PROBLEM).contains(&icmp_type) {
        return None;
    }
    let inner = icmp.get(8..)?;
    let mtu = (icmp_type == ICMP6_PACKET_TOO_BIG)
        .then(|| u32::from_be_bytes([icmp[4], icmp[5], icmp[6], icmp[7]]));
    if inner.len() < IPV6_HEADER_LEN || inner[0] >> 4 != 6 {
        return None;
    }
    // The quote is cut (at 1280 bytes in all): walk what is there.
    // A first fragment quotes the ports; a later one is `LaterFragment`, not followed.
    let (ext, Upper::Transport(p), _) = walk(inner[6], &inner[IPV6_HEADER_LEN..]).ok()? else {
        return None;
    };
    let l4 = inner.get(IPV6_HEADER_LEN + ext..IPV6_HEADER_LEN + ext + 4)?;
    Some(Icmp6ErrorView {
        icmp_type,
        code,
        mtu,
        inner_src: addr(inner, 8),
        inner_dst: addr(inner, 24),
        inner_protocol: p,
        inner_src_port: be16(l4, 0),
        inner_dst_port: be16(l4, 2),
        inner_offset: v.l4_offset() + 8,
    })
}

/// The one's-complement sum of an address's eight 16-bit words (for [`csum_delta`]).
fn words(a: &[u8; 16]) -> [u16; 8] {
    let mut w = [0u16; 8];
    for (i, x) in w.iter_mut().enumerate() {
        *x = u16::from_be_bytes([a[2 * i], a[2 * i + 1]]);
    }
    w
}

/// The upper-layer checksum of `v`'s packet computed in full (RFC 8200 §8.1
/// pseudo-header: addresses, upper-layer length, next header); 0xffff-folded as sent.
pub fn upper_checksum(frame: &[u8], v: &Ipv6View) -> u16 {
    let mut s: u32 = 0;
    for w in words(&v.src).into_iter().chain(words(&v.dst)) {
        s += u32::from(w);
    }
    let len = v.upper_len() as u32;
    s += (len >> 16) + (len & 0xffff) + u32::from(v.protocol());
    let mut chunks = frame[v.l4_offset()..v.end()].chunks_exact(2);
    for c in &mut chunks {
        s += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [b] = chunks.remainder() {
        s += u32::from(*b) << 8;
    }
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// Computes the upper-layer checksum of `v`'s packet afresh and stores it (a partial
/// offload checksum or a rewritten ICMPv6 quote); a UDP checksum computed as 0 is sent
/// as 0xffff (RFC 768). Nothing for a packet without a checksum field it knows.
pub fn fill_upper_checksum(frame: &mut [u8], v: &Ipv6View) {
    let Some(c) = csum_offset(v) else { return };
    if c + 2 > v.end() {
        return;
    }
    frame[c..c + 2].copy_from_slice(&[0, 0]);
    let mut sum = upper_checksum(frame, v);
    if sum == 0 && matches!(v.upper, Upper::Transport(IPPROTO_UDP)) {
        sum = 0xffff;
    }
    frame[c..c + 2].copy_from_slice(&sum.to_be_bytes());
}

/// Offset of the checksum field of `v`'s TCP, UDP or ICMPv6 header.
fn csum_offset(v: &Ipv6View) -> Option<usize> {
    match v.upper {
        Upper::Transport(IPPROTO_TCP) => Some(v.l4_offset() + 16),
        Upper::Transport(_) => Some(v.l4_offset() + 6),
        Upper::Icmp => Some(v.l4_offset() + 2),
        _ => None,
    }
}

/// Which end of the packet a NAT rewrite changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side6 {
    /// The destination (DNAT of a client's packet to its backend).
    Destination,
    /// The source (reverse NAT of a backend's answer to the VIP).
    Source,
}

/// Rewrites one end's address and port of a TCP/UDP packet in place, the upper-layer
/// checksum updated incrementally (RFC 1624) — IPv6 has no header checksum. A UDP
/// checksum of 0 (invalid over IPv6, RFC 8200) is left 0. `v` follows the change.
pub fn rewrite6(frame: &mut [u8], v: &mut Ipv6View, side: Side6, addr: [u8; 16], port: u16) {
    let Some(l4) = v.l4 else { return };
    let l4_off = v.l4_offset();
    let (addr_off, port_off, old_addr, old_port) = match side {
        Side6::Destination => (ETH_HEADER_LEN + 24, l4_off + 2, v.dst, l4.dst_port),
        Side6::Source => (ETH_HEADER_LEN + 8, l4_off, v.src, l4.src_port),
    };
    let delta = csum_delta_add(
        csum_delta(&words(&old_addr), &words(&addr)),
        csum_delta(&[old_port], &[port]),
    );
    frame[addr_off..addr_off + 16].copy_from_slice(&addr);
    frame[port_off..port_off + 2].copy_from_slice(&port.to_be_bytes());
    if let Some(c) = csum_offset(v) {
        let old = be16(frame, c);
        if !(l4.udp_no_checksum && old == 0) {
            let new = crate::packet::csum_apply(old, delta);
            // UDP sends a computed 0 as 0xffff (RFC 768).
            let new = if new == 0 && matches!(v.upper, Upper::Transport(IPPROTO_UDP)) {
                0xffff
            } else {
                new
            };
            frame[c..c + 2].copy_from_slice(&new.to_be_bytes());
        }
    }
    match side {
        Side6::Destination => {
            v.dst = addr;
            v.l4 = Some(crate::packet::L4View {
                dst_port: port,
                ..l4
            });
        }
        Side6::Source => {
            v.src = addr;
            v.l4 = Some(crate::packet::L4View {
                src_port: port,
                ..l4
            });
        }
    }
}

/// Decrements the hop limit; `false` (frame untouched) when it would reach 0 — the
/// packet is not forwarded (an ICMPv6 Time Exceeded is the kernel's to send).
pub fn decrement_hop_limit(frame: &mut [u8], v: &mut Ipv6View) -> bool {
    if v.hop_limit <= 1 {
        return false;
    }
    v.hop_limit -= 1;
    frame[ETH_HEADER_LEN + 7] = v.hop_limit;
    true
}

#[cfg(test)]
pub(crate) mod tests;
