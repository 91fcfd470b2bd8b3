//! Redirects between nodes across real network namespaces: two real `juneau-dataplane` processes behind
//! a router whose route to the VIP changes under open keep-alive connections.
//!
//! ```text
//!                               router ns (kernel forwarding, L4-hash ECMP)
//! client ns                     c0 10.100.1.1/24        br0 10.1.0.1/24 (MTU 1600)
//! eth0 10.100.1.2/24 ────────── c0                       ├── na ── up0 10.1.0.2/24  node A ns ── pv0 ── pod A 10.10.1.2
//!                                                        └── nb ── up0 10.1.0.3/24  node B ns ── pv0 ── pod B 10.10.2.2
//! route to the VIP 10.200.0.10:  A only → A+B (ECMP) → B only ("A withdrew") → A only
//! ```
//!
//! Every link is dual-stack (issue #28): the client `2001:db8:100:1::2`, the node network
//! `fd00:1::/64`, each Pod `fd00:10:<n>::2`; the router's route to the IPv6 VIP
//! `2001:db8:200::10` moves the same way. Redirects between the nodes stay IPv4 (their
//! redirect addresses); an IPv6 packet travels inside unchanged.
//!
//! Every time the route changes, connections land on a node that has never seen them:
//! that node redirects their packets to the other one (encapsulated, UDP 7411 over the
//! node network), which serves them from its own Pod; replies leave from the owner. The
//! test counts failed requests and resets (must be 0), checks every response came from
//! the Pod the connection started on (no connection moved backend), and reads the
//! dataplanes' per-peer redirect counters. The router is the kernel with a multipath
//! route (`fib_multipath_hash_policy=1`), not BIRD: the ECMP *change* is what matters here.
//!
//! The nodes publish a redirect MAC key (wire version 3) unless a test says
//! otherwise; one test gives the two nodes different keys.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use juneau_control::model::{
    Frontend, Frontend6, LocalBackend, LocalBackend6, NodeService, NodeService6, NodeState,
    Protocol, RedirectKey, Redirects,
};
use juneau_control::secret::SecretKey;
use juneau_control::shm::{Capacity, NodeStateWriter};
use juneau_tests::daemon::json_sampled_after_now;
use juneau_tests::frames::{inject, TcpFlood};
use juneau_tests::http::{fnv64, http_get, pattern, TestBackend};
use juneau_tests::netns::{in_ns, mac_of, require_root, run, unique_prefix, veth, Netns, NsChild};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 10);
const NODE: [&str; 2] = ["10.1.0.2", "10.1.0.3"];
const POD: [&str; 2] = ["10.10.1.2", "10.10.2.2"];
const HTTP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x200, 0, 0, 0, 0, 0x10);
const NODE6: [&str; 2] = ["fd00:1::2", "fd00:1::3"];
/// The IPv6 backends' ports (the IPv4 servers bind 0.0.0.0 only).
const HTTP_PORT6: u16 = 8081;
const UDP_PORT6: u16 = 5354;

fn pod6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, i as u16 + 1, 0, 0, 0, 0, 2)
}

struct BpfMount(PathBuf);

impl Drop for BpfMount {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.0.to_str().unwrap()]);
    }
}

/// One node: its namespace, Pod, state writer and dataplane. Field order is drop
/// order: the dataplane dies first, then its bpffs goes (unpinning everything).
struct Node {
    dataplane: NsChild,
    _bpf: BpfMount,
    _server: TestBackend,
    _server6: TestBackend,
    writer: NodeStateWriter,
    stats: PathBuf,
    log: PathBuf,
    pod: Netns,
    ns: Netns,
}

