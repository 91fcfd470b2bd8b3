//! `kubectl-juneau`: the kubectl plugin (`kubectl juneau ...`) for Juneau load balancers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use juneau_k8s_sync::crd::{
    AddressPool, BGPAdvertisement, BGPPeer, ExternalNetwork, NodeBGPStatus, ServiceLoadBalancer,
    LOAD_BALANCER_CLASS,
};
use juneau_k8s_sync::describe::render;
use juneau_k8s_sync::endpoints::SERVICE_NAME_LABEL;
use juneau_k8s_sync::reconcile::World;
use juneau_k8s_sync::report::{self, table};
use k8s_openapi::api::core::v1::{Node, Service};
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
    /// Every Juneau Service: VIP, phase, advertising nodes.
    Status {
        /// Only this namespace (default: all namespaces).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// AddressPool usage: total, allocated, free, overlaps.
    Pools {
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Per node: does it announce the Service's VIP, and if not, precisely why.
    Why {
        /// Name of the Service.
        service: String,
        /// Namespace (default: the kubeconfig context's namespace).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Per node BGP sessions: state, uptime, prefixes announced, BFD (from each node's
    /// NodeBGPStatus, written by its agent), and configured peers not reported.
    Peers {
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

/// Output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    /// A table for humans.
    Table,
    /// JSON.
    Json,
    /// YAML.
    Yaml,
}

fn emit<T: serde::Serialize>(
    output: Output,
    value: &T,
    table: impl FnOnce() -> String,
) -> anyhow::Result<Option<String>> {
    Ok(Some(match output {
        Output::Table => table(),
        Output::Json => serde_json::to_string_pretty(value)? + "\n",
        Output::Yaml => serde_saphyr::to_string(value)?,
    }))
}

async fn status(
    c: kube::Client,
    ns: Option<&str>,
    output: Output,
) -> anyhow::Result<Option<String>> {
    let api: Api<ServiceLoadBalancer> = match ns {
        Some(ns) => Api::namespaced(c, ns),
        None => Api::all(c),
    };
    let slbs = api
        .list(&ListParams::default())
        .await
        .context("listing ServiceLoadBalancers")?
        .items;
    let rows = report::status_rows(&slbs);
    emit(output, &rows, || {
        table(
            &[
                "NAMESPACE",
                "SERVICE",
                "VIP",
                "PHASE",
                "POOL",
                "ADVERTISING NODES",
                "REASON",
            ],
            &rows
                .iter()
                .map(|r| {
                    vec![
                        r.namespace.clone(),
                        r.service.clone(),
                        r.vip.clone().unwrap_or_else(|| "<none>".into()),
                        r.phase.clone(),
                        r.pool.clone().unwrap_or_else(|| "<none>".into()),
                        if r.advertising_nodes.is_empty() {
                            "<none>".into()
                        } else {
                            r.advertising_nodes.join(",")
                        },
                        r.reason.clone(),
                    ]
                })
                .collect::<Vec<_>>(),
        )
    })
}

/// Every object of a cluster-wide kind (`what`: its plural, for the error).
async fn list_all<K>(c: &kube::Client, what: &str) -> anyhow::Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    Ok(Api::<K>::all(c.clone())
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing {what}"))?
        .items)
}

async fn pools(c: kube::Client, output: Output) -> anyhow::Result<Option<String>> {
    let pools = list_all::<AddressPool>(&c, "AddressPools").await?;
    let slbs = list_all::<ServiceLoadBalancer>(&c, "ServiceLoadBalancers").await?;
    let rows = report::pool_rows(&pools, &slbs);
    emit(output, &rows, || {
        table(
            &[
                "POOL",
                "TOTAL",
                "ALLOCATED",
                "FREE",
                "USED",
                "AUTO-ASSIGN",
                "SERVES",
                "OVERLAPS WITH",
                "SERVICES",
            ],
            &rows
                .iter()
                .map(|r| {
                    vec![
                        r.pool.clone(),
                        r.total.to_string(),
                        r.allocated.to_string(),
                        r.free.to_string(),
                        format!("{}%", r.used_percent),
                        if r.auto_assign { "yes" } else { "no" }.into(),
                        r.serves.clone(),
                        match &r.invalid {
                            Some(e) => format!("invalid: {e}"),
                            None if r.overlaps_with.is_empty() => "-".into(),
                            None => r.overlaps_with.join(","),
                        },
                        if r.services.is_empty() {
                            "-".into()
                        } else {
                            r.services.join(",")
                        },
                    ]
                })
                .collect::<Vec<_>>(),
        )
    })
}

async fn why(
    c: kube::Client,
    name: &str,
    ns: &str,
    output: Output,
) -> anyhow::Result<Option<String>> {
    let Some(slb) = Api::<ServiceLoadBalancer>::namespaced(c.clone(), ns)
        .get_opt(name)
        .await
        .context("reading the ServiceLoadBalancer")?
    else {
        eprintln!("Error: Service {ns}/{name} has no ServiceLoadBalancer: it is not a Juneau Service, or the controller has not processed it yet (try `kubectl juneau describe lb {name} -n {ns}`)");
        return Ok(None);
    };
    let slices = Api::<EndpointSlice>::namespaced(c.clone(), ns)
        .list(&ListParams::default().labels(&format!("{SERVICE_NAME_LABEL}={name}")))
        .await
        .context("listing EndpointSlices")?
        .items;
    let nodes = list_all::<Node>(&c, "Nodes").await?;
    let advs = list_all::<BGPAdvertisement>(&c, "BGPAdvertisements").await?;
    let speakers = list_all::<NodeBGPStatus>(&c, "NodeBGPStatuses").await?;
    let world = World {
        nodes: report::node_map(nodes),
        advertisements: advs.into_iter().map(|a| a.spec).collect(),
        ..Default::default()
    };
    // Its labels choose the BGPAdvertisements that apply (serviceSelector).
    let service_labels = Api::<Service>::namespaced(c.clone(), ns)
        .get_opt(name)
        .await
        .context("reading the Service")?
        .and_then(|s| s.metadata.labels)
        .unwrap_or_default();
    let mut r = report::why(&slb, &service_labels, &slices, &world);
    juneau_k8s_sync::peers::refine_why(&mut r, &speakers);
    // Services sharing its VIP (same allow-shared-ip key) announce it too.
    let siblings: Vec<ServiceLoadBalancer> = Api::<ServiceLoadBalancer>::namespaced(c.clone(), ns)
        .list(&ListParams::default())
        .await
        .context("listing the namespace's ServiceLoadBalancers")?
        .items
        .into_iter()
        .filter(|s| s.metadata.name.as_deref() != Some(name))
        .collect();
    report::refine_why_for_shared_vip(&mut r, &siblings);
    emit(output, &r, || {
        let mut out = format!(
            "Service {}  vip: {}  phase: {}\n",
            r.service,
            r.vip.as_deref().unwrap_or("<none>"),
            r.phase
        );
        for p in &r.service_problems {
            out.push_str(&format!("Problem: {p}\n"));
        }
        out.push_str(&table(
            &["NODE", "ADVERTISING", "REASON", "DETAIL"],
            &r.nodes
                .iter()
                .map(|v| {
                    vec![
                        v.node.clone(),
                        if v.advertising {
                            "yes".into()
                        } else {
                            "no".into()
                        },
                        v.reason.clone(),
                        v.message.clone(),
                    ]
                })
                .collect::<Vec<_>>(),
        ));
        for n in &r.not_checked {
            out.push_str(&format!("Not checked: {n}\n"));
        }
        out
    })
}

async fn peers(c: kube::Client, output: Output) -> anyhow::Result<Option<String>> {
    let peers = list_all::<BGPPeer>(&c, "BGPPeers").await?;
    let nodes = list_all::<Node>(&c, "Nodes").await?;
    let statuses = list_all::<NodeBGPStatus>(&c, "NodeBGPStatuses").await?;
    let r = juneau_k8s_sync::peers::peers_report(
        &peers,
        &nodes,
        &statuses,
        k8s_openapi::jiff::Timestamp::now(),
    );
    emit(output, &r, || juneau_k8s_sync::peers::render(&r))
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
            Command::Status { namespace, output } => status(c, namespace.as_deref(), *output).await,
            Command::Pools { output } => pools(c, *output).await,
            Command::Why {
                service,
                namespace,
                output,
            } => {
                let ns = namespace
                    .clone()
                    .unwrap_or_else(|| c.default_namespace().to_string());
                why(c, service, &ns, *output).await
            }
            Command::Peers { output } => peers(c, *output).await,
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
