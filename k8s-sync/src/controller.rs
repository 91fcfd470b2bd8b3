//! The cluster controller: leader election on a Lease, the VIP book rebuilt from the API,
//! and the kube-runtime Controller that runs [`crate::reconcile::reconcile_service`] for
//! every Service and writes what it decided.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{future, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, ResourceExt};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::{Event as KEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource};
use serde_json::json;
use tracing::{info, warn};

use crate::crd::{
    AddressPool, AddressPoolStatus, BGPAdvertisement, ExternalNetwork, ServiceLoadBalancer,
    ServiceLoadBalancerSpec, ServiceLoadBalancerStatus, CONTROLLER_MANAGER,
    EXTERNAL_NETWORK_ANNOTATION, FINALIZER, REQUESTED_IP_ANNOTATION,
};
use crate::endpoints::SERVICE_NAME_LABEL;
use crate::metrics::{ControllerMetrics, PoolLabel, ServiceLabels};
use crate::pools::{self, OVERLAPPING, OVERLAP_REASON};
use crate::reconcile::{created_secs, is_managed, key_of, reconcile_service, Waiter, World};
use crate::vips::VipBook;
use crate::Error;

/// Settings of the controller process.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// Namespace holding the Lease.
    pub namespace: String,
    /// Lease name.
    pub lease_name: String,
    /// This replica's identity in the Lease.
    pub identity: String,
    /// Seconds a lease stays valid without renewal.
    pub lease_duration: u64,
    /// The controller's metrics (registered by the caller, served on `--metrics-addr`).
    pub metrics: ControllerMetrics,
}

/// Who this replica is in the Lease, checked before every batch of writes.
#[derive(Clone)]
struct Fence {
    leases: Api<Lease>,
    lease_name: String,
    identity: String,
}

/// Reconciles in flight at once. Unbounded (kube-runtime's default), 3 000 Services
/// created at once put ~1 000 reconciles in flight, each with its own requests: the
/// apiserver answered in tens of seconds, the Lease check saw the Lease expired and
/// Services backed off for minutes (issue 14). A few dozen keep a 2-core apiserver busy.
pub const RECONCILE_CONCURRENCY: u16 = 16;
/// Retry of a reconcile whose write met a newer version than its cache had.
const STALE_RETRY: Duration = Duration::from_secs(2);

/// Which watch events of a kind whose status the controller writes itself (AddressPool)
/// change what reconciles read: an object added or deleted, a new `generation` (a spec
/// change), a relist that found a different set. A status-only write is none of these:
/// as a bulk-reconcile trigger it made every allocation burst (one pool status write)
/// reconcile every Service, O(N²) for N Services created at once (issue 14).
#[derive(Debug, Default)]
pub struct SpecChanges {
    /// name -> (uid, generation) of every object seen.
    seen: HashMap<String, (String, Option<i64>)>,
    /// Objects of a relist in progress.
    listing: Option<HashMap<String, (String, Option<i64>)>>,
    listed_once: bool,
}

impl SpecChanges {
    /// Whether `ev` changes the spec-level picture (the first listing does not: the
    /// controller reconciles everything when it starts anyway).
    pub fn changed<K: Resource>(&mut self, ev: &watcher::Event<K>) -> bool {
        let id = |o: &K| {
            let m = o.meta();
            (
                m.name.clone().unwrap_or_default(),
                (m.uid.clone().unwrap_or_default(), m.generation),
            )
        };
        match ev {
            watcher::Event::Apply(o) => {
                let (name, v) = id(o);
                self.seen.insert(name, v.clone()) != Some(v)
            }
            watcher::Event::Delete(o) => {
                self.seen.remove(&id(o).0);
                true
            }
            watcher::Event::Init => {
                self.listing = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                let (name, v) = id(o);
                self.listing
                    .get_or_insert_with(HashMap::new)
                    .insert(name, v);
                false
            }
            watcher::Event::InitDone => {
                let listed = self.listing.take().unwrap_or_default();
                let changed = self.listed_once && listed != self.seen;
                self.seen = listed;
                self.listed_once = true;
                changed
            }
        }
    }
}

