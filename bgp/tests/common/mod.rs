//! Test bed: network namespaces with a real router daemon (BIRD 2, FRR or GoBGP) and one
//! `juneau-bgp` per node namespace, driven through a real node-state file.
//!
//! Topology: node `i` (namespace `<p>n<i>`, interface `uplink`, 10.0.<i+1>.2/24) is wired
//! to the router (namespace `<p>r`, interface `d<i>`, 10.0.<i+1>.1/24). Everything is
//! removed on drop (namespaces take their veths and leftover processes with them).

#![allow(dead_code)]

pub mod dataplane;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use juneau_control::model::{AdvertisedVip, NodeState, PeerConfig};
use juneau_control::shm::{Capacity, NodeStateWriter};
use juneau_tests::bird::{BgpNeighbor, Bird, BirdConfig};
use juneau_tests::netns::{unique_prefix, veth, Netns, NsChild};

pub const ROUTER_ASN: u32 = 65000;
pub const NODE_ASN: u32 = 65001;
pub const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

pub fn router_addr(node: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, node as u8 + 1, 1)
}

pub fn node_addr(node: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, node as u8 + 1, 2)
}

/// The router's IPv6 address on node `node`'s link (after [`Topo::add_ipv6`]).
pub const fn router_addr6(node: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0, node as u16 + 1, 0, 0, 0, 1)
}

/// Node `node`'s global IPv6 address on its link (after [`Topo::add_ipv6`]).
pub const fn node_addr6(node: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0, node as u16 + 1, 0, 0, 0, 2)
}

/// Prints a convergence measurement and appends it to
/// `$CARGO_TARGET_TMPDIR/bgp-convergence.tsv` (router, event, milliseconds), so it is
/// kept even when the test harness captures output.
pub fn record(kind: RouterKind, event: &str, took: Duration) {
    let ms = took.as_secs_f64() * 1e3;
    println!("{kind:?}: {event}: {ms:.1} ms");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bgp-convergence.tsv");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        use std::io::Write;
        let _ = writeln!(f, "{kind:?}\t{event}\t{ms:.1}");
    }
}

/// Fails with a message naming the setup step when a binary is missing.
pub fn require(bin: &str) -> Result<()> {
    if Path::new(bin).exists()
        || Command::new("which")
            .arg(bin)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    {
        Ok(())
    } else {
        bail!("`{bin}` is not installed: run tests/setup.sh (Debian packages bird2, frr, gobgpd)")
    }
}

/// Polls `f` until it returns `Some`, or fails after `timeout` with `what`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    juneau_tests::daemon::wait_for(what, timeout, Duration::from_millis(20), f)
}

pub struct Topo {
    pub prefix: String,
    pub router: Netns,
    pub nodes: Vec<Netns>,
    pub dir: tempfile::TempDir,
}

impl Topo {
    pub fn new(tag: &str, nodes: usize) -> Result<Self> {
        let prefix = unique_prefix(tag);
        let router = Netns::new(format!("{prefix}r"))?;
        let mut ns = Vec::new();
        for i in 0..nodes {
            let n = Netns::new(format!("{prefix}n{i}"))?;
            veth(&n, "uplink", &router, &format!("d{i}"))?;
            n.addr("uplink", &format!("{}/24", node_addr(i)))?;
            router.addr(&format!("d{i}"), &format!("{}/24", router_addr(i)))?;
            ns.push(n);
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("{prefix}-"))
            .tempdir()?;
        Ok(Topo {
            prefix,
            router,
            nodes: ns,
            dir,
        })
    }

    /// Adds [`node_addr6`] and [`router_addr6`] (/64) on every node's link, without
    /// duplicate address detection (`nodad`), so the speaker can bind them at once.
    pub fn add_ipv6(&self) -> Result<()> {
        for (i, n) in self.nodes.iter().enumerate() {
            let (na, ra) = (node_addr6(i), router_addr6(i));
            n.exec(&[
                "ip",
                "addr",
                "add",
                &format!("{na}/64"),
                "dev",
                "uplink",
                "nodad",
            ])?;
            let dev = format!("d{i}");
            self.router.exec(&[
                "ip",
                "addr",
                "add",
                &format!("{ra}/64"),
                "dev",
                &dev,
                "nodad",
            ])?;
        }
        Ok(())
    }

