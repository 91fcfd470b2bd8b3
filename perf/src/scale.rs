//! Control-plane scale: N Services (3 endpoints each, default N = 10 000) created at once
//! against the real control plane of one node ([`crate::convergence::Bed`]: etcd +
//! kube-apiserver, `juneau-k8s-sync controller` and `agent`, `juneau-bgp`, BIRD 2).
//!
//! Two ways to create them ([`Creation`]): while the daemons run, `t0` = just before the
//! first create (the apiserver's creation rate is then part of every figure), or
//! `--scale-precreated`: all created before any Juneau daemon starts, `t0` = the daemons'
//! start (Juneau's own convergence from a cold start with N Services waiting). Live, the
//! baseline is taken first on the same bed, before the daemons start: the same client code
//! creates the same objects (the apiserver alone: its time is the live target's
//! baseline), then deletes them and waits until none is left.
//!
//! Juneau's API writes per Service ([`juneau_writes_per_service`]) come from the
//! apiserver's request counters over the run, less juneau-perf's own creates.
//!
//! Measured from `t0` (live: just before the first create is sent): when every Service shows
//! its VIP (`.status.loadBalancer.ingress`), when every ServiceLoadBalancer is `Ready`,
//! when the agent's shared-memory state advertises all N VIPs (and how often it
//! published, its CPU time, the state file's size), when BIRD has all N /32s, and the
//! memory (RSS now / peak) of every process of the bed. Observers poll: the API every
//! second (a list of N objects), BIRD's route count every 200 ms, the shared memory
//! through its futex (microseconds), so each figure is late by at most its poll interval
//! (stated in the report).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use juneau_control::shm::NodeStateReader;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject, PostParams};
use kube::runtime::watcher;

use crate::convergence::{start_bed_with, Binaries, NODE};
use crate::plan::INTERRUPTED;
pub use crate::scale_data::{markdown, ApiRequests, Rss, ScaleReport, LOG_DIR};
use juneau_tests::bird::BirdControl as Birdc;

/// Creates in flight at once.
const CONCURRENCY: usize = 32;
/// How often the wait prints its progress.
const PROGRESS: Duration = Duration::from_secs(5);
/// BIRD observer's poll interval.
const BIRD_POLL: Duration = Duration::from_millis(200);

/// Sends a create (or delete) at most this many times: an apiserver whose etcd is slow on
/// a loaded machine answers some with 500 (seen with 10 000 Services: etcd "apply request
/// took too long") or 429; those are retried after a pause. The client's own retries
/// are off ([`api_client`]), so every request sent is one of these attempts and counted
/// in [`Sent`].
const CREATE_ATTEMPTS: u32 = 8;

/// Runs `f` until it succeeds or answers one of `done` (for a create, 409: names are
/// unique to this run, so "already exists" means an earlier attempt landed; for a
/// delete, 404); retries 5xx and 429. Returns how many requests it sent.
async fn with_retries<T, F, Fut>(done: u16, mut f: F) -> Result<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        match f().await {
            Ok(_) => return Ok(u64::from(attempt)),
            Err(kube::Error::Api(e)) if e.code == done => return Ok(u64::from(attempt)),
            Err(kube::Error::Api(e))
                if (e.code >= 500 || e.code == 429) && attempt < CREATE_ATTEMPTS =>
            {
                tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The requests one pass of creates sent, retries included (the apiserver counted each:
/// those it answered 409, 429 or 5xx too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sent {
    /// POSTs of Services.
    services: u64,
    /// POSTs of EndpointSlices.
    slices: u64,
}

impl Sent {
    /// Requests beyond one per object (`n` Services and `n` EndpointSlices).
    fn retries(&self, n: u32) -> u64 {
        (self.services + self.slices).saturating_sub(2 * u64::from(n))
    }
}

/// The baseline of a live run: the apiserver alone (no Juneau daemon running) creating
/// the same objects with the same client code.
#[derive(Debug, Clone, Copy)]
struct Baseline {
    /// From just before the first create to the last create's answer.
    create: Duration,
    /// kube-apiserver's CPU time over `create`, s.
    apiserver_cpu_s: f64,
    /// Its creates retried.
    retries: u64,
    /// Deleting them all again, until none was left.
    delete: Duration,
}

/// What was done on the bed before the Juneau daemons started.
enum Before {
    /// Live: the apiserver-alone baseline.
    Baseline(Baseline),
    /// Precreated: every object was created, taking `create` with `retries` retried
    /// creates; the apiserver's request counters just after.
    Precreated {
        create: Duration,
        retries: u64,
        requests: std::collections::BTreeMap<(String, String), u64>,
    },
}

/// When the scale measurement creates its Services and EndpointSlices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Creation {
    /// While the Juneau daemons run; `t0` = just before the first create.
    #[default]
    Live,
    /// Before any Juneau daemon starts; `t0` = the daemons' start, so the figures are
    /// Juneau's own convergence, not the apiserver's creation rate.
    Precreated,
}

/// Reads `apiserver_request_total` from the apiserver's `/metrics` text: requests by
/// (verb, resource[/subresource]), summed over codes, groups and scopes.
fn api_request_counts(metrics: &str) -> std::collections::BTreeMap<(String, String), u64> {
    let mut counts = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split("\",")
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let (resource, sub) = (label("resource"), label("subresource"));
        if resource.is_empty() {
            continue; // non-resource URLs (/healthz, /metrics ...)
        }
        let resource = if sub.is_empty() {
            resource
        } else {
            format!("{resource}/{sub}")
        };
        let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        *counts.entry((label("verb"), resource)).or_insert(0) += n;
    }
    counts
}

