//! Control-plane convergence: time from an EndpointSlice change at a real kube-apiserver
//! to (a) the node's shared-memory table and (b) the BGP route at a real BIRD 2 router.
//!
//! Set-up (all removed on return, error or Ctrl-C): a real etcd + kube-apiserver
//! (`juneau_tests::kube::KubeCluster`) with Juneau's CRDs; the real
//! `juneau-k8s-sync controller` and `juneau-k8s-sync agent --node node-a` on the host,
//! both with the cluster's admin kubeconfig (RBAC is not what is measured here); the real
//! `juneau-bgp` in a node namespace reading the agent's state file, peering over a veth
//! with BIRD 2 in a router namespace. One Service with one endpoint on node-a; each
//! repetition marks that endpoint not ready (withdraw) and ready again (announce).
//!
//! Clocks: one monotonic clock in this process. `t0` is taken just before the PATCH is
//! sent over an already-open HTTPS connection (the write's round trip is reported too: the
//! apiserver stored the change somewhere inside it). (a) is stamped by a thread blocked
//! in `NodeStateReader::wait_change` (futex: wakes within microseconds of the publish).
//! (b) is stamped by a thread that asks BIRD over its control socket every
//! [`BIRD_POLL`] for the /32 (BIRD's routing table, i.e. after BIRD parsed the UPDATE
//! and imported it); the resolution is that interval plus one query.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use juneau_control::shm::NodeStateReader;
use juneau_tests::bird::{BgpNeighbor, Bird, BirdConfig, BirdControl};
use juneau_tests::daemon::{Daemon, DaemonSpec};
use juneau_tests::kube::KubeCluster;
use juneau_tests::netns::{unique_prefix, veth, Netns, NsChild};

pub use crate::convergence_data::{ConvergenceReport, Series};
use crate::plan::INTERRUPTED;

/// The CRDs, compiled in so the binary needs no source tree.
const CRDS: &str = include_str!("../../deploy/crds/juneau.loutres.me.yaml");
/// How often the BIRD watcher asks BIRD for the route.
pub const BIRD_POLL: Duration = Duration::from_millis(1);
/// Bound on one change reaching both places.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on the set-up's "eventually" checks (busy 2-core machine).
const SETUP_TIMEOUT: Duration = Duration::from_secs(120);
pub(crate) const NODE: &str = "node-a";
const NODE_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const ROUTER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 1);
const SLICE: &str = "web-1";

/// Where the real binaries are.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `juneau-k8s-sync`.
    pub k8s_sync: PathBuf,
    /// `juneau-bgp`.
    pub bgp: PathBuf,
}

impl Binaries {
    /// `$JUNEAU_K8S_SYNC` / `$JUNEAU_BGP`, else next to juneau-perf.
    pub fn default_paths() -> Binaries {
        let dir = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        let pick = |env: &str, name: &str| {
            std::env::var_os(env)
                .map(PathBuf::from)
                .unwrap_or_else(|| dir.join(name))
        };
        Binaries {
            k8s_sync: pick("JUNEAU_K8S_SYNC", "juneau-k8s-sync"),
            bgp: pick("JUNEAU_BGP", "juneau-bgp"),
        }
    }
}

/// What is missing for the convergence measurement (nothing is installed).
pub fn missing(bins: &Binaries) -> Vec<crate::prereq::Missing> {
    let mut m = Vec::new();
    let mut need = |ok: bool, what: String, fix: &str| {
        if !ok {
            m.push(crate::prereq::Missing {
                what,
                fix: fix.into(),
            })
        }
    };
    need(
        bins.k8s_sync.exists(),
        format!("juneau-k8s-sync at {}", bins.k8s_sync.display()),
        "cargo build --release -p juneau-k8s-sync (or --k8s-sync PATH / $JUNEAU_K8S_SYNC)",
    );
    need(
        bins.bgp.exists(),
        format!("juneau-bgp at {}", bins.bgp.display()),
        "cargo build --release -p juneau-bgp (or --bgp PATH / $JUNEAU_BGP)",
    );
    need(
        Path::new(juneau_tests::bird::BIRD).exists(),
        format!("BIRD 2 ({})", juneau_tests::bird::BIRD),
        "apt-get install bird2",
    );
    need(
        Command::new("kubectl")
            .arg("version")
            .arg("--client")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false),
        "`kubectl`".into(),
        "install kubectl (tests/setup.sh)",
    );
    if let Err(e) = juneau_tests::kube::binaries_dir() {
        need(false, "etcd / kube-apiserver".into(), &format!("{e:#}"));
    }
    m
}

