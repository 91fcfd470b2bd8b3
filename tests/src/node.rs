//! A real Kubernetes node in a network namespace: its own containerd (Debian's, with
//! runc and the bridge + host-local CNI plugins on the node's `cni0`) and a real kubelet
//! (built by `tests/k8s/build.sh`), which registers the Node itself.
//!
//! What it takes on these machines (FACTS.md, "A real kubelet runs here"): both are
//! started with `nsenter --net` ([`crate::daemon`]); one containerd per node with its own
//! root, state, socket, runc root and CNI directories, and `restrict_oom_score_adj`
//! (there is no CAP_SYS_RESOURCE); the kubelet with the cgroupfs driver, a cgroup root
//! per node, `failSwapOn: false`, its own root directory; images imported with
//! `ctr -n k8s.io images import` ([`crate::images`]), Pods use `imagePullPolicy: Never`.
//!
//! Everything a node makes lives under its directory, its cgroup root and its network
//! namespace; [`cleanup`] removes all of it by those names — what dropping a
//! [`KubeletNode`] does, also on panic, and what the lab's `down` does for nodes an
//! earlier process left running.

use std::collections::BTreeSet;
use std::fs;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::daemon::{alive, signal_pid, tail, wait_for, Daemon, DaemonSpec};
use crate::images::{self, Images, PAUSE_IMAGE};

/// Where a node lives and how it is addressed.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// Node name (`--hostname-override`), e.g. `node-a`.
    pub name: String,
    /// The node's network namespace (must exist, with its uplink configured).
    pub netns: String,
    /// The node's address (`--node-ip`: the Node's InternalIP; the kubelet serves on it).
    pub node_ip: Ipv4Addr,
    /// The node's IPv6 address on a dual-stack node (`--node-ip=IPv4,IPv6`: the Node's
    /// second InternalIP); `None`: an IPv4-only node.
    pub node_ip6: Option<Ipv6Addr>,
    /// The Pod subnet on `cni0`: `a.b.c.0/24`, gateway `.1`, Pods from `.10`.
    pub pod_subnet: Ipv4Addr,
    /// The IPv6 Pod subnet on `cni0` of a dual-stack node: a /64, gateway `::1`, Pods from
    /// `::10` (each Pod gets an address of both families); `None`: IPv4-only Pods.
    pub pod_subnet6: Option<Ipv6Addr>,
    /// The node's directory (containerd and kubelet state, logs, configs).
    pub dir: PathBuf,
    /// The kubelet's cgroup root (one per node, e.g. `/jlab-node-a`).
    pub cgroup_root: String,
    /// Kubeconfig the kubelet uses to reach the API server.
    pub kubeconfig: PathBuf,
    /// Labels the kubelet registers the Node with (`k=v`).
    pub labels: Vec<String>,
}

impl NodeSpec {
    fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }
    fn gateway(&self) -> Ipv4Addr {
        let o = self.pod_subnet.octets();
        Ipv4Addr::new(o[0], o[1], o[2], 1)
    }
}

/// A running node (containerd + kubelet), cleaned up on drop.
#[derive(Debug)]
pub struct KubeletNode {
    spec: NodeSpec,
    // Field order is drop order: the kubelet before containerd.
    kubelet: Option<Daemon>,
    containerd: Option<Daemon>,
    detached: bool,
}

/// The cgroup v1 controllers (or the v2 root) under `/sys/fs/cgroup`.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return vec![base.to_path_buf()];
    }
    let mut v: Vec<PathBuf> = fs::read_dir(base)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn make_cgroup_root(root: &str) -> Result<()> {
    let rel = root.trim_start_matches('/');
    for h in cgroup_hierarchies() {
        let d = h.join(rel);
        fs::create_dir_all(&d).with_context(|| format!("creating cgroup {}", d.display()))?;
        // A new cpuset cgroup starts with no CPUs and no memory nodes: inherit them.
        if h.ends_with("cpuset") {
            for f in ["cpuset.cpus", "cpuset.mems"] {
                let v = fs::read_to_string(h.join(f)).unwrap_or_default();
                let _ = fs::write(d.join(f), v.trim());
            }
        }
    }
    Ok(())
}

