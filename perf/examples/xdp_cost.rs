//! The XDP DNAT baseline's forward program, per packet, run by the kernel with
//! `BPF_PROG_TEST_RUN` one packet per run, over FLOWS established flows (default 1 000)
//! visited in a scrambled order — the same method as the steering program's figure
//! (`dataplane/examples/engine_cost.rs xdp-flows`), so the two programs compare without
//! the rest of the path (veths, NAPI, the sink). `HOT=1` sends flow 0's packet every time.
//! It also prints the same runs of `xdp_pass` (a program that does nothing): the test
//! run's own cost (frame set-up, clock reads), to subtract from both. Needs root.
//!
//! ```text
//! cargo build --release -p juneau-perf --example xdp_cost
//! FLOWS=1000 target/release/examples/xdp_cost 2000000
//! FLOWS=1000 target/release/examples/engine_cost xdp-flows 2000000   # juneau, same runs
//! ```

use std::net::Ipv4Addr;

use anyhow::{bail, Context, Result};
use juneau_perf::bpf::{DnatConfig, TestRunProgram};
use juneau_perf::packet::{flow, write_frame, Template, FRAME_LEN};

const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 5);
const CLIENTS: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 0);

fn main() -> Result<()> {
    let n: u32 = std::env::args()
        .nth(1)
        .map(|a| a.parse().context("the number of runs"))
        .transpose()?
        .unwrap_or(1_000_000);
    let flows: u32 = std::env::var("FLOWS")
        .ok()
        .map(|v| v.parse().context("FLOWS"))
        .transpose()?
        .unwrap_or(1000);
    if flows == 0 {
        bail!("FLOWS must be at least 1");
    }
    let hot = std::env::var("HOT").is_ok();
    let prog = TestRunProgram::xdp_dnat(&DnatConfig {
        client_iface: "lo".into(),
        backend_iface: "lo".into(),
        node_client_mac: [2, 0, 0, 0, 0, 1],
        client_mac: [2, 0, 0, 0, 0, 2],
        node_backend_mac: [2, 0, 0, 0, 0, 3],
        backend_mac: [2, 0, 0, 0, 0, 4],
        services: vec![((VIP, 53), (BACKEND, 8053))],
    })
    .context("loading xdp_dnat (run as root)")?;
    let template = Template {
        src_mac: [2, 0, 0, 0, 0, 2],
        dst_mac: [2, 0, 0, 0, 0, 1],
        dst_ip: VIP,
        dst_port: 53,
    };
    let pass = TestRunProgram::pass().context("loading xdp_pass")?;
    let mut buf = [0u8; FRAME_LEN];
    // Every flow's first packet inserts it into the program's flow table.
    for k in 0..flows {
        write_frame(&mut buf, &template, flow(CLIENTS, k));
        prog.run(&buf)?;
    }
    // The mean time per run of `p` over `n` runs (flows scrambled unless HOT), checking
    // every run's action.
    let mut mean = |p: &TestRunProgram, want: u32, runs: u32| -> Result<f64> {
        let (mut sum, mut k) = (0u128, 0u64);
        for _ in 0..runs {
            if !hot {
                k = (k + 0x9e37_79b9) % u64::from(flows);
            }
            write_frame(&mut buf, &template, flow(CLIENTS, k as u32));
            let (action, took) = p.run(&buf)?;
            if action != want {
                bail!("flow {k}: action {action}, want {want}");
            }
            sum += took.as_nanos();
        }
        Ok(sum as f64 / f64::from(runs))
    };
    let dnat = mean(&prog, XDP_REDIRECT, n)?;
    let base = mean(&pass, XDP_PASS, n)?;
    println!(
        "{flows} flows, hot={hot}: {dnat:.0} ns/run (xdp-dnat forward, established), \
         {base:.0} ns/run (xdp_pass)"
    );
    Ok(())
}