/// A host process killed and reaped on drop.
pub(crate) fn tail(p: &Path) -> String {
    let t = std::fs::read_to_string(p).unwrap_or_default();
    let l: Vec<&str> = t.lines().collect();
    l[l.len().saturating_sub(30)..].join("\n")
}

/// Polls `f` until it returns `Some` (`juneau_tests::daemon::wait_for`, every 100 ms for
/// at most [`SETUP_TIMEOUT`]); Ctrl-C ends the wait at once.
pub(crate) fn eventually<T>(what: &str, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    juneau_tests::daemon::wait_for(what, SETUP_TIMEOUT, Duration::from_millis(100), || {
        match check_interrupt() {
            Err(e) => Ok(Some(Err(e))),
            Ok(()) => Ok(f()?.map(Ok)),
        }
    })?
}

fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (Ctrl-C): cleaning up");
    }
    Ok(())
}

fn slice_patch(ready: bool) -> serde_json::Value {
    serde_json::json!({"endpoints": [{
        "addresses": ["10.244.0.10"], "nodeName": NODE,
        "conditions": {"ready": ready, "serving": ready, "terminating": false}
    }]})
}

fn advertised(r: &mut NodeStateReader, vip: Ipv4Addr) -> Result<bool> {
    Ok(r.routing_snapshot()?
        .state
        .advertised
        .iter()
        .any(|a| a.vip == vip))
}

/// The one Service of the convergence measurement and its EndpointSlice (one ready
/// endpoint on node-a).
fn web_service_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\n  annotations:\n    \
         juneau.loutres.me/load-balancer-external-network: perf\nspec:\n  type: LoadBalancer\n  \
         loadBalancerClass: juneau.loutres.me/load-balancer\n  externalTrafficPolicy: Local\n  \
         selector: {{app: web}}\n  ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: 8080}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {SLICE}\n  namespace: default\n  \
         labels: {{kubernetes.io/service-name: web, endpointslice.kubernetes.io/managed-by: juneau-perf}}\n\
         addressType: IPv4\nports:\n- {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n\
         - addresses: [\"10.244.0.10\"]\n  nodeName: {NODE}\n  conditions: {{ready: true, serving: true, terminating: false}}\n"
    )
}

/// The real control plane of one node: etcd + kube-apiserver with the CRDs, BIRD 2 in a
/// router namespace, `juneau-k8s-sync controller` and `agent --node node-a` on the host
/// (admin kubeconfig), `juneau-bgp` in a node namespace peering with BIRD; Node `node-a`,
/// an AddressPool `perf` of `pool`, ExternalNetwork, BGPAdvertisement and BGPPeer. Fields
/// drop in order: daemons first, the cluster last.
pub(crate) struct Bed {
    pub(crate) controller: Daemon,
    pub(crate) controller_log: PathBuf,
    pub(crate) agent: Daemon,
    pub(crate) agent_log: PathBuf,
    pub(crate) bgp: NsChild,
    pub(crate) bgp_log: PathBuf,
    pub(crate) bird: Bird,
    pub(crate) bird_log: PathBuf,
    /// The agent's state file.
    pub(crate) state: PathBuf,
    /// BIRD's control socket.
    pub(crate) ctl: PathBuf,
    /// Just before the first Juneau daemon was started.
    pub(crate) daemons_started: Instant,
    _node: Netns,
    _router: Netns,
    _dir: tempfile::TempDir,
    pub(crate) k: KubeCluster,
}

