//! `juneau-dataplane`: the node's AF_XDP load-balancing dataplane.
//!
//! ```text
//! juneau-dataplane --uplink IF [--pod-iface IF ...] --state-file PATH
//!                  [--pin-dir DIR] [--stats-file PATH] [--metrics-addr ADDR] [tuning options]
//! juneau-dataplane --remove-pins --pin-dir DIR     # uninstall: links, maps, flow table
//! juneau-dataplane --probe-ready PATH              # the kubelet's readiness probe
//! ```
//! See `docs/dataplane.md` for every option and the stats file format.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use juneau_dataplane::engine::EngineConfig;
use juneau_dataplane::flow::Timeouts;
use juneau_dataplane::runtime::{self, run, RuntimeConfig};

/// DNAT VIP traffic from the uplink to local backend Pods (no SNAT) and reverse-NAT the
/// replies, with AF_XDP.
#[derive(Debug, Parser)]
#[command(name = "juneau-dataplane", version)]
struct Args {
    /// The node's uplink interface (where VIP traffic arrives).
    #[arg(long, value_name = "IF", required_unless_present_any = ["remove_pins", "probe_ready"])]
    uplink: Option<String>,
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
    #[arg(long, value_name = "PATH", required_unless_present_any = ["remove_pins", "probe_ready"])]
    state_file: Option<PathBuf>,
    /// Where the steering program's maps (including the flow table) and XDP links are
    /// pinned, so flows survive a restart; one directory per dataplane instance.
    /// Default: /sys/fs/bpf/juneau/<state file name without extension>.
    #[arg(long, value_name = "DIR")]
    pin_dir: Option<PathBuf>,
    /// Remove everything pinned under --pin-dir (XDP links: the program is detached from
    /// every interface; maps: the flow table is lost) and exit. Stop the dataplane first.
    #[arg(long, requires = "pin_dir")]
    remove_pins: bool,
    /// The dataplane status juneau-bgp reads before announcing a VIP (heartbeat,
    /// programmed VIPs); default: the state file with extension `.dataplane`.
    #[arg(long, value_name = "PATH")]
    status_file: Option<PathBuf>,
    /// The `nft` binary (nftables) that programs the kernel's DNAT to host-network
    /// backends (docs/dataplane.md, "Host-network backends"); only run when a Service
    /// has some on this node.
    #[arg(long, value_name = "PATH", default_value = "nft")]
    nft: PathBuf,
    /// The node Pod's decommission directory (an emptyDir shared with the node agent):
    /// when the agent's request stands there (helm uninstall), detach the XDP program,
    /// remove the pins and this process's files, and idle until stopped. Without it,
    /// stopping always keeps the pins (restarts keep the flows).
    #[arg(long, value_name = "DIR")]
    decommission_dir: Option<PathBuf>,
    /// A file in the Pod's own emptyDir where this process says whether it is ready:
    /// `prepared` once loaded and only waiting for its predecessor to exit, then the
    /// `/readyz` verdict about once a second. The kubelet probes it with `--probe-ready`
    /// (on the host network, an HTTP probe of an upgrade's new Pod is answered by the old
    /// process).
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,
    /// Probe: exit 0 if the --ready-file at PATH says ready (and print why), else 1.
    #[arg(long, value_name = "PATH", conflicts_with = "remove_pins")]
    probe_ready: Option<PathBuf>,
    /// Write counters as JSON to this file about once a second (atomically, by rename).
    #[arg(long, value_name = "PATH")]
    stats_file: Option<PathBuf>,
    /// Serve `/metrics` (Prometheus), `/healthz` and `/readyz` on this address; when not
    /// given, on 0.0.0.0:9743 (and without them, with a warning, if that is taken).
    #[arg(long, value_name = "ADDR", value_parser = juneau_telemetry::parse_listen_addr)]
    metrics_addr: Option<SocketAddr>,
    /// Flow table capacity (flows); memory is ~87 bytes per flow plus 512 KiB, allocated
    /// at start.
    #[arg(long, default_value_t = 1 << 20)]
    flow_capacity: usize,
    /// IPv6 flow table capacity per forwarding worker (flows); ~200 bytes per flow,
    /// allocated at start.
    #[arg(long, default_value_t = 1 << 16)]
    flow6_capacity: usize,
    /// TCP timeout of a half-open flow (SYN, or SYN and SYN-ACK, seen), seconds.
    #[arg(long, default_value_t = 5)]
    tcp_syn_timeout: u32,
    /// Most half-open TCP flows held at once; beyond it the oldest is evicted (a SYN
    /// flood never evicts an established flow). 0: a quarter of --flow-capacity.
    #[arg(long, default_value_t = 0)]
    half_open_max: usize,
    /// Most flows one client address may hold at once (per worker); beyond it its new
    /// flows are dropped as source_over_quota. Default: --flow-capacity / 16; 0: none.
    #[arg(long)]
    source_flow_quota: Option<usize>,
    /// Most flows one client /24 may hold at once (per worker). Default:
    /// --flow-capacity / 4; 0: none.
    #[arg(long)]
    prefix_flow_quota: Option<usize>,
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
    /// (any steady traffic keeps the loop spinning; a quiet node sleeps). Only for
    /// workers under the normal policy (`--worker-priority 0`, or CAP_SYS_NICE missing):
    /// a realtime worker sleeps as soon as its rings are empty.
    #[arg(long, default_value_t = 10_000)]
    busy_poll_us: u64,
    /// SCHED_FIFO priority (1-99) of the forwarding workers, so the kernel's receive
    /// work never takes their core from them (docs/dataplane.md, "AF_XDP I/O and the
    /// forwarding loop");
    /// 0 keeps the normal policy. Needs CAP_SYS_NICE (without it: a warning, the normal
    /// policy).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=99))]
    worker_priority: u8,
    /// Longest sleep in poll(2) while idle, milliseconds (a packet wakes it at once).
    #[arg(long, default_value_t = 10)]
    idle_sleep_ms: i32,
    /// AF_XDP busy polling: the forwarding thread runs the interfaces' NAPI itself
    /// (SO_PREFER_BUSY_POLL, SO_BUSY_POLL, SO_BUSY_POLL_BUDGET = this many frames per
    /// poll); 0 = off. Works only for zero-copy sockets on Linux >= 6.13 (not veth):
    /// docs/dataplane.md, "AF_XDP I/O and the forwarding loop".
    #[arg(long, default_value_t = 0)]
    xsk_busy_poll_budget: u32,
    /// UMEM frames (4 KiB each) per interface.
    #[arg(long, default_value_t = runtime::DEFAULT_FRAMES_PER_IFACE)]
    frames_per_iface: u32,
    /// Size of each AF_XDP ring (power of two).
    #[arg(long, default_value_t = runtime::DEFAULT_RING_SIZE)]
    ring_size: u32,
    /// Attach XDP in generic (skb) mode instead of native.
    #[arg(long)]
    generic_xdp: bool,
    /// Opt-in accelerator: the steering program forwards established flows itself
    /// where the egress takes XDP frames (a NIC, a veth whose peer runs XDP; not a
    /// bridge CNI's Pods), instead of every packet going through userspace
    /// (docs/dataplane.md, "XDP fast path").
    #[arg(long)]
    xdp_fast_path: bool,
    /// Packets of no flow (a new connection's first packet, a flood's) to an exposed
    /// VIP:port admitted per second per source /24 (IPv6: /64); the excess is dropped
    /// (`new_flow_prefix_rate_limited`) by the steering program once the prefix's bucket
    /// is empty, before it costs a ring slot and a flow (by the workers, for the few
    /// already queued). Packets of held flows never count. 0: no limit.
    #[arg(long, default_value_t = 10_000)]
    new_flow_prefix_rate: u64,
    /// Burst of those per /24.
    #[arg(long, default_value_t = 20_000)]
    new_flow_prefix_burst: u64,
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
    /// This node's address on the node network, or `auto`: turns on redirects between
    /// nodes, so packets of connections another node holds are sent there instead of
    /// being dropped (docs/dataplane.md, "Redirects between nodes"). `auto` takes the
    /// address the node agent publishes for this node (the Node's InternalIP, or its
    /// `juneau.loutres.me/redirect-address` annotation); redirects start once it is
    /// published. The peers of each VIP always come from the agent.
    #[arg(long, value_parser = parse_node_address)]
    node_address: Option<NodeAddress>,
    /// A peer node's address (repeatable), asked about unknown flows of every VIP in
    /// addition to the peers the agent publishes per VIP (for set-ups without the agent).
    #[arg(long = "redirect-peer")]
    redirect_peers: Vec<std::net::Ipv4Addr>,
    /// UDP port redirected packets and notices use (the same on every node).
    #[arg(long, default_value_t = juneau_dataplane::redirect::DEFAULT_PORT)]
    redirect_port: u16,
    /// Packets of unknown flows redirected per second at most (a flood of random ACKs
    /// stays this small between nodes); redirects of known flows are not limited.
    #[arg(long, default_value_t = 20_000)]
    redirect_rate: u32,
    /// Burst of such redirects.
    #[arg(long, default_value_t = 2_000)]
    redirect_burst: u32,
    /// Of those, at most this many per second about clients of one /24 (and notices
    /// about them): a flood from one prefix leaves the rest of the bucket to others.
    /// Half the node's rate: one busy /24 (a NAT, the lab's one client) moved by an ECMP
    /// change must not lose its packets before the owner's notice arrives (with 2 500/s
    /// and a burst of 250, a helm upgrade in the lab dropped 994 and a request timed out).
    #[arg(long, default_value_t = 10_000)]
    redirect_prefix_rate: u32,
    /// Burst of those per /24 (the node's burst).
    #[arg(long, default_value_t = 2_000)]
    redirect_prefix_burst: u32,
    /// Largest IPv4 packet sent to another node (the node network's MTU); a client
    /// packet that does not fit once encapsulated (up to 92 bytes more) is dropped.
    #[arg(long, default_value_t = 1500)]
    redirect_mtu: usize,
    /// Forwarding workers (threads). Each serves the RX queues `q` with
    /// `q % workers == worker` of every interface, transmits on its own queues and owns
    /// one flow table; 0: one per RX queue of the uplink. More than one needs every
    /// interface to have at least that many queues and fixed --pod-iface interfaces.
    /// Changing it across a restart starts with empty flow tables.
    #[arg(long, default_value_t = 1)]
    workers: u32,
}

