//! ICMP "fragmentation needed" (type 3, code 4) for packets the dataplane cannot send
//! (pure, no I/O): a non-TCP packet with DF set that is larger than its egress takes.
//! RFC 1191 puts the next-hop MTU in the second half of the header's unused word;
//! RFC 792 quotes the offending packet's IP header and its first 8 data bytes.
//!
//! [`frag_needed`] writes the error into a caller's buffer; the engine then addresses it
//! like an error a router or a backend sent (see `Engine::frag_needed`), so the quoted
//! packet is the one its sender sent. A [`crate::redirect::TokenBucket`] bounds how many
//! a worker sends, so a flood of oversized datagrams cannot make the node an amplifier.

use crate::packet::{self, ETH_HEADER_LEN, IPPROTO_ICMP};

/// Largest error [`frag_needed`] writes: Ethernet, IPv4 (20), ICMP (8), then the quoted
/// IPv4 header (at most 60) and 8 bytes.
pub const FRAG_NEEDED_MAX: usize = ETH_HEADER_LEN + 20 + 8 + 60 + 8;

/// ICMP type "destination unreachable".
const DEST_UNREACH: u8 = 3;
/// Its code "fragmentation needed and DF set".
const FRAG_NEEDED: u8 = 4;
/// Precedence "internetwork control", as Linux sends its ICMP errors.
const TOS_INTERNETWORK_CONTROL: u8 = 0xc0;

