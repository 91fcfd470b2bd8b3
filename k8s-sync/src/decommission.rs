//! Decommissioning Juneau's nodes (`helm uninstall`, docs/operations.md "Uninstall").
//!
//! * The request: the annotation [`REQUEST_ANNOTATION`] on the node DaemonSet, whose
//!   value is a token. It stands exactly as long as the DaemonSet exists, so a fresh
//!   install (a new DaemonSet) never inherits it, and an ordinary restart or rolling
//!   update (no annotation) keeps graceful restart and the pinned flows.
//! * The chart's `pre-delete` hook ([`run_hook`], `juneau-k8s-sync decommission`) sets it
//!   and waits, bounded, until every node running a node Pod reports the token in its
//!   `NodeBGPStatus` (`status.decommissioned`).
//! * Each agent ([`watch_request`], [`carry_out`]) writes the request into its Pod's
//!   decommission directory (`juneau_control::decommission`), waits until the dataplane,
//!   the speaker and BFD acknowledged, removes the node's remaining files in
//!   `/run/juneau`, reports the token, and idles until the Pod is deleted.
//!
//! The decisions (is the annotation a request, which nodes are still pending) are pure
//! functions with unit tests; the rest is thin glue.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use futures::StreamExt as _;
use juneau_control::decommission::{self as files, Component};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::Client;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::crd::NodeBGPStatus;

/// The annotation on the node DaemonSet that asks every node to decommission; its value
/// is the request's token.
pub const REQUEST_ANNOTATION: &str = "juneau.loutres.me/decommission";
/// Field manager of the agent's decommission report (apart from [`crate::speaker_status`]'s).
pub const REPORT_MANAGER: &str = "juneau-agent-decommission";
/// Longest token accepted (an annotation value can be much longer; a token is short).
const MAX_TOKEN: usize = 63;

/// Why an annotation value is not a decommission request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    /// Empty or blank.
    #[error("the juneau.loutres.me/decommission annotation is empty")]
    Empty,
    /// Longer than [`MAX_TOKEN`].
    #[error("the juneau.loutres.me/decommission annotation is {0} characters long, at most 63")]
    TooLong(usize),
    /// A character other than ASCII letters, digits, `-`, `.`, `_`, `:`.
    #[error("the juneau.loutres.me/decommission annotation {0:?} holds a character other than letters, digits, '-', '.', '_', ':'")]
    BadCharacter(String),
}

/// The request a DaemonSet's annotations carry: `Ok(None)` without the annotation.
pub fn request_token(
    annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<String>, BadRequest> {
    let Some(v) = annotations.and_then(|a| a.get(REQUEST_ANNOTATION)) else {
        return Ok(None);
    };
    let v = v.trim();
    if v.is_empty() {
        return Err(BadRequest::Empty);
    }
    if v.len() > MAX_TOKEN {
        return Err(BadRequest::TooLong(v.len()));
    }
    if !v
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b))
    {
        return Err(BadRequest::BadCharacter(v.to_string()));
    }
    Ok(Some(v.to_string()))
}

/// A fresh token for a request made at `unix_ms`.
pub fn new_token(unix_ms: u128) -> String {
    format!("uninstall-{unix_ms}")
}

/// Which of the `expected` nodes reported `token`, and which did not yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Nodes that carried the request out.
    pub done: BTreeSet<String>,
    /// Nodes still to report.
    pub pending: BTreeSet<String>,
}

/// Sorts `expected` by the tokens `reports` give (node, reported token).
pub fn progress<'a>(
    expected: &BTreeSet<String>,
    reports: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    token: &str,
) -> Progress {
    let reported: BTreeSet<&str> = reports
        .into_iter()
        .filter(|(_, t)| *t == Some(token))
        .map(|(n, _)| n)
        .collect();
    let (done, pending) = expected
        .iter()
        .cloned()
        .partition(|n| reported.contains(n.as_str()));
    Progress { done, pending }
}