    /// Next hops of `prefix` in the router namespace's kernel table (`ip route`).
    pub fn kernel_nexthops(&self, prefix: Ipv4Addr) -> Result<Vec<Ipv4Addr>> {
        juneau_tests::netns::route_next_hops(self.router.name(), prefix)
    }
}

/// How a node's speaker peers with the router.
#[derive(Clone)]
pub struct NodePeering {
    pub password: Option<String>,
    pub graceful_restart: bool,
}

impl Default for NodePeering {
    fn default() -> Self {
        NodePeering {
            password: None,
            graceful_restart: true,
        }
    }
}

/// One node: its control-state writer and its `juneau-bgp` process.
pub struct Speaker {
    pub node: usize,
    ns_name: String,
    pub state_path: PathBuf,
    pub status_path: PathBuf,
    pub log_path: PathBuf,
    writer: NodeStateWriter,
    pub state: NodeState,
    child: Option<NsChild>,
    restarts: u32,
    /// More juneau-bgp arguments (e.g. `--bfd-status-file`), used from the next spawn on.
    pub extra_args: Vec<String>,
    /// Dataplane-gate arguments for the next `spawn`; empty: `--no-dataplane-gate`.
    pub gate_args: Vec<String>,
    /// `--listen` of the next `spawn` (default `0.0.0.0:179`; `[::]:179` also takes
    /// IPv6 sessions).
    pub listen: String,
}

impl Speaker {
    pub fn peer_config(node: usize, p: &NodePeering) -> PeerConfig {
        let mut pc = PeerConfig::new("router", router_addr(node), ROUTER_ASN, NODE_ASN);
        pc.hold_time = 9;
        pc.keepalive_time = 3;
        pc.connect_retry_time = 1;
        pc.md5_password = p.password.clone().map(Into::into);
        pc.graceful_restart_time = p.graceful_restart.then_some(120);
        pc
    }

    pub fn start(topo: &Topo, node: usize, peering: &NodePeering) -> Result<Self> {
        Self::start_with_peers(topo, node, vec![Self::peer_config(node, peering)])
    }

    pub fn start_with_peers(topo: &Topo, node: usize, peers: Vec<PeerConfig>) -> Result<Self> {
        let mut s = Self::start_with_peers_stopped(topo, node, peers)?;
        s.spawn(&topo.nodes[node])?;
        Ok(s)
    }

    /// Like [`start_with_peers`](Self::start_with_peers), with more juneau-bgp arguments.
    pub fn start_with_args(
        topo: &Topo,
        node: usize,
        peers: Vec<PeerConfig>,
        args: &[&str],
    ) -> Result<Self> {
        let mut s = Self::start_with_peers_stopped(topo, node, peers)?;
        s.extra_args = args.iter().map(|a| a.to_string()).collect();
        s.spawn(&topo.nodes[node])?;
        Ok(s)
    }

    fn start_with_peers_stopped(topo: &Topo, node: usize, peers: Vec<PeerConfig>) -> Result<Self> {
        let state_path = topo.dir.path().join(format!("node{node}.state"));
        let status_path = topo.dir.path().join(format!("node{node}.status.json"));
        let log_path = topo.dir.path().join(format!("node{node}.log"));
        let mut writer = NodeStateWriter::create(&state_path, Capacity::default())?;
        let state = NodeState {
            node: format!("node{node}"),
            router_id: Some(node_addr(node)),
            peers,
            ..Default::default()
        };
        writer.publish(&state)?;
        Ok(Speaker {
            node,
            ns_name: topo.nodes[node].name().to_string(),
            state_path,
            status_path,
            log_path,
            writer,
            state,
            child: None,
            restarts: 0,
            extra_args: vec![],
            gate_args: Vec::new(),
            listen: "0.0.0.0:179".into(),
        })
    }

    /// Starts juneau-bfd for this node (BFD apart from the speaker); its status file is
    /// `node<i>.bfd.json`, to hand to juneau-bgp as `--bfd-status-file`.
    pub fn start_bfd(&self, ns: &Netns) -> Result<BfdDaemon> {
        let status_path = self.state_path.with_extension("bfd.json");
        let log_path = self.state_path.with_extension("bfd.log");
        let child = ns.spawn_logged(
            &[
                env!("CARGO_BIN_EXE_juneau-bfd"),
                "--state-file",
                self.state_path.to_str().unwrap(),
                "--status-file",
                status_path.to_str().unwrap(),
            ],
            &log_path,
        )?;
        Ok(BfdDaemon {
            child: Some(child),
            status_path,
            log_path,
        })
    }