impl Node {
    /// Publishes `state` and waits until the dataplane has taken it.
    fn publish(&mut self, state: &NodeState) -> Result<()> {
        let g = self.writer.publish(state)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.stats()?["generation"].as_u64().unwrap_or(0) < g {
            ensure!(
                Instant::now() < deadline,
                "generation {g} not taken:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    fn stats(&self) -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&std::fs::read_to_string(
            &self.stats,
        )?)?)
    }

    fn peer(&self, addr: &str) -> serde_json::Value {
        self.stats()
            .ok()
            .and_then(|s| {
                s["redirect_peers"]
                    .as_array()?
                    .iter()
                    .find(|p| p["peer"] == addr)
                    .cloned()
            })
            .unwrap_or_default()
    }

    /// A drop counter (0 while the stats are not readable).
    fn drops(&self, reason: &str) -> u64 {
        self.stats()
            .ok()
            .and_then(|s| s["drops"][reason].as_u64())
            .unwrap_or(0)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The redirect MAC key made of byte `b` (none: the channel unauthenticated).
fn keys(b: Option<u8>) -> Vec<RedirectKey> {
    b.map(|b| RedirectKey::new(SecretKey::new([b; 16])))
        .into_iter()
        .collect()
}

/// Node `i`'s state: the VIP's TCP/80 and UDP/53 with its Pod as backend
/// (`has_backend`), the Service's policy Cluster (`cluster_policy`) or Local, and
/// redirect key `key`.
fn node_state(
    i: usize,
    key: Option<u8>,
    has_backend: bool,
    cluster_policy: bool,
) -> Result<NodeState> {
    let backends = if has_backend {
        vec![LocalBackend {
            ip: POD[i].parse()?,
            port: HTTP_PORT,
        }]
    } else {
        Vec::new()
    };
    let service = |protocol, port, backends: Vec<LocalBackend>| {
        let mut s = NodeService::new(
            Frontend {
                vip: VIP,
                protocol,
                port,
            },
            backends,
        );
        s.hand_off = cluster_policy;
        s
    };
    let udp_backends = backends
        .iter()
        .map(|b| LocalBackend {
            ip: b.ip,
            port: UDP_PORT,
        })
        .collect();
    Ok(NodeState {
        node: format!("node-{}", ["a", "b"][i]),
        services: vec![
            service(Protocol::Tcp, 80, backends),
            service(Protocol::Udp, 53, udp_backends),
        ],
        services6: [
            (Protocol::Tcp, 80, HTTP_PORT6),
            (Protocol::Udp, 53, UDP_PORT6),
        ]
        .into_iter()
        .map(|(protocol, port, target)| {
            let pods = if has_backend { vec![pod6(i)] } else { vec![] };
            let mut s = NodeService6::new(
                Frontend6 {
                    vip: VIP6,
                    protocol,
                    port,
                },
                pods.into_iter()
                    .map(|ip| LocalBackend6 { ip, port: target })
                    .collect(),
            );
            s.hand_off = cluster_policy;
            s
        })
        .collect(),
        redirects: Redirects {
            keys: keys(key),
            ..Default::default()
        },
        ..Default::default()
    })
}

/// How a topology is built.
#[derive(Debug, Clone, Copy)]
struct Opts {
    /// The dataplanes redirect (their redirect address and peers given); else not at all.
    redirects: bool,
    /// Each Pod behind a bridge in its node (the dataplane on the bridge, so the Pod's
    /// veth keeps TSO on, as bridge CNIs leave it); else on its own veth, which the
    /// dataplane's XDP program holds (the kernel then turns the Pod's TSO off).
    bridge: bool,
}

/// Node `i` behind `router`.
fn build_node(
    p: &str,
    i: usize,
    router: &Netns,
    dir: &std::path::Path,
    (extra, key, opts): (&[&str], Option<u8>, Opts),
) -> Result<Node> {
    let name = ["a", "b"][i];
    let ns = Netns::new(format!("{p}{name}"))?;
    let pod = Netns::new(format!("{p}{name}p"))?;
    let rif = format!("n{name}");
    veth(router, &rif, &ns, "up0")?;
    for (n, ifname) in [(router, rif.as_str()), (&ns, "up0")] {
        n.exec(&["ip", "link", "set", ifname, "mtu", "1600"])?;
    }
    router.exec(&["ip", "link", "set", &rif, "master", "br0", "up"])?;
    ns.addr("up0", &format!("{}/24", NODE[i]))?;
    ns.exec(&["ip", "route", "add", "default", "via", "10.1.0.1"])?;
    veth(&ns, "pv0", &pod, "eth0")?;
    let pod_iface = if opts.bridge {
        ns.exec(&["ip", "link", "add", "br0", "type", "bridge"])?;
        ns.exec(&["ip", "link", "set", "pv0", "master", "br0", "up"])?;
        "br0"
    } else {
        "pv0"
    };
    ns.addr(pod_iface, &format!("10.10.{}.1/24", i + 1))?;
    pod.addr("eth0", &format!("{}/24", POD[i]))?;
    pod.exec(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        &format!("10.10.{}.1", i + 1),
    ])?;
    // IPv6 beside IPv4 on every link.
    ns.addr6("up0", &format!("{}/64", NODE6[i]))?;
    ns.exec(&["ip", "-6", "route", "add", "default", "via", "fd00:1::1"])?;
    ns.addr6(pod_iface, &format!("fd00:10:{}::1/64", i + 1))?;
    pod.addr6("eth0", &format!("{}/64", pod6(i)))?;
    pod.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        "default",
        "via",
        &format!("fd00:10:{}::1", i + 1),
    ])?;
    let server = TestBackend::start(
        pod.name(),
        ["podA", "podB"][i],
        SocketAddr::from(([0, 0, 0, 0], HTTP_PORT)),
        Some(SocketAddr::from(([0, 0, 0, 0], UDP_PORT))),
    )?;
    let server6 = TestBackend::start(
        pod.name(),
        ["podA", "podB"][i],
        SocketAddr::from((Ipv6Addr::UNSPECIFIED, HTTP_PORT6)),
        Some(SocketAddr::from((Ipv6Addr::UNSPECIFIED, UDP_PORT6))),
    )?;

    let state_path = dir.join(format!("{name}.state"));
    let mut writer = NodeStateWriter::create(&state_path, Capacity::default())?;
    writer.publish(&node_state(i, key, true, false)?)?;
    let bpf = dir.join(format!("bpf-{name}"));
    std::fs::create_dir_all(&bpf)?;
    run("mount", &["-t", "bpf", "bpf", bpf.to_str().unwrap()])?;
    let bpf = BpfMount(bpf);
    let stats = dir.join(format!("{name}.json"));
    let log = dir.join(format!("{name}.log"));
    let pin = bpf.0.join("pins");
    let mut argv = vec![
        env!("CARGO_BIN_EXE_juneau-dataplane"),
        "--uplink",
        "up0",
        "--pod-iface",
        pod_iface,
        "--state-file",
        state_path.to_str().unwrap(),
        "--stats-file",
        stats.to_str().unwrap(),
        "--pin-dir",
        pin.to_str().unwrap(),
        "--flow-capacity",
        "65536",
        "--frames-per-iface",
        "2048",
        "--ring-size",
        "1024",
    ];
    if opts.redirects {
        argv.extend_from_slice(&[
            "--node-address",
            NODE[i],
            "--redirect-peer",
            NODE[0],
            "--redirect-peer",
            NODE[1],
            "--redirect-mtu",
            "1600",
        ]);
    }
    argv.extend_from_slice(extra);
    let dataplane = ns.spawn_logged(&argv, &log)?;
    let node = Node {
        dataplane,
        _bpf: bpf,
        _server: server,
        _server6: server6,
        writer,
        stats,
        log,
        pod,
        ns,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if node
            .stats()
            .ok()
            .and_then(|s| s["generation"].as_u64())
            .unwrap_or(0)
            >= 1
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "dataplane {name} not ready:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(node)
}