struct Ctx {
    fence: Fence,
    metrics: ControllerMetrics,
    /// Services waiting for an address of an exhausted pool (creation order decides who
    /// gets a freed one).
    waiters: Mutex<HashMap<String, Waiter>>,
    /// Woken when allocations or pools change, so AddressPool statuses follow.
    pools_changed: Arc<tokio::sync::Notify>,
    pool_objects: Store<AddressPool>,
    client: Client,
    book: Mutex<VipBook>,
    recorder: Recorder,
    slices: Store<EndpointSlice>,
    networks: Store<ExternalNetwork>,
    pools: Store<AddressPool>,
    nodes: Store<Node>,
    advertisements: Store<BGPAdvertisement>,
    /// The ServiceLoadBalancer records, as last seen by the watch: a reconcile reads its
    /// record here, not with a GET (every Service is reconciled at least every 5 min;
    /// with 10 000 Services those GETs alone kept the apiserver busy, issue 14). Writes
    /// still carry the record's resourceVersion, so a stale copy costs a 409 and a
    /// retry, never an overwrite.
    records: Store<ServiceLoadBalancer>,
    failures: Mutex<HashMap<String, u32>>,
    /// Signalled when a VIP is released, so Services waiting for an address look again.
    released: futures::channel::mpsc::UnboundedSender<()>,
}

/// Runs the controller: waits for the Lease, acts while holding it, stops acting the
/// moment it is lost (and starts again, with a fresh VIP book, when it comes back).
pub async fn run(client: Client, opts: ControllerOptions) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &opts.lease_name)
        .with_namespace(&opts.namespace)
        .with_identity(&opts.identity)
        .with_duration(opts.lease_duration)
        .with_grace(opts.lease_duration.div_ceil(3).max(1))
        .build()
        .await
        .context("setting up leader election on the Lease")?;
    let (mut leader, lease_task) = manager.watch().await;
    info!(identity = %opts.identity, lease = %opts.lease_name, "waiting for leadership");
    loop {
        while !*leader.borrow_and_update() {
            if leader.changed().await.is_err() {
                let r = lease_task.await;
                anyhow::bail!("leader election stopped: {r:?}");
            }
        }
        info!(identity = %opts.identity, "became leader; rebuilding the VIP book from the API");
        opts.metrics.is_leader.set(1);
        let fence = Fence {
            leases: Api::namespaced(client.clone(), &opts.namespace),
            lease_name: opts.lease_name.clone(),
            identity: opts.identity.clone(),
        };
        let mut work = tokio::spawn(lead(client.clone(), fence, opts.metrics.clone()));
        let lost = loop {
            tokio::select! {
                r = &mut work => {
                    match r {
                        Ok(Ok(())) => warn!("controller stopped; restarting"),
                        Ok(Err(e)) => warn!(error = %format!("{e:#}"), "controller failed; restarting"),
                        Err(e) => warn!(error = %e, "controller task died; restarting"),
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    break false;
                }
                c = leader.changed() => {
                    if c.is_err() || !*leader.borrow() { break true; }
                }
            }
        };
        opts.metrics.is_leader.set(0);
        if lost {
            warn!("lost leadership; stopping");
            work.abort();
            let _ = work.await;
        } else {
            work.abort();
        }
        // Only the leader speaks for pools and Services.
        opts.metrics.pool_addresses.clear();
        opts.metrics.pool_addresses_in_use.clear();
        opts.metrics.service_ready_backends.clear();
        opts.metrics.service_advertising_nodes.clear();
    }
}

/// Lists what the API records and fills the VIP book: ServiceLoadBalancer statuses first
/// (oldest first), then ingress IPs of managed Services that have none.
pub async fn rebuild_book(client: &Client) -> Result<VipBook, Error> {
    Ok(rebuild(client).await?.0)
}

