//! Raw Ethernet frames for dataplane tests: hand-made IPv4 frames, TCP segments and UDP
//! datagrams from pseudo-random sources (valid checksums)
//! and their injection on an interface inside a namespace (AF_PACKET through
//! `pnet_datalink`), for floods no socket API would send (spoofed ACKs and SYNs).

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::netns::in_ns;

/// The one's-complement checksum of `data` (RFC 1071).
pub fn inet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in data.chunks(2) {
        sum += u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A 20-byte IPv4 header from `src` to `dst`, protocol `proto`, carrying `payload_len`
/// bytes: DF set, TTL 64, identification 0, checksum left 0 ([`ethernet_ipv4`] fills
/// it in after any change, e.g. a fragment's identification and offset).
pub fn ipv4_header(src: [u8; 4], dst: [u8; 4], proto: u8, payload_len: usize) -> [u8; 20] {
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + payload_len) as u16).to_be_bytes());
    ip[6] = 0x40;
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src);
    ip[16..20].copy_from_slice(&dst);
    ip
}

/// An Ethernet frame carrying the IPv4 header `ip` (its checksum computed here) and
/// `payload`.
pub fn ethernet_ipv4(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    mut ip: [u8; 20],
    payload: &[u8],
) -> Vec<u8> {
    ip[10..12].copy_from_slice(&[0, 0]);
    let c = inet_checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = Vec::with_capacity(34 + payload.len());
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&ip);
    f.extend_from_slice(payload);
    f
}

/// `n` pseudo-random sources in 198.18.0.0/15 with ports 1024..61024 (same seed, same
/// sources), each with the random word it came from.
pub fn random_sources(seed: u64, n: usize) -> impl Iterator<Item = ([u8; 4], u16, u64)> {
    let mut x = seed | 1;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let src = [198, 18 + (x & 1) as u8, (x >> 8) as u8, (x >> 16) as u8];
        (src, 1024 + ((x >> 24) as u16 % 60000), x)
    })
}

/// `n` UDP datagrams (payload "hi", no UDP checksum) to `dst:dst_port`, each from a new
/// pseudo-random source address and port ([`random_sources`]): every one a new flow.
pub fn udp_flood(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    dst: Ipv4Addr,
    dst_port: u16,
    seed: u64,
    n: usize,
) -> Vec<Vec<u8>> {
    random_sources(seed, n)
        .map(|(src, sport, _)| {
            let mut udp = Vec::with_capacity(10);
            udp.extend_from_slice(&sport.to_be_bytes());
            udp.extend_from_slice(&dst_port.to_be_bytes());
            udp.extend_from_slice(&10u16.to_be_bytes());
            udp.extend_from_slice(&[0, 0, b'h', b'i']); // checksum 0: none (IPv4)
            let ip = ipv4_header(src, dst.octets(), 17, udp.len());
            ethernet_ipv4(dst_mac, src_mac, ip, &udp)
        })
        .collect()
}

/// What a flood of TCP segments looks like.
#[derive(Clone, Copy, Debug)]
pub struct TcpFlood {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub dst: Ipv4Addr,
    pub dst_port: u16,
    /// TCP flags byte (0x10 ACK, 0x02 SYN).
    pub flags: u8,
    /// Seed of the pseudo-random sources (same seed, same frames).
    pub seed: u64,
}

impl TcpFlood {
    /// `n` segments from pseudo-random sources in 198.18.0.0/15 and ports 1024..61024,
    /// with valid IPv4 and TCP checksums (so a Pod answers a SYN as it would a real one).
    pub fn frames(&self, n: usize) -> Vec<Vec<u8>> {
        random_sources(self.seed, n)
            .map(|(src, sport, x)| self.frame(src, sport, (x >> 32) as u32, x as u32))
            .collect()
    }

    /// `n` segments as [`TcpFlood::frames`], every source inside the /24 `prefix`.
    pub fn frames_from(&self, prefix: [u8; 3], n: usize) -> Vec<Vec<u8>> {
        random_sources(self.seed, n)
            .map(|(src, sport, x)| {
                let src = [prefix[0], prefix[1], prefix[2], src[3]];
                self.frame(src, sport, (x >> 32) as u32, x as u32)
            })
            .collect()
    }

    fn frame(&self, src: [u8; 4], sport: u16, seq: u32, ack: u32) -> Vec<u8> {
        let dst = self.dst.octets();
        let tcp = tcp_segment(src, dst, sport, self.dst_port, seq, ack, self.flags);
        let ip = ipv4_header(src, dst, 6, tcp.len());
        ethernet_ipv4(self.dst_mac, self.src_mac, ip, &tcp)
    }
}