impl Bed {
    /// Fails if the controller or the agent exited.
    pub(crate) fn check(&mut self) -> Result<()> {
        self.controller.check_running()?;
        self.agent.check_running()
    }
}

/// Starts the [`Bed`] with the address pool `pool` (CIDR) and `extra_yaml` applied with
/// the Juneau objects (before the daemons start).
pub(crate) fn start_bed(
    bins: &Binaries,
    say: &dyn Fn(String),
    pool: &str,
    extra_yaml: &str,
) -> Result<Bed> {
    start_bed_with(bins, say, pool, extra_yaml, &mut |_| Ok(()))
}

/// [`start_bed`], running `before_daemons` once the Juneau objects are in and before any
/// Juneau daemon starts (the scale measurement's `--scale-precreated` creates its
/// Services there).
pub(crate) fn start_bed_with(
    bins: &Binaries,
    say: &dyn Fn(String),
    pool: &str,
    extra_yaml: &str,
    before_daemons: &mut dyn FnMut(&KubeCluster) -> Result<()>,
) -> Result<Bed> {
    say("convergence: starting etcd + kube-apiserver".into());
    let k = KubeCluster::start()?;
    k.apply_yaml(CRDS)?;
    k.kubectl(&["create", "namespace", "juneau-system"])?;
    k.wait_crds_established(juneau_tests::kube::JUNEAU_CRDS)?;

    // Namespaces: node <p>n (uplink 10.0.1.2) <-> router <p>r (d0 10.0.1.1).
    let prefix = unique_prefix("cvg");
    let router = Netns::new(format!("{prefix}r"))?;
    let node = Netns::new(format!("{prefix}n"))?;
    veth(&node, "uplink", &router, "d0")?;
    node.addr("uplink", &format!("{NODE_ADDR}/24"))?;
    router.addr("d0", &format!("{ROUTER_ADDR}/24"))?;
    let dir = tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir()?;
    let d = dir.path();

    let bird = Bird::start(
        router.name(),
        &d.join("router"),
        &BirdConfig::new(ROUTER_ADDR)
            .bgp(&BgpNeighbor::new(
                "juneau",
                ROUTER_ADDR,
                65000,
                NODE_ADDR,
                65001,
            ))
            .render(),
    )?;
    let bird_log = bird.log().to_path_buf();

    // Kubernetes objects: node-a (InternalIP = its BGP router id), network, peer,
    // advertisement, a Service and its EndpointSlice with one ready endpoint on node-a.
    k.create_node(NODE, &NODE_ADDR.to_string())?;
    k.apply_yaml(&format!(
        "apiVersion: juneau.loutres.me/v1alpha1\nkind: AddressPool\nmetadata: {{name: perf}}\n\
         spec: {{advertiseMode: bgp, addresses: [{pool}]}}\n---\n\
         apiVersion: juneau.loutres.me/v1alpha1\nkind: ExternalNetwork\nmetadata: {{name: perf}}\n\
         spec: {{type: bgp, addressPools: [perf]}}\n---\n\
         apiVersion: juneau.loutres.me/v1alpha1\nkind: BGPAdvertisement\nmetadata: {{name: perf}}\n\
         spec: {{addressPools: [perf]}}\n---\n\
         apiVersion: juneau.loutres.me/v1alpha1\nkind: BGPPeer\nmetadata: {{name: router}}\n\
         spec: {{peerAddress: {ROUTER_ADDR}, peerASN: 65000, localASN: 65001, holdTimeSeconds: 9, connectRetrySeconds: 1}}\n"
    ))?;
    if !extra_yaml.is_empty() {
        k.apply_yaml(extra_yaml)?;
    }
    before_daemons(&k)?;
    let daemons_started = Instant::now();

    // The real daemons: controller and agent on the host (admin kubeconfig), juneau-bgp
    // in the node namespace.
    let state = d.join(format!("{NODE}.state"));
    let spawn_host = |name: &str, args: &[&str]| -> Result<(Daemon, PathBuf)> {
        let log = d.join(format!("{name}.log"));
        let bin = bins.k8s_sync.to_str().context("juneau-k8s-sync path")?;
        let argv: Vec<&str> = std::iter::once(bin).chain(args.iter().copied()).collect();
        let spec = DaemonSpec::new(name, &argv, &log).kube_client(k.kubeconfig(), "info");
        Ok((Daemon::spawn(spec)?, log))
    };
    let (controller, controller_log) = spawn_host(
        "controller",
        &[
            "controller",
            "--namespace",
            "juneau-system",
            "--identity",
            "perf",
            "--lease-duration",
            "6",
        ],
    )?;
    let (agent, agent_log) = spawn_host(
        "agent",
        &[
            "agent",
            "--node",
            NODE,
            "--state-file",
            state.to_str().unwrap(),
            "--namespace",
            "juneau-system",
        ],
    )?;
    let bgp_log = d.join("juneau-bgp.log");
    let bgp: NsChild = node.spawn_logged(
        &[
            bins.bgp.to_str().unwrap(),
            "--state-file",
            state.to_str().unwrap(),
            "--status-file",
            d.join("bgp.status.json").to_str().unwrap(),
            "--listen",
            "0.0.0.0:179",
            // Route convergence only: no dataplane runs here.
            "--no-dataplane-gate",
        ],
        &bgp_log,
    )?;
    Ok(Bed {
        controller,
        controller_log,
        agent,
        agent_log,
        bgp,
        bgp_log,
        ctl: bird.ctl().to_path_buf(),
        daemons_started,
        bird,
        bird_log,
        state,
        _node: node,
        _router: router,
        _dir: dir,
        k,
    })
}

