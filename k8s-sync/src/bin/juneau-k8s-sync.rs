//! `juneau-k8s-sync`: the cluster controller and the node agent of Juneau.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use juneau_k8s_sync::metrics::{self, AgentMetrics, ControllerMetrics, Health};
use juneau_k8s_sync::{agent, controller};
use prometheus_client::registry::Registry;

/// Juneau's face to Kubernetes.
#[derive(Parser, Debug)]
#[command(name = "juneau-k8s-sync", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Cluster-wide controller (leader-elected): allocates VIPs, writes
    /// ServiceLoadBalancers, Service status and Events.
    Controller {
        /// Namespace of the leader-election Lease.
        #[arg(long, env = "POD_NAMESPACE", default_value = "juneau-system")]
        namespace: String,
        /// Name of the leader-election Lease.
        #[arg(long, default_value = "juneau-controller")]
        lease_name: String,
        /// This replica's identity in the Lease (default: the Pod name, else host name + pid).
        #[arg(long, env = "POD_NAME")]
        identity: Option<String>,
        /// Seconds the Lease stays valid without renewal (a new leader takes over after it).
        #[arg(long, default_value_t = 15)]
        lease_duration: u64,
        /// Where to serve /metrics, /healthz and /readyz (default 0.0.0.0:9741; when the
        /// default is taken the controller runs without them and says so; an address
        /// given here must be free; port 0 picks one).
        #[arg(long, value_name = "ADDR", value_parser = juneau_telemetry::parse_listen_addr)]
        metrics_addr: Option<SocketAddr>,
    },
    /// Node agent: publishes this node's service table, advertise set and BGP peers
    /// into shared memory for the dataplane and the BGP speaker.
    Agent {
        /// Name of this node (the Node object).
        #[arg(long, env = "NODE_NAME")]
        node: String,
        /// Shared-memory state file (default /run/juneau/<node>.state).
        #[arg(long)]
        state_file: Option<PathBuf>,
        /// Namespace of BGP password Secrets.
        #[arg(long, env = "POD_NAMESPACE", default_value = "juneau-system")]
        namespace: String,
        /// Where to serve /metrics, /healthz and /readyz (default 0.0.0.0:9742; when the
        /// default is taken the agent runs without them and says so; an address given
        /// here must be free; port 0 picks one).
        #[arg(long, value_name = "ADDR", value_parser = juneau_telemetry::parse_listen_addr)]
        metrics_addr: Option<SocketAddr>,
        /// juneau-bgp's status file, published as the node's NodeBGPStatus (default
        /// /run/juneau/<node>.bgp-status.json, the speaker's --status-file in deploy/).
        #[arg(long)]
        bgp_status_file: Option<PathBuf>,
        /// The node Pod's decommission directory (an emptyDir every node container
        /// mounts). With --daemonset: watch that DaemonSet for the decommission request
        /// (helm uninstall) and carry it out on this node (docs/operations.md,
        /// "Uninstall"). Without: never decommissioned.
        #[arg(long, value_name = "DIR", requires = "daemonset")]
        decommission_dir: Option<PathBuf>,
        /// What puts this node in graceful maintenance for BGPPeers that name no
        /// `spec.maintenance.triggers` (comma-separated: Cordon, ExcludeLabel,
        /// NodeShutdown, Annotation; empty: never; default ExcludeLabel,Annotation).
        /// docs/bgp.md, "Graceful maintenance".
        #[arg(long, value_name = "TRIGGERS", value_parser = juneau_k8s_sync::maintenance::Triggers::parse)]
        maintenance_triggers: Option<juneau_k8s_sync::maintenance::Triggers>,
        /// The node DaemonSet (in --namespace) whose juneau.loutres.me/decommission
        /// annotation is the decommission request.
        #[arg(long, requires = "decommission_dir")]
        daemonset: Option<String>,
    },
    /// helm uninstall's pre-delete hook: asks every node to decommission (annotation on
    /// the node DaemonSet) and waits until each reports it did — routes withdrawn with a
    /// Cease, XDP detached, pins and /run/juneau files removed — or fails after --timeout
    /// naming the nodes that did not.
    Decommission {
        /// The release namespace.
        #[arg(long, env = "POD_NAMESPACE", default_value = "juneau-system")]
        namespace: String,
        /// The node DaemonSet.
        #[arg(long, default_value = "juneau-node")]
        daemonset: String,
        /// Longest wait for every node, in seconds.
        #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
        timeout: u64,
    },
    /// Gives the node directories (`/run/juneau`) to the node processes' group before
    /// they start (the node Pod's init container): the directory setgid 2770, the files
    /// already there (an earlier version's) group read and write. No API access.
    NodeDirs {
        /// The group (the node Pod's runAsGroup).
        #[arg(long)]
        group: u32,
        /// The directories.
        #[arg(required = true)]
        dirs: Vec<std::path::PathBuf>,
    },
}