/// Writes into `out` (at least [`FRAG_NEEDED_MAX`] bytes) an ICMP "fragmentation
/// needed" from `src` to `dst` (host order) about the IPv4 packet in `frame` (Ethernet +
/// IPv4), announcing `mtu`. MACs are left zero (the engine sets them). `None` when no
/// error may be sent about this packet (RFC 1812, 4.3.2.7): not a well-formed IPv4
/// packet, a fragment other than the first, an ICMP error itself, or a source that is
/// not a unicast host.
pub fn frag_needed(frame: &[u8], src: u32, dst: u32, mtu: u16, out: &mut [u8]) -> Option<usize> {
    let ip = frame.get(ETH_HEADER_LEN..)?;
    let ihl = usize::from(*ip.first()? & 0x0f) * 4;
    if ip[0] >> 4 != 4 || ihl < 20 || ip.len() < ihl {
        return None;
    }
    if u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff != 0 {
        return None;
    }
    let sender = u32::from_be_bytes([ip[12], ip[13], ip[14], ip[15]]);
    if !unicast(sender) || !unicast(dst) {
        return None;
    }
    if ip[9] == IPPROTO_ICMP && ip.get(ihl).is_some_and(|&t| is_icmp_error(t)) {
        return None;
    }
    let quoted = (ihl + 8).min(ip.len());
    let total = 20 + 8 + quoted;
    let out = out.get_mut(..ETH_HEADER_LEN + total)?;
    out[..12].fill(0);
    out[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let h = &mut out[ETH_HEADER_LEN..];
    h[0] = 0x45;
    h[1] = TOS_INTERNETWORK_CONTROL;
    h[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    h[4..8].fill(0);
    h[8] = 64;
    h[9] = IPPROTO_ICMP;
    h[10..12].fill(0);
    h[12..16].copy_from_slice(&src.to_be_bytes());
    h[16..20].copy_from_slice(&dst.to_be_bytes());
    let c = packet::ipv4_header_checksum(&h[..20]);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    let icmp = &mut h[20..total];
    icmp[0] = DEST_UNREACH;
    icmp[1] = FRAG_NEEDED;
    icmp[2..6].fill(0);
    icmp[6..8].copy_from_slice(&mtu.to_be_bytes());
    icmp[8..].copy_from_slice(&ip[..quoted]);
    let c = packet::fold(packet::sum_words(0, icmp));
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    Some(ETH_HEADER_LEN + total)
}

/// ICMP types that are errors (never answered with an error).
fn is_icmp_error(ty: u8) -> bool {
    matches!(ty, 3 | 4 | 5 | 11 | 12)
}

/// A unicast host address: not 0.0.0.0/8, loopback, multicast, reserved or broadcast.
fn unicast(a: u32) -> bool {
    let first = a >> 24;
    first != 0 && first != 127 && first < 224
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{parse, Parsed};

    fn udp_df(len: usize, src: [u8; 4], frag: u16) -> Vec<u8> {
        let total = 20 + 8 + len;
        let mut f = vec![0u8; 14 + total];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
        f[20..22].copy_from_slice(&(0x4000 | frag).to_be_bytes());
        f[22] = 63;
        f[23] = packet::IPPROTO_UDP;
        f[26..30].copy_from_slice(&src);
        f[30..34].copy_from_slice(&[10, 100, 2, 10]);
        f[34..36].copy_from_slice(&40000u16.to_be_bytes());
        f[36..38].copy_from_slice(&53u16.to_be_bytes());
        f[38..40].copy_from_slice(&((8 + len) as u16).to_be_bytes());
        f
    }

    const NODE: u32 = 0x0a64_0201;
    const CLIENT: u32 = 0x0a64_0102;

    #[test]
    fn the_error_quotes_the_header_and_8_bytes_and_carries_the_mtu() {
        let big = udp_df(1472, [10, 100, 1, 2], 0);
        let mut out = [0u8; FRAG_NEEDED_MAX];
        let n = frag_needed(&big, NODE, CLIENT, 1450, &mut out).unwrap();
        assert_eq!(n, 14 + 20 + 8 + 28);
        let f = &out[..n];
        let Ok(Parsed::Ipv4(v)) = parse(f) else {
            panic!("not IPv4");
        };
        assert_eq!(v.protocol, IPPROTO_ICMP);
        assert_eq!(v.total_len, 56);
        assert_eq!(&f[26..30], &NODE.to_be_bytes());
        assert_eq!(&f[30..34], &CLIENT.to_be_bytes());
        assert_eq!(f[22], 64, "TTL");
        assert_eq!(
            packet::ipv4_header_checksum(&f[14..34]),
            u16::from_be_bytes([f[24], f[25]])
        );
        assert_eq!(
            packet::fold(packet::sum_words(0, &f[34..])),
            0,
            "ICMP checksum"
        );
        assert_eq!((f[34], f[35]), (3, 4));
        assert_eq!(u16::from_be_bytes([f[40], f[41]]), 1450, "next-hop MTU");
        assert_eq!(&f[42..], &big[14..42], "IP header + 8 bytes, as sent");
        let e = packet::parse_icmp_error(f, &v).expect("an ICMP error view");
        assert_eq!(e.inner_dst_port, 53);
        assert_eq!(packet::frag_needed_mtu(f, &v), Some(1450));
    }

    #[test]
    fn no_error_about_errors_later_fragments_or_non_unicast_senders() {
        let mut out = [0u8; FRAG_NEEDED_MAX];
        let later = udp_df(1472, [10, 100, 1, 2], 185);
        assert_eq!(frag_needed(&later, NODE, CLIENT, 1450, &mut out), None);
        for src in [[0, 0, 0, 0], [127, 0, 0, 1], [224, 0, 0, 5], [255; 4]] {
            let f = udp_df(1472, src, 0);
            let to = u32::from_be_bytes(src);
            assert_eq!(frag_needed(&f, NODE, to, 1450, &mut out), None, "{src:?}");
        }
        let mut err = udp_df(1472, [10, 100, 1, 2], 0);
        err[23] = IPPROTO_ICMP;
        err[34] = 3;
        assert_eq!(frag_needed(&err, NODE, CLIENT, 1450, &mut out), None);
        err[34] = 8; // an echo request is answered
        assert!(frag_needed(&err, NODE, CLIENT, 1450, &mut out).is_some());
        assert_eq!(frag_needed(&err, NODE, CLIENT, 1450, &mut [0u8; 40]), None);
    }

    #[test]
    fn garbage_never_panics() {
        let mut out = [0u8; FRAG_NEEDED_MAX];
        for seed in 0..3000u32 {
            let len = (seed as usize * 13) % 200;
            let f: Vec<u8> = (0..len)
                .map(|i| (i as u32 * seed).wrapping_mul(2654435761) as u8 | 0x40)
                .collect();
            if let Some(n) = frag_needed(&f, NODE, CLIENT, 1400, &mut out) {
                assert!(n <= FRAG_NEEDED_MAX);
            }
        }
    }
}
