//! Issue 12 across real network namespaces: two real `juneau-dataplane` processes behind
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
//! Every time the route changes, connections land on a node that has never seen them:
//! that node redirects their packets to the other one (encapsulated, UDP 7411 over the
//! node network), which serves them from its own Pod; replies leave from the owner. The
//! test counts failed requests and resets (must be 0), checks every response came from
//! the Pod the connection started on (no connection moved backend), and reads the
//! dataplanes' per-peer redirect counters. The router is the kernel with a multipath
//! route (`fib_multipath_hash_policy=1`), not BIRD: the ECMP *change* is what matters here.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_control::shm::{Capacity, NodeStateWriter};
use juneau_tests::netns::{run, unique_prefix, veth, Netns, NsChild};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 10);
const NODE: [&str; 2] = ["10.1.0.2", "10.1.0.3"];
const POD: [&str; 2] = ["10.10.1.2", "10.10.2.2"];
const HTTP_PORT: u16 = 8080;

fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        let fd = std::fs::File::open(format!("/var/run/netns/{ns}")).expect("netns");
        // SAFETY: setns(2) on a valid namespace fd affects only the calling thread.
        let r = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {ns}");
        f()
    })
    .join()
    .expect("namespace thread panicked")
}

/// A keep-alive HTTP server in a Pod namespace answering `GET /` with its name.
struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(ns: &str, name: &'static str) -> Result<Self> {
        let l = in_ns(ns, || TcpListener::bind(("0.0.0.0", HTTP_PORT)))?;
        l.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((c, _)) => {
                        let s3 = s2.clone();
                        std::thread::spawn(move || serve(c, name, &s3));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Server {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut c: TcpStream, name: &str, stop: &AtomicBool) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        match c.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        }
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.drain(..end + 4);
            let body = format!("{name}\n");
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
            if c.write_all(head.as_bytes())
                .and_then(|_| c.write_all(body.as_bytes()))
                .is_err()
            {
                return;
            }
        }
    }
}

fn http_get(c: &mut TcpStream) -> Result<String> {
    c.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .context("no Content-Length")?
                .trim()
                .parse()?;
            if buf.len() >= end + 4 + len {
                return Ok(String::from_utf8_lossy(&buf[end + 4..end + 4 + len])
                    .trim()
                    .to_string());
            }
        }
        let n = c.read(&mut chunk)?;
        ensure!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
    }
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
    _server: Server,
    _writer: NodeStateWriter,
    stats: PathBuf,
    log: PathBuf,
    _pod: Netns,
    ns: Netns,
}

impl Node {
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

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn build_node(p: &str, i: usize, router: &Netns, dir: &std::path::Path) -> Result<Node> {
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
    ns.addr("pv0", &format!("10.10.{}.1/24", i + 1))?;
    pod.addr("eth0", &format!("{}/24", POD[i]))?;
    pod.exec(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        &format!("10.10.{}.1", i + 1),
    ])?;
    let server = Server::start(pod.name(), ["podA", "podB"][i])?;

    let state_path = dir.join(format!("{name}.state"));
    let mut writer = NodeStateWriter::create(&state_path, Capacity::default())?;
    writer.publish(&NodeState {
        node: format!("node-{name}"),
        services: vec![NodeService {
            frontend: Frontend {
                vip: VIP,
                protocol: Protocol::Tcp,
                port: 80,
            },
            backends: vec![LocalBackend {
                ip: POD[i].parse()?,
                port: HTTP_PORT,
            }],
        }],
        ..Default::default()
    })?;
    let bpf = dir.join(format!("bpf-{name}"));
    std::fs::create_dir_all(&bpf)?;
    run("mount", &["-t", "bpf", "bpf", bpf.to_str().unwrap()])?;
    let bpf = BpfMount(bpf);
    let stats = dir.join(format!("{name}.json"));
    let log = dir.join(format!("{name}.log"));
    let pin = bpf.0.join("pins");
    let argv = [
        env!("CARGO_BIN_EXE_juneau-dataplane"),
        "--uplink",
        "up0",
        "--pod-iface",
        "pv0",
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
        "--node-address",
        NODE[i],
        "--redirect-peer",
        NODE[0],
        "--redirect-peer",
        NODE[1],
        "--redirect-mtu",
        "1600",
    ];
    let dataplane = ns.spawn_logged(&argv, &log)?;
    let node = Node {
        dataplane,
        _bpf: bpf,
        _server: server,
        _writer: writer,
        stats,
        log,
        _pod: pod,
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
            Ok(body) if body == *pod => ok += 1,
            Ok(body) => failures.push(format!("conn {i}: answered by {body}, opened on {pod}")),
            Err(e) => failures.push(format!("conn {i} ({pod}): {e}")),
        }
    }
    (failures, ok)
}

