//! `juneau-k8s-sync`: the cluster controller and the node agent of Juneau.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use juneau_k8s_sync::{agent, controller};

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
    },
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
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (KUBECONFIG or in-cluster config)")?;
    match cli.command {
        Command::Controller {
            namespace,
            lease_name,
            identity,
            lease_duration,
        } => {
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
                },
            )
            .await
        }
        Command::Agent {
            node,
            state_file,
            namespace,
        } => {
            let state_file = state_file.unwrap_or_else(|| juneau_control::shm::default_path(&node));
            agent::run(
                client,
                agent::AgentOptions {
                    node,
                    state_file,
                    secret_namespace: namespace,
                },
            )
            .await
        }
    }
}
