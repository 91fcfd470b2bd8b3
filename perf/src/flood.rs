//! Floods at generator rate against a node serving real traffic (docs/security.md,
//! "Floods at generator rate"): the generator (`gen.rs`) sends one kind of hostile
//! packet — random-source SYNs, ACKs of no connection, UDP datagrams, first fragments,
//! UDP to the redirect channel's port from nodes that are no peer — as fast as its core
//! allows, from a million source address and port pairs, while a real TCP client in the client namespace keeps one connection reading through the VIP
//! and opens new ones one after the other. A row says what the flood offered, what the
//! legitimate traffic got (every new connection served? the kept-alive one never cut,
//! its longest pause), how full the flow table got and where the dataplane put the
//! flood's packets (its drop reasons).
//!
//! The generator runs at normal priority on the endpoints' core; the legitimate client
//! and server threads at nice -20 (they stand for other machines: the flood must not
//! win by starving them of CPU), the dataplane on the path core as in every run.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::bulk::{self, Pattern, Server};
use crate::harness::{self, Gen, GenSpec};
use crate::packet::FrameKind;
use crate::plan::{self, Plan, Scenario};
use crate::topology::{
    Ends, Topology, BACKEND_BULK_PORT, BULK_PORT, LOAD_PORT, NODE_CLIENT_IP, VIP,
};

/// A redirect peer the node is given in the `redirect-port` flood (no such node exists:
/// the flood is about packets from strangers, and new connections start with a SYN the
/// node serves itself).
const FLOOD_REDIRECT_PEER: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 3);

/// What a flood sends, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FloodKind {
    /// Random-source TCP SYNs to the TCP service.
    Syn,
    /// TCP ACKs of no connection to the TCP service.
    Ack,
    /// UDP datagrams to the UDP service.
    Udp,
    /// First fragments (more fragments set) to the UDP service.
    Fragment,
    /// UDP datagrams to the node's redirect address and port (7411) from random
    /// sources, none of them a peer node: forged questions and notices from outside.
    RedirectPort,
}

impl FloodKind {
    /// Its name in the rows and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FloodKind::Syn => "syn",
            FloodKind::Ack => "ack",
            FloodKind::Udp => "udp",
            FloodKind::Fragment => "fragment",
            FloodKind::RedirectPort => "redirect-port",
        }
    }

    /// The frames the generator sends.
    pub fn frame(self) -> FrameKind {
        match self {
            FloodKind::Syn => FrameKind::Syn,
            FloodKind::Ack => FrameKind::Ack,
            FloodKind::Udp | FloodKind::RedirectPort => FrameKind::Udp,
            FloodKind::Fragment => FrameKind::Fragment,
        }
    }

    /// The flood's destination.
    fn target(self) -> (Ipv4Addr, u16) {
        match self {
            FloodKind::Syn | FloodKind::Ack => (VIP, BULK_PORT),
            FloodKind::Udp | FloodKind::Fragment => (VIP, LOAD_PORT),
            FloodKind::RedirectPort => (NODE_CLIENT_IP, juneau_dataplane::redirect::DEFAULT_PORT),
        }
    }

    /// Dataplane arguments the flood needs: redirects on for `redirect-port`.
    fn dataplane_args(self) -> Vec<String> {
        match self {
            FloodKind::RedirectPort => vec![
                "--node-address".into(),
                NODE_CLIENT_IP.to_string(),
                "--redirect-peer".into(),
                FLOOD_REDIRECT_PEER.to_string(),
            ],
            _ => Vec::new(),
        }
    }
}

