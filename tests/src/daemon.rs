//! Long-running processes of a test environment (BIRD, containerd, kubelet, Juneau's
//! binaries, ...), in the host or in a network namespace, stopped on drop.
//!
//! A daemon runs in its own process group, so stopping it (SIGTERM, then SIGKILL after
//! a grace period) also stops the helpers it started. In a namespace it is started with
//! `nsenter --net=/run/netns/NS`, not `ip netns exec`: the latter also remounts `/sys`
//! for the child, and the kubelet then fails to find its cgroup mounts (FACTS.md).
//! Programs that read their namespace's interfaces from `/sys/class/net` (Juneau's
//! dataplane) need exactly that remount: [`DaemonSpec::in_netns_with_sysfs`].
//! [`Daemon::detach`] hands a process over to something that outlives this one (the
//! lab's `up`), which then stops it by pid.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How to start a [`Daemon`].
#[derive(Debug, Clone, Default)]
pub struct DaemonSpec {
    /// Name in messages (e.g. `kubelet node-a`).
    pub name: String,
    /// Network namespace (a name under `/run/netns`), or the host's when `None`.
    pub netns: Option<String>,
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Variables of this process's environment the daemon must not inherit.
    pub env_removed: Vec<String>,
    /// Where stdout and stderr go (appended, so a restart keeps the earlier lines).
    pub log: PathBuf,
    /// Enter the namespace with `ip netns exec` (which also mounts a `/sys` showing the
    /// namespace's interfaces, what programs that read `/sys/class/net` need) rather
    /// than `nsenter --net` (what the kubelet needs).
    pub netns_sysfs: bool,
}

impl DaemonSpec {
    /// A daemon named `name` running `argv`, logging to `log`.
    pub fn new(name: impl Into<String>, argv: &[&str], log: impl Into<PathBuf>) -> Self {
        DaemonSpec {
            name: name.into(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            log: log.into(),
            ..Default::default()
        }
    }

    /// Runs it in network namespace `ns` (`nsenter --net`: the host's `/sys`).
    pub fn in_netns(mut self, ns: &str) -> Self {
        self.netns = Some(ns.to_string());
        self
    }

    /// Runs it in network namespace `ns` with `ip netns exec` (`/sys` of the namespace).
    pub fn in_netns_with_sysfs(mut self, ns: &str) -> Self {
        self.netns = Some(ns.to_string());
        self.netns_sysfs = true;
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.insert(key.to_string(), value.into());
        self
    }

    /// Keeps a variable of this process's environment from the daemon.
    pub fn env_remove(mut self, key: &str) -> Self {
        self.env_removed.push(key.to_string());
        self
    }

    /// A `juneau-k8s-sync` (or other Kubernetes client) on the host with `kubeconfig`,
    /// not inheriting the in-cluster variables a test runner may have.
    pub fn kube_client(self, kubeconfig: &Path, rust_log: &str) -> Self {
        self.env("KUBECONFIG", kubeconfig.display().to_string())
            .env("RUST_LOG", rust_log)
            .env_remove("POD_NAMESPACE")
            .env_remove("POD_NAME")
            .env_remove("NODE_NAME")
    }
}

/// A running process (and its process group), stopped on drop.
#[derive(Debug)]
pub struct Daemon {
    spec: DaemonSpec,
    child: Option<Child>,
    pid: u32,
}

impl Daemon {
    /// Starts the process.
    pub fn spawn(spec: DaemonSpec) -> Result<Daemon> {
        if spec.argv.is_empty() {
            bail!("daemon {}: empty command line", spec.name);
        }
        if let Some(dir) = spec.log.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&spec.log)
            .with_context(|| format!("opening {}", spec.log.display()))?;
        let mut cmd = match &spec.netns {
            Some(ns) if spec.netns_sysfs => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]);
                c.args(&spec.argv);
                c
            }
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg("--");
                c.args(&spec.argv);
                c
            }
            None => {
                let mut c = Command::new(&spec.argv[0]);
                c.args(&spec.argv[1..]);
                c
            }
        };
        for k in &spec.env_removed {
            cmd.env_remove(k);
        }
        cmd.envs(&spec.env)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {} ({:?})", spec.name, spec.argv))?;
        let pid = child.id();
        Ok(Daemon {
            spec,
            child: Some(child),
            pid,
        })
    }

    /// Starts the same command again (after [`kill`](Self::kill) or [`stop`](Self::stop)).
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let fresh = Daemon::spawn(self.spec.clone())?;
        *self = fresh;
        Ok(())
    }

    /// The process id (nsenter execs the program, so it is the program's).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The name given in the spec.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The log file.
    pub fn log(&self) -> &Path {
        &self.spec.log
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Fails with the log's last lines if the process has exited.
    pub fn check_running(&mut self) -> Result<()> {
        if !self.is_running() {
            bail!(
                "{} exited; last lines of {}:\n{}",
                self.spec.name,
                self.spec.log.display(),
                tail(&self.spec.log, 30)
            );
        }
        Ok(())
    }

    /// Sends `sig` (a name such as `TERM`, `KILL`, `HUP`) to the process only.
    pub fn signal(&self, sig: &str) {
        signal_pid(self.pid, sig);
    }

    /// SIGKILL to the process group, as a crash would end it; waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal_group(self.pid, "KILL");
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM to the process group, SIGKILL after 10 s; waits for it.
    pub fn stop(&mut self) {
        self.stop_within(Duration::from_secs(10));
    }

    /// SIGTERM to the process group, SIGKILL after `grace`; waits for it.
    pub fn stop_within(&mut self, grace: Duration) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        if matches!(c.try_wait(), Ok(None)) {
            signal_group(self.pid, "TERM");
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        signal_group(self.pid, "KILL");
        let _ = c.kill();
        let _ = c.wait();
        // A SIGKILLed process dies when it is next scheduled, not when kill(2) returns:
        // wait (bounded) until no member of the group is left, so a caller that removes
        // the namespace or the files next finds nobody using them.
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline && group_alive(self.pid) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Leaves the process running when this handle drops; returns its pid.
    pub fn detach(mut self) -> u32 {
        // Dropping a std Child neither kills nor waits for it.
        self.child.take();
        self.pid
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_within(Duration::from_secs(5));
    }
}

/// `kill -SIG PID`, errors ignored.
pub fn signal_pid(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .stderr(Stdio::null())
        .output();
}

/// `kill -SIG -- -PGID`, errors ignored.
pub fn signal_group(pgid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), "--".into(), format!("-{pgid}")])
        .stderr(Stdio::null())
        .output();
}