/// The VIP book and the waiting line, as the API records them: a Service whose record
/// says it waits for a free address (`VIPAllocated` False, `AddressPoolExhausted`) is in
/// line, by its creation time.
async fn rebuild(client: &Client) -> Result<(VipBook, HashMap<String, Waiter>), Error> {
    let mut book = VipBook::default();
    let mut waiters = HashMap::new();
    let svcs: Api<Service> = Api::all(client.clone());
    let services = svcs.list(&ListParams::default()).await?.items;
    let uids: HashMap<String, String> = services
        .iter()
        .map(|s| (key_of(s), s.uid().unwrap_or_default()))
        .collect();
    let networks: HashMap<String, Vec<String>> = Api::<ExternalNetwork>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|n| (n.name_any(), n.spec.address_pools))
        .collect();
    let created: HashMap<String, i64> = services
        .iter()
        .map(|s| (key_of(s), created_secs(s)))
        .collect();
    let slbs: Api<ServiceLoadBalancer> = Api::all(client.clone());
    let mut list = slbs.list(&ListParams::default()).await?.items;
    list.sort_by(|a, b| {
        a.metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0)
            .cmp(&b.metadata.creation_timestamp.as_ref().map(|t| t.0))
    });
    for s in &list {
        let ns = s.namespace().unwrap_or_default();
        let owner = format!("{ns}/{}", s.name_any());
        // A record whose Service is gone (or was re-created) holds nothing: without a
        // garbage collector it would otherwise keep its VIP forever.
        let service_uid = uids.get(&owner);
        let orphan = match service_uid {
            None => true,
            Some(uid) => s
                .owner_references()
                .iter()
                .any(|o| o.kind == "Service" && &o.uid != uid),
        };
        if orphan {
            warn!(record = %owner, "ServiceLoadBalancer without its Service; deleting it");
            match Api::<ServiceLoadBalancer>::namespaced(client.clone(), &ns)
                .delete(&s.name_any(), &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        if let Some(st) = s.status.as_ref() {
            let queued = st.conditions.iter().any(|c| {
                c.type_ == crate::reconcile::condition::VIP_ALLOCATED
                    && c.status == "False"
                    && c.reason == "AddressPoolExhausted"
            });
            if queued && st.vip.is_none() {
                let net = st.external_network.clone().unwrap_or_default();
                let pools = networks.get(&net).cloned().unwrap_or_default();
                waiters.insert(
                    owner.clone(),
                    Waiter {
                        key: owner.clone(),
                        created: created.get(&owner).copied().unwrap_or(i64::MAX),
                        pools,
                    },
                );
            }
        }
        if let Some(vip) = s
            .status
            .as_ref()
            .and_then(|st| st.vip.as_deref())
            .and_then(|v| v.parse::<Ipv4Addr>().ok())
        {
            if !book.restore(vip, &owner) {
                warn!(%vip, %owner, "VIP recorded twice; the older record keeps it");
            }
        }
    }
    for s in &services {
        if !is_managed(s) {
            continue;
        }
        let owner = key_of(s);
        if book.vip_of(&owner).is_some() {
            continue;
        }
        if let Some(vip) = ingress_ip(s) {
            if !book.restore(vip, &owner) {
                warn!(%vip, %owner, "Service shows a VIP held by another Service");
            }
        }
    }
    info!(
        vips = book.len(),
        waiting = waiters.len(),
        "VIP book rebuilt"
    );
    Ok((book, waiters))
}

fn ingress_ip(s: &Service) -> Option<Ipv4Addr> {
    s.status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?
        .first()?
        .ip
        .as_deref()?
        .parse()
        .ok()
}

/// Reflects `api` into a store; the returned stream must be polled to keep it current.
fn reflect<K>(
    api: Api<K>,
) -> (
    Store<K>,
    impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    (store, stream)
}

async fn lead(client: Client, fence: Fence, metrics: ControllerMetrics) -> anyhow::Result<()> {
    let identity = fence.identity.clone();
    let (book, waiters) = rebuild(&client).await?;
    let (slices, slice_stream) = reflect(Api::<EndpointSlice>::all(client.clone()));
    let (networks, net_stream) = reflect(Api::<ExternalNetwork>::all(client.clone()));
    let (pools, pool_writer) = reflector::store();
    let pool_events = watcher(
        Api::<AddressPool>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(pool_writer);
    let (nodes, node_stream) = reflect(Api::<Node>::all(client.clone()));
    let (advertisements, adv_stream) = reflect(Api::<BGPAdvertisement>::all(client.clone()));
    let (records, record_stream) = reflect(Api::<ServiceLoadBalancer>::all(client.clone()));
    let (released, released_rx) = futures::channel::mpsc::unbounded();
    let pools_changed = Arc::new(tokio::sync::Notify::new());
    // Every pool event refreshes the pools' statuses; only a spec change (or a pool
    // added or removed) reconciles every Service: the controller writes pool statuses
    // itself after each burst of allocations (see [`SpecChanges`]).
    let pool_watch = {
        let n = pools_changed.clone();
        let mut changes = SpecChanges::default();
        pool_events.filter_map(move |e| {
            n.notify_one();
            let spec = matches!(&e, Ok(ev) if changes.changed(ev));
            future::ready(spec.then_some(()))
        })
    };
    let cluster_changes = futures::stream::select_all(vec![
        released_rx.boxed(),
        net_stream.map(|_| ()).boxed(),
        pool_watch.boxed(),
        node_stream.map(|_| ()).boxed(),
        adv_stream.map(|_| ()).boxed(),
    ]);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: CONTROLLER_MANAGER.into(),
            instance: Some(identity),
        },
    );
    let ctx = Arc::new(Ctx {
        fence,
        metrics,
        waiters: Mutex::new(waiters),
        pools_changed: pools_changed.clone(),
        pool_objects: pools.clone(),
        client: client.clone(),
        book: Mutex::new(book),
        recorder,
        slices,
        networks,
        pools,
        nodes,
        advertisements,
        records,
        failures: Mutex::new(HashMap::new()),
        released,
    });
    let pool_task = tokio::spawn(report_pools(ctx.clone()));
    struct AbortOnDrop(tokio::task::JoinHandle<()>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _pool_task = AbortOnDrop(pool_task);
    Controller::new(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns_stream(record_stream)
    .watches_stream(slice_stream, |s: EndpointSlice| {
        let ns = s.namespace()?;
        let svc = s.labels().get(SERVICE_NAME_LABEL)?.clone();
        Some(ObjectRef::new(&svc).within(&ns))
    })
    .reconcile_all_on(cluster_changes)
    .with_config(
        ControllerConfig::default()
            .debounce(Duration::from_millis(100))
            .concurrency(RECONCILE_CONCURRENCY),
    )
    .run(timed_reconcile, error_policy, ctx)
    .for_each(|r| {
        if let Err(e) = r {
            tracing::debug!(error = %e, "reconcile");
        }
        future::ready(())
    })
    .await;
    Ok(())
}

fn error_policy(svc: Arc<Service>, err: &Error, ctx: Arc<Ctx>) -> Action {
    let key = key_of(&svc);
    ctx.metrics.reconcile_errors.inc();
    if is_fenced(err) {
        ctx.metrics.fenced_writes.inc();
    }
    if is_stale(err) {
        // The watch cache had an older version than the apiserver: the newer one is on
        // its way and triggers its own reconcile; this retry only bounds the wait should
        // that be missed. Not a failure of the Service: no back-off, no warning.
        tracing::debug!(service = %key, error = %err, "stale read; retrying");
        return Action::requeue(STALE_RETRY);
    }
    let n = {
        let mut f = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = f.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay =
        Duration::from_millis(500u64.saturating_mul(1 << n.min(10))).min(Duration::from_secs(300));
    warn!(service = %key, error = %err, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

async fn wait_ready(ctx: &Ctx) -> Result<(), Error> {
    let all = async {
        let _ = ctx.slices.wait_until_ready().await;
        let _ = ctx.networks.wait_until_ready().await;
        let _ = ctx.pools.wait_until_ready().await;
        let _ = ctx.nodes.wait_until_ready().await;
        let _ = ctx.advertisements.wait_until_ready().await;
        let _ = ctx.records.wait_until_ready().await;
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .map_err(|_| Error::NotReady("caches of the Juneau objects"))
}

fn world(ctx: &Ctx) -> World {
    World {
        networks: ctx
            .networks
            .state()
            .iter()
            .map(|n| (n.name_any(), n.spec.clone()))
            .collect(),
        pools: ctx
            .pools
            .state()
            .iter()
            .map(|p| (p.name_any(), p.spec.clone()))
            .collect(),
        nodes: ctx
            .nodes
            .state()
            .iter()
            .map(|n| (n.name_any(), (**n).clone()))
            .collect(),
        advertisements: ctx
            .advertisements
            .state()
            .iter()
            .map(|a| a.spec.clone())
            .collect(),
        waiters: ctx
            .waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect(),
    }
}

fn service_ref(svc: &Service) -> ObjectReference {
    svc.object_ref(&())
}

async fn publish(
    ctx: &Ctx,
    svc: &Service,
    warning: bool,
    reason: &str,
    message: &str,
    action: &str,
) {
    let ev = KEvent {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note: Some(message.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &service_ref(svc)).await {
        warn!(error = %e, reason, "could not publish Event");
    }
}

/// True when the error is a write this replica must not make (deposed, or the object
/// changed since it was read).
fn is_fenced(err: &Error) -> bool {
    match err {
        Error::Fenced(_) | Error::Stale(_) => true,
        Error::Kube(kube::Error::Api(e)) => e.code == 409,
        _ => false,
    }
}

/// True when a write was refused only because the object changed since the watch cache
/// read it (409 Conflict on a write conditioned on the resourceVersion, or the
/// finalizer patch's resourceVersion test failing).
fn is_stale(err: &Error) -> bool {
    match err {
        Error::Stale(_) => true,
        Error::Kube(kube::Error::Api(e)) => e.code == 409,
        _ => false,
    }
}

impl Fence {
    /// Fails unless the Lease, as the apiserver has it now, names this replica and has
    /// not expired. Called before every batch of writes: a replica that was deposed
    /// while it worked (paused, partitioned) writes nothing. Writes racing the check are
    /// fenced by the `resourceVersion` every write carries.
    async fn check(&self) -> Result<(), Error> {
        let lease = self.leases.get(&self.lease_name).await?;
        let spec = lease.spec.unwrap_or_default();
        let holder = spec.holder_identity.unwrap_or_default();
        if holder != self.identity {
            return Err(Error::Fenced(format!(
                "the Lease is held by {holder:?}, not by this replica ({})",
                self.identity
            )));
        }
        let duration = i64::from(spec.lease_duration_seconds.unwrap_or(0));
        let expires = spec
            .renew_time
            .map(|t| t.0.as_second().saturating_add(duration))
            .unwrap_or(0);
        let now = k8s_openapi::jiff::Timestamp::now().as_second();
        if expires <= now {
            return Err(Error::Fenced(format!(
                "this replica's Lease expired {}s ago",
                now - expires
            )));
        }
        Ok(())
    }
}

async fn timed_reconcile(svc: Arc<Service>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let start = std::time::Instant::now();
    ctx.metrics.reconciles.inc();
    let r = reconcile(svc, ctx.clone()).await;
    ctx.metrics
        .reconcile_duration
        .observe(start.elapsed().as_secs_f64());
    if let Err(e) = &r {
        if is_fenced(e) {
            warn!(error = %e, "write fenced");
        }
    }
    r
}

fn labels_of(key: &str, vip: Ipv4Addr) -> ServiceLabels {
    let (ns, name) = key.split_once('/').unwrap_or(("", key));
    ServiceLabels {
        namespace: ns.into(),
        service: name.into(),
        vip: vip.to_string(),
    }
}

fn forget_service(ctx: &Ctx, key: &str, vip: Option<Ipv4Addr>) {
    if let Some(v) = vip {
        let l = labels_of(key, v);
        ctx.metrics.service_ready_backends.remove(&l);
        ctx.metrics.service_advertising_nodes.remove(&l);
    }
}

/// Applies the Service's `.status.loadBalancer.ingress` (server-side apply, field
/// manager `juneau-controller`, conditioned on the resourceVersion it was decided from).
async fn apply_ingress(
    svcs: &Api<Service>,
    svc: &Service,
    ip: Option<Ipv4Addr>,
) -> Result<(), Error> {
    let ingress = match ip {
        Some(ip) => json!([{"ip": ip.to_string(), "ipMode": "VIP"}]),
        None => json!([]),
    };
    svcs.patch_status(
        &svc.name_any(),
        &PatchParams::apply(CONTROLLER_MANAGER).force(),
        &Patch::Apply(json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": svc.name_any(),
                "namespace": svc.namespace(),
                "resourceVersion": svc.resource_version(),
            },
            "status": {"loadBalancer": {"ingress": ingress}},
        })),
    )
    .await?;
    Ok(())
}

async fn reconcile(svc: Arc<Service>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = svc.namespace().unwrap_or_else(|| "default".into());
    let name = svc.name_any();
    let key = key_of(&svc);
    let svcs: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    let slbs: Api<ServiceLoadBalancer> = Api::namespaced(ctx.client.clone(), &ns);
    let has_finalizer = svc.finalizers().iter().any(|f| f == FINALIZER);
    let deleting = svc.metadata.deletion_timestamp.is_some();

    if deleting || !is_managed(&svc) {
        let held = ctx
            .book
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .vip_of(&key);
        let was_waiting = ctx
            .waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key)
            .is_some();
        if was_waiting {
            // Those behind it move up the line.
            let _ = ctx.released.unbounded_send(());
        }
        if !has_finalizer && held.is_none() {
            return Ok(Action::await_change()); // never ours: strictly untouched
        }
        ctx.fence.check().await?;
        // Ours until now: delete the record, clear the VIP we wrote, drop the finalizer,
        // and only then free the VIP for others.
        match slbs.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        if !deleting {
            if let (Some(shown), Some(v)) = (ingress_ip(&svc), held) {
                if shown == v {
                    apply_ingress(&svcs, &svc, None).await?;
                }
            }
        }
        if has_finalizer {
            remove_finalizer(&svcs, &svc).await?;
        }
        let released = ctx
            .book
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(&key);
        forget_service(&ctx, &key, released);
        if let Some(v) = released {
            info!(service = %key, vip = %v, "VIP released");
            ctx.metrics.releases.inc();
            ctx.pools_changed.notify_one();
            let _ = ctx.released.unbounded_send(());
            if !deleting {
                publish(&ctx, &svc, false, "VIPReleased", &format!("VIP {v} released: the Service is no longer of class juneau.loutres.me/load-balancer"), "Release").await;
            }
        }
        ctx.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        return Ok(Action::await_change());
    }

    let mut svc = svc;
    if !has_finalizer {
        ctx.fence.check().await?;
        svc = Arc::new(add_finalizer(&svcs, &svc).await?);
        // The update triggers another reconcile; do the work now anyway.
    }
    wait_ready(&ctx).await?;

    let previous = ctx
        .records
        .get(&ObjectRef::new(&name).within(&ns))
        .map(|r| (*r).clone());
    let prev_status = previous.as_ref().and_then(|p| p.status.clone());
    let world = world(&ctx);
    let slice_objs: Vec<Arc<EndpointSlice>> = ctx
        .slices
        .state()
        .into_iter()
        .filter(|s| {
            s.namespace().as_deref() == Some(ns.as_str())
                && s.labels().get(SERVICE_NAME_LABEL) == Some(&name)
        })
        .collect();
    let slice_refs: Vec<&EndpointSlice> = slice_objs.iter().map(|s| s.as_ref()).collect();
    let (outcome, held_before, held_now) = {
        let mut book = ctx.book.lock().unwrap_or_else(|e| e.into_inner());
        let held_before = book.vip_of(&key);
        let outcome = reconcile_service(
            &svc,
            prev_status.as_ref(),
            &slice_refs,
            &world,
            &mut book,
            now(),
        );
        (outcome, held_before, book.vip_of(&key))
    };
    {
        let mut w = ctx.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if outcome.queued_on.is_empty() {
            w.remove(&key);
        } else {
            w.insert(
                key.clone(),
                Waiter {
                    key: key.clone(),
                    created: created_secs(&svc),
                    pools: outcome.queued_on.clone(),
                },
            );
        }
    }
    if held_before.is_none() && held_now.is_some() {
        ctx.metrics.allocations.inc();
    }
    if held_now != held_before {
        ctx.pools_changed.notify_one();
        forget_service(&ctx, &key, held_before);
    }
    if let Some(v) = held_now {
        let l = labels_of(&key, v);
        ctx.metrics
            .service_ready_backends
            .get_or_create(&l)
            .set(i64::from(outcome.status.backend_summary.total_ready));
        ctx.metrics
            .service_advertising_nodes
            .get_or_create(&l)
            .set(outcome.status.advertising_nodes.len() as i64);
    }

    // 1. The record (ServiceLoadBalancer), before the Service shows anything.
    let ann = svc.annotations();
    let spec = ServiceLoadBalancerSpec {
        service_name: name.clone(),
        external_network: ann.get(EXTERNAL_NETWORK_ANNOTATION).cloned(),
        requested_ip: ann.get(REQUESTED_IP_ANNOTATION).cloned(),
    };
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Service".into(),
        name: name.clone(),
        uid: svc.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    let spec_changed = previous.as_ref().map(|p| (&p.spec, p.owner_references()))
        != Some((&spec, std::slice::from_ref(&owner)));
    let status_changed = prev_status.as_ref() != Some(&outcome.status);
    let ingress_changed = ingress_ip(&svc) != outcome.ingress_ip;
    if spec_changed || status_changed || ingress_changed {
        ctx.fence.check().await?;
    }
    let pp = PatchParams::apply(CONTROLLER_MANAGER).force();
    let mut record_version = previous.as_ref().and_then(|p| p.resource_version());
    if spec_changed {
        let mut metadata = json!({"name": name, "namespace": ns, "ownerReferences": [owner]});
        if let Some(rv) = &record_version {
            metadata["resourceVersion"] = json!(rv);
        }
        let written = slbs
            .patch(
                &name,
                &pp,
                &Patch::Apply(json!({
                    "apiVersion": "juneau.loutres.me/v1alpha1",
                    "kind": "ServiceLoadBalancer",
                    "metadata": metadata,
                    "spec": spec,
                })),
            )
            .await?;
        record_version = written.resource_version();
    }
    if status_changed {
        write_status(&slbs, &name, record_version, &outcome.status).await?;
    }

    // 2. What the Service shows.
    if ingress_changed {
        apply_ingress(&svcs, &svc, outcome.ingress_ip).await?;
    }

    // 3. Events, only for what changed.
    for n in &outcome.notes {
        publish(&ctx, &svc, n.warning, &n.reason, &n.message, "Reconcile").await;
    }
    ctx.failures
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
    // A Service waiting for an address is woken by the release that frees one; the
    // shorter requeue only bounds the wait should that signal be missed.
    Ok(Action::requeue(if outcome.waiting_for_address {
        Duration::from_secs(60)
    } else {
        Duration::from_secs(300)
    }))
}

/// Server-side apply of a ServiceLoadBalancer's status (field manager
/// `juneau-controller`), conditioned on the record's resourceVersion: fields the status
/// no longer has are dropped by the apply itself.
async fn write_status(
    slbs: &Api<ServiceLoadBalancer>,
    name: &str,
    resource_version: Option<String>,
    status: &ServiceLoadBalancerStatus,
) -> Result<(), Error> {
    let mut metadata = json!({ "name": name });
    if let Some(rv) = resource_version {
        metadata["resourceVersion"] = json!(rv);
    }
    slbs.patch_status(
        name,
        &PatchParams::apply(CONTROLLER_MANAGER).force(),
        &Patch::Apply(json!({
            "apiVersion": "juneau.loutres.me/v1alpha1",
            "kind": "ServiceLoadBalancer",
            "metadata": metadata,
            "status": status,
        })),
    )
    .await?;
    Ok(())
}

/// Keeps every AddressPool's status (addresses total / allocated, `Overlapping`) and the
/// per-pool metrics current; raises a Warning Event on a pool when it starts overlapping.
async fn report_pools(ctx: Arc<Ctx>) {
    let _ = ctx.pool_objects.wait_until_ready().await;
    loop {
        if let Err(e) = report_pools_once(&ctx).await {
            if is_fenced(&e) {
                ctx.metrics.fenced_writes.inc();
            }
            warn!(error = %e, "could not write AddressPool statuses; retrying");
            tokio::time::sleep(Duration::from_secs(2)).await;
            continue;
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), ctx.pools_changed.notified()).await;
        // Let a burst of allocations settle into one write per pool.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn report_pools_once(ctx: &Ctx) -> Result<(), Error> {
    let objects = ctx.pool_objects.state();
    let specs = objects
        .iter()
        .map(|p| (p.name_any(), p.spec.clone()))
        .collect();
    let report = {
        let book = ctx.book.lock().unwrap_or_else(|e| e.into_inner());
        pools::report(&specs, &book)
    };
    ctx.metrics.pool_addresses.clear();
    ctx.metrics.pool_addresses_in_use.clear();
    let api: Api<AddressPool> = Api::all(ctx.client.clone());
    let mut checked = false;
    for pool in objects.iter() {
        let name = pool.name_any();
        let Some(r) = report.get(&name) else { continue };
        let label = PoolLabel { pool: name.clone() };
        ctx.metrics
            .pool_addresses
            .get_or_create(&label)
            .set(i64::try_from(r.total).unwrap_or(i64::MAX));
        ctx.metrics
            .pool_addresses_in_use
            .get_or_create(&label)
            .set(i64::try_from(r.allocated).unwrap_or(i64::MAX));
        let prev = pool.status.clone().unwrap_or_default();
        let overlapping = !r.overlaps.is_empty();
        let (reason, message) = match (&r.invalid, overlapping) {
            (Some(e), _) => ("AddressesInvalid", e.clone()),
            (None, true) => ("AddressesOverlap", r.overlap_message(&name)),
            (None, false) => ("NoOverlap", r.overlap_message(&name)),
        };
        let status_word = if overlapping { "True" } else { "False" };
        let was = prev.conditions.iter().find(|c| c.type_ == OVERLAPPING);
        let cond = k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: OVERLAPPING.into(),
            status: status_word.into(),
            reason: reason.into(),
            message: message.clone(),
            observed_generation: pool.metadata.generation,
            last_transition_time: was
                .filter(|c| c.status == status_word)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(now),
        };
        let status = AddressPoolStatus {
            addresses_total: r.total,
            addresses_allocated: r.allocated,
            conditions: vec![cond],
        };
        if prev == status {
            continue;
        }
        if !checked {
            ctx.fence.check().await?;
            checked = true;
        }
        api.patch_status(
            &name,
            &PatchParams::apply(CONTROLLER_MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "juneau.loutres.me/v1alpha1",
                "kind": "AddressPool",
                "metadata": {"name": name, "resourceVersion": pool.resource_version()},
                "status": status,
            })),
        )
        .await?;
        if overlapping && was.is_none_or(|c| c.status != "True") {
            warn!(pool = %name, "{message}");
            let ev = KEvent {
                type_: EventType::Warning,
                reason: OVERLAP_REASON.into(),
                note: Some(message.chars().take(1000).collect()),
                action: "Validate".into(),
                secondary: None,
            };
            if let Err(e) = ctx.recorder.publish(&ev, &pool.object_ref(&())).await {
                warn!(error = %e, "could not publish Event");
            }
        }
    }
    Ok(())
}

