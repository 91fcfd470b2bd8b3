//! How the forwarding workers are scheduled: `SCHED_FIFO`, so that the kernel's receive
//! work that fills a worker's RX rings (NAPI, in a kthread or in `ksoftirqd`) never
//! takes the core from the worker that drains them.
//!
//! On a core shared by the interface's NAPI and a worker under the normal policy, both
//! runnable under load get equal shares: NAPI fills the RX ring faster than the worker
//! empties it, the kernel then drops frames at the socket after having done their
//! receive work, and under a flood the worker is starved outright (receive livelock:
//! `juneau-perf` measured 35 k packets/s delivered of 4.3 M offered). A `SCHED_FIFO`
//! worker preempts NAPI when woken; when its rings are empty it sleeps in `poll(2)`
//! (never spins: a realtime thread's `sched_yield` does not let normal-policy NAPI run),
//! and NAPI refills them. Measured on the perf topology: 2 425 ns → ~1 000 ns of path
//! core per packet, and 917 k packets/s delivered under the same flood (docs/dataplane.md,
//! "AF_XDP I/O and the forwarding loop"; docs/decisions.md, "Forwarding workers run
//! SCHED_FIFO and never spin").
//!
//! The kernel's realtime throttling (`kernel.sched_rt_runtime_us`, 95 % by default)
//! bounds what a worker can take from its core even when it never sleeps.
//!
//! Where the kernel refuses (no `CAP_SYS_NICE`; or `CONFIG_RT_GROUP_SCHED` with cgroup
//! v1, where a Pod's cgroup has no realtime budget — the lab's machine is such a case),
//! the worker logs why and keeps the normal policy and its old idle policy.

use thread_priority::{
    RealtimeThreadSchedulePolicy, ThreadPriority, ThreadPriorityValue, ThreadSchedulePolicy,
};

/// Why a worker could not get its realtime policy.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// The priority is outside `SCHED_FIFO`'s 1–99.
    #[error("worker priority {0} is outside SCHED_FIFO's range 1-99 (0 keeps the normal policy)")]
    OutOfRange(u8),
    /// The kernel refused: no `CAP_SYS_NICE`, or a kernel with RT group scheduling
    /// (`CONFIG_RT_GROUP_SCHED`, cgroup v1) whose cgroup for this process has no
    /// realtime budget (`cpu.rt_runtime_us` 0, as the kubelet creates Pod cgroups).
    #[error("sched_setscheduler(SCHED_FIFO, {priority}) refused: {detail} (the dataplane needs CAP_SYS_NICE; on a kernel with RT group scheduling and cgroup v1 its cgroup also needs a realtime budget, cpu.rt_runtime_us > 0)")]
    Refused {
        /// The priority asked for.
        priority: u8,
        /// What the kernel said.
        detail: String,
    },
}

/// Puts the calling thread under `SCHED_FIFO` at `priority` (1–99).
pub fn make_current_thread_realtime(priority: u8) -> Result<(), SchedError> {
    if !(1..=99).contains(&priority) {
        return Err(SchedError::OutOfRange(priority));
    }
    let value =
        ThreadPriorityValue::try_from(priority).map_err(|_| SchedError::OutOfRange(priority))?;
    thread_priority::unix::set_thread_priority_and_policy(
        thread_priority::unix::thread_native_id(),
        ThreadPriority::Crossplatform(value),
        ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo),
    )
    .map_err(|e| SchedError::Refused {
        priority,
        detail: format!("{e:?}"),
    })
}

/// A forwarding worker's start: `SCHED_FIFO` at `priority` unless it is 0. Returns
/// whether the thread runs realtime; a refusal is logged and the worker goes on under
/// the normal policy (then it may spin, `busy_poll_us`).
pub fn enter_worker(priority: u8, worker: usize) -> bool {
    enter_realtime(priority, "forwarding worker", Some(worker))
}

/// The node thread's start (control state, interface attach): `SCHED_FIFO` at the
/// workers' `priority` too, as when worker 0 did that work, so a node busy with the
/// workers' traffic (their NAPI and softirq work on the other cores) does not delay a
/// new table or a held one's release. It sleeps but for that work. Returns whether it
/// runs realtime.
pub fn enter_node_thread(priority: u8) -> bool {
    enter_realtime(priority, "the node thread", None)
}

/// `SCHED_FIFO` at `priority` for the calling thread (`what`, worker number), unless 0;
/// a refusal is logged and the thread keeps the normal policy.
fn enter_realtime(priority: u8, what: &str, worker: Option<usize>) -> bool {
    if priority == 0 {
        return false;
    }
    match make_current_thread_realtime(priority) {
        Ok(()) => {
            tracing::info!(?worker, priority, "{what} runs SCHED_FIFO");
            true
        }
        Err(e) => {
            tracing::warn!(?worker, error = %e, "{what} keeps the normal policy");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_priorities_are_refused_with_a_clear_error() {
        for p in [0u8, 100, 255] {
            let e = make_current_thread_realtime(p).unwrap_err();
            assert!(matches!(e, SchedError::OutOfRange(q) if q == p));
            assert!(e.to_string().contains("1-99"), "{e}");
        }
    }

    /// A thread of its own (the test runner's threads stay as they are): realtime when
    /// the test may (root), a clear refusal otherwise.
    #[test]
    fn a_worker_thread_becomes_fifo_or_says_why_not() {
        std::thread::spawn(|| match make_current_thread_realtime(5) {
            Ok(()) => {
                // proc(5): fields are numbered from 1, the state (3) follows the comm;
                // rt_priority is field 40, policy field 41 (1 = SCHED_FIFO).
                let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
                let after_comm = stat.rsplit(')').next().unwrap();
                let fields: Vec<&str> = after_comm.split_whitespace().collect();
                let field = |n: usize| fields[n - 3];
                assert_eq!(field(41), "1", "policy in {stat}");
                assert_eq!(field(40), "5", "rt_priority in {stat}");
            }
            Err(e) => {
                // A refusal must be the kernel's: where `chrt` (util-linux) can start a
                // SCHED_FIFO process from here, the worker had to get it too.
                assert!(matches!(e, SchedError::Refused { .. }), "{e}");
                let chrt = std::process::Command::new("chrt")
                    .args(["--fifo", "5", "true"])
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(
                    !chrt,
                    "chrt runs SCHED_FIFO here, yet the worker was refused: {e}"
                );
                assert!(e.to_string().contains("CAP_SYS_NICE"), "{e}");
            }
        })
        .join()
        .unwrap();
    }
}
