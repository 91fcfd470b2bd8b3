//! The whole userspace cost per packet: the real `juneau-dataplane` binary — its
//! forwarding loop with the engine inside (RX/fill/TX/completion rings, frame pool,
//! batching, the `sendto` kicks, stats, heartbeat) — run under
//! `valgrind --tool=callgrind` on the benchmark topology with real AF_XDP sockets, fed by
//! the generator (`gen.rs`). Around each measured window the counters are zeroed and
//! dumped through `callgrind_control` (vgdb); packets come from the dataplane's own
//! `rx_packets`. Instructions that run whether packets come or not (idle wake-ups,
//! the once-a-second stats, the heartbeat) are measured in a window without traffic and
//! subtracted per second of window (the gross figure is kept beside it).
//!
//! Under callgrind the loop runs ~50x slower than natively, so at the offered rate its
//! RX batches are full (64 frames): this is the loop's cost per packet at saturation,
//! the case the throughput rows measure. Instruction counts, not time: a kernel's copy
//! into the RX ring and the cache misses of a big flow table are not in them (the
//! throughput rows' cycles/packet are).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::harness::{self, Active, Gen, GenSpec};
pub use crate::loopcost_data::{LoopCase, LoopCost};
use crate::plan::{self, Plan, Scenario};
use crate::topology::*;

/// What the measurement sends.
pub struct LoopCostPlan {
    /// Packets per measured window.
    pub packets: u32,
    /// Flow counts of the established-forward case (1 000 and 1 M in `run`).
    pub flows: Vec<u32>,
    /// Offered rate of a window, packets/s (above what the loop does under callgrind).
    pub rate: u64,
}

/// Time the measurement adds (estimate, without 1 M flows).
pub const EXPECTED: Duration = Duration::from_secs(90);

struct Callgrind {
    pid: u32,
    out: PathBuf,
    dumps: u32,
}

impl Callgrind {
    fn control(&self, flag: &str) -> Result<()> {
        let out = Command::new("callgrind_control")
            .arg(flag)
            .arg(self.pid.to_string())
            .output()
            .context("running callgrind_control (valgrind)")?;
        if !out.status.success() || !String::from_utf8_lossy(&out.stdout).contains("OK") {
            bail!(
                "callgrind_control {flag} {}: {} {}",
                self.pid,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    fn zero(&self) -> Result<()> {
        self.control("-z")
    }

    /// Dumps and returns the instructions since the last zero.
    fn dump(&mut self) -> Result<u64> {
        self.control("-d")?;
        self.dumps += 1;
        let file = PathBuf::from(format!("{}.{}", self.out.display(), self.dumps));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(text) = std::fs::read_to_string(&file) {
                if let Some(ir) = text.lines().find_map(|l| {
                    l.strip_prefix("summary:")
                        .or_else(|| l.strip_prefix("totals:"))
                        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                }) {
                    let _ = std::fs::remove_file(&file);
                    return Ok(ir);
                }
            }
            if Instant::now() > deadline {
                bail!("callgrind dump {} did not appear", file.display());
            }
            plan::sleep(Duration::from_millis(100))?;
        }
    }
}

fn stats(path: &Path) -> Result<(u64, u64)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    Ok((
        v["rx_packets"].as_u64().context("rx_packets")?,
        v["flows"].as_u64().unwrap_or(0),
    ))
}

/// Waits until the dataplane's `rx_packets` stops changing (its stats file is rewritten
/// about once a second), returns (rx_packets, flows).
fn settle(path: &Path) -> Result<(u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(180);
    // The first stats file comes a second or more after start-up (under callgrind).
    let mut last = loop {
        match stats(path) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => plan::sleep(Duration::from_millis(250))?,
        }
    };
    let mut since = Instant::now();
    loop {
        plan::sleep(Duration::from_millis(250))?;
        let now = stats(path)?;
        if now.0 != last.0 {
            last = now;
            since = Instant::now();
        } else if since.elapsed() > Duration::from_millis(2500) {
            return Ok(now);
        }
        if Instant::now() > deadline {
            bail!("the dataplane's rx_packets did not settle");
        }
    }
}

