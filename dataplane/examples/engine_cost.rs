//! Runs N packets of one scenario through the forwarding engine, for instruction counts
//! under callgrind (stable on noisy shared machines, unlike wall-clock benches):
//!
//! ```text
//! cargo build --release -p juneau-dataplane --example engine_cost
//! for n in 100000 200000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!   target/release/examples/engine_cost forward $n 2>&1 | grep refs; done
//! # instructions per packet = (Ir(200000) - Ir(100000)) / 100000
//! ```
//! That figure includes this harness's loop (a 64-byte frame copied in per packet with
//! libc `memcpy`, the loop, a branch on the verdict). The `baseline` scenario runs the
//! same loop without the engine (same copy, same counter); the engine's own cost is
//! `forward` minus `baseline`, both measured with the two-run method above (about 33
//! instructions of harness). Per-instruction detail: add `--dump-instr=yes` and a real
//! output file, then `callgrind_annotate --auto=yes FILE`.
//! Scenarios: `baseline`, `parse`, `forward` (established flow, 256 flows), `reverse`
//! (reply with L4 checksum recomputation, 64 B frames; `PAYLOAD=1472` for 1514 B),
//! `reverse-incremental`, `new-flow`.
//!
//! Wall-clock scenarios (cache and TLB misses matter there, instruction counts do not):
//! `forward-flows` (FLOWS established flows, default 1 Mi, visited in a scrambled order,
//! batches of 64; `WARM=1` warms each batch first as the forwarding loop does;
//! `SHARED=1` puts the flow table in the steering program's mmapped BPF maps, as the
//! dataplane does, instead of the heap with huge pages — needs root) and `xdp-flows`
//! (the steering program's established-flow fast path over FLOWS flows, run by the
//! kernel with `BPF_PROG_TEST_RUN` one packet of a scrambled flow per run; the mean of
//! the kernel's time per run, which includes one clock read; `HOT=1` sends flow 0's
//! packet every time instead — needs root) and `xdp-default` (the same program's cost
//! on the default path: the packet goes to userspace).

use std::hint::black_box;

use juneau_dataplane::engine::{Engine, EngineConfig, Verdict};
use juneau_dataplane::flow::FlowTable;
use juneau_dataplane::neigh::{Neighbours, Side};
use juneau_dataplane::packet::{self, Parsed};
use juneau_dataplane::steering::Steering;

#[path = "../benches/common/mod.rs"]
mod common;
use common::{setup, setup_engine, udp, B, CLIENT, VIP};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).map(String::as_str).unwrap_or("forward");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let frames: Vec<Vec<u8>> = (0..256)
        .map(|i| udp(CLIENT, 10000 + i, VIP, 53, 22))
        .collect();
    let mut buf = frames[0].clone();
    match scenario {
        "parse" => {
            for i in 0..n {
                black_box(packet::parse(black_box(&frames[i & 255])).ok());
            }
        }
        "forward" => {
            let (mut e, nb) = setup(true, 1 << 16);
            for f in &frames {
                let mut g = f.clone();
                e.process(&mut g, Side::Uplink, &nb, 0);
            }
            // The verdict is consumed as the forwarding loop does (a branch on it), not
            // forced through memory with `black_box`.
            let mut tx = 0usize;
            for i in 0..n {
                buf.copy_from_slice(&frames[i & 255]);
                if let Verdict::Tx(Side::Pod(_)) = e.process(&mut buf, Side::Uplink, &nb, 1) {
                    tx += 1;
                }
            }
            assert_eq!(black_box(tx), n, "every packet forwarded");
        }
        "baseline" => {
            // The harness alone: the same frame copy and `black_box` as `forward`, no
            // engine. Subtract its per-packet count to get the engine's own cost.
            let mut tx = 0usize;
            for i in 0..n {
                buf.copy_from_slice(&frames[i & 255]);
                if black_box(&mut buf).len() == 64 {
                    tx += 1;
                }
            }
            assert_eq!(black_box(tx), n);
        }
        "reverse" | "reverse-incremental" => {
            let (mut e, nb) = setup(scenario == "reverse", 1 << 16);
            // PAYLOAD (bytes of UDP payload, default 22 = 64-byte frames).
            let payload = std::env::var("PAYLOAD")
                .ok()
                .and_then(|p| p.parse().ok())
                .unwrap_or(22);
            let replies: Vec<Vec<u8>> = (0..256)
                .map(|i| udp(B, 5353, CLIENT, 10000 + i, payload))
                .collect();
            buf = replies[0].clone();
            for f in &frames {
                let mut g = f.clone();
                e.process(&mut g, Side::Uplink, &nb, 0);
            }
            for i in 0..n {
                buf.copy_from_slice(&replies[i & 255]);
                black_box(e.process(&mut buf, Side::Pod(0), &nb, 1));
            }
            assert_eq!(
                e.counters().services[0].packets_out,
                n as u64,
                "every reply forwarded"
            );
        }
        "new-flow" => {
            let (mut e, nb) = setup(true, 1 << 20);
            let mut g = udp(CLIENT, 1, VIP, 53, 22);
            for i in 0..n {
                // A fresh client address/port per packet: rewrite source and checksums.
                let src = 0x0a00_0000u32 | (i as u32 >> 16);
                let Ok(Parsed::Ipv4(mut v)) = packet::parse(&g) else {
                    unreachable!()
                };
                packet::rewrite_addr_port(
                    &mut g,
                    &mut v,
                    packet::NatSide::Source,
                    src,
                    i as u16,
                    packet::L4Checksum::Incremental,
                );
                buf.copy_from_slice(&g);
                black_box(e.process(&mut buf, Side::Uplink, &nb, i as u64));
                e.sweep(i as u64, 64);
            }
        }
        "forward-flows" => forward_flows(n),
        "xdp-flows" => xdp_flows(n, true),
        "xdp-default" => xdp_flows(n, false),
        other => panic!("unknown scenario {other}"),
    }
}

