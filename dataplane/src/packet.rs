//! Thin views over Ethernet / IPv4 / TCP / UDP frames, and in-place rewrites.
//!
//! [`parse`] validates a frame once (every length the later accessors and rewrites rely
//! on) and returns a [`Ipv4View`] of offsets and header fields; nothing here allocates,
//! copies the frame or panics on any input (the property tests and the malformed-frame
//! corpus check that). Rewrites change the frame in place and keep the checksums right
//! with RFC 1624 incremental updates ([`csum_replace16`] / [`csum_replace32`]), or — for
//! frames whose L4 checksum cannot be trusted (Pod veths with checksum offload leave a
//! partial checksum) — with a full recomputation ([`recompute_l4_checksum`]).

use std::fmt;
use std::net::Ipv4Addr;

/// Length of an Ethernet II header (no VLAN tag).
pub const ETH_HEADER_LEN: usize = 14;
/// EtherType of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
/// EtherType of ARP.
pub const ETHERTYPE_ARP: u16 = 0x0806;
/// EtherType of an 802.1Q VLAN tag.
pub const ETHERTYPE_VLAN: u16 = 0x8100;
pub use crate::proto::{tcp_flags, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

/// A MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct MacAddr(pub [u8; 6]);

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// Why a frame could not be read as far as the dataplane needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Shorter than an Ethernet header.
    #[error("frame shorter than an Ethernet header")]
    TruncatedEthernet,
    /// EtherType says IPv4 but fewer than 20 bytes follow.
    #[error("IPv4 header truncated")]
    TruncatedIpv4,
    /// The IPv4 version nibble is not 4.
    #[error("IPv4 version field is not 4")]
    BadIpVersion,
    /// IHL below 5, or the header runs past the frame.
    #[error("IPv4 header length invalid")]
    BadIpHeaderLength,
    /// Total length shorter than the header or longer than the frame.
    #[error("IPv4 total length invalid")]
    BadIpTotalLength,
    /// A TCP/UDP header that does not fit in the IPv4 payload.
    #[error("TCP/UDP header truncated")]
    TruncatedL4,
    /// TCP data offset below 5 or past the payload; UDP length inconsistent.
    #[error("TCP/UDP header length invalid")]
    BadL4Length,
}

/// What a frame is, as far as the dataplane cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// Not IPv4 (ARP, IPv6, VLAN-tagged, ...): the EtherType.
    NotIpv4(u16),
    /// An IPv4 packet.
    Ipv4(Ipv4View),
}

/// Offsets and header fields of a validated IPv4 frame. `l4` is `Some` only for an
/// unfragmented (or first-fragment-free) TCP/UDP packet whose transport header fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4View {
    /// Header length in bytes (20 without options).
    pub header_len: usize,
    /// Total length from the header (bytes from the IPv4 header on).
    pub total_len: usize,
    /// Source address (host order).
    pub src: u32,
    /// Destination address (host order).
    pub dst: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Time to live.
    pub ttl: u8,
    /// More-fragments flag set or fragment offset non-zero.
    pub fragment: bool,
    /// The TCP/UDP header, when there is one to read.
    pub l4: Option<L4View>,
}

impl Ipv4View {
    /// Offset of the IPv4 header in the frame.
    pub const fn l3_offset(&self) -> usize {
        ETH_HEADER_LEN
    }

    /// Offset of the transport header in the frame.
    pub const fn l4_offset(&self) -> usize {
        ETH_HEADER_LEN + self.header_len
    }

    /// The header carries IP options (IHL > 5).
    pub const fn has_options(&self) -> bool {
        self.header_len > 20
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.src)
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.dst)
    }
}

/// Ports and flags of a TCP or UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L4View {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
    /// The UDP checksum field is zero (no checksum); always false for TCP.
    pub udp_no_checksum: bool,
}

#[inline]
fn be16(b: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([b[off], b[off + 1]])
}

#[inline]
fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline]
fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

#[inline]
fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

/// The EtherType of a frame (no VLAN handling), if it has an Ethernet header.
pub fn ethertype(frame: &[u8]) -> Option<u16> {
    (frame.len() >= ETH_HEADER_LEN).then(|| be16(frame, 12))
}

/// Validates a frame once; every later accessor and rewrite relies on what this checked.
pub fn parse(frame: &[u8]) -> Result<Parsed, ParseError> {
    if frame.len() < ETH_HEADER_LEN {
        return Err(ParseError::TruncatedEthernet);
    }
    let et = be16(frame, 12);
    if et != ETHERTYPE_IPV4 {
        return Ok(Parsed::NotIpv4(et));
    }
    let ip = &frame[ETH_HEADER_LEN..];
    if ip.len() < 20 {
        return Err(ParseError::TruncatedIpv4);
    }
    if ip[0] >> 4 != 4 {
        return Err(ParseError::BadIpVersion);
    }
    let header_len = usize::from(ip[0] & 0x0f) * 4;
    if header_len < 20 || header_len > ip.len() {
        return Err(ParseError::BadIpHeaderLength);
    }
    let total_len = usize::from(be16(ip, 2));
    if total_len < header_len || total_len > ip.len() {
        return Err(ParseError::BadIpTotalLength);
    }
    let flags_frag = be16(ip, 6);
    let fragment = flags_frag & 0x3fff != 0; // MF bit or a non-zero offset
    let protocol = ip[9];
    let mut view = Ipv4View {
        header_len,
        total_len,
        src: be32(ip, 12),
        dst: be32(ip, 16),
        protocol,
        ttl: ip[8],
        fragment,
        l4: None,
    };
    if fragment || (protocol != IPPROTO_TCP && protocol != IPPROTO_UDP) {
        return Ok(Parsed::Ipv4(view));
    }
    view.l4 = Some(read_l4(protocol, &ip[header_len..total_len])?);
    Ok(Parsed::Ipv4(view))
}