/// The apiserver's request counters now (empty if `/metrics` cannot be read).
fn scrape_requests(
    k: &juneau_tests::kube::KubeCluster,
) -> std::collections::BTreeMap<(String, String), u64> {
    k.kubectl(&["get", "--raw", "/metrics"])
        .map(|text| api_request_counts(&text))
        .unwrap_or_default()
}

/// What `after` counted beyond `before`, most first.
fn requests_between(
    before: &std::collections::BTreeMap<(String, String), u64>,
    after: &std::collections::BTreeMap<(String, String), u64>,
) -> Vec<ApiRequests> {
    let mut v: Vec<ApiRequests> = after
        .iter()
        .map(|((verb, resource), n)| ApiRequests {
            verb: verb.clone(),
            resource: resource.clone(),
            count: n.saturating_sub(
                before
                    .get(&(verb.clone(), resource.clone()))
                    .copied()
                    .unwrap_or(0),
            ),
        })
        .filter(|r| r.count > 0)
        .collect();
    v.sort_by(|a, b| b.count.cmp(&a.count).then(a.resource.cmp(&b.resource)));
    v
}

fn service_yaml(i: u32) -> Result<(Service, EndpointSlice)> {
    let name = format!("s{i:05}");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default",
            "annotations": {"juneau.loutres.me/load-balancer-external-network": "perf"}},
        "spec": {"type": "LoadBalancer", "loadBalancerClass": "juneau.loutres.me/load-balancer",
            // 10 000 LoadBalancer Services would exhaust the NodePort range (2 768 ports).
            // Their health-check NodePorts (Local policy) still come from it: the test
            // apiserver's range is 15 000 ports (tests/src/kube.rs).
            "allocateLoadBalancerNodePorts": false,
            "externalTrafficPolicy": "Local", "selector": {"app": name},
            "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    }))?;
    let ep = |k: u32| {
        serde_json::json!({
            "addresses": [format!("10.{}.{}.{}", 128 + (i >> 14), (i >> 6) & 255, ((i & 63) << 2) + k)],
            "nodeName": NODE,
            "conditions": {"ready": true, "serving": true, "terminating": false}
        })
    };
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-1"), "namespace": "default",
            "labels": {"kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "juneau-perf"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": [ep(1), ep(2), ep(3)]
    }))?;
    Ok((svc, slice))
}

fn rss_of(name: &str, pid: u32) -> Rss {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Rss {
        name: name.into(),
        rss_mib: kib("VmRSS:") / 1024.0,
        peak_mib: kib("VmHWM:") / 1024.0,
    }
}

fn cpu_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rp) = s.rfind(')') else { return 0.0 };
    let f: Vec<&str> = s[rp + 2..].split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let t = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / hz
}

fn stopped() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// A kept log longer than this keeps its first quarter and its last three quarters of
/// this size, with a line saying what was cut.
const LOG_CAP: u64 = 16 << 20;

