//! Where a path's work runs and what it costs: per-CPU times from `/proc/stat`, per-thread
//! run time from `/proc/<pid>/task/<tid>/schedstat` (nanoseconds), the threaded-NAPI
//! kernel threads of an interface, and CPU pinning.
//!
//! Every forwarding path runs on one dedicated core (the "path core"): the node's veths
//! run threaded NAPI with their `napi/<iface>-<id>` kthreads pinned there, the userspace
//! forwarders are pinned there too, and the generator is alone on the other core. A path's
//! CPU cost is the run time of its threads (NAPI kthreads, `ksoftirqd/<core>`, forwarder
//! threads) over the window, divided by the packets delivered; the path core's busy share
//! from `/proc/stat` (user + nice + system + irq + softirq) shows whether it was saturated
//! (and how much else ran there: the machine is shared).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One CPU's cumulative times from `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreTimes {
    /// user + nice.
    pub user: u64,
    /// system.
    pub system: u64,
    /// idle + iowait.
    pub idle: u64,
    /// irq + softirq.
    pub irq_softirq: u64,
    /// steal (time the hypervisor gave to someone else).
    pub steal: u64,
}

impl CoreTimes {
    /// Reads `cpu<n>` from `/proc/stat`.
    pub fn read(cpu: u32) -> Result<CoreTimes> {
        let text = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        let tag = format!("cpu{cpu} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&tag))
            .with_context(|| format!("no {tag}line in /proc/stat"))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        if v.len() < 8 {
            bail!("short /proc/stat line: {line}");
        }
        Ok(CoreTimes {
            user: v[0] + v[1],
            system: v[2],
            idle: v[3] + v[4],
            irq_softirq: v[5] + v[6],
            steal: v[7],
        })
    }

    fn total(&self) -> u64 {
        self.user + self.system + self.idle + self.irq_softirq + self.steal
    }

    /// Busy share of `later - self` (user + system + irq + softirq over all time), and
    /// the softirq share alone, as fractions.
    pub fn busy_since(&self, later: &CoreTimes) -> CoreLoad {
        let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
        let total = d(self.total(), later.total()).max(1.0);
        CoreLoad {
            busy: (d(self.user, later.user)
                + d(self.system, later.system)
                + d(self.irq_softirq, later.irq_softirq))
                / total,
            user: d(self.user, later.user) / total,
            system: d(self.system, later.system) / total,
            softirq: d(self.irq_softirq, later.irq_softirq) / total,
            steal: d(self.steal, later.steal) / total,
        }
    }
}

/// Shares of one core's time over a window (fractions of the window).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct CoreLoad {
    /// user + system + irq + softirq.
    pub busy: f64,
    /// user + nice.
    pub user: f64,
    /// system.
    pub system: f64,
    /// irq + softirq.
    pub softirq: f64,
    /// steal.
    pub steal: f64,
}

/// The thread ids of process `pid` (`/proc/<pid>/task`; a kernel thread: itself); none
/// once it is gone.
fn tasks_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Total run time (ns) of every thread of each process in `pids` (threads of a kernel
/// thread: itself). Processes that are gone count 0.
pub fn run_time_ns(pids: &[u32]) -> u64 {
    pids.iter()
        .flat_map(|&pid| tasks_of(pid))
        .filter_map(|tid| std::fs::read_to_string(format!("/proc/{tid}/schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// One thread as the scheduler sees it (`/proc/<pid>/task/<tid>/stat` and `schedstat`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSched {
    /// Its id.
    pub tid: u32,
    /// Its name.
    pub comm: String,
    /// `R`, `S`, `D`...
    pub state: String,
    /// The CPU it last ran on.
    pub last_cpu: u32,
    /// SCHED_OTHER 0, SCHED_FIFO 1, SCHED_RR 2, SCHED_BATCH 3, SCHED_IDLE 5.
    pub policy: u32,
    /// Real-time priority (0 under SCHED_OTHER).
    pub rt_priority: u32,
    /// Time on a CPU, ns.
    pub run_ns: u64,
    /// Time runnable but waiting for a CPU, ns.
    pub wait_ns: u64,
}

impl ThreadSched {
    /// Parses a `stat` line and a `schedstat` line; `None` when either is malformed.
    pub fn parse(tid: u32, stat: &str, schedstat: &str) -> Option<ThreadSched> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let fields: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
        let mut times = schedstat.split_whitespace().map(str::parse::<u64>);
        Some(ThreadSched {
            tid,
            comm: stat.get(open + 1..close)?.to_string(),
            state: fields.first()?.to_string(),
            last_cpu: fields.get(36)?.parse().ok()?,
            rt_priority: fields.get(37)?.parse().ok()?,
            policy: fields.get(38)?.parse().ok()?,
            run_ns: times.next()?.ok()?,
            wait_ns: times.next()?.ok()?,
        })
    }

    /// Thread `tid` now (of any process); `None` once it is gone.
    pub fn read(tid: u32) -> Option<ThreadSched> {
        let dir = Path::new("/proc").join(tid.to_string());
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        let schedstat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        ThreadSched::parse(tid, &stat, &schedstat)
    }

    /// Every thread of each process in `pids` (a kernel thread: itself).
    pub fn of(pids: &[u32]) -> Vec<ThreadSched> {
        pids.iter()
            .flat_map(|&pid| tasks_of(pid))
            .filter_map(ThreadSched::read)
            .collect()
    }

    fn policy_name(&self) -> String {
        match self.policy {
            0 => "normal".into(),
            1 => format!("FIFO {}", self.rt_priority),
            2 => format!("RR {}", self.rt_priority),
            p => format!("policy {p}"),
        }
    }
}

impl std::fmt::Display for ThreadSched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}, {}, {}, last on CPU {})",
            self.comm,
            self.tid,
            self.state,
            self.policy_name(),
            self.last_cpu
        )
    }
}

