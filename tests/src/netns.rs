//! Network namespaces and veth pairs that clean themselves up.
//!
//! Every test builds its own topology with unique names (a per-process, per-call
//! prefix), so tests can run in parallel; dropping a [`Netns`] deletes the namespace (and
//! with it every veth end inside it and every process still running in it), also when
//! the test panics. Processes spawned through [`Netns::spawn`] are returned as
//! [`NsChild`], which kills the process on drop.

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context, Result};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A short prefix unique to this process and call, for namespace and link names
/// (interface names are limited to 15 bytes, so keep what you append short).
pub fn unique_prefix(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id() % 100_000;
    let tag: String = tag.chars().take(3).collect();
    format!("j{tag}{pid}{n}")
}

/// Runs a host command and fails with its stderr if it fails.
pub fn run(cmd: &str, args: &[&str]) -> Result<Output> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("spawning {cmd}"))?;
    if !out.status.success() {
        bail!(
            "`{} {}` failed ({}): {}",
            cmd,
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// A network namespace deleted (with everything in it) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace with loopback up.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        // A namespace left by a crashed run of an earlier process with the same pid.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run("ip", &["netns", "add", &name])?;
        let ns = Netns { name };
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A `Command` that runs `argv` inside the namespace.
    pub fn command(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).args(argv);
        c
    }

    /// Runs `argv` in the namespace; fails with its stderr if it fails.
    pub fn exec(&self, argv: &[&str]) -> Result<String> {
        let out = self
            .command(argv)
            .output()
            .with_context(|| format!("spawning {argv:?} in {}", self.name))?;
        if !out.status.success() {
            bail!(
                "`{}` in netns {} failed ({}): {}{}",
                argv.join(" "),
                self.name,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `argv` in the namespace and returns its output whatever its exit status.
    pub fn output(&self, argv: &[&str]) -> Result<Output> {
        self.command(argv)
            .output()
            .with_context(|| format!("spawning {argv:?} in {}", self.name))
    }

    /// Starts a long-running process in the namespace; it is killed when the returned
    /// handle drops.
    pub fn spawn(&self, argv: &[&str]) -> Result<NsChild> {
        let child = self
            .command(argv)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning {argv:?} in {}", self.name))?;
        Ok(NsChild { child })
    }

    /// Starts a process with stdout/stderr going to the given files.
    pub fn spawn_logged(&self, argv: &[&str], log: &std::path::Path) -> Result<NsChild> {
        let f =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = self
            .command(argv)
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("spawning {argv:?} in {}", self.name))?;
        Ok(NsChild { child })
    }

    /// Leaves the namespace in place when this handle drops (the lab's `up`, whose
    /// `down` deletes it by name); returns its name.
    pub fn detach(self) -> String {
        let name = self.name.clone();
        std::mem::forget(self);
        name
    }

    /// Adds an address (`a.b.c.d/len`) to an interface in this namespace and sets it up.
    pub fn addr(&self, ifname: &str, cidr: &str) -> Result<()> {
        self.exec(&["ip", "addr", "add", cidr, "dev", ifname])?;
        self.exec(&["ip", "link", "set", ifname, "up"])?;
        Ok(())
    }

    /// Adds an IPv6 address without duplicate address detection (usable at once) and
    /// sets the interface up.
    pub fn addr6(&self, ifname: &str, cidr: &str) -> Result<()> {
        self.exec(&["ip", "-6", "addr", "add", cidr, "dev", ifname, "nodad"])?;
        self.exec(&["ip", "link", "set", ifname, "up"])?;
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Kill whatever still runs inside, then delete the namespace (veths go with it).
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).output();
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Fails unless this process runs as root (namespaces, veths, BPF need it).
pub fn require_root() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("this test builds network namespaces and must run as root");
    }
    Ok(())
}

/// Runs `f` on a thread that has entered network namespace `ns` (by name, as `ip netns`
/// knows it); sockets it creates stay in that namespace wherever they are used
/// afterwards. Panics if the namespace cannot be entered (a test harness error).
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        let file = std::fs::File::open(format!("/var/run/netns/{ns}"))
            .unwrap_or_else(|e| panic!("opening netns {ns}: {e}"));
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .unwrap_or_else(|e| panic!("setns({ns}): {e}"));
        f()
    })
    .join()
    .unwrap_or_else(|_| panic!("a thread inside a network namespace panicked"))
}