/// Runs the scale measurement with `n` Services; gives up waiting after `timeout`. The
/// logs of the controller, agent, juneau-bgp, BIRD, kube-apiserver and etcd are copied
/// into `out`/[`LOG_DIR`] whatever the outcome (success, timeout, error, Ctrl-C), so a
/// stall can be read afterwards.
pub fn measure(
    bins: &Binaries,
    n: u32,
    timeout: Duration,
    out: &Path,
    say: &dyn Fn(String),
    creation: Creation,
) -> Result<ScaleReport> {
    if n == 0 || n > 16_000 {
        bail!("--services must be between 1 and 16000 (the address pool is a /18)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let objects: Vec<(Service, EndpointSlice)> = (0..n).map(service_yaml).collect::<Result<_>>()?;
    // Precreated: the creates; live: the apiserver-alone baseline.
    let mut before = None;
    let mut bed = start_bed_with(bins, say, "100.64.0.0/18", "", &mut |k| {
        let client = rt.block_on(api_client(k.kubeconfig(), true))?;
        before = Some(match creation {
            Creation::Precreated => {
                say(format!(
                    "scale: creating {n} Services with 3 endpoints each ({CONCURRENCY} in flight) before the Juneau daemons start"
                ));
                let t = Instant::now();
                let sent = rt.block_on(create_all(&client, &objects))?;
                let create = t.elapsed();
                say(format!(
                    "scale: created in {:.1} s ({} creates retried after a 5xx/429); starting the daemons (t0)",
                    create.as_secs_f64(),
                    sent.retries(n)
                ));
                Before::Precreated {
                    create,
                    retries: sent.retries(n),
                    // The creates are not part of the run: count requests from here.
                    requests: scrape_requests(k),
                }
            }
            Creation::Live => {
                Before::Baseline(apiserver_alone(&rt, &client, &objects, k.pids()[1], say)?)
            }
        });
        Ok(())
    })?;
    let before = before.context("the bed did not run the creates")?;
    let r = measure_on(&mut bed, &rt, &objects, timeout, say, before);
    let dir = out.join(LOG_DIR);
    match keep_logs(&bed, &dir) {
        Ok(kept) => say(format!(
            "scale: kept {} logs in {}",
            kept.len(),
            dir.display()
        )),
        Err(e) => say(format!(
            "scale: could not keep the logs in {}: {e:#}",
            dir.display()
        )),
    }
    let mut r = r?;
    r.logs = LOG_DIR.into();
    Ok(r)
}

/// Copies the bed's logs into `dir` (each capped at [`LOG_CAP`]); returns the files.
fn keep_logs(bed: &crate::convergence::Bed, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let logs = [
        (&bed.controller_log, "controller.log"),
        (&bed.agent_log, "agent.log"),
        (&bed.bgp_log, "juneau-bgp.log"),
        (&bed.bird_log, "bird.log"),
        (
            &bed.k.dir().join("kube-apiserver.log"),
            "kube-apiserver.log",
        ),
        (&bed.k.dir().join("etcd.log"), "etcd.log"),
    ];
    let (mut kept, mut failed) = (Vec::new(), Vec::new());
    for (src, name) in logs {
        let dst = dir.join(name);
        // One missing log does not cost the others.
        match copy_capped(src, &dst, LOG_CAP) {
            Ok(()) => kept.push(dst),
            Err(e) => failed.push(format!("{}: {e:#}", src.display())),
        }
    }
    if !failed.is_empty() {
        bail!(
            "kept {} logs, could not copy: {}",
            kept.len(),
            failed.join("; ")
        );
    }
    Ok(kept)
}

/// Copies `src` to `dst`; a file longer than `cap` keeps its first `cap / 4` and last
/// `3 cap / 4` bytes with a line between saying how many bytes were left out.
pub fn copy_capped(src: &Path, dst: &Path, cap: u64) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::File::open(src)?;
    let len = f.metadata()?.len();
    let mut w = std::io::BufWriter::new(std::fs::File::create(dst)?);
    if len <= cap {
        std::io::copy(&mut f, &mut w)?;
    } else {
        let (head, tail) = (cap / 4, cap - cap / 4);
        std::io::copy(&mut (&mut f).take(head), &mut w)?;
        writeln!(
            w,
            "\n[juneau-perf: {} bytes left out here; the log had {len} bytes]",
            len - head - tail
        )?;
        f.seek(SeekFrom::Start(len - tail))?;
        std::io::copy(&mut f.take(tail), &mut w)?;
    }
    w.flush()?;
    Ok(())
}

/// A client of the bed's apiserver; `requests`: with a 60 s read timeout and without the
/// client's own retries of 429/503/504 (creates and deletes: [`with_retries`] retries
/// them, so every request sent is counted), else the client's default (watches, whose
/// timeout is longer).
async fn api_client(kubeconfig: &Path, requests: bool) -> Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    if requests {
        cfg.read_timeout = Some(Duration::from_secs(60));
        cfg.default_retry = false;
    }
    Ok(kube::Client::try_from(cfg)?)
}

/// Creates every Service and its EndpointSlice, [`CONCURRENCY`] pairs in flight; returns
/// the requests sent.
async fn create_all(client: &kube::Client, objects: &[(Service, EndpointSlice)]) -> Result<Sent> {
    let svcs: kube::Api<Service> = kube::Api::namespaced(client.clone(), "default");
    let slices: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), "default");
    let results: Vec<Result<Sent>> = futures::stream::iter(objects.iter())
        .map(|(svc, slice)| {
            let (svcs, slices) = (svcs.clone(), slices.clone());
            async move {
                let pp = PostParams::default();
                let services = with_retries(409, || svcs.create(&pp, svc))
                    .await
                    .context("creating a Service")?;
                let slices = with_retries(409, || slices.create(&pp, slice))
                    .await
                    .context("creating an EndpointSlice")?;
                Ok(Sent { services, slices })
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut sent = Sent::default();
    for r in results {
        let r = r?;
        sent.services += r.services;
        sent.slices += r.slices;
    }
    Ok(sent)
}

/// The live mode's baseline, on the bed before any Juneau daemon starts: the same client
/// code creates the same `objects` (timed: the apiserver alone), then deletes them all
/// and waits until none is left, so the live run starts from the same empty namespace.
fn apiserver_alone(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    objects: &[(Service, EndpointSlice)],
    apiserver_pid: u32,
    say: &dyn Fn(String),
) -> Result<Baseline> {
    let n = objects.len() as u32;
    say(format!(
        "scale: baseline: the apiserver alone (no Juneau daemon yet) creating {n} Services with 3 endpoints each ({CONCURRENCY} in flight)"
    ));
    let (t, cpu0) = (Instant::now(), cpu_s(apiserver_pid));
    let sent = rt
        .block_on(create_all(client, objects))
        .context("baseline: the apiserver alone")?;
    let (create, apiserver_cpu_s) = (t.elapsed(), cpu_s(apiserver_pid) - cpu0);
    say(format!(
        "scale: baseline: created in {:.1} s, kube-apiserver {apiserver_cpu_s:.1} s of CPU ({} creates retried after a 5xx/429); deleting them again",
        create.as_secs_f64(),
        sent.retries(n)
    ));
    let t = Instant::now();
    rt.block_on(delete_all(client, objects))
        .context("baseline: deleting its objects")?;
    let svcs: kube::Api<Service> = kube::Api::namespaced(client.clone(), "default");
    let slices: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), "default");
    let names: std::collections::HashSet<String> = objects
        .iter()
        .filter_map(|(s, _)| s.metadata.name.clone())
        .collect();
    let by_us = kube::api::ListParams::default()
        .labels("endpointslice.kubernetes.io/managed-by=juneau-perf");
    crate::convergence::eventually("the baseline's objects to be gone", || {
        let left = rt.block_on(async {
            let s = svcs.list_metadata(&Default::default()).await?;
            let e = slices.list_metadata(&by_us).await?;
            let ours = s
                .items
                .iter()
                .filter(|m| m.metadata.name.as_ref().is_some_and(|x| names.contains(x)))
                .count();
            anyhow::Ok(ours + e.items.len())
        })?;
        Ok((left == 0).then_some(()))
    })?;
    let delete = t.elapsed();
    say(format!(
        "scale: baseline: deleted in {:.1} s; starting the daemons",
        delete.as_secs_f64()
    ));
    Ok(Baseline {
        create,
        apiserver_cpu_s,
        retries: sent.retries(n),
        delete,
    })
}