    pub fn spawn(&mut self, ns: &Netns) -> Result<()> {
        let log = self
            .log_path
            .with_extension(format!("{}.log", self.restarts));
        self.restarts += 1;
        let no_gate = ["--no-dataplane-gate".to_string()];
        let gate: Vec<&str> = if self.gate_args.is_empty() {
            no_gate.iter().map(String::as_str).collect()
        } else {
            self.gate_args.iter().map(String::as_str).collect()
        };
        let child = ns.spawn_logged(
            &[
                env!("CARGO_BIN_EXE_juneau-bgp"),
                "--state-file",
                self.state_path.to_str().unwrap(),
                "--status-file",
                self.status_path.to_str().unwrap(),
                "--listen",
                &self.listen,
                "--metrics-addr",
                "127.0.0.1:9179",
            ]
            .into_iter()
            .chain(gate)
            .chain(self.extra_args.iter().map(String::as_str))
            .collect::<Vec<&str>>(),
            &log,
        )?;
        self.child = Some(child);
        Ok(())
    }

    /// Kills the daemon with SIGKILL (a crash: no NOTIFICATION, the kernel closes TCP).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }

    /// Sends SIGTERM and waits for the daemon to exit.
    pub fn terminate(&mut self) -> Result<()> {
        let Some(c) = self.child.as_mut() else {
            bail!("not running")
        };
        c.signal(15);
        wait_for(
            "juneau-bgp to exit after SIGTERM",
            Duration::from_secs(10),
            || Ok((!c.is_running()).then_some(())),
        )?;
        self.child = None;
        Ok(())
    }

    pub fn publish_vips(&mut self, vips: &[Ipv4Addr]) -> Result<()> {
        let vips: Vec<IpAddr> = vips.iter().map(|v| IpAddr::V4(*v)).collect();
        self.publish_ip_vips(&vips)
    }

    /// Like [`publish_vips`](Self::publish_vips), IPv4 or IPv6, to every peer.
    pub fn publish_ip_vips(&mut self, vips: &[IpAddr]) -> Result<()> {
        self.state.advertised = vips
            .iter()
            .map(|v| AdvertisedVip {
                vip: *v,
                communities: vec![(65001 << 16) | 100],
                large_communities: vec![[65001, 1, 2]],
                local_pref: None,
                peers: vec![],
                weight: None,
            })
            .collect();
        self.writer.publish(&self.state)?;
        Ok(())
    }

    pub fn publish_state(&mut self, state: &NodeState) -> Result<()> {
        self.state = state.clone();
        self.writer.publish(&self.state)?;
        Ok(())
    }

    pub fn status(&self) -> Result<serde_json::Value> {
        let b = std::fs::read(&self.status_path)
            .with_context(|| format!("reading {}", self.status_path.display()))?;
        Ok(serde_json::from_slice(&b)?)
    }

    /// `GET path` of the speaker's metrics endpoint (127.0.0.1:9179 in the node's
    /// namespace): HTTP status code and body.
    pub fn http(&self, path: &str) -> Result<(u16, String)> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns_name, "curl", "-sS", "-m", "5"])
            .args([
                "-w",
                "\n%{http_code}",
                &format!("http://127.0.0.1:9179{path}"),
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        let code = code.trim().parse().with_context(|| {
            format!("GET {path}: {text}{}", String::from_utf8_lossy(&out.stderr))
        })?;
        Ok((code, body.to_string()))
    }

    /// The value of the sample `series` (name with labels, exactly as exported) on
    /// `/metrics`, if present.
    pub fn metric(&self, series: &str) -> Result<Option<f64>> {
        let (_, body) = self.http("/metrics")?;
        Ok(body.lines().find_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            (name == series).then(|| v.parse().ok())?
        }))
    }

    pub fn peer_state(&self, peer: &str) -> Result<String> {
        let s = self.status()?;
        Ok(s["peers"][peer]["state"].as_str().unwrap_or("").to_string())
    }

    pub fn wait_established(&self, peer: &str, timeout: Duration) -> Result<()> {
        wait_for(
            &format!("node{} session to {peer} Established", self.node),
            timeout,
            || Ok((self.peer_state(peer)? == "Established").then_some(())),
        )
        .with_context(|| self.logs())
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for i in 0..self.restarts {
            let p = self.log_path.with_extension(format!("{i}.log"));
            s += &format!(
                "--- {} ---\n{}\n",
                p.display(),
                std::fs::read_to_string(&p).unwrap_or_default()
            );
        }
        s
    }
}