fn containerd_config(s: &NodeSpec) -> String {
    let d = s.dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
oom_score = 0

[grpc]
  address = "{d}/containerd.sock"

[ttrpc]
  address = "{d}/containerd.ttrpc.sock"

[debug]
  address = ""

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{d}/containerd/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{PAUSE_IMAGE}"
    restrict_oom_score_adj = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "{d}/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "{d}/cni/net.d"
"#
    )
}

fn cni_config(s: &NodeSpec) -> String {
    let o = s.pod_subnet.octets();
    let mut ranges = vec![serde_json::json!([{
        "subnet": format!("{}.{}.{}.0/24", o[0], o[1], o[2]),
        "rangeStart": format!("{}.{}.{}.10", o[0], o[1], o[2]),
        "gateway": s.gateway().to_string(),
    }])];
    let mut routes = vec![serde_json::json!({ "dst": "0.0.0.0/0" })];
    if let Some(p6) = s.pod_subnet6 {
        let host = |h: u16| {
            let mut seg = p6.segments();
            seg[7] = h;
            Ipv6Addr::from(seg).to_string()
        };
        ranges.push(serde_json::json!([{
            "subnet": format!("{p6}/64"),
            "rangeStart": host(0x10),
            "gateway": host(1),
        }]));
        routes.push(serde_json::json!({ "dst": "::/0" }));
    }
    serde_json::json!({
        "cniVersion": "0.4.0",
        "name": "juneau-pods",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": ranges,
                "routes": routes,
                "dataDir": format!("{}/cni/ipam", s.dir.display()),
            },
        }],
    })
    .to_string()
}

fn kubelet_config(s: &NodeSpec) -> String {
    let d = s.dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
# The API server reaches the kubelet (logs) without a client certificate: a lab.
authentication:
  anonymous: {{enabled: true}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
cgroupDriver: cgroupfs
cgroupRoot: {root}
cgroupsPerQOS: true
failSwapOn: false
containerRuntimeEndpoint: unix://{d}/containerd.sock
podLogsDir: {d}/pod-logs
registerNode: true
makeIPTablesUtilChains: false
maxPods: 30
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 60s
shutdownGracePeriod: 0s
"#,
        ip = s.node_ip,
        root = s.cgroup_root,
    )
}

impl KubeletNode {
    /// Starts containerd, imports the images, starts the kubelet (which registers the
    /// Node), and returns once containerd answers and the kubelet runs. Use
    /// [`wait_ready`](Self::wait_ready) with kubectl for the Node's Ready condition.
    pub fn start(spec: NodeSpec, images: &Images, kubelet_bin: &Path) -> Result<KubeletNode> {
        let mut node = Self::start_runtime(spec, images)?;
        node.start_kubelet(kubelet_bin)?;
        Ok(node)
    }

    /// Only containerd, with the images imported (no kubelet yet).
    pub fn start_runtime(spec: NodeSpec, images: &Images) -> Result<KubeletNode> {
        Self::start_runtime_importing(spec, &images.archives())
    }

    /// Only containerd, with these docker archives imported (no kubelet yet; a kubelet
    /// needs [`Images`]' pause image too).
    pub fn start_runtime_importing(spec: NodeSpec, archives: &[&Path]) -> Result<KubeletNode> {
        // Whatever an earlier run with these names left.
        cleanup(&spec.dir, &spec.cgroup_root, Some(&spec.netns));
        for d in [
            "containerd",
            "cni/net.d",
            "cni/ipam",
            "kubelet",
            "pod-logs",
            "runc",
        ] {
            fs::create_dir_all(spec.dir.join(d))?;
        }
        make_cgroup_root(&spec.cgroup_root)?;
        fs::write(spec.dir.join("containerd.toml"), containerd_config(&spec))?;
        fs::write(
            spec.dir.join("cni/net.d/10-juneau-pods.conflist"),
            cni_config(&spec),
        )?;
        fs::write(spec.dir.join("kubelet.yaml"), kubelet_config(&spec))?;
        let mut node = KubeletNode {
            spec,
            kubelet: None,
            containerd: None,
            detached: false,
        };
        let s = node.spec.clone();
        let conf = s.dir.join("containerd.toml").display().to_string();
        node.containerd = Some(Daemon::spawn(
            DaemonSpec::new(
                format!("containerd {}", s.name),
                &["containerd", "--config", &conf],
                s.dir.join("containerd.log"),
            )
            .in_netns(&s.netns),
        )?);
        let sock = s.containerd_socket();
        wait_for(
            &format!("containerd of {} to answer", s.name),
            Duration::from_secs(60),
            Duration::from_millis(100),
            || {
                if let Some(c) = node.containerd.as_mut() {
                    c.check_running()?;
                }
                let out = Command::new("ctr")
                    .arg("-a")
                    .arg(&sock)
                    .arg("version")
                    .output()?;
                Ok(out.status.success().then_some(()))
            },
        )?;
        images::import(&sock, archives)?;
        Ok(node)
    }

