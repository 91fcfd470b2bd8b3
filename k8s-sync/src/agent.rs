//! The node agent: watches what concerns its node, rebuilds the node's
//! [`juneau_control::NodeState`] with [`crate::node_state::build_node_state_with`] on
//! every change (paced: [`crate::pacing`]) and publishes it into shared memory, with a
//! heartbeat every second.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{FutureExt, StreamExt};
use juneau_control::shm::{Capacity, NodeStateWriter};
use juneau_control::{AdvertisedVip, NodeState};
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ResourceExt};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::Client;
use std::net::IpAddr;
use tracing::{debug, info, warn};

use crate::crd::{BGPAdvertisement, BGPPeer, ServiceLoadBalancer};
use crate::endpoints::SERVICE_NAME_LABEL;
use crate::metrics::{AgentMetrics, Health, VipLabel};
use crate::node_state::{build_node_state_with, AgentView, BuildCache};
use crate::pacing::Pacing;
use crate::redirect_key;

/// Settings of the agent process.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// This node's name.
    pub node: String,
    /// The shared-memory state file.
    pub state_file: PathBuf,
    /// Namespace of BGP password Secrets.
    pub secret_namespace: String,
    /// The agent's metrics (registered by the caller, served on `--metrics-addr`).
    pub metrics: AgentMetrics,
    /// Readiness: set once the first state is published.
    pub health: std::sync::Arc<Health>,
    /// juneau-bgp's status file, published as NodeBGPStatus/<node>
    /// ([`crate::speaker_status`]).
    pub bgp_status_file: PathBuf,
    /// Where to watch for a decommission request and carry it out
    /// ([`crate::decommission`]); `None`: never decommissioned.
    pub decommission: Option<AgentDecommission>,
    /// What puts the node in maintenance for BGPPeers that name no triggers.
    pub maintenance_triggers: crate::maintenance::Triggers,
}

/// The agent's decommission settings.
#[derive(Debug, Clone)]
pub struct AgentDecommission {
    /// Namespace of the node DaemonSet.
    pub namespace: String,
    /// The node DaemonSet whose annotation is the request.
    pub daemonset: String,
    /// The Pod's decommission directory, shared with the other node containers.
    pub dir: PathBuf,
}

/// Carries a decommission request out, then idles until the process is stopped.
async fn decommission_and_idle(
    client: Client,
    opts: &AgentOptions,
    token: &str,
) -> anyhow::Result<()> {
    let d = opts
        .decommission
        .as_ref()
        .context("decommissioned without decommission settings")?;
    let shm_dir = opts
        .state_file
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(juneau_control::shm::DEFAULT_DIR));
    crate::decommission::carry_out(
        client,
        &crate::decommission::NodeDecommission {
            node: opts.node.clone(),
            dir: d.dir.clone(),
            shm_dir,
        },
        token,
    )
    .await?;
    opts.health.set_ready(false);
    info!("decommissioned: idle until stopped");
    std::future::pending::<()>().await;
    Ok(())
}

fn record(m: &AgentMetrics, state: &NodeState, last: Option<&NodeState>, generation: u64) {
    m.publishes.inc();
    m.services.set(state.services.len() as i64);
    m.backends
        .set(state.services.iter().map(|s| s.backends.len() as i64).sum());
    m.services6.set(state.services6.len() as i64);
    m.backends6.set(
        state
            .services6
            .iter()
            .map(|s| s.backends.len() as i64)
            .sum(),
    );
    m.advertised_vips.set(state.advertised.len() as i64);
    let before = last.map_or(&[][..], |l| &l.advertised[..]);
    for (vip, now) in advertised_changes(before, &state.advertised) {
        let label = VipLabel {
            vip: vip.to_string(),
        };
        if now {
            m.vip_advertised.get_or_create(&label).set(1);
        } else {
            m.vip_advertised.remove(&label);
        }
    }
    m.peers.set(state.peers.len() as i64);
    m.redirect_keys.set(state.redirects.keys.len() as i64);
    m.state_generation
        .set(i64::try_from(generation).unwrap_or(i64::MAX));
}