fn env_flows() -> u32 {
    std::env::var("FLOWS")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(1 << 20)
}

/// The template frame of `forward-flows` / `xdp-flows`, and how flow `k`'s frame is made
/// from it (source address and port per flow; checksums are not fixed up, which costs
/// neither the engine nor the program anything extra).
fn flow_frame(template: &[u8], buf: &mut [u8], k: u32) {
    buf.copy_from_slice(template);
    buf[26..30].copy_from_slice(&(0x0a00_0000 | (k >> 14)).to_be_bytes());
    buf[34..36].copy_from_slice(&(1024 + (k & 0x3fff) as u16).to_be_bytes());
}

/// An engine over `flows` flows' table: on the heap (huge pages), or with `shared` in
/// the steering program's BPF maps (returned too; not pinned: the temporary directory is
/// not on a BPF filesystem). Every flow is established by one packet.
fn engine_with_flows(
    flows: u32,
    shared: bool,
) -> (Engine, Neighbours, Option<(Steering, tempfile::TempDir)>) {
    let template = udp(CLIENT, 1, VIP, 53, 22);
    let mut buf = template.clone();
    let (mut e, nb, st) = if shared {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (st, regions, _) = Steering::load(dir.path(), flows as usize, 1, false)
            .expect("loading the steering program (run as root)");
        let cfg = EngineConfig {
            flow_capacity: flows as usize,
            ..Default::default()
        };
        let now = juneau_dataplane::region::monotonic_ms();
        let (tables, _) = FlowTable::open_group(regions, 1, cfg.timeouts, cfg.hash_seed, now);
        let e = Engine::with_flows(cfg, tables.into_iter().next().expect("a table"));
        let (e, nb) = setup_engine(e);
        (e, nb, Some((st, dir)))
    } else {
        let (e, nb) = setup(true, flows as usize);
        (e, nb, None)
    };
    let now = juneau_dataplane::region::monotonic_ms();
    for k in 0..flows {
        flow_frame(&template, &mut buf, k);
        e.process(&mut buf, Side::Uplink, &nb, now);
    }
    assert_eq!(
        e.flows().len(),
        flows as usize,
        "every flow established (drops: {:?})",
        e.counters().drops
    );
    (e, nb, st)
}

fn forward_flows(n: usize) {
    let flows = env_flows();
    let shared = std::env::var("SHARED").is_ok();
    let (mut e, nb, _st) = engine_with_flows(flows, shared);
    let template = udp(CLIENT, 1, VIP, 53, 22);
    let warm = std::env::var("WARM").is_ok();
    let mut batch: Vec<Vec<u8>> = vec![template.clone(); 64];
    let mut hashes = [0u32; 64];
    let now = juneau_dataplane::region::monotonic_ms();
    let t = std::time::Instant::now();
    let mut k: u64 = 0;
    for _ in 0..n / 64 {
        for b in batch.iter_mut() {
            k = (k + 0x9e37_79b9) % u64::from(flows);
            flow_frame(&template, b, k as u32);
        }
        if warm {
            for (h, b) in hashes.iter_mut().zip(&batch) {
                *h = e.flow_hash(b);
            }
            black_box(e.warm(&hashes));
        }
        for b in batch.iter_mut() {
            black_box(e.process(b, Side::Uplink, &nb, now));
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!(
        "{flows} flows, warm={warm}, shared={shared}: {ns:.0} ns/packet (forward, established, batches of 64)"
    );
}

fn xdp_flows(n: usize, fast_path: bool) {
    const XDP_REDIRECT: u32 = 4;
    // Without the fast path the program hands the packet to userspace: in a test run
    // no socket is in the slot, so it drops it as `no_socket` (what it costs is the
    // same up to the last helper call).
    const XDP_DROP: u32 = 1;
    let flows = env_flows();
    let (mut e, mut nb, st) = engine_with_flows(flows, true);
    let (mut st, _dir) = st.expect("a shared table");
    st.configure_test_uplink()
        .expect("configuring lo as the uplink");
    st.sync(e.services()).expect("programming the frontends");
    if fast_path {
        e.set_xdp_fast_path(st.take_fast_parts(1).remove(0));
        nb.set_xdp_frame_targets(vec![2]);
        e.refresh_xdp(&nb);
    }
    let template = udp(CLIENT, 1, VIP, 53, 22);
    let mut buf = template.clone();
    let hot = std::env::var("HOT").is_ok();
    let mut sum = 0u128;
    let mut k: u64 = 0;
    for _ in 0..n {
        if !hot {
            k = (k + 0x9e37_79b9) % u64::from(flows);
        }
        flow_frame(&template, &mut buf, k as u32);
        let (action, d) = st.test_run_timed(&buf, 1, 1).expect("test run");
        let want = if fast_path { XDP_REDIRECT } else { XDP_DROP };
        assert_eq!(
            action, want,
            "fast path forwards / default path to userspace"
        );
        sum += d.as_nanos();
    }
    let total = sum as f64 / n as f64;
    let path = if fast_path {
        "XDP fast path"
    } else {
        "default path, to userspace"
    };
    println!("{flows} flows, hot={hot}: {total:.0} ns/run ({path}, forward, established)");
}
