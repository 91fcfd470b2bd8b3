//! How the controller writes a Service's ServiceLoadBalancer record.
//!
//! The shipped CRD has no status subresource (since 2026-12-07): the record is written
//! by the controller alone, like an EndpointSlice, so its spec and status go in **one**
//! request — a create (POST) for a new record, a merge patch of what changed for an
//! existing one ([`crate::status_patch::record_patch`]). A new Service costs two object
//! writes (the record, the Service's status) instead of three, and one round trip less
//! (perf/README.md, "Control-plane scale").
//!
//! A cluster may still have the earlier CRD, with the subresource (Helm never upgrades a
//! chart's `crds/`): the apiserver then drops the status of such a write without an
//! error. The controller finds that out from its answer — the record it returns does not
//! carry the status sent — writes the status through `/status` at once, and from then on
//! writes the spec and the status apart, as before ([`RecordShape`]). An answer 404 from
//! `/status` (the subresource is gone: the CRD was upgraded) turns it back. Nothing to
//! configure, nothing lost in either direction; `k8s-sync/tests/record_shape.rs`.
//!
//! Owns only these requests; what the record says is decided elsewhere
//! ([`crate::reconcile`]), and when to write (the Lease, `OwnWrites`) by the controller.

use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, Patch, PatchParams, PostParams, ResourceExt};
use serde_json::json;
use tracing::info;

use crate::crd::{
    ServiceLoadBalancer, ServiceLoadBalancerSpec, ServiceLoadBalancerStatus, CONTROLLER_MANAGER,
};
use crate::Error;

/// Whether the installed ServiceLoadBalancer CRD has a status subresource, as the
/// apiserver's answers showed it (assumed not: the shipped CRD).
#[derive(Debug, Default)]
pub struct RecordShape {
    status_subresource: AtomicBool,
}

impl RecordShape {
    /// Whether the status is written apart, through `/status`.
    pub fn status_subresource(&self) -> bool {
        self.status_subresource.load(Ordering::Relaxed)
    }

    fn learn(&self, status_subresource: bool, why: &str) {
        if self
            .status_subresource
            .swap(status_subresource, Ordering::Relaxed)
            != status_subresource
        {
            info!(
                status_subresource,
                "the ServiceLoadBalancer CRD {}: {why}",
                if status_subresource {
                    "has a status subresource (an earlier CRD): spec and status are written apart"
                } else {
                    "has no status subresource: spec and status are written in one request"
                }
            );
        }
    }
}

/// A merge patch's parameters: Juneau's field manager (an `Update` entry in
/// `managedFields`).
pub fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(CONTROLLER_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// The record as the controller wants it (metadata: name, namespace, owner).
pub fn desired(
    name: &str,
    ns: &str,
    owner: &OwnerReference,
    spec: &ServiceLoadBalancerSpec,
    status: &ServiceLoadBalancerStatus,
) -> ServiceLoadBalancer {
    ServiceLoadBalancer {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: spec.clone(),
        status: Some(status.clone()),
    }
}

/// Writes the record `want` (with its status) in one request: created when `previous`
/// (the watch's copy) is `None` (a 409 if the watch is behind: retried as a stale read),
/// else a merge patch of what changed, conditioned on `previous`'s resourceVersion.
/// Where the CRD turns out to have a status subresource, the status follows through
/// `/status`. Returns the record's resourceVersion after the write(s).
pub async fn write_record(
    shape: &RecordShape,
    slbs: &Api<ServiceLoadBalancer>,
    previous: Option<&ServiceLoadBalancer>,
    want: &ServiceLoadBalancer,
) -> Result<Option<String>, Error> {
    let name = want.name_any();
    let Some(status) = want.status.as_ref() else {
        return Err(Error::Stale(format!(
            "record {name} without a status to write"
        )));
    };
    // The status was dropped: a create answered without one, or a patch of it answered
    // with the status the record had before (the apiserver's own copy, so the same
    // rendering as the watch's).
    let (written, dropped) = match previous {
        None => {
            let pp = PostParams {
                field_manager: Some(CONTROLLER_MANAGER.into()),
                ..PostParams::default()
            };
            let written = slbs.create(&pp, want).await?;
            let dropped = written.status.is_none();
            (written, dropped)
        }
        Some(prev) => {
            let rv = prev.resource_version();
            let Some(patch) = crate::status_patch::record_patch(
                &serde_json::to_value(prev)?,
                &serde_json::to_value(want)?,
                rv.as_deref(),
            ) else {
                return Ok(rv);
            };
            let written = slbs
                .patch(&name, &merge_params(), &Patch::Merge(&patch))
                .await?;
            let dropped = patch.get("status").is_some()
                && serde_json::to_value(&written.status)? == serde_json::to_value(&prev.status)?;
            (written, dropped)
        }
    };
    let version = written.resource_version();
    if !dropped {
        return Ok(version);
    }
    shape.learn(
        true,
        "a write of the whole record came back without its status",
    );
    write_status(shape, slbs, &name, version, written.status.as_ref(), status).await
}

/// Writes a ServiceLoadBalancer's status through `/status` as a JSON merge patch from
/// the status the decision read, `prev` ([`crate::status_patch`]: fields it no longer
/// has are removed), conditioned on the record's resourceVersion. A 404 while the record
/// exists means the subresource is gone (the CRD was upgraded): noted, and retried as a
/// stale read, the next reconcile writes the whole record.
pub async fn write_status(
    shape: &RecordShape,
    slbs: &Api<ServiceLoadBalancer>,
    name: &str,
    resource_version: Option<String>,
    prev: Option<&ServiceLoadBalancerStatus>,
    status: &ServiceLoadBalancerStatus,
) -> Result<Option<String>, Error> {
    let prev = prev.map(|p| json!(p));
    let Some(patch) = crate::status_patch::status_patch(
        prev.as_ref(),
        &json!(status),
        resource_version.as_deref(),
    ) else {
        return Ok(resource_version);
    };
    match slbs
        .patch_status(name, &merge_params(), &Patch::Merge(patch))
        .await
    {
        Ok(written) => Ok(written.resource_version()),
        Err(kube::Error::Api(e)) if e.code == 404 && slbs.get_opt(name).await?.is_some() => {
            shape.learn(
                false,
                "the record's /status answered 404 while the record exists",
            );
            Err(Error::Stale(format!(
                "no status subresource on ServiceLoadBalancer {name} any more: {}",
                e.message
            )))
        }
        Err(e) => Err(e.into()),
    }
}

/// Server-side apply of a ServiceLoadBalancer's metadata and spec (it creates the
/// record), conditioned on `resource_version` when given; returns the record's new
/// resourceVersion. Only where the CRD has a status subresource.
pub async fn apply_spec(
    slbs: &Api<ServiceLoadBalancer>,
    name: &str,
    ns: &str,
    owner: &OwnerReference,
    spec: &ServiceLoadBalancerSpec,
    resource_version: Option<String>,
) -> Result<Option<String>, Error> {
    let mut metadata = json!({"name": name, "namespace": ns, "ownerReferences": [owner]});
    if let Some(rv) = resource_version {
        metadata["resourceVersion"] = json!(rv);
    }
    let written = slbs
        .patch(
            name,
            &PatchParams::apply(CONTROLLER_MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "juneau.loutres.me/v1alpha1",
                "kind": "ServiceLoadBalancer",
                "metadata": metadata,
                "spec": spec,
            })),
        )
        .await?;
    Ok(written.resource_version())
}