/// The MAC address of interface `ifname` in namespace `ns`.
pub fn mac_of(ns: &Netns, ifname: &str) -> Result<[u8; 6]> {
    let s = ns.exec(&["cat", &format!("/sys/class/net/{ifname}/address")])?;
    let v: Vec<u8> = s
        .trim()
        .split(':')
        .map(|x| u8::from_str_radix(x, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC of {ifname} in {}: {s:?}", ns.name()))?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("MAC of {ifname} in {}: {s:?}", ns.name()))
}

/// The next hops (`via`) of the kernel route to `prefix`/32 in namespace `ns`, sorted:
/// an ECMP route lists several.
pub fn route_next_hops(ns: &str, prefix: std::net::Ipv4Addr) -> Result<Vec<std::net::Ipv4Addr>> {
    route_vias(ns, "-4", &format!("{prefix}/32"))
}

/// The IPv6 next hops (`via inet6`) of the kernel route to the IPv4 `prefix`/32 in
/// namespace `ns`, sorted: an IPv4 route learnt with an IPv6 next hop (RFC 8950).
pub fn route_next_hops_via_ipv6(
    ns: &str,
    prefix: std::net::Ipv4Addr,
) -> Result<Vec<std::net::Ipv6Addr>> {
    route_vias(ns, "-4", &format!("{prefix}/32"))
}

/// The `via` addresses of `ip <family> route show <prefix>` in namespace `ns`, sorted;
/// those of type `A` only (`via inet6 ADDR` in an IPv4 route is an IPv6 one).
fn route_vias<A: std::str::FromStr + Ord>(ns: &str, family: &str, prefix: &str) -> Result<Vec<A>> {
    let out = run("ip", &["-n", ns, family, "route", "show", prefix])?;
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text
        .split_whitespace()
        .filter(|w| !matches!(*w, "inet" | "inet6"))
        .collect();
    let mut v: Vec<A> = words
        .windows(2)
        .filter(|w| w[0] == "via")
        .filter_map(|w| w[1].parse().ok())
        .collect();
    v.sort();
    Ok(v)
}

/// The next hops (`via`) of the kernel route to `prefix`/128 in namespace `ns`, sorted
/// (an ECMP route lists several): a global or a link-local address of the neighbour.
pub fn route6_next_hops(ns: &str, prefix: std::net::Ipv6Addr) -> Result<Vec<std::net::Ipv6Addr>> {
    route_vias(ns, "-6", &format!("{prefix}/128"))
}

/// The IPv6 addresses of `ifname` in namespace `ns` with scope `scope` (`global`,
/// `link`).
pub fn ipv6_addresses(ns: &str, ifname: &str, scope: &str) -> Result<Vec<std::net::Ipv6Addr>> {
    let out = run(
        "ip",
        &[
            "-n", ns, "-6", "-o", "addr", "show", "dev", ifname, "scope", scope,
        ],
    )?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "inet6")
        .filter_map(|w| w[1].split('/').next()?.parse().ok())
        .collect())
}

/// Connects `a` and `b` with a veth pair named `a_if` (in `a`) and `b_if` (in `b`),
/// both up.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> Result<()> {
    run(
        "ip",
        &[
            "link", "add", a_if, "netns", &a.name, "type", "veth", "peer", "name", b_if, "netns",
            &b.name,
        ],
    )?;
    a.exec(&["ip", "link", "set", a_if, "up"])?;
    b.exec(&["ip", "link", "set", b_if, "up"])?;
    Ok(())
}

/// A veth pair with `queues` RX and TX queues on each end (`numrxqueues`/`numtxqueues`),
/// both ends up.
pub fn veth_queues(a: &Netns, a_if: &str, b: &Netns, b_if: &str, queues: u32) -> Result<()> {
    let q = queues.to_string();
    run(
        "ip",
        &[
            "link",
            "add",
            a_if,
            "netns",
            &a.name,
            "numrxqueues",
            &q,
            "numtxqueues",
            &q,
            "type",
            "veth",
            "peer",
            "name",
            b_if,
            "netns",
            &b.name,
            "numrxqueues",
            &q,
            "numtxqueues",
            &q,
        ],
    )?;
    a.exec(&["ip", "link", "set", a_if, "up"])?;
    b.exec(&["ip", "link", "set", b_if, "up"])?;
    Ok(())
}

/// A process running in a namespace, killed on drop.
#[derive(Debug)]
pub struct NsChild {
    child: Child,
}

impl NsChild {
    /// The process id (of `ip netns exec`, which execs the target, so the target's).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a signal (e.g. `libc::SIGTERM` as 15) to the process.
    pub fn signal(&self, sig: i32) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .output();
    }

    /// Kills the process and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NsChild {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_pair_pings_and_is_removed_on_drop() -> Result<()> {
        let p = unique_prefix("ns");
        let (a_name, b_name) = (format!("{p}a"), format!("{p}b"));
        {
            let a = Netns::new(&a_name)?;
            let b = Netns::new(&b_name)?;
            veth(&a, "va", &b, "vb")?;
            a.addr("va", "10.250.0.1/30")?;
            b.addr("vb", "10.250.0.2/30")?;
            a.exec(&["ping", "-c", "1", "-W", "2", "10.250.0.2"])?;
        }
        let list = String::from_utf8(run("ip", &["netns", "list"])?.stdout)?;
        assert!(
            !list.contains(&a_name),
            "namespace {a_name} left behind: {list}"
        );
        assert!(
            !list.contains(&b_name),
            "namespace {b_name} left behind: {list}"
        );
        Ok(())
    }
}
