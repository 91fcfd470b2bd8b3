//! What the traffic generator sends ([`GenConfig`]) and which of the two generators
//! sends it: live frames (`livegen.rs`: `BPF_PROG_RUN` with `BPF_F_TEST_XDP_LIVE_FRAMES`,
//! several Mpps from one core) by default, and AF_XDP copy-mode TX (`xsk.rs`: about
//! 2.7 Mpps from one core on the 2026-12-07 machine, measured by hand) where the kernel refuses live frames
//! (EPERM on a kernel locked down from its configuration). Both send the same frames:
//! [`GenConfig::write_frame`] is the userspace twin of `bpf/gen.c`, frame for frame.
//!
//! Not the same on the receiving side: a live frame reaches the node's veth as an XDP
//! frame, an AF_XDP TX frame as an skb, which veth copies into a page of its own before
//! an XDP program there (juneau's, xdp-dnat's) runs on it — work a NIC does not do, on
//! the path's core, against the XDP paths only. The report states the generator.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::packet::{self, FrameKind, Template, Template6, FRAME6_LEN, FRAME_LEN};

/// What to send.
#[derive(Debug, Clone)]
pub struct GenConfig {
    /// Interface to send on (in the current namespace).
    pub iface: String,
    /// The fixed frame fields.
    pub template: Template,
    /// First client source address of the flow set.
    pub src_base: Ipv4Addr,
    /// Number of flows, round robin.
    pub flows: u32,
    /// Frames per second; 0 sends as fast as the core allows.
    pub rate_pps: u64,
    /// Stop after this long...
    pub duration: Duration,
    /// ...or after this many frames.
    pub max_packets: u64,
    /// Replies: the flow is the destination and `reply_from` the fixed source (the
    /// template's destination fields are then overwritten per frame).
    pub reply_from: Option<(Ipv4Addr, u16)>,
    /// Send partial UDP checksums (the pseudo-header sum, as a Pod's kernel with tx
    /// checksum offload hands them over) instead of none.
    pub partial_checksum: bool,
    /// What each frame is: the load's UDP datagram or a flood's packet.
    pub kind: FrameKind,
    /// IPv6 instead: the load's UDP datagram over IPv6 to this destination address (the
    /// template's MACs and port), from flows counted up from `src_base` in their last 32
    /// bits ([`packet::flow6`]); `template.dst_ip` and `src_base` are then unused.
    pub ipv6: Option<Ipv6Load>,
}

/// The IPv6 load's addresses ([`GenConfig::ipv6`]).
#[derive(Debug, Clone, Copy)]
pub struct Ipv6Load {
    /// Destination (the IPv6 VIP or the backend's IPv6 address).
    pub dst_ip: Ipv6Addr,
    /// First client source address of the flow set.
    pub src_base: Ipv6Addr,
}

/// Which generator sent a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Generator {
    /// `BPF_PROG_RUN` with `BPF_F_TEST_XDP_LIVE_FRAMES` (`livegen.rs`).
    LiveFrames,
    /// AF_XDP copy-mode TX (`xsk.rs`).
    AfxdpTx,
}

/// [`Generator::for_this_kernel`], probed once per process.
static THIS_KERNEL: OnceLock<(Generator, Option<String>)> = OnceLock::new();

impl Generator {
    /// The generator this kernel runs: live frames unless it refuses them, with why
    /// (probed once per process: a program load and one frame).
    pub fn for_this_kernel() -> &'static (Generator, Option<String>) {
        THIS_KERNEL.get_or_init(|| match crate::livegen::live_frames_refused() {
            None => (Generator::LiveFrames, None),
            Some(why) => (Generator::AfxdpTx, Some(why)),
        })
    }

    /// Its name on `juneau-perf gen --generator`.
    pub fn name(self) -> &'static str {
        match self {
            Generator::LiveFrames => "live-frames",
            Generator::AfxdpTx => "afxdp-tx",
        }
    }

    /// One line for reports: the generator and, when it is the fallback, why.
    pub fn describe(self, why: Option<&str>) -> String {
        match (self, why) {
            (Generator::LiveFrames, _) => "live frames (BPF_PROG_RUN, XDP)".into(),
            (Generator::AfxdpTx, None) => "AF_XDP copy-mode TX".into(),
            (Generator::AfxdpTx, Some(w)) => format!("AF_XDP copy-mode TX, because {w}"),
        }
    }
}