/// A 20-byte TCP header without data from `src:sport` to `dst:dport`, with `flags`,
/// window 64240 and its checksum (over the pseudo-header) filled in.
pub fn tcp_segment(
    src: [u8; 4],
    dst: [u8; 4],
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
) -> [u8; 20] {
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&ack.to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let mut pseudo = Vec::with_capacity(32);
    pseudo.extend_from_slice(&src);
    pseudo.extend_from_slice(&dst);
    pseudo.extend_from_slice(&[0, 6, 0, 20]);
    pseudo.extend_from_slice(&tcp);
    tcp[16..18].copy_from_slice(&inet_checksum(&pseudo).to_be_bytes());
    tcp
}

/// Sends raw frames out of `ifname` in namespace `ns`, in bursts of 500 with a 5 ms
/// pause between bursts (bounded in count by `frames`); returns how many were sent.
pub fn inject(ns: &str, ifname: &str, frames: Vec<Vec<u8>>) -> Result<usize> {
    let (ns, ifname) = (ns.to_string(), ifname.to_string());
    in_ns(&ns.clone(), move || -> Result<usize> {
        let iface = pnet_datalink::interfaces()
            .into_iter()
            .find(|i| i.name == ifname)
            .with_context(|| format!("no interface {ifname} in {ns}"))?;
        let mut tx = match pnet_datalink::channel(&iface, Default::default())
            .with_context(|| format!("AF_PACKET channel on {ifname} in {ns}"))?
        {
            pnet_datalink::Channel::Ethernet(tx, _rx) => tx,
            _ => anyhow::bail!("{ifname} in {ns}: not an Ethernet channel"),
        };
        let mut sent = 0;
        for burst in frames.chunks(500) {
            for f in burst {
                if matches!(tx.send_to(f, None), Some(Ok(()))) {
                    sent += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(sent)
    })
}

/// Sends `payload` as the body of raw IPv4 packets of protocol `proto` to `dst` from
/// namespace `ns`, `times` times (the kernel writes the IPv4 header) — an ICMP error a
/// router would send, say.
pub fn send_raw_ipv4(
    ns: &str,
    dst: Ipv4Addr,
    proto: i32,
    payload: Vec<u8>,
    times: usize,
) -> Result<()> {
    use socket2::{Domain, Protocol, SockAddr, Socket, Type};
    in_ns(ns, move || -> Result<()> {
        let s = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(proto)))
            .context("raw IPv4 socket")?;
        let to = SockAddr::from(std::net::SocketAddrV4::new(dst, 0));
        for _ in 0..times {
            s.send_to(&payload, &to)
                .with_context(|| format!("sending to {dst}"))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_of_a_flood_frame_verify() {
        let f = TcpFlood {
            dst_mac: [2, 0, 0, 0, 0, 1],
            src_mac: [2, 0, 0, 0, 0, 2],
            dst: Ipv4Addr::new(10, 200, 0, 10),
            dst_port: 80,
            flags: 0x10,
            seed: 7,
        };
        let frames = f.frames(3);
        assert_eq!(frames.len(), 3);
        assert_ne!(frames[0], frames[1], "sources differ");
        for fr in &frames {
            let ip = &fr[14..34];
            assert_eq!(inet_checksum(ip), 0, "IPv4 header checksum verifies");
            let mut pseudo = ip[12..20].to_vec();
            pseudo.extend_from_slice(&[0, 6, 0, 20]);
            pseudo.extend_from_slice(&fr[34..54]);
            assert_eq!(inet_checksum(&pseudo), 0, "TCP checksum verifies");
            assert_eq!(fr[47], 0x10);
            assert_eq!(&fr[30..34], &[10, 200, 0, 10]);
        }
    }

    #[test]
    fn a_udp_flood_has_a_new_source_per_datagram_and_valid_headers() {
        let frames = udp_flood(
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 0, 2],
            Ipv4Addr::new(10, 200, 0, 10),
            53,
            11,
            100,
        );
        assert_eq!(frames.len(), 100);
        let sources: std::collections::BTreeSet<&[u8]> =
            frames.iter().map(|f| &f[26..34]).collect();
        assert!(sources.len() > 95, "mostly distinct sources");
        for fr in &frames {
            assert_eq!(fr.len(), 14 + 30);
            assert_eq!(
                inet_checksum(&fr[14..34]),
                0,
                "IPv4 header checksum verifies"
            );
            assert_eq!(fr[23], 17);
            assert_eq!(&fr[36..38], &53u16.to_be_bytes());
        }
    }
}