/// `node-dirs`: prepares each directory, saying what changed.
fn node_dirs(group: u32, dirs: &[std::path::PathBuf]) -> anyhow::Result<()> {
    for dir in dirs {
        let done = juneau_control::node_dir::prepare(dir, group)
            .with_context(|| format!("preparing {} for group {group}", dir.display()))?;
        tracing::info!(
            dir = %dir.display(),
            group,
            created = done.created,
            changed = done.changed.len(),
            "node directory prepared"
        );
    }
    Ok(())
}

/// Binds the metrics address and serves the registry there in the background. An
/// explicit address that cannot be bound is an error; the default one is only warned
/// about (several replicas on one host, as in tests, cannot all have it).
async fn serve_metrics(
    given: Option<SocketAddr>,
    default: &str,
    registry: Registry,
    health: Arc<Health>,
) -> anyhow::Result<()> {
    let addr = match given {
        Some(a) => a,
        None => default.parse().context("the default metrics address")?,
    };
    let listener = match metrics::bind(addr).await {
        Ok(l) => l,
        Err(e) if given.is_none() => {
            tracing::warn!(error = %format!("{e:#}"), "running without /metrics, /healthz and /readyz");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    tokio::spawn(metrics::serve(listener, Arc::new(registry), health));
    Ok(())
}

/// Resolves on SIGTERM or SIGINT. A process without a SIGTERM handler that runs as a
/// container's first process ignores SIGTERM (the kernel protects a PID namespace's
/// init), so the kubelet would wait the whole grace period and then kill it.
async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "no signal handler: SIGTERM will not stop this process");
            std::future::pending::<()>().await
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_lease_manager=warn".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let cli = Cli::parse();
    if let Command::NodeDirs { group, dirs } = &cli.command {
        return node_dirs(*group, dirs);
    }
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (KUBECONFIG or in-cluster config)")?;
    match cli.command {
        Command::Controller {
            namespace,
            lease_name,
            identity,
            lease_duration,
            metrics_addr,
        } => {
            let mut registry = Registry::default();
            let metrics = ControllerMetrics::new(&mut registry);
            // A standby replica is as ready as the leader: it takes over on its own.
            let health = Arc::new(Health::default());
            health.set_ready(true);
            serve_metrics(
                metrics_addr,
                metrics::CONTROLLER_METRICS_ADDR,
                registry,
                health,
            )
            .await?;
            let identity = identity.unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_else(|_| "juneau".into());
                format!("{host}-{}", std::process::id())
            });
            controller::run(
                client,
                controller::ControllerOptions {
                    namespace,
                    lease_name,
                    identity,
                    lease_duration,
                    metrics,
                },
                terminated(),
            )
            .await
        }
        Command::Agent {
            node,
            state_file,
            namespace,
            metrics_addr,
            bgp_status_file,
            decommission_dir,
            daemonset,
            maintenance_triggers,
        } => {
            let state_file = state_file.unwrap_or_else(|| juneau_control::shm::default_path(&node));
            // An upgrade's new Pod starts beside the old one: the state file and the
            // metrics port are the old agent's until it exits. Held until this process
            // exits (blocking: nothing else runs yet).
            let _succession = juneau_telemetry::take_over(&state_file, "agent")?;
            let decommission = match (decommission_dir, daemonset) {
                (Some(dir), Some(daemonset)) => Some(agent::AgentDecommission {
                    namespace: namespace.clone(),
                    daemonset,
                    dir,
                }),
                _ => None,
            };
            let bgp_status_file = bgp_status_file
                .unwrap_or_else(|| juneau_k8s_sync::speaker_status::default_path(&node));
            let mut registry = Registry::default();
            let metrics = AgentMetrics::new(&mut registry);
            let health = Arc::new(Health::default());
            serve_metrics(
                metrics_addr,
                metrics::AGENT_METRICS_ADDR,
                registry,
                health.clone(),
            )
            .await?;
            let agent = agent::run(
                client,
                agent::AgentOptions {
                    node,
                    state_file,
                    secret_namespace: namespace,
                    metrics,
                    health,
                    bgp_status_file,
                    decommission,
                    maintenance_triggers: maintenance_triggers.unwrap_or_default(),
                },
            );
            tokio::select! {
                r = agent => r,
                () = terminated() => {
                    // Static stability: the published node state stays for the
                    // dataplane and the speaker until the next agent publishes.
                    tracing::info!("stopping; the node state stays as published");
                    Ok(())
                }
            }
        }
        Command::Decommission {
            namespace,
            daemonset,
            timeout,
        } => {
            let opts = juneau_k8s_sync::decommission::HookOptions {
                namespace,
                daemonset,
                timeout: std::time::Duration::from_secs(timeout),
            };
            juneau_k8s_sync::decommission::run_hook(client, opts)
                .await
                .context("decommissioning Juneau's nodes (helm uninstall's pre-delete hook)")
        }
        Command::NodeDirs { .. } => unreachable!("handled before connecting to the API"),
    }
}