/// Runs the set-up, `reps` withdraw/announce cycles, and returns the distributions.
/// `say` prints progress.
pub fn measure(bins: &Binaries, reps: u32, say: &dyn Fn(String)) -> Result<ConvergenceReport> {
    let m = missing(bins);
    if !m.is_empty() {
        bail!(
            "missing: {}",
            m.iter()
                .map(|m| format!("{} ({})", m.what, m.fix))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    let mut bed = start_bed(bins, say, "203.0.113.0/24", &web_service_yaml())?;
    let state = bed.state.clone();
    let (agent_log, bgp_log, bird_log) = (
        bed.agent_log.clone(),
        bed.bgp_log.clone(),
        bed.bird_log.clone(),
    );
    say("convergence: waiting for the VIP in shared memory and at BIRD".into());
    let vip = eventually("the agent to advertise the Service's VIP", || {
        bed.check()?;
        if !state.exists() {
            return Ok(None);
        }
        let mut r = NodeStateReader::open(&state)?;
        // The bed's Service is IPv4 (BIRD's channel here is IPv4).
        Ok(r.routing_snapshot()?
            .state
            .advertised
            .iter()
            .find_map(|a| match a.vip {
                std::net::IpAddr::V4(v4) => Some(v4),
                std::net::IpAddr::V6(_) => None,
            }))
    })?;
    let mut birdc = bed.bird.control()?;
    eventually("BIRD to have the VIP's /32 from juneau-bgp", || {
        Ok(birdc.has_route(vip)?.then_some(()))
    })
    .with_context(|| {
        format!(
            "juneau-bgp log:\n{}\nBIRD log:\n{}",
            tail(&bgp_log),
            tail(&bird_log)
        )
    })?;
    // Cost of one query, for the resolution statement.
    let query_p50 = bird_query_p50(&mut birdc, vip)?;

    // The timed writes go over one kept-alive HTTPS connection.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let api = slice_api(&rt, &bed.k)?;
    rt.block_on(api.get(SLICE))
        .context("reading the EndpointSlice")?;

    let mut reader = NodeStateReader::open(&state)?;
    let mut max_gap = Duration::ZERO;
    let (mut shm_w, mut shm_a, mut bird_w, mut bird_a, mut write_rtt) =
        (vec![], vec![], vec![], vec![], vec![]);
    for rep in 0..reps {
        for ready in [false, true] {
            check_interrupt()?;
            bed.check()?;
            let (t0, rtt, t_shm, t_bird, gap) =
                time_change(&mut reader, &mut birdc, &rt, &api, vip, ready).with_context(|| {
                    format!(
                        "repetition {rep} (ready={ready}); agent log:\n{}\njuneau-bgp log:\n{}",
                        tail(&agent_log),
                        tail(&bgp_log)
                    )
                })?;
            let (a, b) = (t_shm - t0, t_bird.saturating_duration_since(t0));
            write_rtt.push(rtt);
            max_gap = max_gap.max(gap);
            if ready {
                shm_a.push(a);
                bird_a.push(b);
            } else {
                shm_w.push(a);
                bird_w.push(b);
            }
            // Let BIRD, the agent and the apiserver settle before the next change.
            std::thread::sleep(Duration::from_millis(200));
        }
        say(format!(
            "convergence: repetition {}/{reps}: withdraw shm {:.1} ms BIRD {:.1} ms, announce shm {:.1} ms BIRD {:.1} ms",
            rep + 1,
            shm_w.last().unwrap().as_secs_f64() * 1e3,
            bird_w.last().unwrap().as_secs_f64() * 1e3,
            shm_a.last().unwrap().as_secs_f64() * 1e3,
            bird_a.last().unwrap().as_secs_f64() * 1e3,
        ));
    }
    Ok(ConvergenceReport {
        status: "measured".into(),
        repetitions: reps,
        bird_poll_interval_ms: BIRD_POLL.as_secs_f64() * 1e3,
        bird_query_p50_ms: query_p50.as_secs_f64() * 1e3,
        bird_max_gap_ms: max_gap.as_secs_f64() * 1e3,
        setup: convergence_setup(),
        series: vec![
            Series::from_samples("withdraw: apiserver -> shared memory", &shm_w),
            Series::from_samples("withdraw: apiserver -> BIRD", &bird_w),
            Series::from_samples("announce: apiserver -> shared memory", &shm_a),
            Series::from_samples("announce: apiserver -> BIRD", &bird_a),
            Series::from_samples("PATCH round trip (t0 -> response)", &write_rtt),
        ],
    })
}

/// One timed change: `ready` (true: announce, false: withdraw) patched into the
/// EndpointSlice through `api` while the shared memory (`reader`) and BIRD (`birdc`) are
/// watched for `vip` to follow. Returns t0 (just before the PATCH), the PATCH's round
/// trip, when each saw the change, and the longest gap between two BIRD queries.
fn time_change(
    reader: &mut NodeStateReader,
    birdc: &mut BirdControl,
    rt: &tokio::runtime::Runtime,
    api: &kube::Api<k8s_openapi::api::discovery::v1::EndpointSlice>,
    vip: Ipv4Addr,
    ready: bool,
) -> Result<(Instant, Duration, Instant, Instant, Duration)> {
    let barrier = Arc::new(Barrier::new(3));
    let seen = reader.generation();
    std::thread::scope(|s| -> Result<_> {
        let b1 = barrier.clone();
        let rd = reader;
        let shm = s.spawn(move || shm_sees_change(rd, seen, vip, ready, &b1));
        let b2 = barrier.clone();
        let bc = birdc;
        let bird = s.spawn(move || bird_sees_change(bc, vip, ready, &b2));
        barrier.wait();
        let t0 = Instant::now();
        rt.block_on(api.patch(
            SLICE,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(slice_patch(ready)),
        ))
        .context("patching the EndpointSlice")?;
        let rtt = t0.elapsed();
        let t_shm = shm.join().expect("shm watcher")?;
        let (t_bird, gap) = bird.join().expect("BIRD watcher")?;
        Ok((t0, rtt, t_shm, t_bird, gap))
    })
}

/// When the shared memory (`rd`, at generation `seen`) shows `vip` advertised as
/// `ready`, watched from the `barrier` on for [`STEP_TIMEOUT`].
fn shm_sees_change(
    rd: &mut NodeStateReader,
    seen: u64,
    vip: Ipv4Addr,
    ready: bool,
    barrier: &Barrier,
) -> Result<Instant> {
    let mut g = seen;
    barrier.wait();
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let ng = rd.wait_change(g, deadline.saturating_duration_since(Instant::now()));
        let t = Instant::now();
        if ng != g {
            g = ng;
            if advertised(rd, vip)? == ready {
                return Ok(t);
            }
        }
        if Instant::now() >= deadline {
            bail!("shared memory did not change to advertised={ready} within {STEP_TIMEOUT:?}");
        }
    }
}

/// When BIRD (`bc`) has the route to `vip` as `ready` says, asked every [`BIRD_POLL`]
/// from the `barrier` on for [`STEP_TIMEOUT`]; with the longest gap between two queries.
fn bird_sees_change(
    bc: &mut BirdControl,
    vip: Ipv4Addr,
    ready: bool,
    barrier: &Barrier,
) -> Result<(Instant, Duration)> {
    barrier.wait();
    let deadline = Instant::now() + STEP_TIMEOUT;
    // The longest time between two queries: the real resolution.
    let (mut prev, mut gap) = (None::<Instant>, Duration::ZERO);
    loop {
        let t = Instant::now();
        if let Some(p) = prev {
            gap = gap.max(t - p);
        }
        prev = Some(t);
        if bc.has_route(vip)? == ready {
            return Ok((t, gap));
        }
        if t >= deadline {
            bail!("BIRD did not change to route={ready} within {STEP_TIMEOUT:?}");
        }
        std::thread::sleep(BIRD_POLL);
    }
}

/// The median time of a BIRD query for `vip`'s route, over 50 queries.
fn bird_query_p50(birdc: &mut BirdControl, vip: Ipv4Addr) -> Result<Duration> {
    let mut q = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        birdc.has_route(vip)?;
        q.push(t.elapsed());
    }
    q.sort();
    Ok(q[q.len() / 2])
}