/// Sends `n` packets over `flows` flows as `spec` says and waits until the dataplane has
/// taken them all in.
fn send(spec: &GenSpec<'_>, flows: u32, rate: u64, n: u64, stats_file: &Path) -> Result<()> {
    let secs = n as f64 / rate as f64 + 2.0;
    let g = Gen::spawn(spec, flows, rate, Duration::from_secs_f64(secs), n)?;
    g.finish()?;
    settle(stats_file)?;
    Ok(())
}

/// Measures every case; an error ends the measurement (reported as its status).
pub fn measure(plan: &Plan, lp: &LoopCostPlan, say: &dyn Fn(String)) -> LoopCost {
    match run(plan, lp, say) {
        Ok(c) => c,
        Err(e) => LoopCost {
            status: format!("Not measured: {e:#}"),
            ..Default::default()
        },
    }
}

fn run(plan: &Plan, lp: &LoopCostPlan, say: &dyn Fn(String)) -> Result<LoopCost> {
    if !plan.dataplane.exists() {
        bail!("no dataplane binary at {}", plan.dataplane.display());
    }
    let out = plan
        .out_dir
        .join(format!("loop-callgrind-{}.out", std::process::id()));
    let mut p = plan.clone();
    p.dataplane_wrapper = vec![
        "valgrind".into(),
        "--tool=callgrind".into(),
        "--vgdb=yes".into(),
        format!("--callgrind-out-file={}", out.display()),
    ];
    // Idle: sleep in poll(2) at once (no spinning between windows to subtract). A flow
    // table no bigger than the cases need (filling a 1 Mi-flow table under callgrind
    // takes long in a debug build).
    let need = lp.flows.iter().copied().max().unwrap_or(0).max(lp.packets) as usize;
    let capacity = (2 * need).next_power_of_two().clamp(65_536, 1 << 20);
    p.dataplane_args = vec![
        "--busy-poll-us".into(),
        "0".into(),
        "--flow-capacity".into(),
        capacity.to_string(),
        // Warming 1 M flows under callgrind takes about a minute: no flow may expire
        // before its window (the default UDP timeout is 60 s).
        "--udp-timeout".into(),
        "900".into(),
    ];
    let t = Topology::build()?;
    let tag = format!("loop-cost-{}", std::process::id());
    let stats_file = p.out_dir.join(format!("juneau-dataplane-stats-{tag}.json"));
    // The default path: every packet through userspace. (With the opt-in fast path the
    // established flows' packets never reach it: "the dataplane received nothing".)
    let mut a = harness::setup(&t, Scenario::Juneau, &p, &tag)?;
    // Replies reach the client's kernel, which has no socket on their ports: keep its
    // ICMP errors from coming back through the dataplane into the counts.
    t.client.exec(&[
        "nft",
        "add table ip jlc; add chain ip jlc out { type filter hook output priority 0; }; add rule ip jlc out icmp type destination-unreachable drop",
    ])?;
    say("loop cost: juneau-dataplane under callgrind, waiting for it to forward".into());
    harness::wait_until_delivering(&t, &mut a, Duration::from_secs(180))?;
    let pid = a.path.forwarder.as_ref().context("no dataplane")?.id();
    let mut cg = Callgrind {
        pid,
        out: out.clone(),
        dumps: 0,
    };
    let result = cases(&t, &mut a, &mut cg, lp, &stats_file, say);
    let _ = std::fs::remove_file(&out);
    for k in 1..=cg.dumps + 1 {
        let _ = std::fs::remove_file(format!("{}.{k}", out.display()));
    }
    let mut c = result?;
    c.status = format!(
        "Whole process (forwarding loop + engine + stats/heartbeat), release binary {} under callgrind with real AF_XDP \
         sockets on the benchmark topology; {} packets per window offered at {} pps (full 64-frame batches under callgrind); \
         idle instructions ({:.0}/s: poll wake-ups, stats, heartbeat) subtracted per second of window.",
        plan.dataplane.display(),
        lp.packets,
        lp.rate,
        c.idle_instructions_per_s
    );
    Ok(c)
}

