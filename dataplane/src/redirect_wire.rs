//! The encapsulation of redirected packets between nodes: a view over frame bytes.
//!
//! ```text
//! Ethernet | IPv4 (node → node, DF, TTL 64, proto 17) | UDP (→ redirect port, checksum 0)
//!          | header: "JR" | version | kind | flags | hop count n | key id | 0 | cookie (8 bytes)
//!          | n × IPv4 address
//!          | version 3 only: tag (16 bytes)
//!          | kind 1 (packet): the original IPv4 or IPv6 packet, unchanged (its version
//!            nibble says which)
//!          | kind 2 (notice): client, VIP (4 bytes each), client port, VIP port (2 each),
//!            protocol, 3 zero bytes — "the sender of this notice owns this flow"
//!          | kind 3 (IPv6 notice): the same with 16-byte addresses (40 bytes)
//!          | kind 4 (probe), kind 5 (answer): no body; the cookie field carries the
//!            probe's nonce, which the answer echoes — "are you there", "I am"
//! ```
//!
//! IPv6 (issue #28) changed no byte of what IPv4 sends: the outer packet stays IPv4 between
//! the nodes' redirect addresses, an IPv6 inner packet is told by its version nibble, an
//! IPv6 notice by its kind. A node older than that refuses both as malformed
//! (`redirect_malformed`), so no version bump (docs/decisions.md).
//!
//! The cookie (version 2) is the first node's: a keyed hash of the flow it
//! asks about, carried unchanged by the nodes that pass the question on and echoed by
//! the owner in its notice, which the first node accepts only if the cookie is the one
//! it would compute (so a notice answers a question it asked). 0 when no notice is
//! wanted. Version 1 (no cookie) is refused as malformed.
//!
//! Version 3 (when a key is published) adds a MAC: the key id (byte 6 of the
//! header, [`RedirectKey::id`]) and a 16-byte tag, SipHash-2-4-128 under that key of
//! [`mac`]'s input: the outer source and destination addresses, the whole header
//! (hops included, the tag left out) and, for a notice, its body; for a packet, the
//! first [`INNER_AUTH`] bytes of the inner packet (its IPv4 header and first 8
//! transport bytes: addresses, ports, protocol; an IPv6 one's first [`INNER_AUTH6`]: its
//! fixed header and the 8 bytes after it), not its payload. Version 2 (no key id
//! byte, no tag) is what a node without a key sends.
//!
//! Probes and answers (the liveness of redirect peers, [`crate::peer_liveness`]) came
//! after version 3 and kept its bytes: a node older than them refuses both as malformed,
//! so it never answers, and a peer that never answered stays a candidate.
//!
//! The header grows by 4 bytes per visited node (at most [`MAX_HOPS`]), so a packet
//! gains 28 + 16 + 4 × hops (+ 16 with a tag) ≤ 92 bytes: the node network's MTU must
//! exceed the clients' by that much (docs/dataplane.md, "Redirects between nodes"). The
//! UDP checksum is 0 (allowed for IPv4, RFC 768): the inner packet keeps its own
//! checksums.
//!
//! Must not touch: decisions (that is [`crate::redirect`]) or I/O.

use juneau_control::model::RedirectKey;
use siphasher::sip128::SipHasher24;
use subtle::ConstantTimeEq;

use crate::flow::FlowKey;
use crate::flow6::Flow6Key;
use crate::packet;
use crate::redirect::{HopList, RedirectOut, MAX_HOPS};

