//! The one BIRD 2 router of the tests, the lab and the benchmarks: a configuration
//! builder ([`BirdConfig`]), the daemon in a network namespace ([`Bird`]) and its control
//! socket ([`BirdControl`], what `birdc` speaks).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use juneau_tests::bird::{Bird, BirdConfig, BgpNeighbor};
//! let conf = BirdConfig::new("10.0.1.1".parse()?)
//!     .kernel_ecmp()
//!     .bgp(&BgpNeighbor::new("node0", "10.0.1.1".parse()?, 65000, "10.0.1.2".parse()?, 65001));
//! let dir = tempfile::tempdir()?;
//! let bird = Bird::start("my-router-netns", dir.path(), &conf.render())?;
//! let hops = bird.bgp_nexthops("192.0.2.10".parse()?)?;
//! # Ok(()) }
//! ```

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::daemon::{tail, Daemon, DaemonSpec};

/// Where Debian's `bird2` package installs the daemon.
pub const BIRD: &str = "/usr/sbin/bird";

/// One eBGP or iBGP neighbour in a BIRD configuration.
#[derive(Debug, Clone)]
pub struct BgpNeighbor {
    /// Protocol name (`show protocols` shows it).
    pub name: String,
    /// Local address (IPv4 or IPv6: the session's family).
    pub local: IpAddr,
    /// Local AS number.
    pub local_as: u32,
    /// The neighbour's address (the family of `local`).
    pub neighbor: IpAddr,
    /// The neighbour's AS number.
    pub neighbor_as: u32,
    /// Hold time, seconds (keepalive is a third of it).
    pub hold_time: u32,
    /// `graceful restart on; graceful restart time N;` when set.
    pub graceful_restart_time: Option<u32>,
    /// TCP-MD5 password.
    pub password: Option<String>,
    /// Import/export policy of the channel of the session's family (`ipv4 { .. }` over
    /// IPv4, `ipv6 { .. }` over IPv6; default: import all, export none).
    pub ipv4_channel: String,
    /// More statements inside the protocol block (e.g. `multihop 2;`, `direct;`).
    pub extra: String,
}

impl BgpNeighbor {
    /// A neighbour with the tests' fast timers (hold 9 s, keepalive 3 s, connect retry
    /// 2 s, error wait 1..4 s) that imports every route and exports none.
    pub fn new(
        name: &str,
        local: Ipv4Addr,
        local_as: u32,
        neighbor: Ipv4Addr,
        neighbor_as: u32,
    ) -> Self {
        BgpNeighbor {
            name: name.to_string(),
            local: local.into(),
            local_as,
            neighbor: neighbor.into(),
            neighbor_as,
            hold_time: 9,
            graceful_restart_time: None,
            password: None,
            ipv4_channel: "import all; export none;".into(),
            extra: String::new(),
        }
    }

    /// A session over IPv6 (its channel is `ipv6`, carrying IPv6 unicast), with the
    /// timers and policy of [`BgpNeighbor::new`].
    pub fn new_v6(
        name: &str,
        local: Ipv6Addr,
        local_as: u32,
        neighbor: Ipv6Addr,
        neighbor_as: u32,
    ) -> Self {
        BgpNeighbor {
            local: local.into(),
            neighbor: neighbor.into(),
            ..BgpNeighbor::new(
                name,
                Ipv4Addr::UNSPECIFIED,
                local_as,
                Ipv4Addr::UNSPECIFIED,
                neighbor_as,
            )
        }
    }

    /// With graceful restart (RFC 4724) and this restart time.
    pub fn graceful_restart(mut self, seconds: u32) -> Self {
        self.graceful_restart_time = Some(seconds);
        self
    }

    /// With a TCP-MD5 password.
    pub fn password(mut self, password: Option<String>) -> Self {
        self.password = password;
        self
    }

    /// With more statements in the protocol block.
    pub fn extra(mut self, statements: &str) -> Self {
        self.extra.push_str(statements);
        self
    }

    /// With BFD for this session (`bfd on;`): needs a [`BirdConfig::bfd`] protocol.
    pub fn bfd(self) -> Self {
        self.extra("bfd on;\n")
    }

    /// With BIRD's debug messages about state changes and events in its log
    /// (`debug { states, events };`).
    pub fn debug_states(self) -> Self {
        self.extra("debug { states, events };\n")
    }

    /// With this ipv4 channel policy (e.g. `import all; export all;`).
    pub fn ipv4(mut self, channel: &str) -> Self {
        self.ipv4_channel = channel.to_string();
        self
    }

