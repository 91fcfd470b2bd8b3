//! Tests of the IPv6 views: frames built here byte by byte, checksums against a
//! reference sum computed from scratch.

use super::*;
use proptest::prelude::*;

const CLIENT: [u8; 16] = [
    0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42,
];
const VIP: [u8; 16] = [
    0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0x71, 0, 0, 0, 0, 0, 0, 0, 0x10,
];
const POD: [u8; 16] = [0xfd, 0x00, 0, 0x0a, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0x05];

/// The upper-layer checksum of a packet, summed from scratch (RFC 8200 §8.1).
fn reference_sum(src: &[u8; 16], dst: &[u8; 16], proto: u8, upper: &[u8]) -> u16 {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(src);
    bytes.extend_from_slice(dst);
    bytes.extend_from_slice(&(upper.len() as u32).to_be_bytes());
    bytes.extend_from_slice(&[0, 0, 0, proto]);
    bytes.extend_from_slice(upper);
    if bytes.len() % 2 == 1 {
        bytes.push(0);
    }
    let mut s: u64 = bytes
        .chunks(2)
        .map(|c| u64::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// A TCP segment (20-byte header, flags, `data`) or UDP datagram from `sport` to
/// `dport`, its checksum field zero.
pub(crate) fn upper(proto: u8, sport: u16, dport: u16, flags: u8, data: &[u8]) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend_from_slice(&sport.to_be_bytes());
    u.extend_from_slice(&dport.to_be_bytes());
    if proto == IPPROTO_TCP {
        u.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    } else {
        u.extend_from_slice(&((8 + data.len()) as u16).to_be_bytes());
        u.extend_from_slice(&[0, 0]);
    }
    u.extend_from_slice(data);
    u
}

/// An extension header of type `kind` (its next-header byte filled in by [`frame`]),
/// `units` units long: 8 bytes each, 4 for AH; `b3`: its fourth byte (a routing
/// header's segments left; a fragment header's offset/flags are `b2`, `b3`).
pub(crate) fn ext(kind: u8, units: u8, b2: u8, b3: u8) -> (u8, Vec<u8>) {
    let len = match kind {
        NH_FRAGMENT => 8,
        NH_AUTH => (usize::from(units) + 2) * 4,
        _ => (usize::from(units) + 1) * 8,
    };
    let mut h = vec![0u8; len];
    h[1] = if kind == NH_FRAGMENT { 0 } else { units };
    h[2] = b2;
    h[3] = b3;
    (kind, h)
}

/// An Ethernet + IPv6 frame from `src` to `dst` through `exts` to `proto`'s `body`,
/// whose checksum (TCP, UDP, ICMPv6) is filled in.
pub(crate) fn frame(
    src: [u8; 16],
    dst: [u8; 16],
    exts: &[(u8, Vec<u8>)],
    proto: u8,
    body: &[u8],
) -> Vec<u8> {
    let mut body = body.to_vec();
    let c = match proto {
        IPPROTO_TCP => Some(16),
        IPPROTO_UDP => Some(6),
        IPPROTO_ICMPV6 => Some(2),
        _ => None,
    };
    if let Some(c) = c.filter(|c| body.len() >= c + 2) {
        let sum = reference_sum(&src, &dst, proto, &body);
        body[c..c + 2].copy_from_slice(&sum.to_be_bytes());
    }
    let mut chain = Vec::new();
    for (i, (_, h)) in exts.iter().enumerate() {
        let mut h = h.clone();
        h[0] = exts.get(i + 1).map_or(proto, |e| e.0);
        chain.extend_from_slice(&h);
    }
    let mut f = vec![0u8; 12];
    f.extend_from_slice(&ETHERTYPE_IPV6.to_be_bytes());
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&((chain.len() + body.len()) as u16).to_be_bytes());
    f.push(exts.first().map_or(proto, |e| e.0));
    f.push(64);
    f.extend_from_slice(&src);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&chain);
    f.extend_from_slice(&body);
    f
}

pub(crate) fn checksum_ok(f: &[u8], v: &Ipv6View) -> bool {
    upper_checksum(f, v) == 0
}