    /// Starts the kubelet (after [`start_runtime`](Self::start_runtime)).
    pub fn start_kubelet(&mut self, kubelet_bin: &Path) -> Result<()> {
        let s = &self.spec;
        let mut argv: Vec<String> = vec![
            kubelet_bin.display().to_string(),
            format!("--config={}", s.dir.join("kubelet.yaml").display()),
            format!("--kubeconfig={}", s.kubeconfig.display()),
            format!("--hostname-override={}", s.name),
            match s.node_ip6 {
                Some(ip6) => format!("--node-ip={},{ip6}", s.node_ip),
                None => format!("--node-ip={}", s.node_ip),
            },
            format!("--root-dir={}", s.dir.join("kubelet").display()),
            "--v=1".into(),
        ];
        if !s.labels.is_empty() {
            argv.push(format!("--node-labels={}", s.labels.join(",")));
        }
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut kubelet = Daemon::spawn(
            DaemonSpec::new(
                format!("kubelet {}", s.name),
                &argv,
                s.dir.join("kubelet.log"),
            )
            .in_netns(&s.netns),
        )?;
        std::thread::sleep(Duration::from_millis(500));
        kubelet.check_running()?;
        self.kubelet = Some(kubelet);
        Ok(())
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The node's spec.
    pub fn spec(&self) -> &NodeSpec {
        &self.spec
    }

    /// The containerd socket (for `ctr -a`).
    pub fn containerd_socket(&self) -> PathBuf {
        self.spec.containerd_socket()
    }

    /// Waits until the Node reports Ready (through `kubectl` with `kubeconfig`).
    pub fn wait_ready(&mut self, kubeconfig: &Path, timeout: Duration) -> Result<()> {
        let name = self.spec.name.clone();
        let log = self.spec.dir.join("kubelet.log");
        wait_for(
            &format!("Node {name} Ready"),
            timeout,
            Duration::from_millis(500),
            || {
                if let Some(k) = self.kubelet.as_mut() {
                    k.check_running()?;
                }
                let out = Command::new("kubectl")
                    .arg("--kubeconfig")
                    .arg(kubeconfig)
                    .args([
                        "get",
                        "node",
                        &name,
                        "-o",
                        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                    ])
                    .output()?;
                Ok((String::from_utf8_lossy(&out.stdout).trim() == "True").then_some(()))
            },
        )
        .with_context(|| format!("kubelet log of {name}:\n{}", tail(&log, 40)))
    }

    /// The pids of containerd and the kubelet.
    pub fn pids(&self) -> Vec<(String, u32)> {
        [&self.containerd, &self.kubelet]
            .into_iter()
            .flatten()
            .map(|d| (d.name().to_string(), d.pid()))
            .collect()
    }

    /// Leaves containerd, the kubelet and the Pods running; returns the pids.
    pub fn detach(mut self) -> Vec<(String, u32)> {
        let pids = self.pids();
        self.detached = true;
        if let Some(k) = self.kubelet.take() {
            k.detach();
        }
        if let Some(c) = self.containerd.take() {
            c.detach();
        }
        pids
    }
}

impl Drop for KubeletNode {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        if let Some(mut k) = self.kubelet.take() {
            k.stop_within(Duration::from_secs(3));
        }
        if let Some(mut c) = self.containerd.take() {
            c.stop_within(Duration::from_secs(3));
        }
        cleanup(
            &self.spec.dir,
            &self.spec.cgroup_root,
            Some(&self.spec.netns),
        );
    }
}

