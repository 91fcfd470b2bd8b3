//! Building the benchmark's 64-byte Ethernet/IPv4/UDP frames (and, for floods, TCP
//! segments and first fragments), its 70-byte Ethernet/IPv6/UDP frames (the IPv6 rows),
//! and spreading them over flows.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Frame length on the wire without FCS: the classic "64-byte packet" minus its 4-byte FCS.
pub const FRAME_LEN: usize = 60;
const IP_OFF: usize = 14;
const UDP_OFF: usize = 34;

/// One benchmark flow's varying fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// Client source address.
    pub src_ip: Ipv4Addr,
    /// Client source port.
    pub src_port: u16,
}

/// Flow `i` of a set: 64 source ports per source address, source addresses counted up
/// from `base` (so 1 M flows use 16 384 addresses, a /18).
pub fn flow(base: Ipv4Addr, i: u32) -> Flow {
    Flow {
        src_ip: Ipv4Addr::from(u32::from(base) + (i >> 6)),
        src_port: 10_000 + (i & 63) as u16,
    }
}

/// The fixed part of every frame of a run.
#[derive(Debug, Clone, Copy)]
pub struct Template {
    /// Source MAC (the client interface).
    pub src_mac: [u8; 6],
    /// Destination MAC (the next hop: the node's client-facing interface).
    pub dst_mac: [u8; 6],
    /// Destination address (a VIP or the backend).
    pub dst_ip: Ipv4Addr,
    /// Destination UDP port.
    pub dst_port: u16,
}

fn sum16(data: &[u8]) -> u32 {
    let mut s = 0u32;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        s += u32::from(w);
    }
    s
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// Writes a complete frame for `flow` into `buf` (at least [`FRAME_LEN`] bytes), with
/// valid IPv4 and UDP checksums.
pub fn write_frame(buf: &mut [u8], t: &Template, flow: Flow) {
    let buf = &mut buf[..FRAME_LEN];
    buf.fill(0);
    buf[0..6].copy_from_slice(&t.dst_mac);
    buf[6..12].copy_from_slice(&t.src_mac);
    buf[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip_len = (FRAME_LEN - IP_OFF) as u16;
    let udp_len = (FRAME_LEN - UDP_OFF) as u16;
    let ip = &mut buf[IP_OFF..UDP_OFF];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&flow.src_ip.octets());
    ip[16..20].copy_from_slice(&t.dst_ip.octets());
    let c = fold(sum16(ip));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    {
        let udp = &mut buf[UDP_OFF..];
        udp[0..2].copy_from_slice(&flow.src_port.to_be_bytes());
        udp[2..4].copy_from_slice(&t.dst_port.to_be_bytes());
        udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
        udp[8..16].copy_from_slice(b"juneaupf");
    }
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&flow.src_ip.octets());
    pseudo[4..8].copy_from_slice(&t.dst_ip.octets());
    pseudo[9] = 17;
    pseudo[10..12].copy_from_slice(&udp_len.to_be_bytes());
    let mut c = fold(sum16(&pseudo) + sum16(&buf[UDP_OFF..UDP_OFF + udp_len as usize]));
    if c == 0 {
        c = 0xffff;
    }
    buf[UDP_OFF + 6..UDP_OFF + 8].copy_from_slice(&c.to_be_bytes());
}

/// What a generated frame is: the load's UDP datagram, or a flood's packet.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum FrameKind {
    /// A UDP datagram (the load).
    Udp,
    /// A TCP SYN (a SYN flood).
    Syn,
    /// A TCP ACK of no connection (an ACK flood).
    Ack,
    /// The first fragment of a UDP datagram (more fragments set, offset 0).
    Fragment,
}

impl FrameKind {
    /// The generator's name for it (`juneau-perf gen --kind`).
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Udp => "udp",
            FrameKind::Syn => "syn",
            FrameKind::Ack => "ack",
            FrameKind::Fragment => "fragment",
        }
    }
}

