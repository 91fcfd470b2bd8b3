//! Pod interfaces found through the routing table (`--pod-ifaces-from-routes`),
//! attached and detached on the node thread while the workers forward: a socket per
//! queue opened here and handed to the worker that serves it ([`PortChange`]), the
//! steering program attached once that worker has taken the sockets (so the first
//! packets find frames in their fill rings), and on detach the program removed before
//! the worker closes the sockets and takes their frames back. Opening a socket can wait
//! up to two seconds for a queue a replaced process still holds: never on a forwarding
//! thread.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::worker::{PortChange, Published};
use super::{rx_queues, SocketFactory};
use crate::neigh::{Neighbours, Side};
use crate::netlink;
use crate::steering::{IfaceLink, SteeredIface, Steering};

/// The worker that serves discovered Pod interfaces (a per-Pod veth has one queue;
/// `worker_count` allows one worker with discovery on).
const POD_WORKER: usize = 0;

/// A Pod interface found through the routing table and attached while running.
struct DiscoveredPod {
    steered: SteeredIface,
    link: IfaceLink,
}

/// An interface whose sockets the worker has been sent, waiting for it to take them
/// before the steering program is attached.
struct Opening {
    steered: SteeredIface,
    /// The worker has taken it once its applied changes reach this count.
    seq: u64,
}

/// Discovered Pod interfaces: their redirect-map slots and sockets' frame budget.
pub(super) struct PodInterfaces<'u> {
    factory: SocketFactory<'u>,
    slots: SocketSlots,
    fill_budget: u32,
    attached: Vec<DiscoveredPod>,
    opening: Vec<Opening>,
    /// Interfaces whose attach failed, and when to try again.
    retry_after: HashMap<u32, Instant>,
    /// `--pod-iface` interfaces (never detached).
    explicit: Vec<u32>,
    /// Socket changes for [`POD_WORKER`], and how many were sent.
    to_worker: mpsc::Sender<PortChange>,
    sent: u64,
    /// What the stats report.
    pub attaches: u64,
    pub detaches: u64,
}

impl<'u> PodInterfaces<'u> {
    pub fn new(
        factory: SocketFactory<'u>,
        (slot_base, slots): (u32, u32),
        fill_budget: u32,
        explicit: Vec<u32>,
        to_worker: mpsc::Sender<PortChange>,
    ) -> Self {
        PodInterfaces {
            factory,
            slots: SocketSlots::new(slot_base, slots),
            fill_budget,
            attached: Vec::new(),
            opening: Vec::new(),
            retry_after: HashMap::new(),
            explicit,
            to_worker,
            sent: 0,
            attaches: 0,
            detaches: 0,
        }
    }

    /// Whether sockets were handed to the worker and their program waits for it.
    pub fn opening(&self) -> bool {
        !self.opening.is_empty()
    }

    /// The attached interfaces' names.
    pub fn names(&self) -> Vec<String> {
        self.attached
            .iter()
            .map(|d| d.steered.name.clone())
            .collect()
    }

    /// Opens sockets on the Pod interfaces `nb` lists that have none yet and detaches
    /// discovered ones it no longer lists (their routes went away, e.g. the veth was
    /// deleted).
    pub fn reconcile(&mut self, nb: &Neighbours, now: Instant, steering: &mut Steering) {
        let listed = |ifindex: u32| nb.pods().iter().any(|p| p.ifindex == ifindex);
        // Detach first: frees slots for the new ones.
        let gone: Vec<usize> = (0..self.attached.len())
            .filter(|&i| {
                let ifindex = self.attached[i].steered.ifindex;
                !listed(ifindex) || netlink::iface_name(ifindex).is_err()
            })
            .collect();
        for i in gone.into_iter().rev() {
            let d = self.attached.remove(i);
            self.detach(d, steering);
        }
        let abandoned: Vec<usize> = (0..self.opening.len())
            .filter(|&i| !listed(self.opening[i].steered.ifindex))
            .collect();
        for i in abandoned.into_iter().rev() {
            let o = self.opening.remove(i);
            self.close(&o.steered);
        }
        for p in nb.pods() {
            let known = self.explicit.contains(&p.ifindex)
                || self.attached.iter().any(|d| d.steered.ifindex == p.ifindex)
                || self.opening.iter().any(|o| o.steered.ifindex == p.ifindex)
                || self.retry_after.get(&p.ifindex).is_some_and(|t| now < *t);
            if known {
                continue;
            }
            if let Err(e) = self.open(p.ifindex, steering) {
                self.failed(p.ifindex, now, &e);
            }
        }
        self.retry_after.retain(|ifindex, _| listed(*ifindex));
    }