/// Every pid in the cgroup tree `root` (all hierarchies).
fn cgroup_pids(root: &str) -> BTreeSet<u32> {
    fn walk(d: &Path, out: &mut BTreeSet<u32>) {
        if let Ok(t) = fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(t.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
        if let Ok(rd) = fs::read_dir(d) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    walk(&e.path(), out);
                }
            }
        }
    }
    let mut out = BTreeSet::new();
    for h in cgroup_hierarchies() {
        walk(&h.join(root.trim_start_matches('/')), &mut out);
    }
    out
}

/// Removes the cgroup tree `root` in every hierarchy, deepest first.
fn remove_cgroups(root: &str) {
    fn rmdir_tree(d: &Path) {
        if let Ok(rd) = fs::read_dir(d) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    rmdir_tree(&e.path());
                }
            }
        }
        let _ = fs::remove_dir(d);
    }
    for h in cgroup_hierarchies() {
        rmdir_tree(&h.join(root.trim_start_matches('/')));
    }
}

/// The `/run/netns` names whose namespace is that of one of `pids`, or that a
/// container bundle under `dir` names (Pod sandboxes' `cni-*` namespaces).
fn pod_netns(dir: &Path, pids: &BTreeSet<u32>) -> BTreeSet<String> {
    let mut inodes = BTreeSet::new();
    for p in pids {
        if let Ok(m) = fs::metadata(format!("/proc/{p}/ns/net")) {
            inodes.insert(m.ino());
        }
    }
    let mut paths = BTreeSet::new();
    // Sandboxes' OCI specs name their namespace path (they survive a crashed containerd).
    let tasks = dir.join("containerd/state/io.containerd.runtime.v2.task");
    if let Ok(nss) = fs::read_dir(&tasks) {
        for ns in nss.flatten() {
            for c in fs::read_dir(ns.path()).into_iter().flatten().flatten() {
                let spec = fs::read(c.path().join("config.json")).unwrap_or_default();
                let v: serde_json::Value = serde_json::from_slice(&spec).unwrap_or_default();
                for n in v["linux"]["namespaces"].as_array().into_iter().flatten() {
                    if n["type"] == "network" {
                        if let Some(p) = n["path"].as_str() {
                            paths.insert(
                                Path::new(p)
                                    .file_name()
                                    .map(|f| f.to_string_lossy().into_owned())
                                    .unwrap_or_default(),
                            );
                        }
                    }
                }
            }
        }
    }
    let mut names = BTreeSet::new();
    for e in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("cni-") {
            continue;
        }
        let ino = fs::metadata(e.path()).map(|m| m.ino()).unwrap_or(0);
        if paths.contains(&name) || inodes.contains(&ino) {
            names.insert(name);
        }
    }
    names
}

/// Mount points at or under `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.display().to_string();
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| m.replace("\\040", " "))
        .filter(|m| m == &prefix || m.starts_with(&format!("{prefix}/")))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.len()));
    v.dedup();
    v
}