/// `--node-address`: an address, or `auto` (published by the node agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeAddress {
    Given(std::net::Ipv4Addr),
    FromState,
}

fn parse_node_address(s: &str) -> Result<NodeAddress, String> {
    if s == "auto" {
        return Ok(NodeAddress::FromState);
    }
    match s.parse::<std::net::Ipv4Addr>() {
        Ok(ip) if !ip.is_unspecified() => Ok(NodeAddress::Given(ip)),
        _ => Err(format!(
            "{s:?} is neither an IPv4 address nor `auto` (the address the node agent publishes)"
        )),
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let a = Args::parse();
    if let Some(path) = &a.probe_ready {
        match juneau_dataplane::runtime::ready_file::probe(path, std::time::SystemTime::now()) {
            Ok(said) => {
                println!("{said}");
                return Ok(());
            }
            Err(why) => {
                eprintln!("{why}");
                std::process::exit(1);
            }
        }
    }
    if a.remove_pins {
        let dir = a.pin_dir.expect("clap requires --pin-dir");
        let n = juneau_dataplane::steering::Steering::remove_pins(&dir)?;
        tracing::info!(pin_dir = %dir.display(), removed = n, "pins removed");
        return Ok(());
    }
    let (Some(uplink), Some(state_file)) = (a.uplink, a.state_file) else {
        anyhow::bail!("--uplink and --state-file are required");
    };
    let pin_dir = a.pin_dir.unwrap_or_else(|| {
        let stem = state_file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "default".into());
        PathBuf::from("/sys/fs/bpf/juneau").join(stem)
    });
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
        uplink,
        pod_ifaces: a.pod_ifaces,
        status_file: a
            .status_file
            .unwrap_or_else(|| juneau_control::dataplane_status::path_for_state_file(&state_file)),
        state_file,
        nft: a.nft,
        pin_dir,
        stats_file: a.stats_file,
        decommission_dir: a.decommission_dir,
        ready_file: juneau_dataplane::runtime::ready_file::ReadyFile(a.ready_file),
        metrics_addr: a.metrics_addr,
        engine: EngineConfig {
            flow_capacity: a.flow_capacity,
            flow6_capacity: a.flow6_capacity,
            timeouts: Timeouts {
                tcp_syn_ms: ms(a.tcp_syn_timeout),
                tcp_established_ms: ms(a.tcp_established_timeout),
                tcp_fin_ms: ms(a.tcp_fin_timeout),
                tcp_rst_ms: ms(a.tcp_rst_timeout),
                udp_ms: ms(a.udp_timeout),
            },
            recompute_pod_checksums: !a.trust_pod_checksums,
            hash_seed: seed,
            half_open_max: a.half_open_max,
            source_flow_quota: a.source_flow_quota.unwrap_or(a.flow_capacity.div_ceil(16)),
            prefix_flow_quota: a.prefix_flow_quota.unwrap_or(a.flow_capacity.div_ceil(4)),
        },
        frames_per_iface: a.frames_per_iface,
        ring_size: a.ring_size,
        busy_poll_us: a.busy_poll_us,
        worker_priority: a.worker_priority,
        idle_sleep_ms: a.idle_sleep_ms,
        xsk_busy_poll_budget: a.xsk_busy_poll_budget,
        generic_xdp: a.generic_xdp,
        xdp_fast_path: a.xdp_fast_path,
        new_flow_admission: juneau_dataplane::admission::Limit {
            rate: a.new_flow_prefix_rate,
            burst: a.new_flow_prefix_burst.max(1),
        },
        zero_copy: a.zero_copy,
        neighbour_keepalive_s: a.neighbour_keepalive,
        redirect: a
            .node_address
            .map(|node| juneau_dataplane::redirect::RedirectConfig {
                node: match node {
                    NodeAddress::Given(ip) => u32::from(ip),
                    NodeAddress::FromState => 0,
                },
                port: a.redirect_port,
                peers: a.redirect_peers.iter().map(|p| u32::from(*p)).collect(),
                rate_per_s: a.redirect_rate,
                burst: a.redirect_burst,
                prefix_rate_per_s: a.redirect_prefix_rate,
                prefix_burst: a.redirect_prefix_burst,
                node_from_state: node == NodeAddress::FromState,
            }),
        redirect_mtu: a.redirect_mtu,
        workers: a.workers,
    };
    run(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_address_is_an_address_or_auto_and_nothing_else() {
        assert_eq!(
            parse_node_address("192.0.2.11"),
            Ok(NodeAddress::Given("192.0.2.11".parse().unwrap()))
        );
        assert_eq!(parse_node_address("auto"), Ok(NodeAddress::FromState));
        for bad in [
            "",
            "0.0.0.0",
            "AUTO",
            "node-a",
            "192.0.2.300",
            "2001:db8::1",
        ] {
            let e = parse_node_address(bad).unwrap_err();
            assert!(
                e.contains("neither an IPv4 address nor `auto`"),
                "{bad}: {e}"
            );
        }
    }
}
