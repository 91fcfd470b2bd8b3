//! `juneau-dataplane`: the node's AF_XDP load-balancing dataplane.
//!
//! ```text
//! juneau-dataplane --uplink IF --pod-iface IF [--pod-iface IF ...] --state-file PATH
//!                  [--stats-file PATH] [--metrics-addr ADDR] [tuning options]
//! ```
//! See `docs/dataplane.md` for every option and the stats file format.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use juneau_dataplane::engine::EngineConfig;
use juneau_dataplane::flow::Timeouts;
use juneau_dataplane::runtime::{run, RuntimeConfig};

/// DNAT VIP traffic from the uplink to local backend Pods (no SNAT) and reverse-NAT the
/// replies, with AF_XDP.
#[derive(Debug, Parser)]
#[command(name = "juneau-dataplane", version)]
struct Args {
    /// The node's uplink interface (where VIP traffic arrives).
    #[arg(long, value_name = "IF")]
    uplink: String,
    /// A Pod-facing interface: a bridge the Pods are plugged into, or the node end of a
    /// Pod's veth; repeat for each. Without any, --pod-ifaces-from-routes is implied.
    #[arg(long = "pod-iface", value_name = "IF")]
    pod_ifaces: Vec<String>,
    /// Also serve the interface the kernel routes each backend out of (per-Pod veths of
    /// Calico-style CNIs), attaching and detaching as they appear and disappear. The
    /// default when no --pod-iface is given.
    #[arg(long)]
    pod_ifaces_from_routes: bool,
    /// Most AF_XDP sockets on discovered Pod interfaces at once (one per RX queue).
    #[arg(long, default_value_t = 64)]
    max_pod_sockets: u32,
    /// UMEM frames (4 KiB each) reserved per socket on a discovered Pod interface.
    #[arg(long, default_value_t = 256)]
    pod_iface_frames: u32,
    /// The node-state file the node agent publishes (juneau_control::shm).
    #[arg(long, value_name = "PATH")]
    state_file: PathBuf,
    /// The dataplane status juneau-bgp reads before announcing a VIP (heartbeat,
    /// programmed VIPs); default: the state file with extension `.dataplane`.
    #[arg(long, value_name = "PATH")]
    status_file: Option<PathBuf>,
    /// Write counters as JSON to this file about once a second (atomically, by rename).
    #[arg(long, value_name = "PATH")]
    stats_file: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Flow table capacity (flows); memory is ~68 bytes per flow, allocated at start.
    #[arg(long, default_value_t = 1 << 20)]
    flow_capacity: usize,
    /// TCP timeout after an unanswered SYN, seconds.
    #[arg(long, default_value_t = 30)]
    tcp_syn_timeout: u32,
    /// TCP established-connection idle timeout, seconds.
    #[arg(long, default_value_t = 900)]
    tcp_established_timeout: u32,
    /// TCP timeout after a FIN, seconds.
    #[arg(long, default_value_t = 30)]
    tcp_fin_timeout: u32,
    /// TCP timeout after a RST, seconds.
    #[arg(long, default_value_t = 10)]
    tcp_rst_timeout: u32,
    /// UDP idle timeout, seconds.
    #[arg(long, default_value_t = 60)]
    udp_timeout: u32,
    /// Keep busy-polling this many microseconds after the last packet before sleeping
    /// (any steady traffic keeps the loop spinning; a quiet node sleeps).
    #[arg(long, default_value_t = 10_000)]
    busy_poll_us: u64,
    /// Longest sleep in poll(2) while idle, milliseconds (a packet wakes it at once).
    #[arg(long, default_value_t = 10)]
    idle_sleep_ms: i32,
    /// UMEM frames (4 KiB each) per interface.
    #[arg(long, default_value_t = 4096)]
    frames_per_iface: u32,
    /// Size of each AF_XDP ring (power of two).
    #[arg(long, default_value_t = 2048)]
    ring_size: u32,
    /// Attach XDP in generic (skb) mode instead of native.
    #[arg(long)]
    generic_xdp: bool,
    /// Bind AF_XDP sockets in zero-copy mode (NICs that support it; not veth).
    #[arg(long)]
    zero_copy: bool,
    /// Re-probe stale kernel neighbour entries of Pods and gateways this often, seconds
    /// (AF_XDP traffic never confirms them, so they would age out).
    #[arg(long, default_value_t = 30)]
    neighbour_keepalive: u64,
    /// Trust L4 checksums of Pod replies and update them incrementally instead of
    /// recomputing them (only if no Pod interface uses tx checksum offload).
    #[arg(long)]
    trust_pod_checksums: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let a = Args::parse();
    let ms = |s: u32| s.saturating_mul(1000);
    let seed = {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(std::process::id().into());
        h.finish()
    };
    let from_routes = a.pod_ifaces_from_routes || a.pod_ifaces.is_empty();
    let cfg = RuntimeConfig {
        pod_ifaces_from_routes: from_routes,
        max_pod_sockets: a.max_pod_sockets,
        pod_iface_frames: a.pod_iface_frames,
        uplink: a.uplink,
        pod_ifaces: a.pod_ifaces,
        status_file: a.status_file.unwrap_or_else(|| {
            juneau_control::dataplane_status::path_for_state_file(&a.state_file)
        }),
        state_file: a.state_file,
        stats_file: a.stats_file,
        metrics_addr: a.metrics_addr,
        engine: EngineConfig {
            flow_capacity: a.flow_capacity,
            timeouts: Timeouts {
                tcp_syn_ms: ms(a.tcp_syn_timeout),
                tcp_established_ms: ms(a.tcp_established_timeout),
                tcp_fin_ms: ms(a.tcp_fin_timeout),
                tcp_rst_ms: ms(a.tcp_rst_timeout),
                udp_ms: ms(a.udp_timeout),
            },
            recompute_pod_checksums: !a.trust_pod_checksums,
            hash_seed: seed,
        },
        frames_per_iface: a.frames_per_iface,
        ring_size: a.ring_size,
        busy_poll_us: a.busy_poll_us,
        idle_sleep_ms: a.idle_sleep_ms,
        generic_xdp: a.generic_xdp,
        zero_copy: a.zero_copy,
        neighbour_keepalive_s: a.neighbour_keepalive,
    };
    run(cfg)
}
