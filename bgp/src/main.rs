//! `juneau-bgp`: the per-node BGP speaker daemon.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use juneau_bgp::gate::{self, GateConfig};
use juneau_bgp::speaker::{self, SpeakerConfig, Stop};
use juneau_bgp::status::StatusHub;
use juneau_control::decommission::{self, Component};

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
    #[arg(long, value_name = "ADDR", value_parser = juneau_telemetry::parse_listen_addr)]
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
    /// The node Pod's decommission directory (an emptyDir shared with the node agent):
    /// when the agent's request stands there (helm uninstall), close every session with
    /// a Cease so the peers drop the routes at once (never graceful restart), remove the
    /// status file, and idle until stopped, also after a restart.
    #[arg(long, value_name = "DIR")]
    decommission_dir: Option<PathBuf>,
    /// Announce what the state file says without checking the dataplane: for route-only
    /// set-ups (another forwarder behind the VIPs) and tests without a dataplane.
    #[arg(long)]
    no_dataplane_gate: bool,
    /// Offer IPv6 unicast (MP-BGP) on every session from the start, not only once a peer
    /// has an IPv6 VIP: a dual-stack cluster avoids the one session reset the first IPv6
    /// VIP would cause. A router that does not negotiate it is sent no IPv6 route.
    #[arg(long)]
    offer_ipv6: bool,
}

fn main() -> anyhow::Result<()> {
    juneau_bgp::daemon::init_logging();
    let args = Args::parse();
    let (state_file, decommission_dir) = (args.state_file.clone(), args.decommission_dir.clone());
    juneau_bgp::daemon::run("bgp", &state_file, decommission_dir.as_deref(), run(args))
}

/// Resolves on SIGTERM or SIGINT.
async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// After the sessions closed (or, restarted, before any opened): removes the status
/// file, acknowledges, and idles until SIGTERM.
async fn decommissioned(
    args: &Args,
    token: &str,
    writer: Option<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<()> {
    if let Some(w) = writer {
        w.abort();
        let _ = w.await;
    }
    decommission::finish(
        args.status_file.as_deref(),
        args.decommission_dir.as_deref(),
        Component::Speaker,
    )?;
    tracing::info!(
        token,
        "decommissioned: sessions closed with a Cease, status file removed; idle until stopped"
    );
    terminated().await;
    Ok(())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let hub = StatusHub::new();
    let default = DEFAULT_METRICS_ADDR
        .parse()
        .context("the default metrics address")?;
    if let Some(l) = juneau_telemetry::bind(args.metrics_addr, default)? {
        l.set_nonblocking(true)?;
        let l = tokio::net::TcpListener::from_std(l).context("the metrics listener")?;
        tokio::spawn(juneau_telemetry::serve(l, hub.clone()));
    }
    // A restarted speaker on a decommissioned node opens no session.
    if let Some(token) = args
        .decommission_dir
        .as_deref()
        .and_then(decommission::requested)
    {
        return decommissioned(&args, &token, None).await;
    }
    let writer = args
        .status_file
        .clone()
        .map(|path| tokio::spawn(hub.clone().write_loop(path)));
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
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(Stop::No);
    let request = args.decommission_dir.clone();
    let stopper = tokio::spawn(async move {
        let (stop, token) = tokio::select! {
            () = terminated() => (Stop::Restart, None),
            t = juneau_bgp::decommission_watch::requested(request) => (Stop::Decommission, Some(t)),
        };
        if let Some(t) = &token {
            tracing::info!(token = %t, "decommission requested");
        }
        let _ = stop_tx.send(stop);
        token
    });
    let cfg = SpeakerConfig {
        router_id: args.router_id,
        listen: args.listen,
        bfd_status_file: args.bfd_status_file.clone(),
        offer_ipv6: args.offer_ipv6,
    };
    let stopped = stop_rx.clone();
    speaker::run(cfg, state_rx, hub.clone(), stop_rx).await?;
    if *stopped.borrow() == Stop::Decommission {
        let token = stopper.await.ok().flatten().unwrap_or_default();
        return decommissioned(&args, &token, writer).await;
    }
    // Let the status writer record the final state.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    Ok(())
}