impl Drop for Speaker {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("JUNEAU_TEST_SHOW_LOGS").is_some() {
            eprintln!(
                "juneau-bgp logs of node {} ({}):\n{}",
                self.node,
                self.ns_name,
                self.logs()
            );
        }
        self.kill();
    }
}

/// A juneau-bfd process of one node.
pub struct BfdDaemon {
    child: Option<NsChild>,
    pub status_path: PathBuf,
    pub log_path: PathBuf,
}

impl BfdDaemon {
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for the daemon to exit.
    pub fn terminate(&mut self) -> Result<()> {
        let Some(c) = self.child.as_mut() else {
            bail!("not running")
        };
        c.signal(15);
        wait_for(
            "juneau-bfd to exit after SIGTERM",
            Duration::from_secs(10),
            || Ok((!c.is_running()).then_some(())),
        )?;
        self.child = None;
        Ok(())
    }
}

impl Drop for BfdDaemon {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("JUNEAU_TEST_SHOW_LOGS").is_some() {
            eprintln!("juneau-bfd logs:\n{}", self.logs());
        }
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    Bird,
    Frr,
    Gobgp,
}

/// A neighbor as the router sees it.
pub struct Neighbor {
    pub node: usize,
    pub password: Option<String>,
}

/// A router daemon running in the router namespace.
pub struct Router {
    pub kind: RouterKind,
    ns_name: String,
    dir: PathBuf,
    children: Vec<NsChild>,
    log_files: Vec<PathBuf>,
    bird: Option<Bird>,
}

impl Router {
    pub fn start(topo: &Topo, kind: RouterKind, neighbors: &[Neighbor]) -> Result<Self> {
        let dir = topo.dir.path().join("router");
        std::fs::create_dir_all(&dir)?;
        let mut r = Router {
            kind,
            ns_name: topo.router.name().to_string(),
            dir: dir.clone(),
            children: vec![],
            log_files: vec![],
            bird: None,
        };
        let rid = router_addr(0);
        match kind {
            RouterKind::Bird => {
                let mut cfg = BirdConfig::new(rid).kernel_ecmp();
                for n in neighbors {
                    cfg = cfg.bgp(
                        &BgpNeighbor::new(
                            &format!("node{}", n.node),
                            router_addr(n.node),
                            ROUTER_ASN,
                            node_addr(n.node),
                            NODE_ASN,
                        )
                        .graceful_restart(120)
                        .password(n.password.clone()),
                    );
                }
                r.spawn_bird(&topo.router, &cfg.render())?;
            }
            RouterKind::Frr => {
                require("/usr/lib/frr/bgpd")?;
                require("/usr/lib/frr/zebra")?;
                let mut cfg = format!(
                    "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
                     bgp router-id {rid}\n no bgp ebgp-requires-policy\n bgp graceful-restart\n"
                );
                for n in neighbors {
                    let na = node_addr(n.node);
                    cfg += &format!(" neighbor {na} remote-as {NODE_ASN}\n neighbor {na} timers 3 9\n neighbor {na} timers connect 1\n");
                    if let Some(p) = &n.password {
                        cfg += &format!(" neighbor {na} password {p}\n");
                    }
                }
                cfg += " address-family ipv4 unicast\n  maximum-paths 8\n exit-address-family\n!\n";
                r.spawn_frr(topo, &cfg, None)?;
            }
            RouterKind::Gobgp => {
                require("gobgpd")?;
                require("gobgp")?;
                let mut cfg = format!(
                    "[global.config]\n  as = {ROUTER_ASN}\n  router-id = \"{rid}\"\n  port = 179\n"
                );
                for n in neighbors {
                    cfg += &format!(
                        "[[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{na}\"\n    peer-as = {NODE_ASN}\n{pw}\
                         [neighbors.timers.config]\n    hold-time = 9\n    keepalive-interval = 3\n    connect-retry = 1\n\
                         [neighbors.graceful-restart.config]\n    enabled = true\n    restart-time = 120\n\
                         [[neighbors.afi-safis]]\n  [neighbors.afi-safis.config]\n    afi-safi-name = \"ipv4-unicast\"\n\
                         [neighbors.afi-safis.mp-graceful-restart.config]\n    enabled = true\n",
                        na = node_addr(n.node),
                        pw = n.password.as_ref().map(|p| format!("    auth-password = \"{p}\"\n")).unwrap_or_default(),
                    );
                }
                r.spawn_gobgp(&topo.router, &cfg)?;
            }
        }
        Ok(r)
    }

