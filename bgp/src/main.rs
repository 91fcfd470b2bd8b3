//! `juneau-bgp`: the per-node BGP speaker daemon.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use juneau_bgp::gate::{self, GateConfig};
use juneau_bgp::speaker::{self, SpeakerConfig};
use juneau_bgp::status::StatusHub;

/// Default `--metrics-addr` (the node's port 9744: the speaker runs on the host network).
const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9744";

/// Announces this node's VIPs (as /32s) to its BGP peers, exactly as the node's shared
/// control state says, and reports per-peer status.
#[derive(Debug, Parser)]
#[command(name = "juneau-bgp", version)]
struct Args {
    /// The node's shared control state (written by the node agent).
    #[arg(long, env = "JUNEAU_STATE_FILE")]
    state_file: PathBuf,
    /// BGP identifier (default: the state's router_id, else the first peer's source address).
    #[arg(long)]
    router_id: Option<Ipv4Addr>,
    /// Address and port to accept BGP connections on.
    #[arg(long, default_value = "0.0.0.0:179")]
    listen: SocketAddr,
    /// Per-peer status as JSON, replaced atomically on every change.
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Serve `/metrics` (Prometheus), `/healthz` and `/readyz` on this address; when not
    /// given, on 0.0.0.0:9744 (and without them, with a warning, if that is taken).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// BFD runs in a separate juneau-bfd process that writes this file: follow it (a
    /// path failure still tears the session down) instead of running BFD here. Lets BFD
    /// survive restarts of this speaker (graceful restart without a BFD flap).
    #[arg(long)]
    bfd_status_file: Option<PathBuf>,
    /// The dataplane's status file (heartbeat, programmed VIPs); default: the state file
    /// with extension `.dataplane`.
    #[arg(long, env = "JUNEAU_DATAPLANE_STATUS_FILE")]
    dataplane_status_file: Option<PathBuf>,
    /// Withdraw every VIP when the dataplane's heartbeat is older than this (ms).
    #[arg(long, default_value_t = 500)]
    dataplane_heartbeat_timeout_ms: u64,
    /// Announce what the state file says without checking the dataplane: for route-only
    /// set-ups (another forwarder behind the VIPs) and tests without a dataplane.
    #[arg(long)]
    no_dataplane_gate: bool,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let hub = StatusHub::new();
    if let Some(path) = args.status_file.clone() {
        tokio::spawn(hub.clone().write_loop(path));
    }
    let default = DEFAULT_METRICS_ADDR
        .parse()
        .context("the default metrics address")?;
    if let Some(l) = juneau_telemetry::bind(args.metrics_addr, default)? {
        l.set_nonblocking(true)?;
        let l = tokio::net::TcpListener::from_std(l).context("the metrics listener")?;
        tokio::spawn(juneau_telemetry::serve(l, hub.clone()));
    }
    let state_rx = if args.no_dataplane_gate {
        tracing::warn!("--no-dataplane-gate: announcing VIPs without checking the dataplane");
        speaker::watch_state(args.state_file.clone())
    } else {
        let gate = GateConfig {
            status_file: args.dataplane_status_file.clone().unwrap_or_else(|| {
                juneau_control::dataplane_status::path_for_state_file(&args.state_file)
            }),
            heartbeat_timeout: std::time::Duration::from_millis(
                args.dataplane_heartbeat_timeout_ms,
            ),
        };
        gate::watch_gated_state(args.state_file.clone(), gate, hub.clone())
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        let _ = stop_tx.send(true);
    });
    let cfg = SpeakerConfig {
        router_id: args.router_id,
        listen: args.listen,
        bfd_status_file: args.bfd_status_file.clone(),
    };
    speaker::run(cfg, state_rx, hub.clone(), stop_rx).await?;
    // Let the status writer record the final state.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    Ok(())
}