/// Source address and port pairs of a flood (a /18 of addresses, 64 ports each).
pub const FLOOD_FLOWS: u32 = 1 << 20;
/// Bytes each new legitimate connection downloads.
const NEW_CONNECTION_BYTES: u64 = 64 << 10;
/// Longest a read or write on a new legitimate connection may wait before it counts as
/// failed: as long as the kept-alive connection's ([`KEPT_ALIVE_TIMEOUT`], the same
/// reasoning: segments the kernel drops before XDP come back after TCP's backed-off
/// retransmissions, up to ~3 s after the flood). It was 3 s when one connection of 29
/// failed once in CI (connect or read: not printed then) during a 3.8 Mpps flood whose
/// kernel dropped 4.6 M packets before XDP.
const LEGIT_TIMEOUT: Duration = KEPT_ALIVE_TIMEOUT;
/// Longest a legitimate connect may take before it counts as failed: long enough for
/// the SYN's retransmissions after 1 and 3 s (a client's kernel retries for two minutes),
/// since a flood far beyond the receive queue's capacity makes the kernel drop packets
/// before XDP at random, a legitimate SYN among them (`interface_rx_dropped`, reported
/// beside): a connection the dataplane refuses or loses still fails, one the kernel
/// dropped a SYN of is served on a retry.
const LEGIT_CONNECT_TIMEOUT: Duration = Duration::from_secs(8);
/// Longest the kept-alive connection may wait for its next bytes before it counts as
/// cut: the same reasoning as for a connect. Under a flood that overflows the receive
/// queue, the kernel drops its segments before XDP at random; TCP's retransmission timer
/// backs off (0.2, 0.4, 0.8, 1.6, 3.2 s), so a connection that lost a few in a row
/// resumes up to ~3 s after the flood ends. A pause is reported (longest pause); a
/// connection the dataplane drops or resets stays cut.
const KEPT_ALIVE_TIMEOUT: Duration = Duration::from_secs(8);
/// How fast the kept-alive connection reads (bytes per 10 ms): a steady stream, far
/// below what the path carries, so that a pause is the flood's doing.
const KEPT_ALIVE_READ: usize = 16 << 10;

/// One flood and what the legitimate traffic got meanwhile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FloodRow {
    /// `none` (the baseline without a flood), or the frame kind.
    pub flood: String,
    /// Where the flood went.
    pub target: String,
    /// Frames the generator sent, per second of its run.
    pub offered_pps: f64,
    /// Seconds the flood lasted.
    pub seconds: f64,
    /// New legitimate connections opened during the flood, and those that failed
    /// (connect, a short or altered body, a timeout).
    pub new_connections: u64,
    /// Of them, failed.
    pub new_connections_failed: u64,
    /// The first failures, with why.
    pub failure_samples: Vec<String>,
    /// Bytes the kept-alive connection read during the flood (each checked).
    pub kept_alive_bytes: u64,
    /// Whether it carried on to the end (no error, no timeout, no wrong byte).
    pub kept_alive_ok: bool,
    /// Its longest pause between two reads, ms.
    pub kept_alive_longest_pause_ms: u64,
    /// The most flows the dataplane held (its stats, about once a second), and its
    /// capacity.
    pub flows_max: u64,
    /// The flow table's capacity.
    pub flow_capacity: u64,
    /// Packets the dataplane received during the flood.
    pub rx_packets: u64,
    /// Its drops during the flood, by reason (non-zero only).
    pub drops: serde_json::Map<String, serde_json::Value>,
    /// Frames the kernel dropped on receive on the node's interfaces during the flood,
    /// before the steering program ran (the dataplane's `interface_rx_dropped`).
    #[serde(default)]
    pub kernel_rx_dropped: u64,
}

impl FloodRow {
    /// Every legitimate connection served, the kept-alive one never cut, the table
    /// never full.
    pub fn held(&self) -> bool {
        self.new_connections > 0
            && self.new_connections_failed == 0
            && self.kept_alive_ok
            && self.drops.get("flow_table_full").is_none()
    }
}

/// The floods of a run, each on a fresh topology and dataplane, after a baseline
/// without one.
pub fn run(plan: &Plan, kinds: &[FloodKind], seconds: Duration) -> Result<Vec<FloodRow>> {
    let mut rows = Vec::new();
    for kind in std::iter::once(None).chain(kinds.iter().copied().map(Some)) {
        plan::check_interrupt()?;
        let name = kind.map_or("none", FloodKind::name);
        eprintln!("==> flood {name} ({} s)", seconds.as_secs_f64());
        let row = run_one(plan, kind, seconds).with_context(|| format!("flood {name}"))?;
        eprintln!(
            "    offered {:.0} pps; new connections {} ({} failed); kept-alive {} ({} MiB, longest pause {} ms); flows max {} of {}; drops {:?}; kernel drops before XDP {}",
            row.offered_pps,
            row.new_connections,
            row.new_connections_failed,
            if row.kept_alive_ok { "carried on" } else { "CUT" },
            row.kept_alive_bytes >> 20,
            row.kept_alive_longest_pause_ms,
            row.flows_max,
            row.flow_capacity,
            row.drops,
            row.kernel_rx_dropped
        );
        for f in &row.failure_samples {
            eprintln!("    failed: {f}");
        }
        rows.push(row);
    }
    Ok(rows)
}

