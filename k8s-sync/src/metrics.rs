//! Prometheus metrics of the controller and the agent (through the `prometheus-client`
//! crate, never a hand-written exposition format) and the small HTTP endpoint serving
//! them with the probes: `GET /metrics`, `GET /healthz` (the process runs its loop),
//! `GET /readyz` (it is ready: caches loaded, state published).
//!
//! Names follow the Prometheus conventions: `juneau_` prefix, `_total` on counters, base
//! units (`_seconds`). The list with meanings is in `docs/observability.md`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Default `--metrics-addr` of the controller.
pub const CONTROLLER_METRICS_ADDR: &str = "0.0.0.0:9741";
/// Default `--metrics-addr` of the agent.
pub const AGENT_METRICS_ADDR: &str = "0.0.0.0:9742";

/// Label of per-pool series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    /// AddressPool name.
    pub pool: String,
}

/// Labels of per-Service series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// Service namespace.
    pub namespace: String,
    /// Service name.
    pub service: String,
    /// The VIP it holds.
    pub vip: String,
}

/// Label of per-VIP series of the agent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VipLabel {
    /// The VIP.
    pub vip: String,
}

/// Declares a metrics struct and its constructor from one list: each field's doc comment
/// (one line) is also its help text, and it is registered as `<prefix>_<name>` — one
/// definition per metric, so the two cannot drift apart.
macro_rules! metrics {
    (
        $(#[doc = $doc:literal])*
        pub struct $name:ident in $prefix:literal {
            $(
                #[doc = $help:literal]
                $field:ident: $ty:ty = $init:expr => $metric:literal,
            )*
        }
    ) => {
        $(#[doc = $doc])*
        #[derive(Clone, Debug)]
        pub struct $name {
            $(#[doc = $help] pub $field: $ty,)*
        }

        impl $name {
            /// Creates the metrics and registers them.
            pub fn new(registry: &mut Registry) -> Self {
                let r = registry.sub_registry_with_prefix($prefix);
                let m = $name { $($field: $init,)* };
                $(r.register($metric, $help.trim(), m.$field.clone());)*
                m
            }
        }
    };
}

metrics! {
    /// The controller's metrics.
    pub struct ControllerMetrics in "juneau" {
        /// VIPs handed out to a Service that held none.
        allocations: Counter = Counter::default() => "controller_vip_allocations",
        /// VIPs released (Service deleted or left Juneau's class).
        releases: Counter = Counter::default() => "controller_vip_releases",
        /// Addresses the AddressPool hands out.
        pool_addresses: Family<PoolLabel, Gauge> = Family::default() => "address_pool_addresses",
        /// Addresses of the AddressPool held by a Service.
        pool_addresses_in_use: Family<PoolLabel, Gauge> =
            Family::default() => "address_pool_addresses_in_use",
        /// Reconciles of a Service, every outcome.
        reconciles: Counter = Counter::default() => "controller_reconciles",
        /// Reconciles that failed and are retried with backoff.
        reconcile_errors: Counter = Counter::default() => "controller_reconcile_errors",
        /// Time one reconcile takes, API writes included.
        reconcile_duration: Histogram = Histogram::new(exponential_buckets(0.001, 2.0, 16))
            => "controller_reconcile_duration_seconds",
        /// 1 while this replica holds the Lease and acts.
        is_leader: Gauge = Gauge::default() => "controller_is_leader",
        /// Writes refused because this replica was deposed or the object changed under it.
        fenced_writes: Counter = Counter::default() => "controller_fenced_writes",
        /// Normal Events not written: beyond their budget (many Services at once; the ServiceLoadBalancers' conditions say the same).
        events_suppressed: Counter = Counter::default() => "controller_events_suppressed",
        /// Ready, non-terminating backends of a served Service, cluster-wide.
        service_ready_backends: Family<ServiceLabels, Gauge> =
            Family::default() => "service_ready_backends",
        /// Nodes that should announce the Service's VIP (covered by a BGPAdvertisement; with the Local policy, a Ready local backend).
        service_advertising_nodes: Family<ServiceLabels, Gauge> =
            Family::default() => "service_advertising_nodes",
    }
}

metrics! {
    /// The agent's metrics.
    pub struct AgentMetrics in "juneau_agent" {
        /// Node states published into shared memory.
        publishes: Counter = Counter::default() => "state_publishes",
        /// Time from a watch event to the node state being in shared memory.
        publish_latency: Histogram = Histogram::new(exponential_buckets(0.0001, 2.0, 18))
            => "publish_latency_seconds",
        /// Service entries (VIP:port/protocol) in the published node state.
        services: Gauge = Gauge::default() => "services",
        /// Local backends new flows go to in the published node state, summed over its entries.
        backends: Gauge = Gauge::default() => "backends",
        /// IPv6 service entries ([VIP]:port/protocol) in the published node state.
        services6: Gauge = Gauge::default() => "services6",
        /// Local IPv6 backends new flows go to in the published node state, summed over its entries.
        backends6: Gauge = Gauge::default() => "backends6",
        /// IPv6 host-network endpoints on this node left unserved (IPv6 VIPs are served from Pod-network backends only).
        ipv6_host_network_unserved: Gauge = Gauge::default() => "ipv6_host_network_unserved",
        /// VIPs this node tells its BGP speaker to announce.
        advertised_vips: Gauge = Gauge::default() => "advertised_vips",
        /// 1 for each VIP this node tells its BGP speaker to announce.
        vip_advertised: Family<VipLabel, Gauge> = Family::default() => "vip_advertised",
        /// BGP peers in the published node state.
        peers: Gauge = Gauge::default() => "peers",
        /// Generation of the last node state published into shared memory.
        state_generation: Gauge = Gauge::default() => "state_generation",
        /// Redirect channel MAC keys in the published node state (0: unauthenticated).
        redirect_keys: Gauge = Gauge::default() => "redirect_keys",
        /// 1 while the Secret juneau-redirect-key is invalid (the keys in force are kept).
        redirect_key_invalid: Gauge = Gauge::default() => "redirect_key_invalid",
    }
}

/// Liveness and readiness as the probes see them.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
}

impl Health {
    /// Marks the process ready (or not).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }
    /// True once ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

/// The controller's or agent's registry and health, served through
/// [`juneau_telemetry`] (one HTTP endpoint implementation for every process).
struct Served {
    registry: Arc<Registry>,
    health: Arc<Health>,
}

impl juneau_telemetry::Endpoint for Served {
    fn collect(&self, _registry: &mut Registry) {
        // Unused: `encode` serves the long-lived registry of metric handles.
    }
    fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
    fn live(&self) -> Result<(), String> {
        Ok(())
    }
    fn ready(&self) -> Result<(), String> {
        if self.health.is_ready() {
            Ok(())
        } else {
            Err("not ready".into())
        }
    }
}

/// Binds `addr` (fails clearly when it cannot).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context as _;
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr} (--metrics-addr)"))
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    health: Arc<Health>,
) {
    juneau_telemetry::serve(listener, Arc::new(Served { registry, health })).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The metric names of `text` (an exposition page or a markdown table), sorted.
    fn names(text: &str, from: impl Fn(&str) -> Option<&str>) -> Vec<String> {
        let mut names: Vec<String> = text.lines().filter_map(from).map(String::from).collect();
        names.sort();
        names.dedup();
        names
    }

    #[test]
    fn every_registered_metric_is_the_one_docs_observability_lists_with_its_help() {
        let mut registry = Registry::default();
        let controller = ControllerMetrics::new(&mut registry);
        let agent = AgentMetrics::new(&mut registry);
        // A family shows on the page once it has a series.
        let pool = PoolLabel { pool: "p".into() };
        controller.pool_addresses.get_or_create(&pool).set(1);
        controller.pool_addresses_in_use.get_or_create(&pool).set(1);
        let service = ServiceLabels {
            namespace: "n".into(),
            service: "s".into(),
            vip: "v".into(),
        };
        controller
            .service_ready_backends
            .get_or_create(&service)
            .set(1);
        controller
            .service_advertising_nodes
            .get_or_create(&service)
            .set(1);
        let vip = VipLabel { vip: "v".into() };
        agent.vip_advertised.get_or_create(&vip).set(1);
        let mut page = String::new();
        prometheus_client::encoding::text::encode(&mut page, &registry).unwrap();
        // `# HELP name text`: the doc comment became the help text, trimmed.
        assert!(page.contains("# HELP juneau_agent_state_publishes Node states published"));
        assert!(page.contains("# HELP juneau_controller_is_leader 1 while this replica"));
        let registered = names(&page, |l| l.strip_prefix("# TYPE ")?.split(' ').next());
        // The package as cargo runs the test, else as compiled (tests/src/lib.rs, `repo_root`).
        let package: std::path::PathBuf = std::env::var_os("CARGO_MANIFEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
        let doc = std::fs::read_to_string(package.join("../docs/observability.md")).unwrap();
        let documented = names(&doc, |l| {
            let name = l.strip_prefix("| `")?.split(['`', '{']).next()?;
            let name = name.trim_end_matches("_total");
            let ours = name.starts_with("juneau_controller_")
                || name.starts_with("juneau_agent_")
                || name.starts_with("juneau_address_pool_")
                || name.starts_with("juneau_service_");
            ours.then_some(name)
        });
        assert_eq!(registered, documented);
    }
}