/// Removes everything a node with this directory, cgroup root and namespace made:
/// kills every process in its cgroup tree and (if given) in its namespace — containerd,
/// the kubelet, shims, Pods — deletes the Pods' namespaces, unmounts what is mounted
/// under `dir`, removes the cgroups and the directory. Idempotent; errors are ignored
/// (it is what runs on drop and in `down`).
pub fn cleanup(dir: &Path, cgroup_root: &str, netns: Option<&str>) {
    for _ in 0..5 {
        let mut pids = cgroup_pids(cgroup_root);
        if let Some(ns) = netns {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                pids.extend(
                    String::from_utf8_lossy(&out.stdout)
                        .split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
        let pod_ns = pod_netns(dir, &pids);
        for p in &pids {
            signal_pid(*p, "KILL");
        }
        for n in &pod_ns {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        let mut waited = 0;
        while pids.iter().any(|p| alive(*p)) && waited < 50 {
            std::thread::sleep(Duration::from_millis(20));
            waited += 1;
        }
        if pids.is_empty() && pod_ns.is_empty() {
            break;
        }
    }
    for m in mounts_under(dir) {
        let _ = Command::new("umount").args(["-l", &m]).output();
    }
    remove_cgroups(cgroup_root);
    if dir.exists() && mounts_under(dir).is_empty() {
        let _ = fs::remove_dir_all(dir);
    }
    // The kubelet links each container's log into the fixed /var/log/containers.
    let prefix = dir.display().to_string();
    for e in fs::read_dir("/var/log/containers")
        .into_iter()
        .flatten()
        .flatten()
    {
        if fs::read_link(e.path()).is_ok_and(|t| t.starts_with(&prefix)) {
            let _ = fs::remove_file(e.path());
        }
    }
    let _ = fs::remove_dir("/var/log/containers");
    // containerd 1.6 keeps shim sockets (and ctr its FIFOs) in fixed directories. A shim
    // killed with SIGKILL leaves its socket: remove the sockets nobody listens on any
    // more (a live shim's, e.g. another node's, still accepts), then the directories
    // when empty.
    for e in fs::read_dir("/run/containerd/s")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Err(err) = std::os::unix::net::UnixStream::connect(e.path()) {
            if err.kind() == std::io::ErrorKind::ConnectionRefused {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    for d in [
        "/run/containerd/s",
        "/run/containerd/fifo",
        "/run/containerd",
    ] {
        let _ = fs::remove_dir(d);
    }
}

/// Fails when something of a node is left: a process in its cgroup tree, a mount under
/// its directory, the directory or a cgroup.
pub fn check_gone(dir: &Path, cgroup_root: &str) -> Result<()> {
    let pids = cgroup_pids(cgroup_root);
    if !pids.is_empty() {
        bail!("processes left in cgroup {cgroup_root}: {pids:?}");
    }
    let m = mounts_under(dir);
    if !m.is_empty() {
        bail!("mounts left under {}: {m:?}", dir.display());
    }
    if dir.exists() {
        bail!("{} left behind", dir.display());
    }
    for h in cgroup_hierarchies() {
        let d = h.join(cgroup_root.trim_start_matches('/'));
        if d.exists() {
            bail!("cgroup {} left behind", d.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netns::{unique_prefix, Netns};

    /// containerd in a namespace imports both images, runs nginx from its image (its
    /// config test passes inside the container), and nothing is left after cleanup.
    #[test]
    fn containerd_runs_the_local_images_and_leaves_nothing() -> Result<()> {
        let p = unique_prefix("nod");
        let netns = Netns::new(format!("{p}n"))?;
        let tmp = tempfile::tempdir()?;
        let images = Images::build(&tmp.path().join("images"))?;
        let dir = tmp.path().join("node");
        let cgroup_root = format!("/{p}");
        let spec = NodeSpec {
            name: format!("{p}-node"),
            netns: netns.name().to_string(),
            node_ip: Ipv4Addr::new(10, 252, 0, 2),
            node_ip6: None,
            pod_subnet: Ipv4Addr::new(10, 252, 1, 0),
            pod_subnet6: None,
            dir: dir.clone(),
            cgroup_root: cgroup_root.clone(),
            kubeconfig: tmp.path().join("none"),
            labels: vec![],
        };
        let node = KubeletNode::start_runtime(spec, &images)?;
        make_cgroup_root(&cgroup_root)?;
        let sock = node.containerd_socket();
        let ctr = |args: &[&str]| -> Result<String> {
            let out = Command::new("ctr")
                .arg("-a")
                .arg(&sock)
                .args(["-n", "k8s.io"])
                .args(args)
                .output()?;
            if !out.status.success() {
                bail!("ctr {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            }
            Ok(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        };
        let list = ctr(&["images", "ls", "-q"])?;
        assert!(list.contains("docker.io/library/nginx:1.27"), "{list}");
        assert!(list.contains(PAUSE_IMAGE), "{list}");
        let runc_root = dir.join("runc-ctr").display().to_string();
        let test = ctr(&[
            "run",
            "--rm",
            "--runc-root",
            &runc_root,
            "--cgroup",
            &format!("{cgroup_root}/t"),
            "docker.io/library/nginx:1.27",
            &format!("{p}-t"),
            "/usr/sbin/nginx",
            "-t",
            "-c",
            "/etc/nginx/nginx.conf",
        ])?;
        assert!(test.contains("test is successful"), "{test}");
        drop(node);
        check_gone(&dir, &cgroup_root)?;
        Ok(())
    }
}