/// The router's route to the IPv6 VIP: via node `via[0]`, or ECMP over `via`.
fn set_route6(router: &Netns, via: &[usize]) -> Result<()> {
    let vip = format!("{VIP6}/128");
    let mut argv: Vec<&str> = vec!["ip", "-6", "route", "replace", &vip];
    if via.len() == 1 {
        argv.extend(["via", NODE6[via[0]]]);
    } else {
        for &i in via {
            argv.extend(["nexthop", "via", NODE6[i]]);
        }
    }
    router.exec(&argv)?;
    Ok(())
}

fn set_route(router: &Netns, via: &[usize]) -> Result<()> {
    let vip = format!("{VIP}/32");
    let mut argv: Vec<String> = ["ip", "route", "replace", &vip]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if via.len() == 1 {
        argv.extend(["via".into(), NODE[via[0]].into()]);
    } else {
        for &i in via {
            argv.extend(["nexthop".into(), "via".into(), NODE[i].into()]);
        }
    }
    let a: Vec<&str> = argv.iter().map(String::as_str).collect();
    router.exec(&a)?;
    // The kernel flushes its route cache on replace; nothing else to wait for.
    Ok(())
}

/// One request on every connection; returns (failures, responses by Pod name).
fn round(conns: &mut [(TcpStream, String)]) -> (Vec<String>, usize) {
    let mut failures = Vec::new();
    let mut ok = 0;
    for (i, (c, pod)) in conns.iter_mut().enumerate() {
        match http_get(c) {
            Ok(body) if body.split_whitespace().next() == Some(pod.as_str()) => ok += 1,
            Ok(body) => failures.push(format!("conn {i}: answered by {body}, opened on {pod}")),
            Err(e) => failures.push(format!("conn {i} ({pod}): {e}")),
        }
    }
    (failures, ok)
}

fn open(client: &Netns, n: usize) -> Result<Vec<(TcpStream, String)>> {
    open_to(client, SocketAddr::V4(SocketAddrV4::new(VIP, 80)), n)
}

/// [`open`] to the IPv6 VIP.
fn open6(client: &Netns, n: usize) -> Result<Vec<(TcpStream, String)>> {
    open_to(client, SocketAddr::from((VIP6, 80)), n)
}

fn open_to(client: &Netns, vip: SocketAddr, n: usize) -> Result<Vec<(TcpStream, String)>> {
    let mut conns = in_ns(client.name(), move || -> Result<Vec<TcpStream>> {
        (0..n)
            .map(|_| {
                let c = TcpStream::connect_timeout(&vip, Duration::from_secs(5))?;
                // Generous: a loaded 2-core CI machine can stall the dataplanes' loops
                // for seconds (TCP recovers by retransmission); a black-holed or reset
                // connection fails either way.
                c.set_read_timeout(Some(Duration::from_secs(15)))?;
                Ok(c)
            })
            .collect()
    })?;
    let mut out = Vec::new();
    for mut c in conns.drain(..) {
        let body = http_get(&mut c).context("first request on a new connection")?;
        // `<pod> saw <client>`: the Pod's name is the connection's identity here.
        let pod = body
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        out.push((c, pod));
    }
    Ok(out)
}

/// The whole topology. Field order is drop order: dataplanes and node namespaces
/// first, then the router and the client, then the files.
struct Topo {
    nodes: [Node; 2],
    router: Netns,
    client: Netns,
    _dir: tempfile::TempDir,
}

impl Topo {
    /// `key[i]`: the redirect MAC key node `i` publishes ([`keys`]).
    fn build(tag: &str, extra: &[&str], key: [Option<u8>; 2]) -> Result<Self> {
        let opts = Opts {
            redirects: true,
            bridge: false,
        };
        Self::build_full(tag, extra, key, opts)
    }

