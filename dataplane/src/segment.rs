//! Packets larger than their egress takes, cut into ones it does (pure, no I/O).
//!
//! A Pod's kernel hands its veth TCP super-segments of up to 64 KiB (TSO/GSO: the NIC or
//! the kernel would cut them at the very end), a generic-XDP uplink hands over GRO'd
//! segments, and a jumbo interface delivers frames larger than the other side's MTU.
//! The engine NATs such a packet like any other (on a contiguous copy); this module
//! then writes the frames that leave:
//!
//! - **TCP**: segments of at most `payload` bytes each — the headers copied, IP total
//!   length, identification (+1 per segment) and header checksum, the sequence number
//!   advanced, FIN and PSH only on the last segment and CWR only on the first, the TCP
//!   checksum computed in full (a Pod hands over partial checksums);
//! - **anything else without DF**: IPv4 fragments (RFC 791) whose payloads are
//!   multiples of 8 bytes; the L4 checksum stays the one of the whole datagram;
//! - **anything else with DF set**: [`CutError::DontFragment`] (dropped as `too_big`);
//! - **IPv6 TCP** (issue #28): segments as for IPv4 — the payload length set, no
//!   identification or header checksum (IPv6 has neither), the checksum over the IPv6
//!   pseudo-header; **other IPv6** larger than the egress: [`CutError::DontFragment`]
//!   (IPv6 routers never fragment).
//!
//! Wire views in the manner of smoltcp: offsets are read from the frame, nothing is
//! allocated; [`Cut::write`] writes piece `i` into a caller's buffer (a UMEM frame).

use crate::packet::{self, ETH_HEADER_LEN, IPPROTO_TCP};

/// Why a packet cannot be cut to fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CutError {
    /// Not an IPv4 packet this module can read (truncated, bad lengths).
    #[error("not a well-formed IPv4 packet")]
    Malformed,
    /// A non-TCP packet with DF set that is larger than the egress takes.
    #[error("larger than the egress MTU with DF set")]
    DontFragment,
    /// The egress takes less than the headers and one byte of payload (or 8 for a
    /// fragment), or the packet is already a fragment.
    #[error("the egress MTU leaves no room for payload")]
    NoRoom,
}

/// How a packet is cut: its header lengths, and the payload bytes per piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// IPv4 header length.
    ip_len: usize,
    /// Bytes copied into every piece after the IPv4 header (the TCP header; 0 for
    /// fragments).
    l4_hdr: usize,
    /// Payload bytes to spread (after the TCP header, or after the IPv4 header).
    payload: usize,
    /// Payload bytes per piece (the last may have fewer).
    per_piece: usize,
    tcp: bool,
    /// An IPv6 packet (`ip_len`: the fixed header and its extension headers).
    v6: bool,
}

impl Cut {
    /// How to cut `frame` (Ethernet + IPv4) into frames of at most `max_frame` bytes.
    /// `mss` caps a TCP segment's payload plus options (the client's MSS, lowered by
    /// path-MTU discovery), when known.
    pub fn plan(frame: &[u8], max_frame: usize, mss: Option<u16>) -> Result<Cut, CutError> {
        let v = match packet::parse(frame) {
            Ok(packet::Parsed::Ipv4(v)) => v,
            Ok(packet::Parsed::NotIpv4(_)) => return Self::plan6(frame, max_frame, mss),
            Err(_) => return Err(CutError::Malformed),
        };
        let room = max_frame.saturating_sub(ETH_HEADER_LEN + v.header_len);
        if v.protocol == IPPROTO_TCP && v.l4.is_some() {
            let l4 = &frame[v.l4_offset()..];
            let thl = usize::from(l4[12] >> 4) * 4;
            let mut per_piece = room.saturating_sub(thl);
            if let Some(m) = mss.filter(|&m| m > 0) {
                per_piece = per_piece.min(usize::from(m).saturating_sub(thl - 20));
            }
            if per_piece == 0 {
                return Err(CutError::NoRoom);
            }
            return Ok(Cut {
                ip_len: v.header_len,
                l4_hdr: thl,
                payload: v.total_len - v.header_len - thl,
                per_piece,
                tcp: true,
                v6: false,
            });
        }
        let flags = u16::from_be_bytes([frame[ETH_HEADER_LEN + 6], frame[ETH_HEADER_LEN + 7]]);
        if flags & 0x4000 != 0 {
            return Err(CutError::DontFragment);
        }
        let per_piece = room / 8 * 8;
        if per_piece == 0 || v.fragment {
            return Err(CutError::NoRoom);
        }
        Ok(Cut {
            ip_len: v.header_len,
            l4_hdr: 0,
            payload: v.total_len - v.header_len,
            per_piece,
            tcp: false,
            v6: false,
        })
    }