#[test]
fn a_tcp_syn_to_the_vip() {
    let f = frame(
        CLIENT,
        VIP,
        &[],
        IPPROTO_TCP,
        &upper(IPPROTO_TCP, 40000, 80, 0x02, &[]),
    );
    let v = parse6(&f).unwrap();
    assert_eq!((v.src, v.dst, v.hop_limit), (CLIENT, VIP, 64));
    assert_eq!(
        (v.upper, v.ext_len, v.fragment),
        (Upper::Transport(IPPROTO_TCP), 0, false)
    );
    let l4 = v.l4.unwrap();
    assert_eq!((l4.src_port, l4.dst_port, l4.tcp_flags), (40000, 80, 0x02));
    assert_eq!(v.l4_offset(), 54);
    assert!(checksum_ok(&f, &v));
}

/// The headers a router may add are skipped: Hop-by-Hop first, Destination Options,
/// Routing with no segment left, an atomic Fragment header, AH.
#[test]
fn the_extension_headers_a_router_may_add_are_skipped() {
    let exts = [
        ext(NH_HOP_BY_HOP, 0, 0, 0),
        ext(NH_DEST_OPTS, 1, 0, 0),
        ext(NH_ROUTING, 0, 4, 0),
        ext(NH_FRAGMENT, 0, 0, 0),
        ext(NH_AUTH, 4, 0, 0),
    ];
    let body = upper(IPPROTO_UDP, 5353, 53, 0, b"question");
    let f = frame(CLIENT, VIP, &exts, IPPROTO_UDP, &body);
    let v = parse6(&f).unwrap();
    assert_eq!(v.ext_len, 8 + 16 + 8 + 8 + 24);
    assert_eq!(
        (v.upper, v.fragment),
        (Upper::Transport(IPPROTO_UDP), false)
    );
    assert_eq!(v.l4.unwrap().dst_port, 53);
    assert_eq!(v.upper_len(), body.len());
    assert!(checksum_ok(&f, &v));
}

/// What the dataplane does not serve ends the walk as `Other`: the engine names the drop.
#[test]
fn what_is_not_served_is_other() {
    let tcp = upper(IPPROTO_TCP, 1, 80, 0x02, &[]);
    let other = |exts: &[(u8, Vec<u8>)], proto| {
        parse6(&frame(CLIENT, VIP, exts, proto, &tcp))
            .unwrap()
            .upper
    };
    assert_eq!(
        other(&[ext(NH_ROUTING, 2, 4, 1)], IPPROTO_TCP),
        Upper::Other(NH_ROUTING),
        "segments left"
    );
    assert_eq!(
        other(
            &[ext(NH_DEST_OPTS, 0, 0, 0), ext(NH_HOP_BY_HOP, 0, 0, 0)],
            IPPROTO_TCP
        ),
        Upper::Other(NH_HOP_BY_HOP),
        "Hop-by-Hop not first"
    );
    assert_eq!(other(&[], 50), Upper::Other(50), "ESP");
    assert_eq!(other(&[], 59), Upper::Other(59), "No Next Header");
    let long: Vec<_> = (0..=MAX_EXTENSION_HEADERS)
        .map(|_| ext(NH_DEST_OPTS, 0, 0, 0))
        .collect();
    assert_eq!(
        other(&long, IPPROTO_TCP),
        Upper::Other(NH_DEST_OPTS),
        "too long a chain"
    );
    let fits: Vec<_> = (0..MAX_EXTENSION_HEADERS)
        .map(|_| ext(NH_DEST_OPTS, 0, 0, 0))
        .collect();
    assert_eq!(other(&fits, IPPROTO_TCP), Upper::Transport(IPPROTO_TCP));
}

