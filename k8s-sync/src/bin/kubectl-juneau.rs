//! `kubectl-juneau`: the kubectl plugin (`kubectl juneau ...`) for Juneau load balancers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use juneau_k8s_sync::crd::{ExternalNetwork, ServiceLoadBalancer, LOAD_BALANCER_CLASS};
use juneau_k8s_sync::describe::render;
use juneau_k8s_sync::endpoints::SERVICE_NAME_LABEL;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// Inspect Juneau load balancers.
#[derive(Parser, Debug)]
#[command(name = "kubectl juneau", bin_name = "kubectl juneau", version)]
struct Cli {
    /// Path to the kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show details of a resource.
    Describe {
        #[command(subcommand)]
        what: Describe,
    },
}

#[derive(Subcommand, Debug)]
enum Describe {
    /// A Service's load balancer: VIP, pool, ports, advertising nodes, backends.
    #[command(visible_aliases = ["lb", "serviceloadbalancer", "slb"])]
    Loadbalancer {
        /// Name of the Service (and of its ServiceLoadBalancer).
        name: String,
        /// Namespace (default: the kubeconfig context's namespace).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
    },
}

async fn client(cli: &Cli) -> anyhow::Result<kube::Client> {
    let options = KubeConfigOptions {
        context: cli.context.clone(),
        ..Default::default()
    };
    let config = match &cli.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options).await?
        }
        None if cli.context.is_some() => kube::Config::from_kubeconfig(&options).await?,
        None => kube::Config::infer()
            .await
            .context("loading the kubeconfig")?,
    };
    Ok(kube::Client::try_from(config)?)
}

async fn describe(client: kube::Client, name: &str, ns: &str) -> anyhow::Result<Option<String>> {
    let slbs: Api<ServiceLoadBalancer> = Api::namespaced(client.clone(), ns);
    let svcs: Api<Service> = Api::namespaced(client.clone(), ns);
    let slb = slbs
        .get_opt(name)
        .await
        .context("reading the ServiceLoadBalancer")?;
    let svc = svcs.get_opt(name).await.context("reading the Service")?;
    let Some(slb) = slb else {
        let why = match &svc {
            None => format!(
                "there is no ServiceLoadBalancer and no Service named {name:?} in namespace {ns:?}"
            ),
            Some(s) => {
                let spec = s.spec.clone().unwrap_or_default();
                if spec.type_.as_deref() != Some("LoadBalancer")
                    || spec.load_balancer_class.as_deref() != Some(LOAD_BALANCER_CLASS)
                {
                    format!(
                        "Service {ns}/{name} is not managed by Juneau: it needs type: LoadBalancer and loadBalancerClass: {LOAD_BALANCER_CLASS}"
                    )
                } else {
                    format!(
                        "Service {ns}/{name} is Juneau's but has no ServiceLoadBalancer yet: is the juneau controller running?"
                    )
                }
            }
        };
        eprintln!("Error: {why}");
        return Ok(None);
    };
    let net_name = slb
        .status
        .as_ref()
        .and_then(|s| s.external_network.clone())
        .or_else(|| slb.spec.external_network.clone());
    let net = match net_name {
        Some(n) => Api::<ExternalNetwork>::all(client.clone())
            .get_opt(&n)
            .await
            .context("reading the ExternalNetwork")?,
        None => None,
    };
    let slices = Api::<EndpointSlice>::namespaced(client, ns)
        .list(&ListParams::default().labels(&format!("{SERVICE_NAME_LABEL}={name}")))
        .await
        .context("listing EndpointSlices")?
        .items;
    Ok(Some(render(&slb, svc.as_ref(), net.as_ref(), &slices)))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let run = async {
        let c = client(&cli).await?;
        match &cli.command {
            Command::Describe {
                what: Describe::Loadbalancer { name, namespace },
            } => {
                let ns = namespace
                    .clone()
                    .unwrap_or_else(|| c.default_namespace().to_string());
                describe(c, name, &ns).await
            }
        }
    };
    match run.await {
        Ok(Some(text)) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