    /// [`Topo::build`] as `opts` says.
    fn build_full(tag: &str, extra: &[&str], key: [Option<u8>; 2], opts: Opts) -> Result<Self> {
        require_root()?;
        let p = unique_prefix(tag);
        let dir = tempfile::tempdir()?;
        let client = Netns::new(format!("{p}c"))?;
        let router = Netns::new(format!("{p}r"))?;
        veth(&client, "eth0", &router, "c0")?;
        client.addr("eth0", "10.100.1.2/24")?;
        router.addr("c0", "10.100.1.1/24")?;
        client.exec(&["ip", "route", "add", "default", "via", "10.100.1.1"])?;
        client.addr6("eth0", "2001:db8:100:1::2/64")?;
        router.addr6("c0", "2001:db8:100:1::1/64")?;
        client.exec(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "2001:db8:100:1::1",
        ])?;
        // Kernel sockets would hand over partial checksums; a real uplink NIC does not.
        client.exec(&["ethtool", "-K", "eth0", "tx", "off"])?;
        router.exec(&["ip", "link", "add", "br0", "mtu", "1600", "type", "bridge"])?;
        router.addr("br0", "10.1.0.1/24")?;
        router.addr6("br0", "fd00:1::1/64")?;
        for s in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.fib_multipath_hash_policy=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv6.conf.all.forwarding=1",
            "net.ipv6.fib_multipath_hash_policy=1",
        ] {
            router.exec(&["sysctl", "-qw", s])?;
        }
        let nodes = [
            build_node(&p, 0, &router, dir.path(), (extra, key[0], opts))?,
            build_node(&p, 1, &router, dir.path(), (extra, key[1], opts))?,
        ];
        // The router and the Pods resolved once, so no first packet waits for ARP (the
        // dataplane drops it and asks the kernel; TCP would retransmit after a second).
        // Not the other node: a dataplane keeps its redirect peers' next hops resolved
        // itself, ahead of the first redirect (the test checks no packet waited).
        for (i, node) in nodes.iter().enumerate() {
            let pod6 = pod6(i).to_string();
            for to in ["10.1.0.1", POD[i], "fd00:1::1", &pod6] {
                node.ns.exec(&["ping", "-c1", "-W2", to])?;
            }
        }
        let t = Topo {
            nodes,
            router,
            client,
            _dir: dir,
        };
        // Warm-up, not measured: one request through each node alone, retried, so both
        // dataplanes have resolved their Pod and the router before the test starts (a
        // dataplane re-resolves a backend new to its table even when the kernel has an
        // entry, and drops the first packets meanwhile).
        for i in 0..2 {
            set_route(&t.router, &[i])?;
            let mut ok = false;
            for _ in 0..10 {
                if let Ok(mut c) = open(&t.client, 1) {
                    ok = c.pop().is_some_and(|c| c.1 == ["podA", "podB"][i]);
                }
                if ok {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            ensure!(
                ok,
                "{}",
                t.diag(&format!("warm-up through node {i} failed"))
            );
            set_route6(&t.router, &[i])?;
            let mut ok = false;
            for _ in 0..10 {
                if let Ok(mut c) = open6(&t.client, 1) {
                    ok = c.pop().is_some_and(|c| c.1 == ["podA", "podB"][i]);
                }
                if ok {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            ensure!(
                ok,
                "{}",
                t.diag(&format!("IPv6 warm-up through node {i} failed"))
            );
        }
        Ok(t)
    }

    /// Waits until every node's stats were sampled after this call (the files are
    /// rewritten about once a second): what the test did so far is counted.
    fn fresh_stats(&self) -> Result<()> {
        for node in &self.nodes {
            json_sampled_after_now(&node.stats)?;
        }
        Ok(())
    }

    fn diag(&self, what: &str) -> String {
        let n = &self.nodes;
        format!(
            "{what}\nnode A stats: {}\nnode B stats: {}\nnode A log:\n{}\nnode B log:\n{}",
            n[0].stats().map(|s| s.to_string()).unwrap_or_default(),
            n[1].stats().map(|s| s.to_string()).unwrap_or_default(),
            n[0].log(),
            n[1].log()
        )
    }

    /// Tears down and checks nothing is left: namespaces, dataplane processes.
    fn finish(self) -> Result<()> {
        let names: Vec<String> = [&self.client, &self.router]
            .iter()
            .map(|n| n.name().to_string())
            .chain(self.nodes.iter().map(|n| n.ns.name().to_string()))
            .collect();
        let pids: Vec<u32> = self.nodes.iter().map(|n| n.dataplane.id()).collect();
        drop(self);
        let list = String::from_utf8(run("ip", &["netns", "list"])?.stdout)?;
        for n in &names {
            ensure!(
                !list.split_whitespace().any(|w| w == n),
                "namespace {n} left behind"
            );
        }
        for pid in pids {
            ensure!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "dataplane {pid} left behind"
            );
        }
        Ok(())
    }
}

#[test]
fn connections_survive_ecmp_changes_between_two_real_dataplanes() -> Result<()> {
    // Both nodes hold the same redirect key: wire version 3, every frame tagged.
    let t = Topo::build("rdr", &[], [Some(1), Some(1)])?;
    for node in &t.nodes {
        ensure!(
            node.log().contains("redirect channel authenticated"),
            "{}",
            t.diag("the key was not taken")
        );
    }
    survive_ecmp_changes(t)
}

/// `externalTrafficPolicy: Cluster`: node B has no backend, the router sends it every
/// connection, and each one reaches node A's Pod with the client's address — however
/// small the redirect buckets (one a second here), which bound only transients.
#[test]
fn under_the_cluster_policy_a_node_without_a_backend_hands_every_connection_over() -> Result<()> {
    let bucket = [
        "--redirect-rate",
        "1",
        "--redirect-burst",
        "1",
        "--redirect-prefix-rate",
        "1",
        "--redirect-prefix-burst",
        "1",
    ];
    let mut t = Topo::build("rcl", &bucket, [Some(1), Some(1)])?;
    t.nodes[0].publish(&node_state(0, Some(1), true, true)?)?;
    t.nodes[1].publish(&node_state(1, Some(1), false, true)?)?;
    set_route(&t.router, &[1])?;
    let mut conns = open(&t.client, 40).with_context(|| t.diag("connections through node B"))?;
    let by: Vec<&str> = conns.iter().map(|c| c.1.as_str()).collect();
    ensure!(
        by.iter().all(|p| *p == "podA"),
        "{}",
        t.diag(&format!("served by {by:?}"))
    );
    for _ in 0..3 {
        let (failures, _) = round(&mut conns);
        ensure!(failures.is_empty(), "{}", t.diag(&failures.join("\n")));
    }
    // The stats are written once a second: wait for the traffic to show.
    let b = &t.nodes[1];
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.peer(NODE[0])["redirected_to"].as_u64().unwrap_or(0) < 40 {
        ensure!(
            Instant::now() < deadline,
            "{}",
            t.diag("node B handed on fewer packets than connections")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for reason in [
        "redirect_rate_limited",
        "redirect_prefix_rate_limited",
        "no_backend",
    ] {
        ensure!(b.drops(reason) == 0, "{}", t.diag(reason));
    }
    drop(conns);
    t.finish()
}

/// UDP under the Cluster policy: node B has no backend and the router sends it every
/// datagram; each flow (a client socket) reaches node A's Pod with the client's address
/// and its answer comes from VIP:53 — its first datagram handed on, the later ones
/// following the record node A's notice left. Small and 1400-byte datagrams.
#[test]
fn under_the_cluster_policy_udp_flows_through_a_node_without_a_backend_reach_a_pod() -> Result<()> {
    let mut t = Topo::build("rcu", &[], [Some(1), Some(1)])?;
    t.nodes[0].publish(&node_state(0, Some(1), true, true)?)?;
    t.nodes[1].publish(&node_state(1, Some(1), false, true)?)?;
    set_route(&t.router, &[1])?;
    const FLOWS: usize = 20;
    const DATAGRAMS: usize = 5;
    let failures = in_ns(t.client.name(), || -> Result<Vec<String>> {
        let mut failures = Vec::new();
        let mut buf = vec![0u8; 4096];
        for f in 0..FLOWS {
            let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let me = s.local_addr()?.port();
            for d in 0..DATAGRAMS {
                let body = vec![b'a' + (d as u8); if d % 2 == 0 { 16 } else { 1400 }];
                s.send_to(&body, (VIP, 53))?;
                match s.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        let reply = &buf[..n];
                        let want = format!("podA saw 10.100.1.2:{me} ");
                        if from != SocketAddr::from((VIP, 53))
                            || !reply.starts_with(want.as_bytes())
                            || !reply.ends_with(&body)
                        {
                            failures.push(format!(
                                "flow {f} datagram {d}: {} bytes from {from}: {:?}",
                                n,
                                String::from_utf8_lossy(&reply[..n.min(40)])
                            ));
                        }
                    }
                    Err(e) => failures.push(format!("flow {f} datagram {d}: {e}")),
                }
            }
        }
        Ok(failures)
    })?;
    ensure!(failures.is_empty(), "{}", t.diag(&failures.join("\n")));
    let b = &t.nodes[1];
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.peer(NODE[0])["redirected_to"].as_u64().unwrap_or(0) < (FLOWS * DATAGRAMS) as u64 {
        ensure!(
            Instant::now() < deadline,
            "{}",
            t.diag("node B handed on fewer datagrams than it received")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    t.fresh_stats()?;
    for reason in [
        "no_backend",
        "redirect_notice_refused",
        "redirect_not_served",
    ] {
        for n in &t.nodes {
            ensure!(n.drops(reason) == 0, "{}", t.diag(reason));
        }
    }
    ensure!(
        t.nodes[0].peer(NODE[1])["notices_sent"]
            .as_u64()
            .unwrap_or(0)
            >= FLOWS as u64,
        "{}",
        t.diag("node A sent fewer notices than flows")
    );
    t.finish()
}

/// Liveness between redirect peers over real sockets: each node probes the other through
/// its kernel, the other's dataplane answers through its AF_XDP socket. Node B cut off
/// the node network (its port taken off the router's bridge, its link still up, as a
/// switch port failing) is reported unreachable by node A within seconds, named in its
/// log and metrics-bound stats, and reachable again once it is back.
#[test]
fn a_peer_cut_off_the_node_network_is_reported_unreachable_then_back() -> Result<()> {
    let t = Topo::build("rlv", &[], [Some(1), Some(1)])?;
    let (a, b) = (&t.nodes[0], &t.nodes[1]);
    let reach = |n: &Node, peer: &str| n.peer(peer)["reachable"].as_bool();
    let wait = |what: &str, cond: &dyn Fn() -> bool| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !cond() {
            ensure!(Instant::now() < deadline, "{}", t.diag(what));
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    };
    wait("the nodes never answered each other's probes", &|| {
        reach(a, NODE[1]) == Some(true) && reach(b, NODE[0]) == Some(true)
    })?;
    t.router.exec(&["ip", "link", "set", "nb", "nomaster"])?;
    wait("node B cut off, still reachable for node A", &|| {
        reach(a, NODE[1]) == Some(false)
    })?;
    ensure!(
        a.log().contains("redirect peer unreachable"),
        "{}",
        t.diag("the cut not logged")
    );
    t.router
        .exec(&["ip", "link", "set", "nb", "master", "br0", "up"])?;
    wait("node B back, still unreachable for node A", &|| {
        reach(a, NODE[1]) == Some(true) && reach(b, NODE[0]) == Some(true)
    })?;
    ensure!(
        a.log().contains("redirect peer answers again"),
        "{}",
        t.diag("the return not logged")
    );
    for (n, peer) in [(a, NODE[1]), (b, NODE[0])] {
        let p = n.peer(peer);
        for c in ["probes_sent", "probes_received", "probe_answers_received"] {
            ensure!(p[c].as_u64().unwrap_or(0) > 0, "{}", t.diag(c));
        }
        for reason in [
            "redirect_malformed",
            "redirect_bad_mac",
            "redirect_not_from_peer",
        ] {
            ensure!(n.drops(reason) == 0, "{}", t.diag(reason));
        }
    }
    t.finish()
}

#[test]
fn connections_survive_ecmp_changes_without_a_redirect_key() -> Result<()> {
    // No key published: wire version 2 (cookie only).
    let t = Topo::build("rdn", &[], [None, None])?;
    for node in &t.nodes {
        ensure!(
            node.log().contains("redirect channel unauthenticated"),
            "{}",
            t.diag("no word of the missing key")
        );
    }
    survive_ecmp_changes(t)
}

fn survive_ecmp_changes(t: Topo) -> Result<()> {
    let (client, router, nodes) = (&t.client, &t.router, &t.nodes);
    let diag = |what: &str| t.diag(what);
    t.fresh_stats()?;
    let no_neighbour_before = nodes.each_ref().map(|n| n.drops("no_neighbour"));

    // 1. Only node A announces: 32 keep-alive connections, all on pod A.
    set_route(router, &[0])?;
    let mut conns = open(client, 32).with_context(|| diag("opening"))?;
    ensure!(
        conns.iter().all(|c| c.1 == "podA"),
        "{:?}",
        conns.iter().map(|c| &c.1).collect::<Vec<_>>()
    );
    let mut failures = Vec::new();
    let mut requests = 0;
    // 2. Node B gains its first backend: ECMP over A and B. About half the old
    //    connections now reach B, which has never seen them. New ones spread.
    set_route(router, &[0, 1])?;
    for _ in 0..3 {
        let (f, ok) = round(&mut conns);
        failures.extend(f);
        requests += ok;
    }
    let mut fresh = open(client, 16).with_context(|| diag("opening under ECMP"))?;
    ensure!(
        fresh.iter().any(|c| c.1 == "podB"),
        "no new connection reached node B under ECMP"
    );
    conns.append(&mut fresh);
    // 3. Node A withdraws (the drain case): everything reaches B; A keeps serving its
    //    connections through B's redirects.
    set_route(router, &[1])?;
    for _ in 0..3 {
        let (f, ok) = round(&mut conns);
        failures.extend(f);
        requests += ok;
    }
    // 4. Back to A only: B's connections now reach A, which redirects them to B.
    set_route(router, &[0])?;
    for _ in 0..3 {
        let (f, ok) = round(&mut conns);
        failures.extend(f);
        requests += ok;
    }
    let mut fresh = open(client, 8).with_context(|| diag("opening after"))?;
    ensure!(fresh.iter().all(|c| c.1 == "podA"));
    conns.append(&mut fresh);
    let (f, ok) = round(&mut conns);
    failures.extend(f);
    requests += ok;

    t.fresh_stats()?;
    let (a_to_b, b_to_a) = (nodes[0].peer(NODE[1]), nodes[1].peer(NODE[0]));
    eprintln!(
        "requests ok {requests}, failures {}; A→B {a_to_b}; B→A {b_to_a}",
        failures.len()
    );
    if !failures.is_empty() {
        bail!(diag(&format!(
            "{} failed requests: {failures:?}",
            failures.len()
        )));
    }
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    ensure!(
        n(&b_to_a, "redirected_to") > 0,
        "{}",
        diag("B never redirected to A")
    );
    ensure!(
        n(&a_to_b, "redirected_to") > 0,
        "{}",
        diag("A never redirected to B")
    );
    ensure!(
        n(&b_to_a, "notices_received") > 0,
        "{}",
        diag("A never told B it owns a flow")
    );
    ensure!(n(&a_to_b, "received_from") > 0);
    // Each node's first redirect to the other found its next hop resolved: no packet
    // of a moved connection was dropped waiting for ARP.
    for (node, before) in nodes.iter().zip(no_neighbour_before) {
        ensure!(
            node.drops("no_neighbour") == before,
            "{}",
            diag(&format!(
                "packets dropped as no_neighbour after the warm-up ({before} before)"
            ))
        );
    }
    for node in nodes {
        let s = node.stats()?;
        ensure!(
            s["drops"]["redirect_rate_limited"] == 0
                && s["drops"]["non_syn_without_flow"] == 0
                && s["drops"]["redirect_bad_mac"] == 0,
            "{}",
            diag("unexpected drops")
        );
    }
    drop(conns);
    t.finish()
}

#[test]
fn a_flood_of_random_acks_stays_within_the_redirect_budget_between_nodes() -> Result<()> {
    let (rate, burst) = (200u64, 50u64);
    let t = Topo::build(
        "rfl",
        &["--redirect-rate", "200", "--redirect-burst", "50"],
        [Some(1), Some(1)],
    )?;
    // Both nodes announce; a live connection on each must carry on through the flood.
    set_route(&t.router, &[0, 1])?;
    let mut conns = open(&t.client, 8).with_context(|| t.diag("opening"))?;
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    // The records before the flood: the 8 connections', and any other the set-up made
    // (a SYN retransmitted from a new port while a neighbour resolved leaves one).
    t.fresh_stats()?;
    let flows_before: Vec<u64> = t
        .nodes
        .iter()
        .map(|node| Ok(n(&node.stats()?, "flows")))
        .collect::<Result<_>>()?;
    let dst = mac_of(&t.router, "c0")?;
    let src = mac_of(&t.client, "eth0")?;
    let start = Instant::now();
    let sent = inject(
        t.client.name(),
        "eth0",
        TcpFlood {
            dst_mac: dst,
            src_mac: src,
            dst: VIP,
            dst_port: 80,
            flags: 0x10,
            seed: 0x9e37_79b9_7f4a_7c15,
        }
        .frames(20_000),
    )?;
    let elapsed = start.elapsed().as_secs_f64();
    let (failures, _) = round(&mut conns);
    ensure!(failures.is_empty(), "{}", t.diag(&format!("{failures:?}")));
    t.fresh_stats()?;
    let mut total_between = 0;
    for (i, node) in t.nodes.iter().enumerate() {
        let peer = node.peer(NODE[1 - i]);
        let s = node.stats()?;
        let to = n(&peer, "redirected_to");
        total_between += to;
        // Each node's own bucket: burst + rate × time (with a second of slack for the
        // stats file's lag and the time the frames took to drain).
        let bound = burst + (rate as f64 * (elapsed + 1.5)) as u64;
        ensure!(
            to <= bound,
            "{}",
            t.diag(&format!("node {i} sent {to} > {bound}"))
        );
        ensure!(
            n(&s["drops"], "redirect_rate_limited") > 0,
            "{}",
            t.diag("the bucket never ran dry")
        );
        // No flow and no redirect record from unknown packets: no more records than
        // before the flood.
        ensure!(
            n(&s, "flows") <= flows_before[i],
            "{}",
            t.diag(&format!(
                "flows created by the flood (node {i} held {} before)",
                flows_before[i]
            ))
        );
    }
    eprintln!("{sent} random ACKs in {elapsed:.2} s; {total_between} redirected between the nodes");
    ensure!(total_between > 0, "{}", t.diag("nothing redirected"));
    drop(conns);
    t.finish()
}

#[test]
fn a_node_with_another_key_accepts_no_redirect() -> Result<()> {
    // Node A holds key 1, node B key 2 (a node missed a rotation, or a forger's key):
    // nothing B sends is taken by A, and each frame is counted as redirect_bad_mac.
    let t = Topo::build("rbk", &[], [Some(1), Some(2)])?;
    set_route(&t.router, &[0])?;
    let mut conns = open(&t.client, 4).with_context(|| t.diag("opening"))?;
    ensure!(conns.iter().all(|c| c.1 == "podA"));
    t.fresh_stats()?;
    let bad_before = t.nodes[0].drops("redirect_bad_mac");
    // Node A withdraws: the connections reach B, which redirects them to A.
    set_route(&t.router, &[1])?;
    for (c, _) in &conns {
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
    }
    let (failures, ok) = round(&mut conns);
    ensure!(
        ok == 0 && failures.len() == conns.len(),
        "{}",
        t.diag(&format!("{ok} requests served across different keys"))
    );
    t.fresh_stats()?;
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    let (a_from_b, b_to_a) = (t.nodes[0].peer(NODE[1]), t.nodes[1].peer(NODE[0]));
    eprintln!("A from B {a_from_b}; B to A {b_to_a}");
    ensure!(
        n(&b_to_a, "redirected_to") > 0,
        "{}",
        t.diag("B never redirected to A")
    );
    ensure!(
        t.nodes[0].drops("redirect_bad_mac") > bad_before,
        "{}",
        t.diag("A counted no redirect_bad_mac")
    );
    ensure!(
        n(&a_from_b, "received_from") == 0 && n(&b_to_a, "notices_received") == 0,
        "{}",
        t.diag("a redirect or notice was accepted across different keys")
    );
    drop(conns);
    t.finish()
}

/// A 4 MiB transfer to the IPv6 VIP with curl from the client, paced (`--limit-rate`) so
/// it runs for seconds, across the route changes: `upload` false downloads
/// `/bytes/4194304` and checks every byte, true posts 4 MiB to `/upload` and checks the
/// Pod's length and hash of what it received.
fn paced_transfer6(client: &str, upload: bool) -> std::thread::JoinHandle<Result<()>> {
    let client = client.to_string();
    std::thread::spawn(move || -> Result<()> {
        let body = pattern(4 << 20);
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("body");
        let f = file.to_str().context("path")?.to_string();
        let base = format!("http://[{VIP6}]");
        let mut argv: Vec<String> = ["netns", "exec", &client, "curl", "-gsS", "-m", "60"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        argv.extend(["--limit-rate".into(), "700K".into()]);
        if upload {
            std::fs::write(&file, &body)?;
            argv.extend(
                [
                    "-H",
                    "Expect:",
                    "-H",
                    "Content-Type: application/octet-stream",
                    "--data-binary",
                ]
                .map(String::from),
            );
            argv.push(format!("@{f}"));
            argv.push(format!("{base}/upload"));
        } else {
            argv.extend([
                "-o".into(),
                f.clone(),
                format!("{base}/bytes/{}", body.len()),
            ]);
        }
        let out = std::process::Command::new("ip").args(&argv).output()?;
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        ensure!(out.status.success(), "curl: {err}");
        if upload {
            let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
            let want = format!("{} {:016x}", body.len(), fnv64(&body));
            ensure!(
                got == want,
                "4 MiB upload: the Pod got {got:?}, want {want:?}"
            );
        } else {
            let got = std::fs::read(&file)?;
            ensure!(
                got == body,
                "4 MiB download: {} of {} bytes{}",
                got.len(),
                body.len(),
                if got.len() == body.len() {
                    ", altered"
                } else {
                    ""
                }
            );
        }
        Ok(())
    })
}

/// TSO of a namespace's `eth0` as `ethtool -k` reports it.
fn tso(ns: &Netns) -> Result<String> {
    let out = ns.exec(&["ethtool", "-k", "eth0"])?;
    Ok(out
        .lines()
        .find(|l| l.starts_with("tcp-segmentation-offload"))
        .unwrap_or_default()
        .to_string())
}

/// IPv6 (issue #28): the router's route to the IPv6 VIP moves A → A+B → B → A under
/// keep-alive connections and a 4 MiB transfer each way (the Pods' TSO on): every
/// request answered by the Pod its connection started on, both transfers whole — the
/// nodes ask each other about the IPv6 flows they never saw, over the IPv4 redirect
/// channel (version 3, tagged), and follow the owners' notices.
#[test]
fn ipv6_connections_and_4mib_transfers_survive_ecmp_changes_between_two_real_dataplanes(
) -> Result<()> {
    let opts = Opts {
        redirects: true,
        bridge: true,
    };
    let t = Topo::build_full("rd6", &[], [Some(1), Some(1)], opts)?;
    let (client, router, nodes) = (&t.client, &t.router, &t.nodes);
    let diag = |what: &str| t.diag(what);
    for n in nodes {
        let on = tso(&n.pod)?;
        ensure!(on.ends_with(": on"), "the Pods keep TSO on: {on}");
    }
    t.fresh_stats()?;
    let no_neighbour_before = nodes.each_ref().map(|n| n.drops("no_neighbour"));

    // 1. Only node A announces the IPv6 VIP: 32 keep-alive connections on pod A, and
    //    both transfers start.
    set_route6(router, &[0])?;
    let mut conns = open6(client, 32).with_context(|| diag("opening"))?;
    ensure!(conns.iter().all(|c| c.1 == "podA"));
    let transfers = [
        paced_transfer6(client.name(), false),
        paced_transfer6(client.name(), true),
    ];
    std::thread::sleep(Duration::from_secs(1));
    let mut failures = Vec::new();
    let mut requests = 0;
    let mut rounds = |conns: &mut Vec<(TcpStream, String)>| {
        for _ in 0..3 {
            let (f, ok) = round(conns);
            failures.extend(f);
            requests += ok;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    // 2. ECMP over A and B: about half the connections (and maybe a transfer) move to B.
    set_route6(router, &[0, 1])?;
    rounds(&mut conns);
    let mut fresh = open6(client, 16).with_context(|| diag("opening under ECMP"))?;
    ensure!(
        fresh.iter().any(|c| c.1 == "podB"),
        "no new IPv6 connection reached node B under ECMP"
    );
    conns.append(&mut fresh);
    // 3. A withdraws: everything reaches B, which sends A's flows to A.
    set_route6(router, &[1])?;
    rounds(&mut conns);
    // 4. Back to A only: B's connections reach A, which sends them to B.
    set_route6(router, &[0])?;
    rounds(&mut conns);
    let mut fresh = open6(client, 8).with_context(|| diag("opening after"))?;
    ensure!(fresh.iter().all(|c| c.1 == "podA"));
    conns.append(&mut fresh);
    let (f, ok) = round(&mut conns);
    failures.extend(f);
    requests += ok;
    for (what, h) in ["download", "upload"].iter().zip(transfers) {
        let r = h
            .join()
            .map_err(|_| anyhow::anyhow!("{what} thread panicked"))?;
        r.with_context(|| diag(&format!("the 4 MiB {what} across the moves")))?;
    }

    t.fresh_stats()?;
    let (a_to_b, b_to_a) = (nodes[0].peer(NODE[1]), nodes[1].peer(NODE[0]));
    eprintln!(
        "IPv6 requests ok {requests}, failures {}; A→B {a_to_b}; B→A {b_to_a}",
        failures.len()
    );
    if !failures.is_empty() {
        bail!(diag(&format!(
            "{} failed requests: {failures:?}",
            failures.len()
        )));
    }
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    ensure!(
        n(&b_to_a, "redirected_to") > 0,
        "{}",
        diag("B never redirected to A")
    );
    ensure!(
        n(&a_to_b, "redirected_to") > 0,
        "{}",
        diag("A never redirected to B")
    );
    ensure!(
        n(&b_to_a, "notices_received") > 0 && n(&a_to_b, "notices_received") > 0,
        "{}",
        diag("an owner never told the other node it owns a flow")
    );
    for (node, before) in nodes.iter().zip(no_neighbour_before) {
        ensure!(
            node.drops("no_neighbour") == before,
            "{}",
            diag(&format!(
                "packets dropped as no_neighbour after the warm-up ({before} before)"
            ))
        );
    }
    for node in nodes {
        for reason in [
            "non_syn_without_flow",
            "redirect_rate_limited",
            "redirect_prefix_rate_limited",
            "redirect_bad_mac",
            "redirect_too_big",
            "redirect_malformed",
            "redirect_not_served",
            "redirect_notice_refused",
        ] {
            ensure!(
                node.drops(reason) == 0,
                "{}",
                diag(&format!("{reason} drops"))
            );
        }
    }
    drop(conns);
    t.finish()
}

/// The control of the test above: the same move with redirects off breaks the IPv6
/// connections that land on the node without their flow (dropped there as
/// `non_syn_without_flow`) — what the redirects save.
#[test]
fn without_redirects_ipv6_connections_moved_to_another_node_break() -> Result<()> {
    let opts = Opts {
        redirects: false,
        bridge: true,
    };
    let t = Topo::build_full("rd6off", &[], [None, None], opts)?;
    set_route6(&t.router, &[0])?;
    let mut conns = open6(&t.client, 8).with_context(|| t.diag("opening"))?;
    ensure!(conns.iter().all(|c| c.1 == "podA"));
    t.fresh_stats()?;
    let before = t.nodes[1].drops("non_syn_without_flow");
    set_route6(&t.router, &[1])?;
    for (c, _) in &conns {
        c.set_read_timeout(Some(Duration::from_secs(3)))?;
    }
    let (failures, ok) = round(&mut conns);
    eprintln!("without redirects: {ok} answered, failures {failures:?}");
    ensure!(
        ok == 0 && failures.len() == conns.len(),
        "{}",
        t.diag(&format!(
            "{ok} moved connections answered without redirects"
        ))
    );
    t.fresh_stats()?;
    ensure!(
        t.nodes[1].drops("non_syn_without_flow") > before,
        "{}",
        t.diag("node B counted no non_syn_without_flow")
    );
    drop(conns);
    t.finish()
}

/// IPv6 under the Cluster policy: node B has no IPv6 backend, the router sends it every
/// IPv6 connection, and each one reaches node A's Pod (the SYN handed on, uncharged,
/// the rest following the record A's notice left) — however small the buckets.
#[test]
fn under_the_cluster_policy_a_node_without_an_ipv6_backend_hands_every_connection_over(
) -> Result<()> {
    let bucket = [
        "--redirect-rate",
        "1",
        "--redirect-burst",
        "1",
        "--redirect-prefix-rate",
        "1",
        "--redirect-prefix-burst",
        "1",
    ];
    let opts = Opts {
        redirects: true,
        bridge: true,
    };
    let mut t = Topo::build_full("rc6", &bucket, [Some(1), Some(1)], opts)?;
    t.nodes[0].publish(&node_state(0, Some(1), true, true)?)?;
    t.nodes[1].publish(&node_state(1, Some(1), false, true)?)?;
    set_route6(&t.router, &[1])?;
    let mut conns = open6(&t.client, 40).with_context(|| t.diag("connections through node B"))?;
    let by: Vec<&str> = conns.iter().map(|c| c.1.as_str()).collect();
    ensure!(
        by.iter().all(|p| *p == "podA"),
        "{}",
        t.diag(&format!("served by {by:?}"))
    );
    for _ in 0..3 {
        let (failures, _) = round(&mut conns);
        ensure!(failures.is_empty(), "{}", t.diag(&failures.join("\n")));
    }
    let b = &t.nodes[1];
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.peer(NODE[0])["redirected_to"].as_u64().unwrap_or(0) < 40 {
        ensure!(
            Instant::now() < deadline,
            "{}",
            t.diag("node B handed on fewer packets than connections")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for reason in [
        "redirect_rate_limited",
        "redirect_prefix_rate_limited",
        "no_backend",
    ] {
        ensure!(b.drops(reason) == 0, "{}", t.diag(reason));
    }
    drop(conns);
    t.finish()
}