/// What a generator did (its own count; throughput is measured at the sink).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenResult {
    /// Frames handed to the kernel.
    pub sent: u64,
    /// Seconds spent sending.
    pub elapsed_s: f64,
    /// The generator that sent them.
    pub generator: Generator,
}

/// Largest table of prebuilt frames ([`GenConfig::frames_by_flow`]): 1 M flows of
/// 64-byte frames fit.
const PREBUILT_MAX_BYTES: usize = 128 << 20;

impl GenConfig {
    /// Refuses what neither generator sends.
    pub fn check(&self) -> Result<()> {
        if self.ipv6.is_some()
            && (self.kind != FrameKind::Udp || self.reply_from.is_some() || self.partial_checksum)
        {
            bail!("the IPv6 load is UDP datagrams from the flows only (no --kind, --reply-from or --partial-checksum)");
        }
        if self.reply_from.is_some() && self.kind != FrameKind::Udp {
            bail!("replies are UDP datagrams only");
        }
        Ok(())
    }

    /// The IPv6 load's fixed frame fields: the template's MACs and port, `v6`'s
    /// destination.
    pub fn template6(&self, v6: Ipv6Load) -> Template6 {
        Template6 {
            src_mac: self.template.src_mac,
            dst_mac: self.template.dst_mac,
            dst_ip: v6.dst_ip,
            dst_port: self.template.dst_port,
        }
    }

    /// Length of every frame of this load.
    pub fn frame_len(&self) -> usize {
        if self.ipv6.is_some() {
            FRAME6_LEN
        } else {
            FRAME_LEN
        }
    }

    /// Every flow's frame, one after the other ([`GenConfig::frame_len`] bytes each), when
    /// a frame depends on its flow only (UDP datagrams; not a flood's TCP segments or
    /// fragments, numbered per frame) and the table fits: a generator that copies them
    /// spends less of its core per frame than one that builds each.
    pub fn frames_by_flow(&self) -> Option<Vec<u8>> {
        let (len, flows) = (self.frame_len(), self.flows.max(1) as usize);
        if self.kind != FrameKind::Udp || len * flows > PREBUILT_MAX_BYTES {
            return None;
        }
        let mut table = vec![0u8; len * flows];
        for (i, f) in table.chunks_exact_mut(len).enumerate() {
            self.write_frame(f, i as u64);
        }
        Some(table)
    }

    /// Writes frame number `n` (counted from 0) into `buf` and returns its length: flow
    /// `n % flows`; as `bpf/gen.c` writes it (a first fragment's IP id and a TCP
    /// segment's sequence number are `n`; a UDP checksum over IPv4 is none, or the
    /// partial one; over IPv6 it is complete).
    pub fn write_frame(&self, buf: &mut [u8], n: u64) -> usize {
        let i = (n % u64::from(self.flows.max(1))) as u32;
        if let Some(v6) = self.ipv6 {
            packet::write_frame6(buf, &self.template6(v6), packet::flow6(v6.src_base, i));
            return FRAME6_LEN;
        }
        let flow = packet::flow(self.src_base, i);
        let (t, from) = match self.reply_from {
            Some((ip, port)) => (
                Template {
                    dst_ip: flow.src_ip,
                    dst_port: flow.src_port,
                    ..self.template
                },
                packet::Flow {
                    src_ip: ip,
                    src_port: port,
                },
            ),
            None => (self.template, flow),
        };
        packet::write_frame_of(buf, &t, from, self.kind);
        match self.kind {
            FrameKind::Udp => packet::set_udp_checksum(buf, self.partial_checksum),
            FrameKind::Fragment => {
                packet::set_udp_checksum(buf, false);
                packet::set_ip_id(buf, n as u16);
            }
            FrameKind::Syn | FrameKind::Ack => packet::set_tcp_seq(buf, n as u32),
        }
        FRAME_LEN
    }
}