/// Writes a complete frame of `kind` for `flow` into `buf` (at least [`FRAME_LEN`]
/// bytes), checksums valid: a UDP frame as [`write_frame`]; a TCP segment of 20 header
/// bytes and no data (`juneau_tests::frames`, the frame padded to [`FRAME_LEN`]),
/// sequence number 0; a first fragment as the UDP frame with more-fragments set (no DF).
pub fn write_frame_of(buf: &mut [u8], t: &Template, flow: Flow, kind: FrameKind) {
    use juneau_tests::frames::{ethernet_ipv4, ipv4_header, tcp_segment};
    write_frame(buf, t, flow);
    let flags = match kind {
        FrameKind::Udp => return,
        FrameKind::Fragment => {
            let ip = &mut buf[IP_OFF..UDP_OFF];
            ip[6..8].copy_from_slice(&0x2000u16.to_be_bytes());
            ip[10..12].fill(0);
            let c = fold(sum16(ip));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            return;
        }
        FrameKind::Syn => 0x02u8,
        FrameKind::Ack => 0x10u8,
    };
    let (src, dst) = (flow.src_ip.octets(), t.dst_ip.octets());
    let tcp = tcp_segment(src, dst, flow.src_port, t.dst_port, 0, 0, flags);
    let frame = ethernet_ipv4(
        t.dst_mac,
        t.src_mac,
        ipv4_header(src, dst, 6, tcp.len()),
        &tcp,
    );
    buf[..FRAME_LEN].fill(0);
    buf[..frame.len()].copy_from_slice(&frame);
}

/// Sets the UDP checksum of an IPv4 frame written by [`write_frame`]: none (0, valid
/// over IPv4), or with `partial` the folded pseudo-header sum, not complemented — what a
/// Pod's kernel with tx checksum offload leaves for the NIC to finish (`bpf/gen.c`).
pub fn set_udp_checksum(buf: &mut [u8], partial: bool) {
    let c = if partial {
        let ip = &buf[IP_OFF..UDP_OFF];
        let mut pseudo = [0u8; 12];
        pseudo[0..8].copy_from_slice(&ip[12..20]);
        pseudo[9] = 17;
        pseudo[10..12].copy_from_slice(&buf[UDP_OFF + 4..UDP_OFF + 6]);
        !fold(sum16(&pseudo))
    } else {
        0
    };
    buf[UDP_OFF + 6..UDP_OFF + 8].copy_from_slice(&c.to_be_bytes());
}

/// Sets the IP identification of an IPv4 frame and its header checksum.
pub fn set_ip_id(buf: &mut [u8], id: u16) {
    let ip = &mut buf[IP_OFF..UDP_OFF];
    ip[4..6].copy_from_slice(&id.to_be_bytes());
    ip[10..12].fill(0);
    let c = fold(sum16(ip));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
}

/// Sets the sequence number of a TCP segment written by [`write_frame_of`] (20 header
/// bytes, no data) and its checksum.
pub fn set_tcp_seq(buf: &mut [u8], seq: u32) {
    const TCP_LEN: usize = 20;
    let mut pseudo = [0u8; 12];
    pseudo[0..8].copy_from_slice(&buf[IP_OFF + 12..IP_OFF + 20]);
    pseudo[9] = 6;
    pseudo[10..12].copy_from_slice(&(TCP_LEN as u16).to_be_bytes());
    let tcp = &mut buf[UDP_OFF..UDP_OFF + TCP_LEN];
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[16..18].fill(0);
    let c = fold(sum16(&pseudo) + sum16(tcp));
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
}

/// Length of an IPv6 load frame without FCS: Ethernet (14) + IPv6 (40) + UDP (8) + the
/// generator's 8-byte payload (`juneaupf`) = 70 bytes, 74 on the wire with the FCS — the
/// smallest frame that holds them (IPv6's 40-byte header does not fit the 60 bytes of a
/// 64-byte frame with IPv4's payload).
pub const FRAME6_LEN: usize = 70;
const IP6_OFF: usize = 14;
const UDP6_OFF: usize = 54;

/// One IPv6 benchmark flow's varying fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow6 {
    /// Client source address.
    pub src_ip: Ipv6Addr,
    /// Client source port.
    pub src_port: u16,
}

/// IPv6 flow `i` of a set, as [`flow`]: 64 source ports per source address, the source
/// addresses counted up in the last 32 bits of `base` (the generator writes only those).
pub fn flow6(base: Ipv6Addr, i: u32) -> Flow6 {
    let b = u128::from(base);
    let low = (b as u32).wrapping_add(i >> 6);
    Flow6 {
        src_ip: Ipv6Addr::from((b & !u128::from(u32::MAX)) | u128::from(low)),
        src_port: 10_000 + (i & 63) as u16,
    }
}

