//! The lab: one whole Juneau installation on this machine, on real parts — etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler ([`crate::kube`]), three
//! nodes each with its own containerd and kubelet ([`crate::node`]), an upstream BIRD 2
//! router ([`crate::bird`]) and a client, in network namespaces — and the user guide's
//! walk on it. Used by the `juneau-lab` binary (`./lab/lab up|show|down`), the lab's
//! end-to-end test and the day-2 operations suite.
//!
//! There is one lab per machine: its namespaces (`jlab-*`), the host bridge `jlab-mgmt`,
//! the host routes to the nodes' addresses, the state directory [`STATE`] and the node
//! state files `/run/juneau/node-*.state` have fixed names. [`Lab`] removes all of it
//! when dropped (also on panic) unless [`Lab::detach`]ed; [`down`] removes it by name.

use std::collections::BTreeMap;
use std::fs;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bird::{bgp_nexthops, BgpNeighbor, Bird, BirdConfig};
use crate::daemon::{stop_pid, wait_for, Daemon, DaemonSpec};
use crate::images::{ImageArchive, Images};
use crate::install::{self, pod_process, Release};
use crate::kube::{binaries_dir, ClusterOptions, KubeCluster};
use crate::netns::{run, Netns};
use crate::node::{self, KubeletNode, NodeSpec};
use crate::prometheus::{Prometheus, PrometheusSpec, Target};
use crate::repo_root;

/// Everything the lab writes (kube/, nodes/, router/, logs/, pids/, images/).
pub const STATE: &str = "/run/juneau-lab";
/// Prefix of the lab's network namespaces.
pub const NETNS_PREFIX: &str = "jlab-";
/// The guide's VIP.
pub const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The guide's client.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 42);
const ROUTER_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// The client's IPv6 address (the lab is dual-stack: every link has both families).
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xc, 0, 0, 0, 0, 0x42);
const ROUTER_CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xc, 0, 0, 0, 0, 1);
/// The pool of the guide's ExternalNetwork for IPv6 VIPs (AddressPool `public-v6`).
pub const VIP6_POOL: &str = "2001:db8:113::/120";
/// A second client, on a network of its own behind the router (namespace `outsider`):
/// the one a Service's `loadBalancerSourceRanges` can leave out.
pub const OUTSIDER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 7, 7);
const ROUTER_OUTSIDER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 7, 1);
const OUTSIDER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x7, 0, 0, 0, 0, 7);
const ROUTER_OUTSIDER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x7, 0, 0, 0, 0, 1);
/// The router's address on the node fabric.
pub const ROUTER_FABRIC_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The router's IPv6 address on the node fabric (the IPv6 BGPPeer `upstream-v6`).
pub const ROUTER_FABRIC_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xf, 0, 0, 0, 0, 1);
const ROUTER_ASN: u32 = 64512;
const NODE_ASN: u32 = 64513;
/// The host end of the management bridge; the API server listens here.
pub const MGMT_HOST: Ipv4Addr = Ipv4Addr::new(172, 31, 255, 1);
/// The host end of the management bridge, IPv6.
const MGMT_HOST6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x172, 0x31, 0x255, 0, 0, 0, 1);
const API_PORT: u16 = 6443;
const MGMT_BRIDGE: &str = "jlab-mgmt";
/// Where the agents write and the dataplanes and speakers read the node state.
const SHM_DIR: &str = "/run/juneau";
/// MTU of the node fabric (node uplinks, the router's fabric ports): room for the
/// dataplane's redirect header (up to 76 bytes) on top of the client side's 1500
/// (docs/dataplane.md, "Redirects between nodes", MTU).
const FABRIC_MTU: u16 = 1600;
/// Where the lab's Prometheus listens (on the management bridge, reachable from the
/// host): it scrapes every Juneau process of the lab (docs/lab.md).
pub const PROMETHEUS_ADDR: std::net::SocketAddr =
    std::net::SocketAddr::V4(std::net::SocketAddrV4::new(MGMT_HOST, 9740));
/// The controller's metrics port (the chart's `metrics.controllerPort`).
const CONTROLLER_METRICS_PORT: u16 = 9741;
/// Metrics ports of the node components (their defaults; each node is its own netns).
const NODE_METRICS_PORTS: [(&str, u16); 3] = [
    ("juneau-agent", 9742),
    ("juneau-dataplane", 9743),
    ("juneau-bgp", 9744),
];

/// The tag of the `juneau` image the lab builds and installs.
pub const JUNEAU_IMAGE_TAG: &str = "lab";
/// The programs of the node DaemonSet's containers: agent, dataplane, speaker, BFD.
const NODE_PROGRAMS: [&str; 4] = [
    "juneau-k8s-sync",
    "juneau-dataplane",
    "juneau-bgp",
    "juneau-bfd",
];
/// The longest an install, upgrade, rollback or a container's restart may take.
pub const JUNEAU_ROLLOUT: Duration = Duration::from_secs(300);

/// The lab's values for deploy/helm/juneau (`helm install -f`): the image imported on
/// each node, the API server's real address (the lab runs no kube-proxy, so the
/// `kubernetes` Service's ClusterIP leads nowhere), the nodes' uplink and Pod bridge,
/// the fabric's MTU for redirects between nodes, and half a core for the dataplane: each
/// lab node reports the machine's 2 cores, and an upgrade runs the old and the new node
/// Pod side by side for a moment (node.updateStrategy), which the default request of a
/// whole core would not fit.
fn lab_values() -> String {
    format!(
        "# The lab's values for deploy/helm/juneau (tests/src/lab.rs).\n\
         image: {{repository: juneau, tag: {JUNEAU_IMAGE_TAG}, pullPolicy: Never}}\n\
         apiServer: {{host: \"{MGMT_HOST}\", port: {API_PORT}}}\n\
         node:\n\
         \x20 nodeSelector: {{juneau.loutres.me/lab: \"true\"}}\n\
         \x20 uplinkInterface: eth0\n\
         \x20 podBridge: cni0\n\
         \x20 redirects: {}\n\
         \x20 redirectMtu: {FABRIC_MTU}\n\
         \x20 dataplane:\n\
         \x20   resources:\n\
         \x20     requests: {{cpu: 500m, memory: 128Mi}}\n\
         \x20     limits: {{memory: 512Mi}}\n",
        !redirects_disabled()
    )
}

/// Where node's dataplane pins its flow table, maps and XDP links: the default
/// `--pin-dir` (`/sys/fs/bpf/juneau/<node>`) in the host's bpffs, which the DaemonSet
/// mounts (all three lab nodes share the host's; each node's directory is its own).
fn pin_dir(node: &str) -> PathBuf {
    Path::new("/sys/fs/bpf/juneau").join(node)
}

/// One lab node's names and addresses.
#[derive(Debug, Clone, Copy)]
pub struct LabNode {
    /// Node name.
    pub name: &'static str,
    /// One letter for interface names.
    pub short: &'static str,
    /// Uplink address on the fabric (BGP router id; the redirect address the agent publishes
    /// from the Node annotation).
    pub ip: Ipv4Addr,
    /// Management address (towards the API server; the Node's InternalIP).
    pub mgmt: Ipv4Addr,
    /// Pod subnet base (`/24` on cni0, gateway `.1`).
    pub pods: Ipv4Addr,
    /// Uplink IPv6 address on the fabric (the IPv6 BGP session's; the speaker's next hop
    /// for IPv6 VIPs).
    pub ip6: Ipv6Addr,
    /// Management IPv6 address (the Node's second InternalIP).
    pub mgmt6: Ipv6Addr,
    /// IPv6 Pod subnet base (`/64` on cni0, gateway `::1`).
    pub pods6: Ipv6Addr,
}

/// The node's Pod subnet, `a.b.c.0/24`.
fn pod_subnet(n: LabNode) -> String {
    format!("{}/24", n.pods)
}

/// The node's IPv6 Pod subnet, `.../64`.
fn pod_subnet6(n: LabNode) -> String {
    format!("{}/64", n.pods6)
}

/// `base` with `host` as its last 16 bits (`::1` the gateway of a /64).
fn host6(base: Ipv6Addr, host: u16) -> Ipv6Addr {
    let mut s = base.segments();
    s[7] = host;
    Ipv6Addr::from(s)
}

/// node-a, node-b, node-c.
pub const NODES: [LabNode; 3] = [
    LabNode {
        name: "node-a",
        short: "a",
        ip: Ipv4Addr::new(192, 0, 2, 11),
        mgmt: Ipv4Addr::new(172, 31, 255, 11),
        pods: Ipv4Addr::new(10, 244, 1, 0),
        ip6: Ipv6Addr::new(0x2001, 0xdb8, 0xf, 0, 0, 0, 0, 0x11),
        mgmt6: Ipv6Addr::new(0xfd00, 0x172, 0x31, 0x255, 0, 0, 0, 0x11),
        pods6: Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0),
    },
    LabNode {
        name: "node-b",
        short: "b",
        ip: Ipv4Addr::new(192, 0, 2, 12),
        mgmt: Ipv4Addr::new(172, 31, 255, 12),
        pods: Ipv4Addr::new(10, 244, 2, 0),
        ip6: Ipv6Addr::new(0x2001, 0xdb8, 0xf, 0, 0, 0, 0, 0x12),
        mgmt6: Ipv6Addr::new(0xfd00, 0x172, 0x31, 0x255, 0, 0, 0, 0x12),
        pods6: Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0),
    },
    LabNode {
        name: "node-c",
        short: "c",
        ip: Ipv4Addr::new(192, 0, 2, 13),
        mgmt: Ipv4Addr::new(172, 31, 255, 13),
        pods: Ipv4Addr::new(10, 244, 3, 0),
        ip6: Ipv6Addr::new(0x2001, 0xdb8, 0xf, 0, 0, 0, 0, 0x13),
        mgmt6: Ipv6Addr::new(0xfd00, 0x172, 0x31, 0x255, 0, 0, 0, 0x13),
        pods6: Ipv6Addr::new(0xfd00, 0x10, 0x244, 3, 0, 0, 0, 0),
    },
];

