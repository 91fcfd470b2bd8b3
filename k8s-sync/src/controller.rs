//! The cluster controller: leader election on a Lease, the VIP book rebuilt from the API,
//! and the kube-runtime Controller that runs [`crate::reconcile::reconcile_service`] for
//! every Service and writes what it decided.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{future, StreamExt};
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
    AddressPool, BGPAdvertisement, ExternalNetwork, ServiceLoadBalancer, ServiceLoadBalancerSpec,
    ServiceLoadBalancerStatus, CONTROLLER_MANAGER, EXTERNAL_NETWORK_ANNOTATION, FINALIZER,
    REQUESTED_IP_ANNOTATION,
};
use crate::endpoints::SERVICE_NAME_LABEL;
use crate::reconcile::{is_managed, key_of, reconcile_service, World};
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
}

struct Ctx {
    client: Client,
    book: Mutex<VipBook>,
    recorder: Recorder,
    slices: Store<EndpointSlice>,
    networks: Store<ExternalNetwork>,
    pools: Store<AddressPool>,
    nodes: Store<Node>,
    advertisements: Store<BGPAdvertisement>,
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
        let mut work = tokio::spawn(lead(client.clone(), opts.identity.clone()));
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
        if lost {
            warn!("lost leadership; stopping");
            work.abort();
            let _ = work.await;
        }
    }
}

/// Lists what the API records and fills the VIP book: ServiceLoadBalancer statuses first
/// (oldest first), then ingress IPs of managed Services that have none.
pub async fn rebuild_book(client: &Client) -> Result<VipBook, Error> {
    let mut book = VipBook::default();
    let svcs: Api<Service> = Api::all(client.clone());
    let services = svcs.list(&ListParams::default()).await?.items;
    let uids: HashMap<String, String> = services
        .iter()
        .map(|s| (key_of(s), s.uid().unwrap_or_default()))
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
    info!(vips = book.len(), "VIP book rebuilt");
    Ok(book)
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

async fn lead(client: Client, identity: String) -> anyhow::Result<()> {
    let book = rebuild_book(&client).await?;
    let (slices, slice_stream) = reflect(Api::<EndpointSlice>::all(client.clone()));
    let (networks, net_stream) = reflect(Api::<ExternalNetwork>::all(client.clone()));
    let (pools, pool_stream) = reflect(Api::<AddressPool>::all(client.clone()));
    let (nodes, node_stream) = reflect(Api::<Node>::all(client.clone()));
    let (advertisements, adv_stream) = reflect(Api::<BGPAdvertisement>::all(client.clone()));
    let (released, released_rx) = futures::channel::mpsc::unbounded();
    let cluster_changes = futures::stream::select_all(vec![
        released_rx.boxed(),
        net_stream.map(|_| ()).boxed(),
        pool_stream.map(|_| ()).boxed(),
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
        client: client.clone(),
        book: Mutex::new(book),
        recorder,
        slices,
        networks,
        pools,
        nodes,
        advertisements,
        failures: Mutex::new(HashMap::new()),
        released,
    });
    Controller::new(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(
        Api::<ServiceLoadBalancer>::all(client.clone()),
        watcher::Config::default(),
    )
    .watches_stream(slice_stream, |s: EndpointSlice| {
        let ns = s.namespace()?;
        let svc = s.labels().get(SERVICE_NAME_LABEL)?.clone();
        Some(ObjectRef::new(&svc).within(&ns))
    })
    .reconcile_all_on(cluster_changes)
    .with_config(ControllerConfig::default().debounce(Duration::from_millis(100)))
    .run(reconcile, error_policy, ctx)
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
        if !has_finalizer && held.is_none() {
            return Ok(Action::await_change()); // never ours: strictly untouched
        }
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
                    svcs.patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": null}}})),
                    )
                    .await?;
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
        if let Some(v) = released {
            info!(service = %key, vip = %v, "VIP released");
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

    if !has_finalizer {
        add_finalizer(&svcs, &svc).await?;
        // The update triggers another reconcile; do the work now anyway.
    }
    wait_ready(&ctx).await?;

    let previous = slbs.get_opt(&name).await?;
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
    let outcome = {
        let mut book = ctx.book.lock().unwrap_or_else(|e| e.into_inner());
        reconcile_service(
            &svc,
            prev_status.as_ref(),
            &slice_refs,
            &world,
            &mut book,
            now(),
        )
    };

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
    let pp = PatchParams::apply(CONTROLLER_MANAGER).force();
    if previous.as_ref().map(|p| (&p.spec, p.owner_references()))
        != Some((&spec, std::slice::from_ref(&owner)))
    {
        slbs.patch(
            &name,
            &pp,
            &Patch::Apply(json!({
                "apiVersion": "juneau.loutres.me/v1alpha1",
                "kind": "ServiceLoadBalancer",
                "metadata": {"name": name, "namespace": ns, "ownerReferences": [owner]},
                "spec": spec,
            })),
        )
        .await?;
    }
    if prev_status.as_ref() != Some(&outcome.status) {
        write_status(&slbs, &name, &outcome.status).await?;
    }

    // 2. What the Service shows.
    if ingress_ip(&svc) != outcome.ingress_ip {
        let ingress = match outcome.ingress_ip {
            Some(ip) => json!([{"ip": ip.to_string(), "ipMode": "VIP"}]),
            None => json!(null),
        };
        svcs.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": ingress}}})),
        )
        .await?;
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

async fn write_status(
    slbs: &Api<ServiceLoadBalancer>,
    name: &str,
    status: &ServiceLoadBalancerStatus,
) -> Result<(), Error> {
    // A merge patch keeps fields it does not mention: name the ones that went away.
    let mut v = serde_json::to_value(status)?;
    if let Some(m) = v.as_object_mut() {
        for k in [
            "vip",
            "addressPool",
            "externalNetwork",
            "observedGeneration",
        ] {
            m.entry(k).or_insert(serde_json::Value::Null);
        }
    }
    slbs.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": v })),
    )
    .await?;
    Ok(())
}

async fn add_finalizer(api: &Api<Service>, svc: &Service) -> Result<(), Error> {
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
    api.patch(
        &svc.name_any(),
        &PatchParams::default(),
        &Patch::<()>::Json(patch),
    )
    .await?;
    Ok(())
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
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}