/// The VIPs advertised in `now` and not in `before` (`true`), and the other way round
/// (`false`); both lists sorted by VIP (`NodeState::normalize`). Most publishes change no
/// VIP: the per-VIP metric is then left alone (10 000 labels rebuilt per publish were
/// 6 % of the agent's CPU at scale).
fn advertised_changes(before: &[AdvertisedVip], now: &[AdvertisedVip]) -> Vec<(IpAddr, bool)> {
    let (mut b, mut n) = (before.iter().peekable(), now.iter().peekable());
    let mut out = Vec::new();
    loop {
        let gone = match (b.peek(), n.peek()) {
            (None, None) => return out,
            (Some(x), Some(y)) if x.vip == y.vip => {
                b.next();
                n.next();
                continue;
            }
            (Some(x), Some(y)) => x.vip < y.vip,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        let (side, now) = if gone {
            (&mut b, false)
        } else {
            (&mut n, true)
        };
        out.extend(side.next().map(|a| (a.vip, now)));
    }
}

/// A cache of `api` ([`crate::caches::reflect`]) and a stream that yields once per
/// change (errors logged: the watch retries with backoff).
fn reflect<K>(
    api: Api<K>,
    wc: watcher::Config,
) -> (Store<K>, futures::stream::BoxStream<'static, ()>)
where
    K: crate::caches::Cached,
{
    let (store, events) = crate::caches::reflect(api, wc);
    let stream = events
        .map(|r| {
            if let Err(e) = r {
                warn!(error = %e, "watch error (retrying with backoff)");
            }
        })
        .boxed();
    (store, stream)
}

struct Stores {
    nodes: Store<Node>,
    slbs: Store<ServiceLoadBalancer>,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    peers: Store<BGPPeer>,
    advertisements: Store<BGPAdvertisement>,
    secrets: Store<Secret>,
}

impl Stores {
    /// Watches every kind the agent reads (Secrets of `secret_ns` only); the stream
    /// yields once per change of any of them.
    fn watch(
        client: &Client,
        secret_ns: &str,
    ) -> (
        Stores,
        futures::stream::SelectAll<futures::stream::BoxStream<'static, ()>>,
    ) {
        let all = watcher::Config::default();
        let (nodes, s1) = reflect(Api::<Node>::all(client.clone()), all.clone());
        let (slbs, s2) = reflect(Api::<ServiceLoadBalancer>::all(client.clone()), all.clone());
        let (services, s3) = reflect(Api::<Service>::all(client.clone()), all.clone());
        let (slices, s4) = reflect(Api::<EndpointSlice>::all(client.clone()), all.clone());
        let (peers, s5) = reflect(Api::<BGPPeer>::all(client.clone()), all.clone());
        let (advertisements, s6) =
            reflect(Api::<BGPAdvertisement>::all(client.clone()), all.clone());
        let (secrets, s7) = reflect(Api::<Secret>::namespaced(client.clone(), secret_ns), all);
        let stores = Stores {
            nodes,
            slbs,
            services,
            slices,
            peers,
            advertisements,
            secrets,
        };
        let changes = futures::stream::select_all(vec![s1, s2, s3, s4, s5, s6, s7]);
        (stores, changes)
    }

    fn ready(&self) -> bool {
        self.nodes.wait_until_ready().now_or_never().is_some()
            && self.slbs.wait_until_ready().now_or_never().is_some()
            && self.services.wait_until_ready().now_or_never().is_some()
            && self.slices.wait_until_ready().now_or_never().is_some()
            && self.peers.wait_until_ready().now_or_never().is_some()
            && self
                .advertisements
                .wait_until_ready()
                .now_or_never()
                .is_some()
            && self.secrets.wait_until_ready().now_or_never().is_some()
    }

    /// The stores' objects, shared with them (`Arc`s: no object is copied).
    fn view(&self, secret_ns: &str, triggers: &crate::maintenance::Triggers) -> AgentView {
        let mut v = AgentView {
            nodes: self
                .nodes
                .state()
                .into_iter()
                .map(|n| (n.name_any(), n))
                .collect(),
            slbs: self.slbs.state(),
            services: self
                .services
                .state()
                .into_iter()
                .map(|s| {
                    (
                        format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any()),
                        s,
                    )
                })
                .collect(),
            peers: self.peers.state(),
            advertisements: self.advertisements.state(),
            secrets: self
                .secrets
                .state()
                .into_iter()
                .map(|s| (s.name_any(), s))
                .collect(),
            secret_namespace: secret_ns.to_string(),
            maintenance_triggers: triggers.clone(),
            ..Default::default()
        };
        for s in self.slices.state() {
            if let Some(svc) = s.labels().get(SERVICE_NAME_LABEL) {
                let key = format!("{}/{}", s.namespace().unwrap_or_default(), svc);
                v.slices.entry(key).or_default().push(s);
            }
        }
        v
    }
}

/// This node's state from what the watches hold, with the redirect MAC keys (a bad
/// Secret keeps the keys of `last` in force), and the warnings to log.
fn build_state(
    opts: &AgentOptions,
    view: &AgentView,
    cache: &mut BuildCache,
    last: Option<&NodeState>,
) -> (NodeState, Vec<String>) {
    let (mut state, mut warnings) = build_node_state_with(&opts.node, view, cache);
    opts.metrics
        .ipv6_host_network_unserved
        .set(cache.ipv6_host_network_unserved() as i64);
    let in_force = last.map_or(&[][..], |s| &s.redirects.keys[..]);
    let (keys, key_error) = redirect_key::keys_to_publish(
        view.secrets.get(redirect_key::SECRET_NAME).map(|s| &**s),
        &opts.secret_namespace,
        in_force,
    );
    opts.metrics
        .redirect_key_invalid
        .set(i64::from(key_error.is_some()));
    warnings.extend(key_error.map(|e| e.to_string()));
    if keys != in_force {
        let ids: Vec<u8> = keys.iter().map(|k| k.id).collect();
        info!(key_ids = ?ids, "redirect MAC keys (current first; none: unauthenticated)");
    }
    state.redirects.keys = keys;
    (state, warnings)
}

/// Runs the agent until the process is stopped.
pub async fn run(client: Client, opts: AgentOptions) -> anyhow::Result<()> {
    // A restarted agent finishes a request that stands: it publishes nothing again.
    if let Some(token) = opts
        .decommission
        .as_ref()
        .and_then(|d| crate::decommission::standing(&d.dir))
    {
        return decommission_and_idle(client, &opts, &token).await;
    }
    let triggers: Vec<&str> = opts
        .maintenance_triggers
        .0
        .iter()
        .map(|t| t.name())
        .collect();
    info!(node = %opts.node, triggers = %triggers.join(","), "graceful maintenance triggers of BGPPeers that name none");
    let (_no_request, mut requests) = tokio::sync::watch::channel(None::<String>);
    if let Some(d) = &opts.decommission {
        requests = crate::decommission::watch_request(client.clone(), &d.namespace, &d.daemonset);
        tokio::spawn(crate::decommission::clear_report(
            client.clone(),
            opts.node.clone(),
        ));
    }
    let (stores, mut changes) = Stores::watch(&client, &opts.secret_namespace);

    if let Some(dir) = opts.state_file.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut writer =
        NodeStateWriter::create(&opts.state_file, Capacity::default()).with_context(|| {
            format!(
                "creating the shared-memory state {}",
                opts.state_file.display()
            )
        })?;
    info!(node = %opts.node, state_file = %opts.state_file.display(), "agent started");
    let speaker_status = tokio::spawn(crate::speaker_status::run(
        client.clone(),
        opts.node.clone(),
        opts.bgp_status_file.clone(),
    ));
    let mut heartbeat = tokio::time::interval(Duration::from_secs(1));
    let mut last: Option<NodeState> = None;
    let mut last_warnings: Vec<String> = Vec::new();
    // Publishes are paced (crate::pacing): after one that took T, changes wait until T
    // has passed and go out together. `pending`: when the oldest unpublished change came.
    let mut pacing = Pacing::default();
    let mut pending: Option<Instant> = None;
    // Each Service's part of the state, reused while its objects stay the same.
    let mut build_cache = BuildCache::default();
    loop {
        let wake =
            pending.map(|_| tokio::time::Instant::from_std(pacing.publish_at(Instant::now())));
        tokio::select! {
            ev = changes.next() => {
                if ev.is_none() {
                    anyhow::bail!("every watch ended");
                }
                pending.get_or_insert_with(Instant::now);
                // Take every change already queued, then publish once.
                while let Some(Some(())) = changes.next().now_or_never() {}
            }
            () = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => {}
            _ = heartbeat.tick() => {
                writer.heartbeat();
                continue;
            }
            Ok(()) = requests.changed() => {
                let token = requests.borrow_and_update().clone();
                if let Some(token) = token {
                    info!(token = %token, "decommission requested (helm uninstall): publishing stops");
                    speaker_status.abort();
                    drop(writer);
                    return decommission_and_idle(client, &opts, &token).await;
                }
                continue;
            }
        }
        let Some(first_event) = pending else {
            continue;
        };
        let started = Instant::now();
        if pacing.publish_at(started) > started {
            continue; // paced: the sleep above wakes the loop when it may publish
        }
        pending = None;
        if !stores.ready() {
            // Not every watch has listed: nothing is published (the next event retries).
            continue;
        }
        let view = stores.view(&opts.secret_namespace, &opts.maintenance_triggers);
        let (state, warnings) = build_state(&opts, &view, &mut build_cache, last.as_ref());
        if warnings != last_warnings {
            for w in &warnings {
                warn!("{w}");
            }
            last_warnings = warnings;
        }
        if last.as_ref() != Some(&state) {
            let generation = writer
                .publish(&state)
                .context("publishing the node state")?;
            opts.metrics
                .publish_latency
                .observe(first_event.elapsed().as_secs_f64());
            record(&opts.metrics, &state, last.as_ref(), generation);
            opts.health.set_ready(true);
            info!(
                generation,
                services = state.services.len(),
                backends = state.services.iter().map(|s| s.backends.len()).sum::<usize>(),
                draining = state.services.iter().map(|s| s.terminating.len()).sum::<usize>(),
                services6 = state.services6.len(),
                advertised = state.advertised.len(),
                peers = state.peers.len(),
                redirect_address = ?state.redirects.node_address,
                redirect_vips = state.redirects.vips.len(),
                "published node state"
            );
            debug!(?state, "node state");
            last = Some(state);
        }
        pacing.published(started, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vips(v: &[u8]) -> Vec<AdvertisedVip> {
        v.iter()
            .map(|&o| AdvertisedVip {
                vip: IpAddr::from([203, 0, 113, o]),
                communities: vec![],
                large_communities: vec![],
                local_pref: None,
                peers: vec![],
                weight: None,
            })
            .collect()
    }

    #[test]
    fn advertised_changes_name_each_vip_gained_and_lost_once() {
        let ip = |o: u8| IpAddr::from([203, 0, 113, o]);
        assert!(advertised_changes(&vips(&[1, 2, 3]), &vips(&[1, 2, 3])).is_empty());
        assert_eq!(
            advertised_changes(&[], &vips(&[1, 2])),
            vec![(ip(1), true), (ip(2), true)]
        );
        assert_eq!(
            advertised_changes(&vips(&[1, 3, 5, 9]), &vips(&[2, 3, 4, 5])),
            vec![(ip(1), false), (ip(2), true), (ip(4), true), (ip(9), false)]
        );
        assert_eq!(advertised_changes(&vips(&[7]), &[]), vec![(ip(7), false)]);
    }
}