/// The fixed part of every IPv6 frame of a run.
#[derive(Debug, Clone, Copy)]
pub struct Template6 {
    /// Source MAC (the client interface).
    pub src_mac: [u8; 6],
    /// Destination MAC (the next hop: the node's client-facing interface).
    pub dst_mac: [u8; 6],
    /// Destination address (the IPv6 VIP or the backend's IPv6 address).
    pub dst_ip: Ipv6Addr,
    /// Destination UDP port.
    pub dst_port: u16,
}

/// Writes a complete IPv6 frame for `flow` into `buf` (at least [`FRAME6_LEN`] bytes):
/// hop limit 64, UDP with its checksum (mandatory over IPv6) and the 8-byte payload.
pub fn write_frame6(buf: &mut [u8], t: &Template6, flow: Flow6) {
    let buf = &mut buf[..FRAME6_LEN];
    buf.fill(0);
    buf[0..6].copy_from_slice(&t.dst_mac);
    buf[6..12].copy_from_slice(&t.src_mac);
    buf[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    let udp_len = (FRAME6_LEN - UDP6_OFF) as u16;
    let ip = &mut buf[IP6_OFF..UDP6_OFF];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
    ip[6] = 17;
    ip[7] = 64;
    ip[8..24].copy_from_slice(&flow.src_ip.octets());
    ip[24..40].copy_from_slice(&t.dst_ip.octets());
    let udp = &mut buf[UDP6_OFF..];
    udp[0..2].copy_from_slice(&flow.src_port.to_be_bytes());
    udp[2..4].copy_from_slice(&t.dst_port.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    udp[8..16].copy_from_slice(b"juneaupf");
    let mut pseudo = [0u8; 40];
    pseudo[0..16].copy_from_slice(&flow.src_ip.octets());
    pseudo[16..32].copy_from_slice(&t.dst_ip.octets());
    pseudo[34..36].copy_from_slice(&udp_len.to_be_bytes());
    pseudo[39] = 17;
    let mut c = fold(sum16(&pseudo) + sum16(&buf[UDP6_OFF..]));
    if c == 0 {
        c = 0xffff;
    }
    buf[UDP6_OFF + 6..UDP6_OFF + 8].copy_from_slice(&c.to_be_bytes());
}

/// Parses "aa:bb:cc:dd:ee:ff".
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Formats a MAC as "aa:bb:cc:dd:ee:ff".
pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_checksums_verify() {
        let t = Template {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            dst_ip: Ipv4Addr::new(198, 19, 0, 10),
            dst_port: 9000,
        };
        let mut buf = [0u8; 64];
        write_frame(&mut buf, &t, flow(Ipv4Addr::new(198, 18, 64, 0), 1000));
        assert_eq!(
            fold(sum16(&buf[IP_OFF..UDP_OFF])),
            0,
            "IPv4 header checksum"
        );
        let mut pseudo = [0u8; 12];
        pseudo[0..4].copy_from_slice(&buf[26..30]);
        pseudo[4..8].copy_from_slice(&buf[30..34]);
        pseudo[9] = 17;
        pseudo[10..12].copy_from_slice(&26u16.to_be_bytes());
        assert_eq!(
            fold(sum16(&pseudo) + sum16(&buf[UDP_OFF..FRAME_LEN])),
            0,
            "UDP checksum"
        );
    }

    #[test]
    fn flood_frames_are_what_they_say_with_valid_checksums() {
        let t = Template {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            dst_ip: Ipv4Addr::new(198, 19, 0, 10),
            dst_port: 9002,
        };
        let f = flow(Ipv4Addr::new(198, 18, 64, 0), 77);
        for (kind, flags) in [(FrameKind::Syn, 0x02), (FrameKind::Ack, 0x10)] {
            let mut buf = [0u8; FRAME_LEN];
            write_frame_of(&mut buf, &t, f, kind);
            assert_eq!(
                fold(sum16(&buf[IP_OFF..UDP_OFF])),
                0,
                "{kind:?} IPv4 checksum"
            );
            assert_eq!(buf[IP_OFF + 9], 6, "{kind:?} protocol");
            assert_eq!(&buf[IP_OFF + 2..IP_OFF + 4], &40u16.to_be_bytes());
            assert_eq!(buf[UDP_OFF + 13], flags, "{kind:?} flags");
            assert_eq!(&buf[UDP_OFF..UDP_OFF + 2], &f.src_port.to_be_bytes());
            let mut pseudo = [0u8; 12];
            pseudo[0..4].copy_from_slice(&buf[26..30]);
            pseudo[4..8].copy_from_slice(&buf[30..34]);
            pseudo[9] = 6;
            pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
            assert_eq!(
                fold(sum16(&pseudo) + sum16(&buf[UDP_OFF..UDP_OFF + 20])),
                0,
                "{kind:?} TCP checksum"
            );
        }
        let mut buf = [0u8; FRAME_LEN];
        write_frame_of(&mut buf, &t, f, FrameKind::Fragment);
        assert_eq!(
            fold(sum16(&buf[IP_OFF..UDP_OFF])),
            0,
            "fragment IPv4 checksum"
        );
        assert_eq!(
            &buf[IP_OFF + 6..IP_OFF + 8],
            &0x2000u16.to_be_bytes(),
            "MF, offset 0"
        );
        let mut udp = [0u8; FRAME_LEN];
        write_frame_of(&mut udp, &t, f, FrameKind::Udp);
        let mut plain = [0u8; FRAME_LEN];
        write_frame(&mut plain, &t, f);
        assert_eq!(udp, plain);
    }

    #[test]
    fn flows_are_distinct() {
        let base = Ipv4Addr::new(198, 18, 64, 0);
        let a = flow(base, 0);
        let b = flow(base, 64);
        let c = flow(base, 63);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(
            flow(base, (1 << 20) - 1).src_ip,
            Ipv4Addr::new(198, 18, 127, 255)
        );
    }

    fn template6() -> Template6 {
        Template6 {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            dst_ip: "2001:2:0:ff::10".parse().unwrap(),
            dst_port: 9000,
        }
    }

    #[test]
    fn ipv6_frame_parses_with_a_valid_udp_checksum() {
        let base: Ipv6Addr = "2001:2:0:40::".parse().unwrap();
        for i in [0, 1, 63, 64, 1000, (1 << 20) - 1] {
            let f = flow6(base, i);
            let mut buf = [0u8; FRAME6_LEN];
            write_frame6(&mut buf, &template6(), f);
            let p = etherparse::SlicedPacket::from_ethernet(&buf).expect("parses");
            let Some(etherparse::NetSlice::Ipv6(ip)) = &p.net else {
                panic!("not IPv6: {:?}", p.net);
            };
            let h = ip.header();
            assert_eq!(h.source_addr(), f.src_ip);
            assert_eq!(h.destination_addr(), template6().dst_ip);
            assert_eq!(h.hop_limit(), 64);
            assert_eq!(usize::from(h.payload_length()), FRAME6_LEN - UDP6_OFF);
            let Some(etherparse::TransportSlice::Udp(udp)) = &p.transport else {
                panic!("not UDP: {:?}", p.transport);
            };
            assert_eq!(udp.source_port(), f.src_port);
            assert_eq!(udp.destination_port(), 9000);
            assert_eq!(udp.payload(), b"juneaupf");
            let expect = udp
                .to_header()
                .calc_checksum_ipv6(&h.to_header(), udp.payload())
                .expect("checksum");
            assert_eq!(udp.checksum(), expect, "UDP checksum of flow {i}");
            assert_ne!(udp.checksum(), 0, "0 is not a valid UDP checksum over IPv6");
        }
    }

    #[test]
    fn ipv6_flows_count_up_the_last_32_bits_as_ipv4_flows_do() {
        let base: Ipv6Addr = "2001:2:0:40::".parse().unwrap();
        for i in [0, 63, 64, 5000, (1 << 20) - 1] {
            let (f4, f6) = (flow(Ipv4Addr::new(0, 0, 0, 0), i), flow6(base, i));
            assert_eq!(f6.src_port, f4.src_port);
            assert_eq!(
                u128::from(f6.src_ip) - u128::from(base),
                u128::from(u32::from(f4.src_ip))
            );
        }
        assert_eq!(
            flow6(base, (1 << 20) - 1).src_ip,
            "2001:2:0:40::3fff".parse::<Ipv6Addr>().unwrap()
        );
    }

    #[test]
    fn mac_round_trip() {
        let m = parse_mac("02:ab:00:10:ff:01").unwrap();
        assert_eq!(format_mac(&m), "02:ab:00:10:ff:01");
        assert!(parse_mac("02:ab").is_none());
    }
}
