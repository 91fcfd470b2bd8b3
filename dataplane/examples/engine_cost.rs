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

use std::hint::black_box;

use juneau_dataplane::engine::Verdict;
use juneau_dataplane::neigh::Side;
use juneau_dataplane::packet::{self, Parsed};

#[path = "../benches/common/mod.rs"]
mod common;
use common::{setup, udp, B, CLIENT, VIP};

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
        "forward-flows" => {
            // FLOWS established flows (default 1 Mi), visited in a scrambled order; prints
            // wall-clock ns/packet (cache misses matter here, instruction counts do not).
            let flows: u32 = std::env::var("FLOWS")
                .ok()
                .and_then(|p| p.parse().ok())
                .unwrap_or(1 << 20);
            let (mut e, nb) = setup(true, flows as usize);
            // Frames are written into one buffer from a template (source address and port
            // per flow; checksums are not fixed up, which costs the engine nothing extra),
            // so only the engine's own memory accesses are measured.
            let template = udp(CLIENT, 1, VIP, 53, 22);
            let fill = |buf: &mut Vec<u8>, k: u32| {
                buf.copy_from_slice(&template);
                buf[26..30].copy_from_slice(&(0x0a00_0000 | (k >> 14)).to_be_bytes());
                buf[34..36].copy_from_slice(&(1024 + (k & 0x3fff) as u16).to_be_bytes());
            };
            for k in 0..flows {
                fill(&mut buf, k);
                e.process(&mut buf, Side::Uplink, &nb, 0);
            }
            assert_eq!(e.flows().len(), flows as usize);
            let warm = std::env::var("WARM").is_ok();
            let mut batch: Vec<Vec<u8>> = vec![template.clone(); 64];
            let mut hashes = [0u32; 64];
            let t = std::time::Instant::now();
            let mut k: u64 = 0;
            for _ in 0..n / 64 {
                for b in batch.iter_mut() {
                    k = (k + 0x9e37_79b9) % u64::from(flows);
                    fill(b, k as u32);
                }
                if warm {
                    for (h, b) in hashes.iter_mut().zip(&batch) {
                        *h = e.flow_hash(b);
                    }
                    black_box(e.warm(&hashes));
                }
                for b in batch.iter_mut() {
                    black_box(e.process(b, Side::Uplink, &nb, 1));
                }
            }
            let ns = t.elapsed().as_nanos() as f64 / n as f64;
            println!("{flows} flows, warm={warm}: {ns:.0} ns/packet (forward, established, batches of 64)");
        }
        other => panic!("unknown scenario {other}"),
    }
}