/// What each thread of `after` ran and waited since `before` (same threads, read
/// earlier), largest run first: "name (tid, state, policy, CPU): ran X ms, waited Y ms".
pub fn thread_deltas(before: &[ThreadSched], after: &[ThreadSched]) -> String {
    let mut rows: Vec<(u64, String)> = after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.tid == a.tid);
            let run = a.run_ns - b.map_or(0, |b| b.run_ns.min(a.run_ns));
            let wait = a.wait_ns - b.map_or(0, |b| b.wait_ns.min(a.wait_ns));
            (
                run,
                format!(
                    "{a}: ran {:.1} ms, waited {:.1} ms",
                    run as f64 / 1e6,
                    wait as f64 / 1e6
                ),
            )
        })
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.0));
    rows.into_iter()
        .map(|(_, r)| r)
        .collect::<Vec<_>>()
        .join("; ")
}

fn comm(pid: &str) -> Option<String> {
    std::fs::read_to_string(Path::new("/proc").join(pid).join("comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// Kernel threads whose name is exactly `name`, or starts with `name` when `prefix`.
fn threads_named(name: &str, prefix: bool) -> Vec<u32> {
    let mut v = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return v;
    };
    for e in dir.flatten() {
        let f = e.file_name();
        let f = f.to_string_lossy();
        if !f.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Some(c) = comm(&f) {
            if (prefix && c.starts_with(name)) || (!prefix && c == name) {
                if let Ok(p) = f.parse() {
                    v.push(p);
                }
            }
        }
    }
    v
}

/// The threaded-NAPI kthreads of `iface` (`napi/<iface>-<napi id>`, cut to the kernel's
/// 15-character thread names; interface names here are unique to this process).
pub fn napi_threads(iface: &str) -> Vec<u32> {
    let name: String = format!("napi/{iface}-").chars().take(15).collect();
    threads_named(&name, true)
}

/// `ksoftirqd/<cpu>` (softirq work the kernel deferred on that core).
pub fn ksoftirqd(cpu: u32) -> Vec<u32> {
    threads_named(&format!("ksoftirqd/{cpu}"), false)
}

/// SCHED_FIFO priority of the harness's measuring thread while it runs a window: above
/// everything it measures (the sink and prober at 20, the dataplane's workers at 10), so
/// that loaded cores (a nice -20 generator and NAPI kthreads) cannot delay its clock.
pub const HARNESS_RT_PRIORITY: i32 = 30;

/// The calling thread under SCHED_FIFO with SCHED_RESET_ON_FORK while this lives (the
/// processes and threads it starts run under the normal policy), back to the normal
/// policy when dropped. For the harness's thread that times a window: it sleeps most of
/// the window and does little else, but on a machine whose two cores carry the load at
/// nice -20 a normal-policy thread can wait a second for its turn — once long enough
/// for the generator it had started to finish before the window began, a window with
/// nothing in it.
pub struct Realtime(());

impl Realtime {
    /// Enters SCHED_FIFO at `priority`.
    pub fn enter(priority: i32) -> Result<Realtime> {
        set_policy(libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, priority)
            .with_context(|| format!("SCHED_FIFO {priority} for the harness's window"))?;
        Ok(Realtime(()))
    }
}

impl Drop for Realtime {
    fn drop(&mut self) {
        if let Err(e) = set_policy(libc::SCHED_OTHER, 0) {
            tracing::warn!("back to the normal policy: {e:#}");
        }
    }
}

fn set_policy(policy: libc::c_int, priority: i32) -> Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: `param` is a valid sched_param that outlives the call; pid 0 is this thread.
    let rc = unsafe { libc::sched_setscheduler(0, policy, &param) };
    if rc != 0 {
        bail!(
            "sched_setscheduler({policy}, {priority}): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Pins a thread (or kernel thread) to one CPU.
pub fn pin(tid: u32, cpu: u32) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (machines here have 2 cores).
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    // SAFETY: a valid cpu_set_t of the size passed.
    let rc = unsafe {
        libc::sched_setaffinity(
            tid as libc::pid_t,
            std::mem::size_of::<libc::cpu_set_t>(),
            &set,
        )
    };
    if rc != 0 {
        bail!(
            "pinning thread {tid} to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Gives a thread (or kernel thread) and, for a process, all its threads the highest
/// CFS weight (nice -20): on a machine shared with other work, the path's threads then
/// get (nearly) all of the path core against nice-0 processes, while sharing it fairly
/// among themselves (e.g. a NAPI kthread and a userspace forwarder).
pub fn boost(pid: u32) -> Result<()> {
    let tids = match tasks_of(pid) {
        v if v.is_empty() => vec![pid],
        v => v,
    };
    for tid in tids {
        // SAFETY: setpriority has no memory preconditions; `tid` is a thread id.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, -20) };
        if rc != 0 {
            bail!(
                "setting nice -20 on thread {tid}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// The CPU a thread last ran on (field 39 of `/proc/<tid>/stat`).
pub fn last_cpu(tid: u32) -> Option<u32> {
    ThreadSched::read(tid).map(|t| t.last_cpu)
}

/// The TSC frequency in MHz (the clock cycles are stated in: this VM exposes no PMU, so
/// cycles/packet = ns/packet x this), from `/proc/cpuinfo`'s "cpu MHz".
pub fn tsc_mhz() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_s_scheduling_is_read_from_stat_and_schedstat() {
        // A name with spaces and a parenthesis, as comm allows.
        let stat = "4242 (udp (sink) 1) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 7 0 0 -21 0 3 0 1000 \
                    1000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 20 1 0 0 0 0 0 0 0 0 0 0 0";
        let t = ThreadSched::parse(4242, stat, "825041365 13876552 900\n").expect("parses");
        assert_eq!(t.comm, "udp (sink) 1");
        assert_eq!(t.state, "S");
        assert_eq!((t.last_cpu, t.rt_priority, t.policy), (0, 20, 1));
        assert_eq!((t.run_ns, t.wait_ns), (825_041_365, 13_876_552));
        assert_eq!(
            t.to_string(),
            "udp (sink) 1 (4242, S, FIFO 20, last on CPU 0)"
        );
        assert!(ThreadSched::parse(1, "1 (x) S 1", "1 2 3").is_none());
        let mut later = t.clone();
        later.run_ns += 2_000_000;
        later.wait_ns += 500_000;
        assert_eq!(
            thread_deltas(&[t], &[later]),
            "udp (sink) 1 (4242, S, FIFO 20, last on CPU 0): ran 2.0 ms, waited 0.5 ms"
        );
    }

    #[test]
    fn a_realtime_window_resets_its_children_and_ends_normal() {
        // SAFETY: gettid has no preconditions.
        let policy = || ThreadSched::read(unsafe { libc::gettid() } as u32).expect("me");
        {
            let _rt = Realtime::enter(HARNESS_RT_PRIORITY).expect("root may");
            let me = policy();
            assert_eq!((me.policy, me.rt_priority), (1, HARNESS_RT_PRIORITY as u32));
            let child = std::thread::spawn(|| {
                // SAFETY: gettid has no preconditions.
                ThreadSched::read(unsafe { libc::gettid() } as u32).expect("child")
            })
            .join()
            .expect("child thread");
            assert_eq!(child.policy, 0, "a thread started in the window is normal");
            let out = std::process::Command::new("sh")
                .args(["-c", "cut -d' ' -f41 /proc/self/stat"])
                .output()
                .expect("sh");
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
        }
        assert_eq!(policy().policy, 0, "normal again after the window");
    }

    #[test]
    fn this_thread_reads_as_itself() {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        let t = ThreadSched::read(tid).expect("this thread");
        assert_eq!(t.state, "R");
        assert!(t.run_ns > 0);
    }

    #[test]
    fn reads_this_cpu_and_own_run_time() {
        let a = CoreTimes::read(0).expect("cpu0");
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        std::hint::black_box(x);
        let b = CoreTimes::read(0).expect("cpu0");
        let l = a.busy_since(&b);
        assert!((0.0..=1.0).contains(&l.busy), "{l:?}");
        assert!(run_time_ns(&[std::process::id()]) > 0);
        assert!(ksoftirqd(0).len() == 1, "ksoftirqd/0 not found");
        assert!(last_cpu(std::process::id()).is_some());
    }
}
