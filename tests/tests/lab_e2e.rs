//! The lab as the end-to-end test: `./lab/lab up` walks the user guide against a real
//! kube-apiserver, BIRD 2, nginx and Juneau's own binaries; this test then checks, from
//! the outside, what the guide promises — and that a node whose last Pod goes away
//! withdraws its route while the VIP keeps answering, that a new Pod behind a node's
//! bridge serves without any restart (every node's `juneau-dataplane` keeps its pid from
//! `up` to the end) — and that `down` leaves nothing.
//!
//! Needs root, `tests/k8s/build.sh` (run by the lab itself) and Debian's bird2 and
//! nginx-light (tests/setup/apt-packages.txt). It brings up the one lab of the machine
//! (netns jlab-*, /run/juneau-lab), so it fails if a lab is already up.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const VIP: &str = "203.0.113.10";
const CLIENT: &str = "198.51.100.42";
const STATE: &str = "/run/juneau-lab";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn lab(arg: &str) -> Result<String> {
    let out = Command::new(repo().join("lab/lab"))
        .arg(arg)
        .output()
        .with_context(|| format!("running lab/lab {arg}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("`lab/lab {arg}` failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

fn sh(argv: &[&str]) -> Result<String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .with_context(|| format!("running {argv:?}"))?;
    if !out.status.success() {
        bail!(
            "{argv:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn kubectl(args: &[&str]) -> Result<String> {
    let kubeconfig = format!("{STATE}/kube/admin.kubeconfig");
    let mut argv = vec!["kubectl", "--kubeconfig", kubeconfig.as_str()];
    argv.extend_from_slice(args);
    sh(&argv)
}

fn eventually(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        match check() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = format!("{e:#}"),
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    bail!("{what}: not within {timeout:?} (last error: {last})")
}

/// Next hops of the router's route to the VIP.
fn router_next_hops() -> Result<Vec<String>> {
    let out = sh(&[
        "ip",
        "netns",
        "exec",
        "jlab-router",
        "ip",
        "route",
        "show",
        &format!("{VIP}/32"),
    ])?;
    Ok(out
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "via")
        .map(|w| w[1].to_string())
        .collect())
}

fn curl_vip() -> Result<String> {
    sh(&[
        "ip",
        "netns",
        "exec",
        "jlab-client",
        "curl",
        "-sS",
        "-m",
        "10",
        &format!("http://{VIP}/"),
    ])
}

fn access_log_lines_from_client() -> Result<usize> {
    let mut n = 0;
    for pod in std::fs::read_dir(format!("{STATE}/pods"))? {
        let log = pod?.path().join("access.log");
        if let Ok(text) = std::fs::read_to_string(&log) {
            n += text
                .lines()
                .filter(|l| l.starts_with(&format!("{CLIENT} ")))
                .count();
        }
    }
    Ok(n)
}

/// The pid of each node's `juneau-dataplane`, as the lab recorded it, checked to be a
/// live `juneau-dataplane` serving the node's bridge `cni0` (node-b too, which has no
/// Pods).
fn dataplane_pids() -> Result<BTreeMap<String, u32>> {
    let mut pids = BTreeMap::new();
    for node in ["node-a", "node-b", "node-c"] {
        let file = format!("{STATE}/pids/dataplane-{node}.pid");
        let pid: u32 = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {file}: the lab runs no dataplane on {node}"))?
            .trim()
            .parse()
            .with_context(|| format!("{file} holds no pid"))?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .with_context(|| format!("dataplane of {node} (pid {pid}) is not running"))?;
        // "pid (comm) S ...": the state follows the last ')'.
        let state = stat.rsplit(')').next().unwrap_or_default().trim_start();
        if state.starts_with('Z') {
            bail!("dataplane of {node} (pid {pid}) has exited (zombie)");
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))?;
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !argv.iter().any(|a| a.ends_with("juneau-dataplane"))
            || !argv
                .windows(2)
                .any(|w| w[0] == "--pod-iface" && w[1] == "cni0")
        {
            bail!("pid {pid} of {file} is not `juneau-dataplane --pod-iface cni0`: {argv:?}");
        }
        pids.insert(node.to_string(), pid);
    }
    Ok(pids)
}

/// `curl -i` through the VIP until a response says it was served on `node`
/// (nginx's `X-Served-By: <pod> on <node>` header); the router's ECMP hash on ports
/// spreads successive connections over the nodes.
fn curl_until_served_on(node: &str, attempts: usize) -> Result<()> {
    let want = format!(" on {node}");
    let mut seen = Vec::new();
    for _ in 0..attempts {
        let resp = sh(&[
            "ip",
            "netns",
            "exec",
            "jlab-client",
            "curl",
            "-sS",
            "-m",
            "10",
            "-i",
            &format!("http://{VIP}/"),
        ])?;
        let served = resp
            .lines()
            .find_map(|l| l.strip_prefix("X-Served-By: "))
            .unwrap_or("?")
            .trim()
            .to_string();
        if served.ends_with(&want) && resp.contains("Welcome to nginx") {
            return Ok(());
        }
        seen.push(served);
    }
    bail!("{attempts} curls through {VIP}, none served on {node}: {seen:?}")
}

/// Runs `lab down` when the test ends, passed or not.
struct Down;
impl Drop for Down {
    fn drop(&mut self) {
        if let Err(e) = lab("down") {
            eprintln!("lab down failed: {e:#}");
        }
    }
}

#[test]
fn lab_walks_the_guide_and_withdraws_a_node_without_backends() -> Result<()> {
    if Path::new(STATE).exists() {
        bail!("{STATE} exists: a lab is already up on this machine; run `./lab/lab down` first");
    }
    let _down = Down;
    let up = lab("up")?;
    println!("{up}");

    // The guide's promises, checked from the outside.
    let ip = kubectl(&[
        "get",
        "svc",
        "nginx",
        "-o",
        "jsonpath={.status.loadBalancer.ingress[0].ip}",
    ])?;
    assert_eq!(ip.trim(), VIP, "Service nginx's ingress IP");
    let slb = kubectl(&[
        "get",
        "serviceloadbalancer",
        "nginx",
        "-o",
        "jsonpath={.status.phase} {.status.addressPool} {.status.advertisingNodes} {.status.backendSummary.totalReady} {.status.backendSummary.localReadyNodes}",
    ])?;
    assert_eq!(
        slb.trim(),
        r#"Ready public-v4 ["node-a","node-c"] 3 2"#,
        "ServiceLoadBalancer status"
    );
    let describe = up
        .split("$ kubectl juneau describe loadbalancer nginx\n")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .unwrap_or_default();
    assert!(
        describe
            .starts_with("ServiceLoadBalancer  default/nginx  (vip: 203.0.113.10, phase: Ready)")
            && describe.contains("├── AdvertisingNodes  (2)\n│   ├── node-a\n│   └── node-c\n")
            && describe.contains("└── Backends  totalReady=3  localReadyNodes=2"),
        "`kubectl juneau describe loadbalancer nginx` as the lab showed it:\n{describe}"
    );
    assert!(
        up.contains("\nnginx   LoadBalancer") && up.contains("203.0.113.10   80:"),
        "the lab did not show `kubectl get svc nginx` with the VIP"
    );
    assert!(
        up.contains(&format!("\n{CLIENT} - - [")),
        "the lab did not show nginx's access-log line from {CLIENT}"
    );
    let mut hops = router_next_hops()?;
    hops.sort();
    assert_eq!(
        hops,
        vec!["192.0.2.11", "192.0.2.13"],
        "router's ECMP next hops for {VIP}"
    );
    let before = access_log_lines_from_client()?;
    let page = curl_vip()?;
    assert!(
        page.contains("Welcome to nginx"),
        "curl http://{VIP}/ answered: {page}"
    );
    assert!(
        access_log_lines_from_client()? > before,
        "nginx did not log the client's real IP {CLIENT}"
    );

    // Every node runs its dataplane on its bridge from `up` on, node-b (no Pods) too.
    let dataplanes = dataplane_pids()?;

    // node-c loses its last Pod (the ReplicaSet removes the cheapest Pod first): node-c
    // withdraws, the route keeps node-a only, and the VIP still answers.
    let pods = kubectl(&[
        "get",
        "pods",
        "-l",
        "app=nginx",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName}{\"\\n\"}{end}",
    ])?;
    let on_c: Vec<&str> = pods
        .lines()
        .filter(|l| l.ends_with(" node-c"))
        .filter_map(|l| l.split(' ').next())
        .collect();
    assert_eq!(on_c.len(), 1, "exactly one Pod on node-c: {pods}");
    kubectl(&[
        "annotate",
        "pod",
        on_c[0],
        "controller.kubernetes.io/pod-deletion-cost=-1000",
    ])?;
    kubectl(&["scale", "deployment", "nginx", "--replicas=2"])?;
    eventually("node-c's Pod terminating", Duration::from_secs(60), || {
        Ok(kubectl(&[
            "get",
            "pod",
            on_c[0],
            "-o",
            "jsonpath={.metadata.deletionTimestamp}",
        ])
        .map(|t| !t.trim().is_empty())
        .unwrap_or(true))
    })?;
    lab("kubelet")?;
    eventually(
        "router's route with node-a as the only next hop",
        Duration::from_secs(90),
        || Ok(router_next_hops()? == vec!["192.0.2.11".to_string()]),
    )?;
    eventually(
        "advertisingNodes = [node-a]",
        Duration::from_secs(60),
        || {
            Ok(kubectl(&[
                "get",
                "serviceloadbalancer",
                "nginx",
                "-o",
                "jsonpath={.status.advertisingNodes}",
            ])?
            .trim()
                == r#"["node-a"]"#)
        },
    )?;
    let page = curl_vip()?;
    assert!(
        page.contains("Welcome to nginx"),
        "after node-c withdrew, curl answered: {page}"
    );
    assert_eq!(
        dataplane_pids()?,
        dataplanes,
        "a dataplane was restarted when node-c lost its Pod (pids before: {dataplanes:?})"
    );

    // Scaling back up puts a new Pod on node-c (the lab's placement): a new port of
    // node-c's bridge, served by the dataplane that has been running since `up`.
    kubectl(&["scale", "deployment", "nginx", "--replicas=3"])?;
    eventually("the ReplicaSet's new Pod", Duration::from_secs(60), || {
        Ok(kubectl(&["get", "pods", "-l", "app=nginx", "-o", "name"])?
            .lines()
            .count()
            == 3)
    })?;
    let kubelet = lab("kubelet")?;
    assert!(
        kubelet.contains("on node-c: netns"),
        "`lab kubelet` did not start the new Pod on node-c:\n{kubelet}"
    );
    eventually(
        "router's route back to two ECMP next hops",
        Duration::from_secs(90),
        || {
            let mut hops = router_next_hops()?;
            hops.sort();
            Ok(hops == vec!["192.0.2.11", "192.0.2.13"])
        },
    )?;
    curl_until_served_on("node-c", 40)?;
    assert_eq!(
        dataplane_pids()?,
        dataplanes,
        "a dataplane was restarted when a Pod was added on node-c (pids before: {dataplanes:?})"
    );

    // down leaves nothing; a second down is harmless.
    drop(_down);
    lab("down")?;
    let netns = sh(&["ip", "netns", "list"])?;
    assert!(
        !netns.lines().any(|l| l.starts_with("jlab-")),
        "lab namespaces left: {netns}"
    );
    assert!(!Path::new(STATE).exists(), "{STATE} left behind");
    assert!(
        sh(&["ip", "link", "show", "jlab-mgmt"]).is_err(),
        "bridge jlab-mgmt left behind"
    );
    Ok(())
}