fn window(
    cg: &mut Callgrind,
    stats_file: &Path,
    idle_per_s: f64,
    name: String,
    flows: u32,
    send_it: &dyn Fn() -> Result<()>,
) -> Result<LoopCase> {
    let (rx0, _) = settle(stats_file)?;
    cg.zero()?;
    let t0 = Instant::now();
    send_it()?;
    let ir = cg.dump()?;
    let secs = t0.elapsed().as_secs_f64();
    let (rx1, _) = stats(stats_file)?;
    let packets = rx1.saturating_sub(rx0);
    if packets == 0 {
        bail!("{name}: the dataplane received nothing");
    }
    let idle = (idle_per_s * secs) as u64;
    Ok(LoopCase {
        name,
        flows,
        packets,
        instructions: ir,
        idle_instructions: idle,
        instructions_per_packet: ir.saturating_sub(idle) as f64 / packets as f64,
        gross_instructions_per_packet: ir as f64 / packets as f64,
    })
}

fn cases(
    t: &Topology,
    a: &mut Active,
    cg: &mut Callgrind,
    lp: &LoopCostPlan,
    stats_file: &Path,
    say: &dyn Fn(String),
) -> Result<LoopCost> {
    let n = u64::from(lp.packets);
    settle(stats_file)?;
    cg.zero()?;
    let t0 = Instant::now();
    plan::sleep(Duration::from_secs(3))?;
    let idle_ir = cg.dump()?;
    let idle_per_s = idle_ir as f64 / t0.elapsed().as_secs_f64();
    let mut c = LoopCost {
        idle_instructions_per_s: idle_per_s,
        ..Default::default()
    };
    let fwd = GenSpec::forward(t, (VIP.into(), LOAD_PORT));
    let report = |k: &LoopCase| {
        say(format!(
            "loop cost: {}: {:.0} instructions/packet ({} packets; gross {:.0})",
            k.name, k.instructions_per_packet, k.packets, k.gross_instructions_per_packet
        ))
    };
    // New flows: every packet of the window opens a flow (the 16 flows of the readiness
    // probe excepted).
    let k = window(
        cg,
        stats_file,
        idle_per_s,
        "forward, new flow (UDP)".into(),
        0,
        &|| send(&fwd, 1 << 22, lp.rate, n, stats_file),
    )?;
    report(&k);
    c.cases.push(k);
    for &flows in &lp.flows {
        // Every flow seen before the window (slow enough that the loop takes each one).
        let warm_rate = 2_000u64.max(u64::from(flows) / 60);
        for _ in 0..3 {
            send(&fwd, flows, warm_rate, u64::from(flows), stats_file)?;
            if stats(stats_file)?.1 >= u64::from(flows) {
                break;
            }
        }
        a.check_forwarder()?;
        let k = window(
            cg,
            stats_file,
            idle_per_s,
            format!("forward, established flow ({flows} flows)"),
            flows,
            &|| send(&fwd, flows, lp.rate, n, stats_file),
        )?;
        report(&k);
        c.cases.push(k);
    }
    // Replies of the backend with partial checksums (as a Pod's kernel with tx offload
    // on hands them over), to the clients of the smallest flow set's flows.
    let flows = lp.flows.iter().copied().min().unwrap_or(1000);
    let reply = GenSpec {
        ns: &t.backend,
        iface: &t.b_if,
        src_mac: t.b_mac,
        dst_mac: t.nb_mac,
        dst: (CLIENT_IP.into(), 10_000),
        extra: vec![
            "--reply-from".into(),
            format!("{BACKEND_IP}:{BACKEND_LOAD_PORT}"),
            "--partial-checksum".into(),
        ],
        nice: -20,
    };
    send(&fwd, flows, 2_000, u64::from(flows), stats_file)?;
    let k = window(
        cg,
        stats_file,
        idle_per_s,
        format!("reply, partial checksum ({flows} flows)"),
        flows,
        &|| send(&reply, flows, lp.rate, n, stats_file),
    )?;
    report(&k);
    c.cases.push(k);
    a.check_forwarder()?;
    Ok(c)
}