    /// FRR (zebra, bgpd, and bfdd when `bfdd_cfg` is given) with configurations written
    /// by the test.
    pub fn start_frr_with_config(
        topo: &Topo,
        bgpd_cfg: &str,
        bfdd_cfg: Option<&str>,
    ) -> Result<Self> {
        require("/usr/lib/frr/bgpd")?;
        let dir = topo.dir.path().join("router");
        std::fs::create_dir_all(&dir)?;
        let mut r = Router {
            kind: RouterKind::Frr,
            ns_name: topo.router.name().to_string(),
            dir,
            children: vec![],
            log_files: vec![],
            bird: None,
        };
        r.spawn_frr(topo, bgpd_cfg, bfdd_cfg)?;
        Ok(r)
    }

    fn spawn_frr(&mut self, topo: &Topo, cfg: &str, bfdd_cfg: Option<&str>) -> Result<()> {
        let r = self;
        let dir = r.dir.clone();
        std::fs::write(dir.join("bgpd.conf"), cfg)?;
        let mut daemons = vec![
            ("zebra", vec![]),
            ("bgpd", vec!["-p".to_string(), "179".to_string()]),
        ];
        if let Some(b) = bfdd_cfg {
            std::fs::write(dir.join("bfdd.conf"), b)?;
            daemons.insert(
                1,
                (
                    "bfdd",
                    vec![
                        "--bfdctl".to_string(),
                        dir.join("bfdd.sock").to_str().unwrap().to_string(),
                    ],
                ),
            );
        }
        std::fs::write(dir.join("zebra.conf"), "hostname router\n!\n")?;
        // The daemons drop to the `frr` user: let it reach and write the directory.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(topo.dir.path(), std::fs::Permissions::from_mode(0o755))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
        let zsock = dir.join("zserv.api");
        for (daemon, extra) in daemons {
            let log = dir.join(format!("{daemon}.log"));
            let mut argv: Vec<String> = vec![
                format!("/usr/lib/frr/{daemon}"),
                "-f".into(),
                dir.join(format!("{daemon}.conf")).to_str().unwrap().into(),
                "-i".into(),
                dir.join(format!("{daemon}.pid")).to_str().unwrap().into(),
                "-z".into(),
                zsock.to_str().unwrap().into(),
                "--vty_socket".into(),
                dir.to_str().unwrap().into(),
                "-u".into(),
                "frr".into(),
                "-g".into(),
                "frr".into(),
                "-A".into(),
                "127.0.0.1".into(),
            ];
            argv.extend(extra);
            let argv: Vec<&str> = argv.iter().map(|s| s.as_str()).collect();
            let child = topo.router.spawn_logged(&argv, &log)?;
            r.children.push(child);
            r.log_files.push(log);
            if daemon == "zebra" {
                wait_for("zebra socket", Duration::from_secs(10), || {
                    Ok(zsock.exists().then_some(()))
                })?;
            }
        }
        let vty = dir.join("bgpd.vty");
        wait_for("bgpd vty socket", Duration::from_secs(10), || {
            Ok(vty.exists().then_some(()))
        })?;
        Ok(())
    }

    /// FRR only: runs a vtysh command.
    pub fn vtysh(&self, cmd: &str) -> Result<String> {
        self.cli(&[
            "vtysh",
            "--vty_socket",
            self.dir.to_str().unwrap(),
            "-c",
            cmd,
        ])
    }

    /// GoBGP with a TOML configuration written by the test (API on 127.0.0.1:50051).
    pub fn start_gobgp_with_config(topo: &Topo, toml: &str) -> Result<Self> {
        require("gobgpd")?;
        require("gobgp")?;
        let dir = topo.dir.path().join("router");
        std::fs::create_dir_all(&dir)?;
        let mut r = Router {
            kind: RouterKind::Gobgp,
            ns_name: topo.router.name().to_string(),
            dir: dir.clone(),
            children: vec![],
            log_files: vec![],
            bird: None,
        };
        r.spawn_gobgp(&topo.router, toml)?;
        Ok(r)
    }

