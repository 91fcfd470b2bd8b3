//! The capabilities the dataplane keeps once it forwards.
//!
//! Set-up needs much: loading and verifying the steering program (`CAP_BPF`,
//! `CAP_PERFMON`, `CAP_NET_ADMIN` for an XDP program), registering the UMEM without
//! charging it to `RLIMIT_MEMLOCK` (`CAP_IPC_LOCK`), creating AF_XDP sockets
//! (`CAP_NET_RAW`), attaching XDP and turning busy polling on (`CAP_NET_ADMIN`). Once the
//! sockets are bound and the program attached, the process parses traffic an attacker
//! chooses with whatever it still holds, so it keeps only what forwarding still calls:
//!
//! - `CAP_NET_ADMIN`, always: the neighbour resolver writes the kernel's neighbour table
//!   (`RTM_NEWNEIGH` with `NTF_USE` to start ARP for a backend, `RTM_DELNEIGH` to forget
//!   a reused address: `netlink::Netlink::request_resolution`, `forget_neighbour`), which
//!   rtnetlink allows only with `CAP_NET_ADMIN`; and with Pod interfaces found through
//!   routes and `--xsk-busy-poll-budget`, a new Pod's sockets get busy polling
//!   (`SO_PREFER_BUSY_POLL`, and `SO_BUSY_POLL_BUDGET` above the default, need it); and
//!   the `nft` the node thread executes for host-network backends (`host_network.rs`)
//!   programs nftables with it.
//! - `CAP_NET_RAW`, only with Pod interfaces found through routes
//!   (`--pod-ifaces-from-routes`): a Pod veth that appears while forwarding gets AF_XDP
//!   sockets, and `socket(AF_XDP)` needs it. With fixed `--pod-iface`s (the chart) no
//!   socket is created after set-up.
//! - `CAP_BPF`, only on kernels before 6.5: there every `bpf(2)` call, even an update of
//!   a map this process holds (the service maps on each new state, the XSK map of a new
//!   Pod's sockets), is refused without it when unprivileged BPF is disabled (the
//!   default). From 6.5 on, operations on held map, program and link descriptors need no
//!   capability.
//! - `CAP_SYS_NICE`, only until each forwarding worker has entered `SCHED_FIFO`
//!   (`crate::sched`): the workers all start with the process (none is started later),
//!   each drops it once its policy is set ([`Forwarding::settle_thread`]).
//!
//! Dropped for good: `CAP_BPF` (from 6.5), `CAP_PERFMON`, `CAP_IPC_LOCK`, `CAP_NET_RAW`
//! (fixed Pod interfaces), `CAP_SYS_NICE` (after the workers start) and anything else the
//! process was given (run as root outside a container: all of them).
//!
//! Capabilities are per thread in Linux: a thread drops its own, and a new thread starts
//! with its creator's. So the main thread drops right after set-up, before it starts the
//! metrics, stats and worker threads; the neighbour resolver, started earlier, drops its
//! own when it begins; threads started from a thread that still holds `CAP_SYS_NICE`
//! drop it themselves.
//!
//! The bounding set is lowered to the kept set too when the process may
//! (`CAP_SETPCAP`, e.g. run as root outside a container), so that even an `execve` of a
//! root process cannot bring a dropped capability back. In a container without
//! `CAP_SETPCAP` it cannot, and does not need to: the chart's
//! `allowPrivilegeEscalation: false` sets `no_new_privs`, under which an `execve` gets at
//! most the permitted set it had.

use std::collections::HashSet;

use caps::{CapSet, Capability, CapsHashSet};

/// What the forwarding threads keep, decided from the configuration and the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forwarding {
    /// Kept for as long as the process forwards.
    pub keep: CapsHashSet,
    /// Whether `CAP_SYS_NICE` is kept until the workers have entered `SCHED_FIFO`.
    pub nice_at_start: bool,
}

/// A kernel release's major and minor numbers (`6.18.44-x` → `(6, 18)`).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// The running kernel's version, from `/proc/sys/kernel/osrelease` (`None` if unreadable:
/// then `CAP_BPF` is kept, as on an old kernel).
pub fn running_kernel() -> Option<(u32, u32)> {
    kernel_version(
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()?
            .trim(),
    )
}

impl Forwarding {
    /// What forwarding needs: Pod interfaces attached while running or not, realtime
    /// workers or not (`--worker-priority` > 0), on a kernel of this version.
    pub fn needs(pods_from_routes: bool, realtime: bool, kernel: Option<(u32, u32)>) -> Self {
        let mut keep: CapsHashSet = HashSet::from([Capability::CAP_NET_ADMIN]);
        if pods_from_routes {
            keep.insert(Capability::CAP_NET_RAW);
        }
        if kernel.is_none_or(|v| v < (6, 5)) {
            keep.insert(Capability::CAP_BPF);
        }
        Forwarding {
            keep,
            nice_at_start: realtime,
        }
    }