/// The Node annotation the agents read for the redirect address (the kubelets'
/// InternalIP is the management address, the dataplanes' uplinks are on the fabric).
pub const REDIRECT_ADDRESS_ANNOTATION: &str = "juneau.loutres.me/redirect-address";

/// Whether `JUNEAU_LAB_NO_REDIRECTS=1` asks for dataplanes without redirects between nodes
/// (to show what they prevent, e.g. in tests/tests/ecmp_change.rs; never in CI).
pub fn redirects_disabled() -> bool {
    std::env::var("JUNEAU_LAB_NO_REDIRECTS").is_ok_and(|v| v == "1")
}

/// The node named `name`.
pub fn lab_node(name: &str) -> Result<LabNode> {
    NODES
        .iter()
        .find(|n| n.name == name)
        .copied()
        .with_context(|| format!("the lab has no node {name}"))
}

fn state() -> PathBuf {
    PathBuf::from(STATE)
}

/// The admin kubeconfig (what `export KUBECONFIG=...` gives the user).
pub fn admin_kubeconfig() -> PathBuf {
    state().join("kube/admin.kubeconfig")
}

/// BIRD's control socket.
pub fn bird_ctl() -> PathBuf {
    state().join("router/bird.ctl")
}

/// A client namespace `name` at `ip`/24 and `ip6`/64 behind the router's port `port`
/// (`router_ip`, `router_ip6`), its default routes through the router.
fn client_behind(
    router: &Netns,
    name: &str,
    port: &str,
    (ip, ip6): (Ipv4Addr, Ipv6Addr),
    (router_ip, router_ip6): (Ipv4Addr, Ipv6Addr),
) -> Result<Netns> {
    let client = Netns::new(ns(name))?;
    let (c, r) = (client.name(), router.name());
    run(
        "ip",
        &[
            "link", "add", "eth0", "netns", c, "type", "veth", "peer", "name", port, "netns", r,
        ],
    )?;
    client.addr("eth0", &format!("{ip}/24"))?;
    // A real wire carries finished checksums; a veth from a kernel socket carries
    // CHECKSUM_PARTIAL ones (docs/lab.md).
    client.exec(&["ethtool", "-K", "eth0", "tx", "off"])?;
    let via = router_ip.to_string();
    client.exec(&["ip", "route", "add", "default", "via", &via])?;
    client.addr6("eth0", &format!("{ip6}/64"))?;
    client.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        "default",
        "via",
        &router_ip6.to_string(),
    ])?;
    router.addr(port, &format!("{router_ip}/24"))?;
    router.addr6(port, &format!("{router_ip6}/64"))?;
    ok(&format!(
        "{name} {ip} {ip6} --- router {router_ip} {router_ip6}"
    ));
    Ok(client)
}

/// Adds the IPv6 address `cidr` to `ifname` in `netns` without duplicate address
/// detection (`nodad`: usable at once, the lab's addresses are unique by construction).
fn logs() -> PathBuf {
    state().join("logs")
}

fn node_dir(n: &str) -> PathBuf {
    state().join("nodes").join(n)
}

fn cgroup_root(n: &str) -> String {
    format!("/jlab-{n}")
}

/// The network namespace of the lab part `name` ("client", "router", "node-a", ...).
pub fn ns(name: &str) -> String {
    format!("{NETNS_PREFIX}{name}")
}

// ------------------------------------------------------------------------- output

fn bold(s: &str) -> String {
    if std::env::var_os("NO_COLOR").is_none()
        && std::io::IsTerminal::is_terminal(&std::io::stdout())
    {
        format!("\x1b[1m{s}\x1b[0m")
    } else {
        s.to_string()
    }
}

/// `==> what` (a step of the walk).
pub fn step(what: &str) {
    println!("\n{}", bold(&format!("==> {what}")));
}

/// `    ✓ what`.
pub fn ok(what: &str) {
    println!("    ✓ {what}");
}

/// `    what`.
pub fn info(what: &str) {
    println!("    {what}");
}

// ------------------------------------------------------------------------- commands

/// `kubectl ARGS...` with the lab's admin kubeconfig; stdout, or an error with stderr.
pub fn kubectl(args: &[&str]) -> Result<String> {
    crate::kube::kubectl_with(&admin_kubeconfig(), args, None)
}

fn kubectl_output(args: &[&str]) -> Result<Output> {
    crate::kube::kubectl_output(&admin_kubeconfig(), args, None)
}

/// `kubectl apply -f -` of `yaml`.
pub fn kubectl_apply(yaml: &str) -> Result<String> {
    crate::kube::kubectl_with(&admin_kubeconfig(), &["apply", "-f", "-"], Some(yaml))
}

