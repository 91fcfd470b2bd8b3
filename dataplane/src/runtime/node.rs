//! The node thread: everything the process does besides forwarding, off the workers'
//! threads — following the control state ([`Control`]), attaching and detaching
//! discovered Pod interfaces ([`PodInterfaces`]), and the process-wide statistics
//! (table generation, held tables, neighbours, interfaces, the steering program's
//! drops), and probing the redirect peers ([`Prober`]). It owns the steering program's handle. It wakes when the node agent publishes
//! a new state (a futex), every [`TICK`] while something is pending, else every
//! [`IDLE_TICK`]; the workers never wait for it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::control::{Control, ControlCtx};
use super::pods::PodInterfaces;
use super::probes::{Prober, Unreachable};
use super::worker::{Published, Reporter};
use super::{now_unix, RuntimeConfig, StatsSender, STOP};
use crate::counters::{PeerCounters, RedirectPeerStats, Stats};
use crate::neigh::Neighbours;
use crate::netlink::SharedNeighbours;
use crate::region::monotonic_ms;
use crate::steering::Steering;

/// How often the node thread looks again while a table is held, not announced yet, or
/// an interface waits for its worker.
const TICK: Duration = Duration::from_millis(1);
/// How often it looks at the neighbours, the interfaces and the heartbeat otherwise (the
/// heartbeat is stamped every 20 ms; a new node state wakes it at once).
const IDLE_TICK: Duration = Duration::from_millis(10);

/// What the node thread owns.
pub(super) struct Node<'u> {
    pub control: Control,
    pub steering: Steering,
    /// `None` with route discovery off (fixed Pod interfaces only).
    pub pods: Option<PodInterfaces<'u>>,
    /// Backend addresses handed to the resolver (route discovery on).
    pub backend_ips: Option<Arc<ArcSwap<Vec<u32>>>>,
}

/// What the node thread shares with the workers and the resolver.
pub(super) struct NodeShared<'a> {
    pub cfg: &'a RuntimeConfig,
    pub neighbours: &'a SharedNeighbours,
    pub miss_tx: &'a crate::netlink::MissSender,
    pub published: &'a Published,
    /// The redirect peers the probes found unreachable, for the workers.
    pub unreachable: &'a Unreachable,
    pub stats_tx: &'a StatsSender,
}

impl Node<'_> {
    /// Runs until [`STOP`], probing the redirect peers with `prober`; the last statistics
    /// are sent on the way out.
    pub fn run(mut self, s: &NodeShared<'_>, mut prober: Prober) {
        let mut nb: Arc<Neighbours> = s.neighbours.get();
        let mut nb_version = s.neighbours.version();
        let mut last_reconcile = Instant::now();
        let mut last_stats = Instant::now();
        while !STOP.load(Ordering::Relaxed) {
            let now = Instant::now();
            let v = s.neighbours.version();
            let nb_changed = v != nb_version;
            if nb_changed {
                nb_version = v;
                nb = s.neighbours.get();
            }
            self.tick(s, &nb, now, nb_changed, &mut last_reconcile);
            let peers = self.control.probed_peers();
            prober.tick(
                self.control.redirector(),
                &peers,
                monotonic_ms(),
                s.unreachable,
            );
            if now.duration_since(last_stats) >= Duration::from_secs(1) {
                last_stats = now;
                let _ = s
                    .stats_tx
                    .try_send((Reporter::Node, self.stats(&nb, s, &prober)));
            }
            let pending = self.control.pending() || self.pods.as_ref().is_some_and(|p| p.opening());
            self.control
                .wait_for_state(if pending { TICK } else { IDLE_TICK });
        }
        let _ = s
            .stats_tx
            .send((Reporter::Node, self.stats(&nb, s, &prober)));
    }

    /// The control state, then the Pod interfaces: those `nb` lists or no longer lists
    /// (re-checked every second, e.g. to retry a failed attach) and those whose sockets
    /// the worker has taken since.
    fn tick(
        &mut self,
        s: &NodeShared<'_>,
        nb: &Neighbours,
        now: Instant,
        nb_changed: bool,
        last_reconcile: &mut Instant,
    ) {
        let ctx = ControlCtx {
            nb,
            shared: s.neighbours,
            miss_tx: s.miss_tx,
            published: s.published,
            backend_ips: self.backend_ips.as_ref(),
        };
        self.control.poll(s.cfg, now, &mut self.steering, &ctx);
        let Some(pods) = self.pods.as_mut() else {
            return;
        };
        if nb_changed || now.duration_since(*last_reconcile) >= Duration::from_secs(1) {
            *last_reconcile = now;
            pods.reconcile(nb, now, &mut self.steering);
        }
        pods.finish_opening(s.published, &mut self.steering);
    }

    /// The process-wide part of the statistics (the workers send their own), with the
    /// redirect peers' liveness.
    fn stats(&self, nb: &Neighbours, s: &NodeShared<'_>, prober: &Prober) -> Stats {
        let holds = self.control.holds;
        let mut st = Stats {
            timestamp: now_unix(),
            generation: self.control.seen_generation,
            tables_held: holds.held,
            held_tables_replaced: holds.replaced,
            held_tables_timed_out: holds.timed_out,
            neighbours: nb.neighbour_count() as u64,
            neighbour_requests: s.neighbours.requests.load(Ordering::Relaxed),
            ..Default::default()
        };
        if let Some(p) = &self.pods {
            st.pod_ifaces = p.names();
            st.pod_iface_attaches = p.attaches;
            st.pod_iface_detaches = p.detaches;
        }
        st.redirect_peers = prober
            .peers()
            .map(|p| RedirectPeerStats {
                peer: std::net::Ipv4Addr::from(p.addr).to_string(),
                counters: PeerCounters {
                    probes_sent: p.probes_sent,
                    ..Default::default()
                },
                reachable: super::probes::reachable(p.reach),
            })
            .collect();
        for (reason, n) in self.steering.drops().by_reason() {
            *st.drops.entry(reason.name().to_string()).or_default() += n;
        }
        st
    }
}