async fn add_finalizer(api: &Api<Service>, svc: &Service) -> Result<Service, Error> {
    let patch = if svc.metadata.finalizers.is_none() {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": svc.resource_version()},
            {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
        ])
    } else {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": svc.resource_version()},
            {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
        ])
    };
    let patch: json_patch::Patch = serde_json::from_value(patch)?;
    match api
        .patch(
            &svc.name_any(),
            &PatchParams {
                field_manager: Some(CONTROLLER_MANAGER.into()),
                ..Default::default()
            },
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(s) => Ok(s),
        // The "test" operation failed: the Service changed since the cache read it.
        Err(kube::Error::Api(e)) if e.code == 422 => Err(Error::Stale(format!(
            "Service {} changed since resourceVersion {}: {}",
            key_of(svc),
            svc.resource_version().unwrap_or_default(),
            e.message
        ))),
        Err(e) => Err(e.into()),
    }
}

async fn remove_finalizer(api: &Api<Service>, svc: &Service) -> Result<(), Error> {
    let Some(i) = svc.finalizers().iter().position(|f| f == FINALIZER) else {
        return Ok(());
    };
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
        {"op": "remove", "path": format!("/metadata/finalizers/{i}")},
    ]))?;
    match api
        .patch(
            &svc.name_any(),
            &PatchParams {
                field_manager: Some(CONTROLLER_MANAGER.into()),
                ..Default::default()
            },
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AddressPoolSpec;
    use watcher::Event;

    fn pool(name: &str, uid: &str, generation: i64, allocated: u64) -> AddressPool {
        let mut p = AddressPool::new(
            name,
            AddressPoolSpec {
                advertise_mode: crate::crd::AdvertiseMode::bgp(),
                addresses: vec!["192.0.2.0/28".into()],
                allow_network_and_broadcast: None,
            },
        );
        p.metadata.uid = Some(uid.into());
        p.metadata.generation = Some(generation);
        p.status = Some(AddressPoolStatus {
            addresses_allocated: allocated,
            ..Default::default()
        });
        p
    }

    #[test]
    fn only_spec_changes_of_a_pool_count_not_its_status() {
        let mut c = SpecChanges::default();
        let init = || Event::<AddressPool>::Init;
        // The first listing: the controller reconciles everything at start anyway.
        assert!(!c.changed(&init()));
        assert!(!c.changed(&Event::InitApply(pool("a", "u1", 1, 0))));
        assert!(!c.changed(&Event::<AddressPool>::InitDone));
        // Status writes (same generation): not a change.
        for n in 1..5 {
            assert!(!c.changed(&Event::Apply(pool("a", "u1", 1, n))));
        }
        // A spec change bumps the generation.
        assert!(c.changed(&Event::Apply(pool("a", "u1", 2, 5))));
        assert!(!c.changed(&Event::Apply(pool("a", "u1", 2, 6))));
        // A new pool, a deleted one, a pool re-created under the same name.
        assert!(c.changed(&Event::Apply(pool("b", "u2", 1, 0))));
        assert!(c.changed(&Event::Delete(pool("b", "u2", 1, 0))));
        assert!(c.changed(&Event::Apply(pool("a", "u3", 1, 0))));
    }

    #[test]
    fn a_relist_counts_only_when_it_finds_a_different_set() {
        let mut c = SpecChanges::default();
        for e in [
            Event::Init,
            Event::InitApply(pool("a", "u1", 1, 0)),
            Event::InitDone,
        ] {
            c.changed(&e);
        }
        // Same pool, only its status moved while the watch was down.
        assert!(!c.changed(&Event::<AddressPool>::Init));
        assert!(!c.changed(&Event::InitApply(pool("a", "u1", 1, 9))));
        assert!(!c.changed(&Event::<AddressPool>::InitDone));
        // A pool deleted while the watch was down.
        assert!(!c.changed(&Event::<AddressPool>::Init));
        assert!(c.changed(&Event::<AddressPool>::InitDone));
        // And added back.
        assert!(!c.changed(&Event::<AddressPool>::Init));
        assert!(!c.changed(&Event::InitApply(pool("a", "u4", 1, 0))));
        assert!(c.changed(&Event::<AddressPool>::InitDone));
    }

    #[test]
    fn conflicts_are_stale_reads_and_other_errors_are_not() {
        let api = |code: u16| {
            Error::Kube(kube::Error::Api(
                kube::core::Status::failure("x", "y")
                    .with_code(code)
                    .boxed(),
            ))
        };
        assert!(is_stale(&api(409)));
        assert!(is_stale(&Error::Stale("changed".into())));
        assert!(!is_stale(&api(422)));
        assert!(!is_stale(&api(500)));
        assert!(!is_stale(&Error::Fenced("deposed".into())));
        assert!(!is_stale(&Error::NotReady("caches")));
    }
}