    /// [`Cut::plan`] for an IPv6 frame: TCP only.
    fn plan6(frame: &[u8], max_frame: usize, mss: Option<u16>) -> Result<Cut, CutError> {
        let v = crate::packet6::parse6(frame).map_err(|_| CutError::Malformed)?;
        if v.upper != crate::packet6::Upper::Transport(IPPROTO_TCP) || v.l4.is_none() {
            return Err(CutError::DontFragment);
        }
        let ip_len = crate::packet6::IPV6_HEADER_LEN + v.ext_len;
        let thl = usize::from(frame[v.l4_offset() + 12] >> 4) * 4;
        let mut per_piece = max_frame
            .saturating_sub(ETH_HEADER_LEN + ip_len)
            .saturating_sub(thl);
        if let Some(m) = mss.filter(|&m| m > 0) {
            per_piece = per_piece.min(usize::from(m).saturating_sub(thl - 20));
        }
        if per_piece == 0 || thl < 20 || v.upper_len() < thl {
            return Err(CutError::NoRoom);
        }
        Ok(Cut {
            ip_len,
            l4_hdr: thl,
            payload: v.upper_len() - thl,
            per_piece,
            tcp: true,
            v6: true,
        })
    }

    /// Number of frames the packet becomes (at least 1).
    pub fn pieces(&self) -> usize {
        self.payload.div_ceil(self.per_piece).max(1)
    }

    /// Writes piece `i` of `frame` into `out`; returns its length. `out` must hold
    /// `max_frame` bytes (the plan's bound).
    pub fn write(&self, frame: &[u8], i: usize, out: &mut [u8]) -> usize {
        let hdrs = ETH_HEADER_LEN + self.ip_len + self.l4_hdr;
        let from = i * self.per_piece;
        let len = self.per_piece.min(self.payload - from);
        let total = hdrs + len;
        out[..hdrs].copy_from_slice(&frame[..hdrs]);
        out[hdrs..total].copy_from_slice(&frame[hdrs + from..hdrs + from + len]);
        let ip = ETH_HEADER_LEN;
        if self.v6 {
            put16(
                out,
                ip + 4,
                (total - ETH_HEADER_LEN - crate::packet6::IPV6_HEADER_LEN) as u16,
            );
        } else {
            put16(out, ip + 2, (total - ETH_HEADER_LEN) as u16);
        }
        let id = u16::from_be_bytes([frame[ip + 4], frame[ip + 5]]);
        if self.tcp {
            if !self.v6 {
                put16(out, ip + 4, id.wrapping_add(i as u16));
            }
            let t = ip + self.ip_len;
            let seq = u32::from_be_bytes([frame[t + 4], frame[t + 5], frame[t + 6], frame[t + 7]]);
            out[t + 4..t + 8].copy_from_slice(&seq.wrapping_add(from as u32).to_be_bytes());
            let last = from + len == self.payload;
            if !last {
                out[t + 13] &= !(packet::tcp_flags::FIN | PSH);
            }
            if i != 0 {
                out[t + 13] &= !CWR;
            }
            put16(out, t + 16, 0);
            let l4_len = total - t;
            let mut sum = if self.v6 {
                pseudo_sum6(out, l4_len as u32)
            } else {
                pseudo_sum(out, l4_len as u32)
            };
            sum = packet::sum_words(sum, &out[t..total]);
            put16(out, t + 16, packet::fold(sum));
            if self.v6 {
                return total;
            }
        } else {
            let last = from + len == self.payload;
            let mf = if last { 0 } else { 0x2000 };
            put16(out, ip + 6, mf | (from / 8) as u16);
        }
        put16(out, ip + 10, 0);
        let c = packet::ipv4_header_checksum(&out[ip..ip + self.ip_len]);
        put16(out, ip + 10, c);
        total
    }
}