    /// BIRD with a configuration written by the test.
    pub fn start_bird_with_config(topo: &Topo, cfg: &str) -> Result<Self> {
        let dir = topo.dir.path().join("router");
        std::fs::create_dir_all(&dir)?;
        let mut r = Router {
            kind: RouterKind::Bird,
            ns_name: topo.router.name().to_string(),
            dir,
            children: vec![],
            log_files: vec![],
            bird: None,
        };
        r.spawn_bird(&topo.router, cfg)?;
        Ok(r)
    }

    /// gobgpd with this TOML configuration, its API on 127.0.0.1:50051, in `ns`.
    fn spawn_gobgp(&mut self, ns: &Netns, toml: &str) -> Result<()> {
        let conf = self.dir.join("gobgpd.toml");
        std::fs::write(&conf, toml)?;
        let log = self.dir.join("gobgpd.log");
        let child = ns.spawn_logged(
            &[
                "gobgpd",
                "-f",
                conf.to_str().unwrap(),
                "-t",
                "toml",
                "-p",
                "--pprof-disable",
                "--api-hosts",
                "127.0.0.1:50051",
            ],
            &log,
        )?;
        self.children.push(child);
        self.log_files.push(log);
        wait_for("gobgpd API", Duration::from_secs(10), || {
            Ok(self
                .cli(&["gobgp", "-u", "127.0.0.1", "-p", "50051", "global"])
                .is_ok()
                .then_some(()))
        })?;
        Ok(())
    }

    /// The one BIRD implementation of the harness (juneau_tests::bird).
    fn spawn_bird(&mut self, ns: &Netns, cfg: &str) -> Result<()> {
        let bird = Bird::start(ns.name(), &self.dir, cfg)?;
        self.log_files.push(bird.log().to_path_buf());
        self.bird = Some(bird);
        Ok(())
    }