/// The TCP (`protocol` 6) or UDP (any other) header at the start of `l4`, the IP
/// payload from it on (IPv4 and IPv6 alike), validated.
pub(crate) fn read_l4(protocol: u8, l4: &[u8]) -> Result<L4View, ParseError> {
    if protocol == IPPROTO_TCP {
        if l4.len() < 20 {
            return Err(ParseError::TruncatedL4);
        }
        let data_off = usize::from(l4[12] >> 4) * 4;
        if data_off < 20 || data_off > l4.len() {
            return Err(ParseError::BadL4Length);
        }
        return Ok(L4View {
            src_port: be16(l4, 0),
            dst_port: be16(l4, 2),
            tcp_flags: l4[13],
            udp_no_checksum: false,
        });
    }
    if l4.len() < 8 {
        return Err(ParseError::TruncatedL4);
    }
    let udp_len = usize::from(be16(l4, 4));
    if udp_len < 8 || udp_len > l4.len() {
        return Err(ParseError::BadL4Length);
    }
    Ok(L4View {
        src_port: be16(l4, 0),
        dst_port: be16(l4, 2),
        tcp_flags: 0,
        udp_no_checksum: be16(l4, 6) == 0,
    })
}

/// The fields of the common frame — Ethernet II, IPv4 without options, not a fragment,
/// TCP or UDP — read by [`parse_fast`] with fixed offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastView {
    /// Source address (host order).
    pub src: u32,
    /// Destination address (host order).
    pub dst: u32,
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// TCP or UDP.
    pub protocol: u8,
    /// Time to live.
    pub ttl: u8,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
    /// TCP/UDP length (IPv4 total length − 20).
    pub l4_len: u16,
    /// The 5-tuple as the frame holds it.
    pub raw: crate::flow::RawKey,
}

/// Offset of the TCP checksum in a frame without IP options.
pub const FAST_TCP_CSUM: usize = ETH_HEADER_LEN + 20 + 16;
/// Offset of the UDP checksum in a frame without IP options.
pub const FAST_UDP_CSUM: usize = ETH_HEADER_LEN + 20 + 6;

/// Reads the common frame in one pass with fixed offsets: Ethernet II + IPv4 with
/// IHL 5, not a fragment, TCP or UDP. Applies exactly the checks [`parse`] applies to
/// such a frame, so `Some(f)` means `parse` returns the same fields with
/// `header_len == 20`, `fragment == false` and `l4 == Some(..)`; anything else is
/// `None`, and the caller falls back to [`parse`].
#[inline(always)]
pub fn parse_fast(frame: &[u8]) -> Option<FastView> {
    match frame.get(23) {
        Some(&IPPROTO_TCP) => parse_fast_as::<true>(frame),
        Some(&IPPROTO_UDP) => parse_fast_as::<false>(frame),
        _ => None,
    }
}

/// [`parse_fast`] for one protocol (TCP when `TCP`, else UDP): `None` for a frame of
/// the other protocol. The engine peeks at the protocol byte first, so each protocol's
/// fast path is one straight line with no second protocol test.
#[inline(always)]
pub fn parse_fast_as<const TCP: bool>(frame: &[u8]) -> Option<FastView> {
    let h: &[u8; 42] = frame.get(..42)?.try_into().ok()?;
    // EtherType 0x0800 and version 4 / IHL 5 in one 32-bit compare; then the
    // fragment-offset and more-fragments bits in one 16-bit test.
    if u32::from_le_bytes([h[12], h[13], h[14], h[15]]) & 0x00ff_ffff != 0x0045_0008
        || u16::from_le_bytes([h[20], h[21]]) & 0xff3f != 0
    {
        return None;
    }
    let total = u16::from_be_bytes([h[16], h[17]]);
    if usize::from(total) > frame.len() - ETH_HEADER_LEN {
        return None;
    }
    // Wraps when total < 20; each protocol's check below rejects those frames first
    // (the UDP check in 32 bits, the TCP one on `total`), so a returned `l4_len` is
    // always total − 20 ≥ 8.
    let l4_len = total.wrapping_sub(20);
    let protocol = if TCP { IPPROTO_TCP } else { IPPROTO_UDP };
    if h[23] != protocol {
        return None;
    }
    let tcp_flags = if !TCP {
        // 8 ≤ udp_len and udp_len + 20 ≤ total: total ≥ 28, udp_len ≤ l4_len.
        let udp_len = u16::from_be_bytes([h[38], h[39]]);
        if udp_len < 8 || u32::from(udp_len) + 20 > u32::from(total) {
            return None;
        }
        0
    } else {
        if total < 40 {
            return None;
        }
        // total ≥ 40, so the frame holds the 20-byte TCP header.
        let t: &[u8; 54] = frame.get(..54)?.try_into().ok()?;
        let data_off = u16::from(t[46] >> 4) * 4;
        if data_off < 20 || data_off > l4_len {
            return None;
        }
        t[47]
    };
    Some(FastView {
        src: u32::from_be_bytes([h[26], h[27], h[28], h[29]]),
        dst: u32::from_be_bytes([h[30], h[31], h[32], h[33]]),
        src_port: u16::from_be_bytes([h[34], h[35]]),
        dst_port: u16::from_be_bytes([h[36], h[37]]),
        protocol,
        ttl: h[22],
        tcp_flags,
        l4_len,
        raw: crate::flow::RawKey {
            addrs: u64::from_le_bytes([h[26], h[27], h[28], h[29], h[30], h[31], h[32], h[33]]),
            ports: u32::from_le_bytes([h[34], h[35], h[36], h[37]]),
            proto: protocol,
        },
    })
}