    fn render(&self, out: &mut String) {
        let _ = writeln!(out, "protocol bgp {} {{", self.name);
        let _ = writeln!(out, " local {} as {};", self.local, self.local_as);
        let _ = writeln!(out, " neighbor {} as {};", self.neighbor, self.neighbor_as);
        let _ = writeln!(
            out,
            " hold time {}; keepalive time {}; connect delay time 1; connect retry time 2; error wait time 1, 4;",
            self.hold_time,
            (self.hold_time / 3).max(1)
        );
        if let Some(t) = self.graceful_restart_time {
            let _ = writeln!(out, " graceful restart on; graceful restart time {t};");
        }
        if let Some(p) = &self.password {
            let _ = writeln!(out, " password \"{p}\";");
        }
        for l in self.extra.lines().filter(|l| !l.trim().is_empty()) {
            let _ = writeln!(out, " {}", l.trim());
        }
        let family = if self.neighbor.is_ipv6() {
            "ipv6"
        } else {
            "ipv4"
        };
        let _ = writeln!(out, " {family} {{ {} }};", self.ipv4_channel);
        let _ = writeln!(out, "}}");
    }
}

/// A BIRD 2 configuration, built statement by statement.
#[derive(Debug, Clone)]
pub struct BirdConfig {
    text: String,
}

impl BirdConfig {
    /// `router id`, a device protocol, and logging to stderr (the daemon's log file).
    pub fn new(router_id: Ipv4Addr) -> Self {
        BirdConfig {
            text: format!(
                "log stderr all;\nrouter id {router_id};\nprotocol device {{ scan time 10; }}\n"
            ),
        }
    }

    /// Installs the best routes into the kernel, equal BGP routes from several
    /// neighbours as one ECMP route (`merge paths on`), as an upstream router does; IPv4
    /// and IPv6 (one kernel protocol per family, as BIRD 2 needs).
    pub fn kernel_ecmp(mut self) -> Self {
        self.text.push_str(
            "protocol kernel {\n ipv4 { import none; export all; };\n merge paths on;\n}\n\
             protocol kernel {\n ipv6 { import none; export all; };\n merge paths on;\n}\n",
        );
        self
    }

    /// A BFD protocol (RFC 5880/5881) on `interface` with these intervals and detect
    /// multiplier, for neighbours with [`BgpNeighbor::bfd`].
    pub fn bfd(mut self, interface: &str, min_rx_ms: u32, min_tx_ms: u32, multiplier: u32) -> Self {
        let _ = writeln!(
            self.text,
            "protocol bfd {{ interface \"{interface}\" {{ min rx interval {min_rx_ms} ms; min tx interval {min_tx_ms} ms; multiplier {multiplier}; }}; }}"
        );
        self
    }

    /// Adds a BGP neighbour.
    pub fn bgp(mut self, n: &BgpNeighbor) -> Self {
        n.render(&mut self.text);
        self
    }

    /// Adds configuration text as it is (e.g. a `protocol static` block).
    pub fn raw(mut self, text: &str) -> Self {
        self.text.push_str(text);
        if !self.text.ends_with('\n') {
            self.text.push('\n');
        }
        self
    }

    /// The configuration text.
    pub fn render(&self) -> String {
        self.text.clone()
    }
}

/// A BIRD 2 daemon running in a network namespace, stopped on drop.
#[derive(Debug)]
pub struct Bird {
    daemon: Daemon,
    ctl: PathBuf,
    conf: PathBuf,
}