fn run_one(plan: &Plan, kind: Option<FloodKind>, seconds: Duration) -> Result<FloodRow> {
    let (ecpu, pcpu) = harness::cpus();
    let t = Topology::build_for(Ends::Bulk {
        endpoint_cpu: ecpu,
        path_cpu: pcpu,
    })?;
    let name = kind.map_or("none", FloodKind::name);
    let tag = format!("flood-{name}-{}", std::process::id());
    let mut plan = plan.clone();
    plan.dataplane_args
        .extend(kind.map(FloodKind::dataplane_args).unwrap_or_default());
    let mut path = harness::start_path(&t, Scenario::Juneau, &plan, &tag)?;
    let _server = Server::start(
        Some(t.backend.name()),
        SocketAddr::from(([0, 0, 0, 0], BACKEND_BULK_PORT)),
        None,
    )?;
    let vip = SocketAddr::V4(SocketAddrV4::new(VIP, BULK_PORT));
    bulk::wait_until_serving(&t, &mut path, vip, ecpu)?;
    let stats = path
        .stats_file
        .clone()
        .context("the juneau path has a stats file")?;
    let stop = Arc::new(AtomicBool::new(false));
    let kept = spawn_legit(&t, {
        let stop = stop.clone();
        move || kept_alive(vip, &stop)
    })?;
    let fresh = spawn_legit(&t, {
        let stop = stop.clone();
        move || new_connections(vip, &stop)
    })?;
    // The legitimate traffic runs before the flood starts and after it ends; the stats
    // file is written about once a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    let before = loop {
        plan::sleep(Duration::from_millis(250))?;
        match read_stats(&stats) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => {}
        }
    };
    let started = Instant::now();
    let offered = match kind {
        None => {
            plan::sleep(seconds)?;
            None
        }
        Some(k) => {
            let mut spec = GenSpec::forward(&t, {
                let (ip, port) = k.target();
                (ip.into(), port)
            });
            spec.nice = 0;
            spec.extra = vec!["--kind".into(), k.frame().name().into()];
            let g = Gen::spawn(&spec, FLOOD_FLOWS, 0, seconds, u64::MAX)?;
            let mut flows_max = 0;
            while started.elapsed() < seconds {
                plan::sleep(Duration::from_millis(250))?;
                if let Ok(s) = read_stats(&stats) {
                    flows_max = flows_max.max(s["flows"].as_u64().unwrap_or(0));
                }
            }
            Some((g.finish()?, flows_max))
        }
    };
    let seconds_run = started.elapsed().as_secs_f64();
    // Stats are rewritten about once a second: one written after the flood.
    plan::sleep(Duration::from_millis(1200))?;
    let after = read_stats(&stats)?;
    stop.store(true, Ordering::Relaxed);
    let kept = join(kept)?;
    let fresh = join(fresh)?;
    path.check_forwarder()?;
    let (offered_pps, flows_seen) = match &offered {
        Some((g, f)) => (g.sent as f64 / g.elapsed_s.max(1e-9), *f),
        None => (0.0, 0),
    };
    Ok(FloodRow {
        flood: name.to_string(),
        target: kind.map_or_else(String::new, |k| {
            let (ip, port) = k.target();
            format!("{ip}:{port}")
        }),
        offered_pps,
        seconds: seconds_run,
        new_connections: fresh.opened,
        new_connections_failed: fresh.failed,
        failure_samples: fresh.samples.into_iter().chain(kept.samples).collect(),
        kept_alive_bytes: kept.bytes,
        kept_alive_ok: kept.failed == 0,
        kept_alive_longest_pause_ms: kept.longest_pause.as_millis() as u64,
        flows_max: flows_seen.max(after["flows"].as_u64().unwrap_or(0)),
        flow_capacity: after["flow_capacity"].as_u64().unwrap_or(0),
        rx_packets: counter(&after, &["rx_packets"]) - counter(&before, &["rx_packets"]),
        drops: drops_between(&before, &after),
        kernel_rx_dropped: kernel_drops(&after).saturating_sub(kernel_drops(&before)),
    })
}