/// Whether `pid` is a live process (not a zombie).
pub fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| live_stat_pgrp(&stat))
        .is_some()
}

/// Whether any live (not zombie) process is in process group `pgid`.
pub fn group_alive(pgid: u32) -> bool {
    let Ok(procs) = fs::read_dir("/proc") else {
        return false;
    };
    procs.flatten().any(|p| {
        fs::read_to_string(p.path().join("stat"))
            .ok()
            .and_then(|stat| live_stat_pgrp(&stat))
            == Some(pgid)
    })
}

/// The process group of a `/proc/PID/stat` line, `None` for a zombie or an unreadable line.
fn live_stat_pgrp(stat: &str) -> Option<u32> {
    // After the command's closing parenthesis: state, ppid, pgrp.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?;
    if state.starts_with('Z') {
        return None;
    }
    fields.nth(1)?.parse().ok()
}

/// Stops a process started by an earlier run (a detached [`Daemon`]): SIGTERM to its
/// group, SIGKILL after `grace`. Only if `/proc/PID/cmdline` still contains `expect`, so
/// a reused pid is left alone.
pub fn stop_pid(pid: u32, expect: &str, grace: Duration) {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !String::from_utf8_lossy(&cmdline).contains(expect) {
        return;
    }
    signal_group(pid, "TERM");
    signal_pid(pid, "TERM");
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && alive(pid) {
        std::thread::sleep(Duration::from_millis(50));
    }
    signal_group(pid, "KILL");
    signal_pid(pid, "KILL");
}

/// Last `n` lines of a file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Polls `f` every `every` until it returns `Some`, or fails after `timeout` naming
/// `what` and the last error.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() > timeout {
            if last.is_empty() {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            bail!("timed out after {timeout:?} waiting for {what} (last error: {last})");
        }
        std::thread::sleep(every);
    }
}

/// The JSON a process rewrites about once a second (the dataplane's stats file), as
/// sampled after this call: waits until its `timestamp` (whole seconds since the epoch,
/// the time of the sample's oldest part) is past the current second. Use it where a
/// test must see counters that include what it just did.
pub fn json_sampled_after_now(path: &Path) -> Result<serde_json::Value> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    wait_for(
        &format!("a sample of {} taken after {now}", path.display()),
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(path)?)?;
            Ok(v["timestamp"]
                .as_u64()
                .is_some_and(|t| t > now)
                .then_some(v))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_daemon_and_its_children_stop_on_drop() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let pidfile = dir.path().join("child.pid");
        let script = format!("sleep 300 & echo $! > {}; wait", pidfile.display());
        let d = Daemon::spawn(DaemonSpec::new(
            "sleeper",
            &["bash", "-c", &script],
            dir.path().join("log"),
        ))?;
        let child: u32 = wait_for(
            "the child's pid file",
            Duration::from_secs(10),
            Duration::from_millis(20),
            || Ok(fs::read_to_string(&pidfile)?.trim().parse().ok()),
        )?;
        let parent = d.pid();
        assert!(alive(parent) && alive(child));
        drop(d);
        assert!(!alive(parent), "the daemon survived its drop");
        assert!(!alive(child), "the daemon's child survived its drop");
        Ok(())
    }

    #[test]
    fn stat_lines_give_the_group_of_live_processes_only() {
        assert_eq!(live_stat_pgrp("42 (sleep) S 1 40 40 0 -1"), Some(40));
        assert_eq!(live_stat_pgrp("42 (a) b) R 1 7 7 0"), Some(7));
        assert_eq!(live_stat_pgrp("42 (sleep) Z 1 40 40 0"), None);
        assert_eq!(live_stat_pgrp("garbage"), None);
    }

    #[test]
    fn an_exited_daemon_is_reported_with_its_log() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut d = Daemon::spawn(DaemonSpec::new(
            "failing",
            &["bash", "-c", "echo 'bad flag --x'; exit 3"],
            dir.path().join("log"),
        ))?;
        let err = wait_for(
            "the daemon to exit",
            Duration::from_secs(10),
            Duration::from_millis(20),
            || Ok(d.check_running().err()),
        )?;
        assert!(format!("{err:#}").contains("bad flag --x"), "{err:#}");
        Ok(())
    }
}