/// Settings of the `pre-delete` hook.
#[derive(Debug, Clone)]
pub struct HookOptions {
    /// The release namespace.
    pub namespace: String,
    /// The node DaemonSet.
    pub daemonset: String,
    /// Longest wait for every node.
    pub timeout: Duration,
}

/// The hook: sets the request on the DaemonSet (keeping a token already there: a
/// retried uninstall) and waits until every node running a node Pod reported it.
pub async fn run_hook(client: Client, opts: HookOptions) -> anyhow::Result<()> {
    let started = Instant::now();
    let ds_api: Api<DaemonSet> = Api::namespaced(client.clone(), &opts.namespace);
    let where_ = format!("DaemonSet {}/{}", opts.namespace, opts.daemonset);
    let Some(ds) = ds_api
        .get_opt(&opts.daemonset)
        .await
        .with_context(|| format!("reading {where_}"))?
    else {
        info!("{where_} does not exist: no node to decommission");
        return Ok(());
    };
    let token = match request_token(ds.metadata.annotations.as_ref()) {
        Ok(Some(t)) => t,
        Ok(None) | Err(_) => {
            let t = new_token(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or(0),
            );
            let patch = serde_json::json!({"metadata": {"annotations": {REQUEST_ANNOTATION: t}}});
            ds_api
                .patch(
                    &opts.daemonset,
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .with_context(|| format!("annotating {where_} with {REQUEST_ANNOTATION}"))?;
            t
        }
    };
    info!(token = %token, "decommission requested on {where_}: waiting for every node (at most {:?})", opts.timeout);
    let selector = ds
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .filter(|s| !s.is_empty())
        .with_context(|| format!("{where_} has no matchLabels selector"))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &opts.namespace);
    let statuses: Api<NodeBGPStatus> = Api::all(client);
    let mut last: Option<Progress> = None;
    let mut last_log = Instant::now();
    loop {
        let expected: BTreeSet<String> = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .context("listing the node Pods")?
            .items
            .into_iter()
            .filter_map(|p| p.spec?.node_name)
            .collect();
        let reports = statuses
            .list(&ListParams::default())
            .await
            .context("listing NodeBGPStatuses")?;
        let p = progress(
            &expected,
            reports.items.iter().map(|s| {
                (
                    s.spec.node.as_str(),
                    s.status
                        .as_ref()
                        .and_then(|st| st.decommissioned.as_deref()),
                )
            }),
            &token,
        );
        if p.pending.is_empty() {
            info!(nodes = ?p.done, took = ?started.elapsed(), "every node decommissioned");
            return Ok(());
        }
        if last.as_ref() != Some(&p) || last_log.elapsed() >= Duration::from_secs(10) {
            info!(done = ?p.done, pending = ?p.pending, "waiting for nodes to decommission");
            last_log = Instant::now();
            last = Some(p.clone());
        }
        if started.elapsed() >= opts.timeout {
            bail!(
                "nodes {:?} did not decommission within {:?} (their juneau-node Pods' agent logs say why: \
                 kubectl -n {} logs <pod> -c agent). Their XDP programs, pins and /run/juneau files may stay; \
                 `helm uninstall --no-hooks` uninstalls without waiting (docs/operations.md, \"Uninstall\")",
                p.pending,
                opts.timeout,
                opts.namespace
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Watches the node DaemonSet for the request. The token, once seen, stays (latched):
/// helm deletes the DaemonSet — and with it the annotation — before the node Pods end,
/// and nothing may attach again meanwhile. A malformed annotation is logged and ignored.
pub fn watch_request(
    client: Client,
    namespace: &str,
    daemonset: &str,
) -> watch::Receiver<Option<String>> {
    let (tx, rx) = watch::channel(None);
    let api: Api<DaemonSet> = Api::namespaced(client, namespace);
    let wc = watcher::Config::default().fields(&format!("metadata.name={daemonset}"));
    let name = daemonset.to_string();
    tokio::spawn(async move {
        let mut events = crate::caches::watch(api, wc).applied_objects().boxed();
        let mut bad: Option<BadRequest> = None;
        while let Some(ev) = events.next().await {
            let ds = match ev {
                Ok(ds) => ds,
                Err(e) => {
                    warn!(error = %e, "watching DaemonSet {name} for a decommission request (retrying with backoff)");
                    continue;
                }
            };
            match request_token(ds.metadata.annotations.as_ref()) {
                Ok(Some(t)) => {
                    let _ = tx.send(Some(t));
                    // Latched: the sender stays, so the agent never sees the channel close.
                    std::future::pending::<()>().await;
                }
                Ok(None) => {}
                Err(e) if bad.as_ref() != Some(&e) => {
                    warn!(error = %e, "ignoring the decommission request");
                    bad = Some(e);
                }
                Err(_) => {}
            }
        }
    });
    rx
}

/// Where the agent carries a request out.
#[derive(Debug, Clone)]
pub struct NodeDecommission {
    /// The node.
    pub node: String,
    /// The Pod's decommission directory (`--decommission-dir`).
    pub dir: PathBuf,
    /// The node's shared directory (`/run/juneau`).
    pub shm_dir: PathBuf,
}

/// The agent's part: hands the request to the node's components, waits for their
/// acknowledgements (logging which are missing every 10 s), removes the node's
/// remaining files, and reports the token in `NodeBGPStatus/<node>` (retried until it
/// is written). Idempotent: a restarted agent carries the same request out again.
pub async fn carry_out(client: Client, d: &NodeDecommission, token: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    files::request(&d.dir, token)
        .with_context(|| format!("writing the decommission request into {}", d.dir.display()))?;
    info!(token, dir = %d.dir.display(), "decommissioning the node: waiting for the dataplane, the speaker and BFD");
    let mut last_log = Instant::now();
    loop {
        let missing: Vec<&str> = Component::ALL
            .iter()
            .filter(|c| !files::acknowledged(&d.dir, **c))
            .map(|c| c.name())
            .collect();
        if missing.is_empty() {
            break;
        }
        if last_log.elapsed() >= Duration::from_secs(10) {
            warn!(?missing, waited = ?started.elapsed(), "decommission: components not done yet");
            last_log = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let removed = files::remove_node_files(&d.shm_dir, &d.node)
        .with_context(|| format!("removing {}'s files in {}", d.node, d.shm_dir.display()))?;
    info!(?removed, took = ?started.elapsed(), "decommissioned: components done, node files removed; reporting");
    report(client, &d.node, token).await;
    Ok(())
}

/// Writes `status.decommissioned = token` into `NodeBGPStatus/<node>` (created if
/// missing), retrying every second until it is written.
async fn report(client: Client, node: &str, token: &str) {
    let api: Api<NodeBGPStatus> = Api::all(client);
    let pp = PatchParams::apply(REPORT_MANAGER).force();
    let obj = serde_json::json!({
        "apiVersion": "juneau.loutres.me/v1alpha1",
        "kind": "NodeBGPStatus",
        "metadata": {"name": node},
        "spec": {"node": node},
    });
    let st = serde_json::json!({
        "apiVersion": "juneau.loutres.me/v1alpha1",
        "kind": "NodeBGPStatus",
        "metadata": {"name": node},
        "status": {"decommissioned": token},
    });
    let mut last_error = String::new();
    loop {
        let r = match api.get_opt(node).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => api.patch(node, &pp, &Patch::Apply(&obj)).await.map(|_| ()),
            Err(e) => Err(e),
        };
        let r = match r {
            Ok(()) => api
                .patch_status(node, &pp, &Patch::Apply(&st))
                .await
                .map(|_| ()),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => {
                info!(token, "reported in NodeBGPStatus/{node}: decommissioned");
                return;
            }
            Err(e) => {
                let text = e.to_string();
                if text != last_error {
                    warn!(error = %text, "reporting the decommission in NodeBGPStatus/{node} failed; retrying every second");
                    last_error = text;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Clears an earlier uninstall's report from `NodeBGPStatus/<node>` (a fresh install
/// on the same cluster: the object is the Node's and outlives the release). Applying an
/// empty status with [`REPORT_MANAGER`] drops the field that manager owned; a missing
/// object has nothing to clear. Best effort: logged, never fatal.
pub async fn clear_report(client: Client, node: String) {
    let api: Api<NodeBGPStatus> = Api::all(client);
    match api.get_opt(&node).await {
        Ok(Some(o))
            if o.status
                .as_ref()
                .is_some_and(|s| s.decommissioned.is_some()) => {}
        Ok(_) => return,
        Err(e) => {
            warn!(error = %e, "reading NodeBGPStatus/{node} to clear an old decommission report");
            return;
        }
    }
    let st = serde_json::json!({
        "apiVersion": "juneau.loutres.me/v1alpha1",
        "kind": "NodeBGPStatus",
        "metadata": {"name": node},
        "status": {},
    });
    let pp = PatchParams::apply(REPORT_MANAGER).force();
    match api.patch_status(&node, &pp, &Patch::Apply(&st)).await {
        Ok(_) => info!("cleared an earlier uninstall's report from NodeBGPStatus/{node}"),
        Err(e) => warn!(error = %e, "clearing the old decommission report of NodeBGPStatus/{node}"),
    }
}

/// Whether `dir` holds a request already (a restarted agent finishes it).
pub fn standing(dir: &Path) -> Option<String> {
    files::requested(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(v: &str) -> BTreeMap<String, String> {
        [(REQUEST_ANNOTATION.to_string(), v.to_string())].into()
    }

    #[test]
    fn the_annotation_is_a_request_only_when_it_is_a_token() {
        assert_eq!(request_token(None), Ok(None));
        assert_eq!(request_token(Some(&BTreeMap::new())), Ok(None));
        assert_eq!(
            request_token(Some(&ann("uninstall-1790000000000"))),
            Ok(Some("uninstall-1790000000000".into()))
        );
        assert_eq!(
            request_token(Some(&ann(" a:b.c_d "))),
            Ok(Some("a:b.c_d".into()))
        );
        assert_eq!(request_token(Some(&ann("  "))), Err(BadRequest::Empty));
        assert_eq!(
            request_token(Some(&ann(&"x".repeat(64)))),
            Err(BadRequest::TooLong(64))
        );
        let e = request_token(Some(&ann("a/b"))).unwrap_err();
        assert!(e.to_string().contains("\"a/b\""), "{e}");
        assert_eq!(new_token(1790000000123), "uninstall-1790000000123");
        assert_eq!(
            request_token(Some(&ann(&new_token(u128::from(u64::MAX))))),
            Ok(Some(new_token(u128::from(u64::MAX))))
        );
    }

    #[test]
    fn progress_counts_only_expected_nodes_with_this_token() {
        let expected: BTreeSet<String> = ["node-a", "node-b", "node-c"]
            .into_iter()
            .map(String::from)
            .collect();
        let p = progress(
            &expected,
            [
                ("node-a", Some("t2")),
                ("node-b", Some("t1")), // an earlier uninstall's token
                ("node-c", None),
                ("node-d", Some("t2")), // no node Pod there: not waited for
            ],
            "t2",
        );
        assert_eq!(p.done, ["node-a".to_string()].into());
        assert_eq!(
            p.pending,
            ["node-b".to_string(), "node-c".to_string()].into()
        );
        let all = progress(
            &expected,
            [
                ("node-a", Some("t")),
                ("node-b", Some("t")),
                ("node-c", Some("t")),
            ],
            "t",
        );
        assert!(all.pending.is_empty() && all.done.len() == 3);
        assert_eq!(progress(&BTreeSet::new(), [], "t"), Progress::default());
    }
}