/// The dataplane's `interface_rx_dropped`, summed over its interfaces.
fn kernel_drops(stats: &serde_json::Value) -> u64 {
    stats["interface_rx_dropped"]
        .as_object()
        .map(|m| m.values().filter_map(serde_json::Value::as_u64).sum())
        .unwrap_or(0)
}

fn read_stats(path: &std::path::Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn counter(v: &serde_json::Value, keys: &[&str]) -> u64 {
    keys.iter()
        .try_fold(v, |v, k| v.get(*k))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// The drop reasons that grew between two stats, and by how much.
fn drops_between(
    before: &serde_json::Value,
    after: &serde_json::Value,
) -> serde_json::Map<String, serde_json::Value> {
    after["drops"]
        .as_object()
        .map(|d| {
            d.iter()
                .filter_map(|(k, v)| {
                    let grew = v.as_u64()?.saturating_sub(counter(before, &["drops", k]));
                    (grew > 0).then(|| (k.clone(), grew.into()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What one legitimate client saw.
#[derive(Debug, Default)]
struct Legit {
    opened: u64,
    failed: u64,
    bytes: u64,
    longest_pause: Duration,
    samples: Vec<String>,
}

impl Legit {
    fn fail(&mut self, at: Instant, what: String) {
        self.failed += 1;
        if self.samples.len() < 8 {
            self.samples
                .push(format!("t={:.3}s {what}", at.elapsed().as_secs_f64()));
        }
    }
}

/// Runs a legitimate client on its own thread in the client namespace, at nice -20.
fn spawn_legit(
    t: &Topology,
    f: impl FnOnce() -> Legit + Send + 'static,
) -> Result<std::thread::JoinHandle<Result<Legit>>> {
    bulk::spawn_in(Some(t.client.name()), move || {
        bulk::pin_here(None);
        f()
    })
}

fn join(h: std::thread::JoinHandle<Result<Legit>>) -> Result<Legit> {
    match h.join() {
        Ok(r) => r,
        Err(_) => bail!("a legitimate client panicked"),
    }
}

/// Asks for `bytes` on a new connection to `vip`.
fn request(vip: SocketAddr, bytes: u64, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut c = TcpStream::connect_timeout(&vip, LEGIT_CONNECT_TIMEOUT)?;
    c.set_read_timeout(Some(timeout))?;
    c.set_write_timeout(Some(timeout))?;
    c.write_all(&bytes.to_le_bytes())?;
    Ok(c)
}

/// New connections one after the other until `stop`, each downloading
/// [`NEW_CONNECTION_BYTES`] and checking them.
fn new_connections(vip: SocketAddr, stop: &AtomicBool) -> Legit {
    let t0 = Instant::now();
    let mut l = Legit::default();
    let mut buf = vec![0u8; NEW_CONNECTION_BYTES as usize];
    while !stop.load(Ordering::Relaxed) {
        l.opened += 1;
        let got = request(vip, NEW_CONNECTION_BYTES, LEGIT_TIMEOUT).and_then(|mut c| {
            c.read_exact(&mut buf)?;
            // The server closes after the body: nothing more.
            let mut extra = [0u8; 1];
            match c.read(&mut extra)? {
                0 => Ok(()),
                _ => Err(std::io::Error::other("a longer body than asked for")),
            }
        });
        match got {
            Ok(()) if Pattern::get().check(0, &buf).is_ok() => {}
            Ok(()) => l.fail(t0, "new connection: altered body".into()),
            Err(e) => l.fail(t0, format!("new connection: {e}")),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    l
}

/// One connection, opened before the flood, reading a steady stream until `stop`.
fn kept_alive(vip: SocketAddr, stop: &AtomicBool) -> Legit {
    let t0 = Instant::now();
    let mut l = Legit {
        opened: 1,
        ..Legit::default()
    };
    let mut c = match request(vip, 1 << 40, KEPT_ALIVE_TIMEOUT) {
        Ok(c) => c,
        Err(e) => {
            l.fail(t0, format!("kept-alive connect: {e}"));
            return l;
        }
    };
    let mut buf = vec![0u8; KEPT_ALIVE_READ];
    let mut last = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let n = match c.read(&mut buf) {
            Ok(0) => {
                l.fail(t0, "kept-alive: closed by the server".into());
                break;
            }
            Ok(n) => n,
            Err(e) => {
                l.longest_pause = l.longest_pause.max(last.elapsed());
                l.fail(t0, format!("kept-alive: {e}"));
                break;
            }
        };
        if let Err(at) = Pattern::get().check(l.bytes, &buf[..n]) {
            l.fail(t0, format!("kept-alive: wrong byte at {at}"));
            break;
        }
        l.bytes += n as u64;
        l.longest_pause = l.longest_pause.max(last.elapsed());
        last = Instant::now();
        std::thread::sleep(Duration::from_millis(10));
    }
    l
}

/// The rows as a Markdown table.
pub fn markdown(rows: &[FloodRow]) -> String {
    let mut s = String::from(
        "| flood | to | offered (pps) | new connections (failed) | kept-alive | longest pause (ms) | flows max / capacity | dataplane drops during the flood | dropped by the kernel before XDP |\n|---|---|---:|---:|---|---:|---:|---|---:|\n",
    );
    for r in rows {
        let drops = if r.drops.is_empty() {
            "none".to_string()
        } else {
            r.drops
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s.push_str(&format!(
            "| {} | {} | {:.0} | {} ({}) | {} | {} | {} / {} | {} | {} |\n",
            r.flood,
            if r.target.is_empty() { "-" } else { &r.target },
            r.offered_pps,
            r.new_connections,
            r.new_connections_failed,
            if r.kept_alive_ok { "carried on" } else { "CUT" },
            r.kept_alive_longest_pause_ms,
            r.flows_max,
            r.flow_capacity,
            drops,
            r.kernel_rx_dropped
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(failed: u64, kept: bool, drops: serde_json::Value) -> FloodRow {
        FloodRow {
            flood: "syn".into(),
            target: "198.19.0.10:9002".into(),
            offered_pps: 1e6,
            seconds: 5.0,
            new_connections: 100,
            new_connections_failed: failed,
            failure_samples: vec![],
            kept_alive_bytes: 1 << 20,
            kept_alive_ok: kept,
            kept_alive_longest_pause_ms: 30,
            flows_max: 10,
            flow_capacity: 1 << 20,
            rx_packets: 5_000_000,
            drops: drops.as_object().cloned().unwrap_or_default(),
            kernel_rx_dropped: 42,
        }
    }

    #[test]
    fn a_flood_held_only_with_every_connection_served_and_room_in_the_table() {
        assert!(row(0, true, serde_json::json!({"half_open_evicted": 3})).held());
        assert!(!row(1, true, serde_json::json!({})).held());
        assert!(!row(0, false, serde_json::json!({})).held());
        assert!(!row(0, true, serde_json::json!({"flow_table_full": 1})).held());
    }

    #[test]
    fn kernel_drops_sum_the_interfaces() {
        let s = serde_json::json!({"interface_rx_dropped": {"up0": 5, "pv0": 2}});
        assert_eq!(kernel_drops(&s), 7);
        assert_eq!(kernel_drops(&serde_json::json!({})), 0);
    }

    #[test]
    fn drops_are_what_grew() {
        let before = serde_json::json!({"drops": {"a": 5, "b": 1}});
        let after = serde_json::json!({"drops": {"a": 5, "b": 4, "c": 2}});
        let d = drops_between(&before, &after);
        assert_eq!(
            serde_json::Value::Object(d),
            serde_json::json!({"b": 3, "c": 2})
        );
    }

    #[test]
    fn the_table_says_cut_and_lists_drops() {
        let md = markdown(&[row(0, false, serde_json::json!({"no_flow": 7}))]);
        assert!(
            md.contains("| syn | 198.19.0.10:9002 | 1000000 | 100 (0) | CUT | 30 |"),
            "{md}"
        );
        assert!(md.contains("no_flow 7 | 42 |"), "{md}");
    }
}