/// A fragmented datagram: the first fragment says what it carries (no ports read: the
/// UDP length covers the whole datagram), a later one only that it is one.
#[test]
fn fragments_are_told_apart() {
    let body = upper(IPPROTO_UDP, 5353, 53, 0, &[7; 64]);
    let first = frame(
        CLIENT,
        VIP,
        &[ext(NH_FRAGMENT, 0, 0, 1)],
        IPPROTO_UDP,
        &body[..40],
    );
    let v = parse6(&first).unwrap();
    assert_eq!(
        (v.upper, v.fragment, v.l4),
        (Upper::Transport(IPPROTO_UDP), true, None)
    );
    let later = frame(
        CLIENT,
        VIP,
        &[ext(NH_FRAGMENT, 0, 0, 5 << 3)],
        IPPROTO_UDP,
        &body[40..],
    );
    let v = parse6(&later).unwrap();
    assert_eq!(
        (v.upper, v.fragment, v.l4),
        (Upper::LaterFragment(IPPROTO_UDP), true, None)
    );
}

#[test]
fn malformed_frames_are_refused_by_name() {
    let good = frame(
        CLIENT,
        VIP,
        &[],
        IPPROTO_TCP,
        &upper(IPPROTO_TCP, 1, 80, 0x10, &[]),
    );
    assert_eq!(parse6(&good[..13]), Err(Parse6Error::NotIpv6));
    assert_eq!(parse6(&good[..53]), Err(Parse6Error::TruncatedIpv6));
    let mut f = good.clone();
    f[14] = 0x40;
    assert_eq!(parse6(&f), Err(Parse6Error::BadIpVersion));
    let mut f = good.clone();
    f[18..20].copy_from_slice(&0u16.to_be_bytes());
    assert_eq!(
        parse6(&f),
        Err(Parse6Error::BadPayloadLength),
        "jumbogram or empty"
    );
    let mut f = good.clone();
    f[18..20].copy_from_slice(&21u16.to_be_bytes());
    assert_eq!(parse6(&f), Err(Parse6Error::BadPayloadLength));
    let mut f = good.clone();
    f[54 + 12] = 0x40;
    assert_eq!(parse6(&f), Err(Parse6Error::BadL4Length), "data offset 4");
    let mut f = good.clone();
    f[18..20].copy_from_slice(&12u16.to_be_bytes());
    assert_eq!(parse6(&f), Err(Parse6Error::TruncatedL4));
    let mut dest = frame(CLIENT, VIP, &[ext(NH_DEST_OPTS, 3, 0, 0)], IPPROTO_TCP, &[]);
    dest[18..20].copy_from_slice(&8u16.to_be_bytes());
    dest.truncate(14 + 40 + 8);
    assert_eq!(
        parse6(&dest),
        Err(Parse6Error::TruncatedExtension),
        "8 bytes of 32"
    );
    let mut ipv4 = good;
    ipv4[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    assert_eq!(parse6(&ipv4), Err(Parse6Error::NotIpv6));
}

/// DNAT to the Pod and reverse NAT back, through an extension header: the checksum
/// the incremental update leaves is the one computed from scratch.
#[test]
fn nat_both_ways_keeps_the_checksum() {
    for proto in [IPPROTO_TCP, IPPROTO_UDP] {
        let body = upper(proto, 40000, 80, 0x18, b"GET / HTTP/1.1\r\n\r\n");
        let mut f = frame(CLIENT, VIP, &[ext(NH_DEST_OPTS, 0, 0, 0)], proto, &body);
        let mut v = parse6(&f).unwrap();
        rewrite6(&mut f, &mut v, Side6::Destination, POD, 8080);
        assert_eq!(parse6(&f), Ok(v));
        assert_eq!((v.dst, v.l4.unwrap().dst_port), (POD, 8080));
        assert!(checksum_ok(&f, &v), "{proto}");
        rewrite6(&mut f, &mut v, Side6::Source, VIP, 80);
        assert!(checksum_ok(&f, &v), "{proto}");
        assert_eq!(parse6(&f), Ok(v));
    }
    assert!({
        let mut f = frame(
            CLIENT,
            VIP,
            &[],
            IPPROTO_TCP,
            &upper(IPPROTO_TCP, 1, 80, 2, &[]),
        );
        let mut v = parse6(&f).unwrap();
        decrement_hop_limit(&mut f, &mut v) && f[21] == 63 && parse6(&f) == Ok(v)
    });
}

/// A router's Packet Too Big about an answer the Pod sent from the VIP: its MTU and the
/// quoted connection, through an extension header in the quote; other ICMPv6 is not an
/// error.
#[test]
fn packet_too_big_quotes_the_connection() {
    let answer = frame(
        VIP,
        CLIENT,
        &[ext(NH_DEST_OPTS, 0, 0, 0)],
        IPPROTO_TCP,
        &upper(IPPROTO_TCP, 80, 40000, 0x10, &[0; 1400]),
    );
    let mut icmp = vec![ICMP6_PACKET_TOO_BIG, 0, 0, 0];
    icmp.extend_from_slice(&1280u32.to_be_bytes());
    icmp.extend_from_slice(&answer[14..14 + 1232]);
    let router = [
        0x20, 0x01, 0x0d, 0xb8, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
    ];
    let f = frame(router, VIP, &[], IPPROTO_ICMPV6, &icmp);
    let v = parse6(&f).unwrap();
    assert_eq!(v.upper, Upper::Icmp);
    assert!(checksum_ok(&f, &v));
    let e = parse_icmp6_error(&f, &v).unwrap();
    assert_eq!((e.icmp_type, e.mtu), (ICMP6_PACKET_TOO_BIG, Some(1280)));
    assert_eq!(
        (e.inner_src, e.inner_dst, e.inner_protocol),
        (VIP, CLIENT, IPPROTO_TCP)
    );
    assert_eq!((e.inner_src_port, e.inner_dst_port), (80, 40000));
    assert_eq!(e.inner_offset, 54 + 8);
    // Cut before its MTU field (the fuzzer's find): no error view, no panic.
    for len in 2..8 {
        let short = frame(router, VIP, &[], IPPROTO_ICMPV6, &icmp[..len]);
        let v = parse6(&short).unwrap();
        assert_eq!(parse_icmp6_error(&short, &v), None, "{len} bytes");
    }
    let echo = frame(
        CLIENT,
        VIP,
        &[],
        IPPROTO_ICMPV6,
        &[128, 0, 0, 0, 0, 1, 0, 1],
    );
    let v = parse6(&echo).unwrap();
    assert_eq!(parse_icmp6_error(&echo, &v), None);
}

proptest! {
    /// Any bytes after an IPv6 EtherType: no panic, and what is accepted is consistent.
    #[test]
    fn any_frame_is_parsed_or_refused(body in proptest::collection::vec(any::<u8>(), 0..200), first in any::<u8>(), nh in any::<u8>()) {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&ETHERTYPE_IPV6.to_be_bytes());
        f.extend_from_slice(&[0x60 | (first & 0x0f), 0, 0, 0]);
        f.extend_from_slice(&(body.len().saturating_sub(32) as u16).to_be_bytes());
        f.extend_from_slice(&[nh, 64]);
        f.extend_from_slice(&body);
        if let Ok(v) = parse6(&f) {
            prop_assert!(v.end() <= f.len() && v.l4_offset() <= v.end());
            prop_assert_eq!(v.l4.is_some(), matches!(v.upper, Upper::Transport(_)) && !v.fragment);
            if let Some(e) = parse_icmp6_error(&f, &v) {
                prop_assert!(e.inner_offset + IPV6_HEADER_LEN <= f.len());
            }
            let _ = upper_checksum(&f, &v);
        }
    }

    /// DNAT then reverse NAT of any TCP/UDP packet keeps a valid checksum valid.
    #[test]
    fn incremental_updates_match_a_full_sum(
        data in proptest::collection::vec(any::<u8>(), 0..300),
        to in any::<[u8; 16]>(),
        port in any::<u16>(),
        udp in any::<bool>(),
    ) {
        let proto = if udp { IPPROTO_UDP } else { IPPROTO_TCP };
        let mut f = frame(CLIENT, VIP, &[], proto, &upper(proto, 40000, 80, 0x18, &data));
        let mut v = parse6(&f).unwrap();
        rewrite6(&mut f, &mut v, Side6::Destination, to, port);
        prop_assert!(checksum_ok(&f, &v));
        rewrite6(&mut f, &mut v, Side6::Source, to, port);
        prop_assert!(checksum_ok(&f, &v));
        prop_assert_eq!(parse6(&f), Ok(v));
    }
}