impl Bird {
    /// Writes `config` to `dir/bird.conf` (prefixed with `log stderr all;` when it names
    /// no log), starts `bird -f` in namespace `netns` with its control socket at
    /// `dir/bird.ctl` and its log at `dir/bird.log`, and waits until it answers.
    pub fn start(netns: &str, dir: &Path, config: &str) -> Result<Bird> {
        if !Path::new(BIRD).exists() {
            bail!("{BIRD} is not installed: run tests/setup.sh (Debian package bird2)");
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let conf = dir.join("bird.conf");
        let config = if config.contains("log ") {
            config.to_string()
        } else {
            format!("log stderr all;\n{config}")
        };
        std::fs::write(&conf, config).with_context(|| format!("writing {}", conf.display()))?;
        let ctl = dir.join("bird.ctl");
        let _ = std::fs::remove_file(&ctl);
        let (c, s, p) = (
            conf.display().to_string(),
            ctl.display().to_string(),
            dir.join("bird.pid").display().to_string(),
        );
        let daemon = Daemon::spawn(
            DaemonSpec::new(
                "bird",
                &[BIRD, "-f", "-c", &c, "-s", &s, "-P", &p],
                dir.join("bird.log"),
            )
            .in_netns(netns),
        )?;
        let mut bird = Bird { daemon, ctl, conf };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            // A bad configuration ends BIRD at once: report its message, do not wait.
            bird.daemon.check_running()?;
            if BirdControl::connect(&bird.ctl).is_ok() {
                return Ok(bird);
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "BIRD's control socket {} does not answer after 20 s; log:\n{}",
                    bird.ctl.display(),
                    bird.log_tail(20)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The control socket (`birdc -s <this>`).
    pub fn ctl(&self) -> &Path {
        &self.ctl
    }

    /// The configuration file.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The daemon's log file.
    pub fn log(&self) -> &Path {
        self.daemon.log()
    }

    /// The whole log.
    pub fn full_log(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    /// The log's last `n` lines.
    pub fn log_tail(&self, n: usize) -> String {
        tail(self.log(), n)
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// A persistent connection to the control socket (cheap repeated queries).
    pub fn control(&self) -> Result<BirdControl> {
        BirdControl::connect(&self.ctl)
    }

    /// Runs `birdc -s <ctl> ARGS...` and returns its output.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        birdc(&self.ctl, args)
    }

    /// The BGP next hops BIRD has for `prefix`/32 (every path, best or not), sorted.
    pub fn bgp_nexthops(&self, prefix: Ipv4Addr) -> Result<Vec<Ipv4Addr>> {
        bgp_nexthops(&self.ctl, prefix)
    }

    /// `show route for PREFIX/32 all`.
    pub fn route_text(&self, prefix: Ipv4Addr) -> Result<String> {
        self.cli(&["show", "route", "for", &format!("{prefix}/32"), "all"])
    }

    /// The line of `show protocols NAME` for that protocol.
    pub fn protocol_info(&self, name: &str) -> Result<String> {
        let out = self.cli(&["show", "protocols", name])?;
        Ok(out
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or("")
            .to_string())
    }

    /// Leaves BIRD running when this handle drops; returns its pid.
    pub fn detach(self) -> u32 {
        self.daemon.detach()
    }
}

/// `birdc -s CTL ARGS...` (the control socket needs no namespace).
pub fn birdc(ctl: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("birdc")
        .arg("-s")
        .arg(ctl)
        .args(args)
        .output()
        .context("running birdc (Debian package bird2)")?;
    if !out.status.success() {
        bail!(
            "birdc {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The BGP next hops of `prefix`/32 at the BIRD behind control socket `ctl`, sorted.
pub fn bgp_nexthops(ctl: &Path, prefix: Ipv4Addr) -> Result<Vec<Ipv4Addr>> {
    let p = format!("{prefix}/32");
    // birdc exits non-zero for "Network not found": read its output whatever the status.
    let out = Command::new("birdc")
        .arg("-s")
        .arg(ctl)
        .args(["show", "route", "for", &p, "all"])
        .output()
        .context("running birdc (Debian package bird2)")?;
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.contains("Network not found") {
        return Ok(vec![]);
    }
    if !out.contains(&p) {
        bail!("unexpected birdc output: {out}");
    }
    let mut hops: Vec<Ipv4Addr> = out
        .lines()
        .filter_map(|l| l.trim().strip_prefix("BGP.next_hop:"))
        .filter_map(|h| h.trim().parse().ok())
        .collect();
    if hops.is_empty() {
        bail!("birdc shows {p} without a BGP next hop: {out}");
    }
    hops.sort();
    Ok(hops)
}

/// A connection to BIRD's control socket.
#[derive(Debug)]
pub struct BirdControl {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl BirdControl {
    /// Connects and reads BIRD's greeting.
    pub fn connect(path: &Path) -> Result<BirdControl> {
        let w =
            UnixStream::connect(path).with_context(|| format!("connecting {}", path.display()))?;
        w.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut b = BirdControl {
            r: BufReader::new(w.try_clone()?),
            w,
        };
        b.read_reply()?; // "0001 BIRD 2.x ready."
        Ok(b)
    }

    /// Reads lines until the reply's last one (code 0xxx, 8xxx or 9xxx and a space).
    fn read_reply(&mut self) -> Result<String> {
        let mut out = String::new();
        loop {
            let mut line = String::new();
            if self.r.read_line(&mut line)? == 0 {
                bail!("BIRD closed its control socket");
            }
            out.push_str(&line);
            let b = line.as_bytes();
            if b.len() >= 5
                && b[..4].iter().all(u8::is_ascii_digit)
                && b[4] == b' '
                && matches!(b[0], b'0' | b'8' | b'9')
            {
                return Ok(out);
            }
        }
    }

    /// Sends one command and returns BIRD's whole reply (with its reply codes).
    pub fn cmd(&mut self, c: &str) -> Result<String> {
        self.w.write_all(format!("{c}\n").as_bytes())?;
        self.read_reply()
    }

    /// Whether BIRD has a route for `prefix`/32.
    pub fn has_route(&mut self, prefix: Ipv4Addr) -> Result<bool> {
        let p = format!("{prefix}/32");
        let r = self.cmd(&format!("show route {p}"))?;
        Ok(r.contains(&p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netns::{unique_prefix, veth, Netns};

    #[test]
    fn config_renders_a_neighbor_with_the_test_timers() {
        let c = BirdConfig::new(Ipv4Addr::new(10, 0, 1, 1))
            .kernel_ecmp()
            .bgp(
                &BgpNeighbor::new(
                    "node0",
                    Ipv4Addr::new(10, 0, 1, 1),
                    65000,
                    Ipv4Addr::new(10, 0, 1, 2),
                    65001,
                )
                .graceful_restart(120)
                .password(Some("s3cret".into()))
                .bfd()
                .debug_states(),
            )
            .bfd("d0", 300, 300, 3)
            .render();
        for want in [
            "router id 10.0.1.1;",
            "merge paths on;",
            "protocol bgp node0 {",
            " local 10.0.1.1 as 65000;",
            " neighbor 10.0.1.2 as 65001;",
            "hold time 9; keepalive time 3;",
            " graceful restart on; graceful restart time 120;",
            " password \"s3cret\";",
            " bfd on;\n debug { states, events };\n ipv4 {",
            "protocol bfd { interface \"d0\" { min rx interval 300 ms; min tx interval 300 ms; multiplier 3; }; }",
            " ipv4 { import all; export none; };",
        ] {
            assert!(c.contains(want), "{want:?} missing from:\n{c}");
        }
    }

    #[test]
    fn an_ipv6_neighbor_renders_an_ipv6_session_and_channel() {
        let c = BirdConfig::new(Ipv4Addr::new(192, 0, 2, 1))
            .kernel_ecmp()
            .bgp(
                &BgpNeighbor::new_v6(
                    "node0_v6",
                    "2001:db8:f::1".parse().unwrap(),
                    65000,
                    "2001:db8:f::11".parse().unwrap(),
                    65001,
                )
                .graceful_restart(120)
                .bfd(),
            )
            .render();
        for want in [
            " local 2001:db8:f::1 as 65000;",
            " neighbor 2001:db8:f::11 as 65001;",
            " graceful restart on; graceful restart time 120;",
            " bfd on;\n ipv6 { import all; export none; };",
            "protocol kernel {\n ipv6 { import none; export all; };\n merge paths on;",
        ] {
            assert!(c.contains(want), "{want:?} missing from:\n{c}");
        }
        assert!(
            !c.contains(" ipv4 { import all"),
            "no IPv4 channel on an IPv6 session:\n{c}"
        );
    }

    #[test]
    fn bird_starts_answers_and_is_gone_after_drop() -> Result<()> {
        let p = unique_prefix("brd");
        let r = Netns::new(format!("{p}r"))?;
        let n = Netns::new(format!("{p}n"))?;
        veth(&r, "d0", &n, "u0")?;
        r.addr("d0", "10.251.0.1/30")?;
        n.addr("u0", "10.251.0.2/30")?;
        let dir = tempfile::tempdir()?;
        let conf = BirdConfig::new(Ipv4Addr::new(10, 251, 0, 1))
            .kernel_ecmp()
            .bgp(&BgpNeighbor::new(
                "node0",
                Ipv4Addr::new(10, 251, 0, 1),
                65000,
                Ipv4Addr::new(10, 251, 0, 2),
                65001,
            ));
        let bird = Bird::start(r.name(), dir.path(), &conf.render())?;
        let pid = bird.pid();
        assert!(bird.protocol_info("node0")?.starts_with("node0"));
        assert_eq!(
            bird.bgp_nexthops(Ipv4Addr::new(192, 0, 2, 10))?,
            Vec::<Ipv4Addr>::new()
        );
        let mut ctl = bird.control()?;
        assert!(!ctl.has_route(Ipv4Addr::new(192, 0, 2, 10))?);
        drop(ctl);
        drop(bird);
        assert!(!crate::daemon::alive(pid), "BIRD survived its drop");
        Ok(())
    }

    #[test]
    fn a_bad_configuration_fails_with_birds_message() -> Result<()> {
        let p = unique_prefix("brd");
        let r = Netns::new(format!("{p}x"))?;
        let dir = tempfile::tempdir()?;
        let err = Bird::start(
            r.name(),
            dir.path(),
            "router id 10.0.0.1;\nprotocol nonsense {}\n",
        )
        .expect_err("BIRD accepted a bad configuration");
        assert!(format!("{err:#}").contains("bird exited"), "{err:#}");
        Ok(())
    }
}