    /// The main thread, once set-up is done (sockets bound, programs attached) and
    /// before it starts any other thread: keeps [`Forwarding::keep`] (and
    /// `CAP_SYS_NICE` for the workers' start), drops the rest. Returns what it dropped
    /// from the permitted set, for the log.
    pub fn enter(&self) -> Result<CapsHashSet, caps::errors::CapsError> {
        let mut keep = self.keep.clone();
        if self.nice_at_start {
            keep.insert(Capability::CAP_SYS_NICE);
        }
        let before = caps::read(None, CapSet::Permitted)?;
        restrict_current_thread(&keep, &self.keep)?;
        let after = caps::read(None, CapSet::Permitted)?;
        Ok(before.difference(&after).copied().collect())
    }

    /// A thread that was started before set-up ended (the neighbour resolver): drops
    /// everything but [`Forwarding::keep`].
    pub fn enter_early_thread(&self) -> Result<(), caps::errors::CapsError> {
        restrict_current_thread(&self.keep, &self.keep)
    }

    /// A thread that needs no `CAP_SYS_NICE` (any more): a worker once it runs
    /// `SCHED_FIFO` (or was refused it), the stats and metrics threads. Logs a failure
    /// (dropping a capability one holds does not fail in practice).
    pub fn settle_thread(&self) {
        if let Err(e) = drop_current(Capability::CAP_SYS_NICE) {
            tracing::warn!(error = %e, "dropping CAP_SYS_NICE failed");
        }
    }
}

/// Drops `cap` from the calling thread's effective and permitted sets.
fn drop_current(cap: Capability) -> Result<(), caps::errors::CapsError> {
    caps::drop(None, CapSet::Effective, cap)?;
    caps::drop(None, CapSet::Permitted, cap)
}

/// Leaves the calling thread at most `keep` in its effective and permitted sets (only
/// what it holds: nothing is raised), nothing inheritable or ambient, and — when it holds
/// `CAP_SETPCAP` — at most `bounding` in its bounding set.
pub fn restrict_current_thread(
    keep: &CapsHashSet,
    bounding: &CapsHashSet,
) -> Result<(), caps::errors::CapsError> {
    // The bounding set first: lowering it takes CAP_SETPCAP, dropped below.
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP)? {
        for cap in caps::read(None, CapSet::Bounding)? {
            if !bounding.contains(&cap) {
                caps::drop(None, CapSet::Bounding, cap)?;
            }
        }
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    let permitted = caps::read(None, CapSet::Permitted)?;
    let kept: CapsHashSet = permitted.intersection(keep).copied().collect();
    // Effective first: it must stay within the permitted set at every step.
    caps::set(None, CapSet::Effective, &kept)?;
    caps::set(None, CapSet::Permitted, &kept)
}

/// Capabilities by name, sorted (for logs).
pub fn names(set: &CapsHashSet) -> Vec<String> {
    let mut v: Vec<String> = set.iter().map(|c| c.to_string()).collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(kernel_version("6.18.44-fc-v1272"), Some((6, 18)));
        assert_eq!(kernel_version("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(kernel_version("6.5"), Some((6, 5)));
        assert_eq!(kernel_version("garbage"), None);
    }

    #[test]
    fn what_forwarding_keeps() {
        use Capability::*;
        let new = Some((6, 18));
        let fixed = Forwarding::needs(false, true, new);
        assert_eq!(fixed.keep, HashSet::from([CAP_NET_ADMIN]));
        assert!(fixed.nice_at_start);
        let routes = Forwarding::needs(true, false, new);
        assert_eq!(routes.keep, HashSet::from([CAP_NET_ADMIN, CAP_NET_RAW]));
        assert!(!routes.nice_at_start);
        for old in [Some((5, 15)), Some((6, 4)), None] {
            assert_eq!(
                Forwarding::needs(false, true, old).keep,
                HashSet::from([CAP_NET_ADMIN, CAP_BPF])
            );
        }
        for f in [fixed, routes] {
            for gone in [CAP_PERFMON, CAP_IPC_LOCK, CAP_SYS_ADMIN, CAP_SYS_NICE] {
                assert!(!f.keep.contains(&gone), "{gone} kept");
            }
        }
    }

    /// On a thread of its own (capabilities are per thread): what it holds afterwards
    /// is at most the kept set, whatever it held before (all of them as root, none as
    /// another user).
    #[test]
    fn a_restricted_thread_holds_at_most_the_kept_set() {
        std::thread::spawn(|| {
            let keep = HashSet::from([Capability::CAP_NET_ADMIN]);
            let before = caps::read(None, CapSet::Permitted).unwrap();
            restrict_current_thread(&keep, &keep).unwrap();
            let expected: CapsHashSet = before.intersection(&keep).copied().collect();
            assert_eq!(caps::read(None, CapSet::Permitted).unwrap(), expected);
            assert_eq!(caps::read(None, CapSet::Effective).unwrap(), expected);
            assert!(caps::read(None, CapSet::Inheritable).unwrap().is_empty());
            if before.contains(&Capability::CAP_SETPCAP) {
                assert_eq!(caps::read(None, CapSet::Bounding).unwrap(), keep);
            }
            // A thread it starts inherits the restriction.
            let child = std::thread::spawn(|| caps::read(None, CapSet::Permitted).unwrap());
            assert_eq!(child.join().unwrap(), expected);
        })
        .join()
        .unwrap();
    }
}