/// The EndpointSlices of the `default` namespace of the bed's cluster `k`, through a
/// client of its own (`rt` drives it).
fn slice_api(
    rt: &tokio::runtime::Runtime,
    k: &KubeCluster,
) -> Result<kube::Api<k8s_openapi::api::discovery::v1::EndpointSlice>> {
    rt.block_on(async {
        let kc = kube::config::Kubeconfig::read_from(k.kubeconfig())?;
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
        let client = kube::Client::try_from(cfg)?;
        anyhow::Ok(kube::Api::namespaced(client, "default"))
    })
}

/// How the convergence figures were measured, for the report.
fn convergence_setup() -> String {
    format!(
        "real etcd + kube-apiserver {}, juneau-k8s-sync controller + agent --node {NODE} (admin kubeconfig), \
         juneau-bgp in a node netns peering eBGP with BIRD 2 in a router netns; one Service, one endpoint \
         toggled ready=false (withdraw) / ready=true (announce); t0 = just before the PATCH is sent",
        juneau_tests::kube::kubernetes_version()
    )
}

/// Expected duration of a measurement of `reps` repetitions (cluster start, session
/// set-up, then ~1 s per repetition).
pub fn expected(reps: u32) -> Duration {
    Duration::from_secs(15) + Duration::from_millis(600) * reps
}
