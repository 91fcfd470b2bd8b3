//! The live-frames traffic generator: the kernel's `BPF_PROG_RUN` with
//! `BPF_F_TEST_XDP_LIVE_FRAMES` runs `bpf/gen.c` on frames built from one 64-byte UDP
//! template and transmits every frame the program redirects into the client's veth
//! (`../shared/notes/FACTS.md`, "A generator fast enough"). On this machine it offers
//! several Mpps from one core — more than any forwarding path here carries on the other
//! core — which is what makes "saturated" provable: the receiving side's ring overflows
//! and delivered < offered.
//!
//! Runs in the client namespace (`juneau-perf gen`, spawned with `ip netns exec` and
//! pinned with `taskset`): `bpf_redirect`'s ifindex is resolved in the namespace of the
//! caller. Every `BPF_PROG_RUN` call swaps the program into the XDP dispatcher and out
//! again, each with an RCU grace period (milliseconds on a busy machine), so calls are
//! long (~200 ms of frames each, sized from the previous call); with a rate, the program
//! paces itself against `bpf_ktime_get_ns` and drops frames that are not due yet, so
//! the wire sees an even rate, not bursts. "Offered" counts frames sent (redirected).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use aya::maps::Array;
use aya::programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp};
use aya::Ebpf;

use crate::gen::{GenConfig, GenResult, Generator};
use crate::packet::{self, FrameKind, FRAME6_LEN, FRAME_LEN};

/// The generator object (embedded).
pub static GEN_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gen.o"));

/// Frames per `BPF_PROG_RUN` batch inside the kernel (the kernel's limit is 256).
const KERNEL_BATCH: u32 = 64;
/// Wall time one call should last.
const CALL_TIME: Duration = Duration::from_millis(200);

#[repr(C)]
#[derive(Clone, Copy)]
struct GenCfg {
    ifindex: u32,
    flows: u32,
    src_base: u32,
    flags: u32,
    gap_ns: u64,
    peer_ip: u32,
    peer_port: u16,
    pad: u16,
    max_sent: u64,
    /// The template's headers, written into every frame (a recycled page holds what the
    /// path that forwarded it wrote).
    hdr: [u8; 64],
}
/// Bytes of `hdr` the program writes (Ethernet 14 + IPv4 20 + UDP 8).
const GEN_HDR_LEN: usize = 42;
// SAFETY: a #[repr(C)] struct (4 x u32, a u64 at offset 16, a u32 and two u16, a u64 at
// offset 32, 64 bytes at offset 40: 104 bytes, no padding); the layout of `struct gen_cfg`.
unsafe impl aya::Pod for GenCfg {}

/// `struct gen_cfg` flags (bpf/gen.c).
const GEN_REPLY: u32 = 1;
const GEN_PARTIAL_CSUM: u32 = 2;
const GEN_TCP: u32 = 4;
const GEN_FIRST_FRAGMENT: u32 = 8;
const GEN_IPV6: u32 = 16;
/// Bytes of `hdr` the program writes with `GEN_IPV6` (Ethernet 14 + IPv6 40 + UDP 8).
const GEN_HDR6_LEN: usize = 62;
/// Bytes of `hdr` the program writes with `GEN_TCP` (Ethernet 14 + IPv4 20 + TCP 20).
const GEN_TCP_HDR_LEN: usize = 54;

fn ifindex(iface: &str) -> Result<u32> {
    let c = std::ffi::CString::new(iface)?;
    // SAFETY: a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no interface {iface} in this namespace");
    }
    Ok(idx)
}

fn set_cfg(bpf: &mut Ebpf, c: GenCfg) -> Result<()> {
    let mut m: Array<_, GenCfg> = Array::try_from(bpf.map_mut("GEN_CFG").context("GEN_CFG")?)?;
    m.set(0, c, 0)?;
    Ok(())
}

/// The frame the kernel builds every frame from (flow 0), the header the program writes
/// into each, the kind's flags and the flows' first address as the program counts it
/// (IPv4: the whole address; IPv6: its last 32 bits).
fn first_frame(cfg: &GenConfig) -> (Vec<u8>, [u8; 64], u32, u32) {
    let mut hdr = [0u8; 64];
    if let Some(v6) = cfg.ipv6 {
        let mut frame = vec![0u8; FRAME6_LEN];
        packet::write_frame6(
            &mut frame,
            &cfg.template6(v6),
            packet::flow6(v6.src_base, 0),
        );
        hdr[..GEN_HDR6_LEN].copy_from_slice(&frame[..GEN_HDR6_LEN]);
        return (frame, hdr, GEN_IPV6, u128::from(v6.src_base) as u32);
    }
    let mut frame = vec![0u8; FRAME_LEN];
    packet::write_frame_of(
        &mut frame,
        &cfg.template,
        packet::flow(cfg.src_base, 0),
        cfg.kind,
    );
    let hdr_len = match cfg.kind {
        FrameKind::Syn | FrameKind::Ack => GEN_TCP_HDR_LEN,
        FrameKind::Udp | FrameKind::Fragment => GEN_HDR_LEN,
    };
    hdr[..hdr_len].copy_from_slice(&frame[..hdr_len]);
    let kind_flags = match cfg.kind {
        FrameKind::Udp => 0,
        FrameKind::Syn | FrameKind::Ack => GEN_TCP,
        FrameKind::Fragment => GEN_FIRST_FRAGMENT,
    };
    (frame, hdr, kind_flags, u32::from(cfg.src_base))
}