/// Sends `cfg` with `generator` (`None`: the one this kernel runs) until its duration
/// or frame bound (or `stop`); `ready` is called just before the first frame.
pub fn generate(
    cfg: &GenConfig,
    generator: Option<Generator>,
    stop: &AtomicBool,
    ready: &dyn Fn(),
) -> Result<GenResult> {
    cfg.check()?;
    let generator = generator.unwrap_or_else(|| {
        let (g, why) = Generator::for_this_kernel();
        if let Some(why) = why {
            tracing::info!("{why}: sending with AF_XDP copy-mode TX");
        }
        *g
    });
    match generator {
        Generator::LiveFrames => crate::livegen::generate(cfg, stop, ready),
        Generator::AfxdpTx => crate::xsk::generate(cfg, stop, ready),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(kind: FrameKind) -> GenConfig {
        GenConfig {
            iface: "c0".into(),
            template: Template {
                src_mac: [2, 0, 0, 0, 0, 1],
                dst_mac: [2, 0, 0, 0, 0, 2],
                dst_ip: Ipv4Addr::new(10, 100, 0, 10),
                dst_port: 9000,
            },
            src_base: Ipv4Addr::new(10, 64, 0, 0),
            flows: 300,
            rate_pps: 0,
            duration: Duration::from_secs(1),
            max_packets: u64::MAX,
            reply_from: None,
            partial_checksum: false,
            kind,
            ipv6: None,
        }
    }

    fn frame(cfg: &GenConfig, n: u64) -> Vec<u8> {
        let mut b = vec![0xaau8; 2048];
        let len = cfg.write_frame(&mut b, n);
        b.truncate(len);
        b
    }

    /// The headers as a receiver parses them, checksums checked where they are set.
    fn parsed(b: &[u8]) -> etherparse::SlicedPacket<'_> {
        let p = etherparse::SlicedPacket::from_ethernet(b).expect("a parseable frame");
        if let Some(etherparse::NetSlice::Ipv4(ip)) = &p.net {
            let h = ip.header().to_header();
            assert_eq!(h.header_checksum, h.calc_header_checksum(), "IPv4 checksum");
        }
        p
    }

    /// The IPv4 header and UDP datagram of a parsed frame.
    fn ipv4_udp<'a>(
        p: &'a etherparse::SlicedPacket<'a>,
    ) -> (&'a etherparse::Ipv4Slice<'a>, &'a etherparse::UdpSlice<'a>) {
        let (Some(etherparse::NetSlice::Ipv4(ip)), Some(etherparse::TransportSlice::Udp(u))) =
            (&p.net, &p.transport)
        else {
            panic!("IPv4 UDP")
        };
        (ip, u)
    }

    #[test]
    fn generator_names_are_what_gen_parses() {
        use clap::ValueEnum;
        for g in [Generator::LiveFrames, Generator::AfxdpTx] {
            assert_eq!(Generator::from_str(g.name(), false), Ok(g));
        }
    }

    #[test]
    fn udp_frames_go_round_robin_over_the_flows_without_a_checksum() {
        let cfg = load(FrameKind::Udp);
        for n in [0u64, 1, 63, 64, 299, 300, 301] {
            let b = frame(&cfg, n);
            let f = packet::flow(cfg.src_base, (n % 300) as u32);
            let p = parsed(&b);
            let Some(etherparse::NetSlice::Ipv4(ip)) = &p.net else {
                panic!("IPv4")
            };
            assert_eq!(ip.header().source_addr(), f.src_ip);
            assert_eq!(ip.header().destination_addr(), cfg.template.dst_ip);
            let Some(etherparse::TransportSlice::Udp(u)) = &p.transport else {
                panic!("UDP")
            };
            assert_eq!((u.source_port(), u.destination_port()), (f.src_port, 9000));
            assert_eq!(u.checksum(), 0, "none, as gen.c sends");
            assert!(u.payload().starts_with(b"juneaupf"));
        }
    }

    #[test]
    fn partial_checksums_are_the_folded_pseudo_header_sum() {
        let cfg = GenConfig {
            partial_checksum: true,
            ..load(FrameKind::Udp)
        };
        let b = frame(&cfg, 5);
        let p = parsed(&b);
        let (ip, u) = ipv4_udp(&p);
        let (s, d) = (
            u32::from(ip.header().source_addr()),
            u32::from(ip.header().destination_addr()),
        );
        let mut sum = (s >> 16) + (s & 0xffff) + (d >> 16) + (d & 0xffff) + 17 + 26;
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(u.checksum(), sum as u16);
    }

    #[test]
    fn replies_come_from_the_fixed_source_to_each_flow() {
        let cfg = GenConfig {
            reply_from: Some((Ipv4Addr::new(10, 200, 0, 2), 9000)),
            ..load(FrameKind::Udp)
        };
        let b = frame(&cfg, 70);
        let f = packet::flow(cfg.src_base, 70);
        let p = parsed(&b);
        let (ip, u) = ipv4_udp(&p);
        assert_eq!(ip.header().source_addr(), Ipv4Addr::new(10, 200, 0, 2));
        assert_eq!(ip.header().destination_addr(), f.src_ip);
        assert_eq!((u.source_port(), u.destination_port()), (9000, f.src_port));
    }

    #[test]
    fn tcp_segments_number_their_sequence_and_keep_a_valid_checksum() {
        for kind in [FrameKind::Syn, FrameKind::Ack] {
            let cfg = load(kind);
            let b = frame(&cfg, 1234);
            let p = parsed(&b);
            let (Some(etherparse::NetSlice::Ipv4(ip)), Some(etherparse::TransportSlice::Tcp(t))) =
                (&p.net, &p.transport)
            else {
                panic!("IPv4 TCP")
            };
            assert_eq!(t.sequence_number(), 1234);
            assert_eq!(t.syn(), kind == FrameKind::Syn);
            assert_eq!(t.ack(), kind == FrameKind::Ack);
            let want = t
                .to_header()
                .calc_checksum_ipv4(&ip.header().to_header(), t.payload())
                .expect("checksum");
            assert_eq!(t.checksum(), want, "TCP checksum");
        }
    }

    #[test]
    fn first_fragments_carry_the_frame_number_as_their_id() {
        let cfg = load(FrameKind::Fragment);
        let b = frame(&cfg, 0x1_0007);
        let p = etherparse::Ipv4HeaderSlice::from_slice(&b[14..]).expect("IPv4");
        assert!(p.more_fragments());
        assert_eq!(p.fragments_offset().value(), 0);
        assert_eq!(p.identification(), 7);
        let h = p.to_header();
        assert_eq!(h.header_checksum, h.calc_header_checksum());
    }

    #[test]
    fn ipv6_frames_carry_a_complete_udp_checksum() {
        let cfg = GenConfig {
            ipv6: Some(Ipv6Load {
                dst_ip: "fd00:100::10".parse().unwrap(),
                src_base: "fd00:64::".parse().unwrap(),
            }),
            ..load(FrameKind::Udp)
        };
        let b = frame(&cfg, 65);
        assert_eq!(b.len(), FRAME6_LEN);
        let p = parsed(&b);
        let (Some(etherparse::NetSlice::Ipv6(ip)), Some(etherparse::TransportSlice::Udp(u))) =
            (&p.net, &p.transport)
        else {
            panic!("IPv6 UDP")
        };
        let f = packet::flow6("fd00:64::".parse().unwrap(), 65);
        assert_eq!(ip.header().source_addr(), f.src_ip);
        let want = u
            .to_header()
            .calc_checksum_ipv6(&ip.header().to_header(), u.payload())
            .expect("checksum");
        assert_eq!(u.checksum(), want);
    }

    /// Udp6InCsumErrors of a namespace.
    fn udp6_checksum_errors(ns: &juneau_tests::netns::Netns) -> u64 {
        let snmp6 = ns.exec(&["cat", "/proc/net/snmp6"]).expect("snmp6");
        snmp6
            .lines()
            .find_map(|l| l.strip_prefix("Udp6InCsumErrors"))
            .and_then(|v| v.trim().parse().ok())
            .expect("Udp6InCsumErrors")
    }

    /// Needs root (namespaces, BPF_PROG_RUN, AF_XDP). What each generator writes per IPv6
    /// frame (the flow's address and port, the UDP checksum), checked by the kernel:
    /// frames sent to the node's own address (receive checksum offload off on its end)
    /// reach a socket, every one, from every flow, none counted as a checksum error.
    /// Live frames only where the kernel runs them (else listed as not run).
    #[test]
    fn ipv6_frames_reach_a_socket_from_every_flow_with_valid_checksums() {
        juneau_tests::netns::require_root().expect("root");
        ipv6_frames_arrive(Generator::AfxdpTx);
        match crate::livegen::live_frames_refused() {
            None => ipv6_frames_arrive(Generator::LiveFrames),
            Some(why) => juneau_tests::did_not_run(
                "gen::tests::ipv6_frames_reach_a_socket_from_every_flow_with_valid_checksums (live frames)",
                &why,
            ),
        }
    }

    fn ipv6_frames_arrive(generator: Generator) {
        use std::collections::BTreeSet;
        use std::net::{SocketAddr, UdpSocket};

        use crate::bpf::in_netns;
        use crate::topology::{Topology, FLOW_BASE6, NODE_CLIENT_IP6};

        const PORT: u16 = 9555;
        let t = Topology::build().expect("topology");
        t.node
            .exec(&["ethtool", "-K", &t.nc_if, "rx", "off"])
            .expect("rx checksum offload off");
        let sock = in_netns(t.node.name(), || {
            let s = UdpSocket::bind(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), PORT))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            crate::sink::set_int(&s, libc::SO_RCVBUFFORCE, 16 << 20)?;
            Ok(s)
        })
        .expect("socket");
        let (flows, frames) = (300u32, 900u64);
        let cfg = GenConfig {
            iface: t.c_if.clone(),
            template: Template {
                src_mac: t.c_mac,
                dst_mac: t.nc_mac,
                dst_ip: Ipv4Addr::UNSPECIFIED,
                dst_port: PORT,
            },
            flows,
            rate_pps: 20_000,
            duration: Duration::from_secs(10),
            max_packets: frames,
            ipv6: Some(Ipv6Load {
                dst_ip: NODE_CLIENT_IP6,
                src_base: FLOW_BASE6,
            }),
            ..load(FrameKind::Udp)
        };
        // Read while the generator sends (the socket's buffer holds only some frames).
        let reader = std::thread::spawn(move || {
            let (mut got, mut seen, mut buf) = (0u64, BTreeSet::new(), [0u8; 64]);
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                assert_eq!(&buf[..n], b"juneaupf");
                seen.insert(from);
                got += 1;
            }
            (got, seen)
        });
        let r = in_netns(t.client.name(), move || {
            generate(&cfg, Some(generator), &AtomicBool::new(false), &|| {})
        })
        .expect("generate");
        assert_eq!((r.sent, r.generator), (frames, generator));
        let (got, seen) = reader.join().expect("reader");
        assert_eq!(udp6_checksum_errors(&t.node), 0, "UDP checksum errors");
        assert_eq!(
            got, frames,
            "every frame reached the socket ({generator:?})"
        );
        let every_flow: BTreeSet<SocketAddr> = (0..flows)
            .map(|i| {
                let f = packet::flow6(FLOW_BASE6, i);
                SocketAddr::new(f.src_ip.into(), f.src_port)
            })
            .collect();
        assert_eq!(seen, every_flow);
    }

    #[test]
    fn prebuilt_frames_are_the_frames_of_their_flow_and_only_for_udp() {
        let cfg = load(FrameKind::Udp);
        let table = cfg.frames_by_flow().expect("UDP frames are prebuilt");
        assert_eq!(table.len(), 300 * FRAME_LEN);
        for n in [0u64, 1, 299, 300, 777] {
            let i = (n % 300) as usize;
            assert_eq!(
                &table[i * FRAME_LEN..(i + 1) * FRAME_LEN],
                &frame(&cfg, n)[..]
            );
        }
        assert!(load(FrameKind::Syn).frames_by_flow().is_none());
        assert!(load(FrameKind::Fragment).frames_by_flow().is_none());
        let huge = GenConfig {
            flows: u32::MAX,
            ..load(FrameKind::Udp)
        };
        assert!(huge.frames_by_flow().is_none());
    }

    #[test]
    fn what_neither_generator_sends_is_refused() {
        let mut v6 = load(FrameKind::Syn);
        v6.ipv6 = Some(Ipv6Load {
            dst_ip: Ipv6Addr::LOCALHOST,
            src_base: Ipv6Addr::LOCALHOST,
        });
        assert!(v6.check().is_err());
        let mut syn_reply = load(FrameKind::Syn);
        syn_reply.reply_from = Some((Ipv4Addr::LOCALHOST, 1));
        assert!(syn_reply.check().is_err());
        assert!(load(FrameKind::Ack).check().is_ok());
    }
}