fn open(client: &Netns, n: usize) -> Result<Vec<(TcpStream, String)>> {
    let mut conns = in_ns(client.name(), move || -> Result<Vec<TcpStream>> {
        let vip = SocketAddr::V4(SocketAddrV4::new(VIP, 80));
        (0..n)
            .map(|_| {
                let c = TcpStream::connect_timeout(&vip, Duration::from_secs(5))?;
                c.set_read_timeout(Some(Duration::from_secs(5)))?;
                Ok(c)
            })
            .collect()
    })?;
    let mut out = Vec::new();
    for mut c in conns.drain(..) {
        let pod = http_get(&mut c).context("first request on a new connection")?;
        out.push((c, pod));
    }
    Ok(out)
}

#[test]
fn connections_survive_ecmp_changes_between_two_real_dataplanes() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(unsafe { libc::geteuid() } == 0, "must run as root");
    let p = unique_prefix("rdr");
    let dir = tempfile::tempdir()?;
    let client = Netns::new(format!("{p}c"))?;
    let router = Netns::new(format!("{p}r"))?;
    veth(&client, "eth0", &router, "c0")?;
    client.addr("eth0", "10.100.1.2/24")?;
    router.addr("c0", "10.100.1.1/24")?;
    client.exec(&["ip", "route", "add", "default", "via", "10.100.1.1"])?;
    // Kernel sockets would hand over partial checksums; a real uplink NIC does not.
    client.exec(&["ethtool", "-K", "eth0", "tx", "off"])?;
    router.exec(&["ip", "link", "add", "br0", "mtu", "1600", "type", "bridge"])?;
    router.addr("br0", "10.1.0.1/24")?;
    for s in [
        "net.ipv4.ip_forward=1",
        "net.ipv4.fib_multipath_hash_policy=1",
        "net.ipv4.conf.all.rp_filter=0",
    ] {
        router.exec(&["sysctl", "-qw", s])?;
    }
    let nodes = [
        build_node(&p, 0, &router, dir.path())?,
        build_node(&p, 1, &router, dir.path())?,
    ];
    // Node addresses resolved once (peers are resolved on demand otherwise; the first
    // redirect to an unresolved peer is dropped and retransmitted).
    nodes[0].ns.exec(&["ping", "-c1", "-W2", NODE[1]])?;
    nodes[1].ns.exec(&["ping", "-c1", "-W2", NODE[0]])?;
    let diag = |what: &str| {
        format!(
            "{what}\nnode A stats: {}\nnode B stats: {}\nnode A log:\n{}\nnode B log:\n{}",
            nodes[0].stats().map(|s| s.to_string()).unwrap_or_default(),
            nodes[1].stats().map(|s| s.to_string()).unwrap_or_default(),
            nodes[0].log(),
            nodes[1].log()
        )
    };

    // 1. Only node A announces: 32 keep-alive connections, all on pod A.
    set_route(&router, &[0])?;
    let mut conns = open(&client, 32).with_context(|| diag("opening"))?;
    ensure!(
        conns.iter().all(|c| c.1 == "podA"),
        "{:?}",
        conns.iter().map(|c| &c.1).collect::<Vec<_>>()
    );
    let mut failures = Vec::new();
    let mut requests = 0;
    // 2. Node B gains its first backend: ECMP over A and B. About half the old
    //    connections now reach B, which has never seen them. New ones spread.
    set_route(&router, &[0, 1])?;
    for _ in 0..3 {
        let (f, ok) = round(&mut conns);
        failures.extend(f);
        requests += ok;
    }
    let mut fresh = open(&client, 16).with_context(|| diag("opening under ECMP"))?;
    ensure!(
        fresh.iter().any(|c| c.1 == "podB"),
        "no new connection reached node B under ECMP"
    );
    conns.append(&mut fresh);
    // 3. Node A withdraws (the drain case): everything reaches B; A keeps serving its
    //    connections through B's redirects.
    set_route(&router, &[1])?;
    for _ in 0..3 {
        let (f, ok) = round(&mut conns);
        failures.extend(f);
        requests += ok;
    }
    // 4. Back to A only: B's connections now reach A, which redirects them to B.
    set_route(&router, &[0])?;
    for _ in 0..3 {
        let (f, ok) = round(&mut conns);
        failures.extend(f);
        requests += ok;
    }
    let mut fresh = open(&client, 8).with_context(|| diag("opening after"))?;
    ensure!(fresh.iter().all(|c| c.1 == "podA"));
    conns.append(&mut fresh);
    let (f, ok) = round(&mut conns);
    failures.extend(f);
    requests += ok;

    // Stats are written about once a second.
    std::thread::sleep(Duration::from_millis(1500));
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
    for node in &nodes {
        let s = node.stats()?;
        ensure!(
            s["drops"]["redirect_rate_limited"] == 0 && s["drops"]["non_syn_without_flow"] == 0,
            "{}",
            diag("unexpected drops")
        );
    }
    drop(conns);
    let names: Vec<String> = [&client, &router]
        .iter()
        .map(|n| n.name().to_string())
        .chain(nodes.iter().map(|n| n.ns.name().to_string()))
        .collect();
    let pids: Vec<u32> = nodes.iter().map(|n| n.dataplane.id()).collect();
    drop(nodes);
    drop(router);
    drop(client);
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
