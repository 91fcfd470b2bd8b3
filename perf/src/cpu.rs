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

/// Total run time (ns) of every thread of each process in `pids` (threads of a kernel
/// thread: itself). Processes that are gone count 0.
pub fn run_time_ns(pids: &[u32]) -> u64 {
    let mut sum = 0u64;
    for pid in pids {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in dir.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                sum += s
                    .split_whitespace()
                    .next()
                    .and_then(|x| x.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    sum
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
    let tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                .collect()
        })
        .unwrap_or_else(|_| vec![pid]);
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
    let s = std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    after.split_whitespace().nth(36)?.parse().ok()
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