/// The one's-complement difference that turns a checksum over `old` words into one
/// over `new` words (RFC 1624): `Σ ~old + Σ new`, folded to 16 bits. Precomputed once per
/// backend, it is applied per packet with [`csum_apply`].
pub fn csum_delta(old: &[u16], new: &[u16]) -> u16 {
    let mut sum: u32 = 0;
    for &o in old {
        sum += u32::from(!o);
    }
    for &n in new {
        sum += u32::from(n);
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// Adds two one's-complement deltas.
pub fn csum_delta_add(a: u16, b: u16) -> u16 {
    let s = u32::from(a) + u32::from(b);
    ((s & 0xffff) + (s >> 16)) as u16
}

/// RFC 1624 eqn. 3 with a precomputed delta: `~(~csum + delta)`, one fold.
#[inline(always)]
pub fn csum_apply(csum: u16, delta: u16) -> u16 {
    let s = u32::from(!csum) + u32::from(delta);
    !(((s & 0xffff) + (s >> 16)) as u16)
}

/// The 16-bit words of an address (for [`csum_delta`]).
pub fn addr_words(a: u32) -> [u16; 2] {
    [(a >> 16) as u16, a as u16]
}

/// Whether an L4 checksum field holds what a sender with checksum offload leaves there
/// (`CHECKSUM_PARTIAL`): the folded pseudo-header sum, not complemented. A complete
/// checksum equals it only by a 1-in-65536 coincidence, which costs nothing but a
/// recomputation that yields the same complete checksum.
#[inline(always)]
pub fn is_partial_checksum(field: u16, src: u32, dst: u32, protocol: u8, l4_len: u16) -> bool {
    let mut s = (src >> 16) + (src & 0xffff) + (dst >> 16) + (dst & 0xffff);
    s += u32::from(protocol) + u32::from(l4_len);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    field == s as u16 || (field == 0 && s == 0xffff)
}

/// RFC 1624 eqn. 3: the checksum after one 16-bit word changed from `old` to `new`.
#[inline]
pub fn csum_replace16(csum: u16, old: u16, new: u16) -> u16 {
    let mut sum = u32::from(!csum) + u32::from(!old) + u32::from(new);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// RFC 1624 for a 32-bit field (an address): both 16-bit halves.
#[inline]
pub fn csum_replace32(csum: u16, old: u32, new: u32) -> u16 {
    let c = csum_replace16(csum, (old >> 16) as u16, (new >> 16) as u16);
    csum_replace16(c, old as u16, new as u16)
}

/// One's-complement sum of the 16-bit big-endian words of `data` added to `sum` (folded
/// to 32 bits, not to 16). `data` must start at an even offset of the checksummed range.
/// Adds 32-bit words into a 64-bit accumulator (the classic RFC 1071 speed-up: the fold
/// of a sum of 32-bit words equals the sum of their 16-bit halves).
#[inline]
pub(crate) fn sum_words(sum: u32, data: &[u8]) -> u32 {
    // Native-order 32-bit words (vectorizes); the one's-complement sum is byte-order
    // independent (RFC 1071 2.B), so swap the folded 16-bit result once at the end.
    let mut acc: u64 = 0;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        acc += u64::from(u32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
    }
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    let mut total = u64::from(sum) + u64::from(u16::from_be(acc as u16));
    let rem = chunks.remainder();
    if rem.len() >= 2 {
        total += u64::from(u16::from_be_bytes([rem[0], rem[1]]));
    }
    if rem.len() % 2 == 1 {
        total += u64::from(rem[rem.len() - 1]) << 8;
    }
    while total >> 32 != 0 {
        total = (total & 0xffff_ffff) + (total >> 32);
    }
    total as u32
}

pub(crate) fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The IPv4 header checksum of `header` computed from scratch (the checksum field is
/// treated as zero).
pub fn ipv4_header_checksum(header: &[u8]) -> u16 {
    let sum = sum_words(0, &header[..10]);
    fold(sum_words(sum, &header[12..]))
}

/// The TCP/UDP checksum of a validated IPv4 packet computed from scratch (its checksum
/// field treated as zero). For UDP a zero result is returned as 0xffff.
pub fn l4_checksum(frame: &[u8], v: &Ipv4View) -> u16 {
    let l4 = &frame[v.l4_offset()..ETH_HEADER_LEN + v.total_len];
    let mut sum = (v.src >> 16) + (v.src & 0xffff) + (v.dst >> 16) + (v.dst & 0xffff);
    sum += u32::from(v.protocol) + l4.len() as u32;
    let csum_off = if v.protocol == IPPROTO_TCP { 16 } else { 6 };
    sum = sum_words(sum, &l4[..csum_off]);
    sum = sum_words(sum, &l4[csum_off + 2..]);
    let c = fold(sum);
    if v.protocol == IPPROTO_UDP && c == 0 {
        0xffff
    } else {
        c
    }
}

/// Offset of the TCP/UDP checksum field in the frame.
pub fn l4_csum_offset(v: &Ipv4View) -> usize {
    v.l4_offset() + if v.protocol == IPPROTO_TCP { 16 } else { 6 }
}

/// Recomputes the TCP/UDP checksum in place (for frames whose checksum cannot be trusted,
/// e.g. partial checksums from a Pod veth with tx offload on). A UDP datagram without a
/// checksum keeps none.
pub fn recompute_l4_checksum(frame: &mut [u8], v: &Ipv4View) {
    if matches!(v.l4, Some(l4) if l4.udp_no_checksum) {
        return;
    }
    let c = l4_checksum(frame, v);
    put16(frame, l4_csum_offset(v), c);
}

/// Writes the TCP/UDP checksum computed from scratch, whatever the field held (for
/// building frames; a UDP datagram gets a checksum even if it had none).
pub fn fill_l4_checksum(frame: &mut [u8], v: &Ipv4View) {
    if v.l4.is_some() {
        let c = l4_checksum(frame, v);
        put16(frame, l4_csum_offset(v), c);
    }
}

/// An ICMP error (destination unreachable — including "fragmentation needed", which
/// path-MTU discovery depends on — or time exceeded) quoting a TCP/UDP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcmpErrorView {
    /// ICMP type (3 or 11).
    pub icmp_type: u8,
    /// Offset of the quoted IPv4 header in the frame.
    pub inner_l3: usize,
    /// Length of the quoted IPv4 header.
    pub inner_header_len: usize,
    /// Quoted source address.
    pub inner_src: u32,
    /// Quoted destination address.
    pub inner_dst: u32,
    /// Quoted protocol (TCP or UDP).
    pub inner_protocol: u8,
    /// Quoted source port.
    pub inner_src_port: u16,
    /// Quoted destination port.
    pub inner_dst_port: u16,
}

/// The next-hop MTU of an ICMP "fragmentation needed" (type 3, code 4), when `frame`
/// is one and names a plausible MTU (RFC 1191: at least 68).
pub fn frag_needed_mtu(frame: &[u8], v: &Ipv4View) -> Option<u16> {
    let icmp = frame.get(v.l4_offset()..v.l4_offset() + 8)?;
    let mtu = u16::from_be_bytes([icmp[6], icmp[7]]);
    (v.protocol == IPPROTO_ICMP && icmp[0] == 3 && icmp[1] == 4 && mtu >= 68).then_some(mtu)
}

/// ICMP type "destination unreachable".
pub const ICMP_DEST_UNREACH: u8 = 3;
/// ICMP type "time exceeded".
pub const ICMP_TIME_EXCEEDED: u8 = 11;

/// Reads an ICMP error quoting a TCP/UDP packet out of a validated, unfragmented ICMP
/// frame; `None` for anything else (echo, truncated quotes, quoted fragments ...).
pub fn parse_icmp_error(frame: &[u8], v: &Ipv4View) -> Option<IcmpErrorView> {
    if v.protocol != IPPROTO_ICMP || v.fragment {
        return None;
    }
    let icmp_off = v.l4_offset();
    let end = ETH_HEADER_LEN + v.total_len;
    let icmp = frame.get(icmp_off..end)?;
    if icmp.len() < 8 + 20 {
        return None;
    }
    let icmp_type = icmp[0];
    if icmp_type != ICMP_DEST_UNREACH && icmp_type != ICMP_TIME_EXCEEDED {
        return None;
    }
    let inner = &icmp[8..];
    if inner[0] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(inner[0] & 0x0f) * 4;
    // The quote must hold the inner header and the first 8 bytes of its payload.
    if ihl < 20 || inner.len() < ihl + 8 || be16(inner, 6) & 0x1fff != 0 {
        return None;
    }
    let proto = inner[9];
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    Some(IcmpErrorView {
        icmp_type,
        inner_l3: icmp_off + 8,
        inner_header_len: ihl,
        inner_src: be32(inner, 12),
        inner_dst: be32(inner, 16),
        inner_protocol: proto,
        inner_src_port: be16(inner, ihl),
        inner_dst_port: be16(inner, ihl + 2),
    })
}

/// Translates an ICMP error in place: the outer header's `outer` end becomes
/// `outer_addr`, the quoted packet's `quoted` end becomes `quoted_addr:quoted_port`.
/// Keeps the outer and quoted IPv4 header checksums right incrementally, updates a quoted
/// UDP checksum incrementally, and recomputes the ICMP checksum over the whole message.
/// (A quoted TCP checksum lies beyond the 8 quoted bytes routers must include and is left
/// alone; receivers do not check it.)
///
/// Forward (an error to a VIP about a reply we sent): outer destination VIP → backend,
/// quoted source VIP:port → backend:port. Reverse (a backend's error about a packet we
/// DNATed): outer source backend → VIP, quoted destination backend:port → VIP:port.
#[allow(clippy::too_many_arguments)]
pub fn rewrite_icmp_error(
    frame: &mut [u8],
    v: &mut Ipv4View,
    e: &IcmpErrorView,
    outer: NatSide,
    outer_addr: u32,
    quoted: NatSide,
    quoted_addr: u32,
    quoted_port: u16,
) {
    rewrite_addr(frame, v, outer, outer_addr);
    let inner = e.inner_l3;
    let l4 = inner + e.inner_header_len;
    let (addr_off, port_off, old_addr, old_port) = match quoted {
        NatSide::Source => (inner + 12, l4, e.inner_src, e.inner_src_port),
        NatSide::Destination => (inner + 16, l4 + 2, e.inner_dst, e.inner_dst_port),
    };
    let c = be16(frame, inner + 10);
    put16(frame, inner + 10, csum_replace32(c, old_addr, quoted_addr));
    put32(frame, addr_off, quoted_addr);
    put16(frame, port_off, quoted_port);
    if e.inner_protocol == IPPROTO_UDP && frame.len() >= l4 + 8 {
        let c = be16(frame, l4 + 6);
        if c != 0 {
            let c = csum_replace32(c, old_addr, quoted_addr);
            let mut c = csum_replace16(c, old_port, quoted_port);
            if c == 0 {
                c = 0xffff;
            }
            put16(frame, l4 + 6, c);
        }
    }
    let icmp = v.l4_offset();
    let end = ETH_HEADER_LEN + v.total_len;
    put16(frame, icmp + 2, 0);
    let c = fold(sum_words(0, &frame[icmp..end]));
    put16(frame, icmp + 2, c);
}

/// Which end of the packet a NAT rewrite changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatSide {
    /// Destination IP and port (forward DNAT, client -> VIP becomes client -> backend).
    Destination,
    /// Source IP and port (reverse NAT, backend -> client becomes VIP -> client).
    Source,
}

/// How the L4 checksum is kept right after a rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4Checksum {
    /// RFC 1624 incremental update (the incoming checksum was complete).
    Incremental,
    /// Recompute over the whole segment (the incoming checksum may be partial).
    Recompute,
}

/// Rewrites one end's address and port of a validated TCP/UDP frame in place, updating
/// the IPv4 header checksum incrementally and the L4 checksum as asked. `v` must come
/// from [`parse`] of this frame and have `l4`; it is updated to match the new frame.
pub fn rewrite_addr_port(
    frame: &mut [u8],
    v: &mut Ipv4View,
    side: NatSide,
    addr: u32,
    port: u16,
    l4csum: L4Checksum,
) {
    let Some(mut l4) = v.l4 else { return };
    let ip = v.l3_offset();
    let (addr_off, port_off, old_addr, old_port) = match side {
        NatSide::Destination => (ip + 16, v.l4_offset() + 2, v.dst, l4.dst_port),
        NatSide::Source => (ip + 12, v.l4_offset(), v.src, l4.src_port),
    };
    // IPv4 header checksum covers the address only.
    let ipc = be16(frame, ip + 10);
    put16(frame, ip + 10, csum_replace32(ipc, old_addr, addr));
    put32(frame, addr_off, addr);
    put16(frame, port_off, port);
    match side {
        NatSide::Destination => {
            v.dst = addr;
            l4.dst_port = port;
        }
        NatSide::Source => {
            v.src = addr;
            l4.src_port = port;
        }
    }
    v.l4 = Some(l4);
    let udp_no_checksum = l4.udp_no_checksum;
    let coff = l4_csum_offset(v);
    match l4csum {
        L4Checksum::Recompute => recompute_l4_checksum(frame, v),
        L4Checksum::Incremental => {
            if udp_no_checksum {
                return;
            }
            // The L4 checksum covers the pseudo-header address and the port.
            let c = be16(frame, coff);
            let c = csum_replace32(c, old_addr, addr);
            let mut c = csum_replace16(c, old_port, port);
            if v.protocol == IPPROTO_UDP && c == 0 {
                c = 0xffff;
            }
            put16(frame, coff, c);
        }
    }
}

/// The IPv4 identification field of the packet in `frame`.
pub fn ip_id(frame: &[u8]) -> u16 {
    be16(frame, ETH_HEADER_LEN + 4)
}

/// The fragment offset (in 8-byte units) of the packet in `frame`; 0 for a first
/// fragment or a whole datagram.
pub fn fragment_offset(frame: &[u8]) -> u16 {
    be16(frame, ETH_HEADER_LEN + 6) & 0x1fff
}

/// The ports of a first fragment (offset 0, more fragments follow) of a TCP or UDP
/// datagram, read from the transport header it carries. `None` when `v` is not such a
/// fragment or the fragment is too short to hold the whole transport header (RFC 1858:
/// such tiny fragments are refused). The checksum covers the whole datagram, so it is
/// only ever updated incrementally.
pub fn first_fragment_l4(frame: &[u8], v: &Ipv4View) -> Option<L4View> {
    if !v.fragment || fragment_offset(frame) != 0 {
        return None;
    }
    let l4 = frame.get(v.l4_offset()..ETH_HEADER_LEN + v.total_len)?;
    let need = match v.protocol {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        _ => return None,
    };
    if l4.len() < need {
        return None;
    }
    Some(L4View {
        src_port: be16(l4, 0),
        dst_port: be16(l4, 2),
        tcp_flags: if v.protocol == IPPROTO_TCP { l4[13] } else { 0 },
        udp_no_checksum: v.protocol == IPPROTO_UDP && be16(l4, 6) == 0,
    })
}

/// Rewrites the source or destination address only (a later fragment: no transport
/// header), with an incremental header-checksum update.
pub fn rewrite_addr(frame: &mut [u8], v: &mut Ipv4View, side: NatSide, addr: u32) {
    let ip = v.l3_offset();
    let (off, old) = match side {
        NatSide::Destination => (ip + 16, v.dst),
        NatSide::Source => (ip + 12, v.src),
    };
    let c = be16(frame, ip + 10);
    put16(frame, ip + 10, csum_replace32(c, old, addr));
    put32(frame, off, addr);
    match side {
        NatSide::Destination => v.dst = addr,
        NatSide::Source => v.src = addr,
    }
}

/// Decrements the TTL with an incremental header-checksum update. Returns `false` (and
/// leaves the frame alone) when the TTL is 0 or 1: the packet must not be forwarded, the
/// kernel answers with ICMP time exceeded.
pub fn decrement_ttl(frame: &mut [u8], v: &mut Ipv4View) -> bool {
    if v.ttl <= 1 {
        return false;
    }
    let ip = v.l3_offset();
    let old = be16(frame, ip + 8);
    frame[ip + 8] = v.ttl - 1;
    let new = be16(frame, ip + 8);
    let c = be16(frame, ip + 10);
    put16(frame, ip + 10, csum_replace16(c, old, new));
    v.ttl -= 1;
    true
}

/// Sets the Ethernet source and destination (the frame has an Ethernet header).
pub fn set_macs(frame: &mut [u8], src: MacAddr, dst: MacAddr) {
    frame[0..6].copy_from_slice(&dst.0);
    frame[6..12].copy_from_slice(&src.0);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Builds an Ethernet + IPv4 + TCP/UDP frame with correct checksums.
    pub(crate) fn build(
        proto: u8,
        src: [u8; 4],
        sport: u16,
        dst: [u8; 4],
        dport: u16,
        payload: &[u8],
    ) -> Vec<u8> {
        build_with(proto, src, sport, dst, dport, payload, 64, tcp_flags::ACK)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build_with(
        proto: u8,
        src: [u8; 4],
        sport: u16,
        dst: [u8; 4],
        dport: u16,
        payload: &[u8],
        ttl: u8,
        flags: u8,
    ) -> Vec<u8> {
        let l4_len = if proto == IPPROTO_TCP { 20 } else { 8 } + payload.len();
        let total = 20 + l4_len;
        let mut f = vec![0u8; ETH_HEADER_LEN + total];
        f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        let ip = ETH_HEADER_LEN;
        f[ip] = 0x45;
        f[ip + 2..ip + 4].copy_from_slice(&(total as u16).to_be_bytes());
        f[ip + 4..ip + 6].copy_from_slice(&0x1234u16.to_be_bytes());
        f[ip + 6] = 0x40; // DF
        f[ip + 8] = ttl;
        f[ip + 9] = proto;
        f[ip + 12..ip + 16].copy_from_slice(&src);
        f[ip + 16..ip + 20].copy_from_slice(&dst);
        let c = ipv4_header_checksum(&f[ip..ip + 20]);
        f[ip + 10..ip + 12].copy_from_slice(&c.to_be_bytes());
        let l4 = ip + 20;
        f[l4..l4 + 2].copy_from_slice(&sport.to_be_bytes());
        f[l4 + 2..l4 + 4].copy_from_slice(&dport.to_be_bytes());
        if proto == IPPROTO_TCP {
            f[l4 + 4..l4 + 8].copy_from_slice(&1000u32.to_be_bytes());
            f[l4 + 12] = 5 << 4;
            f[l4 + 13] = flags;
            f[l4 + 14..l4 + 16].copy_from_slice(&65535u16.to_be_bytes());
            f[l4 + 20..].copy_from_slice(payload);
        } else {
            f[l4 + 4..l4 + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            f[l4 + 8..].copy_from_slice(payload);
        }
        let Ok(Parsed::Ipv4(v)) = parse(&f) else {
            panic!("built frame does not parse")
        };
        fill_l4_checksum(&mut f, &v);
        f
    }

    /// Puts what a sender with tx checksum offload leaves in the L4 checksum field
    /// (`CHECKSUM_PARTIAL`): the folded pseudo-header sum, not complemented — as Linux's
    /// `__tcp_v4_send_check` / `udp4_hwcsum` do (`~csum_tcpudp_magic(src, dst, len,
    /// proto, 0)`).
    pub(crate) fn set_partial_checksum(f: &mut [u8]) {
        let Ok(Parsed::Ipv4(v)) = parse(f) else {
            panic!("not IPv4")
        };
        let len = (v.total_len - v.header_len) as u32;
        let mut s = (v.src >> 16) + (v.src & 0xffff) + (v.dst >> 16) + (v.dst & 0xffff);
        s += u32::from(v.protocol) + len;
        let partial = !fold(s);
        let off = l4_csum_offset(&v);
        f[off..off + 2].copy_from_slice(&partial.to_be_bytes());
    }

    /// Asserts that the IPv4 and L4 checksums of `f` verify from scratch.
    pub(crate) fn assert_checksums_valid(f: &[u8]) {
        let Ok(Parsed::Ipv4(v)) = parse(f) else {
            panic!("not IPv4")
        };
        let ip = &f[ETH_HEADER_LEN..ETH_HEADER_LEN + v.header_len];
        assert_eq!(
            be16(ip, 10),
            ipv4_header_checksum(ip),
            "IPv4 header checksum"
        );
        if v.l4.is_some() {
            let stored = be16(f, l4_csum_offset(&v));
            if !(v.protocol == IPPROTO_UDP && stored == 0) {
                assert_eq!(stored, l4_checksum(f, &v), "L4 checksum");
            }
        }
    }

    #[test]
    fn parses_tcp_frame_fields() {
        let f = build(
            IPPROTO_TCP,
            [192, 0, 2, 1],
            40000,
            [203, 0, 113, 10],
            80,
            b"GET /",
        );
        let Parsed::Ipv4(v) = parse(&f).unwrap() else {
            panic!()
        };
        assert_eq!(v.src_addr(), Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(v.dst_addr(), Ipv4Addr::new(203, 0, 113, 10));
        assert_eq!(v.protocol, IPPROTO_TCP);
        assert_eq!(v.ttl, 64);
        assert!(!v.fragment && !v.has_options());
        let l4 = v.l4.unwrap();
        assert_eq!(
            (l4.src_port, l4.dst_port, l4.tcp_flags),
            (40000, 80, tcp_flags::ACK)
        );
        assert_checksums_valid(&f);
    }

    /// The RFC 1071 definition, 16 bits at a time.
    fn naive_sum(data: &[u8]) -> u16 {
        let mut sum: u32 = 0;
        for c in data.chunks(2) {
            sum += u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0));
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    proptest! {
        #[test]
        fn fast_sum_matches_rfc1071(data in prop::collection::vec(any::<u8>(), 0..2000), split in any::<usize>()) {
            // Split at an even offset, as the L4 checksum does around its own field.
            let split = (split % (data.len() + 1)) & !1;
            let s = sum_words(sum_words(0, &data[..split]), &data[split..]);
            prop_assert_eq!(fold(s), naive_sum(&data));
        }
    }

    #[test]
    fn built_udp_frames_carry_a_checksum() {
        // Guards the property tests: a UDP checksum of 0 would make them vacuous.
        let f = build(IPPROTO_UDP, [10, 0, 0, 1], 1, [10, 0, 0, 2], 2, b"abc");
        assert_ne!(be16(&f, 14 + 20 + 6), 0);
        assert_checksums_valid(&f);
    }

    #[test]
    fn known_checksum_vector() {
        // The classic example header from RFC 1071 discussions (Wikipedia's IPv4 header
        // checksum example): checksum 0xb861.
        let h: [u8; 20] = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(ipv4_header_checksum(&h), 0xb861);
    }

    #[test]
    fn non_ipv4_and_errors() {
        let mut arp = vec![0u8; 42];
        arp[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
        assert_eq!(parse(&arp), Ok(Parsed::NotIpv4(ETHERTYPE_ARP)));
        assert_eq!(parse(&arp[..10]), Err(ParseError::TruncatedEthernet));
        let f = build(IPPROTO_UDP, [10, 0, 0, 1], 1, [10, 0, 0, 2], 2, b"x");
        assert_eq!(parse(&f[..30]), Err(ParseError::TruncatedIpv4));
        let mut bad = f.clone();
        bad[14] = 0x65;
        assert_eq!(parse(&bad), Err(ParseError::BadIpVersion));
        let mut bad = f.clone();
        bad[14] = 0x44;
        assert_eq!(parse(&bad), Err(ParseError::BadIpHeaderLength));
        let mut bad = f.clone();
        bad[16..18].copy_from_slice(&500u16.to_be_bytes());
        assert_eq!(parse(&bad), Err(ParseError::BadIpTotalLength));
        let mut bad = f.clone();
        bad[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&3u16.to_be_bytes());
        assert_eq!(parse(&bad), Err(ParseError::BadL4Length));
        let t = build(IPPROTO_TCP, [10, 0, 0, 1], 1, [10, 0, 0, 2], 2, b"");
        let mut bad = t.clone();
        bad[14 + 20 + 12] = 0x30;
        assert_eq!(parse(&bad), Err(ParseError::BadL4Length));
    }

    #[test]
    fn fragments_have_no_l4() {
        let mut f = build(IPPROTO_UDP, [10, 0, 0, 1], 1, [10, 0, 0, 2], 2, b"abcd");
        f[14 + 6] = 0x20; // MF
        let Parsed::Ipv4(v) = parse(&f).unwrap() else {
            panic!()
        };
        assert!(v.fragment && v.l4.is_none());
        f[14 + 6] = 0x00;
        f[14 + 7] = 0x10; // offset 16*8
        let Parsed::Ipv4(v) = parse(&f).unwrap() else {
            panic!()
        };
        assert!(v.fragment && v.l4.is_none());
    }

    #[test]
    fn frame_with_ethernet_padding_parses_by_total_length() {
        let mut f = build(IPPROTO_UDP, [10, 0, 0, 1], 1, [10, 0, 0, 2], 2, b"");
        f.resize(60, 0xaa);
        let Parsed::Ipv4(mut v) = parse(&f).unwrap() else {
            panic!()
        };
        rewrite_addr_port(
            &mut f,
            &mut v,
            NatSide::Destination,
            0x0a000003,
            8080,
            L4Checksum::Incremental,
        );
        assert_checksums_valid(&f);
    }

    #[test]
    fn dnat_snat_ttl_mac() {
        let mut f = build(
            IPPROTO_TCP,
            [192, 0, 2, 1],
            40000,
            [203, 0, 113, 10],
            80,
            b"hello",
        );
        let Parsed::Ipv4(mut v) = parse(&f).unwrap() else {
            panic!()
        };
        rewrite_addr_port(
            &mut f,
            &mut v,
            NatSide::Destination,
            u32::from(Ipv4Addr::new(10, 1, 0, 5)),
            8080,
            L4Checksum::Incremental,
        );
        assert!(decrement_ttl(&mut f, &mut v));
        set_macs(&mut f, MacAddr([1; 6]), MacAddr([2; 6]));
        assert_checksums_valid(&f);
        let Parsed::Ipv4(v2) = parse(&f).unwrap() else {
            panic!()
        };
        assert_eq!(v2, v);
        assert_eq!(v2.dst_addr(), Ipv4Addr::new(10, 1, 0, 5));
        assert_eq!(v2.l4.unwrap().dst_port, 8080);
        assert_eq!(v2.ttl, 63);
        assert_eq!(&f[0..6], &[2; 6]);
        assert_eq!(&f[6..12], &[1; 6]);
    }

    #[test]
    fn ttl_one_is_not_forwarded() {
        let mut f = build_with(IPPROTO_UDP, [1, 1, 1, 1], 1, [2, 2, 2, 2], 2, b"", 1, 0);
        let Parsed::Ipv4(mut v) = parse(&f).unwrap() else {
            panic!()
        };
        let before = f.clone();
        assert!(!decrement_ttl(&mut f, &mut v));
        assert_eq!(f, before);
    }

    #[test]
    fn udp_without_checksum_keeps_none() {
        let mut f = build(IPPROTO_UDP, [1, 1, 1, 1], 1, [2, 2, 2, 2], 2, b"abc");
        f[14 + 20 + 6] = 0;
        f[14 + 20 + 7] = 0;
        let Parsed::Ipv4(mut v) = parse(&f).unwrap() else {
            panic!()
        };
        rewrite_addr_port(
            &mut f,
            &mut v,
            NatSide::Source,
            0x0a0a0a0a,
            53,
            L4Checksum::Incremental,
        );
        assert_eq!(&f[14 + 26..14 + 28], &[0, 0]);
        rewrite_addr_port(
            &mut f,
            &mut v,
            NatSide::Source,
            0x0a0a0a0b,
            54,
            L4Checksum::Recompute,
        );
        assert_eq!(&f[14 + 26..14 + 28], &[0, 0]);
    }

    #[test]
    fn recompute_fixes_a_partial_checksum() {
        let mut f = build(
            IPPROTO_TCP,
            [10, 0, 0, 5],
            8080,
            [192, 0, 2, 1],
            40000,
            b"reply",
        );
        // What a veth with tx offload hands over: only the pseudo-header sum.
        f[14 + 20 + 16] = 0x12;
        f[14 + 20 + 17] = 0x34;
        let Parsed::Ipv4(mut v) = parse(&f).unwrap() else {
            panic!()
        };
        rewrite_addr_port(
            &mut f,
            &mut v,
            NatSide::Source,
            0xcb00710a,
            80,
            L4Checksum::Recompute,
        );
        assert_checksums_valid(&f);
    }

    fn arb_frame() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::bool::ANY,
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<[u8; 4]>(),
            any::<u16>(),
            prop::collection::vec(any::<u8>(), 0..300),
            2u8..=255,
        )
            .prop_map(|(tcp, s, sp, d, dp, payload, ttl)| {
                let proto = if tcp { IPPROTO_TCP } else { IPPROTO_UDP };
                build_with(proto, s, sp, d, dp, &payload, ttl, tcp_flags::ACK)
            })
    }

    proptest! {
        #[test]
        fn incremental_equals_full_recomputation(f in arb_frame(), addr in any::<u32>(), port in any::<u16>(), dst in any::<bool>()) {
            let mut f = f;
            let Parsed::Ipv4(mut v) = parse(&f).unwrap() else { panic!() };
            let side = if dst { NatSide::Destination } else { NatSide::Source };
            rewrite_addr_port(&mut f, &mut v, side, addr, port, L4Checksum::Incremental);
            prop_assert!(decrement_ttl(&mut f, &mut v));
            assert_checksums_valid(&f);
            let mut g = f.clone();
            let Parsed::Ipv4(w) = parse(&g).unwrap() else { panic!() };
            recompute_l4_checksum(&mut g, &w);
            prop_assert_eq!(f, g);
        }

        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
            let _ = parse_fast(&bytes);
        }

        /// `parse_fast` accepts exactly the frames `parse` reads as IHL-5, unfragmented
        /// TCP/UDP, and reads the same fields.
        #[test]
        fn fast_parse_agrees_with_parse(f in arb_frame(), pos in 0usize..60, val in any::<u8>(), cut in any::<usize>()) {
            let mut f = f;
            if pos < f.len() {
                f[pos] = val;
            }
            f.truncate(cut % (f.len() + 1) + 10);
            let full = match parse(&f) {
                Ok(Parsed::Ipv4(v)) if v.header_len == 20 && !v.fragment => v.l4.map(|l4| (v, l4)),
                _ => None,
            };
            match (parse_fast(&f), full) {
                (None, None) => {}
                (Some(p), Some((v, l4))) => {
                    prop_assert_eq!((p.src, p.dst, p.protocol, p.ttl), (v.src, v.dst, v.protocol, v.ttl));
                    prop_assert_eq!((p.src_port, p.dst_port, p.tcp_flags), (l4.src_port, l4.dst_port, l4.tcp_flags));
                    prop_assert_eq!(usize::from(p.l4_len), v.total_len - 20);
                }
                (a, b) => prop_assert!(false, "parse_fast {:?} vs parse {:?}", a, b),
            }
        }

        /// A partial (offload) checksum is recognised; a complete one only by the
        /// 1-in-65536 coincidence of equal values.
        #[test]
        fn partial_checksums_are_recognised(f in arb_frame()) {
            let mut f = f;
            let Parsed::Ipv4(v) = parse(&f).unwrap() else { panic!() };
            let l4_len = (v.total_len - v.header_len) as u16;
            let off = l4_csum_offset(&v);
            let complete = be16(&f, off);
            set_partial_checksum(&mut f);
            let partial = be16(&f, off);
            prop_assert!(is_partial_checksum(partial, v.src, v.dst, v.protocol, l4_len));
            prop_assert_eq!(is_partial_checksum(complete, v.src, v.dst, v.protocol, l4_len), complete == partial);
        }

        #[test]
        fn mutated_valid_frames_never_panic_and_rewrite_safely(f in arb_frame(), pos in any::<usize>(), val in any::<u8>(), cut in any::<usize>()) {
            let mut f = f;
            let p = pos % f.len();
            f[p] = val;
            f.truncate(cut % (f.len() + 1));
            if let Ok(Parsed::Ipv4(mut v)) = parse(&f) {
                if v.l4.is_some() {
                    rewrite_addr_port(&mut f, &mut v, NatSide::Destination, 1, 2, L4Checksum::Incremental);
                    rewrite_addr_port(&mut f, &mut v, NatSide::Source, 3, 4, L4Checksum::Recompute);
                }
                decrement_ttl(&mut f, &mut v);
            }
        }
    }
}
