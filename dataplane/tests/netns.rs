//! `juneau-dataplane` across real network namespaces.
//!
//! Topology built per test (unique namespace names, removed on drop even on panic):
//!
//! ```text
//! client ns                node ns (juneau-dataplane)                 Pod namespaces
//! eth0 10.100.1.2/24 ── up0 10.100.1.1/24
//!   VIP 10.200.0.10          pv0 10.100.2.1/24 ───────────── eth0 10.100.2.2/24 (pod0)
//!   routed via .1.1          pv1 10.100.3.1/24 ───────────── eth0 10.100.3.2/24 (pod1)
//! ```
//!
//! The backends are small HTTP/1.1 (TCP 8080) and UDP (5353) servers run by this test
//! process on threads that entered the Pod namespaces (`setns`); each records the peer
//! address of every request it serves — the access log. The client side is `curl`, `ping`
//! and sockets opened from a thread inside the client namespace. The node state is
//! published with the real `NodeStateWriter`.
//!
//! Prerequisites (tests/setup.sh): root, `ip`, `ethtool`, `curl`, `ping`, `bpftool`,
//! clang + libbpf-dev (to build the steering program).

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use juneau_control::model::{
    Frontend, Frontend6, LocalBackend, LocalBackend6, NodeService, NodeService6, NodeState,
    Protocol,
};
use juneau_control::shm::{Capacity, NodeStateWriter};
use juneau_tests::daemon::json_sampled_after_now;
use juneau_tests::frames::{
    ethernet_ipv4, inet_checksum, inject, ipv4_header, send_raw_ipv4, udp_flood, TcpFlood,
};
use juneau_tests::http::{download, http_get, pattern, read_response, upload, TestBackend};
use juneau_tests::netns::{
    in_ns, mac_of, require_root, run, unique_prefix, veth, veth_queues, Netns, NsChild,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 10);
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 1, 2);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 1, 1);
const HTTP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const CLOSED_PORT: u16 = 5999;

fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 100, 2 + i as u8, 2)
}

/// A dual-stack lab's IPv6 addresses (issue #28): the VIP, the client, and Pod `i` (on
/// the bridge's /64, the node `fd00:100:2::1`).
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x200, 0, 0, 0, 0, 0x10);
const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 1, 0, 0, 0, 2);
/// The IPv6 backends' ports (the IPv4 ones' servers bind 0.0.0.0 only).
const HTTP_PORT6: u16 = 8081;
const UDP_PORT6: u16 = 5354;

fn pod_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x100, 2, 0, 0, 0, 0, 2 + i as u16)
}

/// An IPv6 frontend of the dual-stack lab on the Pods `pods`.
fn service6(protocol: Protocol, port: u16, target: u16, pods: &[usize]) -> NodeService6 {
    NodeService6 {
        frontend: Frontend6 {
            vip: VIP6,
            protocol,
            port,
        },
        backends: pods
            .iter()
            .map(|&i| LocalBackend6 {
                ip: pod_ip6(i),
                port: target,
            })
            .collect(),
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        client_ip_affinity: None,
        hand_off: false,
    }
}

/// The node state of a dual-stack lab: the IPv4 frontends and their IPv6 twins.
fn dual_stack_state(pods: &[usize]) -> NodeState {
    NodeState {
        services6: vec![
            service6(Protocol::Tcp, 80, HTTP_PORT6, pods),
            service6(Protocol::Udp, 53, UDP_PORT6, pods),
        ],
        ..node_state(pods)
    }
}

/// IPv6 on every link: `2001:db8:100:1::/64` between client and node (the client routes
/// the VIPs' /64 via the node); the Pods on `fd00:100:2::/64` behind the bridge, or, with
/// per-Pod veths, each Pod's /128 routed to its veth and the node `fd00:100:2::1` on
/// every veth (as ptp-style CNIs do); each Pod's default route via `fd00:100:2::1`.
fn wire_ipv6(client: &Netns, node: &Netns, pods: &[Netns], bridge: bool) -> Result<()> {
    node.addr6("up0", "2001:db8:100:1::1/64")?;
    client.addr6("eth0", &format!("{CLIENT_IP6}/64"))?;
    client.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        "2001:db8:200::/64",
        "via",
        "2001:db8:100:1::1",
    ])?;
    if bridge {
        node.addr6("br0", "fd00:100:2::1/64")?;
    }
    for (i, pod) in pods.iter().enumerate() {
        if bridge {
            pod.addr6("eth0", &format!("{}/64", pod_ip6(i)))?;
        } else {
            let pv = format!("pv{i}");
            node.addr6(&pv, "fd00:100:2::1/128")?;
            node.exec(&[
                "ip",
                "-6",
                "route",
                "add",
                &format!("{}/128", pod_ip6(i)),
                "dev",
                &pv,
            ])?;
            pod.addr6("eth0", &format!("{}/128", pod_ip6(i)))?;
            pod.exec(&["ip", "-6", "route", "add", "fd00:100:2::1", "dev", "eth0"])?;
        }
        pod.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "fd00:100:2::1",
        ])?;
    }
    Ok(())
}

/// A backend Pod: HTTP on 8080 and UDP echo on 5353, answering `<name> saw <peer>`.
fn start_backend(ns: &str, name: &str) -> Result<TestBackend> {
    TestBackend::start(
        ns,
        name,
        SocketAddr::from(([0, 0, 0, 0], HTTP_PORT)),
        Some(SocketAddr::from(([0, 0, 0, 0], UDP_PORT))),
    )
}

fn service(protocol: Protocol, port: u16, target: u16, pods: &[usize]) -> NodeService {
    NodeService {
        frontend: Frontend {
            vip: VIP,
            protocol,
            port,
        },
        backends: pods
            .iter()
            .map(|&i| LocalBackend {
                ip: pod_ip(i),
                port: target,
            })
            .collect(),
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        client_ip_affinity: None,
        hand_off: false,
        host_network: false,
    }
}

fn node_state(pods: &[usize]) -> NodeState {
    NodeState {
        node: "node-a".into(),
        services: vec![
            service(Protocol::Tcp, 80, HTTP_PORT, pods),
            service(Protocol::Udp, 53, UDP_PORT, pods),
            // Nothing listens on the target port: the Pods answer ICMP port unreachable.
            service(Protocol::Udp, 55, CLOSED_PORT, pods),
        ],
        ..Default::default()
    }
}

/// A private bpffs instance mounted for one lab; unmounted (pins and all) on drop.
struct BpfMount {
    path: PathBuf,
}

impl BpfMount {
    fn new(path: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&path)?;
        run("mount", &["-t", "bpf", "bpf", path.to_str().unwrap()])?;
        Ok(BpfMount { path })
    }

    fn pin_dir(&self) -> PathBuf {
        self.path.join("node-a")
    }
}

impl Drop for BpfMount {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.path.to_str().unwrap()]);
    }
}

/// One test topology with the dataplane running. Field order is drop order: the
/// dataplane process dies first, then the servers stop, then the namespaces go.
struct Lab {
    bridge: bool,
    /// Started without --pod-iface: Pod veths are found through the routing table.
    routes: bool,
    dataplane: Option<NsChild>,
    /// A BPF filesystem of this lab's own (the dataplane pins its maps and links there);
    /// unmounted right after the dataplane dies, which unpins everything.
    bpffs: BpfMount,
    /// The dataplane's command line (to start it again).
    argv: Vec<String>,
    backends: Vec<TestBackend>,
    writer: NodeStateWriter,
    stats: PathBuf,
    log: PathBuf,
    xdp_prog_ids: Vec<u32>,
    client: Netns,
    node: Netns,
    pods: Vec<Netns>,
    _dir: tempfile::TempDir,
}

fn require(tool: &str, args: &[&str]) -> Result<()> {
    std::process::Command::new(tool)
        .args(args)
        .output()
        .with_context(|| format!("`{tool}` is missing: run tests/setup.sh (installs the Debian packages in tests/setup/apt-packages.txt)"))?;
    Ok(())
}

impl Lab {
    fn new(tag: &str) -> Result<Self> {
        Self::with_uplink_queues(tag, 1)
    }

    /// A lab whose uplink veth has `queues` RX/TX queues (flows spread over them).
    fn with_uplink_queues(tag: &str, queues: u32) -> Result<Self> {
        Self::build(tag, queues, false, false)
    }

    /// Per-Pod veths, and the dataplane started without `--pod-iface`: it finds `pv0`,
    /// `pv1` through the routes to the backends.
    fn from_routes(tag: &str) -> Result<Self> {
        Self::build(tag, 1, false, true)
    }

    /// A lab whose Pods hang off a Linux bridge `br0` (10.100.2.0/23, gateway
    /// 10.100.2.1) and the dataplane is given the bridge as its one Pod interface.
    fn bridged(tag: &str) -> Result<Self> {
        Self::build(tag, 1, true, false)
    }

    fn build(tag: &str, queues: u32, bridge: bool, routes: bool) -> Result<Self> {
        Self::build_with(tag, queues, bridge, routes, &[])
    }

    fn build_with(
        tag: &str,
        queues: u32,
        bridge: bool,
        routes: bool,
        extra: &[&str],
    ) -> Result<Self> {
        Self::build_full(tag, queues, 1, bridge, routes, false, extra)
    }

    /// `workers` forwarding workers over an uplink and Pod veths of `workers` queues
    /// each.
    fn with_workers(tag: &str, workers: u32, extra: &[&str]) -> Result<Self> {
        let n = workers.to_string();
        let mut argv = vec!["--workers", n.as_str()];
        argv.extend_from_slice(extra);
        Self::build_full(tag, workers, workers, false, false, false, &argv)
    }

    /// A bridged lab with IPv6 beside IPv4 on every link, IPv6 servers in the Pods, and
    /// the IPv6 twins of the frontends in the node state ([`dual_stack_state`]).
    fn dual_stack(tag: &str) -> Result<Self> {
        Self::build_full(tag, 1, 1, true, false, true, &[])
    }

    #[allow(clippy::too_many_arguments)]
    fn build_full(
        tag: &str,
        queues: u32,
        pod_queues: u32,
        bridge: bool,
        routes: bool,
        v6: bool,
        extra: &[&str],
    ) -> Result<Self> {
        require_root()?;
        for (t, a) in [
            ("ip", "-V"),
            ("ethtool", "--version"),
            ("curl", "--version"),
            ("ping", "-V"),
            ("bpftool", "version"),
        ] {
            require(t, &[a])?;
        }
        let p = unique_prefix(tag);
        let client = Netns::new(format!("{p}c"))?;
        let node = Netns::new(format!("{p}n"))?;
        let pods = vec![Netns::new(format!("{p}p0"))?, Netns::new(format!("{p}p1"))?];
        veth_queues(&node, "up0", &client, "eth0", queues)?;
        node.addr("up0", "10.100.1.1/24")?;
        client.addr("eth0", "10.100.1.2/24")?;
        client.exec(&["ip", "route", "add", "10.200.0.0/24", "via", "10.100.1.1"])?;
        // Kernel sockets in the client would hand over partial checksums (FACTS.md).
        client.exec(&["ethtool", "-K", "eth0", "tx", "off"])?;
        if bridge {
            node.exec(&["ip", "link", "add", "br0", "type", "bridge"])?;
            node.addr("br0", "10.100.2.1/23")?;
        }
        for (i, pod) in pods.iter().enumerate() {
            wire_pod(&node, pod, i, bridge, pod_queues)?;
        }
        let mut backends = vec![
            start_backend(pods[0].name(), "pod0")?,
            start_backend(pods[1].name(), "pod1")?,
        ];
        if v6 {
            wire_ipv6(&client, &node, &pods, bridge)?;
            for (i, pod) in pods.iter().enumerate() {
                backends.push(TestBackend::start(
                    pod.name(),
                    &format!("pod{i}"),
                    SocketAddr::from((Ipv6Addr::UNSPECIFIED, HTTP_PORT6)),
                    Some(SocketAddr::from((Ipv6Addr::UNSPECIFIED, UDP_PORT6))),
                )?);
            }
        }
        let dir = tempfile::tempdir()?;
        let state_path = dir.path().join("node-a.state");
        let mut writer = NodeStateWriter::create(&state_path, Capacity::default())?;
        writer.publish(&if v6 {
            dual_stack_state(&[0, 1])
        } else {
            node_state(&[0, 1])
        })?;
        let stats = dir.path().join("stats.json");
        let log = dir.path().join("dataplane.log");
        let bpffs = BpfMount::new(dir.path().join("bpf"))?;
        let mut lab = Lab {
            bridge,
            routes,
            dataplane: None,
            bpffs,
            argv: Vec::new(),
            backends,
            writer,
            stats,
            log,
            xdp_prog_ids: Vec::new(),
            client,
            node,
            pods,
            _dir: dir,
        };
        let bin = env!("CARGO_BIN_EXE_juneau-dataplane");
        let st = state_path.to_str().unwrap().to_string();
        let sf = lab.stats.to_str().unwrap().to_string();
        let mut argv = vec![bin, "--uplink", "up0"];
        if bridge {
            argv.extend(["--pod-iface", "br0"]);
        } else if routes {
            // No --pod-iface: discovery through routes is the default.
        } else {
            argv.extend(["--pod-iface", "pv0", "--pod-iface", "pv1"]);
        }
        argv.extend([
            "--state-file",
            &st,
            "--stats-file",
            &sf,
            "--flow-capacity",
            "65536",
            "--neighbour-keepalive",
            "1",
        ]);
        let pin = lab.bpffs.pin_dir().to_str().unwrap().to_string();
        argv.extend(["--pin-dir", &pin]);
        argv.extend(extra.iter().copied());
        lab.argv = argv.iter().map(|a| a.to_string()).collect();
        lab.start()?;
        Ok(lab)
    }

    /// Starts the dataplane (again) and waits until it serves.
    fn start(&mut self) -> Result<()> {
        let _ = std::fs::remove_file(&self.stats);
        let argv: Vec<&str> = self.argv.iter().map(String::as_str).collect();
        let child = self.node.spawn_logged(&argv, &self.log)?;
        self.dataplane = Some(child);
        self.wait_ready()
    }

    /// `kill -9` of the dataplane; returns once the process is gone.
    fn kill9(&mut self) {
        if let Some(mut dp) = self.dataplane.take() {
            dp.signal(9);
            dp.kill();
        }
    }

    fn dataplane_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the dataplane has loaded the state and written stats, and records the
    /// XDP program ids attached to its interfaces.
    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if !self.dataplane.as_mut().unwrap().is_running() {
                bail!("juneau-dataplane exited:\n{}", self.dataplane_log());
            }
            if let Ok(s) = self.stats() {
                if s["generation"].as_u64().unwrap_or(0) >= 1 {
                    break;
                }
            }
            ensure!(
                Instant::now() < deadline,
                "dataplane not ready in 30 s:\n{}",
                self.dataplane_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        if self.routes {
            self.wait_pod_ifaces(&["pv0", "pv1"], &[])?;
        }
        let ifnames: &[&str] = if self.bridge {
            &["up0", "br0"]
        } else {
            &["up0", "pv0", "pv1"]
        };
        for &ifname in ifnames {
            let out = self.node.exec(&["ip", "-d", "link", "show", ifname])?;
            let id = out
                .split_whitespace()
                .skip_while(|w| *w != "prog/xdp")
                .nth(2)
                .and_then(|w| w.parse::<u32>().ok())
                .with_context(|| format!("no XDP program on {ifname}: {out}"))?;
            self.xdp_prog_ids.push(id);
        }
        Ok(())
    }