const PSH: u8 = 0x08;
const CWR: u8 = 0x80;

fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

/// The TCP pseudo-header sum of the IPv4 packet in `frame` for an L4 length.
fn pseudo_sum(frame: &[u8], l4_len: u32) -> u32 {
    let ip = ETH_HEADER_LEN;
    let w = |o: usize| u32::from(u16::from_be_bytes([frame[ip + o], frame[ip + o + 1]]));
    w(12) + w(14) + w(16) + w(18) + u32::from(frame[ip + 9]) + l4_len
}

/// The TCP pseudo-header sum of the IPv6 packet in `frame` for an L4 length.
fn pseudo_sum6(frame: &[u8], l4_len: u32) -> u32 {
    let ip = ETH_HEADER_LEN;
    let addrs = frame[ip + 8..ip + 40]
        .chunks_exact(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum::<u32>();
    addrs + (l4_len >> 16) + (l4_len & 0xffff) + u32::from(IPPROTO_TCP)
}

/// The MSS option of a TCP SYN (`frame`: Ethernet + IPv4 + TCP), when present.
pub fn syn_mss(frame: &[u8]) -> Option<u16> {
    let ip = ETH_HEADER_LEN;
    let ihl = usize::from(*frame.get(ip)? & 0x0f) * 4;
    tcp_mss_option(frame, ip + ihl)
}

/// The MSS option of the TCP header at offset `t` of `frame`, when present (any IP
/// version: the caller found the header).
pub fn tcp_mss_option(frame: &[u8], t: usize) -> Option<u16> {
    let thl = usize::from(*frame.get(t + 12)? >> 4) * 4;
    let opts = frame.get(t + 20..t + thl)?;
    let mut i = 0;
    while i < opts.len() {
        match opts[i] {
            0 => return None,
            1 => i += 1,
            kind => {
                let len = usize::from(*opts.get(i + 1)?);
                if len < 2 {
                    return None;
                }
                if kind == 2 && len == 4 {
                    return Some(u16::from_be_bytes([*opts.get(i + 2)?, *opts.get(i + 3)?]));
                }
                i += len;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{parse, Parsed};

    /// A TCP packet (Ethernet + IPv4 + TCP with 12 bytes of options) carrying `payload`.
    fn tcp(payload: &[u8], flags: u8) -> Vec<u8> {
        let thl = 32;
        let total = 20 + thl + payload.len();
        let mut f = vec![0u8; 14 + total];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        let ip = &mut f[14..34];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&0xfff0u16.to_be_bytes());
        ip[6] = 0x40; // DF
        ip[8] = 64;
        ip[9] = IPPROTO_TCP;
        ip[12..16].copy_from_slice(&[10, 200, 0, 10]);
        ip[16..20].copy_from_slice(&[10, 100, 1, 2]);
        let t = &mut f[34..34 + thl];
        t[0..2].copy_from_slice(&80u16.to_be_bytes());
        t[2..4].copy_from_slice(&40000u16.to_be_bytes());
        t[4..8].copy_from_slice(&0xffff_ff00u32.to_be_bytes());
        t[12] = ((thl / 4) as u8) << 4;
        t[13] = flags;
        t[20..22].copy_from_slice(&[1, 1]);
        t[22] = 8; // timestamps
        t[23] = 10;
        f[34 + thl..].copy_from_slice(payload);
        f
    }

    fn view(f: &[u8]) -> packet::Ipv4View {
        match parse(f) {
            Ok(Parsed::Ipv4(v)) => v,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tso_super_segment_becomes_valid_segments_that_carry_every_byte() {
        let payload: Vec<u8> = (0..65_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let flags = packet::tcp_flags::ACK | PSH | packet::tcp_flags::FIN | CWR;
        let big = tcp(&payload, flags);
        let cut = Cut::plan(&big, 1514, Some(1460)).unwrap();
        // 1460 - 12 bytes of options: what Linux would put in a segment.
        assert_eq!(cut.per_piece, 1448);
        assert_eq!(cut.pieces(), 65_000usize.div_ceil(1448));
        let mut out = vec![0u8; 1514];
        let mut got = Vec::new();
        for i in 0..cut.pieces() {
            let n = cut.write(&big, i, &mut out);
            assert!(n <= 1514);
            let f = &out[..n];
            let v = view(f);
            assert_eq!(v.total_len + 14, n);
            assert_eq!(
                packet::ipv4_header_checksum(&f[14..34]),
                u16::from_be_bytes([f[24], f[25]])
            );
            assert_eq!(
                packet::l4_checksum(f, &v),
                u16::from_be_bytes([f[50], f[51]])
            );
            let seq = u32::from_be_bytes([f[38], f[39], f[40], f[41]]);
            assert_eq!(seq, 0xffff_ff00u32.wrapping_add((i * 1448) as u32));
            assert_eq!(
                u16::from_be_bytes([f[18], f[19]]),
                0xfff0u16.wrapping_add(i as u16)
            );
            let last = i + 1 == cut.pieces();
            assert_eq!(f[47] & packet::tcp_flags::FIN != 0, last);
            assert_eq!(f[47] & PSH != 0, last);
            assert_eq!(f[47] & CWR != 0, i == 0);
            assert!(f[47] & packet::tcp_flags::ACK != 0);
            got.extend_from_slice(&f[66..]);
        }
        assert_eq!(got, payload);
    }

    #[test]
    fn the_egress_mtu_bounds_segments_when_the_mss_is_larger_or_unknown() {
        let big = tcp(&[7u8; 5000], packet::tcp_flags::ACK);
        assert_eq!(
            Cut::plan(&big, 1414, None).unwrap().per_piece,
            1400 - 20 - 32
        );
        assert_eq!(
            Cut::plan(&big, 1414, Some(9000)).unwrap().per_piece,
            1400 - 52
        );
        assert_eq!(Cut::plan(&big, 60, None), Err(CutError::NoRoom));
    }

    fn udp(len: usize, df: bool) -> Vec<u8> {
        let total = 20 + 8 + len;
        let mut f = vec![0u8; 14 + total];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
        f[18..20].copy_from_slice(&0x1234u16.to_be_bytes());
        f[20] = if df { 0x40 } else { 0 };
        f[22] = 64;
        f[23] = packet::IPPROTO_UDP;
        f[26..30].copy_from_slice(&[10, 200, 0, 10]);
        f[30..34].copy_from_slice(&[10, 100, 1, 2]);
        f[34..36].copy_from_slice(&53u16.to_be_bytes());
        f[36..38].copy_from_slice(&5353u16.to_be_bytes());
        f[38..40].copy_from_slice(&((8 + len) as u16).to_be_bytes());
        for (i, b) in f[42..].iter_mut().enumerate() {
            *b = i as u8;
        }
        let v = view(&f);
        packet::fill_l4_checksum(&mut f, &v);
        f
    }

    #[test]
    fn a_large_datagram_without_df_leaves_as_fragments_that_reassemble() {
        let dgram = udp(4000, false);
        let cut = Cut::plan(&dgram, 1514, None).unwrap();
        assert_eq!(cut.per_piece, 1480);
        let mut out = vec![0u8; 1514];
        let mut whole = vec![0u8; 4008];
        for i in 0..cut.pieces() {
            let n = cut.write(&dgram, i, &mut out);
            let f = &out[..n];
            assert_eq!(
                packet::ipv4_header_checksum(&f[14..34]),
                u16::from_be_bytes([f[24], f[25]])
            );
            assert_eq!(
                u16::from_be_bytes([f[18], f[19]]),
                0x1234,
                "one id for all fragments"
            );
            let ff = u16::from_be_bytes([f[20], f[21]]);
            let off = usize::from(ff & 0x1fff) * 8;
            assert_eq!(ff & 0x2000 != 0, i + 1 < cut.pieces());
            whole[off..off + n - 34].copy_from_slice(&f[34..n]);
        }
        assert_eq!(&whole[..], &dgram[34..]);
    }

    #[test]
    fn a_large_datagram_with_df_is_refused() {
        assert_eq!(
            Cut::plan(&udp(4000, true), 1514, None),
            Err(CutError::DontFragment)
        );
    }

    #[test]
    fn the_mss_option_is_read_from_a_syn() {
        let mut f = tcp(&[], packet::tcp_flags::SYN);
        assert_eq!(syn_mss(&f), None);
        f[54..58].copy_from_slice(&[2, 4, 0x05, 0x78]);
        assert_eq!(syn_mss(&f), Some(1400));
        f[54] = 0; // end of options first
        assert_eq!(syn_mss(&f), None);
        f[54..56].copy_from_slice(&[5, 0]); // a zero length never loops
        assert_eq!(syn_mss(&f), None);
    }

    #[test]
    fn garbage_never_panics() {
        let mut out = vec![0u8; 4096];
        for seed in 0..2000u32 {
            let len = (seed as usize * 37) % 3000;
            let mut f: Vec<u8> = (0..len)
                .map(|i| (i as u32 * seed).wrapping_mul(2654435761) as u8)
                .collect();
            if f.len() > 14 {
                f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
                f[14] = 0x45;
            }
            let _ = syn_mss(&f);
            if let Ok(c) = Cut::plan(&f, 600, Some(seed as u16)) {
                for i in 0..c.pieces() {
                    assert!(c.write(&f, i, &mut out) <= 600);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests6 {
    use super::*;
    use crate::packet6::tests::{checksum_ok, frame, upper};
    use crate::packet6::{parse6, IPPROTO_ICMPV6};

    const A: [u8; 16] = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    const B: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

    #[test]
    fn an_ipv6_super_segment_becomes_mtu_sized_segments_with_valid_checksums() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let fin_psh = packet::tcp_flags::FIN | PSH | packet::tcp_flags::ACK;
        let f = frame(
            A,
            B,
            &[],
            IPPROTO_TCP,
            &upper(IPPROTO_TCP, 80, 9, fin_psh, &data),
        );
        let cut = Cut::plan(&f, 1514, None).unwrap();
        assert_eq!(cut.pieces(), 4, "1440 payload bytes per 1514-byte frame");
        let mut out = vec![0u8; 1514];
        let mut joined = Vec::new();
        for i in 0..cut.pieces() {
            let n = cut.write(&f, i, &mut out);
            assert!(n <= 1514);
            let v = parse6(&out[..n]).unwrap();
            assert!(checksum_ok(&out[..n], &v), "segment {i}");
            let t = v.l4_offset();
            let seq = u32::from_be_bytes(out[t + 4..t + 8].try_into().unwrap());
            assert_eq!(seq, 1 + joined.len() as u32);
            let last = i + 1 == cut.pieces();
            assert_eq!(out[t + 13] & (packet::tcp_flags::FIN | PSH) != 0, last);
            joined.extend_from_slice(&out[t + 20..n]);
        }
        assert_eq!(joined, data);
        // The client's MSS bounds a segment too.
        assert_eq!(Cut::plan(&f, 1514, Some(1000)).unwrap().pieces(), 5);
    }

    #[test]
    fn other_ipv6_packets_larger_than_the_egress_are_not_fragmented() {
        let f = frame(A, B, &[], IPPROTO_ICMPV6, &[128, 0, 0, 0, 0, 1, 0, 1]);
        assert_eq!(Cut::plan(&f, 60, None), Err(CutError::DontFragment));
        let udp = frame(
            A,
            B,
            &[],
            crate::proto::IPPROTO_UDP,
            &upper(17, 1, 2, 0, &[0; 3000]),
        );
        assert_eq!(Cut::plan(&udp, 1514, None), Err(CutError::DontFragment));
    }
}