/// First bytes of the header.
pub const MAGIC: [u8; 2] = *b"JR";
/// Header version without a MAC (2: with the cookie), sent while no key is published.
pub const VERSION_COOKIE: u8 = 2;
/// Header version with a key id and a tag (3), sent once a key is published.
pub const VERSION_MAC: u8 = 3;
/// Bytes of a version-3 tag (SipHash-2-4-128).
pub const TAG: usize = 16;
/// Bytes of a redirected packet's inner packet the tag covers: an IPv4 header without
/// options and the first 8 bytes of the transport header.
pub const INNER_AUTH: usize = 20 + 8;
/// The same for an IPv6 inner packet: the fixed header and the next 8 bytes (the
/// transport header's ports when no extension header comes between).
pub const INNER_AUTH6: usize = 40 + 8;
/// Kind: an encapsulated packet.
pub const KIND_PACKET: u8 = 1;
/// Kind: an "I own this flow" notice.
pub const KIND_NOTICE: u8 = 2;
/// Kind: an "I own this flow" notice about an IPv6 flow.
pub const KIND_NOTICE6: u8 = 3;
/// Kind: "are you there" (a liveness probe; its nonce in the cookie field).
pub const KIND_PROBE: u8 = 4;
/// Kind: "I am" (the answer to a probe, its nonce echoed in the cookie field).
pub const KIND_ANSWER: u8 = 5;
/// Flag: the sender wants a notice from the owner.
pub const FLAG_ASK: u8 = 1;
/// Outer IPv4 + UDP header bytes.
pub const OUTER: usize = 20 + 8;
/// Fixed part of the header (with the cookie).
pub const FIXED: usize = 16;
/// Bytes of a notice's body.
pub const NOTICE_BODY: usize = 16;
/// Bytes of an IPv6 notice's body.
pub const NOTICE_BODY6: usize = 40;
/// Most bytes encapsulation adds to a packet (version 3, with the tag).
pub const MAX_OVERHEAD: usize = OUTER + FIXED + 4 * MAX_HOPS + TAG;
/// Most bytes a tag is computed over: the outer addresses, the longest header, a
/// notice's body or a packet's first [`INNER_AUTH`] (IPv6: [`INNER_AUTH6`]) bytes.
const MAX_MAC_INPUT: usize = 8 + FIXED + 4 * MAX_HOPS + INNER_AUTH6;

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
    /// [`KIND_PACKET`], [`KIND_NOTICE`], [`KIND_NOTICE6`], [`KIND_PROBE`] or
    /// [`KIND_ANSWER`].
    pub kind: u8,
    /// Header flags ([`FLAG_ASK`]).
    pub flags: u8,
    /// Visited nodes.
    pub hops: HopList,
    /// The first node's cookie (a question), or the one echoed (a notice); a probe's
    /// nonce (a probe, an answer).
    pub cookie: u64,
    /// [`VERSION_COOKIE`] or [`VERSION_MAC`].
    pub version: u8,
    /// The id of the key the tag is under (version 3; 0 in version 2).
    pub key_id: u8,
    /// Offset of the tag in the frame (version 3), `None` in version 2.
    pub tag: Option<usize>,
    /// Offset of the body (the inner IPv4 or IPv6 packet, or the notice) in the frame.
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
    let version = frame[h + 2];
    if frame[h..h + 2] != MAGIC || !(version == VERSION_COOKIE || version == VERSION_MAC) {
        return Err(WireError::Malformed);
    }
    let (kind, flags, n) = (frame[h + 3], frame[h + 4], usize::from(frame[h + 5]));
    let known = matches!(
        kind,
        KIND_PACKET | KIND_NOTICE | KIND_NOTICE6 | KIND_PROBE | KIND_ANSWER
    );
    if n > MAX_HOPS || !known {
        return Err(WireError::Malformed);
    }
    let (key_id, tag) = if version == VERSION_MAC {
        (frame[h + 6], Some(h + FIXED + 4 * n))
    } else {
        (0, None)
    };
    let body = h + FIXED + 4 * n + if tag.is_some() { TAG } else { 0 };
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
    let short = match kind {
        KIND_NOTICE => body_len < NOTICE_BODY,
        KIND_NOTICE6 => body_len < NOTICE_BODY6,
        KIND_PROBE | KIND_ANSWER => false,
        // An IPv4 packet (version 4) or an IPv6 one (version 6), at least its header.
        _ => match frame.get(body).map(|b| b >> 4) {
            Some(4) => body_len < 20,
            Some(6) => body_len < 40,
            _ => true,
        },
    };
    if short {
        return Err(WireError::Malformed);
    }
    Ok(Received {
        kind,
        flags,
        hops,
        cookie,
        version,
        key_id,
        tag,
        body,
        body_len,
    })
}