/// Deletes every Service and EndpointSlice of `objects` (gone already is fine),
/// [`CONCURRENCY`] pairs in flight.
async fn delete_all(client: &kube::Client, objects: &[(Service, EndpointSlice)]) -> Result<()> {
    let svcs: kube::Api<Service> = kube::Api::namespaced(client.clone(), "default");
    let slices: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), "default");
    let results: Vec<Result<()>> = futures::stream::iter(objects.iter())
        .map(|(svc, slice)| {
            let (svcs, slices) = (svcs.clone(), slices.clone());
            async move {
                let dp = kube::api::DeleteParams::default();
                let (s, e) = (svc.metadata.name.as_deref(), slice.metadata.name.as_deref());
                let (s, e) = (s.unwrap_or_default(), e.unwrap_or_default());
                with_retries(404, || slices.delete(e, &dp))
                    .await
                    .context("deleting an EndpointSlice")?;
                with_retries(404, || svcs.delete(s, &dp))
                    .await
                    .context("deleting a Service")?;
                Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(())
}

/// Measures on a started bed. `before`: what was done before the daemons started; with
/// [`Before::Precreated`], `t0` is the daemons' start and nothing is created here.
fn measure_on(
    bed: &mut crate::convergence::Bed,
    rt: &tokio::runtime::Runtime,
    objects: &[(Service, EndpointSlice)],
    timeout: Duration,
    say: &dyn Fn(String),
    before: Before,
) -> Result<ScaleReport> {
    let n = objects.len() as u32;
    let (precreated, baseline, requests_before) = match before {
        Before::Precreated {
            create,
            retries,
            requests,
        } => (Some((create, retries)), None, Some(requests)),
        Before::Baseline(b) => (None, Some(b), None),
    };
    let mut birdc = connect_bird(bed, precreated.is_some())?;
    let client = rt.block_on(api_client(bed.k.kubeconfig(), true))?;
    let watch_client = rt.block_on(api_client(bed.k.kubeconfig(), false))?;
    let agent_pid = bed.agent.pid();
    let controller_pid = bed.controller.pid();
    let kp = bed.k.pids();
    let (etcd_pid, apiserver_pid) = (kp[0], kp[1]);
    let (etcd_cpu0, apiserver_cpu0) = (cpu_s(etcd_pid), cpu_s(apiserver_pid));
    let requests0 = requests_before.unwrap_or_else(|| scrape_requests(&bed.k));
    // Precreated: the daemons' whole CPU time since their start counts.
    let speaker_pid = bed.bgp.id();
    let (agent_cpu0, controller_cpu0, speaker_cpu0) = match precreated {
        Some(_) => (0.0, 0.0, 0.0),
        None => (cpu_s(agent_pid), cpu_s(controller_pid), cpu_s(speaker_pid)),
    };
    // juneau-perf's own share of the 2 cores over the run (creates, watches, observers).
    let harness_cpu0 = cpu_s(std::process::id());
    let done = Arc::new(AtomicBool::new(false));
    let t0 = match precreated {
        Some(_) => bed.daemons_started,
        None => {
            say(format!(
                "scale: creating {n} Services with 3 endpoints each ({CONCURRENCY} in flight)"
            ));
            Instant::now()
        }
    };
    let deadline = t0 + timeout;
    let (shm, bird, created, all_vips, all_ready) = std::thread::scope(|s| -> Result<_> {
        let state = bed.state.clone();
        let d1 = done.clone();
        // Shared memory: futex wake-ups, microsecond resolution.
        let shm =
            s.spawn(move || shm_all_advertised(&state, n, t0, deadline, precreated.is_some(), &d1));
        let d2 = done.clone();
        let bc = &mut birdc;
        let bird = s.spawn(move || bird_all_routes(bc, n, t0, deadline, &d2));
        let watches = Watches::start(rt, &watch_client, n, t0);
        // Precreated: nothing is sent in the run.
        let created = match precreated {
            Some((d, _)) => (d, Sent::default()),
            None => create_services(rt, &client, objects, t0, say, &done)?,
        };
        let mut last_say = Instant::now();
        while Instant::now() < deadline && !stopped() && !watches.finished() {
            bed.check()?;
            if last_say.elapsed() >= PROGRESS {
                last_say = Instant::now();
                say(format!(
                    "scale: {:.0} s: {}/{n} VIPs shown, {}/{n} Ready",
                    t0.elapsed().as_secs_f64(),
                    watches.vips_seen.load(Ordering::Relaxed),
                    watches.ready_seen.load(Ordering::Relaxed)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let (all_vips, all_ready) = watches.finish(rt);
        let shm = shm.join().expect("shm observer")?;
        let bird = bird.join().expect("BIRD observer")?;
        done.store(true, Ordering::Relaxed);
        Ok((shm, bird, created, all_vips, all_ready))
    })?;
    let (create_s, sent) = created;
    // A failed first scrape would count every request since the apiserver's start.
    let requests = if requests0.is_empty() {
        Vec::new()
    } else {
        requests_between(&requests0, &scrape_requests(&bed.k))
    };
    let (etcd_cpu_s, apiserver_cpu_s) = (
        cpu_s(etcd_pid) - etcd_cpu0,
        cpu_s(apiserver_pid) - apiserver_cpu0,
    );
    let harness_cpu_s = cpu_s(std::process::id()) - harness_cpu0;
    if stopped() {
        bail!("interrupted (Ctrl-C): cleaning up");
    }
    let memory = bed_memory(bed, controller_pid, agent_pid);
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    let juneau_writes_per_service =
        juneau_writes_per_service(&requests, &harness_requests(sent), n);
    Ok(ScaleReport {
        services: n,
        endpoints_per_service: 3,
        create_s: create_s.as_secs_f64(),
        precreated: precreated.is_some(),
        create_retries: precreated.map_or(sent.retries(n), |(_, r)| r),
        all_vips_s: secs(all_vips),
        all_ready_s: secs(all_ready),
        shm_all_advertised_s: secs(shm.0),
        agent_publishes: shm.1,
        agent_cpu_s: cpu_s(agent_pid) - agent_cpu0,
        controller_cpu_s: cpu_s(controller_pid) - controller_cpu0,
        speaker_cpu_s: cpu_s(speaker_pid) - speaker_cpu0,
        harness_cpu_s,
        state_file_bytes: std::fs::metadata(&bed.state).map(|m| m.len()).unwrap_or(0),
        bird_all_routes_s: secs(bird),
        memory,
        goal_s: 60.0,
        logs: String::new(),
        apiserver_cpu_s,
        etcd_cpu_s,
        api_requests: requests,
        method: scale_method(n, precreated.is_some(), baseline.as_ref()),
        apiserver_alone_create_s: baseline.map(|b| b.create.as_secs_f64()),
        apiserver_alone_cpu_s: baseline.map(|b| b.apiserver_cpu_s),
        juneau_writes_per_service,
    })
}

/// A BIRD control connection on the bed; unless the objects were `precreated`, once
/// BIRD's session with juneau-bgp is Established.
fn connect_bird(bed: &crate::convergence::Bed, precreated: bool) -> Result<Birdc> {
    let mut birdc = crate::convergence::eventually("BIRD's control socket", || {
        Ok(Birdc::connect(&bed.ctl).ok())
    })?;
    if !precreated {
        // The BGP session first, so BIRD's figure is not the session's start-up.
        crate::convergence::eventually("the BGP session with juneau-bgp", || {
            Ok(birdc
                .cmd("show protocols juneau")?
                .contains("Established")
                .then_some(()))
        })?;
    }
    Ok(birdc)
}

/// Creates the Services and EndpointSlices (`objects`) and returns how long that took
/// since `t0` and the requests sent; on failure, tells the observers they are `done`.
fn create_services(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    objects: &[(Service, EndpointSlice)],
    t0: Instant,
    say: &dyn Fn(String),
    done: &AtomicBool,
) -> Result<(Duration, Sent)> {
    let sent = match rt.block_on(create_all(client, objects)) {
        Ok(sent) => sent,
        Err(e) => {
            done.store(true, Ordering::Relaxed);
            return Err(e);
        }
    };
    let took = t0.elapsed();
    say(format!(
        "scale: created in {:.1} s ({} creates retried after a 5xx/429); waiting for VIPs, Ready, shared memory, BIRD",
        took.as_secs_f64(),
        sent.retries(objects.len() as u32)
    ));
    Ok((took, sent))
}

/// The watches counting Services showing a VIP and ServiceLoadBalancers Ready.
struct Watches {
    vip_task: tokio::task::JoinHandle<Option<Duration>>,
    ready_task: tokio::task::JoinHandle<Option<Duration>>,
    /// Services seen showing a VIP so far.
    vips_seen: Arc<AtomicUsize>,
    /// ServiceLoadBalancers seen Ready so far.
    ready_seen: Arc<AtomicUsize>,
}

impl Watches {
    /// Starts both watches on `rt`, each until it has seen `n` objects.
    fn start(
        rt: &tokio::runtime::Runtime,
        watch_client: &kube::Client,
        n: u32,
        t0: Instant,
    ) -> Self {
        // Services showing a VIP, ServiceLoadBalancers Ready: counted from watch events,
        // from t0 on (a list of N objects every second loaded the apiserver it measures).
        let (vips_seen, ready_seen) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let vip_task = rt.spawn(count_until(
            kube::Api::<Service>::namespaced(watch_client.clone(), "default"),
            n,
            t0,
            vips_seen.clone(),
            shows_vip,
        ));
        let ready_task = rt.spawn(count_until(
            kube::Api::<DynamicObject>::all_with(watch_client.clone(), &slb_resource()),
            n,
            t0,
            ready_seen.clone(),
            is_ready,
        ));
        Watches {
            vip_task,
            ready_task,
            vips_seen,
            ready_seen,
        }
    }

    /// Whether both watches have seen all their objects (or ended).
    fn finished(&self) -> bool {
        self.vip_task.is_finished() && self.ready_task.is_finished()
    }

    /// When (since t0) every Service showed a VIP and every ServiceLoadBalancer was
    /// Ready; a watch still running is stopped and counts as never.
    fn finish(self, rt: &tokio::runtime::Runtime) -> (Option<Duration>, Option<Duration>) {
        let finished = |task: tokio::task::JoinHandle<Option<Duration>>| {
            if task.is_finished() {
                rt.block_on(task).ok().flatten()
            } else {
                task.abort();
                None
            }
        };
        (finished(self.vip_task), finished(self.ready_task))
    }
}

/// The shared-memory observer: when (since `t0`) the agent's state file at `state`
/// first advertised `n` VIPs, if before `deadline` (or `done`), and how many times the
/// agent published meanwhile (`precreated`: since the agent's start).
fn shm_all_advertised(
    state: &Path,
    n: u32,
    t0: Instant,
    deadline: Instant,
    precreated: bool,
    done: &AtomicBool,
) -> Result<(Option<Duration>, u64)> {
    let mut r = crate::convergence::eventually("the agent's state file", || {
        Ok(NodeStateReader::open(state).ok())
    })?;
    // Precreated: every publish since the agent's start counts (its file is new).
    let first = if precreated { 0 } else { r.generation() };
    let (mut g, mut publishes) = (first, 0u64);
    while Instant::now() < deadline && !done.load(Ordering::Relaxed) && !stopped() {
        let ng = r.wait_change(g, Duration::from_millis(200));
        if ng == g {
            continue;
        }
        let t = t0.elapsed();
        publishes += ng.saturating_sub(g);
        g = ng;
        if r.routing_snapshot()?.state.advertised.len() >= n as usize {
            return Ok((Some(t), publishes));
        }
    }
    Ok((None, publishes))
}

/// The BIRD observer: when (since `t0`) BIRD first counted `n` routes, asked every
/// [`BIRD_POLL`] until `deadline` (or `done`).
fn bird_all_routes(
    bc: &mut Birdc,
    n: u32,
    t0: Instant,
    deadline: Instant,
    done: &AtomicBool,
) -> Result<Option<Duration>> {
    while Instant::now() < deadline && !done.load(Ordering::Relaxed) && !stopped() {
        let t = t0.elapsed();
        let out = bc.cmd("show route count")?;
        let count = out
            .split_whitespace()
            .find_map(|w| w.parse::<u64>().ok())
            .unwrap_or(0);
        if count >= u64::from(n) {
            return Ok(Some(t));
        }
        std::thread::sleep(BIRD_POLL);
    }
    Ok(None)
}

/// The resident memory of the bed's daemons: the Juneau controller and agent, juneau-bgp,
/// BIRD, etcd and kube-apiserver.
fn bed_memory(bed: &crate::convergence::Bed, controller_pid: u32, agent_pid: u32) -> Vec<Rss> {
    let mut memory = vec![
        rss_of("juneau-k8s-sync controller", controller_pid),
        rss_of("juneau-k8s-sync agent", agent_pid),
        rss_of("juneau-bgp", bed.bgp.id()),
        rss_of("BIRD", bed.bird.pid()),
    ];
    let kp = bed.k.pids();
    for (name, pid) in ["etcd", "kube-apiserver"].iter().zip(kp) {
        memory.push(rss_of(name, pid));
    }
    memory
}

/// Verbs of `apiserver_request_total` that only read; every other verb (POST, PUT,
/// PATCH, APPLY, DELETE, DELETECOLLECTION ...) writes.
const READS: [&str; 4] = ["GET", "LIST", "WATCH", "WATCHLIST"];

/// Resources only the apiserver itself writes on the bed, never Juneau: its ClusterIP
/// allocator's IPAddress per Service created, its `kubernetes` Endpoints reconciler.
const APISERVER_OWN: [&str; 2] = ["ipaddresses", "endpoints"];

/// The requests the harness itself sent in the run (`sent`: its creates, every attempt).
fn harness_requests(sent: Sent) -> Vec<ApiRequests> {
    [("services", sent.services), ("endpointslices", sent.slices)]
        .into_iter()
        .filter(|&(_, count)| count > 0)
        .map(|(resource, count)| ApiRequests {
            verb: "POST".into(),
            resource: resource.into(),
            count,
        })
        .collect()
}

/// The API writes per Service Juneau (controller and agent) made over the run: every
/// request of `requests` (the apiserver's counts over the run) that is not a read
/// ([`READS`]) nor on a resource only the apiserver writes ([`APISERVER_OWN`]), less the
/// `harness`'s own requests of the same verb and resource, divided by `services`. The
/// apiserver's other housekeeping writes (its own Lease) are in it: an upper bound.
/// None without counts (the scrape failed) or without Services.
pub fn juneau_writes_per_service(
    requests: &[ApiRequests],
    harness: &[ApiRequests],
    services: u32,
) -> Option<f64> {
    if requests.is_empty() || services == 0 {
        return None;
    }
    let writes: u64 = requests
        .iter()
        .filter(|q| !READS.contains(&q.verb.as_str()))
        .filter(|q| !APISERVER_OWN.contains(&q.resource.as_str()))
        .map(|q| {
            let ours: u64 = harness
                .iter()
                .filter(|h| h.verb == q.verb && h.resource == q.resource)
                .map(|h| h.count)
                .sum();
            q.count.saturating_sub(ours)
        })
        .sum();
    Some(writes as f64 / f64::from(services))
}

/// How the scale figures were measured, for the report (`precreated`: the objects were
/// created before the daemons started; `baseline`: the live mode's apiserver alone).
fn scale_method(n: u32, precreated: bool, baseline: Option<&Baseline>) -> String {
    let t0 = if precreated {
        "everything created before the Juneau daemons started, t0 = their start (the BGP session's \
         set-up is inside the figures)"
            .to_string()
    } else {
        let b = baseline.map_or_else(
            || "no baseline".to_string(),
            |b| {
                format!(
                    "baseline (the apiserver alone): on the same bed before any Juneau daemon started, \
                     the same client code created the same objects in {:.1} s ({} creates retried), \
                     then deleted them all ({:.1} s, until none was left)",
                    b.create.as_secs_f64(),
                    b.retries,
                    b.delete.as_secs_f64()
                )
            },
        );
        format!("t0 = just before the first create; {b}")
    };
    format!(
        "real etcd + kube-apiserver {}, juneau-k8s-sync controller + agent, juneau-bgp and BIRD 2 \
         (the convergence bed); {t0}; {n} Services + {n} EndpointSlices \
         created with {CONCURRENCY} requests in flight; Services and ServiceLoadBalancers are watched \
         (a figure is when the watch event reached juneau-perf), BIRD's route count is asked every {} ms, \
         shared memory via its futex; Juneau's API writes per Service: the requests the apiserver \
         counted over the run that are not {} nor on {} (only the apiserver writes those), less \
         juneau-perf's own creates (every attempt), / {n} (the apiserver's own Lease renewals are in it)",
        juneau_tests::kube::kubernetes_version(),
        BIRD_POLL.as_millis(),
        READS.join("/"),
        APISERVER_OWN.join(", "),
    )
}

fn slb_resource() -> ApiResource {
    ApiResource {
        group: "juneau.loutres.me".into(),
        version: "v1alpha1".into(),
        api_version: "juneau.loutres.me/v1alpha1".into(),
        kind: "ServiceLoadBalancer".into(),
        plural: "serviceloadbalancers".into(),
    }
}

fn shows_vip(s: &Service) -> bool {
    s.status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .is_some_and(|i| !i.is_empty())
}

fn is_ready(o: &DynamicObject) -> bool {
    o.data["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// Watches `api` until `n` of its objects satisfy `pred`; returns the time from `t0`
/// when the event that made it `n` arrived (None if the watch ended). `seen` follows
/// the count for progress.
async fn count_until<K>(
    api: kube::Api<K>,
    n: u32,
    t0: Instant,
    seen: Arc<AtomicUsize>,
    pred: fn(&K) -> bool,
) -> Option<Duration>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use kube::runtime::watcher::{self, Event};
    use kube::runtime::WatchStreamExt;
    use std::collections::HashSet;
    let key = |o: &K| {
        format!(
            "{}/{}",
            o.meta().namespace.as_deref().unwrap_or_default(),
            o.meta().name.as_deref().unwrap_or_default()
        )
    };
    let (mut have, mut listing) = (HashSet::new(), HashSet::new());
    let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
    while let Some(ev) = events.next().await {
        // Errors: the watcher backs off and resumes by itself.
        let Ok(ev) = ev else { continue };
        match ev {
            Event::Apply(o) => {
                if pred(&o) {
                    have.insert(key(&o));
                } else {
                    have.remove(&key(&o));
                }
            }
            Event::Delete(o) => {
                have.remove(&key(&o));
            }
            Event::Init => listing.clear(),
            Event::InitApply(o) => {
                if pred(&o) {
                    listing.insert(key(&o));
                }
            }
            Event::InitDone => have = std::mem::take(&mut listing),
        }
        seen.store(have.len(), Ordering::Relaxed);
        if have.len() >= n as usize {
            return Some(t0.elapsed());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_log_under_the_cap_is_copied_whole_and_a_longer_one_keeps_head_and_tail() {
        let d = tempfile::tempdir().unwrap();
        let (src, dst) = (d.path().join("a.log"), d.path().join("b.log"));
        std::fs::write(&src, "short log\n").unwrap();
        copy_capped(&src, &dst, 100).unwrap();
        assert_eq!(std::fs::read_to_string(&dst).unwrap(), "short log\n");

        let text: String = (0..100).map(|i| format!("line {i:03}\n")).collect();
        std::fs::write(&src, &text).unwrap(); // 900 bytes
        copy_capped(&src, &dst, 400).unwrap();
        let kept = std::fs::read_to_string(&dst).unwrap();
        assert!(kept.starts_with(&text[..100]), "{kept}");
        assert!(kept.ends_with(&text[600..]), "{kept}");
        assert!(
            kept.contains("500 bytes left out here; the log had 900 bytes"),
            "{kept}"
        );
        assert!(!kept.contains("line 050"), "{kept}");
    }

    #[test]
    fn apiserver_request_counts_are_summed_by_verb_and_resource() {
        let text = r#"# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="services",scope="resource",subresource="status",verb="APPLY",version="v1"} 7
apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="services",scope="resource",subresource="status",verb="APPLY",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="GET",version="v1"} 1e+01
apiserver_request_total{code="200",component="",dry_run="",group="",resource="",scope="",subresource="/healthz",verb="GET",version=""} 3
apiserver_request_duration_seconds_count{resource="services",verb="GET"} 99
"#;
        let c = api_request_counts(text);
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c[&("APPLY".into(), "services/status".into())], 9);
        assert_eq!(c[&("GET".into(), "leases".into())], 10);
        // Before: 4 Lease GETs and no status apply yet.
        let before = std::collections::BTreeMap::from([(("GET".into(), "leases".into()), 4)]);
        let d = requests_between(&before, &c);
        assert_eq!(
            d,
            vec![
                ApiRequests {
                    verb: "APPLY".into(),
                    resource: "services/status".into(),
                    count: 9
                },
                ApiRequests {
                    verb: "GET".into(),
                    resource: "leases".into(),
                    count: 6
                },
            ]
        );
    }

    fn q(verb: &str, resource: &str, count: u64) -> ApiRequests {
        ApiRequests {
            verb: verb.into(),
            resource: resource.into(),
            count,
        }
    }

    #[test]
    fn juneau_writes_are_the_writes_less_the_harness_and_the_apiserver_own() {
        // A live run of 100 Services: the harness sent 103 Service POSTs (3 retried after
        // a 500, every attempt counted) and 100 EndpointSlice POSTs.
        let sent = Sent {
            services: 103,
            slices: 100,
        };
        assert_eq!(sent.retries(100), 3);
        let harness = harness_requests(sent);
        let requests = [
            q("POST", "services", 103),
            q("POST", "endpointslices", 100),
            q("POST", "ipaddresses", 100), // the apiserver's ClusterIP allocator
            q("POST", "endpoints", 2),     // its `kubernetes` Endpoints reconciler
            q("POST", "events", 200),
            q("PATCH", "services", 100),
            q("APPLY", "services/status", 100),
            q("APPLY", "serviceloadbalancers", 100),
            q("APPLY", "serviceloadbalancers/status", 100),
            q("PUT", "leases", 4),
            q("DELETE", "events", 1),
            q("GET", "leases", 500),
            q("LIST", "services", 9),
            q("WATCH", "services", 3),
            q("WATCHLIST", "services", 1),
        ];
        // 200 + 4 x 100 + 4 + 1 = 605.
        assert_eq!(
            juneau_writes_per_service(&requests, &harness, 100),
            Some(6.05)
        );
        // Precreated: the harness sent nothing in the run.
        let pre = [q("POST", "events", 200), q("PATCH", "services", 100)];
        assert_eq!(juneau_writes_per_service(&pre, &[], 100), Some(3.0));
        assert!(harness_requests(Sent::default()).is_empty());
    }

    #[test]
    fn a_juneau_create_of_a_harness_resource_is_counted_and_the_harness_never_below_zero() {
        let harness = harness_requests(Sent {
            services: 10,
            slices: 10,
        });
        // 12 EndpointSlice POSTs counted: 2 are not the harness's.
        let requests = [q("POST", "services", 10), q("POST", "endpointslices", 12)];
        assert_eq!(
            juneau_writes_per_service(&requests, &harness, 10),
            Some(0.2)
        );
        // Fewer counted than sent (cannot happen) is no negative count.
        let requests = [q("POST", "services", 8), q("POST", "events", 10)];
        assert_eq!(
            juneau_writes_per_service(&requests, &harness, 10),
            Some(1.0)
        );
    }

    #[test]
    fn no_request_counts_or_no_service_is_no_figure() {
        assert_eq!(juneau_writes_per_service(&[], &[], 100), None);
        assert_eq!(
            juneau_writes_per_service(&[q("POST", "events", 1)], &[], 0),
            None
        );
        // Only reads: measured, and zero.
        assert_eq!(
            juneau_writes_per_service(&[q("GET", "leases", 7)], &[], 7),
            Some(0.0)
        );
    }

    #[test]
    fn the_method_says_how_the_baseline_was_taken() {
        let b = Baseline {
            create: Duration::from_millis(12_340),
            apiserver_cpu_s: 20.5,
            retries: 2,
            delete: Duration::from_millis(8_760),
        };
        let m = scale_method(200, false, Some(&b));
        assert!(m.contains("t0 = just before the first create"), "{m}");
        assert!(
            m.contains("created the same objects in 12.3 s (2 creates retried)"),
            "{m}"
        );
        assert!(m.contains("deleted them all (8.8 s"), "{m}");
        let m = scale_method(200, true, None);
        assert!(m.contains("t0 = their start"), "{m}");
        assert!(!m.contains("baseline"), "{m}");
    }

    #[test]
    fn a_missing_log_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let r = copy_capped(&d.path().join("absent.log"), &d.path().join("b.log"), 10);
        assert!(r.is_err());
    }
}