    /// Attaches the steering program to every interface whose sockets the worker took.
    pub fn finish_opening(&mut self, published: &Published, steering: &mut Steering) {
        let applied = published.changes_applied(POD_WORKER);
        let ready: Vec<usize> = (0..self.opening.len())
            .filter(|&i| self.opening[i].seq <= applied)
            .collect();
        for i in ready.into_iter().rev() {
            let si = self.opening.remove(i).steered;
            match steering.attach_iface(&si) {
                Ok(link) => {
                    tracing::info!(iface = %si.name, ifindex = si.ifindex, queues = si.queues, "Pod interface attached");
                    self.attached.push(DiscoveredPod { steered: si, link });
                    self.attaches += 1;
                }
                Err(e) => {
                    self.close(&si);
                    self.failed(si.ifindex, Instant::now(), &e);
                }
            }
        }
    }

    fn failed(&mut self, ifindex: u32, now: Instant, e: &anyhow::Error) {
        tracing::warn!(ifindex, error = %format!("{e:#}"), "attaching a discovered Pod interface failed; retrying in 1 s");
        self.retry_after
            .insert(ifindex, now + Duration::from_secs(1));
    }

    /// Opens a socket per queue of the interface (registered in the redirect map; the
    /// program passes packets to the kernel until it is attached) and sends them to the
    /// worker.
    fn open(&mut self, ifindex: u32, steering: &mut Steering) -> Result<()> {
        let name = netlink::iface_name(ifindex).context("interface gone")?;
        let queues = rx_queues(&name);
        let slot_base = self
            .slots
            .alloc(queues)
            .with_context(|| format!("{name}: no free AF_XDP socket (raise --max-pod-sockets)"))?;
        let si = SteeredIface {
            name,
            ifindex,
            uplink: false,
            slot_base,
            queues,
        };
        let ports = self
            .factory
            .open(&si, Side::Pod(0), self.fill_budget, steering, (0, 1))
            .inspect_err(|_| self.slots.free(slot_base, queues))?;
        self.send(PortChange::Add(ports));
        self.opening.push(Opening {
            steered: si,
            seq: self.sent,
        });
        Ok(())
    }

    fn detach(&mut self, d: DiscoveredPod, steering: &mut Steering) {
        tracing::info!(iface = %d.steered.name, ifindex = d.steered.ifindex, "Pod interface detached");
        steering.detach_iface(&d.steered, d.link);
        self.close(&d.steered);
        self.detaches += 1;
    }

    /// The worker closes the interface's sockets; their slots are free again.
    fn close(&mut self, si: &SteeredIface) {
        self.send(PortChange::Close(si.ifindex));
        self.slots.free(si.slot_base, si.queues);
    }

    fn send(&mut self, change: PortChange) {
        // The worker outlives the node thread's loop; a send fails only as it stops.
        if self.to_worker.send(change).is_ok() {
            self.sent += 1;
        }
    }
}

/// The redirect-map slots of discovered interfaces' sockets: one per queue, an
/// interface's slots consecutive (the program finds a queue's socket at its interface's
/// first slot + the queue).
struct SocketSlots {
    /// First slot for discovered interfaces.
    base: u32,
    /// Slots in use (relative to `base`).
    used: Vec<bool>,
}

impl SocketSlots {
    fn new(base: u32, n: u32) -> Self {
        SocketSlots {
            base,
            used: vec![false; n as usize],
        }
    }

    /// The first of `n` consecutive free slots, now taken; `None` when there is no such
    /// run (or `n` is 0).
    fn alloc(&mut self, n: u32) -> Option<u32> {
        let n = n as usize;
        if n == 0 {
            return None;
        }
        let free_run = (0..self.used.len().saturating_sub(n - 1))
            .find(|&i| self.used[i..i + n].iter().all(|u| !u))?;
        for u in &mut self.used[free_run..free_run + n] {
            *u = true;
        }
        Some(self.base + free_run as u32)
    }

    /// Frees the `n` slots from `base` on.
    fn free(&mut self, base: u32, n: u32) {
        let from = (base - self.base) as usize;
        for u in self.used.iter_mut().skip(from).take(n as usize) {
            *u = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interface_gets_consecutive_slots_and_gives_them_back() {
        let mut s = SocketSlots::new(16, 6);
        assert_eq!(s.alloc(1), Some(16));
        assert_eq!(s.alloc(4), Some(17));
        assert_eq!(s.alloc(2), None, "one slot left");
        assert_eq!(s.alloc(1), Some(21));
        s.free(17, 4);
        assert_eq!(s.alloc(2), Some(17), "the freed run, lowest first");
        assert_eq!(s.alloc(3), None, "two left, not consecutive with three");
        assert_eq!(s.alloc(2), Some(19));
        assert_eq!(s.alloc(1), None);
    }
}