/// The tag of a frame under `key`: SipHash-2-4-128 of the outer source and destination
/// addresses, the header `frame[h..h + header_len]` (without the tag) and the
/// authenticated part of the body at `body` (a notice's `NOTICE_BODY` bytes, a packet's
/// first [`INNER_AUTH`]). At most [`MAX_MAC_INPUT`] bytes, copied into one buffer and
/// hashed once.
fn mac(key: &RedirectKey, frame: &[u8], header_len: usize, body: usize, auth: usize) -> [u8; TAG] {
    let h = ETH + OUTER;
    let mut input = [0u8; MAX_MAC_INPUT];
    input[..8].copy_from_slice(&frame[ETH + 12..ETH + 20]);
    input[8..8 + header_len].copy_from_slice(&frame[h..h + header_len]);
    let n = 8 + header_len;
    input[n..n + auth].copy_from_slice(&frame[body..body + auth]);
    SipHasher24::new_with_key(key.key.expose())
        .hash(&input[..n + auth])
        .as_bytes()
}

/// Bytes of a body (whose first byte is `first`) the tag covers.
fn authenticated(kind: u8, first: u8, body_len: usize) -> usize {
    match kind {
        KIND_NOTICE => NOTICE_BODY,
        KIND_NOTICE6 => NOTICE_BODY6,
        KIND_PROBE | KIND_ANSWER => 0,
        _ if first >> 4 == 6 => body_len.min(INNER_AUTH6),
        _ => body_len.min(INNER_AUTH),
    }
}

/// Whether a parsed frame carries a tag that one of `keys` (with its key id) gives;
/// constant-time comparison. A frame without a tag (version 2) never does.
pub fn verify(frame: &[u8], r: &Received, keys: &[RedirectKey]) -> bool {
    let Some(at) = r.tag else {
        return false;
    };
    let header_len = FIXED + 4 * r.hops.len();
    let first = frame.get(r.body).copied().unwrap_or(0);
    let auth = authenticated(r.kind, first, r.body_len);
    let got = &frame[at..at + TAG];
    let mut ok = false;
    for k in keys.iter().filter(|k| k.id == r.key_id) {
        let want = mac(k, frame, header_len, r.body, auth);
        ok |= bool::from(want.ct_eq(got));
    }
    ok
}

/// Writes the tag of a frame [`write_headers`] wrote with `key` (its body in place).
fn seal(buf: &mut [u8], key: &RedirectKey, kind: u8, hops: usize, body_len: usize) {
    let header_len = FIXED + 4 * hops;
    let at = ETH + OUTER + header_len;
    let first = buf.get(at + TAG).copied().unwrap_or(0);
    let auth = authenticated(kind, first, body_len);
    let tag = mac(key, buf, header_len, at + TAG, auth);
    buf[at..at + TAG].copy_from_slice(&tag);
}

/// The outer source address of a received frame.
pub fn outer_source(frame: &[u8]) -> u32 {
    u32::from_be_bytes([frame[26], frame[27], frame[28], frame[29]])
}

/// Moves the inner packet of a [`KIND_PACKET`] frame behind the frame's Ethernet header
/// (in place), the EtherType set to the inner packet's family; returns the new frame
/// length.
pub fn decapsulate(frame: &mut [u8], r: &Received) -> usize {
    let ethertype = if inner_is_ipv6(frame, r) {
        packet::ETHERTYPE_IPV6
    } else {
        0x0800
    };
    frame.copy_within(r.body..r.body + r.body_len, ETH);
    frame[12..14].copy_from_slice(&ethertype.to_be_bytes());
    ETH + r.body_len
}

/// Whether a parsed [`KIND_PACKET`] frame carries an IPv6 packet (its version nibble).
pub fn inner_is_ipv6(frame: &[u8], r: &Received) -> bool {
    r.kind == KIND_PACKET && frame[r.body] >> 4 == 6
}

/// The flow a notice names: an IPv4 one or an IPv6 one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeKey {
    /// An IPv4 flow's forward key ([`KIND_NOTICE`]).
    V4(FlowKey),
    /// An IPv6 flow's forward key ([`KIND_NOTICE6`]).
    V6(Flow6Key),
}

impl From<&FlowKey> for NoticeKey {
    fn from(k: &FlowKey) -> Self {
        NoticeKey::V4(*k)
    }
}