    fn cli(&self, argv: &[&str]) -> Result<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns_name])
            .args(argv)
            .output()?;
        if !out.status.success() {
            bail!(
                "{argv:?} failed: {}{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The BGP next hops the router has for `prefix`/32 (every path, best or not).
    pub fn bgp_nexthops(&self, prefix: Ipv4Addr) -> Result<Vec<Ipv4Addr>> {
        let p = format!("{prefix}/32");
        let mut hops: Vec<Ipv4Addr> = match self.kind {
            RouterKind::Bird => {
                juneau_tests::bird::bgp_nexthops(&self.dir.join("bird.ctl"), prefix)?
            }
            RouterKind::Frr => {
                let out = self.cli(&[
                    "vtysh",
                    "--vty_socket",
                    self.dir.to_str().unwrap(),
                    "-c",
                    &format!("show ip bgp {p} json"),
                ])?;
                let v: serde_json::Value =
                    serde_json::from_str(&out).with_context(|| format!("FRR said: {out}"))?;
                v["paths"]
                    .as_array()
                    .map(|paths| {
                        paths
                            .iter()
                            .flat_map(|path| {
                                path["nexthops"].as_array().cloned().unwrap_or_default()
                            })
                            .filter_map(|nh| nh["ip"].as_str().and_then(|s| s.parse().ok()))
                            .collect()
                    })
                    .unwrap_or_default()
            }
            RouterKind::Gobgp => {
                let out = self.cli(&[
                    "gobgp",
                    "-u",
                    "127.0.0.1",
                    "-p",
                    "50051",
                    "-j",
                    "global",
                    "rib",
                    "-a",
                    "ipv4",
                ])?;
                let v: serde_json::Value =
                    serde_json::from_str(&out).with_context(|| format!("gobgp said: {out}"))?;
                v[&p]
                    .as_array()
                    .map(|paths| {
                        paths
                            .iter()
                            .flat_map(|path| path["attrs"].as_array().cloned().unwrap_or_default())
                            .filter(|a| a["type"] == 3)
                            .filter_map(|a| a["nexthop"].as_str().and_then(|s| s.parse().ok()))
                            .collect()
                    })
                    .unwrap_or_default()
            }
        };
        hops.sort();
        Ok(hops)
    }

    /// GoBGP only: the next hops GoBGP's global RIB has for the IPv6 `prefix`/128 (every
    /// path; the MP_REACH_NLRI's global next hop).
    pub fn gobgp_nexthops6(&self, prefix: Ipv6Addr) -> Result<Vec<Ipv6Addr>> {
        if self.kind != RouterKind::Gobgp {
            bail!("not GoBGP");
        }
        let out = self.cli(&[
            "gobgp",
            "-u",
            "127.0.0.1",
            "-p",
            "50051",
            "-j",
            "global",
            "rib",
            "-a",
            "ipv6",
        ])?;
        let v: serde_json::Value =
            serde_json::from_str(&out).with_context(|| format!("gobgp said: {out}"))?;
        let mut hops: Vec<Ipv6Addr> = v[&format!("{prefix}/128")]
            .as_array()
            .map(|paths| {
                paths
                    .iter()
                    .flat_map(|path| path["attrs"].as_array().cloned().unwrap_or_default())
                    .filter(|a| a["type"] == 14)
                    .filter_map(|a| a["nexthop"].as_str().and_then(|s| s.parse().ok()))
                    .collect()
            })
            .unwrap_or_default();
        hops.sort();
        Ok(hops)
    }

    /// BIRD only: runs a `birdc` command.
    pub fn bird_cli(&self, args: &[&str]) -> Result<String> {
        juneau_tests::bird::birdc(&self.dir.join("bird.ctl"), args)
    }

    /// BIRD only: the state of a BGP protocol as `show protocols` prints it.
    pub fn bird_protocol_info(&self, name: &str) -> Result<String> {
        self.bird.as_ref().context("not BIRD")?.protocol_info(name)
    }

    /// The router's own rendering of its paths for `prefix`/32 (text or JSON).
    pub fn route_text(&self, prefix: Ipv4Addr) -> Result<String> {
        let p = format!("{prefix}/32");
        match self.kind {
            RouterKind::Bird => self.bird.as_ref().context("not BIRD")?.route_text(prefix),
            RouterKind::Frr => self.cli(&[
                "vtysh",
                "--vty_socket",
                self.dir.to_str().unwrap(),
                "-c",
                &format!("show ip bgp {p} json"),
            ]),
            RouterKind::Gobgp => self.cli(&[
                "gobgp",
                "-u",
                "127.0.0.1",
                "-p",
                "50051",
                "-j",
                "global",
                "rib",
                "-a",
                "ipv4",
                &p,
            ]),
        }
    }

    /// Strings the router shows for AS_PATH [65001], community 65001:100 and large
    /// community 65001:1:2.
    pub fn expected_attribute_texts(&self) -> &'static [&'static str] {
        match self.kind {
            RouterKind::Bird => &[
                "BGP.as_path: 65001",
                "(65001,100)",
                "(65001, 1, 2)",
                "BGP.origin: IGP",
            ],
            RouterKind::Frr => &[
                "\"65001:100\"",
                "\"65001:1:2\"",
                "\"string\":\"65001\"",
                "\"origin\":\"IGP\"",
            ],
            RouterKind::Gobgp => &[
                "\"asns\":[65001]",
                "4259905636",
                "\"ASN\":65001,\"LocalData1\":1,\"LocalData2\":2",
                "{\"type\":1,\"value\":0}",
            ],
        }
    }

    /// Waits until the router's paths for `prefix` have exactly these next hops.
    pub fn wait_nexthops(
        &self,
        prefix: Ipv4Addr,
        want: &[Ipv4Addr],
        timeout: Duration,
    ) -> Result<Duration> {
        let start = Instant::now();
        let mut want = want.to_vec();
        want.sort();
        wait_for(
            &format!("{:?} to have paths for {prefix}/32 via {want:?}", self.kind),
            timeout,
            || Ok((self.bgp_nexthops(prefix)? == want).then_some(())),
        )
        .with_context(|| self.logs())?;
        Ok(start.elapsed())
    }

    /// Everything the router daemons logged.
    pub fn full_log(&self) -> String {
        self.log_files
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect()
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for p in &self.log_files {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(60).collect();
            s += &format!("--- {} (last 60 lines) ---\n", p.display());
            for l in tail.iter().rev() {
                s += l;
                s.push('\n');
            }
        }
        s
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{:?} logs:\n{}", self.kind, self.logs());
        } else if std::env::var_os("JUNEAU_TEST_SHOW_LOGS").is_some() {
            eprintln!("{:?} logs:\n{}", self.kind, self.full_log());
        }
        for c in &mut self.children {
            c.kill();
        }
    }
}