    /// Waits until the dataplane has sockets on every interface of `present` and on
    /// none of `absent` (discovered Pod interfaces).
    fn wait_pod_ifaces(&self, present: &[&str], absent: &[&str]) -> Result<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(s) = self.stats() {
                let have: Vec<&str> = s["pod_ifaces"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                    .unwrap_or_default();
                if present.iter().all(|p| have.contains(p))
                    && absent.iter().all(|p| !have.contains(p))
                {
                    return Ok(s);
                }
            }
            ensure!(
                Instant::now() < deadline,
                "Pod interfaces not {present:?} without {absent:?} in 20 s: {:?}\n{}",
                self.stats().ok(),
                self.dataplane_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Asks VIP:53 over UDP from the client (a fresh socket, a few tries); the reply.
    fn udp_ask(&self) -> Result<String> {
        in_ns(self.client.name(), || -> Result<String> {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(Duration::from_millis(500)))?;
            let mut buf = [0u8; 2048];
            for _ in 0..10 {
                s.send_to(b"ping", (VIP, 53))?;
                if let Ok((n, _)) = s.recv_from(&mut buf) {
                    return Ok(String::from_utf8_lossy(&buf[..n]).to_string());
                }
            }
            bail!("no UDP reply from the VIP")
        })
    }

    fn stats(&self) -> Result<serde_json::Value> {
        let text = std::fs::read_to_string(&self.stats)?;
        Ok(serde_json::from_str(&text)?)
    }

    /// The stats sampled after this call (what the test did so far is counted).
    fn fresh_stats(&self) -> Result<serde_json::Value> {
        json_sampled_after_now(&self.stats)
    }

    /// A top-level stats counter (0 while the stats are not readable).
    fn stat(&self, name: &str) -> u64 {
        self.stats()
            .ok()
            .and_then(|s| s[name].as_u64())
            .unwrap_or(0)
    }

    fn drops(&self, reason: &str) -> u64 {
        self.stats()
            .ok()
            .and_then(|s| s["drops"][reason].as_u64())
            .unwrap_or(0)
    }

    /// Waits for the stats file to show `reason` ≥ `at_least`.
    fn wait_drops(&self, reason: &str, at_least: u64) -> Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self.drops(reason);
            if n >= at_least {
                return Ok(n);
            }
            ensure!(
                Instant::now() < deadline,
                "drop counter {reason} stayed at {n} (< {at_least}): {:?}",
                self.stats().ok()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn publish(&mut self, pods: &[usize]) -> Result<u64> {
        self.publish_state(&node_state(pods))
    }

    fn publish_state(&mut self, state: &NodeState) -> Result<u64> {
        let g = self.writer.publish(state)?;
        self.wait_generation(g)?;
        Ok(g)
    }

    /// Waits for the dataplane to have taken generation `g`.
    fn wait_generation(&self, g: u64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self
            .stats()
            .ok()
            .and_then(|s| s["generation"].as_u64())
            .unwrap_or(0)
            < g
        {
            ensure!(
                Instant::now() < deadline,
                "dataplane did not take generation {g}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Opens `n` TCP connections and makes a request on each: the connections and the
    /// Pod each one is served by; both Pods must serve some.
    fn connections_on_both_pods(&self, n: usize) -> Result<(Vec<TcpStream>, Vec<usize>)> {
        let mut conns = self.connect_many(n)?;
        let mut on: Vec<usize> = Vec::new();
        for c in conns.iter_mut() {
            on.push(pod_of(&http_get(c)?).context("pod")?);
        }
        ensure!(
            on.contains(&0) && on.contains(&1),
            "need connections on both pods: {on:?}"
        );
        Ok((conns, on))
    }

    /// Opens `n` TCP connections to VIP:80 from the client namespace.
    fn connect_many(&self, n: usize) -> Result<Vec<TcpStream>> {
        in_ns(self.client.name(), move || -> Result<Vec<TcpStream>> {
            let vip = SocketAddr::V4(SocketAddrV4::new(VIP, 80));
            let mut out = Vec::new();
            for i in 0..n {
                let c = TcpStream::connect_timeout(&vip, Duration::from_secs(10))
                    .with_context(|| format!("connection {i} to {vip}"))?;
                c.set_read_timeout(Some(Duration::from_secs(5)))?;
                out.push(c);
            }
            Ok(out)
        })
        .with_context(|| {
            format!(
                "dataplane stats: {}\ndataplane log:\n{}",
                self.stats().map(|s| s.to_string()).unwrap_or_default(),
                self.dataplane_log()
            )
        })
    }

    /// One connection to the VIP from each of the client's addresses `from` (added to
    /// the client's eth0 by the caller).
    fn connect_from(&self, from: &[Ipv4Addr]) -> Result<Vec<TcpStream>> {
        let from = from.to_vec();
        in_ns(self.client.name(), move || -> Result<Vec<TcpStream>> {
            let vip = SocketAddr::V4(SocketAddrV4::new(VIP, 80));
            let mut out = Vec::new();
            for a in from {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
                s.bind(&SocketAddr::V4(SocketAddrV4::new(a, 0)).into())?;
                s.connect_timeout(&vip.into(), Duration::from_secs(10))
                    .with_context(|| format!("connection from {a} to {vip}"))?;
                let c: TcpStream = s.into();
                c.set_read_timeout(Some(Duration::from_secs(5)))?;
                out.push(c);
            }
            Ok(out)
        })
    }

    /// Sets the MTU of the Pods' links: `eth0` in each Pod and its node end (`pv0`, `pv1`).
    fn set_pod_mtu(&self, mtu: u32) -> Result<()> {
        let mtu = mtu.to_string();
        for p in &self.pods {
            p.exec(&["ip", "link", "set", "eth0", "mtu", &mtu])?;
        }
        for pv in ["pv0", "pv1"] {
            self.node.exec(&["ip", "link", "set", pv, "mtu", &mtu])?;
        }
        Ok(())
    }

    /// Tears down and checks that nothing is left behind.
    fn finish(mut self) -> Result<()> {
        let dp = self.dataplane.take();
        let pid = dp.as_ref().map(|c| c.id());
        drop(dp);
        let names: Vec<String> = std::iter::once(self.client.name().to_string())
            .chain(std::iter::once(self.node.name().to_string()))
            .chain(self.pods.iter().map(|p| p.name().to_string()))
            .collect();
        let ids = std::mem::take(&mut self.xdp_prog_ids);
        let bpffs = self.bpffs.path.clone();
        drop(self);
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
        ensure!(
            !mounts.contains(bpffs.to_str().unwrap()),
            "bpffs {} left mounted",
            bpffs.display()
        );
        let list = String::from_utf8(run("ip", &["netns", "list"])?.stdout)?;
        for n in &names {
            ensure!(
                !list.split_whitespace().any(|w| w == n),
                "namespace {n} left behind"
            );
        }
        if let Some(pid) = pid {
            ensure!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "dataplane process {pid} left behind"
            );
        }
        // XDP programs go when their links' last fd closes (process exit) and the
        // interfaces are gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        for id in ids {
            loop {
                let out = std::process::Command::new("bpftool")
                    .args(["prog", "show", "id", &id.to_string()])
                    .output()?;
                if !out.status.success() {
                    break;
                }
                ensure!(
                    Instant::now() < deadline,
                    "XDP program {id} still loaded after teardown"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }
}

/// Connects Pod `i` to the node: its own veth `pv<i>` with a /24 (per-Pod veth, as
/// ptp-style CNIs do), or a port of bridge `br0` (bridge CNIs).
fn wire_pod(node: &Netns, pod: &Netns, i: usize, bridge: bool, queues: u32) -> Result<()> {
    let pv = format!("pv{i}");
    if queues == 1 {
        veth(node, &pv, pod, "eth0")?;
    } else {
        veth_queues(node, &pv, pod, "eth0", queues)?;
    }
    if bridge {
        node.exec(&["ip", "link", "set", &pv, "master", "br0"])?;
        pod.addr("eth0", &format!("{}/23", pod_ip(i)))?;
        pod.exec(&["ip", "route", "add", "default", "via", "10.100.2.1"])?;
    } else {
        node.addr(&pv, &format!("10.100.{}.1/24", 2 + i))?;
        pod.addr("eth0", &format!("{}/24", pod_ip(i)))?;
        pod.exec(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            &format!("10.100.{}.1", 2 + i),
        ])?;
    }
    // Pods keep tx checksum offload ON, as real Pods do: the dataplane must recompute
    // their partial checksums.
    Ok(())
}

/// Downloads 1 MiB from the VIP (`/big`) with curl from `client`; all of it must arrive.
fn download_1mib(client: &Netns) -> Result<()> {
    let out = client.output(&[
        "curl",
        "-sS",
        "-m",
        "20",
        "-o",
        "/dev/null",
        "-w",
        "%{size_download}",
        "http://10.200.0.10/big",
    ])?;
    ensure!(
        String::from_utf8_lossy(&out.stdout) == (1u64 << 20).to_string(),
        "1 MiB download: {} bytes; {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn curl(ns: &Netns, url: &str) -> Result<(String, String)> {
    let out = ns.output(&[
        "curl",
        "-sS",
        "-m",
        "10",
        "-w",
        "\n%{remote_ip}:%{remote_port}",
        url,
    ])?;
    ensure!(
        out.status.success(),
        "curl {url} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let (body, remote) = text.rsplit_once('\n').context("curl output")?;
    Ok((body.to_string(), remote.to_string()))
}

fn pod_of(body: &str) -> Option<usize> {
    body.strip_prefix("pod")?.split(' ').next()?.parse().ok()
}

/// IPv6 end to end (issue #28): TCP and UDP to the IPv6 VIP are DNATed to the Pods'
/// IPv6 addresses and answered from the VIP, the Pods see the client's own address, and
/// 4 MiB go each way with the Pods' offloads on (their super-segments cut for the
/// uplink); the IPv4 frontends keep working beside them.
#[test]
fn ipv6_through_the_vip_keeps_the_client_address_and_carries_4mib_both_ways() -> Result<()> {
    let lab = Lab::dual_stack("dp6")?;
    let base = format!("http://[{VIP6}]");
    let (body, remote) = curl(&lab.client, &format!("{base}/"))?;
    assert_eq!(remote, format!("{VIP6}:80"), "the client talks to VIP:port");
    assert!(
        body.contains(&format!("saw [{CLIENT_IP6}]:")),
        "the backend saw the client's own IPv6 address: {body}"
    );
    let big = pattern(4 << 20);
    download(
        lab.client.name(),
        &format!("{base}/bytes/{}", big.len()),
        &big,
        30,
    )?;
    upload(lab.client.name(), &format!("{base}/upload"), &big, 30)?;

    let (from, reply) = in_ns(lab.client.name(), || -> Result<(SocketAddr, String)> {
        let s = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut buf = [0u8; 2048];
        for _ in 0..10 {
            s.send_to(b"ping6", (VIP6, 53))?;
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                return Ok((from, String::from_utf8_lossy(&buf[..n]).to_string()));
            }
        }
        bail!("no UDP reply from the IPv6 VIP")
    })?;
    assert_eq!(from, SocketAddr::from((VIP6, 53)), "UDP reply source");
    assert!(
        reply.contains(&format!("saw [{CLIENT_IP6}]:")) && reply.ends_with("ping6"),
        "{reply}"
    );
    // IPv4 beside it.
    let (body, _) = curl(&lab.client, "http://10.200.0.10/")?;
    assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");

    let s = lab.fresh_stats()?;
    let v6 = s["services"]
        .as_array()
        .context("services")?
        .iter()
        .find(|x| x["vip"] == VIP6.to_string() && x["protocol"] == "TCP")
        .with_context(|| format!("no IPv6 service in the stats: {s}"))?;
    assert!(v6["new_flows"].as_u64().unwrap_or(0) >= 3, "{v6}");
    assert!(
        s["segmented"].as_u64().unwrap_or(0) > 0,
        "the Pods' IPv6 super-segments were cut for the uplink: {s}"
    );
    for reason in [
        "malformed",
        "ipv6_extension_header",
        "flow_not_published",
        "no_flow",
        "too_big",
    ] {
        assert_eq!(s["drops"][reason].as_u64(), Some(0), "{reason}: {s}");
    }
    lab.finish()
}

/// `n` TCP connections to the IPv6 VIP's port 80 from the client.
fn connect6(lab: &Lab, n: usize) -> Result<Vec<TcpStream>> {
    in_ns(lab.client.name(), move || -> Result<Vec<TcpStream>> {
        let vip = SocketAddr::from((VIP6, 80));
        (0..n)
            .map(|i| {
                let c = TcpStream::connect_timeout(&vip, Duration::from_secs(10))
                    .with_context(|| format!("IPv6 connection {i} to {vip}"))?;
                c.set_read_timeout(Some(Duration::from_secs(40)))?;
                Ok(c)
            })
            .collect()
    })
}

/// IPv6 connections outlive a `kill -9` of the dataplane: the restarted process rebuilds
/// them from the keys left in the pinned `flows6` map, and their Pods' replies in the
/// meantime never reached the kernel un-NATed.
#[test]
fn ipv6_connections_survive_kill_9_and_a_restart() -> Result<()> {
    let mut lab = Lab::dual_stack("dp6r")?;
    // As on a Kubernetes node, the kernel forwards: a Pod's packet handed to it un-NATed
    // would reach the client, whose kernel would answer with a RST.
    lab.node
        .exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])?;
    let mut conns = connect6(&lab, 6)?;
    let mut served_by = Vec::new();
    for c in conns.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw [{CLIENT_IP6}]:")), "{body}");
        served_by.push(pod_of(&body));
    }
    lab.kill9();
    let pending = requests_in_flight(&mut conns);
    std::thread::sleep(Duration::from_millis(500));
    lab.start()?;
    let s = lab.stats()?;
    ensure!(
        s["flows6"].as_u64().unwrap_or(0) >= 6 && s["flows_restored"].as_u64().unwrap_or(0) >= 6,
        "{s}\n{}",
        lab.dataplane_log()
    );
    for (i, h) in pending.into_iter().enumerate() {
        let (c, r) = h.join().expect("request thread");
        let body = r.with_context(|| format!("IPv6 connection {i} after the restart"))?;
        assert!(body.contains(&format!("saw [{CLIENT_IP6}]:")), "{body}");
        assert_eq!(pod_of(&body), served_by[i], "connection {i} kept its Pod");
        conns.push(c);
    }
    let big = pattern(4 << 20);
    download(
        lab.client.name(),
        &format!("http://[{VIP6}]/bytes/{}", big.len()),
        &big,
        30,
    )?;
    assert_eq!(lab.drops("no_flow"), 0, "{}", lab.stats()?);
    lab.finish()
}

/// Two forwarding workers over two-queue links: an IPv6 connection's replies may reach
/// the other worker's socket than its client's packets; the shared IPv6 flow table
/// serves them either way.
#[test]
fn ipv6_with_two_workers_serves_every_connection() -> Result<()> {
    let lab = Lab::build_full("dp6w", 2, 2, false, false, true, &["--workers", "2"])?;
    let mut conns = connect6(&lab, 16)?;
    for c in conns.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw [{CLIENT_IP6}]:")), "{body}");
    }
    let big = pattern(4 << 20);
    download(
        lab.client.name(),
        &format!("http://[{VIP6}]/bytes/{}", big.len()),
        &big,
        30,
    )?;
    upload(
        lab.client.name(),
        &format!("http://[{VIP6}]/upload"),
        &big,
        30,
    )?;
    let s = lab.fresh_stats()?;
    assert_eq!(s["workers"].as_array().map(Vec::len), Some(2), "{s}");
    assert_eq!(s["drops"]["no_flow"].as_u64(), Some(0), "{s}");
    lab.finish()
}

/// Extension headers on the way in: a Destination Options header (as a router or the
/// client may add) is walked past and the datagram served; ESP to the VIP is dropped
/// under its own name, not lost unnamed.
#[test]
fn ipv6_extension_headers_are_walked_or_dropped_by_name() -> Result<()> {
    let lab = Lab::dual_stack("dp6x")?;
    // The whole packet written here (a raw IPPROTO_RAW socket takes the IPv6 header):
    // a Destination Options header (PadN) before a UDP query from a bound socket's port.
    let reply = in_ns(lab.client.name(), || -> Result<String> {
        use socket2::{Domain, Protocol, SockAddr, Socket, Type};
        let rx = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?;
        rx.set_read_timeout(Some(Duration::from_secs(1)))?;
        let port = rx.local_addr()?.port();
        let data = b"with-options";
        let mut udp = Vec::new();
        udp.extend_from_slice(&port.to_be_bytes());
        udp.extend_from_slice(&53u16.to_be_bytes());
        udp.extend_from_slice(&((8 + data.len()) as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(data);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&CLIENT_IP6.octets());
        pseudo.extend_from_slice(&VIP6.octets());
        pseudo.extend_from_slice(&(udp.len() as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, 17]);
        pseudo.extend_from_slice(&udp);
        let c = inet_checksum(&pseudo);
        udp[6..8].copy_from_slice(&c.to_be_bytes());
        let mut pkt = vec![0x60, 0, 0, 0];
        pkt.extend_from_slice(&((8 + udp.len()) as u16).to_be_bytes());
        pkt.extend_from_slice(&[60, 64]); // Destination Options next
        pkt.extend_from_slice(&CLIENT_IP6.octets());
        pkt.extend_from_slice(&VIP6.octets());
        pkt.extend_from_slice(&[17, 0, 1, 4, 0, 0, 0, 0]); // then UDP; PadN(4)
        pkt.extend_from_slice(&udp);
        let raw = Socket::new(
            Domain::IPV6,
            Type::RAW,
            Some(Protocol::from(libc::IPPROTO_RAW)),
        )?;
        let to = SockAddr::from(SocketAddr::from((VIP6, 0)));
        let mut buf = [0u8; 2048];
        for _ in 0..10 {
            raw.send_to(&pkt, &to)?;
            if let Ok((n, _)) = rx.recv_from(&mut buf) {
                return Ok(String::from_utf8_lossy(&buf[..n]).to_string());
            }
        }
        bail!("no UDP reply to a datagram with a Destination Options header")
    })?;
    assert!(
        reply.contains(&format!("saw [{CLIENT_IP6}]:")) && reply.ends_with("with-options"),
        "{reply}"
    );
    let before = lab.drops("ipv6_extension_header");
    in_ns(lab.client.name(), || -> Result<()> {
        use socket2::{Domain, Protocol, SockAddr, Socket, Type};
        let s = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::from(50)))?; // ESP
        let to = SockAddr::from(SocketAddr::from((VIP6, 0)));
        for _ in 0..3 {
            s.send_to(&[0u8; 24], &to)?;
        }
        Ok(())
    })?;
    lab.wait_drops("ipv6_extension_header", before + 3)?;
    lab.finish()
}

/// An ICMPv6 Packet Too Big about a reply (sent to the VIP, the reply's source) reaches
/// the backend translated, so its path-MTU discovery works: IPv6 routers never fragment.
#[test]
fn ipv6_packet_too_big_reaches_the_backend() -> Result<()> {
    let lab = Lab::dual_stack("dp6m")?;
    let (client_port, reply) = in_ns(lab.client.name(), || -> Result<(u16, String)> {
        let s = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut buf = [0u8; 2048];
        for _ in 0..10 {
            s.send_to(b"hello", (VIP6, 53))?;
            if let Ok((n, _)) = s.recv_from(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                return Ok((s.local_addr()?.port(), text));
            }
        }
        bail!("no UDP reply through the IPv6 VIP")
    })?;
    let pod = pod_of(&reply).context("which pod answered")?;
    let route = |pod: usize| {
        lab.pods[pod]
            .exec(&["ip", "-6", "route", "get", &CLIENT_IP6.to_string()])
            .unwrap_or_default()
    };
    assert!(!route(pod).contains("mtu 1280"), "{}", route(pod));
    // The quoted reply: VIP:53 -> client:port, 1400 bytes.
    let mut quote = vec![0x60, 0, 0, 0];
    quote.extend_from_slice(&1360u16.to_be_bytes());
    quote.extend_from_slice(&[17, 63]);
    quote.extend_from_slice(&VIP6.octets());
    quote.extend_from_slice(&CLIENT_IP6.octets());
    quote.extend_from_slice(&53u16.to_be_bytes());
    quote.extend_from_slice(&client_port.to_be_bytes());
    quote.extend_from_slice(&1360u16.to_be_bytes());
    quote.extend_from_slice(&[0, 0]);
    let mut ptb = vec![2u8, 0, 0, 0]; // type, code, checksum (the kernel fills it)
    ptb.extend_from_slice(&1280u32.to_be_bytes());
    ptb.extend_from_slice(&quote);
    in_ns(lab.client.name(), move || -> Result<()> {
        use socket2::{Domain, Protocol, SockAddr, Socket, Type};
        let s = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
        let to = SockAddr::from(SocketAddr::from((VIP6, 0)));
        for _ in 0..3 {
            s.send_to(&ptb, &to)?;
        }
        Ok(())
    })?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !route(pod).contains("mtu 1280") {
        ensure!(
            Instant::now() < deadline,
            "the backend never learned the IPv6 path MTU: {}\nstats: {:?}",
            route(pod),
            lab.stats().ok()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    lab.finish()
}

#[test]
fn http_and_udp_through_the_vip_keep_the_client_ip() -> Result<()> {
    let lab = Lab::new("dpa")?;
    // HTTP over TCP with curl.
    let (body, remote) = curl(&lab.client, "http://10.200.0.10/")?;
    assert_eq!(remote, "10.200.0.10:80", "the client talks to VIP:port");
    assert!(
        body.contains(&format!("saw {CLIENT_IP}:")),
        "backend saw the client's real IP: {body}"
    );
    let served = pod_of(&body).context("which pod answered")?;
    let peers = lab.backends[served].peers();
    assert!(
        peers
            .iter()
            .any(|p| p.ip() == std::net::IpAddr::V4(CLIENT_IP)),
        "{}'s access log records the client IP: {peers:?}",
        lab.backends[served].name
    );
    // A 1 MiB response (many full-size segments from a Pod with offloads on).
    download_1mib(&lab.client)?;

    // UDP: the reply comes from VIP:53 and the backend saw the client's address.
    let (from, reply) = in_ns(lab.client.name(), || -> Result<(SocketAddr, String)> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut buf = [0u8; 2048];
        for _ in 0..10 {
            s.send_to(b"ping", (VIP, 53))?;
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                return Ok((from, String::from_utf8_lossy(&buf[..n]).to_string()));
            }
        }
        bail!("no UDP reply from the VIP")
    })?;
    assert_eq!(
        from,
        SocketAddr::V4(SocketAddrV4::new(VIP, 53)),
        "UDP reply source"
    );
    assert!(
        reply.contains(&format!("saw {CLIENT_IP}:")) && reply.ends_with("ping"),
        "{reply}"
    );

    let s = lab.stats()?;
    assert!(
        s["services"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["new_flows"].as_u64().unwrap_or(0) > 0),
        "{s}"
    );
    // The same counters through /metrics (on by default, port 9743 of the node), and
    // the probes: live, and ready (state programmed, heartbeat fresh).
    let get = |path: &str| {
        lab.node.exec(&[
            "curl",
            "-sS",
            "-m",
            "5",
            "-w",
            "\n%{http_code}",
            &format!("http://127.0.0.1:9743{path}"),
        ])
    };
    assert!(get("/healthz")?.ends_with("\n200"));
    assert!(get("/readyz")?.ends_with("\n200"));
    // Two TCP connections (curl twice); the counters reach /metrics within ~1 s.
    let tcp80 = "juneau_dataplane_service_new_flows_total{vip=\"10.200.0.10\",protocol=\"TCP\",port=\"80\"}";
    let deadline = Instant::now() + Duration::from_secs(5);
    let metrics = loop {
        let m = get("/metrics")?;
        ensure!(m.ends_with("# EOF\n\n200"), "{m}");
        let new_flows: u64 = m
            .lines()
            .find(|l| l.starts_with(tcp80))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0);
        if new_flows >= 2 {
            break m;
        }
        ensure!(
            Instant::now() < deadline,
            "curl made 2 TCP flows, metrics say {new_flows}:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        metrics.contains("juneau_dataplane_drops_total{reason=\"no_backend\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("juneau_dataplane_programmed_vips 1"),
        "{metrics}"
    );
    lab.finish()
}

#[test]
fn connections_spread_over_both_backends_and_each_stays_on_one() -> Result<()> {
    let lab = Lab::new("dps")?;
    let mut conns = lab.connect_many(40)?;
    let mut first: Vec<usize> = Vec::new();
    for c in conns.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
        first.push(pod_of(&body).context("pod")?);
    }
    let on0 = first.iter().filter(|&&p| p == 0).count();
    assert!(
        on0 > 0 && on0 < first.len(),
        "Maglev spreads connections over both backends: {on0}/{} on pod0",
        first.len()
    );
    for round in 0..3 {
        for (i, c) in conns.iter_mut().enumerate() {
            let body = http_get(c)?;
            assert_eq!(
                pod_of(&body),
                Some(first[i]),
                "connection {i} moved in round {round}: {body}"
            );
        }
    }
    drop(conns);
    lab.finish()
}

#[test]
fn unexposed_port_is_dropped_while_node_traffic_still_works() -> Result<()> {
    let lab = Lab::new("dpp")?;
    // A TCP port the Service does not expose: silently dropped (no RST, no answer).
    let err = in_ns(lab.client.name(), || {
        TcpStream::connect_timeout(
            &SocketAddr::V4(SocketAddrV4::new(VIP, 81)),
            Duration::from_secs(2),
        )
        .map(|_| ())
    })
    .expect_err("connection to an unexposed port must not succeed");
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::TimedOut,
        "dropped, not refused: {err}"
    );
    // UDP to an unexposed port: no answer.
    let answered = in_ns(lab.client.name(), || -> Result<bool> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        s.send_to(b"x", (VIP, 54))?;
        Ok(s.recv_from(&mut [0u8; 64]).is_ok())
    })?;
    assert!(!answered, "UDP to an unexposed port answered");
    lab.wait_drops("port_not_exposed", 2)?;

    // The node's own traffic goes to the kernel: ping, ARP, and TCP to a node service.
    lab.client.exec(&["ip", "neigh", "flush", "dev", "eth0"])?;
    lab.client
        .exec(&["ping", "-c", "2", "-W", "2", "10.100.1.1"])?;
    let neigh = lab
        .client
        .exec(&["ip", "neigh", "show", "10.100.1.1", "dev", "eth0"])?;
    assert!(neigh.contains("lladdr"), "ARP resolved the node: {neigh}");
    let node_listener = in_ns(lab.node.name(), || TcpListener::bind((NODE_IP, 2222)))?;
    let t = std::thread::spawn(move || node_listener.accept().map(|(_, peer)| peer));
    in_ns(lab.client.name(), || {
        TcpStream::connect_timeout(
            &SocketAddr::V4(SocketAddrV4::new(NODE_IP, 2222)),
            Duration::from_secs(5),
        )
    })?;
    let peer = t.join().unwrap()?;
    assert_eq!(peer.ip(), std::net::IpAddr::V4(CLIENT_IP));
    // ICMP to the VIP is not TCP/UDP: dropped and counted.
    let out = lab
        .client
        .output(&["ping", "-c", "1", "-W", "1", "10.200.0.10"])?;
    assert!(
        !out.status.success(),
        "ping to the VIP must not be answered"
    );
    lab.wait_drops("unsupported_protocol", 1)?;
    lab.finish()
}