impl From<&Flow6Key> for NoticeKey {
    fn from(k: &Flow6Key) -> Self {
        NoticeKey::V6(*k)
    }
}

/// The forward key an IPv6 notice ([`KIND_NOTICE6`]) names.
pub fn notice_key6(frame: &[u8], r: &Received) -> Flow6Key {
    let b = &frame[r.body..r.body + NOTICE_BODY6];
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&b[0..16]);
    dst.copy_from_slice(&b[16..32]);
    Flow6Key {
        src,
        dst,
        src_port: u16::from_be_bytes([b[32], b[33]]),
        dst_port: u16::from_be_bytes([b[34], b[35]]),
        proto: b[36],
    }
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

/// Writes Ethernet, outer IPv4, UDP and the fixed header + hops (+ room for the tag
/// when `key_id` is given: version 3) at the start of `buf` for a body of `body_len`
/// bytes; returns the header length.
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
    key_id: Option<u8>,
    body_len: usize,
) -> usize {
    let tag = if key_id.is_some() { TAG } else { 0 };
    let hdr = FIXED + 4 * hops.len() + tag;
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
    h[2] = if key_id.is_some() {
        VERSION_MAC
    } else {
        VERSION_COOKIE
    };
    h[3] = kind;
    h[4] = flags;
    h[5] = hops.len() as u8;
    h[6..8].copy_from_slice(&[key_id.unwrap_or(0), 0]);
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    for (i, a) in hops.as_slice().iter().enumerate() {
        h[FIXED + 4 * i..FIXED + 4 * i + 4].copy_from_slice(&a.to_be_bytes());
    }
    ETH + OUTER + hdr
}

/// Encapsulates the frame in `buf[..out.frame_len]` (Ethernet + IPv4 packet) in place
/// for `out.peer`; `buf` is the whole frame buffer. With `key`: version 3, tagged under
/// it; without: version 2. Returns the new length, or `None` when the result does not
/// fit the buffer or would exceed `mtu` (IPv4 bytes).
pub fn encapsulate(
    buf: &mut [u8],
    out: &RedirectOut,
    node: u32,
    port: u16,
    mtu: usize,
    key: Option<&RedirectKey>,
) -> Option<usize> {
    let inner = out.frame_len.checked_sub(ETH)?;
    let tag = if key.is_some() { TAG } else { 0 };
    let head = ETH + OUTER + FIXED + 4 * out.hops.len() + tag;
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
        key.map(|k| k.id),
        inner,
    );
    debug_assert_eq!(h, head);
    if let Some(k) = key {
        seal(buf, k, KIND_PACKET, out.hops.len(), inner);
    }
    Some(total)
}

/// Writes a notice into `buf` (an IPv4 flow's [`KIND_NOTICE`], an IPv6 flow's
/// [`KIND_NOTICE6`]), echoing the question's `cookie` (tagged under `mac_key` when
/// given: version 3); returns its length (`None` if `buf` is too small).
#[allow(clippy::too_many_arguments)]
pub fn build_notice(
    buf: &mut [u8],
    macs: &[u8; 12],
    node: u32,
    to: u32,
    port: u16,
    key: impl Into<NoticeKey>,
    cookie: u64,
    mac_key: Option<&RedirectKey>,
) -> Option<usize> {
    let key: NoticeKey = key.into();
    let (kind, body_len) = match key {
        NoticeKey::V4(_) => (KIND_NOTICE, NOTICE_BODY),
        NoticeKey::V6(_) => (KIND_NOTICE6, NOTICE_BODY6),
    };
    let to = Control {
        macs,
        node,
        to,
        port,
    };
    build_control(buf, &to, (kind, cookie), body_len, mac_key, |b| match key {
        NoticeKey::V4(key) => {
            b[0..4].copy_from_slice(&key.src.to_be_bytes());
            b[4..8].copy_from_slice(&key.dst.to_be_bytes());
            b[8..10].copy_from_slice(&key.src_port.to_be_bytes());
            b[10..12].copy_from_slice(&key.dst_port.to_be_bytes());
            b[12] = key.proto;
            b[13..16].copy_from_slice(&[0, 0, 0]);
        }
        NoticeKey::V6(key) => {
            b[0..16].copy_from_slice(&key.src);
            b[16..32].copy_from_slice(&key.dst);
            b[32..34].copy_from_slice(&key.src_port.to_be_bytes());
            b[34..36].copy_from_slice(&key.dst_port.to_be_bytes());
            b[36] = key.proto;
            b[37..40].copy_from_slice(&[0, 0, 0]);
        }
    })
}

