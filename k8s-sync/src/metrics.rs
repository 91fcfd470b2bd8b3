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

/// The controller's metrics.
#[derive(Clone, Debug)]
pub struct ControllerMetrics {
    /// VIPs handed out to a Service that held none.
    pub allocations: Counter,
    /// VIPs released.
    pub releases: Counter,
    /// Addresses each AddressPool hands out.
    pub pool_addresses: Family<PoolLabel, Gauge>,
    /// Addresses of each AddressPool held by a Service.
    pub pool_addresses_in_use: Family<PoolLabel, Gauge>,
    /// Reconciles of a Service (every outcome).
    pub reconciles: Counter,
    /// Reconciles that failed (retried with backoff).
    pub reconcile_errors: Counter,
    /// Time one reconcile takes, API writes included.
    pub reconcile_duration: Histogram,
    /// 1 while this replica holds the Lease and acts.
    pub is_leader: Gauge,
    /// Writes refused because this replica is no longer the leader or the object changed.
    pub fenced_writes: Counter,
    /// Ready, non-terminating backends of each served Service (cluster-wide).
    pub service_ready_backends: Family<ServiceLabels, Gauge>,
    /// Nodes the controller computed as advertising each served Service.
    pub service_advertising_nodes: Family<ServiceLabels, Gauge>,
}

impl ControllerMetrics {
    /// Creates the metrics and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let m = ControllerMetrics {
            allocations: Counter::default(),
            releases: Counter::default(),
            pool_addresses: Family::default(),
            pool_addresses_in_use: Family::default(),
            reconciles: Counter::default(),
            reconcile_errors: Counter::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            is_leader: Gauge::default(),
            fenced_writes: Counter::default(),
            service_ready_backends: Family::default(),
            service_advertising_nodes: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("juneau");
        r.register(
            "controller_vip_allocations",
            "VIPs handed out to a Service that held none",
            m.allocations.clone(),
        );
        r.register(
            "controller_vip_releases",
            "VIPs released (Service deleted or left Juneau's class)",
            m.releases.clone(),
        );
        r.register(
            "address_pool_addresses",
            "Addresses the AddressPool hands out",
            m.pool_addresses.clone(),
        );
        r.register(
            "address_pool_addresses_in_use",
            "Addresses of the AddressPool held by a Service",
            m.pool_addresses_in_use.clone(),
        );
        r.register(
            "controller_reconciles",
            "Reconciles of a Service, every outcome",
            m.reconciles.clone(),
        );
        r.register(
            "controller_reconcile_errors",
            "Reconciles that failed and are retried with backoff",
            m.reconcile_errors.clone(),
        );
        r.register(
            "controller_reconcile_duration_seconds",
            "Time one reconcile takes, API writes included",
            m.reconcile_duration.clone(),
        );
        r.register(
            "controller_is_leader",
            "1 while this replica holds the Lease and acts",
            m.is_leader.clone(),
        );
        r.register(
            "controller_fenced_writes",
            "Writes refused because this replica was deposed or the object changed under it",
            m.fenced_writes.clone(),
        );
        r.register(
            "service_ready_backends",
            "Ready, non-terminating backends of a served Service, cluster-wide",
            m.service_ready_backends.clone(),
        );
        r.register(
            "service_advertising_nodes",
            "Nodes that should announce the Service's VIP (Ready local backend, covered by a BGPAdvertisement)",
            m.service_advertising_nodes.clone(),
        );
        m
    }
}

/// The agent's metrics.
#[derive(Clone, Debug)]
pub struct AgentMetrics {
    /// Node states published into shared memory.
    pub publishes: Counter,
    /// Time from the first watch event of a batch to the state being in shared memory.
    pub publish_latency: Histogram,
    /// Service entries (`VIP:port/protocol`) of the published state.
    pub services: Gauge,
    /// Local backends new flows go to in the published state (summed over the entries).
    pub backends: Gauge,
    /// VIPs this node tells its speaker to announce.
    pub advertised_vips: Gauge,
    /// 1 for each VIP this node tells its speaker to announce.
    pub vip_advertised: Family<VipLabel, Gauge>,
    /// BGP peers of the published state.
    pub peers: Gauge,
    /// Generation of the last published state (the dataplane reports the one it runs).
    pub state_generation: Gauge,
    /// Redirect MAC keys in the published state (0: the channel is unauthenticated).
    pub redirect_keys: Gauge,
    /// 1 while the Secret `juneau-redirect-key` is invalid (the keys in force are kept).
    pub redirect_key_invalid: Gauge,
}

impl AgentMetrics {
    /// Creates the metrics and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let m = AgentMetrics {
            publishes: Counter::default(),
            publish_latency: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            services: Gauge::default(),
            backends: Gauge::default(),
            advertised_vips: Gauge::default(),
            vip_advertised: Family::default(),
            peers: Gauge::default(),
            state_generation: Gauge::default(),
            redirect_keys: Gauge::default(),
            redirect_key_invalid: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("juneau_agent");
        r.register(
            "state_publishes",
            "Node states published into shared memory",
            m.publishes.clone(),
        );
        r.register(
            "publish_latency_seconds",
            "Time from a watch event to the node state being in shared memory",
            m.publish_latency.clone(),
        );
        r.register(
            "services",
            "Service entries (VIP:port/protocol) in the published node state",
            m.services.clone(),
        );
        r.register(
            "backends",
            "Local backends new flows go to in the published node state, summed over its entries",
            m.backends.clone(),
        );
        r.register(
            "advertised_vips",
            "VIPs this node tells its BGP speaker to announce",
            m.advertised_vips.clone(),
        );
        r.register(
            "vip_advertised",
            "1 for each VIP this node tells its BGP speaker to announce",
            m.vip_advertised.clone(),
        );
        r.register(
            "peers",
            "BGP peers in the published node state",
            m.peers.clone(),
        );
        r.register(
            "state_generation",
            "Generation of the last node state published into shared memory",
            m.state_generation.clone(),
        );
        r.register(
            "redirect_keys",
            "Redirect channel MAC keys in the published node state (0: unauthenticated)",
            m.redirect_keys.clone(),
        );
        r.register(
            "redirect_key_invalid",
            "1 while the Secret juneau-redirect-key is invalid (the keys in force are kept)",
            m.redirect_key_invalid.clone(),
        );
        m
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