#[test]
fn removing_and_adding_backends_leaves_other_connections_alone() -> Result<()> {
    let mut lab = Lab::new("dpr")?;
    let (mut conns, on) = lab.connections_on_both_pods(30)?;

    // Remove pod1.
    lab.publish(&[0])?;
    for (i, c) in conns.iter_mut().enumerate() {
        if on[i] == 0 {
            let body = http_get(c)
                .with_context(|| format!("connection {i} on the remaining backend broke"))?;
            assert_eq!(pod_of(&body), Some(0));
        } else {
            c.set_read_timeout(Some(Duration::from_millis(1500)))?;
            let r = http_get(c);
            assert!(
                r.is_err(),
                "connection {i} to the removed backend must not be served elsewhere: {r:?}"
            );
        }
    }
    lab.wait_drops("backend_removed", 1)?;
    // New connections all go to pod0.
    let mut fresh = lab.connect_many(10)?;
    for c in fresh.iter_mut() {
        assert_eq!(pod_of(&http_get(c)?), Some(0));
    }

    // Add pod1 back: existing connections stay where they are.
    lab.publish(&[0, 1])?;
    for (i, c) in conns.iter_mut().enumerate().filter(|(i, _)| on[*i] == 0) {
        assert_eq!(
            pod_of(&http_get(c)?),
            Some(0),
            "connection {i} moved after a backend was added"
        );
    }
    for c in fresh.iter_mut() {
        assert_eq!(
            pod_of(&http_get(c)?),
            Some(0),
            "a connection moved after a backend was added"
        );
    }
    // And new connections use both again.
    let mut newer = lab.connect_many(30)?;
    let mut seen = HashSet::new();
    for c in newer.iter_mut() {
        seen.insert(pod_of(&http_get(c)?).context("pod")?);
    }
    assert_eq!(
        seen.len(),
        2,
        "new connections spread over both backends again"
    );
    drop((conns, fresh, newer));
    lab.finish()
}

/// The node state with both Pods as backends, pod 1 at `addr` (a Pod address the node
/// has never seen).
fn pod1_at(addr: Ipv4Addr) -> NodeState {
    let mut state = node_state(&[0, 1]);
    for s in state.services.iter_mut() {
        for b in s.backends.iter_mut().filter(|b| b.ip == pod_ip(1)) {
            b.ip = addr;
        }
    }
    state
}