/// Sends until the duration or the frame bound is reached (or `stop` is set). The
/// result counts frames the generator offered (run through the program and handed to
/// the veth); what arrives is counted at the sink.
/// `ready` is called once the program is loaded, just before the first frame is sent
/// (loading can take long on a busy machine: callers start their clocks here).
pub fn generate(cfg: &GenConfig, stop: &AtomicBool, ready: &dyn Fn()) -> Result<GenResult> {
    cfg.check()?;
    let mut bpf = Ebpf::load(GEN_OBJ).context("loading gen.o")?;
    let (frame, hdr, kind_flags, src_base) = first_frame(cfg);
    let base = {
        let c = GenCfg {
            ifindex: ifindex(&cfg.iface)?,
            flows: cfg.flows.max(1),
            src_base,
            flags: if cfg.reply_from.is_some() {
                GEN_REPLY
            } else {
                0
            } | if cfg.partial_checksum {
                GEN_PARTIAL_CSUM
            } else {
                0
            } | kind_flags,
            peer_ip: cfg
                .reply_from
                .map(|(ip, _)| u32::from_ne_bytes(ip.octets()))
                .unwrap_or(0),
            peer_port: cfg.reply_from.map(|(_, p)| p.to_be()).unwrap_or(0),
            pad: 0,
            // Paced calls run many frames through the program per frame sent: the bound
            // must hold inside a call too.
            max_sent: if cfg.max_packets == u64::MAX {
                0
            } else {
                cfg.max_packets
            },
            hdr,
            gap_ns: if cfg.rate_pps == 0 {
                0
            } else {
                (1e9 / cfg.rate_pps as f64).round().max(1.0) as u64
            },
        };
        set_cfg(&mut bpf, c)?;
        c
    };
    let mut gap_ns = base.gap_ns as f64;
    {
        let prog: &mut Xdp = bpf
            .program_mut("xdp_gen")
            .context("program xdp_gen missing")?
            .try_into()?;
        prog.load().context("loading xdp_gen")?;
    }
    let sent_so_far = |bpf: &Ebpf| -> Result<u64> {
        let m: aya::maps::PerCpuArray<_, u64> =
            aya::maps::PerCpuArray::try_from(bpf.map("GEN_SEQ").context("GEN_SEQ")?)?;
        Ok(m.get(&0, 0)?.iter().sum())
    };
    // Frames the kernel runs per call (sent and paced-out alike), re-sized after each
    // call so that a call lasts about CALL_TIME.
    let mut chunk: u32 = 1 << 20;
    let mut sent = 0u64;
    ready();
    let start = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) || sent >= cfg.max_packets {
            break;
        }
        let elapsed = start.elapsed();
        if elapsed >= cfg.duration {
            break;
        }
        let left = cfg.duration - elapsed;
        let mut n = chunk;
        if cfg.rate_pps == 0 {
            n = u64::from(n).min(cfg.max_packets - sent) as u32;
        }
        if left < CALL_TIME {
            n = ((f64::from(n) * left.as_secs_f64() / CALL_TIME.as_secs_f64()) as u32)
                .max(KERNEL_BATCH);
        }
        let t = Instant::now();
        let opts = TestRunOptions {
            data_in: Some(&frame[..]),
            repeat: n,
            attrs: TestRunAttrs::new().xdp_live_frames(KERNEL_BATCH),
            ..Default::default()
        };
        let prog: &Xdp = bpf
            .program("xdp_gen")
            .context("program xdp_gen missing")?
            .try_into()?;
        if let Err(e) = prog.test_run(opts) {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            return Err(anyhow::Error::new(e))
                .context("BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (needs Linux >= 5.18)");
        }
        let took = t.elapsed().as_secs_f64().max(1e-6);
        chunk = ((f64::from(n) * CALL_TIME.as_secs_f64() / took) as u32).clamp(1 << 12, 1 << 26);
        sent = sent_so_far(&bpf)?;
        if cfg.rate_pps > 0 {
            // No frames go out between calls (each swaps the program into the XDP
            // dispatcher and out, with RCU grace periods: up to half the wall time on a
            // loaded machine, measured), so pace a little faster inside the calls until
            // the average since the start is the asked rate (at most 4x the rate).
            let due = cfg.rate_pps as f64 * start.elapsed().as_secs_f64();
            if due > 0.0 && sent > 0 {
                let b = base.gap_ns as f64;
                gap_ns = (gap_ns * sent as f64 / due).clamp(b / 4.0, b);
                set_cfg(
                    &mut bpf,
                    GenCfg {
                        gap_ns: gap_ns.round().max(1.0) as u64,
                        ..base
                    },
                )?;
            }
        }
    }
    Ok(GenResult {
        sent,
        elapsed_s: start.elapsed().as_secs_f64(),
        generator: Generator::LiveFrames,
    })
}

/// Why this kernel refuses to run the generator (`BPF_PROG_RUN` with
/// `BPF_F_TEST_XDP_LIVE_FRAMES` answered EPERM: seen on a kernel locked down from its
/// configuration, 2026-12-07), or `None` when it runs it: one frame through the
/// generator program, unconfigured (no interface: the frame goes nowhere).
pub fn live_frames_refused() -> Option<String> {
    let probe = || -> Result<()> {
        let mut bpf = Ebpf::load(GEN_OBJ).context("loading gen.o")?;
        let prog: &mut Xdp = bpf
            .program_mut("xdp_gen")
            .context("program xdp_gen missing")?
            .try_into()?;
        prog.load().context("loading xdp_gen")?;
        let frame = [0u8; FRAME_LEN];
        let opts = TestRunOptions {
            data_in: Some(&frame[..]),
            repeat: 1,
            attrs: TestRunAttrs::new().xdp_live_frames(1),
            ..Default::default()
        };
        prog.test_run(opts)?;
        Ok(())
    };
    let e = probe().err()?;
    let refused = e
        .chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.raw_os_error() == Some(libc::EPERM));
    refused.then(|| {
        format!("this kernel refuses BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (EPERM): {e:#}")
    })
}