/// Writes a probe ([`KIND_PROBE`]) or an answer ([`KIND_ANSWER`]) from `node` to `to`
/// carrying `nonce`, tagged under `key` (version 3) or not (version 2); returns its length
/// (`None` when `buf` is too short). A probe goes out through the kernel's UDP socket
/// (its bytes after the outer headers); an answer through the uplink's AF_XDP socket.
#[allow(clippy::too_many_arguments)]
pub fn build_liveness(
    buf: &mut [u8],
    macs: &[u8; 12],
    node: u32,
    to: u32,
    port: u16,
    kind: u8,
    nonce: u64,
    key: Option<&RedirectKey>,
) -> Option<usize> {
    debug_assert!(kind == KIND_PROBE || kind == KIND_ANSWER);
    let to = Control {
        macs,
        node,
        to,
        port,
    };
    build_control(buf, &to, (kind, nonce), 0, key, |_| {})
}

/// Where a frame of this node's own (a notice, a probe, an answer) goes: MACs, this
/// node, the peer, the redirect port (source and destination).
struct Control<'a> {
    macs: &'a [u8; 12],
    node: u32,
    to: u32,
    port: u16,
}

/// Writes a frame of this node's own without hops: headers, `(kind, cookie)`, a body of
/// `body_len` bytes written by `body`, the tag under `key` when given; its length, or
/// `None` when `buf` is too short.
fn build_control(
    buf: &mut [u8],
    c: &Control<'_>,
    (kind, cookie): (u8, u64),
    body_len: usize,
    key: Option<&RedirectKey>,
    body: impl FnOnce(&mut [u8]),
) -> Option<usize> {
    let tag = if key.is_some() { TAG } else { 0 };
    let total = ETH + OUTER + FIXED + tag + body_len;
    if buf.len() < total {
        return None;
    }
    let h = write_headers(
        buf,
        c.macs,
        c.node,
        c.to,
        c.port,
        c.port,
        kind,
        0,
        &HopList::new(),
        cookie,
        key.map(|k| k.id),
        body_len,
    );
    body(&mut buf[h..h + body_len]);
    if let Some(k) = key {
        seal(buf, k, kind, 0, body_len);
    }
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
            let n = encapsulate(&mut buf, &out, A, 7411, 1500, None).unwrap();
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
        assert_eq!(encapsulate(&mut buf, &out, A, 7411, 1500, None), None);
        assert!(encapsulate(&mut buf[..1600], &out, A, 7411, 9000, None).is_some());
        assert_eq!(
            encapsulate(&mut buf[..1538], &out, A, 7411, 9000, None),
            None
        );
        // The tag takes 16 more bytes.
        let k = key(1);
        assert_eq!(
            encapsulate(&mut buf[..1577], &out, A, 7411, 9000, Some(&k)),
            None
        );
        assert!(encapsulate(&mut buf[..1578], &out, A, 7411, 9000, Some(&k)).is_some());
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
        let n = build_notice(&mut buf, &[2; 12], A, B, 7411, &key, 42, None).unwrap();
        let f = &mut buf[..n];
        assert!(is_redirect(f, B, 7411));
        let r = parse(f).unwrap();
        assert_eq!((r.kind, r.cookie), (KIND_NOTICE, 42));
        assert_eq!(notice_key(f, &r), key);
        // Version 1 (no cookie) is refused.
        f[14 + 28 + 2] = 1;
        assert_eq!(parse(f), Err(WireError::Malformed));
    }

    /// An IPv6 TCP packet (fixed header, 20-byte TCP header, `payload` bytes) in a frame.
    fn inner_frame6(payload: usize) -> Vec<u8> {
        let mut f = vec![0u8; ETH + 40 + 20 + payload];
        f[12..14].copy_from_slice(&packet::ETHERTYPE_IPV6.to_be_bytes());
        f[14] = 0x60;
        f[18..20].copy_from_slice(&((20 + payload) as u16).to_be_bytes());
        f[20] = packet::IPPROTO_TCP;
        f[21] = 64;
        for (i, b) in f[22..].iter_mut().enumerate() {
            *b = i as u8;
        }
        f
    }

    #[test]
    fn an_ipv6_packet_travels_unchanged_and_its_tag_covers_its_addresses_and_ports() {
        let orig = inner_frame6(100);
        let k = key(3);
        for key in [None, Some(&k)] {
            let mut buf = vec![0u8; 2048];
            buf[..orig.len()].copy_from_slice(&orig);
            let out = RedirectOut {
                peer: B,
                macs: [1; 12],
                hops: HopList::from_slice(&[A]).unwrap(),
                ask: true,
                frame_len: orig.len(),
                entropy: 1,
                cookie: 9,
            };
            let n = encapsulate(&mut buf, &out, A, 7411, 1500, key).unwrap();
            let f = &mut buf[..n];
            assert_eq!(&f[12..14], &[0x08, 0x00], "the outer packet is IPv4");
            let r = parse(f).unwrap();
            assert!(inner_is_ipv6(f, &r));
            if key.is_some() {
                let keys = [k.clone()];
                assert!(verify(f, &r, &keys));
                // The whole fixed header and the ports are covered, not the payload.
                for i in r.body..r.body + INNER_AUTH6 {
                    let mut g = f.to_vec();
                    g[i] ^= 1;
                    assert!(!accepted(&g, &keys), "inner byte {}", i - r.body);
                }
                let mut g = f.to_vec();
                g[r.body + INNER_AUTH6] ^= 1;
                assert!(accepted(&g, &keys));
            }
            let m = decapsulate(f, &r);
            assert_eq!(
                &f[..m][12..],
                &orig[12..],
                "EtherType IPv6, the packet whole"
            );
        }
        // Shorter than an IPv6 header, or another version: malformed.
        let mut buf = vec![0u8; 2048];
        let short = inner_frame6(0);
        buf[..short.len()].copy_from_slice(&short);
        let out = RedirectOut {
            peer: B,
            macs: [1; 12],
            hops: HopList::new(),
            ask: false,
            frame_len: ETH + 39,
            entropy: 0,
            cookie: 0,
        };
        let n = encapsulate(&mut buf, &out, A, 7411, 1500, None).unwrap();
        assert_eq!(parse(&buf[..n]), Err(WireError::Malformed));
        let out = RedirectOut {
            frame_len: ETH + 40,
            ..out
        };
        buf[..short.len()].copy_from_slice(&short);
        let n = encapsulate(&mut buf, &out, A, 7411, 1500, None).unwrap();
        assert!(parse(&buf[..n]).is_ok());
        let body = n - 40;
        buf[body] = 0x50;
        assert_eq!(parse(&buf[..n]), Err(WireError::Malformed));
    }

    #[test]
    fn ipv6_notices_round_trip_tagged_or_not() {
        let key6 = Flow6Key {
            src: [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42],
            dst: [0x20, 1, 0xd, 0xb8, 0, 0x71, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10],
            src_port: 40000,
            dst_port: 443,
            proto: packet::IPPROTO_TCP,
        };
        let k = key(5);
        for mac_key in [None, Some(&k)] {
            let mut buf = [0u8; 160];
            let n = build_notice(&mut buf, &[2; 12], A, B, 7411, &key6, 42, mac_key).unwrap();
            let tag = if mac_key.is_some() { TAG } else { 0 };
            assert_eq!(n, ETH + OUTER + FIXED + tag + NOTICE_BODY6);
            let f = &buf[..n];
            let r = parse(f).unwrap();
            assert_eq!((r.kind, r.cookie), (KIND_NOTICE6, 42));
            assert_eq!(notice_key6(f, &r), key6);
            if mac_key.is_some() {
                let keys = [k.clone()];
                assert!(accepted(f, &keys));
                for i in r.body..r.body + NOTICE_BODY6 {
                    let mut g = f.to_vec();
                    g[i] ^= 0x80;
                    assert!(!accepted(&g, &keys), "notice byte {}", i - r.body);
                }
            }
            // Cut short of its body: malformed.
            let mut g = f.to_vec();
            let udp = u16::from_be_bytes([g[38], g[39]]) - 1;
            g[38..40].copy_from_slice(&udp.to_be_bytes());
            assert_eq!(parse(&g), Err(WireError::Malformed));
        }
    }

    fn key(b: u8) -> RedirectKey {
        RedirectKey::new(juneau_control::secret::SecretKey::new([b; 16]))
    }

    #[test]
    fn probes_and_answers_carry_their_nonce_and_their_tag_covers_it() {
        let macs = [1u8; 12];
        for kind in [KIND_PROBE, KIND_ANSWER] {
            for k in [None, Some(key(7))] {
                let mut buf = vec![0u8; 256];
                let len = build_liveness(&mut buf, &macs, A, B, 7411, kind, 0xfeed, k.as_ref())
                    .expect("fits");
                let f = &mut buf[..len];
                assert!(is_redirect(f, B, 7411));
                let r = parse(f).expect("parses");
                assert_eq!((r.kind, r.cookie, r.body_len), (kind, 0xfeed, 0));
                assert_eq!(outer_source(f), A);
                let Some(k) = k else {
                    assert_eq!(r.version, VERSION_COOKIE);
                    continue;
                };
                assert!(verify(f, &r, std::slice::from_ref(&k)));
                assert!(!verify(f, &r, &[key(8)]), "another key");
                // The nonce is covered: an answer cannot be replayed for another probe.
                f[ETH + OUTER + 15] ^= 1;
                let r = parse(f).expect("parses");
                assert!(!verify(f, &r, std::slice::from_ref(&k)));
            }
        }
        let mut short = [0u8; ETH + OUTER + FIXED - 1];
        assert_eq!(
            build_liveness(&mut short, &macs, A, B, 7411, KIND_PROBE, 1, None),
            None
        );
    }

    #[test]
    fn an_unknown_kind_is_malformed() {
        let mut buf = vec![0u8; 256];
        let len = build_liveness(&mut buf, &[0; 12], A, B, 7411, KIND_PROBE, 1, None).unwrap();
        buf[ETH + OUTER + 3] = 6;
        assert_eq!(parse(&buf[..len]), Err(WireError::Malformed));
    }

    #[test]
    fn the_mac_is_siphash_2_4_128_as_the_reference_gives_it() {
        // The reference implementation's first two 128-bit vectors (key 00..0f; messages
        // of 0 and 1 bytes): the crate is the algorithm the docs name.
        let k: [u8; 16] = std::array::from_fn(|i| i as u8);
        let h = SipHasher24::new_with_key(&k);
        assert_eq!(
            h.hash(&[]).as_bytes(),
            [
                0xa3, 0x81, 0x7f, 0x04, 0xba, 0x25, 0xa8, 0xe6, 0x6d, 0xf6, 0x72, 0x14, 0xc7, 0x55,
                0x02, 0x93
            ]
        );
        assert_eq!(
            h.hash(&[0]).as_bytes(),
            [
                0xda, 0x87, 0xc1, 0xd8, 0x6b, 0x99, 0xaf, 0x44, 0x34, 0x76, 0x59, 0x11, 0x9b, 0x22,
                0xfc, 0x45
            ]
        );
    }

    /// A tagged redirected packet (hops A, B; 100 payload bytes) from A to B.
    fn tagged_packet(k: &RedirectKey) -> Vec<u8> {
        let orig = inner_frame(100);
        let mut buf = vec![0u8; 2048];
        buf[..orig.len()].copy_from_slice(&orig);
        let out = RedirectOut {
            peer: B,
            macs: [1; 12],
            hops: HopList::from_slice(&[A, B]).unwrap(),
            ask: true,
            frame_len: orig.len(),
            entropy: 77,
            cookie: 0x0123_4567_89ab_cdef,
        };
        let n = encapsulate(&mut buf, &out, A, 7411, 1500, Some(k)).unwrap();
        assert_eq!(n, orig.len() + OUTER + FIXED + 8 + TAG);
        buf.truncate(n);
        buf
    }

    fn tagged_notice(k: &RedirectKey) -> Vec<u8> {
        let flow = FlowKey {
            src: 0x0a64_0102,
            dst: 0x0ac8_000a,
            src_port: 40000,
            dst_port: 80,
            proto: packet::IPPROTO_TCP,
        };
        let mut buf = [0u8; 128];
        let n = build_notice(&mut buf, &[2; 12], A, B, 7411, &flow, 42, Some(k)).unwrap();
        assert_eq!(n, ETH + OUTER + FIXED + TAG + NOTICE_BODY);
        buf[..n].to_vec()
    }

    /// Whether `f` is still accepted under `keys` (parses and verifies).
    fn accepted(f: &[u8], keys: &[RedirectKey]) -> bool {
        is_redirect(f, B, 7411) && parse(f).is_ok_and(|r| verify(f, &r, keys))
    }

    #[test]
    fn a_tag_covers_every_authenticated_bit_and_not_the_payload() {
        let k = key(7);
        let keys = [k.clone()];
        for (what, f) in [("packet", tagged_packet(&k)), ("notice", tagged_notice(&k))] {
            let r = parse(&f).unwrap();
            assert_eq!((r.version, r.key_id), (VERSION_MAC, k.id), "{what}");
            assert!(accepted(&f, &keys), "{what}: as sent");
            // The inner packet / notice is where version 2 would have it, shifted by the tag.
            if r.kind == KIND_PACKET {
                let mut g = f.clone();
                let m = decapsulate(&mut g, &r);
                assert_eq!(&g[14..m], &inner_frame(100)[14..], "{what}");
            } else {
                assert_eq!(notice_key(&f, &r).src_port, 40000);
            }
            let tag = r.tag.unwrap();
            let header = ETH + OUTER..tag;
            let auth = r.body..r.body + authenticated(r.kind, f[r.body], r.body_len);
            // Outer addresses, the header (hops, key id, cookie...), the tag, the notice
            // body or the inner IPv4 header + 8 transport bytes: any bit flipped fails.
            let covered = (ETH + 12..ETH + 20)
                .chain(header)
                .chain(tag..tag + TAG)
                .chain(auth.clone());
            for i in covered {
                for bit in 0..8 {
                    let mut g = f.clone();
                    g[i] ^= 1 << bit;
                    assert!(!accepted(&g, &keys), "{what}: byte {i} bit {bit} flipped");
                }
            }
            // Not covered: the payload of a redirected packet (and the outer TTL, id...).
            if r.kind == KIND_PACKET {
                for i in auth.end..f.len() {
                    let mut g = f.clone();
                    g[i] ^= 0xff;
                    assert!(accepted(&g, &keys), "{what}: payload byte {i}");
                }
            }
            let mut g = f.clone();
            g[ETH + 8] ^= 0xff; // outer TTL
            assert!(accepted(&g, &keys), "{what}: outer TTL");
            // Another key, or the right key under another id: refused.
            assert!(!accepted(&f, &[key(8)]), "{what}: other key");
            let mut renamed = k.clone();
            renamed.id = renamed.id.wrapping_add(1);
            assert!(!accepted(&f, &[renamed]), "{what}: other id");
            assert!(!accepted(&f, &[]), "{what}: no key");
            // Either of two keys (a rotation).
            assert!(accepted(&f, &[key(8), k.clone()]), "{what}: rotation");
        }
    }

    #[test]
    fn version_2_frames_parse_but_never_verify() {
        let k = key(7);
        let orig = inner_frame(10);
        let mut buf = vec![0u8; 2048];
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
        let n = encapsulate(&mut buf, &out, A, 7411, 1500, None).unwrap();
        let f = &buf[..n];
        let r = parse(f).unwrap();
        assert_eq!((r.version, r.tag), (VERSION_COOKIE, None));
        assert!(!verify(f, &r, &[k]));
        // A version-3 frame too short for its tag is malformed.
        let mut t = tagged_notice(&key(7));
        let short = (8 + FIXED + TAG - 1) as u16;
        t[38..40].copy_from_slice(&short.to_be_bytes());
        assert_eq!(parse(&t), Err(WireError::Malformed));
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