/// A backend that is new to the service table (a Pod address the node has no neighbour
/// entry for) gets no packet before its next hop is resolved: the table waits for the resolver
/// (bounded) instead of sending first SYNs into `no_neighbour` drops, each of which
/// costs a client a 1 s retransmission. A SYN flood from random clients runs across the
/// change, so new flows reach the new backend within microseconds of the table.
#[test]
fn a_new_backend_gets_no_packet_before_its_next_hop_is_resolved() -> Result<()> {
    let mut lab = Lab::new("dpn")?;
    // The client's own next hop resolved first (its first reply would otherwise be a
    // `no_neighbour` drop of another kind: a client on the uplink's subnet is resolved on
    // demand).
    for c in lab.connect_many(4)?.iter_mut() {
        http_get(c)?;
    }
    lab.publish(&[0])?;
    let dst = mac_of(&lab.node, "up0")?;
    let src = mac_of(&lab.client, "eth0")?;
    let client = lab.client.name().to_string();
    let mut seen_new_backend = false;
    let mut replaced_in_slow = 0;
    // The last round's new Pod answers ARP only ~45 ms after its table arrived (the
    // kernel re-probes every 40 ms), and a second table, with no backend new to it,
    // arrives while the first is held: it must go on waiting for the first one's.
    lab.node
        .exec(&["sysctl", "-qw", "net.ipv4.neigh.pv1.retrans_time_ms=40"])?;
    for round in 0..3u64 {
        let slow = round == 2;
        // A Pod address never seen before (a new Pod): pod1 answers on a fresh address,
        // of which neither the node's kernel nor the dataplane has a neighbour entry.
        let fresh = Ipv4Addr::new(10, 100, 3, 10 + round as u8);
        let add_fresh =
            || lab.pods[1].exec(&["ip", "addr", "add", &format!("{fresh}/24"), "dev", "eth0"]);
        if !slow {
            add_fresh()?;
        }
        let state = pod1_at(fresh);
        let before = lab.drops("no_neighbour");
        let stop = Arc::new(AtomicBool::new(false));
        let flooder = {
            let (stop, client) = (stop.clone(), client.clone());
            std::thread::spawn(move || -> Result<usize> {
                let mut sent = 0;
                let deadline = Instant::now() + Duration::from_secs(10);
                for part in 0..200u64 {
                    if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                        break;
                    }
                    let frames = flood(dst, src, 0x02, 1000 * (round + 1) + part).frames(200);
                    sent += inject(&client, "eth0", frames)?;
                }
                Ok(sent)
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        let replaced_before = lab.stat("held_tables_replaced");
        if slow {
            lab.writer.publish(&state)?;
            // Longer than the worker's longest idle sleep (--idle-sleep-ms, 10 ms) twice:
            // it has read the first table, and holds it, before the second arrives.
            std::thread::sleep(Duration::from_millis(30));
            let mut more = state.clone();
            let mut extra = more.services[0].clone();
            extra.frontend.port += 1000;
            more.services.push(extra);
            let g = lab.writer.publish(&more)?;
            std::thread::sleep(Duration::from_millis(15));
            add_fresh()?;
            lab.wait_generation(g)?;
        } else {
            lab.publish_state(&state)?;
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        let sent = flooder.join().expect("flooder")?;
        // The new backend serves new connections.
        let mut c = lab.connect_many(20)?;
        for x in c.iter_mut() {
            seen_new_backend |= pod_of(&http_get(x)?) == Some(1);
        }
        lab.fresh_stats()?;
        let dropped = lab.drops("no_neighbour") - before;
        let replaced = lab.stat("held_tables_replaced") - replaced_before;
        if slow {
            replaced_in_slow = replaced;
        }
        eprintln!(
            "round {round}: {sent} SYNs across the change, {dropped} dropped as no_neighbour, \
             {replaced} held table(s) replaced"
        );
        assert_eq!(
            dropped,
            0,
            "round {round}: packets to the new backend were dropped for its unresolved next hop: {}\n{}",
            lab.stats()?,
            lab.dataplane_log()
        );
        lab.publish(&[0])?;
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        seen_new_backend,
        "the added backend never served a connection"
    );
    assert!(
        replaced_in_slow > 0,
        "no second table arrived while the first was held: the replacement went untested"
    );
    lab.finish()
}

/// A new backend whose neighbour answers only the kernel's later solicitation (a Pod
/// still coming up when its table arrived): the resolver keeps re-reading while the
/// kernel tries, so the entry is in the dataplane's table once the kernel has it — no
/// packet has to be dropped as `no_neighbour` first to make the resolver look again.
/// (The resolver once stopped re-reading ~400 ms after asking; an entry found on the
/// kernel's second try went unseen until the next packet's drop, which cost a client's
/// SYN a retransmission.)
#[test]
fn a_backend_found_on_the_kernels_later_try_is_seen_without_a_drop() -> Result<()> {
    let mut lab = Lab::new("dpk")?;
    for c in lab.connect_many(4)?.iter_mut() {
        http_get(c)?;
    }
    lab.publish(&[0])?;
    // The kernel solicits every 400 ms (three times): 0, 400, 800 ms.
    lab.node
        .exec(&["sysctl", "-qw", "net.ipv4.neigh.pv1.retrans_time_ms=400"])?;
    let fresh = Ipv4Addr::new(10, 100, 3, 40);
    let state = pod1_at(fresh);
    // Taken after the 250 ms hold, the backend still unresolved (not waited for through
    // the stats file: it is written once a second).
    lab.writer.publish(&state)?;
    // The Pod gets its address after the second solicitation, before the third.
    std::thread::sleep(Duration::from_millis(500));
    lab.pods[1].exec(&["ip", "addr", "add", &format!("{fresh}/24"), "dev", "eth0"])?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = lab
            .node
            .exec(&["ip", "neigh", "show", &fresh.to_string(), "dev", "pv1"])?;
        if out.contains("lladdr") && !out.contains("FAILED") {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the node's kernel never resolved {fresh}: {out}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Longer than the re-read period (250 ms) after the kernel's answer, shorter than
    // the resolver's once-a-second refresh.
    std::thread::sleep(Duration::from_millis(400));
    let before = lab.drops("no_neighbour");
    let mut conns = lab.connect_many(20)?;
    let mut on_fresh = 0;
    for c in conns.iter_mut() {
        on_fresh += usize::from(pod_of(&http_get(c)?) == Some(1));
    }
    lab.fresh_stats()?;
    let dropped = lab.drops("no_neighbour") - before;
    ensure!(on_fresh > 0, "no connection reached the new backend");
    ensure!(
        dropped == 0,
        "{dropped} packets to the new backend were dropped as no_neighbour after the kernel had resolved it\n{}",
        lab.dataplane_log()
    );
    drop(conns);
    lab.finish()
}

/// The stats' `xdp_fast_packets` once two consecutive stats writes agree (the dataplane
/// folds the program's counters into its stats once a second).
fn settled_fast_packets(lab: &Lab) -> Result<u64> {
    let read = || -> Option<(u64, u64)> {
        let s = lab.stats().ok()?;
        Some((s["timestamp"].as_u64()?, s["xdp_fast_packets"].as_u64()?))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last: Option<(u64, u64)> = None;
    loop {
        if let Some((t, v)) = read() {
            if let Some((t0, v0)) = last {
                if t > t0 && v == v0 {
                    return Ok(v);
                }
            }
            if last.is_none_or(|(t0, _)| t > t0) {
                last = Some((t, v));
            }
        }
        ensure!(Instant::now() < deadline, "xdp_fast_packets never settled");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Requests on the connections `which` picks (connection `i` is served by Pod `on[i]`)
/// every 200 ms until the stats counter `counter` exceeds `above`; an error after 15 s.
fn requests_until(
    lab: &Lab,
    conns: &mut [TcpStream],
    on: &[usize],
    which: impl Fn(usize) -> bool,
    counter: &str,
    above: u64,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        for (i, c) in conns.iter_mut().enumerate().filter(|(i, _)| which(*i)) {
            let body = http_get(c).with_context(|| format!("connection {i}"))?;
            assert_eq!(pod_of(&body), Some(on[i]));
        }
        if lab.stats()?[counter].as_u64().unwrap_or(0) > above {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{counter} stayed at {above} or below: {}",
            lab.stats()?
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The XDP fast path is opt-in: with the dataplane's defaults every packet goes through
/// userspace, even where both sides' veths take XDP frames (GRO on in the Pod and the
/// client), and its workers run SCHED_FIFO (the tests run as root).
#[test]
fn by_default_every_packet_goes_through_userspace() -> Result<()> {
    let lab = Lab::new("dpu")?;
    for ns in [&lab.pods[0], &lab.pods[1], &lab.client] {
        ns.exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    }
    // The dataplane re-reads which interfaces take XDP frames about once a second.
    std::thread::sleep(Duration::from_millis(1500));
    let (mut conns, _) = lab.connections_on_both_pods(8)?;
    for _ in 0..20 {
        for c in conns.iter_mut() {
            http_get(c)?;
        }
    }
    download_1mib(&lab.client)?;
    let s = lab.fresh_stats()?;
    assert_eq!(s["xdp_fast_packets"].as_u64(), Some(0), "{s}");
    assert_eq!(s["xdp_fast_replies"].as_u64(), Some(0), "{s}");
    assert!(s["rx_packets"].as_u64().unwrap_or(0) > 500, "{s}");
    let log = lab.dataplane_log();
    assert!(
        log.contains("forwarding worker runs SCHED_FIFO"),
        "the worker is not realtime:\n{log}"
    );
    Ok(())
}

/// The steering program forwards packets of established connections itself towards a
/// Pod whose veth takes XDP frames (GRO on in the Pod), never towards one whose veth
/// does not, and stops using a service table as soon as it changes: a removed backend's
/// connections are not served by it any more (as on the userspace path). Replies take
/// it once the client's side takes XDP frames, their partial checksums completed.
#[test]
fn established_flows_take_the_xdp_fast_path_only_where_the_pod_takes_xdp_frames() -> Result<()> {
    let mut lab = Lab::build_with("dpx", 1, false, false, &["--xdp-fast-path"])?;
    lab.pods[0].exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    let (mut conns, on) = lab.connections_on_both_pods(12)?;
    // Requests on pod0's connections until the program's packets show in the stats (the
    // dataplane re-reads which interfaces take XDP frames about once a second).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        for (i, c) in conns.iter_mut().enumerate().filter(|(i, _)| on[*i] == 0) {
            let body = http_get(c).with_context(|| format!("connection {i} on pod0"))?;
            assert_eq!(pod_of(&body), Some(0));
            assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
        }
        if lab.stats()?["xdp_fast_packets"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "no packet took the XDP fast path: {}\n{}",
            lab.stats()?,
            lab.dataplane_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A 1 MiB download over a fresh connection: its ACKs take the fast path.
    download_1mib(&lab.client)?;

    // pod1's veth takes no XDP frames: its connections stay in userspace.
    let before = settled_fast_packets(&lab)?;
    for _ in 0..5 {
        for (i, c) in conns.iter_mut().enumerate().filter(|(i, _)| on[*i] == 1) {
            let body = http_get(c).with_context(|| format!("connection {i} on pod1"))?;
            assert_eq!(pod_of(&body), Some(1));
        }
    }
    assert_eq!(
        settled_fast_packets(&lab)?,
        before,
        "packets towards a Pod whose veth takes no XDP frames took the fast path"
    );
    let s = lab.stats()?;
    let packets_in: u64 = s["services"]
        .as_array()
        .context("services")?
        .iter()
        .filter_map(|x| x["packets_in"].as_u64())
        .sum();
    assert!(
        packets_in >= before,
        "the program's packets are in the service counters: {s}"
    );

    // Now pod1 takes XDP frames too: its connections move to the fast path.
    lab.pods[1].exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    requests_until(
        &lab,
        &mut conns,
        &on,
        |i| on[i] == 1,
        "xdp_fast_packets",
        before,
    )
    .context("pod1's connections never took the XDP fast path")?;

    // The client's side takes XDP frames now (GRO on in its veth): replies, which the
    // Pods send with partial checksums (tx offload on), are reverse-NATed by the
    // program, their checksums completed; the client's stack checks them (its veth gets
    // no checksum offload with XDP frames), so a wrong one would stall the connections.
    let replies =
        |lab: &Lab| -> Result<u64> { Ok(lab.stats()?["xdp_fast_replies"].as_u64().unwrap_or(0)) };
    assert_eq!(
        replies(&lab)?,
        0,
        "no reply can take the fast path while the client's side takes no XDP frames"
    );
    lab.client.exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    requests_until(&lab, &mut conns, &on, |_| true, "xdp_fast_replies", 0)
        .context("no reply took the XDP fast path")?;
    // Full-size segments with partial checksums, completed in the program.
    let before = settled_fast_packets(&lab)?;
    let replies_before = replies(&lab)?;
    download_1mib(&lab.client)?;
    let _ = settled_fast_packets(&lab)?;
    let got = replies(&lab)? - replies_before;
    assert!(
        got >= 500,
        "a 1 MiB download's ~720 segments take the reply fast path: {got} did (fast packets before {before})"
    );

    // Remove pod0: the program must stop forwarding its connections at once and leave
    // them to userspace, which drops them as `backend_removed` (a stale decision would
    // send them to the slot's new owner, pod1's interface, unseen).
    lab.publish(&[1])?;
    for (i, c) in conns.iter_mut().enumerate() {
        if on[i] == 0 {
            c.set_read_timeout(Some(Duration::from_millis(1000)))?;
            let r = http_get(c);
            assert!(
                r.is_err(),
                "connection {i} to the removed backend must not be served: {r:?}"
            );
        } else {
            assert_eq!(pod_of(&http_get(c)?), Some(1), "connection {i} on pod1");
        }
    }
    lab.wait_drops("backend_removed", 1)?;
    drop(conns);
    lab.finish()
}

/// Frames that must not crash the dataplane: all addressed to the node's uplink MAC and
/// the VIP so the steering program hands them to userspace.
fn malformed_corpus(dst_mac: [u8; 6], src_mac: [u8; 6]) -> Vec<Vec<u8>> {
    let ip_hdr = |total: u16, ihl: u8, proto: u8, frag: u16, ttl: u8| {
        let mut h = vec![(4 << 4) | ihl, 0];
        h.extend_from_slice(&total.to_be_bytes());
        h.extend_from_slice(&[0x12, 0x34]);
        h.extend_from_slice(&frag.to_be_bytes());
        h.extend_from_slice(&[ttl, proto, 0, 0]);
        h.extend_from_slice(&CLIENT_IP.octets());
        h.extend_from_slice(&VIP.octets());
        h
    };
    let eth = |payload: &[u8]| {
        let mut f = dst_mac.to_vec();
        f.extend_from_slice(&src_mac);
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(payload);
        f
    };
    // Total length larger than the frame.
    let mut corpus = vec![eth(&ip_hdr(1400, 5, 6, 0, 64))];
    // Total length smaller than the header.
    corpus.push(eth(&[ip_hdr(10, 5, 6, 0, 64), vec![0; 20]].concat()));
    // IHL < 5 and IHL beyond the frame.
    corpus.push(eth(&[ip_hdr(40, 3, 6, 0, 64), vec![0; 20]].concat()));
    corpus.push(eth(&[ip_hdr(40, 15, 6, 0, 64), vec![0; 20]].concat()));
    // TCP header truncated, bad data offset; UDP with a bad length.
    corpus.push(eth(&[ip_hdr(30, 5, 6, 0, 64), vec![0; 10]].concat()));
    let mut tcp = vec![0u8; 20];
    tcp[2..4].copy_from_slice(&80u16.to_be_bytes());
    tcp[12] = 0xf0;
    corpus.push(eth(&[ip_hdr(40, 5, 6, 0, 64), tcp.clone()].concat()));
    tcp[12] = 0x10;
    corpus.push(eth(&[ip_hdr(40, 5, 6, 0, 64), tcp].concat()));
    let mut udp = vec![0u8; 8];
    udp[2..4].copy_from_slice(&53u16.to_be_bytes());
    udp[4..6].copy_from_slice(&200u16.to_be_bytes());
    corpus.push(eth(&[ip_hdr(28, 5, 17, 0, 64), udp.clone()].concat()));
    udp[4..6].copy_from_slice(&3u16.to_be_bytes());
    corpus.push(eth(&[ip_hdr(28, 5, 17, 0, 64), udp].concat()));
    // Wrong IP version in an IPv4 EtherType.
    let mut v6 = ip_hdr(40, 5, 6, 0, 64);
    v6[0] = 0x65;
    corpus.push(eth(&[v6, vec![0; 20]].concat()));
    // Fragments to the VIP: a first one too short for its UDP header (dropped as
    // `fragment`, RFC 1858) and a later one (held for a first fragment that never
    // comes: `fragment_expired`), and a header with options.
    corpus.push(eth(&[ip_hdr(24, 5, 17, 0x2000, 64), vec![0; 4]].concat()));
    corpus.push(eth(&[ip_hdr(48, 5, 17, 0x0010, 64), vec![0; 28]].concat()));
    // Every truncation of a valid-looking TCP SYN.
    let mut syn = ip_hdr(40, 5, 6, 0, 64);
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&40000u16.to_be_bytes());
    t[2..4].copy_from_slice(&80u16.to_be_bytes());
    t[12] = 0x50;
    t[13] = 0x02;
    syn.extend_from_slice(&t);
    let full = eth(&syn);
    for cut in 34..full.len() {
        corpus.push(full[..cut].to_vec());
    }
    corpus
}

#[test]
fn malformed_frames_are_counted_and_never_crash_the_dataplane() -> Result<()> {
    let mut lab = Lab::new("dpm")?;
    let corpus = malformed_corpus(mac_of(&lab.node, "up0")?, mac_of(&lab.client, "eth0")?);
    let n = corpus.len();
    let sent = inject(
        lab.client.name(),
        "eth0",
        (0..5).flat_map(|_| corpus.iter().cloned()).collect(),
    )?;
    assert!(sent >= n, "sent {sent} of {} frames", 5 * n);
    let malformed = lab.wait_drops("malformed", 20)?;
    assert!(
        lab.dataplane.as_mut().unwrap().is_running(),
        "dataplane crashed:\n{}",
        lab.dataplane_log()
    );
    lab.wait_drops("fragment", 2)?;
    // Still forwarding.
    let (body, _) = curl(&lab.client, "http://10.200.0.10/")?;
    assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    let s = lab.stats()?;
    let drops: BTreeMap<String, u64> = serde_json::from_value(s["drops"].clone())?;
    eprintln!("after {sent} malformed frames: malformed={malformed}, drops={drops:?}");
    lab.finish()
}

#[test]
fn every_rx_queue_of_a_multi_queue_uplink_is_served() -> Result<()> {
    let lab = Lab::with_uplink_queues("dpq", 2)?;
    let mut conns = lab.connect_many(24)?;
    for c in conns.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    // The client spreads its flows over both TX queues, so the node's uplink receives
    // on both RX queues: the socket of each queue must have taken frames.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = lab.stats()?;
        let q0 = s["rx_packets_per_socket"]["up0/0"].as_u64().unwrap_or(0);
        let q1 = s["rx_packets_per_socket"]["up0/1"].as_u64().unwrap_or(0);
        if q0 > 0 && q1 > 0 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "both uplink queues' sockets must receive: {}",
            s["rx_packets_per_socket"]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(conns);
    lab.finish()
}

#[test]
fn pods_behind_a_bridge_and_a_new_pod_need_no_restart() -> Result<()> {
    let mut lab = Lab::bridged("dpb")?;
    // Start with pod0 only: pod1 "does not exist yet".
    lab.publish(&[0])?;
    let pod1_ns = lab.pods.pop().context("pod1")?;
    let pod1_backend = lab.backends.pop().context("pod1 backend")?;
    drop(pod1_backend);
    drop(pod1_ns);
    let mut old = lab.connect_many(10)?;
    for c in old.iter_mut() {
        assert_eq!(pod_of(&http_get(c)?), Some(0));
    }
    let pid_before = lab.dataplane.as_ref().map(|c| c.id());

    // A new Pod is created and plugged into the bridge, then becomes a backend.
    let name = format!("{}x", lab.node.name());
    let pod1 = Netns::new(name)?;
    wire_pod(&lab.node, &pod1, 1, true, 1)?;
    lab.backends.push(start_backend(pod1.name(), "pod1")?);
    lab.pods.push(pod1);
    lab.publish(&[0, 1])?;

    let mut seen = HashSet::new();
    let mut fresh = lab.connect_many(30)?;
    for c in fresh.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
        seen.insert(pod_of(&body).context("pod")?);
    }
    assert_eq!(
        seen.len(),
        2,
        "the new Pod gets new connections without a restart"
    );
    for c in old.iter_mut() {
        assert_eq!(
            pod_of(&http_get(c)?),
            Some(0),
            "an existing connection moved"
        );
    }
    assert!(lab.dataplane.as_mut().unwrap().is_running());
    assert_eq!(
        lab.dataplane.as_ref().map(|c| c.id()),
        pid_before,
        "same process"
    );
    drop((old, fresh));
    lab.finish()
}

#[test]
fn stale_neighbour_entries_of_pods_are_kept_alive() -> Result<()> {
    let lab = Lab::new("dpk")?;
    let (body, _) = curl(&lab.client, "http://10.200.0.10/")?;
    let pod = pod_of(&body).context("pod")?;
    let mac = lab.pods[pod].exec(&["cat", "/sys/class/net/eth0/address"])?;
    assert_reprobed(
        &lab.node,
        &pod_ip(pod).to_string(),
        &format!("pv{pod}"),
        mac.trim(),
    )?;
    lab.finish()
}

/// The same for a Pod's IPv6 neighbour entry (neighbour discovery), behind a bridge.
#[test]
fn ipv6_stale_neighbour_entries_of_pods_are_kept_alive() -> Result<()> {
    let lab = Lab::dual_stack("dp6k")?;
    let (body, _) = curl(&lab.client, &format!("http://[{VIP6}]/"))?;
    let pod = pod_of(&body).context("pod")?;
    let mac = lab.pods[pod].exec(&["cat", "/sys/class/net/eth0/address"])?;
    assert_reprobed(&lab.node, &pod_ip6(pod).to_string(), "br0", mac.trim())?;
    lab.finish()
}

/// Ages the node's entry for `ip` on `dev` to STALE by hand (forwarding with AF_XDP
/// never confirms it) and waits for the resolver to have it re-probed (keep-alive every
/// second here): STALE -> DELAY -> PROBE -> REACHABLE after the kernel's first-probe
/// delay (5 s).
fn assert_reprobed(node: &Netns, ip: &str, dev: &str, mac: &str) -> Result<()> {
    node.exec(&[
        "ip", "neigh", "replace", ip, "dev", dev, "lladdr", mac, "nud", "stale",
    ])?;
    let state = || {
        node.exec(&["ip", "neigh", "show", ip, "dev", dev])
            .unwrap_or_default()
    };
    ensure!(state().contains("STALE"), "{}", state());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !state().contains("REACHABLE") {
        ensure!(
            Instant::now() < deadline,
            "neighbour entry {ip} on {dev} not re-probed: {}",
            state()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

#[test]
fn fragmentation_needed_reaches_the_backend_so_path_mtu_discovery_works() -> Result<()> {
    let lab = Lab::new("dpi")?;
    // A UDP exchange through the VIP: the reply left the node as VIP:53 -> client:port.
    let (client_port, reply) = in_ns(lab.client.name(), || -> Result<(u16, String)> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut buf = [0u8; 2048];
        for _ in 0..10 {
            s.send_to(b"hello", (VIP, 53))?;
            if let Ok((n, _)) = s.recv_from(&mut buf) {
                return Ok((
                    s.local_addr()?.port(),
                    String::from_utf8_lossy(&buf[..n]).to_string(),
                ));
            }
        }
        bail!("no UDP reply through the VIP")
    })?;
    let pod = pod_of(&reply).context("which pod answered")?;
    let route = |pod: usize| {
        lab.pods[pod]
            .exec(&["ip", "route", "get", &CLIENT_IP.to_string()])
            .unwrap_or_default()
    };
    assert!(!route(pod).contains("mtu 1280"), "{}", route(pod));

    // A router on the client's path says the reply was too big (MTU 1280). It is sent
    // to the VIP — the reply's source — and must reach the backend, translated.
    let mut quote = vec![0u8; 28];
    quote[0] = 0x45;
    quote[2..4].copy_from_slice(&1428u16.to_be_bytes());
    quote[6] = 0x40; // DF
    quote[8] = 63;
    quote[9] = 17;
    quote[12..16].copy_from_slice(&VIP.octets());
    quote[16..20].copy_from_slice(&CLIENT_IP.octets());
    let c = inet_checksum(&quote[..20]);
    quote[10..12].copy_from_slice(&c.to_be_bytes());
    quote[20..22].copy_from_slice(&53u16.to_be_bytes());
    quote[22..24].copy_from_slice(&client_port.to_be_bytes());
    quote[24..26].copy_from_slice(&1408u16.to_be_bytes());
    let mut icmp = vec![3u8, 4, 0, 0, 0, 0];
    icmp.extend_from_slice(&1280u16.to_be_bytes());
    icmp.extend_from_slice(&quote);
    let c = inet_checksum(&icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    send_raw_ipv4(lab.client.name(), VIP, libc::IPPROTO_ICMP, icmp, 3)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !route(pod).contains("mtu 1280") {
        ensure!(
            Instant::now() < deadline,
            "the backend never learned the path MTU: {}\nstats: {:?}",
            route(pod),
            lab.stats().ok()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    lab.finish()
}

#[test]
fn a_state_file_replaced_by_a_bigger_one_is_followed() -> Result<()> {
    let mut lab = Lab::new("dpg")?;
    // More VIPs than the file's initial capacity: the writer writes a new, bigger file
    // and renames it over the old one while the dataplane has the old one mapped.
    let mut state = node_state(&[0]);
    for i in 0..100u16 {
        state.services.push(NodeService {
            frontend: Frontend {
                vip: Ipv4Addr::new(10, 201, (i / 250) as u8, (i % 250) as u8 + 1),
                protocol: Protocol::Tcp,
                port: 80,
            },
            backends: vec![LocalBackend {
                ip: pod_ip(1),
                port: HTTP_PORT,
            }],
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
            host_network: false,
        });
    }
    let want = state.services.len();
    let before = lab.writer.capacity();
    let g = lab.writer.publish(&state)?;
    ensure!(
        lab.writer.capacity() != before,
        "the state must have outgrown the file ({before:?}) for this test to mean anything"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = lab.stats()?;
        if s["generation"].as_u64().unwrap_or(0) >= g
            && s["services"].as_array().map_or(0, |a| a.len()) == want
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "dataplane did not follow the replaced state file: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut conns = lab.connect_many(10)?;
    for c in conns.iter_mut() {
        assert_eq!(
            pod_of(&http_get(c)?),
            Some(0),
            "the VIP's service now has pod0 only"
        );
    }
    drop(conns);
    lab.finish()
}

#[test]
fn a_backends_port_unreachable_reaches_the_client_from_the_vip() -> Result<()> {
    let lab = Lab::new("dpu")?;
    // A connected UDP socket sees ICMP port unreachable as ECONNREFUSED, and only when
    // the error quotes its own packet (client:port -> VIP:55) and comes for it.
    let refused = in_ns(lab.client.name(), || -> Result<bool> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.connect((VIP, 55))?;
        s.set_read_timeout(Some(Duration::from_millis(700)))?;
        let mut buf = [0u8; 64];
        for _ in 0..8 {
            let _ = s.send(b"anyone?");
            match s.recv(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(true),
                _ => continue,
            }
        }
        Ok(false)
    })?;
    assert!(
        refused,
        "the client never saw port unreachable; stats: {:?}",
        lab.stats().ok()
    );
    lab.finish()
}

/// UMEM accounting from the stats file: every frame is free or held by a live socket.
fn assert_no_frame_leak(s: &serde_json::Value) {
    let total = s["umem_frames"].as_u64().unwrap_or(0);
    let free = s["umem_frames_free"].as_u64().unwrap_or(0);
    let held = s["umem_frames_in_kernel"].as_u64().unwrap_or(0);
    assert!(total > 0, "{s}");
    assert_eq!(free + held, total, "UMEM frames lost or duplicated: {s}");
}

#[test]
fn per_pod_veths_found_through_routes_come_and_go_without_a_restart() -> Result<()> {
    let mut lab = Lab::from_routes("dpr")?;
    let pid_before = lab.dataplane.as_ref().map(|c| c.id());
    let mut old = lab.connect_many(20)?;
    let mut old_pods = Vec::new();
    for c in old.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
        old_pods.push(pod_of(&body).context("pod")?);
    }
    assert!(
        old_pods.contains(&0) && old_pods.contains(&1),
        "{old_pods:?}"
    );

    // A Pod namespace created after the dataplane started, on its own veth pv2.
    add_third_pod_on_its_own_veth(&mut lab)?;

    // pv1 is deleted (the Pod's veth goes away): the dataplane detaches it and keeps
    // serving the other Pods' connections.
    lab.node.exec(&["ip", "link", "del", "pv1"])?;
    lab.wait_pod_ifaces(&["pv0", "pv2"], &["pv1"])?;
    for (c, &p) in old.iter_mut().zip(&old_pods) {
        if p != 1 {
            assert_eq!(
                pod_of(&http_get(c)?),
                Some(p),
                "a connection to pod{p} broke"
            );
        }
    }
    // ... and re-created: pod1 serves again.
    wire_pod(&lab.node, &lab.pods[1], 1, false, 1)?;
    lab.wait_pod_ifaces(&["pv0", "pv1", "pv2"], &[])?;
    let mut seen = HashSet::new();
    for mut c in lab.connect_many(30)? {
        seen.insert(pod_of(&http_get(&mut c)?).context("pod")?);
    }
    assert_eq!(seen.len(), 3, "all three Pods serve: {seen:?}");
    for (c, &p) in old.iter_mut().zip(&old_pods) {
        if p != 1 {
            assert_eq!(pod_of(&http_get(c)?), Some(p));
        }
    }
    let s = lab.stats()?;
    assert!(s["pod_iface_detaches"].as_u64().unwrap_or(0) >= 1, "{s}");
    assert!(s["umem_frames_reclaimed"].as_u64().unwrap_or(0) > 0, "{s}");
    assert_no_frame_leak(&s);
    assert!(lab.dataplane.as_mut().unwrap().is_running());
    assert_eq!(
        lab.dataplane.as_ref().map(|c| c.id()),
        pid_before,
        "same process"
    );
    drop(old);
    lab.finish()
}

#[test]
fn many_pod_veth_attach_detach_cycles_leak_no_frames() -> Result<()> {
    const CYCLES: u64 = 12;
    let mut lab = Lab::from_routes("dpf")?;
    // Only pod1 is a backend: pv0 carries no backend any more and is detached.
    lab.publish(&[1])?;
    let s = lab.wait_pod_ifaces(&["pv1"], &["pv0"])?;
    let attaches0 = s["pod_iface_attaches"].as_u64().unwrap_or(0);
    let detaches0 = s["pod_iface_detaches"].as_u64().unwrap_or(0);
    assert!(lab.udp_ask()?.starts_with("pod1 "));
    for i in 1..=CYCLES {
        lab.node.exec(&["ip", "link", "del", "pv1"])?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while lab.stats()?["pod_iface_detaches"].as_u64().unwrap_or(0) < detaches0 + i {
            ensure!(
                Instant::now() < deadline,
                "cycle {i}: pv1 not detached: {:?}",
                lab.stats().ok()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        wire_pod(&lab.node, &lab.pods[1], 1, false, 1)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while lab.stats()?["pod_iface_attaches"].as_u64().unwrap_or(0) < attaches0 + i {
            ensure!(
                Instant::now() < deadline,
                "cycle {i}: pv1 not re-attached: {:?}",
                lab.stats().ok()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let reply = lab
            .udp_ask()
            .with_context(|| format!("cycle {i}: {}", lab.dataplane_log()))?;
        assert!(reply.starts_with("pod1 "), "cycle {i}: {reply}");
    }
    let s = lab.fresh_stats()?;
    assert_no_frame_leak(&s);
    let reclaimed = s["umem_frames_reclaimed"].as_u64().unwrap_or(0);
    assert!(
        reclaimed >= CYCLES,
        "every closed socket gave its fill ring back: {s}"
    );
    assert!(lab.dataplane.as_mut().unwrap().is_running());
    lab.finish()
}

/// One `GET /` on every connection, each on a thread of its own (answered whenever the
/// path is back): join them to get the connections and answers back.
fn requests_in_flight(conns: &mut Vec<TcpStream>) -> Vec<JoinHandle<(TcpStream, Result<String>)>> {
    conns
        .drain(..)
        .map(|mut c| {
            std::thread::spawn(move || {
                let r = http_get(&mut c);
                (c, r)
            })
        })
        .collect()
}

/// Joins [`requests_in_flight`]: every request was answered, to the client's own
/// address, after the restart; the connections go back into `conns`.
fn answered_after_restart(
    lab: &Lab,
    pending: Vec<JoinHandle<(TcpStream, Result<String>)>>,
    conns: &mut Vec<TcpStream>,
) -> Result<()> {
    for (i, h) in pending.into_iter().enumerate() {
        let (c, r) = h.join().expect("request thread");
        let body = r.with_context(|| {
            format!("connection {i} after the restart:\n{}", lab.dataplane_log())
        })?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
        conns.push(c);
    }
    Ok(())
}

/// TCP segments with `flags` to VIP:80 from pseudo-random sources (see [`TcpFlood`]).
fn flood(dst_mac: [u8; 6], src_mac: [u8; 6], flags: u8, seed: u64) -> TcpFlood {
    TcpFlood {
        dst_mac,
        src_mac,
        dst: VIP,
        dst_port: 80,
        flags,
        seed,
    }
}

/// A one-connection-at-a-time HTTP server in namespace `ns` on `addr`, answering
/// `hello <peer>`; stops with `stop`.
fn tiny_http_server(ns: &str, addr: SocketAddr, stop: Arc<AtomicBool>) -> Result<JoinHandle<()>> {
    let l = in_ns(ns, move || TcpListener::bind(addr))?;
    l.set_nonblocking(true)?;
    Ok(std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut c, peer)) => {
                    let _ = c.set_nonblocking(false);
                    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut buf = [0u8; 1024];
                    let _ = c.read(&mut buf);
                    let body = format!("hello {peer}\n");
                    let _ = c.write_all(
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
                            .as_bytes(),
                    );
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }))
}

/// The kubelet's probes (node -> Pod on the Service's target port), HTTP and a
/// plain TCP connect, and a Pod's own connection out of its serving port all work while
/// the dataplane runs: only packets of flows it holds leave the kernel path.
#[test]
fn node_reaches_local_pods_on_the_target_port_and_pods_connect_out_from_it() -> Result<()> {
    let mut lab = Lab::new("dpk")?;
    // A Service whose target port 7070 nothing in pod0 listens on: pod0 uses it as the
    // source port of its own outbound connection.
    let mut st = node_state(&[0, 1]);
    st.services.push(service(Protocol::Tcp, 8081, 7070, &[0]));
    st.normalize();
    lab.publish_state(&st)?;
    let (body, _) = curl(&lab.client, "http://10.200.0.10/")?;
    assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    // Probes from the node, as the kubelet sends them, several rounds.
    for round in 0..3 {
        for i in 0..2 {
            let (body, _) = curl(&lab.node, &format!("http://{}:{HTTP_PORT}/", pod_ip(i)))
                .with_context(|| {
                    format!(
                        "node -> pod{i} HTTP probe, round {round}:\n{}",
                        lab.dataplane_log()
                    )
                })?;
            assert!(
                body.starts_with(&format!("pod{i} saw 10.100.{}.1:", 2 + i)),
                "{body}"
            );
            let target = SocketAddr::V4(SocketAddrV4::new(pod_ip(i), HTTP_PORT));
            in_ns(lab.node.name(), move || {
                TcpStream::connect_timeout(&target, Duration::from_secs(5))
            })
            .with_context(|| format!("node -> pod{i} TCP connect probe, round {round}"))?;
        }
    }
    // UDP from the node to a Pod's serving port: the answer comes from that port.
    let reply = in_ns(lab.node.name(), || -> Result<String> {
        let s = UdpSocket::bind("10.100.2.1:0")?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.send_to(b"probe", (pod_ip(0), UDP_PORT))?;
        let mut buf = [0u8; 512];
        let (n, from) = s.recv_from(&mut buf)?;
        ensure!(
            from == SocketAddr::V4(SocketAddrV4::new(pod_ip(0), UDP_PORT)),
            "{from}"
        );
        Ok(String::from_utf8_lossy(&buf[..n]).to_string())
    })?;
    assert!(reply.starts_with("pod0 saw 10.100.2.1:"), "{reply}");
    // pod0's own outbound TCP connection from its serving port 7070.
    let stop = Arc::new(AtomicBool::new(false));
    let server = tiny_http_server(lab.node.name(), "10.100.2.1:9099".parse()?, stop.clone())?;
    let out = lab.pods[0].output(&[
        "curl",
        "-sS",
        "-m",
        "10",
        "--local-port",
        "7070",
        "http://10.100.2.1:9099/",
    ])?;
    stop.store(true, Ordering::Relaxed);
    let _ = server.join();
    ensure!(
        out.status.success(),
        "pod0's connection from its serving port failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        lab.dataplane_log()
    );
    let text = String::from_utf8(out.stdout)?;
    assert_eq!(text.trim(), "hello 10.100.2.2:7070");
    // None of it went through the dataplane: no flow beyond the client's, no drop.
    let s = lab.stats()?;
    assert_eq!(lab.drops("no_flow"), 0, "{s}");
    assert!(s["flows"].as_u64().unwrap_or(99) <= 1, "{s}");
    lab.finish()
}

/// Host-network backends (an ingress controller on the node's own address): the
/// steering program passes the frontend's packets to the kernel, whose DNAT — the
/// dataplane's nftables table — delivers them to the node's server with the client's
/// address, and whose conntrack answers from the VIP; the Pods' frontends go on through
/// userspace; the table goes when the last host-network frontend does.
#[test]
fn host_network_backends_get_the_clients_connections_through_the_kernel() -> Result<()> {
    require("nft", &["--version"])?;
    let mut lab = Lab::new("dph")?;
    let stop = Arc::new(AtomicBool::new(false));
    let server = tiny_http_server(
        lab.node.name(),
        SocketAddr::V4(SocketAddrV4::new(NODE_IP, 9098)),
        stop.clone(),
    )?;
    let mut st = node_state(&[0, 1]);
    let mut host = service(Protocol::Tcp, 8082, 9098, &[]);
    host.backends = vec![LocalBackend {
        ip: NODE_IP,
        port: 9098,
    }];
    host.host_network = true;
    st.services.push(host);
    st.normalize();
    lab.publish_state(&st)?;
    for _ in 0..5 {
        let (body, _) = curl(&lab.client, &format!("http://{VIP}:8082/"))
            .with_context(|| lab.dataplane_log())?;
        ensure!(
            body.starts_with(&format!("hello {CLIENT_IP}:")),
            "the node's server saw {body:?}"
        );
    }
    let (body, _) = curl(&lab.client, &format!("http://{VIP}/"))?;
    ensure!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    let rules = lab
        .node
        .exec(&["nft", "list", "table", "ip", "juneau_host_network"])?;
    ensure!(rules.contains("8082 : 10.100.1.1 . 9098"), "{rules}");
    // None of it reached userspace: one flow (the Pod frontend's), no kernel-bound drop.
    let s = lab.fresh_stats()?;
    ensure!(s["flows"].as_u64() == Some(1), "{s}");
    ensure!(lab.drops("kernel_bound") == 0, "{s}");
    // Without host-network frontends the table goes.
    lab.publish_state(&node_state(&[0, 1]))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while lab
        .node
        .exec(&["nft", "list", "table", "ip", "juneau_host_network"])
        .is_ok()
    {
        ensure!(
            Instant::now() < deadline,
            "the host-network table outlived its last frontend"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = server.join();
    lab.finish()
}

/// `kill -9` of the dataplane and a new start under open TCP connections
/// through the VIP: every connection carries on (0 resets), requests sent while it was
/// down are retransmitted by TCP and answered once it is back, and the node's own
/// traffic to its Pods is never interrupted.
#[test]
fn established_connections_survive_kill_9_and_a_restart() -> Result<()> {
    let mut lab = Lab::new("dpr")?;
    // As on a Kubernetes node, the kernel forwards, and the client can reach the world:
    // a Pod's packet handed to the kernel un-NATed would reach the client, whose kernel
    // would answer with a RST that reaches the Pod.
    lab.node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
    lab.client
        .exec(&["ip", "route", "add", "default", "via", "10.100.1.1"])?;
    let mut conns = lab.connect_many(8)?;
    for c in conns.iter_mut() {
        c.set_read_timeout(Some(Duration::from_secs(40)))?;
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    let mut big = lab.connect_many(1)?.remove(0);
    big.set_read_timeout(Some(Duration::from_secs(40)))?;
    for round in 0..2 {
        // A 1 MiB response the client does not read yet: the Pod fills the window and
        // keeps sending (window probes) while the dataplane is down. Were those handed
        // to the kernel un-NATed, the client's kernel would answer with a RST that
        // kills the Pod's side of the connection.
        big.write_all(b"GET /big HTTP/1.1\r\nHost: vip\r\n\r\n")?;
        std::thread::sleep(Duration::from_millis(300));
        lab.kill9();
        // While it is down the pinned program still passes what is not Juneau's.
        let (body, _) = curl(&lab.node, &format!("http://{}:{HTTP_PORT}/", pod_ip(0)))
            .context("node -> Pod while the dataplane is down")?;
        assert!(body.starts_with("pod0 saw 10.100.2.1:"), "{body}");
        // Requests sent while it is down: TCP retransmits them.
        let pending = requests_in_flight(&mut conns);
        std::thread::sleep(Duration::from_millis(500));
        let t0 = Instant::now();
        lab.start()?;
        eprintln!(
            "round {round}: dataplane serving again {:?} after start",
            t0.elapsed()
        );
        let s = lab.stats()?;
        assert!(
            s["flows_restored"].as_u64().unwrap_or(0) >= 8,
            "{s}\n{}",
            lab.dataplane_log()
        );
        answered_after_restart(&lab, pending, &mut conns)?;
        // What reached the node while no socket was there is counted, not lost unnamed
        // (the steering program's pinned counters outlive the process).
        ensure!(
            lab.drops("no_socket") > 0,
            "round {round}: nothing counted as no_socket: {}",
            lab.stats()?
        );
        let body = read_response(&mut big)
            .with_context(|| format!("1 MiB response across the restart, round {round}"))?;
        assert_eq!(body.len(), 1 << 20);
        // And they keep going; new connections work too.
        for c in conns.iter_mut() {
            http_get(c)?;
        }
        let mut fresh = lab.connect_many(2)?;
        for c in fresh.iter_mut() {
            http_get(c)?;
        }
    }
    assert!(
        lab.dataplane_log().contains("flow table found again"),
        "{}",
        lab.dataplane_log()
    );
    drop(conns);
    drop(big);
    // A pinned table of another layout version is never read: replaced, with the
    // reason in the log, and the dataplane serves.
    lab.kill9();
    let meta = lab.bpffs.pin_dir().join("flow_meta");
    let mut value: Vec<String> = vec!["0".into(); 64];
    for (i, b) in 0x4a55_4e45_4155_4654u64.to_le_bytes().iter().enumerate() {
        value[i] = b.to_string();
    }
    value[8] = "99".into();
    let mut argv = vec!["map", "update", "pinned", meta.to_str().unwrap()];
    argv.extend(["key", "0", "0", "0", "0", "value"]);
    argv.extend(value.iter().map(String::as_str));
    run("bpftool", &argv)?;
    lab.start()?;
    let log = lab.dataplane_log();
    assert!(
        log.contains("pinned flow table has layout version 99")
            && log.contains("replaced by fresh ones"),
        "{log}"
    );
    let mut c = lab.connect_many(1)?;
    http_get(&mut c[0])?;
    drop(c);
    // Uninstall: stop it, remove the pins; the program leaves the interfaces (the
    // namespaces are still there).
    lab.kill9();
    let pin = lab.bpffs.pin_dir();
    let bin = env!("CARGO_BIN_EXE_juneau-dataplane");
    let out = std::process::Command::new(bin)
        .args(["--remove-pins", "--pin-dir", pin.to_str().unwrap()])
        .output()?;
    ensure!(
        out.status.success(),
        "--remove-pins: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(!pin.exists(), "{} still there", pin.display());
    // The kernel frees an unpinned link from a workqueue: within moments, not
    // necessarily before `--remove-pins` returns.
    let deadline = Instant::now() + Duration::from_secs(5);
    for ifname in ["up0", "pv0", "pv1"] {
        loop {
            let show = lab.node.exec(&["ip", "-d", "link", "show", ifname])?;
            if !show.contains("prog/xdp") {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "XDP still on {ifname} 5 s after --remove-pins: {show}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let (body, _) = curl(&lab.node, &format!("http://{}:{HTTP_PORT}/", pod_ip(0)))?;
    assert!(body.starts_with("pod0 saw"), "{body}");
    lab.finish()
}

/// An upgrade's handover: a second dataplane started while the first runs (the new node
/// Pod beside the old one) waits on its succession lock and touches nothing — the
/// first keeps forwarding; once the first stops (SIGTERM, as the kubelet stops the old
/// Pod) the second takes over, and the open connections carry on through it.
#[test]
fn a_successor_waits_for_the_running_dataplane_then_carries_its_connections() -> Result<()> {
    let mut lab = Lab::new("dph")?;
    let mut conns = lab.connect_many(4)?;
    for c in conns.iter_mut() {
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        http_get(c)?;
    }
    let successor_log = lab.log.with_file_name("successor.log");
    let argv: Vec<&str> = lab.argv.iter().map(String::as_str).collect();
    let mut successor = lab.node.spawn_logged(&argv, &successor_log)?;
    let log = || std::fs::read_to_string(&successor_log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !log().contains("waiting for it to exit") {
        ensure!(successor.is_running(), "the successor exited:\n{}", log());
        ensure!(
            Instant::now() < deadline,
            "the successor never waited:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Waiting: the first still serves every connection, and new ones.
    for _ in 0..3 {
        for c in conns.iter_mut() {
            http_get(c)?;
        }
    }
    for c in lab.connect_many(2)?.iter_mut() {
        http_get(c)?;
    }
    ensure!(successor.is_running(), "{}", log());
    ensure!(!log().contains("taking over"), "{}", log());
    // The first stops; the second takes over with its flows.
    let mut first = lab.dataplane.take().context("the first dataplane")?;
    first.signal(15);
    let deadline = Instant::now() + Duration::from_secs(20);
    while first.is_running() {
        ensure!(
            Instant::now() < deadline,
            "the first did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = std::fs::remove_file(&lab.stats);
    lab.dataplane = Some(successor);
    lab.wait_ready()?;
    let taken = log();
    ensure!(
        taken.contains("taking over") && taken.contains("flow table found again"),
        "{taken}"
    );
    for c in conns.iter_mut() {
        let body = http_get(c).with_context(|| format!("after the handover:\n{}", log()))?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    let mut fresh = lab.connect_many(2)?;
    for c in fresh.iter_mut() {
        http_get(c)?;
    }
    lab.finish()
}

/// New-flow admission: SYNs from one /24 beyond `--new-flow-prefix-rate` are dropped by
/// the steering program (`new_flow_prefix_rate_limited`) before they reach userspace, so
/// they create no flow, while clients of another /24 open connections as usual and the
/// established ones carry on.
#[test]
fn new_flows_from_one_prefix_beyond_its_rate_are_dropped_before_userspace() -> Result<()> {
    let lab = Lab::build_with(
        "dpa",
        1,
        false,
        false,
        &[
            "--new-flow-prefix-rate",
            "200",
            "--new-flow-prefix-burst",
            "200",
        ],
    )?;
    let dst = mac_of(&lab.node, "up0")?;
    let src = mac_of(&lab.client, "eth0")?;
    let mut est = lab.connect_many(2)?;
    for c in est.iter_mut() {
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        http_get(c)?;
    }
    let t = Instant::now();
    let sent = inject(
        lab.client.name(),
        "eth0",
        flood(dst, src, 0x02, 5).frames_from([203, 0, 113], 20_000),
    )?;
    let secs = t.elapsed().as_secs_f64();
    let limited = lab.wait_drops("new_flow_prefix_rate_limited", 15_000)?;
    let s = lab.fresh_stats()?;
    // The workers' own drops (every reason) are on the Service's counters: the bulk was
    // dropped by the steering program (the workers debit the buckets it reads, and drop
    // only what was queued when the bucket emptied).
    let in_userspace: u64 = s["services"]
        .as_array()
        .context("services")?
        .iter()
        .filter_map(|v| v["drops"].as_u64())
        .sum();
    ensure!(
        limited.saturating_sub(in_userspace) >= 15_000,
        "{limited} limited, {in_userspace} of them (at most) in userspace: {s}"
    );
    // What passed: at most the burst and the rate over the injection (and the 2).
    let admitted_max = 2 + 200 + (200.0 * (secs + 2.0)) as u64;
    let flows = s["flows"].as_u64().unwrap_or(u64::MAX);
    ensure!(flows <= admitted_max, "{flows} flows > {admitted_max}: {s}");
    // The kernel's own receive drops of each served interface are reported beside.
    for iface in ["up0", "pv0", "pv1"] {
        ensure!(
            s["interface_rx_dropped"][iface].as_u64().is_some(),
            "no interface_rx_dropped for {iface}: {s}"
        );
    }
    for c in est.iter_mut() {
        http_get(c).context("established connection after the flood")?;
    }
    for i in 0..4 {
        let mut c = lab
            .connect_many(1)
            .with_context(|| format!("new connection {i} from another /24"))?;
        let body = http_get(&mut c[0]).with_context(|| format!("new connection {i}"))?;
        ensure!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    eprintln!(
        "SYNs from one /24: {sent} sent in {secs:.2} s, {limited} limited ({in_userspace} at most in userspace), {flows} flows"
    );
    lab.finish()
}

/// `loadBalancerSourceRanges`: with ranges admitting client address A, A's connections
/// open while B's SYNs are dropped by the steering program (`source_range_denied`) and
/// cost no flow, also across a `kill -9` and restart. Ranges changed to admit only B:
/// B connects, A's established connection
/// gets no more answers (its flow ended), the UDP frontend without ranges still serves
/// A. Without ranges A connects again.
#[test]
fn source_ranges_admit_only_their_clients_and_follow_updates() -> Result<()> {
    let mut lab = Lab::new("dpr")?;
    let (a, b) = (Ipv4Addr::new(10, 100, 1, 20), Ipv4Addr::new(10, 100, 1, 30));
    for x in [a, b] {
        lab.client.addr("eth0", &format!("{x}/24"))?;
    }
    let with = |tcp_ranges: &[&str]| {
        let mut s = node_state(&[0, 1]);
        let tcp = &mut s.services[0];
        tcp.source_ranges = tcp_ranges.iter().map(|r| r.parse().unwrap()).collect();
        s
    };
    let refused = |lab: &Lab, from: Ipv4Addr| -> Result<()> {
        in_ns(lab.client.name(), move || -> Result<()> {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            s.bind(&SocketAddr::V4(SocketAddrV4::new(from, 0)).into())?;
            let vip = SocketAddr::V4(SocketAddrV4::new(VIP, 80));
            ensure!(
                s.connect_timeout(&vip.into(), Duration::from_millis(1500))
                    .is_err(),
                "{from} connected through ranges that do not admit it"
            );
            Ok(())
        })
    };
    lab.publish_state(&with(&["10.100.1.20/32", "192.0.2.0/24"]))?;
    let mut ca = lab.connect_from(&[a])?;
    ensure!(http_get(&mut ca[0])?.contains(&format!("saw {a}:")));
    refused(&lab, b)?;
    let denied = lab.wait_drops("source_range_denied", 1)?;
    let st = lab.fresh_stats()?;
    ensure!(st["flows"] == 1, "{st}");
    // Dropped by the steering program: userspace (which counts a drop on the Service's
    // counters too) never saw B's SYNs; its only drops there are A's first SYNs, while
    // the node resolved the Pod's MAC.
    let tcp = st["services"]
        .as_array()
        .and_then(|v| v.iter().find(|s| s["protocol"] == "TCP"))
        .context("the TCP service's counters")?;
    ensure!(tcp["drops"] == st["drops"]["no_neighbour"], "{st}");

    // A restarted dataplane finds the pinned ranges (and removes A's below): B is still
    // refused meanwhile.
    lab.kill9();
    lab.start()?;
    refused(&lab, b)?;

    lab.publish_state(&with(&["10.100.1.30/32"]))?;
    let mut cb = lab.connect_from(&[b])?;
    ensure!(http_get(&mut cb[0])?.contains(&format!("saw {b}:")));
    ca[0].set_read_timeout(Some(Duration::from_millis(1500)))?;
    ensure!(
        http_get(&mut ca[0]).is_err(),
        "A's connection was still answered after the ranges left A out"
    );
    ensure!(lab.udp_ask()?.contains("saw "), "UDP has no ranges");

    lab.publish_state(&with(&[]))?;
    let mut again = lab.connect_from(&[a])?;
    ensure!(http_get(&mut again[0])?.contains(&format!("saw {a}:")));
    eprintln!("source ranges: {denied} packets of B dropped before userspace");
    lab.finish()
}

/// `sessionAffinity: ClientIP` through the real binary: 24 connections of one client all
/// reach one Pod (without it they spread over both: `connections_spread_...`).
#[test]
fn client_ip_affinity_sends_a_clients_connections_to_one_pod() -> Result<()> {
    let mut lab = Lab::new("dpy")?;
    let mut s = node_state(&[0, 1]);
    s.services[0].client_ip_affinity = Some(60);
    lab.publish_state(&s)?;
    let mut conns = lab.connect_many(24)?;
    let mut pods = std::collections::BTreeSet::new();
    for c in conns.iter_mut() {
        pods.insert(pod_of(&http_get(c)?).context("pod")?);
    }
    ensure!(pods.len() == 1, "one client reached Pods {pods:?}");
    lab.finish()
}

/// The same over IPv6 (issue #28), through the real binary: a client whose entry put it
/// on the Pod the hash does not give it stays there when the other Pod arrives, and goes
/// back to the hash once `timeoutSeconds` (5 s) passed without a new connection.
#[test]
fn ipv6_client_ip_affinity_keeps_a_clients_pod_when_another_arrives() -> Result<()> {
    const TIMEOUT_S: u32 = 5;
    let mut lab = Lab::dual_stack("dp6a")?;
    let state = |pods: &[usize]| {
        let mut s = dual_stack_state(pods);
        s.services6[0].client_ip_affinity = Some(TIMEOUT_S);
        s
    };
    let pod_of6 = |lab: &Lab| -> Result<usize> {
        let mut c = connect6(lab, 1)?;
        let body = http_get(&mut c[0])?;
        ensure!(body.contains(&format!("saw [{CLIENT_IP6}]:")), "{body}");
        pod_of(&body).context("pod")
    };
    let expire = || std::thread::sleep(Duration::from_millis(u64::from(TIMEOUT_S) * 1000 + 500));
    lab.publish_state(&state(&[0, 1]))?;
    let hashed = pod_of6(&lab)?;
    expire();
    let other = 1 - hashed;
    lab.publish_state(&state(&[other]))?;
    ensure!(pod_of6(&lab)? == other);
    lab.publish_state(&state(&[0, 1]))?;
    for i in 0..24 {
        let p = pod_of6(&lab)?;
        ensure!(
            p == other,
            "connection {i} went to Pod {p}, the hash's, not the client's Pod {other}"
        );
    }
    expire();
    ensure!(pod_of6(&lab)? == hashed, "after the timeout, the hash");
    lab.finish()
}

/// Unsolicited TCP segments create no flow; a SYN flood (bounded: 20 000
/// SYNs) against a small half-open budget evicts only half-open flows, oldest first,
/// while established connections keep exchanging data and new connections succeed.
#[test]
fn ack_flood_creates_no_flow_and_a_syn_flood_spares_established_connections() -> Result<()> {
    const BUDGET: u64 = 512;
    let lab = Lab::build_with("dpf", 1, false, false, &["--half-open-max", "512"])?;
    let dst = mac_of(&lab.node, "up0")?;
    let src = mac_of(&lab.client, "eth0")?;
    let mut est = lab.connect_many(4)?;
    for c in est.iter_mut() {
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        http_get(c)?;
    }
    let flows_before = lab.fresh_stats()?["flows"].as_u64().unwrap_or(0);
    assert_eq!(flows_before, 4, "{}", lab.stats()?);
    // ACK flood.
    let t = Instant::now();
    let sent = inject(
        lab.client.name(),
        "eth0",
        flood(dst, src, 0x10, 7).frames(20_000),
    )?;
    let ack_secs = t.elapsed().as_secs_f64();
    let dropped = lab.wait_drops("non_syn_without_flow", 1000)?;
    let s = lab.fresh_stats()?;
    let dropped = lab.drops("non_syn_without_flow").max(dropped);
    assert_eq!(
        s["flows"].as_u64(),
        Some(flows_before),
        "ACKs created flows: {s}"
    );
    eprintln!(
        "ACK flood: {sent} sent in {ack_secs:.2} s ({:.0}/s), {dropped} dropped as non_syn_without_flow, flows {flows_before} -> {}",
        sent as f64 / ack_secs,
        s["flows"]
    );
    // SYN flood while the established connections keep talking.
    let stop = Arc::new(AtomicBool::new(false));
    let talker = {
        let stop = stop.clone();
        std::thread::spawn(move || -> Result<(Vec<TcpStream>, usize)> {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                for c in est.iter_mut() {
                    let body =
                        http_get(c).context("established connection during the SYN flood")?;
                    ensure!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok((est, n))
        })
    };
    let t = Instant::now();
    let mut syn_sent = 0;
    let mut new_ok = 0;
    for part in 0..4u64 {
        syn_sent += inject(
            lab.client.name(),
            "eth0",
            flood(dst, src, 0x02, 100 + part).frames(5_000),
        )?;
        // A legitimate new connection in the middle of the flood.
        let mut c = lab.connect_many(1)?;
        http_get(&mut c[0]).context("new connection during the SYN flood")?;
        new_ok += 1;
    }
    let syn_secs = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (mut est, talked) = talker.join().expect("talker")?;
    for c in est.iter_mut() {
        http_get(c)?;
    }
    let s = lab.fresh_stats()?;
    let half_open = s["half_open_flows"].as_u64().unwrap_or(u64::MAX);
    let evicted = s["half_open_evicted"].as_u64().unwrap_or(0);
    assert!(half_open <= BUDGET, "{s}");
    assert!(
        evicted > 0,
        "the flood never reached the half-open budget: {s}"
    );
    assert!(talked > 0);
    eprintln!(
        "SYN flood: {syn_sent} sent in {syn_secs:.2} s ({:.0}/s); half-open held {half_open} (budget {BUDGET}), evicted {evicted}; {talked} requests on 4 established connections and {new_ok} new connections, all answered; flows {}; xsk_rx_ring_full {}",
        syn_sent as f64 / syn_secs,
        s["flows"],
        s["xsk_rx_ring_full"]
    );
    lab.finish()
}

/// A flood of new UDP flows (one datagram per source address and port, more
/// than the table holds) fills the flow table; an established connection keeps
/// working and new connections still get a flow: the flood displaces its own oldest
/// flows instead of making new SYNs `flow_table_full`.
#[test]
fn a_udp_flood_filling_the_flow_table_leaves_room_for_new_connections() -> Result<()> {
    let lab = Lab::build_with("dpu", 1, false, false, &[])?;
    let dst = mac_of(&lab.node, "up0")?;
    let src = mac_of(&lab.client, "eth0")?;
    let mut est = lab.connect_many(1)?;
    http_get(&mut est[0])?;
    // The lab's table holds 65 536 flows: 90 000 new UDP flows overflow it.
    let t = Instant::now();
    let sent = inject(
        lab.client.name(),
        "eth0",
        udp_flood(dst, src, VIP, 53, 11, 90_000),
    )?;
    let secs = t.elapsed().as_secs_f64();
    let s = lab.fresh_stats()?;
    let flows = s["flows"].as_u64().unwrap_or(0);
    let capacity = s["flow_capacity"].as_u64().unwrap_or(0);
    let evicted = s["idle_evicted"].as_u64().unwrap_or(0);
    ensure!(
        flows + 1000 >= capacity,
        "the flood did not fill the table: {s}"
    );
    // Both the established connection and new ones work.
    http_get(&mut est[0]).context("established connection after the UDP flood")?;
    for i in 0..4 {
        let mut c = lab
            .connect_many(1)
            .with_context(|| format!("new connection {i}"))?;
        let body = http_get(&mut c[0]).with_context(|| format!("new connection {i}"))?;
        ensure!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    assert_eq!(lab.drops("flow_table_full"), 0, "{}", lab.stats()?);
    assert!(evicted > 0, "{s}");
    eprintln!(
        "UDP flood: {sent} new flows sent in {secs:.2} s ({:.0}/s); flows {flows} of {capacity}, {evicted} displaced; the established and 4 new connections answered",
        sent as f64 / secs
    );
    lab.finish()
}

/// Pods `ready` take new flows; Pods `draining` are `serving` but `terminating`.
fn drain_state(ready: &[usize], draining: &[usize]) -> NodeState {
    let mut st = node_state(ready);
    for s in &mut st.services {
        let port = s.backends.first().map(|b| b.port).unwrap_or(
            match (s.frontend.protocol, s.frontend.port) {
                (Protocol::Tcp, _) => HTTP_PORT,
                (_, 53) => UDP_PORT,
                _ => CLOSED_PORT,
            },
        );
        s.terminating = draining
            .iter()
            .map(|&i| LocalBackend {
                ip: pod_ip(i),
                port,
            })
            .collect();
    }
    st
}

/// Graceful drain: pod1 turns `serving` + `terminating` while connections (one in the
/// middle of a 1 MiB response) run through it. They all complete; every new connection
/// goes to pod0; a node with only draining backends still forwards the flows it has but
/// accepts no new one; when the endpoint disappears its flows end.
#[test]
fn a_terminating_backend_finishes_its_connections_and_gets_no_new_ones() -> Result<()> {
    let mut lab = Lab::new("dpd")?;
    let mut conns = lab.connect_many(20)?;
    let mut on: Vec<usize> = Vec::new();
    for c in conns.iter_mut() {
        on.push(pod_of(&http_get(c)?).context("pod")?);
    }
    let long = on
        .iter()
        .position(|p| *p == 1)
        .context("no connection on pod1")?;
    // A long response in flight on one pod1 connection: read only its start now.
    conns[long].write_all(b"GET /big HTTP/1.1\r\nHost: vip\r\n\r\n")?;
    let mut first = [0u8; 4096];
    let n = conns[long].read(&mut first)?;
    ensure!(n > 0, "no start of the long response");

    // pod1 starts terminating.
    lab.publish_state(&drain_state(&[0], &[1]))?;
    let svc = &lab.stats()?["services"][0];
    assert_eq!(
        (svc["backends"].as_u64(), svc["draining_backends"].as_u64()),
        (Some(1), Some(1)),
        "{svc}"
    );
    // The long response completes: 1 MiB body after the headers.
    let mut got = first[..n].to_vec();
    let mut chunk = vec![0u8; 65536];
    let body_start = loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = conns[long].read(&mut chunk)?;
        ensure!(n > 0, "long connection closed in its headers");
        got.extend_from_slice(&chunk[..n]);
    };
    while got.len() - body_start < 1 << 20 {
        let n = conns[long]
            .read(&mut chunk)
            .context("the long response to a terminating backend was cut")?;
        ensure!(n > 0, "long connection closed after {} bytes", got.len());
        got.extend_from_slice(&chunk[..n]);
    }
    // Every existing connection keeps working, on the backend it had.
    for (i, c) in conns.iter_mut().enumerate() {
        let body = http_get(c)
            .with_context(|| format!("connection {i} (pod{}) broke while draining", on[i]))?;
        assert_eq!(pod_of(&body), Some(on[i]), "connection {i} moved");
    }
    // New connections: pod0 only.
    let mut fresh = lab.connect_many(20)?;
    for c in fresh.iter_mut() {
        assert_eq!(pod_of(&http_get(c)?), Some(0), "a new flow went to pod1");
    }

    // Only draining backends left: flows continue, nothing new is accepted.
    lab.publish_state(&drain_state(&[], &[0, 1]))?;
    for (i, c) in conns.iter_mut().enumerate() {
        let body = http_get(c).with_context(|| format!("connection {i} broke"))?;
        assert_eq!(pod_of(&body), Some(on[i]));
    }
    let refused = in_ns(lab.client.name(), || {
        TcpStream::connect_timeout(
            &SocketAddr::V4(SocketAddrV4::new(VIP, 80)),
            Duration::from_secs(2),
        )
        .map(|_| ())
    });
    assert!(
        refused.is_err(),
        "a new connection was accepted with no Ready backend"
    );

    // pod1's endpoint disappears: its flows end; pod0's keep draining.
    lab.publish_state(&drain_state(&[], &[0]))?;
    for (i, c) in conns.iter_mut().enumerate() {
        if on[i] == 0 {
            assert_eq!(pod_of(&http_get(c)?), Some(0));
        } else {
            c.set_read_timeout(Some(Duration::from_millis(1500)))?;
            assert!(
                http_get(c).is_err(),
                "connection {i} to a gone endpoint served"
            );
        }
    }
    lab.wait_drops("backend_removed", 1)?;
    drop((conns, fresh));
    lab.finish()
}

/// Per-worker figures from the stats file: `(rx_packets, flows)` of each worker.
fn per_worker(s: &serde_json::Value) -> Vec<(u64, u64)> {
    s["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .map(|w| {
                    (
                        w["rx_packets"].as_u64().unwrap_or(0),
                        w["flows"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Two workers with the XDP fast path (both Pods' veths take XDP frames): each worker
/// publishes its own part, and the program forwards the flows of both workers' tables
/// through them; a kill -9 and a restart lose no connection (the program keeps
/// forwarding established flows while the process is down; the new process turns the
/// parts off until its workers republish them).
#[test]
fn two_workers_each_publish_their_fast_path_part_and_survive_a_restart() -> Result<()> {
    let mut lab = Lab::with_workers("dpf", 2, &["--xdp-fast-path"])?;
    for p in &lab.pods {
        p.exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    }
    let mut conns = lab.connect_many(16)?;
    let fast_per_worker = |s: &serde_json::Value| -> Vec<u64> {
        s["workers"]
            .as_array()
            .map(|ws| {
                ws.iter()
                    .map(|w| w["xdp_fast_packets"].as_u64().unwrap_or(0))
                    .collect()
            })
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for c in conns.iter_mut() {
            c.set_read_timeout(Some(Duration::from_secs(20)))?;
            let body = http_get(c)?;
            assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
        }
        let s = lab.stats()?;
        let fast = fast_per_worker(&s);
        if fast.len() == 2 && fast.iter().all(|n| *n > 0) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "both workers' flows must take the fast path: {s}\n{}",
            lab.dataplane_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    lab.kill9();
    let pending = requests_in_flight(&mut conns);
    std::thread::sleep(Duration::from_millis(300));
    lab.start()?;
    answered_after_restart(&lab, pending, &mut conns)?;
    for c in conns.iter_mut() {
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    drop(conns);
    lab.finish()
}

/// Two forwarding workers (`--workers 2`) over 2-queue veths on the uplink and both Pod
/// sides. The client's connections spread over both uplink queues (the sender's TX
/// queue, picked by its flow hash, is the veth receiver's RX queue), and each Pod's
/// replies over both queues of its veth independently, so many connections have their
/// two directions on different workers: replies must be found in the other worker's
/// table (counted as `cross_worker_lookups`). Then: no flow from spoofed ACKs, and the
/// connections survive `kill -9` and a restart with the same worker count.
#[test]
fn two_workers_share_connections_across_queues_and_survive_a_restart() -> Result<()> {
    let mut lab = Lab::with_workers("dpw", 2, &[])?;
    let mut conns = lab.connect_many(32)?;
    for c in conns.iter_mut() {
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        let body = http_get(c)?;
        assert!(body.contains(&format!("saw {CLIENT_IP}:")), "{body}");
    }
    // The stats file is rewritten about once a second (merged from both workers).
    let deadline = Instant::now() + Duration::from_secs(10);
    let s = loop {
        let s = lab.stats()?;
        let w = per_worker(&s);
        if w.len() == 2 && w.iter().all(|(rx, flows)| *rx > 0 && *flows > 0) && s["flows"] == 32 {
            break s;
        }
        ensure!(
            Instant::now() < deadline,
            "both workers must receive and own flows: {s}\n{}",
            lab.dataplane_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let cross = s["cross_worker_lookups"].as_u64().unwrap_or(0);
    assert!(cross > 0, "no reply was found across workers: {s}");
    eprintln!(
        "2 workers: per worker (rx, flows) {:?}, cross-worker look-ups {cross}, sockets {}",
        per_worker(&s),
        s["rx_packets_per_socket"]
    );
    // Spoofed ACKs (on both uplink queues: their source ports vary) create no flow.
    let dst = mac_of(&lab.node, "up0")?;
    let src = mac_of(&lab.client, "eth0")?;
    inject(
        lab.client.name(),
        "eth0",
        flood(dst, src, 0x10, 11).frames(4_000),
    )?;
    lab.wait_drops("non_syn_without_flow", 500)?;
    let s = lab.fresh_stats()?;
    assert_eq!(s["flows"].as_u64(), Some(32), "ACKs created flows: {s}");
    // kill -9 and a restart with the same workers: every connection carries on.
    lab.kill9();
    let pending = requests_in_flight(&mut conns);
    std::thread::sleep(Duration::from_millis(300));
    lab.start()?;
    answered_after_restart(&lab, pending, &mut conns)?;
    let s = lab.stats()?;
    assert!(s["flows_restored"].as_u64().unwrap_or(0) >= 32, "{s}");
    for c in conns.iter_mut() {
        http_get(c)?;
    }
    drop(conns);
    // Another worker count: the pinned tables are not reused (logged), new connections
    // are served.
    lab.kill9();
    let at = lab
        .argv
        .iter()
        .position(|a| a == "--workers")
        .expect("--workers")
        + 1;
    lab.argv[at] = "1".into();
    lab.start()?;
    let log = lab.dataplane_log();
    assert!(
        log.contains("replaced by fresh ones") && log.contains("--workers"),
        "{log}"
    );
    let mut c = lab.connect_many(2)?;
    for c in c.iter_mut() {
        http_get(c)?;
    }
    let s = lab.stats()?;
    assert_eq!(s["flows_restored"].as_u64(), Some(0), "{s}");
    drop(c);
    lab.finish()
}

/// Two workers, 32 clients with one connection each. A client's replies reach whichever
/// worker the Pod's flow hash picks, half the time not the flow's owner; that worker
/// handles the first ones (the handshake) in userspace and resolves the client in its own
/// part of the fast path only. The program uses that part's reply-egress entry for the
/// owner's flows too, so once the connections are established every reply takes the
/// fast path and userspace finds replies across workers only when a worker re-resolves a
/// client (before, such a flow's replies all went through the other worker's userspace,
/// ~half of them here).
#[test]
fn two_workers_fast_path_replies_whichever_worker_resolved_the_client() -> Result<()> {
    let lab = Lab::with_workers("dpe", 2, &["--xdp-fast-path"])?;
    for p in &lab.pods {
        p.exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    }
    lab.client.exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    let clients: Vec<Ipv4Addr> = (10..42).map(|i| Ipv4Addr::new(10, 100, 1, i)).collect();
    for a in &clients {
        lab.client.addr("eth0", &format!("{a}/24"))?;
    }
    let mut conns = lab.connect_from(&clients)?;
    let round = |conns: &mut Vec<TcpStream>| -> Result<()> {
        for (c, a) in conns.iter_mut().zip(&clients) {
            let body = http_get(c)?;
            ensure!(body.contains(&format!("saw {a}:")), "{body}");
        }
        Ok(())
    };
    for _ in 0..3 {
        round(&mut conns)?;
    }
    settled_fast_packets(&lab)?;
    let before = lab.stats()?;
    const ROUNDS: u64 = 10;
    for _ in 0..ROUNDS {
        round(&mut conns)?;
    }
    settled_fast_packets(&lab)?;
    let after = lab.stats()?;
    let delta = |k: &str| after[k].as_u64().unwrap_or(0) - before[k].as_u64().unwrap_or(0);
    let (cross, fast) = (delta("cross_worker_lookups"), delta("xdp_fast_replies"));
    eprintln!(
        "{ROUNDS} rounds of {} requests: replies in the fast path {fast}, found across workers in userspace {cross}; per worker (rx, flows) {:?}; sockets before {} after {}",
        clients.len(),
        per_worker(&after),
        before["rx_packets_per_socket"],
        after["rx_packets_per_socket"]
    );
    ensure!(
        per_worker(&after).iter().all(|(_, flows)| *flows > 0),
        "both workers must own flows: {after}"
    );
    // A client's replies still go through userspace once after each clear of a worker's
    // egress cache (new neighbours or routes: the kernel's neighbour entries for the
    // new client addresses change state meanwhile); before, half the clients' every reply
    // did (> 300 here).
    ensure!(
        cross * 4 < ROUNDS * clients.len() as u64,
        "replies of established connections went through userspace across workers: {cross}\n{after}"
    );
    ensure!(
        fast >= ROUNDS * clients.len() as u64,
        "every response must take the reply fast path: {fast}\n{after}"
    );
    drop(conns);
    lab.finish()
}

/// More workers than an interface has queues, or several workers with route discovery
/// of per-Pod veths: the dataplane refuses to start and says why.
#[test]
fn more_workers_than_queues_is_refused_with_a_clear_error() -> Result<()> {
    let err = Lab::build_with("dpwq", 1, false, false, &["--workers", "2"])
        .err()
        .context("2 workers on 1-queue veths must not start")?;
    let msg = format!("{err:#}");
    assert!(
        msg.contains("up0 has 1 RX queue(s); 2 workers need at least 2"),
        "{msg}"
    );
    let err = Lab::build_with("dpwr", 1, false, true, &["--workers", "2"])
        .err()
        .context("2 workers with route discovery must not start")?;
    let msg = format!("{err:#}");
    assert!(
        msg.contains("--pod-ifaces-from-routes is not supported"),
        "{msg}"
    );
    Ok(())
}

/// Every size a real client moves through the VIP, both ways — a small page, 64 KiB,
/// 4 MiB and 64 MiB — each byte checked (a truncated or altered body fails).
fn bodies_cross_the_vip(lab: &Lab) -> Result<()> {
    let ns = lab.client.name();
    for n in [615usize, 64 << 10, 4 << 20, 64 << 20] {
        download(ns, &format!("http://{VIP}/bytes/{n}"), &pattern(n), 60)?;
    }
    for n in [615usize, 64 << 10, 4 << 20, 64 << 20] {
        upload(ns, &format!("http://{VIP}/upload"), &pattern(n), 60)?;
    }
    Ok(())
}

/// Nothing was lost without a name, and nothing for being too big.
fn assert_no_size_drops(lab: &Lab) {
    for r in [
        "too_big",
        "no_free_frame",
        "socket_rx_dropped",
        "socket_rx_ring_full",
        "socket_tx_invalid",
        "malformed",
    ] {
        assert_eq!(lab.drops(r), 0, "{r}: {}", lab.stats().unwrap_or_default());
    }
}

/// TSO and GSO of a namespace's `eth0` as `ethtool -k` reports them ("on" / "off").
fn offloads(ns: &Netns) -> Result<String> {
    let out = ns.exec(&["ethtool", "-k", "eth0"])?;
    Ok(out
        .lines()
        .filter(|l| {
            l.starts_with("tcp-segmentation-offload")
                || l.starts_with("generic-segmentation-offload")
        })
        .collect::<Vec<_>>()
        .join(", "))
}

#[test]
fn large_bodies_cross_a_bridge_from_pods_with_tso_on() -> Result<()> {
    let lab = Lab::bridged("dpL")?;
    for p in &lab.pods {
        let o = offloads(p)?;
        ensure!(
            !o.contains(": off"),
            "a bridged Pod keeps TSO/GSO on, as CNIs leave it: {o}"
        );
    }
    bodies_cross_the_vip(&lab)?;
    ensure!(
        lab.stat("segmented") > 0,
        "the Pods' super-segments reached the dataplane whole and were cut: {}",
        lab.stats()?
    );
    assert_no_size_drops(&lab);
    lab.finish()
}

#[test]
fn large_bodies_cross_per_pod_veths_with_uplink_gro_off_and_on() -> Result<()> {
    let lab = Lab::new("dpM")?;
    bodies_cross_the_vip(&lab)?;
    lab.client.exec(&["ethtool", "-K", "eth0", "gro", "on"])?;
    lab.node.exec(&["ethtool", "-K", "up0", "gro", "on"])?;
    bodies_cross_the_vip(&lab)?;
    assert_no_size_drops(&lab);
    lab.finish()
}

#[test]
fn large_bodies_cross_overlay_pod_mtus_and_a_jumbo_uplink() -> Result<()> {
    let mut lab = Lab::bridged("dpJ")?;
    lab.kill9();
    lab.set_pod_mtu(1450)?;
    lab.node
        .exec(&["ip", "link", "set", "up0", "mtu", "9000"])?;
    lab.client
        .exec(&["ip", "link", "set", "eth0", "mtu", "9000"])?;
    lab.start()?;
    bodies_cross_the_vip(&lab)?;
    assert_no_size_drops(&lab);
    lab.finish()
}

/// The IPv6 twin: a Pod's IPv6 super-segments are cut to the client's MSS (its SYN said
/// 1340), not to the node's uplink MTU, both ways 4 MiB.
#[test]
fn ipv6_large_bodies_reach_a_client_behind_a_1400_byte_link() -> Result<()> {
    let lab = Lab::dual_stack("dp6P")?;
    lab.client
        .exec(&["ip", "link", "set", "eth0", "mtu", "1400"])?;
    let big = pattern(4 << 20);
    let ns = lab.client.name();
    download(
        ns,
        &format!("http://[{VIP6}]/bytes/{}", big.len()),
        &big,
        30,
    )?;
    upload(ns, &format!("http://[{VIP6}]/upload"), &big, 30)?;
    let s = lab.fresh_stats()?;
    ensure!(s["segmented"].as_u64().unwrap_or(0) > 0, "{s}");
    assert_no_size_drops(&lab);
    lab.finish()
}

#[test]
fn large_bodies_reach_a_client_behind_a_1400_byte_link() -> Result<()> {
    // The client's link takes 1400 bytes (its SYN says MSS 1360); the node's uplink
    // 1500. The Pods' super-segments must be cut to the client's MSS, not to the uplink's
    // MTU: a 1514-byte frame would die at the client's link.
    let lab = Lab::bridged("dpP")?;
    lab.client
        .exec(&["ip", "link", "set", "eth0", "mtu", "1400"])?;
    bodies_cross_the_vip(&lab)?;
    ensure!(lab.stat("segmented") > 0, "{}", lab.stats()?);
    assert_no_size_drops(&lab);
    lab.finish()
}

/// Received packets and bytes of `ifname` in `ns` (the kernel's interface counters).
fn rx_counts(ns: &Netns, ifname: &str) -> Result<(u64, u64)> {
    let read = |what: &str| -> Result<u64> {
        let path = format!("/sys/class/net/{ifname}/statistics/rx_{what}");
        Ok(ns.exec(&["cat", &path])?.trim().parse()?)
    };
    Ok((read("packets")?, read("bytes")?))
}

/// Bytes per packet the `eth0` of the namespaces `at` received, together, while `f` ran.
fn mean_rx_size(at: &[&Netns], f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let sum = || -> Result<(u64, u64)> {
        let mut t = (0, 0);
        for ns in at {
            let (p, b) = rx_counts(ns, "eth0")?;
            t = (t.0 + p, t.1 + b);
        }
        Ok(t)
    };
    let (p0, b0) = sum()?;
    f()?;
    let (p1, b1) = sum()?;
    ensure!(p1 > p0, "nothing received");
    Ok((b1 - b0) / (p1 - p0))
}

#[test]
fn large_jumbo_packets_leave_whole_over_several_tx_descriptors() -> Result<()> {
    // Every link takes 9000 bytes: a Pod's 8960-byte segments, longer than a UMEM frame,
    // must reach the client whole (several TX descriptors, one packet), not cut to
    // 3840-byte frames; the client's segments the same towards the Pods.
    let mut lab = Lab::new("dpW")?;
    lab.kill9();
    lab.set_pod_mtu(9000)?;
    lab.node
        .exec(&["ip", "link", "set", "up0", "mtu", "9000"])?;
    lab.client
        .exec(&["ip", "link", "set", "eth0", "mtu", "9000"])?;
    lab.start()?;
    let ns = lab.client.name();
    let n = 4 << 20;
    let down = mean_rx_size(&[&lab.client], || {
        download(ns, &format!("http://{VIP}/bytes/{n}"), &pattern(n), 60)
    })?;
    let pods: Vec<&Netns> = lab.pods.iter().collect();
    let up = mean_rx_size(&pods, || {
        for _ in 0..4 {
            upload(ns, &format!("http://{VIP}/upload"), &pattern(n), 60)?;
        }
        Ok(())
    })?;
    bodies_cross_the_vip(&lab)?;
    eprintln!("mean packet: {down} B to the client, {up} B to the Pods");
    // The mean, not each packet: how full the segments are is the senders' business
    // (a receive window that a busy machine keeps small makes smaller ones), but a mean
    // above what one 4096-byte UMEM frame carries (3840 bytes after the headroom) is only
    // reached when packets longer than a frame crossed whole; `segmented` below says
    // none was cut.
    const ONE_FRAME: u64 = 3840;
    ensure!(
        down > ONE_FRAME && up > ONE_FRAME,
        "packets longer than one UMEM frame both ways: the client got {down} B/packet, \
         the Pods {up}: {}",
        lab.stats()?
    );
    ensure!(
        lab.stat("segmented") == 0,
        "nothing cut, every segment fits the 9000-byte links: {}",
        lab.stats()?
    );
    assert_no_size_drops(&lab);
    lab.finish()
}

/// Sends `payload` to VIP:53 from a socket in namespace `ns` (Linux sets DF on what fits
/// the route's path MTU and fragments the rest) until an answer comes; the answer.
fn udp_echo_from(ns: &str, payload: &[u8], tries: usize) -> Result<Vec<u8>> {
    let payload = payload.to_vec();
    in_ns(ns, move || -> Result<Vec<u8>> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut buf = vec![0u8; 65_536];
        for _ in 0..tries {
            // EMSGSIZE once the kernel learned a smaller path MTU: send again.
            let _ = s.send_to(&payload, (VIP, 53));
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                ensure!(from == SocketAddr::from((VIP, 53)), "answer from {from}");
                return Ok(buf[..n].to_vec());
            }
        }
        bail!("no UDP answer from the VIP to {} bytes", payload.len())
    })
}

/// Waits until `ip route get <to>` in `ns` shows `mtu <mtu>` (a learned path MTU).
fn wait_path_mtu(ns: &Netns, to: Ipv4Addr, mtu: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = ns.exec(&["ip", "route", "get", &to.to_string()])?;
        if r.contains(&format!("mtu {mtu}")) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{} never learned path MTU {mtu} towards {to}: {r}",
            ns.name()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_df_datagram_larger_than_the_pods_mtu_gets_fragmentation_needed_from_the_vip() -> Result<()> {
    // The Pods' links take 1400 bytes, the client's 1500: a client's 1450-byte datagram
    // (DF set, as Linux sends what fits its route) cannot reach a Pod. The client must
    // hear so from the VIP it sent to, learn the path MTU, and its next try (fragmented
    // by its kernel) must cross.
    let mut lab = Lab::new("dpD")?;
    lab.kill9();
    lab.set_pod_mtu(1400)?;
    lab.start()?;
    let payload = pattern(1450 - 28);
    let answer = udp_echo_from(lab.client.name(), &payload, 10)?;
    ensure!(answer.ends_with(&payload), "the echo carries every byte");
    wait_path_mtu(&lab.client, VIP, 1400)?;
    ensure!(lab.stat("icmp_frag_needed_sent") >= 1, "{}", lab.stats()?);
    ensure!(lab.drops("too_big") >= 1, "{}", lab.stats()?);
    lab.finish()
}

#[test]
fn a_pods_df_reply_larger_than_the_uplink_gets_fragmentation_needed_from_the_node() -> Result<()> {
    // The uplink (and the client) take 1400 bytes, the Pods 1500: a Pod's ~1450-byte UDP
    // answer (DF set) cannot leave. The Pod must be told (from the node's address, about
    // the packet as it sent it), learn the path MTU towards the client, and fragment its
    // next answers.
    let mut lab = Lab::new("dpE")?;
    lab.kill9();
    lab.node
        .exec(&["ip", "link", "set", "up0", "mtu", "1400"])?;
    lab.client
        .exec(&["ip", "link", "set", "eth0", "mtu", "1400"])?;
    lab.start()?;
    let payload = pattern(1450 - 28 - 27);
    let answer = udp_echo_from(lab.client.name(), &payload, 10)?;
    ensure!(answer.ends_with(&payload), "the echo carries every byte");
    let pod = pod_of(&String::from_utf8_lossy(&answer)).context("which pod")?;
    wait_path_mtu(&lab.pods[pod], CLIENT_IP, 1400)?;
    ensure!(lab.stat("icmp_frag_needed_sent") >= 1, "{}", lab.stats()?);
    ensure!(lab.drops("too_big") >= 1, "{}", lab.stats()?);
    lab.finish()
}

#[test]
fn a_client_behind_a_1400_byte_link_between_two_routers_moves_4_mib_both_ways() -> Result<()> {
    // client (1500) ── r1 ══ 1400 ══ r2 (the lab's client namespace) ── up0 (1500):
    // both ends think 1500, a link between them takes 1400. Path-MTU discovery must work
    // through the VIP both ways: r2's "fragmentation needed" about a Pod's reply goes to
    // the VIP and must reach the Pod; r1's reaches the client directly.
    let mut lab = Lab::new("dpR")?;
    lab.kill9();
    let p = unique_prefix("dpR");
    let r1 = Netns::new(format!("{p}r1"))?;
    let c = Netns::new(format!("{p}c2"))?;
    let r2 = &lab.client;
    veth(r2, "mid", &r1, "mid")?;
    for ns in [r2, &r1] {
        ns.exec(&["ip", "link", "set", "mid", "mtu", "1400"])?;
        ns.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
    }
    r2.addr("mid", "10.100.9.1/30")?;
    r1.addr("mid", "10.100.9.2/30")?;
    veth(&r1, "eth1", &c, "eth0")?;
    r1.addr("eth1", "10.100.10.1/24")?;
    c.addr("eth0", "10.100.10.2/24")?;
    c.exec(&["ip", "route", "add", "default", "via", "10.100.10.1"])?;
    c.exec(&["ethtool", "-K", "eth0", "tx", "off"])?;
    r1.exec(&["ip", "route", "add", "default", "via", "10.100.9.1"])?;
    r2.exec(&["ip", "route", "add", "10.100.10.0/24", "via", "10.100.9.2"])?;
    lab.node
        .exec(&["ip", "route", "add", "10.100.10.0/24", "via", "10.100.1.2"])?;
    lab.start()?;
    let far = Ipv4Addr::new(10, 100, 10, 2);

    // UDP first (nothing learned yet): a ~1450-byte request and answer, DF set by both
    // kernels. Each side hears from the router in front of the narrow link, learns 1400
    // and fragments the next try.
    let payload = pattern(1450 - 28 - 27);
    let answer = udp_echo_from(c.name(), &payload, 20)?;
    ensure!(answer.ends_with(&payload), "the echo carries every byte");
    wait_path_mtu(&c, VIP, 1400)?;
    let pod = pod_of(&String::from_utf8_lossy(&answer)).context("which pod")?;
    wait_path_mtu(&lab.pods[pod], far, 1400)?;

    let n = 4 << 20;
    for _ in 0..3 {
        download(
            c.name(),
            &format!("http://{VIP}/bytes/{n}"),
            &pattern(n),
            60,
        )?;
        upload(c.name(), &format!("http://{VIP}/upload"), &pattern(n), 60)?;
    }
    assert_no_size_drops(&lab);
    drop((c, r1));
    lab.finish()
}

#[test]
fn large_uploads_cross_a_generic_xdp_uplink_that_hands_over_gro_segments() -> Result<()> {
    // Generic (skb) XDP runs after GRO: the client's segments reach the program merged.
    let lab = Lab::build_with("dpG", 1, true, false, &["--generic-xdp"])?;
    lab.node.exec(&["ethtool", "-K", "up0", "gro", "on"])?;
    bodies_cross_the_vip(&lab)?;
    ensure!(
        lab.stat("segmented") > 0,
        "super-segments (the Pods' TSO, the uplink's GRO) were cut: {}",
        lab.stats()?
    );
    assert_no_size_drops(&lab);
    lab.finish()
}

/// Sends `payload` to the VIP's UDP port from the client (its kernel fragments what is
/// larger than the MTU) and returns the answer (the Pod's kernel fragments it too).
fn udp_exchange(lab: &Lab, payload: &[u8]) -> Result<Vec<u8>> {
    let payload = payload.to_vec();
    in_ns(lab.client.name(), move || -> Result<Vec<u8>> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut buf = vec![0u8; 65_536];
        for _ in 0..10 {
            s.send_to(&payload, (VIP, 53))?;
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                ensure!(from == SocketAddr::from((VIP, 53)), "answer from {from}");
                return Ok(buf[..n].to_vec());
            }
        }
        bail!(
            "no UDP answer from the VIP to a {}-byte datagram",
            payload.len()
        )
    })
}

/// A UDP datagram to `VIP:53` cut into fragments of `frag_len` payload bytes (a multiple
/// of 8), as Ethernet frames from the client to the node's uplink.
fn client_fragments(
    macs: ([u8; 6], [u8; 6]),
    id: u16,
    payload: &[u8],
    frag_len: usize,
) -> Vec<Vec<u8>> {
    let (dst_mac, src_mac) = macs;
    let mut dgram = Vec::new();
    dgram.extend_from_slice(&40000u16.to_be_bytes());
    dgram.extend_from_slice(&53u16.to_be_bytes());
    dgram.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    dgram.extend_from_slice(&[0, 0]); // no UDP checksum
    dgram.extend_from_slice(payload);
    let mut frames = Vec::new();
    for (i, chunk) in dgram.chunks(frag_len).enumerate() {
        let more = (i + 1) * frag_len < dgram.len();
        let mut ip = ipv4_header(CLIENT_IP.octets(), VIP.octets(), 17, chunk.len());
        ip[4..6].copy_from_slice(&id.to_be_bytes());
        let ff = ((i * frag_len / 8) as u16) | if more { 0x2000 } else { 0 };
        ip[6..8].copy_from_slice(&ff.to_be_bytes());
        frames.push(ethernet_ipv4(dst_mac, src_mac, ip, chunk));
    }
    frames
}

/// The node's uplink MAC and the client's, for frames injected from the client.
fn uplink_macs(lab: &Lab) -> Result<([u8; 6], [u8; 6])> {
    Ok((mac_of(&lab.node, "up0")?, mac_of(&lab.client, "eth0")?))
}

#[test]
fn fragmented_datagrams_reach_one_backend_and_fragmented_answers_leave_from_the_vip() -> Result<()>
{
    for bridged in [false, true] {
        let lab = if bridged {
            Lab::bridged("dpF")?
        } else {
            Lab::new("dpf")?
        };
        // Both ways fragmented by the kernels: 4000 bytes out, the echo (longer) back.
        for n in [1400usize, 4000, 20_000] {
            let payload = juneau_tests::http::pattern(n);
            let answer = udp_exchange(&lab, &payload).with_context(|| {
                let m = run("bpftool", &["map", "dump", "name", "frag_replies"])
                    .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                    .unwrap_or_default();
                format!(
                    "stats: {} frag_replies: {m}",
                    lab.stats().unwrap_or_default()
                )
            })?;
            ensure!(
                answer.ends_with(&payload) && answer.starts_with(b"pod"),
                "{n}-byte datagram: answer of {} bytes does not echo it",
                answer.len()
            );
        }
        // Out of order, from the client's raw socket: the last fragment first, then the
        // middle, then the first; the backend echoes the whole datagram.
        let payload = juneau_tests::http::pattern(3000);
        let mut frames = client_fragments(uplink_macs(&lab)?, 0x7777, &payload, 1200);
        frames.reverse();
        let got = in_ns(lab.client.name(), {
            let ns = lab.client.name().to_string();
            move || -> Result<usize> {
                let s = UdpSocket::bind("0.0.0.0:40000")?;
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                inject(&ns, "eth0", frames)?;
                let mut buf = vec![0u8; 65_536];
                let (n, _) = s
                    .recv_from(&mut buf)
                    .context("no echo of the reordered datagram")?;
                ensure!(buf[..n].ends_with(&payload), "echo of {n} bytes differs");
                Ok(n)
            }
        })?;
        ensure!(got > 3000);
        assert_eq!(lab.drops("fragment_held_full"), 0);
        lab.finish()?;
    }
    Ok(())
}

#[test]
fn a_flood_of_first_fragments_is_bounded_and_spares_real_datagrams() -> Result<()> {
    let lab = Lab::new("dpg")?;
    // The flood's first fragments are forwarded (each picks a backend, as a real one
    // would) and wait in the Pod's own reassembly queue for 30 s. A network namespace
    // keeps at most `ipfrag_high_thresh` (4 MiB) there and drops every new fragment
    // above it, so 20 000 of them would leave the Pod deaf to the real datagram below:
    // that is the Pod kernel's defence, not the dataplane's, and not what this measures.
    for pod in &lab.pods {
        pod.exec(&["sysctl", "-qw", "net.ipv4.ipfrag_high_thresh=268435456"])?;
    }
    let macs = uplink_macs(&lab)?;
    let mut frames = Vec::new();
    for id in 0..20_000u16 {
        // A first fragment each (its later fragments never come).
        let mut f = client_fragments(macs, id, &[0u8; 1000], 512);
        frames.push(f.swap_remove(0));
    }
    let sent = inject(lab.client.name(), "eth0", frames)?;
    assert!(sent >= 19_000, "sent {sent}");
    // The stats file is rewritten every second: wait until it shows the flood taken in.
    let deadline = Instant::now() + Duration::from_secs(20);
    while lab.stat("rx_packets") < sent as u64 {
        ensure!(
            Instant::now() < deadline,
            "flood not received: {}",
            lab.stats()?
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let s = lab.stats()?;
    let tracked = s["fragment_datagrams"].as_u64().unwrap_or(0);
    ensure!(tracked > 1000, "the flood's datagrams were followed: {s}");
    ensure!(
        tracked <= juneau_dataplane::engine::FRAG_DATAGRAMS as u64,
        "fragment table grew to {tracked}"
    );
    // Real datagrams, fragmented or not, still cross.
    for n in [100usize, 4000] {
        let payload = juneau_tests::http::pattern(n);
        ensure!(udp_exchange(&lab, &payload)?.ends_with(&payload));
    }
    lab.finish()
}

// Capability bits (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;
const CAP_NET_RAW: u32 = 13;
const CAP_IPC_LOCK: u32 = 14;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_SYS_NICE: u32 = 23;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The capability sets of each thread of `pid` (`/proc/PID/task/TID/status`): thread id,
/// name, and CapInh, CapPrm, CapEff, CapBnd, CapAmb.
fn thread_caps(pid: u32) -> Result<Vec<(u32, String, [u64; 5])>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let e = e?;
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A thread may end between the listing and the read.
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let field = |name: &str| -> Result<String> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
                .with_context(|| format!("no {name} in {status}"))
        };
        let mut sets = [0u64; 5];
        for (i, name) in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"]
            .iter()
            .enumerate()
        {
            sets[i] = u64::from_str_radix(&field(name)?, 16)?;
        }
        out.push((tid, field("Name:")?, sets));
    }
    Ok(out)
}

/// Whether CAP_BPF stays for map updates (kernels before 6.5, `crate::privileges`).
fn kernel_before_6_5() -> bool {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    juneau_dataplane::privileges::kernel_version(r.trim()).is_none_or(|v| v < (6, 5))
}

/// Every thread of the running dataplane holds at most `keep` (permitted, effective,
/// bounding; nothing inheritable or ambient), and the main thread exactly `keep` (it
/// started as root, with every capability). Waits up to 5 s for the threads to settle
/// (each worker drops CAP_SYS_NICE once it runs SCHED_FIFO).
fn assert_forwarding_caps(lab: &Lab, mut keep: u64) -> Result<()> {
    if kernel_before_6_5() {
        keep |= 1 << CAP_BPF;
    }
    let pid = lab.dataplane.as_ref().context("no dataplane")?.id();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let threads = thread_caps(pid)?;
        let over: Vec<_> = threads
            .iter()
            .filter(|(_, _, c)| c[0] != 0 || c[4] != 0 || (c[1] | c[2] | c[3]) & !keep != 0)
            .collect();
        let main = threads
            .iter()
            .find(|t| t.0 == pid)
            .context("no main thread")?;
        if over.is_empty() {
            assert_eq!(main.2[1], keep, "main thread's CapPrm: {threads:#x?}");
            assert_eq!(main.2[2], keep, "main thread's CapEff: {threads:#x?}");
            ensure!(
                threads.len() >= 4,
                "main, neighbours, metrics, stats: {threads:?}"
            );
            for gone in [
                CAP_BPF,
                CAP_PERFMON,
                CAP_IPC_LOCK,
                CAP_SYS_ADMIN,
                CAP_SYS_NICE,
            ] {
                if keep & (1 << gone) == 0 {
                    ensure!(threads.iter().all(|t| t.2[1] & (1 << gone) == 0));
                }
            }
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "threads of the forwarding dataplane hold more than {keep:#x} \
             ([CapInh, CapPrm, CapEff, CapBnd, CapAmb]): {over:#x?}\n{}",
            lab.dataplane_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Once forwarding, the dataplane holds only what forwarding needs — with
/// fixed Pod interfaces (the chart), CAP_NET_ADMIN (the neighbour table) — not the BPF,
/// PERFMON, IPC_LOCK, NET_RAW and SYS_NICE set-up took; and it still forwards, resolves
/// a new backend's neighbour and survives a restart that reuses its pins.
#[test]
fn a_forwarding_dataplane_keeps_only_the_capabilities_it_still_needs() -> Result<()> {
    let mut lab = Lab::new("dcap")?;
    assert_forwarding_caps(&lab, 1 << CAP_NET_ADMIN)?;
    let log = lab.dataplane_log();
    ensure!(log.contains("capabilities after set-up"), "{log}");
    lab.connections_on_both_pods(16)?;
    ensure!(lab.udp_ask()?.contains("pod"), "UDP through the VIP");
    // A restart reuses the pinned program and links, and drops again.
    lab.kill9();
    lab.start()?;
    assert_forwarding_caps(&lab, 1 << CAP_NET_ADMIN)?;
    lab.connections_on_both_pods(16)?;
    lab.finish()
}

/// With Pod interfaces found through routes, CAP_NET_RAW stays too: a Pod veth that
/// appears while forwarding gets AF_XDP sockets and the XDP program with what is kept.
/// A third Pod namespace created while the dataplane runs, on its own veth `pv2`, found
/// through its route, published as a backend: it gets some of 30 new connections.
fn add_third_pod_on_its_own_veth(lab: &mut Lab) -> Result<()> {
    let pod2 = Netns::new(format!("{}x", lab.node.name()))?;
    wire_pod(&lab.node, &pod2, 2, false, 1)?;
    lab.backends.push(start_backend(pod2.name(), "pod2")?);
    lab.pods.push(pod2);
    lab.publish(&[0, 1, 2])?;
    lab.wait_pod_ifaces(&["pv0", "pv1", "pv2"], &[])?;
    let mut seen = HashSet::new();
    for mut c in lab.connect_many(30)? {
        seen.insert(pod_of(&http_get(&mut c)?).context("pod")?);
    }
    ensure!(seen.contains(&2), "the new Pod gets traffic: {seen:?}");
    Ok(())
}

#[test]
fn with_pods_found_through_routes_net_raw_stays_and_a_new_pod_is_attached() -> Result<()> {
    let mut lab = Lab::from_routes("dcar")?;
    // pv0 and pv1 were attached after set-up already (found through the routes).
    assert_forwarding_caps(&lab, (1 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW))?;
    add_third_pod_on_its_own_veth(&mut lab)?;
    assert_forwarding_caps(&lab, (1 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW))?;
    lab.finish()
}

/// helm uninstall's request reaching a forwarding dataplane, which holds only
/// CAP_NET_ADMIN by then: it still detaches its XDP program from every
/// interface, removes its pins and acknowledges; idle, its main thread holds nothing.
#[test]
fn a_decommission_while_forwarding_needs_none_of_the_dropped_capabilities() -> Result<()> {
    let req = tempfile::tempdir()?;
    let d = req.path().to_str().context("path")?.to_string();
    let lab = Lab::build_with("dcad", 1, false, false, &["--decommission-dir", &d])?;
    assert_forwarding_caps(&lab, 1 << CAP_NET_ADMIN)?;
    lab.connections_on_both_pods(8)?;
    juneau_control::decommission::request(req.path(), "t1")?;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !juneau_control::decommission::acknowledged(
        req.path(),
        juneau_control::decommission::Component::Dataplane,
    ) {
        ensure!(
            Instant::now() < deadline,
            "no acknowledgement in 15 s:\n{}",
            lab.dataplane_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for ifname in ["up0", "pv0", "pv1"] {
        let out = lab.node.exec(&["ip", "-d", "link", "show", ifname])?;
        ensure!(!out.contains("prog/xdp"), "XDP still on {ifname}: {out}");
    }
    let pins = lab.bpffs.pin_dir();
    ensure!(!pins.exists(), "{} left", pins.display());
    let pid = lab.dataplane.as_ref().context("no dataplane")?.id();
    let threads = thread_caps(pid)?;
    let main = threads.iter().find(|t| t.0 == pid).context("main")?;
    assert_eq!(
        (main.2[1], main.2[2]),
        (0, 0),
        "idle main thread: {threads:#x?}"
    );
    lab.finish()
}