/// Prints `$ CMD` as a user would type it, runs it and prints its output; fails if it
/// fails. `display` is what is shown, `argv` what runs.
fn show(display: &str, argv: &[&str], env: &[(&str, &str)]) -> Result<String> {
    println!("{}", bold(&format!("$ {display}")));
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {display}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    if !text.ends_with('\n') && !text.is_empty() {
        println!();
    }
    if !out.status.success() {
        bail!(
            "`{display}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(text)
}

/// Runs `argv` in the lab namespace `name` (e.g. `client`).
pub fn in_ns(name: &str, argv: &[&str]) -> Result<String> {
    let mut full = vec![
        "nsenter".to_string(),
        format!("--net=/run/netns/{}", ns(name)),
        "--".into(),
    ];
    full.extend(argv.iter().map(|s| s.to_string()));
    let out = Command::new(&full[0])
        .args(&full[1..])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {argv:?} in {}", ns(name)))?;
    if !out.status.success() {
        bail!(
            "{argv:?} in {} failed ({}): {}",
            ns(name),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The router's kernel next hops for the VIP, sorted.
pub fn router_next_hops() -> Result<Vec<Ipv4Addr>> {
    crate::netns::route_next_hops(&ns("router"), VIP)
}

// ------------------------------------------------------------------------- binaries

/// The debug binaries the lab runs on the host (`kubectl-juneau`, `juneau-lab`), next to
/// this program or the test; Juneau itself runs from its image.
#[derive(Debug, Clone)]
pub struct JuneauBins {
    /// The directory holding them.
    pub dir: PathBuf,
}

impl JuneauBins {
    /// `$JUNEAU_BIN_DIR`, else the directory of the running executable (a test's
    /// `target/debug/deps` counts as `target/debug`).
    pub fn locate() -> Result<JuneauBins> {
        let dir = match std::env::var_os("JUNEAU_BIN_DIR") {
            Some(d) => PathBuf::from(d),
            None => {
                let exe = std::env::current_exe()?;
                let mut d = exe
                    .parent()
                    .context("executable has no directory")?
                    .to_path_buf();
                if d.ends_with("deps") {
                    d.pop();
                }
                d
            }
        };
        let b = JuneauBins { dir };
        // Juneau itself runs from its image (release builds); these are the user's
        // kubectl plugin and the lab's own program (load clients).
        for name in ["kubectl-juneau", "juneau-lab"] {
            if !b.path(name).is_file() {
                bail!(
                    "{} is missing: build with `cargo build -p juneau-k8s-sync -p juneau-tests \
                     --bins` (./lab/lab does)",
                    b.path(name).display()
                );
            }
        }
        Ok(b)
    }

    /// Builds the binaries with cargo into the target directory this test runs from,
    /// then locates them (for tests: `cargo test -p juneau-tests` builds only this
    /// crate's binaries).
    pub fn build_and_locate() -> Result<JuneauBins> {
        if std::env::var_os("JUNEAU_BIN_DIR").is_none() {
            let exe = std::env::current_exe()?;
            // <target>/debug/deps/<test> -> <target>
            let target = exe
                .ancestors()
                .find(|p| p.ends_with("debug"))
                .and_then(Path::parent)
                .context("cannot find the cargo target directory")?
                .to_path_buf();
            let root = repo_root();
            let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .current_dir(&root)
                .env("CARGO_TARGET_DIR", &target)
                .args([
                    "build",
                    // Juneau's programs too: the image test builds an image from them.
                    "-p",
                    "juneau-k8s-sync",
                    "-p",
                    "juneau-dataplane",
                    "-p",
                    "juneau-bgp",
                    "-p",
                    "juneau-tests",
                    "--bins",
                ])
                .output()
                .context("running cargo build")?;
            if !out.status.success() {
                bail!(
                    "cargo build of Juneau's binaries failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        Self::locate()
    }

    /// The path of binary `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

// ------------------------------------------------------------------------- the lab

/// A running lab. Dropping it removes everything (see [`down`]) unless detached.
#[derive(Debug)]
pub struct Lab {
    bins: JuneauBins,
    // Drop order (explicit in `teardown`): Prometheus, nodes (with Juneau's Pods),
    // router, control plane, netns.
    prometheus: Option<Prometheus>,
    nodes: Vec<KubeletNode>,
    bird: Option<Bird>,
    cluster: Option<KubeCluster>,
    netns: Vec<Netns>,
    detached: bool,
}

/// Whether anything of a lab exists on this machine (its state directory or a
/// namespace).
pub fn exists() -> bool {
    state().exists() || lab_netns().map(|v| !v.is_empty()).unwrap_or(false)
}

/// Makes room for a test's lab: fails if a lab on this machine still has a process
/// running (someone's lab, or another test's), removes the leftovers of one that has
/// none (a machine or a test stopped under it: namespaces and files outlive processes).
pub fn clear_leftovers_or_refuse() -> Result<()> {
    if !exists() {
        return Ok(());
    }
    let running = running_processes();
    if !running.is_empty() {
        bail!("a lab runs on this machine (pids {running:?}): run `./lab/lab down` first");
    }
    step("Leftovers of a lab no process of which runs: removing them first");
    down()
}

/// The processes of a lab on this machine: those recorded in `STATE/pids` that still
/// run, those with the lab's state directory in their arguments, those inside its
/// namespaces.
fn running_processes() -> Vec<u32> {
    let mut pids: Vec<u32> = fs::read_dir(state().join("pids"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let text = fs::read_to_string(e.path()).ok()?;
            let mut it = text.split_whitespace();
            let pid = it.next()?.parse::<u32>().ok()?;
            let expect = it.next()?;
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains(expect)
                .then_some(pid)
        })
        .collect();
    pids.extend(lab_processes());
    for name in lab_netns().unwrap_or_default() {
        if let Ok(out) = run("ip", &["netns", "pids", &name]) {
            pids.extend(
                String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn lab_netns() -> Result<Vec<String>> {
    let out = run("ip", &["netns", "list"])?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(NETNS_PREFIX))
        .map(str::to_string)
        .collect())
}

impl Lab {
    /// Brings the whole lab up: control plane, topology, router, nodes (kubelets register
    /// themselves), Juneau (CRDs, RBAC, controller ×2, an agent, a dataplane and a BGP
    /// speaker per node) and the guide's manifests; returns when the nginx Pods are
    /// Ready by their own probes. Fails if a lab exists already.
    pub fn up(bins: JuneauBins) -> Result<Lab> {
        if exists() {
            bail!("a lab exists on this machine ({STATE} or {NETNS_PREFIX}* namespaces): run `./lab/lab down` first");
        }
        for d in ["logs", "pids", "nodes", "router", "images"] {
            fs::create_dir_all(state().join(d))?;
        }
        let mut lab = Lab {
            bins,
            prometheus: None,
            nodes: vec![],
            bird: None,
            cluster: None,
            netns: vec![],
            detached: false,
        };
        if let Err(e) = lab.bring_up() {
            keep_logs();
            return Err(e);
        }
        Ok(lab)
    }

    fn bring_up(&mut self) -> Result<()> {
        self.topology()?;
        self.control_plane()?;
        self.router()?;
        let image = self.juneau_image()?;
        self.start_nodes(&image)?;
        self.install_juneau()?;
        self.guide_manifests()?;
        self.wait_pods_ready(3, Duration::from_secs(240))?;
        println!("{}", bold("$ kubectl get pods -o wide"));
        print!("{}", kubectl(&["get", "pods", "-o", "wide"])?);
        self.start_prometheus()?;
        Ok(())
    }

    /// Prometheus (Debian's) scraping every Juneau process: both controller replicas
    /// and each node's agent, dataplane and speaker (on the node's management address),
    /// with the shipped alert rules loaded.
    fn start_prometheus(&mut self) -> Result<()> {
        step(&format!(
            "Prometheus on http://{PROMETHEUS_ADDR} scraping every Juneau process every 5 s"
        ));
        // The controller replicas are Pods on the Pod network, scraped at their Pod IPs
        // as they are now (Debian's Prometheus is built without Kubernetes service
        // discovery: a replica replaced later is not followed).
        let pods = kubectl(&[
            "-n",
            install::NAMESPACE,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=juneau-controller",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{\"\\n\"}{end}",
        ])?;
        let mut targets: Vec<Target> = pods
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(pod, ip)| {
                Target::new(
                    "juneau-controller",
                    format!("{ip}:{CONTROLLER_METRICS_PORT}"),
                )
                .label("pod", pod)
            })
            .collect();
        for n in NODES {
            for (job, port) in NODE_METRICS_PORTS {
                targets.push(Target::new(job, format!("{}:{port}", n.mgmt)).label("node", n.name));
            }
        }
        let p = Prometheus::start(&PrometheusSpec {
            dir: state().join("prometheus"),
            listen: PROMETHEUS_ADDR,
            rule_files: vec![repo_root().join("deploy/monitoring/juneau-alerts.rules.yaml")],
            targets,
            // Every 5 s: light on a small machine (the operations suite runs under it).
            interval_s: 5,
        })?;
        ok(&format!(
            "prometheus (pid {}, {} targets, log {})",
            p.pid(),
            2 + 3 * NODE_METRICS_PORTS.len(),
            state().join("prometheus/prometheus.log").display()
        ));
        self.prometheus = Some(p);
        Ok(())
    }

    /// The binaries this lab runs.
    pub fn bins(&self) -> &JuneauBins {
        &self.bins
    }

    fn topology(&mut self) -> Result<()> {
        step(&format!(
            "Network namespaces: client, outsider, router (BIRD 2), node-a, node-b, node-c; management bridge {MGMT_BRIDGE} {MGMT_HOST}/24"
        ));
        run("ip", &["link", "add", MGMT_BRIDGE, "type", "bridge"])?;
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{MGMT_HOST}/24"),
                "dev",
                MGMT_BRIDGE,
            ],
        )?;
        run(
            "ip",
            &[
                "-6",
                "addr",
                "add",
                &format!("{MGMT_HOST6}/64"),
                "dev",
                MGMT_BRIDGE,
                "nodad",
            ],
        )?;
        run("ip", &["link", "set", MGMT_BRIDGE, "up"])?;
        let router = Netns::new(ns("router"))?;
        let client = client_behind(
            &router,
            "client",
            "c0",
            (CLIENT_IP, CLIENT_IP6),
            (ROUTER_CLIENT_IP, ROUTER_CLIENT_IP6),
        )?;
        self.netns.push(client);
        router.exec(&["ip", "link", "add", "fabric", "type", "bridge"])?;
        router.addr("fabric", &format!("{ROUTER_FABRIC_IP}/24"))?;
        router.addr6("fabric", &format!("{ROUTER_FABRIC_IP6}/64"))?;
        router.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        router.exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])?;
        router.exec(&["sysctl", "-qw", "net.ipv6.fib_multipath_hash_policy=1"])?;
        // ECMP hashes on addresses and ports, so one client's connections spread.
        router.exec(&["sysctl", "-qw", "net.ipv4.fib_multipath_hash_policy=1"])?;
        let outsider = client_behind(
            &router,
            "outsider",
            "c1",
            (OUTSIDER_IP, OUTSIDER_IP6),
            (ROUTER_OUTSIDER_IP, ROUTER_OUTSIDER_IP6),
        )?;
        self.netns.push(outsider);
        for n in NODES {
            let node = Netns::new(ns(n.name))?;
            let f = format!("f-{}", n.short);
            run(
                "ip",
                &[
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    node.name(),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &f,
                    "netns",
                    router.name(),
                ],
            )?;
            router.exec(&["ip", "link", "set", &f, "mtu", &FABRIC_MTU.to_string()])?;
            router.exec(&["ip", "link", "set", &f, "master", "fabric", "up"])?;
            // XDP_REDIRECT into the node's uplink veth drops unless its peer has GRO on.
            let _ = router.exec(&["ethtool", "-K", &f, "gro", "on"]);
            node.exec(&["ip", "link", "set", "eth0", "mtu", &FABRIC_MTU.to_string()])?;
            node.addr("eth0", &format!("{}/24", n.ip))?;
            node.exec(&[
                "ip",
                "route",
                "add",
                "default",
                "via",
                &ROUTER_FABRIC_IP.to_string(),
            ])?;
            node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
            node.addr6("eth0", &format!("{}/64", n.ip6))?;
            node.exec(&[
                "ip",
                "-6",
                "route",
                "add",
                "default",
                "via",
                &ROUTER_FABRIC_IP6.to_string(),
            ])?;
            node.exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])?;
            // Management link to the host (API server; and the API server to the kubelet).
            let m = format!("jlab-m-{}", n.short);
            run(
                "ip",
                &[
                    "link",
                    "add",
                    &m,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "mgmt0",
                    "netns",
                    node.name(),
                ],
            )?;
            run("ip", &["link", "set", &m, "master", MGMT_BRIDGE, "up"])?;
            node.addr("mgmt0", &format!("{}/24", n.mgmt))?;
            node.addr6("mgmt0", &format!("{}/64", n.mgmt6))?;
            // The Pod network is routed, as on clusters without an overlay: the host
            // (the API server, Prometheus) reaches Pods on the Pod network — the
            // controller replicas — through their node, and they reach it back.
            run(
                "ip",
                &[
                    "route",
                    "replace",
                    &pod_subnet(n),
                    "via",
                    &n.mgmt.to_string(),
                    "dev",
                    MGMT_BRIDGE,
                ],
            )?;
            run(
                "ip",
                &[
                    "-6",
                    "route",
                    "replace",
                    &pod_subnet6(n),
                    "via",
                    &n.mgmt6.to_string(),
                    "dev",
                    MGMT_BRIDGE,
                ],
            )?;
            // The API server reaches the kubelet at the node's InternalIP (kubectl logs),
            // which is the management address: on jlab-mgmt's /24, no host route.
            // The Pod network's bridge, made before any Pod exists (the dataplane serves
            // it from the start); the bridge CNI plugin plugs Pods into it. Its MAC is
            // fixed so it does not change when the first Pod's veth joins.
            let o = n.pods.octets();
            node.exec(&["ip", "link", "add", "cni0", "type", "bridge"])?;
            node.exec(&[
                "ip",
                "link",
                "set",
                "cni0",
                "address",
                &format!("02:00:0a:f4:{:02x}:01", o[2]),
            ])?;
            node.addr("cni0", &format!("{}.{}.{}.1/24", o[0], o[1], o[2]))?;
            node.addr6("cni0", &format!("{}/64", host6(n.pods6, 1)))?;
            ok(&format!(
                "{} uplink {} {} (router fabric {ROUTER_FABRIC_IP} {ROUTER_FABRIC_IP6}), mgmt {} {}, Pods {} {} on bridge cni0",
                n.name, n.ip, n.ip6, n.mgmt, n.mgmt6, pod_subnet(n), pod_subnet6(n)
            ));
            self.netns.push(node);
        }
        self.netns.push(router);
        Ok(())
    }

    fn control_plane(&mut self) -> Result<()> {
        step(&format!(
            "Kubernetes control plane: etcd, kube-apiserver ({MGMT_HOST}:{API_PORT}), kube-controller-manager, kube-scheduler"
        ));
        let mut k = KubeCluster::start_with(ClusterOptions {
            bind_address: MGMT_HOST,
            api_port: Some(API_PORT),
            dir: Some(state().join("kube")),
            node_lifecycle: true,
            // Juneau's Pods use their ServiceAccounts' tokens (in-cluster config).
            service_account_tokens: true,
            // Services of both families (ClusterIPs from both ranges), as the nodes' Pods
            // have addresses of both.
            dual_stack: true,
        })?;
        k.start_controller_manager()?;
        k.start_scheduler()?;
        ok(&format!(
            "API at {} (binaries from {})",
            k.server(),
            binaries_dir()?.display()
        ));
        self.cluster = Some(k);
        Ok(())
    }

    fn router(&mut self) -> Result<()> {
        step(&format!(
            "Upstream router: BIRD 2, AS {ROUTER_ASN}, eBGP to each node (AS {NODE_ASN}) over IPv4 and over IPv6, ECMP into the kernel"
        ));
        // As operators configure theirs: graceful restart (a speaker restart keeps the
        // node's routes) and BFD towards the nodes (a dead node or link leaves ECMP
        // within 0.9 s), the timers of the guide's BGPPeer.
        let mut conf = BirdConfig::new(ROUTER_FABRIC_IP)
            .kernel_ecmp()
            .bfd("fabric", 300, 300, 3);
        for n in NODES {
            conf = conf.bgp(
                &BgpNeighbor::new(
                    &n.name.replace('-', "_"),
                    ROUTER_FABRIC_IP,
                    ROUTER_ASN,
                    n.ip,
                    NODE_ASN,
                )
                .graceful_restart(120)
                .bfd(),
            );
            // A session per family, as BIRD operators run dual-stack peerings (docs/lab.md):
            // IPv6 VIPs over an IPv6 session, with the same graceful restart and BFD.
            conf = conf.bgp(
                &BgpNeighbor::new_v6(
                    &format!("{}_v6", n.name.replace('-', "_")),
                    ROUTER_FABRIC_IP6,
                    ROUTER_ASN,
                    n.ip6,
                    NODE_ASN,
                )
                .graceful_restart(120)
                .bfd(),
            );
        }
        let bird = Bird::start(&ns("router"), &state().join("router"), &conf.render())?;
        ok(&format!(
            "BIRD running (birdc -s {} show protocols)",
            bird.ctl().display()
        ));
        self.bird = Some(bird);
        Ok(())
    }

    /// The `juneau` image the lab installs, from release builds of this checkout
    /// ([`install::build_image`]: what `deploy/image/build.sh` does).
    fn juneau_image(&mut self) -> Result<ImageArchive> {
        step(&format!(
            "The juneau image ({JUNEAU_IMAGE_TAG}): release builds of the four programs (cargo build --release; minutes on a cold machine)"
        ));
        let t0 = Instant::now();
        let image = install::build_image(&state().join("images"), JUNEAU_IMAGE_TAG)?;
        ok(&format!(
            "juneau:{JUNEAU_IMAGE_TAG}, {:.1} MiB, id {} ({:.0?})",
            fs::metadata(&image.path)?.len() as f64 / f64::from(1 << 20),
            image.config_digest,
            t0.elapsed()
        ));
        Ok(image)
    }

    fn start_nodes(&mut self, juneau: &ImageArchive) -> Result<()> {
        step(
            "Nodes: containerd + kubelet in each node's namespace; the kubelets register the Nodes",
        );
        let images = Images::build(&state().join("images"))?;
        ok("images built locally: localhost/juneau-pause:1 (sandbox), nginx:1.27 (Debian's nginx); juneau imported with ctr as users without a registry do");
        let kubelet = binaries_dir()?.join("kubelet");
        if !kubelet.is_file() {
            bail!(
                "{} missing: run tests/setup.sh (tests/k8s/build.sh builds it)",
                kubelet.display()
            );
        }
        for n in NODES {
            let spec = NodeSpec {
                name: n.name.to_string(),
                netns: ns(n.name),
                // The InternalIP the API server connects to: the management address, so
                // nothing of the host is routed into 192.0.2.0/24 (the host's own network
                // may be that documentation range too).
                node_ip: n.mgmt,
                node_ip6: Some(n.mgmt6),
                pod_subnet: n.pods,
                pod_subnet6: Some(n.pods6),
                dir: node_dir(n.name),
                cgroup_root: cgroup_root(n.name),
                kubeconfig: admin_kubeconfig(),
                labels: vec!["juneau.loutres.me/lab=true".into()],
            };
            let mut node = KubeletNode::start_runtime_importing(
                spec,
                &[&images.pause, &images.nginx, &juneau.path],
            )?;
            node.start_kubelet(&kubelet)?;
            ok(&format!(
                "{}: containerd ({}), kubelet (log {})",
                n.name,
                node.containerd_socket().display(),
                node_dir(n.name).join("kubelet.log").display()
            ));
            self.nodes.push(node);
        }
        let kc = admin_kubeconfig();
        for node in &mut self.nodes {
            node.wait_ready(&kc, Duration::from_secs(180))?;
        }
        // The kubelets' InternalIP is the management address; the dataplanes' uplinks
        // are on the fabric: the agents publish this address for redirects between
        // nodes (docs/dataplane.md), and each dataplane takes its own (`--node-address
        // auto`).
        for n in NODES {
            kubectl(&[
                "annotate",
                "--overwrite",
                "node",
                n.name,
                &format!("{REDIRECT_ADDRESS_ANNOTATION}={}", n.ip),
            ])?;
        }
        ok("Nodes annotated with their fabric addresses (juneau.loutres.me/redirect-address)");
        println!("{}", bold("$ kubectl get nodes -o wide"));
        print!("{}", kubectl(&["get", "nodes", "-o", "wide"])?);
        Ok(())
    }

    /// Imports another build of the image (`tag`) into every node's containerd, as an
    /// operator without a registry does before `helm upgrade`.
    pub fn import_juneau_image(&self, tag: &str) -> Result<ImageArchive> {
        let image = install::build_image(&state().join("images"), tag)?;
        for node in &self.nodes {
            crate::images::import(&node.containerd_socket(), &[&image.path])?;
        }
        Ok(image)
    }

    /// Juneau as users install it: `helm install` of deploy/helm/juneau (CRDs, RBAC, the
    /// controller Deployment with 2 replicas, the node DaemonSet with the agent,
    /// dataplane, speaker and BFD containers) with the lab's values file.
    fn install_juneau(&mut self) -> Result<()> {
        step("Juneau from its Helm chart: helm install juneau deploy/helm/juneau -n juneau-system -f values.yaml");
        // The namespace as the README says: created and labelled for privileged Pods
        // (the node DaemonSet), then the release into it.
        kubectl(&[
            "apply",
            "-f",
            &repo_root()
                .join("deploy/namespace.yaml")
                .display()
                .to_string(),
        ])?;
        let values = lab_values();
        fs::write(state().join("juneau-values.yaml"), &values)?;
        for l in values.lines().filter(|l| !l.trim_start().starts_with('#')) {
            info(l);
        }
        let t0 = Instant::now();
        let release = self.release();
        release.install(&[], JUNEAU_ROLLOUT)?;
        ok(&format!(
            "release {} revision {} ({:.0?})",
            install::RELEASE,
            release.revision()?,
            t0.elapsed()
        ));
        create_redirect_key()?;
        println!("{}", bold("$ kubectl -n juneau-system get pods -o wide"));
        print!(
            "{}",
            kubectl(&["-n", install::NAMESPACE, "get", "pods", "-o", "wide"])?
        );
        let leader = wait_for(
            "a controller replica holding the Lease juneau-system/juneau-controller",
            Duration::from_secs(60),
            Duration::from_millis(500),
            controller_leader,
        )?;
        ok(&format!("leader: {leader}"));
        Ok(())
    }

    /// The lab's Helm release of Juneau.
    pub fn release(&self) -> Release {
        Release {
            kubeconfig: admin_kubeconfig(),
            values: state().join("juneau-values.yaml"),
        }
    }

    /// `kill -9` of node's dataplane (a crash); the kubelet restarts its container.
    /// Returns once a new dataplane runs and the node's Pod is Ready again.
    pub fn kill_and_restart_dataplane(&mut self, node: &str) -> Result<()> {
        self.signal_and_wait(node, &["juneau-dataplane"], "KILL")
    }

    /// SIGTERM to node's BGP speaker; the kubelet restarts its container.
    pub fn restart_speaker(&mut self, node: &str) -> Result<()> {
        self.signal_and_wait(node, &["juneau-bgp"], "TERM")
    }

    /// SIGTERM to node's agent; the kubelet restarts its container.
    pub fn restart_agent(&mut self, node: &str) -> Result<()> {
        self.signal_and_wait(node, &["juneau-k8s-sync"], "TERM")
    }

    /// `kill -9` of every Juneau process of the node at once (a node-level crash of
    /// Juneau: agent, dataplane, speaker, BFD); the kubelet restarts them all.
    pub fn kill_node_components(&mut self, node: &str) -> Result<()> {
        self.signal_and_wait(node, &NODE_PROGRAMS, "KILL")
    }

    fn signal_and_wait(&mut self, node: &str, programs: &[&str], sig: &str) -> Result<()> {
        let netns = ns(node);
        let mut old = Vec::new();
        for p in programs {
            let pid = pod_process(p, Some(&netns), None)
                .with_context(|| format!("no {p} runs on {node}"))?;
            old.push((*p, pid));
        }
        for (_, pid) in &old {
            crate::daemon::signal_pid(*pid, sig);
        }
        for (p, pid) in &old {
            wait_for(
                &format!("the kubelet to restart {p} on {node}"),
                JUNEAU_ROLLOUT,
                Duration::from_millis(100),
                || Ok(pod_process(p, Some(&netns), None).filter(|new| new != pid)),
            )?;
        }
        self.wait_node_pod_ready(node)
    }

    /// Waits until node's juneau-node Pod is Ready (every container's readiness probe).
    pub fn wait_node_pod_ready(&self, node: &str) -> Result<()> {
        wait_for(
            &format!("the juneau-node Pod on {node} Ready"),
            JUNEAU_ROLLOUT,
            Duration::from_millis(250),
            || {
                let out = kubectl(&[
                    "-n",
                    install::NAMESPACE,
                    "get",
                    "pods",
                    "-l",
                    "app.kubernetes.io/name=juneau-node",
                    "--field-selector",
                    &format!("spec.nodeName={node}"),
                    "-o",
                    "jsonpath={.items[*].status.containerStatuses[*].ready}",
                ])?;
                let ready: Vec<&str> = out.split_whitespace().collect();
                Ok(
                    (ready.len() == NODE_PROGRAMS.len() && ready.iter().all(|r| *r == "true"))
                        .then_some(()),
                )
            },
        )
    }

    /// `kill -9` of the controller replica holding the Lease; waits (at most `timeout`)
    /// until a replica leads again: the other one once the Lease expired, or — usually
    /// first — the killed one, restarted by the kubelet in the same Pod with the same
    /// identity (the Pod name), which resumes its own Lease. Returns (old, new) leader.
    pub fn kill_controller_leader(&mut self, timeout: Duration) -> Result<(String, String)> {
        let leader = controller_leader()?.context("no controller holds the Lease")?;
        let pid = pod_process("juneau-k8s-sync", None, Some(&format!("POD_NAME={leader}")))
            .with_context(|| format!("no process of the leader {leader}"))?;
        crate::daemon::signal_pid(pid, "KILL");
        let new = wait_for(
            "a controller replica leading again (the other, or the killed one restarted)",
            timeout,
            Duration::from_millis(250),
            || {
                let holder = controller_leader()?;
                let restarted =
                    pod_process("juneau-k8s-sync", None, Some(&format!("POD_NAME={leader}")))
                        .is_some_and(|p| p != pid);
                Ok(holder.filter(|h| *h != leader || restarted))
            },
        )?;
        self.release().wait_rolled_out(JUNEAU_ROLLOUT)?;
        Ok((leader, new))
    }

    /// The pid of each node's dataplane.
    pub fn dataplane_pids(&self) -> BTreeMap<String, u32> {
        NODES
            .iter()
            .filter_map(|n| {
                let pid = pod_process("juneau-dataplane", Some(&ns(n.name)), None)?;
                Some((n.name.to_string(), pid))
            })
            .collect()
    }

    fn guide_manifests(&mut self) -> Result<()> {
        step("The guide's manifests (lab/manifests/), applied with kubectl as a user would");
        let mut files: Vec<PathBuf> = fs::read_dir(repo_root().join("lab/manifests"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        for f in files {
            let name = f
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            println!(
                "{}",
                bold(&format!("$ kubectl apply -f lab/manifests/{name}"))
            );
            for l in kubectl(&["apply", "-f", &f.display().to_string()])?.lines() {
                info(l);
            }
        }
        Ok(())
    }

    /// Waits until `want` nginx Pods are Ready and none is terminating.
    pub fn wait_pods_ready(&mut self, want: usize, timeout: Duration) -> Result<()> {
        step(&format!(
            "Waiting for {want} nginx Pods Ready by their own readiness probes"
        ));
        let t0 = Instant::now();
        wait_for(
            &format!("{want} nginx Pods Ready"),
            timeout,
            Duration::from_secs(1),
            || {
                let pods = nginx_pods()?;
                let ready = pods.iter().filter(|p| p.ready && !p.terminating).count();
                Ok((ready == want && pods.len() == want).then_some(()))
            },
        )
        .with_context(|| {
            format!(
                "Pods now:\n{}",
                kubectl(&["get", "pods", "-o", "wide"]).unwrap_or_default()
            )
        })?;
        ok(&format!("{want} Pods Ready after {:.0?}", t0.elapsed()));
        Ok(())
    }

    /// The control plane.
    pub fn cluster(&mut self) -> Result<&mut KubeCluster> {
        self.cluster
            .as_mut()
            .context("the lab has no control plane")
    }

    /// The router.
    pub fn bird(&self) -> Result<&Bird> {
        self.bird.as_ref().context("the lab has no router")
    }

    /// Leaves everything running (the lab's `up`): writes each process's pid to
    /// `STATE/pids/<name>.pid` for [`down`].
    pub fn detach(mut self) -> Result<()> {
        let mut pids: Vec<(String, u32, String)> = Vec::new();
        if let Some(p) = self.prometheus.take() {
            pids.push(("prometheus".into(), p.detach(), "prometheus".into()));
        }
        for n in std::mem::take(&mut self.nodes) {
            for (name, pid) in n.detach() {
                let expect = name.split(' ').next().unwrap_or_default().to_string();
                pids.push((name.replace(' ', "-"), pid, expect));
            }
        }
        if let Some(b) = self.bird.take() {
            pids.push(("bird-router".into(), b.detach(), "bird".into()));
        }
        if let Some(k) = self.cluster.take() {
            for (name, pid) in k.detach() {
                pids.push((name.clone(), pid, name));
            }
        }
        for n in std::mem::take(&mut self.netns) {
            n.detach();
        }
        let dir = state().join("pids");
        fs::create_dir_all(&dir)?;
        for (name, pid, expect) in pids {
            fs::write(dir.join(format!("{name}.pid")), format!("{pid} {expect}\n"))?;
        }
        self.detached = true;
        Ok(())
    }

    fn teardown(&mut self) {
        self.prometheus = None;
        // Juneau's Pods go with their nodes (kubelet, containerd, cgroups).
        self.nodes.clear();
        self.bird = None;
        self.cluster = None;
        self.netns.clear();
        down_quiet();
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if !self.detached {
            if std::thread::panicking() {
                keep_logs();
            }
            self.teardown();
        }
    }
}

/// What Juneau left on `node` (empty: nothing): XDP programs attached in the node's
/// namespace (`ip -d link`), entries under its pin directory in the bpffs, its files in
/// [`SHM_DIR`], and nft or iptables rules that mention juneau.
pub fn node_leftovers(node: &str) -> Result<Vec<String>> {
    let mut left = Vec::new();
    for l in in_ns(node, &["ip", "-d", "-o", "link", "show"])?.lines() {
        if l.contains("xdp") {
            let iface = l.split(':').nth(1).unwrap_or("?").trim().to_string();
            left.push(format!("{node}: an XDP program attached to {iface}"));
        }
    }
    let dir = pin_dir(node);
    if let Ok(rd) = fs::read_dir(&dir) {
        for e in rd.flatten() {
            left.push(format!("{node}: pinned {}", e.path().display()));
        }
        left.push(format!("{node}: the pin directory {}", dir.display()));
    }
    for f in node_shm_files().into_iter().filter(|f| {
        f.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&format!("{node}.")))
    }) {
        left.push(format!("{node}: the file {}", f.display()));
    }
    for (what, argv) in [
        ("an nft rule", &["nft", "list", "ruleset"][..]),
        ("an iptables rule", &["iptables-save"][..]),
    ] {
        let out = in_ns(node, argv).unwrap_or_default();
        for l in out.lines().filter(|l| l.to_lowercase().contains("juneau")) {
            left.push(format!("{node}: {what}: {}", l.trim()));
        }
    }
    Ok(left)
}

/// The `start took` lines (a dataplane's start: set-up before taking over, the wait for
/// its predecessor, the gap after it) in the logs of `node`'s Juneau dataplane
/// containers still on disk, colour codes removed, oldest first by their timestamp.
pub fn dataplane_start_lines(node: &str) -> Vec<String> {
    let mut lines: Vec<String> = fs::read_dir(node_dir(node).join("pod-logs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|pod| {
            pod.file_name()
                .to_string_lossy()
                .starts_with(&format!("{}_", install::NAMESPACE))
        })
        .flat_map(|pod| {
            fs::read_dir(pod.path().join("dataplane"))
                .into_iter()
                .flatten()
                .flatten()
        })
        .filter_map(|log| fs::read_to_string(log.path()).ok())
        .flat_map(|text| {
            text.lines()
                .filter(|l| l.contains("start took"))
                .map(|l| {
                    let plain = strip_colours(l);
                    // "<cri time> stdout F <time> INFO target: start took ..."
                    plain
                        .split_whitespace()
                        .skip(3)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect::<Vec<_>>()
        })
        .collect();
    lines.sort();
    lines
}

/// `text` without ANSI colour sequences (ESC [ ... m).
fn strip_colours(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Where [`keep_logs`] keeps a run's evidence: `$TMPDIR/juneau-lab-logs-<pid>`.
pub fn kept_logs_dir() -> PathBuf {
    std::env::temp_dir().join(format!("juneau-lab-logs-{}", std::process::id()))
}

/// [`keep_logs`], and what the test saw (its load's report, or its error) beside them as
/// `outcome.txt`: CI shows only part of a failed test's output, the kept logs stay.
pub fn keep_logs_and_outcome(outcome: &str) {
    keep_logs();
    let _ = fs::write(kept_logs_dir().join("outcome.txt"), outcome);
}

/// Copies the lab's logs and the dataplanes' last stats files (their drop counters) to
/// [`kept_logs_dir`] (a failed run's evidence).
pub fn keep_logs() {
    let keep = kept_logs_dir();
    let _ = fs::create_dir_all(&keep);
    let copy = |src: PathBuf, name: String| {
        let _ = fs::copy(src, keep.join(name));
    };
    for e in fs::read_dir(logs()).into_iter().flatten().flatten() {
        copy(e.path(), e.file_name().to_string_lossy().into_owned());
    }
    for n in NODES {
        for f in ["kubelet.log", "containerd.log"] {
            copy(node_dir(n.name).join(f), format!("{}-{f}", n.name));
        }
        // Juneau's containers' logs (podLogsDir/<ns>_<pod>_<uid>/<container>/<n>.log).
        for pod in fs::read_dir(node_dir(n.name).join("pod-logs"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let pod_name = pod.file_name().to_string_lossy().into_owned();
            if !pod_name.starts_with(&format!("{}_", install::NAMESPACE)) {
                continue;
            }
            let short = pod_name.split('_').nth(1).unwrap_or_default().to_string();
            for c in fs::read_dir(pod.path()).into_iter().flatten().flatten() {
                for l in fs::read_dir(c.path()).into_iter().flatten().flatten() {
                    copy(
                        l.path(),
                        format!(
                            "{}-{short}-{}-{}",
                            n.name,
                            c.file_name().to_string_lossy(),
                            l.file_name().to_string_lossy()
                        ),
                    );
                }
            }
        }
    }
    for f in [
        "kube-apiserver.log",
        "kube-controller-manager.log",
        "kube-scheduler.log",
        "etcd.log",
    ] {
        copy(state().join("kube").join(f), f.to_string());
    }
    copy(state().join("router/bird.log"), "bird.log".into());
    for n in NODES {
        let f = format!("{}.dataplane-stats.json", n.name);
        copy(Path::new(SHM_DIR).join(&f), f);
    }
    eprintln!("lab logs kept in {}", keep.display());
}

/// The holder of the controller's Lease.
pub fn controller_leader() -> Result<Option<String>> {
    let out = kubectl_output(&[
        "get",
        "lease",
        "juneau-controller",
        "-n",
        "juneau-system",
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ])?;
    let h = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok((out.status.success() && !h.is_empty()).then_some(h))
}

/// One of Juneau's Pods as the API shows it.
#[derive(Debug, Clone)]
pub struct JuneauPod {
    /// `app.kubernetes.io/name`: `juneau-controller` or `juneau-node`.
    pub app: String,
    /// Node it runs on.
    pub node: String,
    /// Its (first container's) image.
    pub image: String,
    /// Every container Ready.
    pub ready: bool,
}

/// Juneau's Pods in the release namespace.
pub fn juneau_pods() -> Result<Vec<JuneauPod>> {
    let out = kubectl(&[
        "-n",
        install::NAMESPACE,
        "get",
        "pods",
        "-o",
        "jsonpath={range .items[*]}{.metadata.labels.app\\.kubernetes\\.io/name} {.spec.nodeName} {.spec.containers[0].image} {.status.containerStatuses[*].ready}{\"\\n\"}{end}",
    ])?;
    Ok(out
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            JuneauPod {
                app: f.first().unwrap_or(&"").to_string(),
                node: f.get(1).unwrap_or(&"").to_string(),
                image: f.get(2).unwrap_or(&"").to_string(),
                ready: f.len() > 3 && f[3..].iter().all(|r| *r == "true"),
            }
        })
        .collect())
}

/// One nginx Pod as the API shows it.
#[derive(Debug, Clone)]
pub struct PodInfo {
    /// Pod name.
    pub name: String,
    /// Node it runs on (empty while pending).
    pub node: String,
    /// Its Ready condition.
    pub ready: bool,
    /// Being deleted.
    pub terminating: bool,
}

/// The Pods labelled `app=nginx`.
pub fn nginx_pods() -> Result<Vec<PodInfo>> {
    let out = kubectl(&["get", "pods", "-l", "app=nginx", "-o", "json"])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    Ok(v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| PodInfo {
            name: p["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            node: p["spec"]["nodeName"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            ready: p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True"),
            terminating: !p["metadata"]["deletionTimestamp"].is_null(),
        })
        .collect())
}

// ------------------------------------------------------------------------- what the user sees

/// The guide's "what you see": the Service's VIP, `kubectl juneau describe`, the
/// router's two ECMP next hops, curl from the client, and the client's address in
/// `kubectl logs deploy/nginx`.
pub fn show_walk(bins: &JuneauBins) -> Result<()> {
    show_api(bins)?;
    show_data()
}

fn show_api(bins: &JuneauBins) -> Result<()> {
    step("The Service gets its VIP");
    wait_for(
        &format!("EXTERNAL-IP {VIP} on Service nginx"),
        Duration::from_secs(120),
        Duration::from_secs(1),
        || {
            Ok((kubectl(&[
                "get",
                "svc",
                "nginx",
                "-o",
                "jsonpath={.status.loadBalancer.ingress[0].ip}",
            ])?
            .trim()
                == VIP.to_string())
            .then_some(()))
        },
    )?;
    let kc = admin_kubeconfig().display().to_string();
    let env = [("KUBECONFIG", kc.as_str())];
    show(
        "kubectl get svc nginx",
        &["kubectl", "get", "svc", "nginx"],
        &env,
    )?;
    step("Why, and from where: kubectl juneau describe loadbalancer nginx");
    let settled = wait_for(
        "ServiceLoadBalancer nginx Ready with node-a and node-c advertising",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || {
            Ok((kubectl(&[
                "get",
                "serviceloadbalancer",
                "nginx",
                "-o",
                "jsonpath={.status.phase} {.status.backendSummary.localReadyNodes}",
            ])?
            .trim()
                == "Ready 2")
                .then_some(()))
        },
    );
    if let Err(e) = settled {
        info(&format!("(not settled: {e:#}; showing it as it is)"));
    }
    show(
        "kubectl get serviceloadbalancer nginx",
        &["kubectl", "get", "serviceloadbalancer", "nginx"],
        &env,
    )?;
    let path = format!(
        "{}:{}",
        bins.dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    show(
        "kubectl juneau describe loadbalancer nginx",
        &["kubectl", "juneau", "describe", "loadbalancer", "nginx"],
        &[("KUBECONFIG", kc.as_str()), ("PATH", path.as_str())],
    )?;
    println!();
    Ok(())
}

fn show_data() -> Result<()> {
    step("The router learned the /32 from node-a and node-c and spreads it with ECMP");
    let want = vec![NODES[0].ip, NODES[2].ip];
    wait_for(
        &format!("two ECMP next hops for {VIP}/32 on the router"),
        Duration::from_secs(120),
        Duration::from_secs(1),
        || Ok((router_next_hops()? == want).then_some(())),
    )
    .with_context(|| {
        format!(
            "router routes:\n{}\nBIRD:\n{}",
            in_ns("router", &["ip", "route"]).unwrap_or_default(),
            crate::bird::birdc(&bird_ctl(), &["show", "protocols"]).unwrap_or_default()
        )
    })?;
    let netns_router = ns("router");
    show(
        &format!("ip netns exec {netns_router} ip route show {VIP}/32"),
        &[
            "nsenter",
            &format!("--net=/run/netns/{netns_router}"),
            "--",
            "ip",
            "route",
            "show",
            &format!("{VIP}/32"),
        ],
        &[],
    )?;
    let ctl = bird_ctl().display().to_string();
    show(
        &format!("birdc -s {ctl} show route {VIP}/32"),
        &["birdc", "-s", &ctl, "show", "route", &format!("{VIP}/32")],
        &[],
    )?;
    let hops = bgp_nexthops(&bird_ctl(), VIP)?;
    ok(&format!("BGP paths at the router: {hops:?}"));
    step(&format!("The client ({CLIENT_IP}) opens http://{VIP}/"));
    let netns_client = ns("client");
    // The first SYN may race the last ECMP/flow set-up: retry a few times, then fail.
    let mut last = None;
    for _ in 0..5 {
        match show(
            &format!("ip netns exec {netns_client} curl -sS -m 10 -i http://{VIP}/"),
            &[
                "nsenter",
                &format!("--net=/run/netns/{netns_client}"),
                "--",
                "curl",
                "-sS",
                "-m",
                "10",
                "-i",
                &format!("http://{VIP}/"),
            ],
            &[],
        ) {
            Ok(_) => {
                last = None;
                break;
            }
            Err(e) => {
                last = Some(e);
                std::thread::sleep(Duration::from_secs(2));
            }
        }
    }
    if let Some(e) = last {
        return Err(e.context("curl through the VIP from the client"));
    }
    step("nginx saw the client's real address (no SNAT)");
    // `kubectl logs deploy/nginx` shows the log of the Pod kubectl picks; the router's
    // ECMP and the node's backend choice may have sent the request to another one, so
    // the client asks again (at most 30 times) until that Pod has served it.
    let client_line = |log: &str| {
        log.lines()
            .rev()
            .find(|l| l.starts_with(&format!("{CLIENT_IP} ")))
            .map(str::to_string)
    };
    let mut line = client_line(&kubectl(&["logs", "deploy/nginx"])?);
    for _ in 0..30 {
        if line.is_some() {
            break;
        }
        let _ = in_ns(
            "client",
            &[
                "curl",
                "-sS",
                "-m",
                "5",
                "-o",
                "/dev/null",
                &format!("http://{VIP}/"),
            ],
        );
        line = client_line(&kubectl(&["logs", "deploy/nginx"])?);
    }
    let Some(line) = line else {
        bail!("no line from {CLIENT_IP} in `kubectl logs deploy/nginx` after 30 more requests");
    };
    println!(
        "{}",
        bold(&format!(
            "$ kubectl logs deploy/nginx | grep {CLIENT_IP} | tail -n 1"
        ))
    );
    println!("{line}");
    Ok(())
}

/// What `./lab/lab up` prints at the end.
pub fn hint(bins: &JuneauBins) {
    println!(
        "\n{}\n    export KUBECONFIG={}\n    kubectl get svc,serviceloadbalancers,nodes,pods -o wide\n    \
         PATH={}:$PATH kubectl juneau describe loadbalancer nginx\n    \
         ip netns exec jlab-client curl http://{VIP}/\n    kubectl logs deploy/nginx\n    \
         kubectl -n juneau-system get pods -o wide   (Juneau, installed by helm)\n    \
         kubectl -n juneau-system logs ds/juneau-node -c dataplane\n    \
         birdc -s {} show route\n    \
         curl -s 'http://{PROMETHEUS_ADDR}/api/v1/query?query=juneau_bgp_peer_up'   (Prometheus)\nLogs: {}  Tear down: ./lab/lab down",
        bold("The lab is up. Point kubectl at it:"),
        admin_kubeconfig().display(),
        bins.dir.display(),
        bird_ctl().display(),
        logs().display()
    );
}

// ------------------------------------------------------------------------- down

/// Removes everything a lab made, by name: the processes recorded in `STATE/pids`,
/// each node (containerd, kubelet, Pods, their namespaces, mounts and cgroups), the
/// `jlab-*` namespaces, the management bridge and routes, the node state files and the
/// state directory. Idempotent. Prints what it removed.
pub fn down() -> Result<()> {
    step("Tearing the lab down");
    let removed = down_quiet();
    for r in &removed {
        info(r);
    }
    check_nothing_left()?;
    ok("nothing of the lab is left");
    Ok(())
}

fn down_quiet() -> Vec<String> {
    let mut removed = Vec::new();
    // Juneau first (BGP withdraws while the router still runs), the control plane last.
    let order = [
        "prometheus",
        "juneau-controller",
        "agent-",
        "bgp-",
        "dataplane-",
        "kubelet",
        "containerd",
        "bird-router",
        "kube-scheduler",
        "kube-controller-manager",
        "kube-apiserver",
        "etcd",
    ];
    let mut pidfiles: Vec<PathBuf> = fs::read_dir(state().join("pids"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    pidfiles.sort_by_key(|p| {
        let n = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        order
            .iter()
            .position(|o| n.starts_with(o))
            .unwrap_or(order.len())
    });
    for f in pidfiles {
        let text = fs::read_to_string(&f).unwrap_or_default();
        let mut it = text.split_whitespace();
        if let (Some(Ok(pid)), Some(expect)) = (it.next().map(str::parse::<u32>), it.next()) {
            stop_pid(pid, expect, Duration::from_secs(5));
            removed.push(format!(
                "stopped {} (pid {pid})",
                f.file_stem().unwrap_or_default().to_string_lossy()
            ));
        }
    }
    // A lab whose program was killed (a test interrupted) recorded no pids: whatever
    // still runs with the lab's state directory in its arguments (the control plane,
    // BIRD, Prometheus, containerd, kubelets) is its.
    for pid in lab_processes() {
        stop_pid(pid, "/", Duration::from_secs(5));
        removed.push(format!("stopped a leftover lab process (pid {pid})"));
    }
    for n in NODES {
        if node_dir(n.name).exists() || cgroup_present(n.name) {
            node::cleanup(&node_dir(n.name), &cgroup_root(n.name), Some(&ns(n.name)));
            removed.push(format!(
                "removed {}'s containerd, kubelet, Pods and cgroups",
                n.name
            ));
        }
        if run("ip", &["route", "show", &pod_subnet(n)])
            .map(|o| !o.stdout.is_empty())
            .unwrap_or(false)
        {
            let _ = run("ip", &["route", "del", &pod_subnet(n)]);
            removed.push(format!("removed host route {}", pod_subnet(n)));
        }
        if run("ip", &["-6", "route", "show", &pod_subnet6(n)])
            .map(|o| !o.stdout.is_empty())
            .unwrap_or(false)
        {
            let _ = run("ip", &["-6", "route", "del", &pod_subnet6(n)]);
            removed.push(format!("removed host route {}", pod_subnet6(n)));
        }
    }
    removed.extend(remove_pins());
    for name in lab_netns().unwrap_or_default() {
        if let Ok(out) = run("ip", &["netns", "pids", &name]) {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).output();
            }
        }
        let _ = run("ip", &["netns", "del", &name]);
        removed.push(format!("removed netns {name}"));
    }
    if run("ip", &["link", "show", MGMT_BRIDGE]).is_ok() {
        let _ = run("ip", &["link", "del", MGMT_BRIDGE]);
        removed.push(format!("removed bridge {MGMT_BRIDGE}"));
    }
    if state().exists() {
        for f in node_shm_files() {
            let _ = fs::remove_file(&f);
            removed.push(format!("removed {}", f.display()));
        }
        let _ = fs::remove_dir_all(state());
        removed.push(format!("removed {STATE}"));
    }
    removed
}

/// The lab nodes' files in [`SHM_DIR`] (`<node>.state`, `.dataplane`, `.bfd.json`, ...).
fn node_shm_files() -> Vec<PathBuf> {
    let Ok(dir) = fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            NODES
                .iter()
                .any(|n| name.starts_with(&format!("{}.", n.name)))
        })
        .collect()
}

/// Removes what each node's dataplane pinned (unpinning its XDP links detaches the
/// program; the namespaces' interfaces go with them anyway); idempotent.
fn remove_pins() -> Vec<String> {
    let mut removed = Vec::new();
    for n in NODES {
        let dir = pin_dir(n.name);
        if dir.exists() {
            let _ = fs::remove_dir_all(&dir);
            removed.push(format!(
                "removed {}'s dataplane pins {}",
                n.name,
                dir.display()
            ));
        }
    }
    removed
}

fn cgroup_present(node: &str) -> bool {
    Path::new("/sys/fs/cgroup/pids")
        .join(cgroup_root(node).trim_start_matches('/'))
        .exists()
        || Path::new("/sys/fs/cgroup")
            .join(cgroup_root(node).trim_start_matches('/'))
            .exists()
}

/// Fails naming what is left of a lab, if anything.
pub fn check_nothing_left() -> Result<()> {
    let netns = lab_netns()?;
    if !netns.is_empty() {
        bail!("namespaces left: {netns:?}");
    }
    if state().exists() {
        bail!("{STATE} left");
    }
    for n in NODES {
        if pin_dir(n.name).exists() {
            bail!("{} left", pin_dir(n.name).display());
        }
    }
    if run("ip", &["link", "show", MGMT_BRIDGE]).is_ok() {
        bail!("bridge {MGMT_BRIDGE} left");
    }
    let left = lab_processes();
    if !left.is_empty() {
        bail!("processes of the lab still run (pids {left:?}, arguments under {STATE})");
    }
    for n in NODES {
        node::check_gone(&node_dir(n.name), &cgroup_root(n.name))?;
        if let Some(f) = node_shm_files().first() {
            bail!("{} left", f.display());
        }
    }
    Ok(())
}

/// Pids of the processes (not this one) with an argument under [`STATE`].
fn lab_processes() -> Vec<u32> {
    let me = std::process::id();
    processes_with_arg(&format!("{STATE}/"))
        .into_iter()
        .filter(|p| *p != me)
        .collect()
}

/// Pids of the processes with an argument containing `needle`.
fn processes_with_arg(needle: &str) -> Vec<u32> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// The node's dataplane stats file (`--stats-file`, JSON), as last written.
pub fn dataplane_stats(node: &str) -> Result<serde_json::Value> {
    let path = Path::new(SHM_DIR).join(format!("{node}.dataplane-stats.json"));
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The node's dataplane stats as sampled after this call (the file is rewritten about
/// once a second): what the test did so far is counted.
pub fn fresh_dataplane_stats(node: &str) -> Result<serde_json::Value> {
    let path = Path::new(SHM_DIR).join(format!("{node}.dataplane-stats.json"));
    crate::daemon::json_sampled_after_now(&path)
}

/// Packets the node's dataplane redirected to other nodes and received from them (sums
/// over its per-peer counters, `redirect_peers` in the stats file).
pub fn redirected_packets(node: &str) -> Result<(u64, u64)> {
    let s = dataplane_stats(node)?;
    let sum = |k: &str| -> u64 {
        s["redirect_peers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p[k].as_u64())
            .sum()
    };
    Ok((sum("redirected_to"), sum("received_from")))
}

/// The redirect channel's MAC key, as the README tells operators after `helm install`:
/// `kubectl -n juneau-system create secret generic juneau-redirect-key
/// --from-literal=current=<base64 of 16 random bytes>`; the agents publish it and the
/// dataplanes tag and check every redirect frame with it (docs/security.md).
fn create_redirect_key() -> Result<()> {
    use base64::Engine as _;
    let mut key = [0u8; 16];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .context("reading 16 random bytes")?;
    // From a file (a 0600 temporary one), so the key is in no command line or log.
    let mut file = tempfile::NamedTempFile::new().context("a file for the key")?;
    std::io::Write::write_all(
        &mut file,
        base64::engine::general_purpose::STANDARD
            .encode(key)
            .as_bytes(),
    )?;
    step("The redirect channel's key: kubectl -n juneau-system create secret generic juneau-redirect-key --from-file=current=...");
    kubectl(&[
        "-n",
        install::NAMESPACE,
        "create",
        "secret",
        "generic",
        "juneau-redirect-key",
        &format!("--from-file=current={}", file.path().display()),
    ])?;
    Ok(())
}

/// The clients of a [`LabLoad`].
#[derive(Debug, Clone, Copy)]
pub struct LoadShape {
    /// The VIP's `ip:port` they load (either family).
    pub target: std::net::SocketAddr,
    /// The client's address they connect from (`None`: the kernel's choice, [`CLIENT_IP`]
    /// or [`CLIENT_IP6`]).
    pub source: Option<std::net::IpAddr>,
    /// Bulk clients (4 MiB down, 1 MiB up, on a kept-alive connection).
    pub bulk: usize,
    /// Paced keep-alive clients.
    pub keepalive: usize,
    /// Paced new-connection clients.
    pub fresh: usize,
    /// Requests per second per paced client at most.
    pub rate: u32,
    /// Saturating (wrk-like) clients.
    pub saturating: usize,
    /// Stop after this long at the latest.
    pub max_seconds: u64,
}

/// An HTTP load through the VIP from the client's namespace (`juneau-lab load`,
/// [`crate::load`]), running until [`LabLoad::finish`] (or `max_seconds`).
pub struct LabLoad {
    daemon: Daemon,
    stop: PathBuf,
    out: PathBuf,
    /// Diagnostic packet captures, stopped with the load.
    _captures: Vec<Daemon>,
}

/// With `JUNEAU_LAB_CAPTURE=DIR` (a diagnostic, needs tcpdump): the connection
/// openings and closings (SYN, FIN, RST) in the client's, the router's and every node's
/// namespace go to `DIR/NAME-NAMESPACE-PID.pcap` (headers: 128 bytes of each packet) for
/// as long as a [`LabLoad`] runs; `JUNEAU_LAB_CAPTURE_FILTER` replaces that filter (e.g.
/// `ip6 and tcp port 80`: every IPv6 segment). A node's namespace shows what its kernel
/// sees, not what the dataplane forwards (XDP takes it before the capture).
fn start_captures(name: &str) -> Result<Vec<Daemon>> {
    let Some(dir) = std::env::var_os("JUNEAU_LAB_CAPTURE").map(PathBuf::from) else {
        return Ok(Vec::new());
    };
    let filter = std::env::var("JUNEAU_LAB_CAPTURE_FILTER").unwrap_or_else(|_| {
        "tcp port 80 and tcp[tcpflags] & (tcp-syn|tcp-fin|tcp-rst) != 0".to_string()
    });
    fs::create_dir_all(&dir)?;
    let spaces = ["client", "router"]
        .into_iter()
        .chain(NODES.iter().map(|n| n.name));
    spaces
        .map(|space| {
            let file = dir.join(format!("{name}-{space}-{}.pcap", std::process::id()));
            Daemon::spawn(
                DaemonSpec::new(
                    format!("capture {name} {space}"),
                    &[
                        "tcpdump",
                        "-i",
                        "any",
                        "-n",
                        "-U",
                        "-s",
                        "128",
                        "-w",
                        &file.display().to_string(),
                        &filter,
                    ],
                    dir.join(format!("{name}-{space}.log")),
                )
                .in_netns(&ns(space)),
            )
        })
        .collect()
}

impl LabLoad {
    /// Starts the clients `shape` says (and the bulk clients `juneau-lab load` runs by
    /// default); files go to `dir`.
    pub fn start(bins: &JuneauBins, dir: &Path, name: &str, shape: &LoadShape) -> Result<LabLoad> {
        let LoadShape {
            target,
            source,
            bulk,
            keepalive,
            fresh,
            rate,
            saturating,
            max_seconds,
        } = *shape;
        let stop = dir.join(format!("{name}.stop"));
        let out = dir.join(format!("{name}.json"));
        let from = source.map(|ip| ip.to_string());
        let from: Vec<&str> = from
            .iter()
            .flat_map(|ip| ["--source", ip.as_str()])
            .collect();
        let daemon = Daemon::spawn(
            DaemonSpec::new(
                format!("load {name}"),
                &[
                    &bins.path("juneau-lab").display().to_string(),
                    "load",
                    "--target",
                    &target.to_string(),
                    "--bulk",
                    &bulk.to_string(),
                    "--keepalive",
                    &keepalive.to_string(),
                    "--fresh",
                    &fresh.to_string(),
                    "--rate",
                    &rate.to_string(),
                    "--saturating",
                    &saturating.to_string(),
                    "--max-seconds",
                    &max_seconds.to_string(),
                    "--stop-file",
                    &stop.display().to_string(),
                    "--out",
                    &out.display().to_string(),
                ]
                .into_iter()
                .chain(from)
                .collect::<Vec<_>>(),
                dir.join(format!("{name}.log")),
            )
            .in_netns(&ns("client")),
        )?;
        let _captures = start_captures(name)?;
        Ok(LabLoad {
            daemon,
            stop,
            out,
            _captures,
        })
    }

    /// Stops the load and reads its report.
    pub fn finish(mut self) -> Result<crate::load::LoadReport> {
        fs::write(&self.stop, "stop")?;
        wait_for(
            "the load to stop",
            Duration::from_secs(30),
            Duration::from_millis(200),
            || Ok((!self.daemon.is_running()).then_some(())),
        )?;
        let text = fs::read_to_string(&self.out).with_context(|| {
            format!(
                "load report {} (log {})",
                self.out.display(),
                self.daemon.log().display()
            )
        })?;
        crate::load::LoadReport::from_json(&serde_json::from_str(&text)?)
    }
}

/// An nginx Pod of the lab's Deployment pinned to node-b (which has none otherwise): the
/// ECMP group grows to three next hops while it is Ready, and shrinks when it leaves
/// (preStop 5 s, 30 s grace).
pub const POD_ON_NODE_B: &str = r#"apiVersion: v1
kind: Pod
metadata:
  name: nginx-on-node-b
  namespace: default
  labels: {app: nginx}
spec:
  nodeSelector: {kubernetes.io/hostname: node-b}
  terminationGracePeriodSeconds: 30
  containers:
    - name: nginx
      image: nginx:1.27
      imagePullPolicy: Never
      ports: [{containerPort: 80, name: http}]
      readinessProbe:
        httpGet: {path: /healthz, port: http}
        periodSeconds: 2
        failureThreshold: 2
      lifecycle:
        preStop:
          exec: {command: ["/bin/drain", "5"]}
      # nginx's /tmp (uploads, request bodies) in memory, as the Deployment's.
      volumeMounts: [{name: tmp, mountPath: /tmp}]
  volumes: [{name: tmp, emptyDir: {medium: Memory, sizeLimit: 256Mi}}]
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_codes_are_stripped_from_a_log_line() {
        let line = "2026-12-06T09:41:25Z stdout F \u{1b}[2m2026-12-06T09:41:25Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m start took \u{1b}[3mprepared_ms\u{1b}[0m\u{1b}[2m=\u{1b}[0m1547";
        assert_eq!(
            strip_colours(line),
            "2026-12-06T09:41:25Z stdout F 2026-12-06T09:41:25Z  INFO start took prepared_ms=1547"
        );
    }
}
