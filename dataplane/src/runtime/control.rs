//! Following the control state, on the node thread: the node state the agent publishes
//! (one atomic load per tick, a snapshot only on change), a new table held while its
//! new backends' next hops are resolved, the steering maps, the table handed to every
//! worker ([`Published`]), the redirect channel's maps, and the dataplane status
//! juneau-bgp reads (heartbeat, the VIPs every worker serves). Never on a forwarding
//! thread: a worker only picks the published table up between batches.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use juneau_control::dataplane_status::DataplaneStatusWriter;
use juneau_control::shm::NodeStateReader;

use super::worker::Published;
use super::RuntimeConfig;
use crate::neigh::{Neighbours, Resolve, Side};
use crate::netlink::SharedNeighbours;
use crate::redirect::Redirector;
use crate::region::monotonic_ms;
use crate::services::ServiceTable;
use crate::steering::Steering;

fn open_state(path: &Path) -> Option<NodeStateReader> {
    match NodeStateReader::open(path) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "node state not readable yet; forwarding nothing until it is");
            None
        }
    }
}

/// What following the control state needs from the rest of the process.
pub(super) struct ControlCtx<'a> {
    pub nb: &'a Neighbours,
    pub shared: &'a SharedNeighbours,
    pub miss_tx: &'a crate::netlink::MissSender,
    pub published: &'a Published,
    /// Backend addresses handed to the resolver (route discovery on).
    pub backend_ips: Option<&'a Arc<ArcSwap<Vec<u32>>>>,
}

/// The node state followed (one atomic load per iteration; a snapshot only on change)
/// and the dataplane status written for juneau-bgp (heartbeat, programmed VIPs).
pub(super) struct Control {
    reader: Option<NodeStateReader>,
    last_open_try: Instant,
    pub seen_generation: u64,
    status: DataplaneStatusWriter,
    /// VIPs steered to us with a backend for new flows: what juneau-bgp may announce.
    programmed: Vec<std::net::IpAddr>,
    last_beat: Instant,
    /// Backend addresses of the table last read, in force or held (to spot new ones).
    known_backends: std::collections::HashSet<u32>,
    /// IPv6 backend addresses of the table last read.
    known_backends6: std::collections::HashSet<[u8; 16]>,
    /// Redirect peers of the table last read (to spot new ones).
    known_peers: Vec<u32>,
    /// A table waiting for its new backends' next hops (see [`Held`]).
    held: Option<Held>,
    /// Entries pushed to `SharedNeighbours::reverify` so far.
    reverify_pushed: u64,
    /// What the stats report of holding tables.
    pub holds: HoldCounts,
    /// The redirect channel's state as the table in force says (peers, this node's
    /// address, keys), for the steering program's redirect maps.
    redirector: Option<Redirector>,
    /// Whether a table was installed: until then the redirector's keys are not known.
    installed: bool,
    /// A table published to the workers whose VIPs juneau-bgp learns once every worker
    /// has taken it (generation, the workers' table version).
    unannounced: Option<(u64, u64)>,
    /// The kernel's DNAT to host-network backends, as last applied.
    host_network: crate::host_network::HostNetworkRules,
}

/// Tables held so far (installed after waiting), replaced while held, and installed
/// after [`HOLD_MAX`] with a next hop still unresolved.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct HoldCounts {
    pub held: u64,
    pub replaced: u64,
    pub timed_out: u64,
}

/// Longest a new table waits for its new backends' next hops to be resolved.
const HOLD_MAX: Duration = Duration::from_millis(250);

/// A new service table held back, the previous one still in force, until the next hops
/// of its new backends are resolved (or [`HOLD_MAX`] has passed): installed at once, its
/// first packets to a new backend would be dropped as `no_neighbour` while the resolver
/// re-resolves it (milliseconds), each costing a client a 1 s SYN retransmission.
struct Held {
    table: ServiceTable,
    generation: u64,
    /// When the first table still waiting was read (a newer one keeps this time, so a
    /// stream of changes is never held longer than `HOLD_MAX`).
    since: Instant,
    /// `SharedNeighbours::reverified` once the resolver has dropped and re-requested
    /// every entry this table pushed.
    reverify_target: u64,
    /// The resolver's snapshot version once it had: a resolution must come from a
    /// later snapshot (an earlier one may still hold a dropped entry).
    version: Option<u64>,
    /// Backend addresses (and new redirect peers) whose next hop must be found first; a
    /// replacing table carries over only the backends (the peers stay resolved ahead).
    waiting: Vec<u32>,
    /// New IPv6 backends whose next hop must be found first (neighbour discovery).
    waiting6: Vec<[u8; 16]>,
    /// The snapshot version `waiting` was last checked against (checked again only
    /// when the resolver publishes a new one).
    checked: u64,
}

/// What to do with a held table now.
#[derive(Debug, PartialEq, Eq)]
enum HoldVerdict {
    /// Keep the table in force; look again at the next tick.
    Wait,
    /// Install the held table: every next hop it waited for `resolved`, or not after
    /// [`HOLD_MAX`]; `waited` since the first held table was read.
    Install { resolved: bool, waited: Duration },
}

impl Held {
    /// Whether the held table may go in at `now` (sans-IO): the resolver has dropped and
    /// re-requested every entry this table pushed once `reverified` (its counter)
    /// reached `reverify_target`; a resolution counts only from a snapshot published
    /// after that (`current`, its version), and `all_found` looks at a snapshot only
    /// once per new version.
    fn verdict(
        &mut self,
        now: Instant,
        reverified: u64,
        current: u64,
        all_found: impl FnOnce(&[u32]) -> bool,
    ) -> HoldVerdict {
        if self.version.is_none() && reverified >= self.reverify_target {
            self.version = Some(current);
        }
        let refreshed = self.version.is_some_and(|v| current != v) && self.checked != current;
        if refreshed {
            self.checked = current;
        }
        let nothing = self.waiting.is_empty() && self.waiting6.is_empty();
        let resolved = nothing || refreshed && all_found(&self.waiting);
        let waited = now.saturating_duration_since(self.since);
        if resolved || waited >= HOLD_MAX {
            HoldVerdict::Install { resolved, waited }
        } else {
            HoldVerdict::Wait
        }
    }
}

impl Control {
    pub fn new(cfg: &RuntimeConfig) -> Result<Self> {
        let status = DataplaneStatusWriter::create(&cfg.status_file).with_context(|| {
            format!(
                "creating the dataplane status {}",
                cfg.status_file.display()
            )
        })?;
        Ok(Control {
            reader: open_state(&cfg.state_file),
            last_open_try: Instant::now(),
            seen_generation: 0,
            status,
            programmed: Vec::new(),
            last_beat: Instant::now(),
            known_backends: Default::default(),
            known_backends6: Default::default(),
            known_peers: Vec::new(),
            held: None,
            reverify_pushed: 0,
            holds: HoldCounts::default(),
            redirector: cfg.redirect.clone().map(Redirector::new),
            installed: false,
            unannounced: None,
            host_network: crate::host_network::HostNetworkRules::new(cfg.nft.clone()),
        })
    }

    /// Once per node-thread tick: a new service table when the state moved, the VIPs
    /// of the table the workers took, and the heartbeat (at most every 20 ms, while
    /// every worker loops).
    pub fn poll(
        &mut self,
        cfg: &RuntimeConfig,
        now: Instant,
        steering: &mut Steering,
        ctx: &ControlCtx<'_>,
    ) {
        if self.reader.is_none() && now.duration_since(self.last_open_try) > Duration::from_secs(1)
        {
            self.last_open_try = now;
            self.reader = open_state(&cfg.state_file);
        }
        if let Some(r) = self.reader.as_mut() {
            let g = r.generation();
            let held_g = self.held.as_ref().map(|h| h.generation);
            if g != self.seen_generation && g != 0 && Some(g) != held_g {
                match r.snapshot() {
                    Ok(snap) => self.take(cfg, &snap, now, ctx),
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the node state failed; keeping the previous table")
                    }
                }
            }
        }
        self.release_held(now, steering, ctx);
        self.announce_when_taken(ctx.published);
        // Every worker must be looping: an idle one wakes every `idle_sleep_ms`.
        let max_ms = 250u64.max(4 * cfg.idle_sleep_ms.max(0) as u64);
        if now.duration_since(self.last_beat) >= Duration::from_millis(20)
            && ctx.published.all_alive(monotonic_ms(), max_ms)
        {
            self.last_beat = now;
            self.status.heartbeat();
        }
    }

    /// Installs the held table once its new backends' next hops are resolved in a
    /// snapshot the resolver published after re-requesting them, or after [`HOLD_MAX`]
    /// ([`Held::verdict`]).
    fn release_held(&mut self, now: Instant, steering: &mut Steering, ctx: &ControlCtx<'_>) {
        let Some(h) = self.held.as_mut() else {
            return;
        };
        let found = |nb: &Neighbours, ip: u32| matches!(nb.resolve(ip), Resolve::Found { .. });
        let found6 = |nb: &Neighbours, ip: [u8; 16]| {
            matches!(nb.resolve6(ip), crate::neigh::Resolve6::Found { .. })
        };
        let reverified = ctx.shared.reverified.load(Ordering::Acquire);
        let waiting6 = h.waiting6.clone();
        let verdict = h.verdict(now, reverified, ctx.shared.version(), |waiting| {
            let nb = ctx.shared.get();
            waiting.iter().all(|ip| found(&nb, *ip)) && waiting6.iter().all(|ip| found6(&nb, *ip))
        });
        let HoldVerdict::Install { resolved, waited } = verdict else {
            return;
        };
        let h = self.held.take().expect("held");
        if !h.waiting.is_empty() || !h.waiting6.is_empty() {
            self.holds.held += 1;
        }
        if !resolved {
            self.holds.timed_out += 1;
            let nb = ctx.shared.get();
            let missing: Vec<std::net::IpAddr> = (h.waiting.iter())
                .filter(|ip| !found(&nb, **ip))
                .map(|ip| std::net::Ipv4Addr::from(*ip).into())
                .chain(
                    (h.waiting6.iter())
                        .filter(|ip| !found6(&nb, **ip))
                        .map(|ip| std::net::Ipv6Addr::from(*ip).into()),
                )
                .collect();
            tracing::warn!(
                generation = h.generation,
                waited_ms = waited.as_millis() as u64,
                unresolved = missing.len(),
                first = ?missing.iter().take(8).collect::<Vec<_>>(),
                "new backends' next hops not resolved in time; installing the table anyway"
            );
        }
        self.apply(h.table, h.generation, steering, ctx);
    }

    /// The IPv6 frontends into the steering maps; the programmed IPv6 VIPs follow (only
    /// those with a Ready backend here, as for IPv4).
    fn sync6(&mut self, table: &ServiceTable, steering: &mut Steering) {
        let vips6 = table.v6.serving_vips();
        self.programmed.retain(|v| v.is_ipv4());
        match steering.sync6(&table.v6.frontends()) {
            Ok(()) => self
                .programmed
                .extend(vips6.into_iter().map(std::net::IpAddr::from)),
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "updating the IPv6 steering maps failed; no IPv6 VIP is announced from this node")
            }
        }
    }

    /// A new node state read: the resolver starts on its backends at once; the table is
    /// installed now, or held (see [`Held`]) while new backends' next hops are resolved.
    fn take(
        &mut self,
        cfg: &RuntimeConfig,
        snap: &juneau_control::shm::Snapshot,
        now: Instant,
        ctx: &ControlCtx<'_>,
    ) {
        let table = ServiceTable::from_snapshot(snap);
        if let Some(b) = ctx.backend_ips {
            // The resolver finds their interfaces (route look-up).
            let mut ips: Vec<u32> = table
                .services()
                .iter()
                .flat_map(|s| s.backends.iter().map(|b| u32::from(b.ip)))
                .collect();
            ips.sort_unstable();
            ips.dedup();
            b.store(Arc::new(ips));
            let _ = ctx.miss_tx.try_send(crate::netlink::REFRESH);
        }
        let waiting6 = self.resolve_backends6(&table, ctx);
        let mut waiting = self.resolve_backends(&table, ctx);
        waiting.extend(self.resolve_peers(cfg, &table, ctx));
        // A table replacing a held one still waits for the held one's new backends it
        // keeps (they are no longer new to `known_backends`).
        if let Some(old) = self.held.as_ref() {
            let seen: std::collections::HashSet<u32> = waiting.iter().copied().collect();
            waiting.extend(
                old.waiting
                    .iter()
                    .filter(|ip| self.known_backends.contains(ip) && !seen.contains(ip)),
            );
        }
        if self.held.is_some() {
            self.holds.replaced += 1;
        }
        let since = self.held.as_ref().map_or(now, |h| h.since);
        self.held = Some(Held {
            table,
            generation: snap.generation,
            since,
            reverify_target: self.reverify_pushed,
            version: None,
            waiting,
            waiting6,
            checked: 0,
        });
    }

    /// Installs a service table: steering maps, then the workers' table; the status
    /// (the VIPs now programmed) follows once every worker took it.
    fn apply(
        &mut self,
        table: ServiceTable,
        generation: u64,
        steering: &mut Steering,
        ctx: &ControlCtx<'_>,
    ) {
        self.seen_generation = generation;
        // Announce only VIPs with a backend for new flows in the table in force: a VIP
        // steered here without one (redirects between nodes, draining) would otherwise
        // be announced before the table that brings its first backend is installed.
        let mut vips = table.serving_vips();
        // The kernel's DNAT first, so that a frontend is passed to the kernel only once
        // it can deliver it. Without it, a VIP served here only by host-network backends
        // is not announced (the steering program passes its packets to a kernel that
        // would route them back out).
        if let Err(e) = self.host_network.sync(&table) {
            tracing::error!(error = %e, "programming the DNAT to host-network backends failed; their VIPs are not announced from this node");
            let pod_served: std::collections::HashSet<_> = table
                .services()
                .iter()
                .filter(|s| !s.host_network && s.ready > 0)
                .map(|s| s.frontend.vip)
                .collect();
            let host_only: std::collections::HashSet<_> = table
                .services()
                .iter()
                .filter(|s| s.host_network && !pod_served.contains(&s.frontend.vip))
                .map(|s| s.frontend.vip)
                .collect();
            vips.retain(|v| !host_only.contains(v));
        }
        let vips: Vec<std::net::IpAddr> = vips.into_iter().map(Into::into).collect();
        if let Err(e) = steering.sync(&table) {
            // E.g. more VIPs than the map holds: keep forwarding what is steered rather
            // than stop serving every VIP.
            tracing::error!(error = %e, "updating the steering maps failed; some VIPs may not be steered");
            // Only VIPs steered before and still wanted are surely in the map: announce
            // no other.
            self.programmed.retain(|v| v.is_ipv6() || vips.contains(v));
        } else {
            self.programmed.retain(|v| v.is_ipv6());
            self.programmed.extend(vips);
        }
        self.sync6(&table, steering);
        tracing::info!(
            generation,
            services = table.services().len(),
            "service table updated"
        );
        if let Some(r) = self.redirector.as_mut() {
            r.set_from_state(table.redirects());
        }
        self.installed = true;
        let version = ctx.published.publish(&table);
        self.unannounced = Some((generation, version));
        if let Err(e) = self.listen_redirects(steering) {
            tracing::error!(error = %e, "steering redirected packets to this node failed; it takes none");
        }
        self.announce_when_taken(ctx.published);
    }

    /// Tells juneau-bgp the VIPs of the table last published once every worker has
    /// taken it: announced earlier, a VIP's first packets could reach a worker still
    /// without its service.
    fn announce_when_taken(&mut self, published: &Published) {
        let Some((generation, version)) = self.unannounced else {
            return;
        };
        if !published.all_took(version) {
            return;
        }
        self.unannounced = None;
        if let Err(e) = self
            .status
            .publish(generation, self.programmed.iter().copied())
        {
            tracing::error!(error = %e, "writing the dataplane status failed; juneau-bgp keeps the previous VIP set");
        }
    }

    /// Whether something waits on a next tick rather than on a new node state: a held
    /// table (its next hops) or a table not announced yet (the workers taking it).
    pub fn pending(&self) -> bool {
        self.held.is_some() || self.unannounced.is_some()
    }

    /// Sleeps until the node agent publishes a node state this thread has not read, or
    /// `timeout` passes (a futex on the state file: a new table is picked up at once).
    pub fn wait_for_state(&mut self, timeout: Duration) {
        let read = self
            .held
            .as_ref()
            .map_or(self.seen_generation, |h| h.generation);
        match self.reader.as_mut() {
            Some(r) => {
                r.wait_change(read, timeout);
            }
            None => std::thread::sleep(timeout),
        }
    }

    /// The node thread's redirector (the peers, this node's address, the keys) as the
    /// table in force says: `None` with redirects off, and before the first table (a
    /// frame sent then could lack the key the peers check).
    pub fn redirector(&self) -> Option<&Redirector> {
        self.redirector.as_ref().filter(|_| self.installed)
    }

    /// The peers to probe: those of the VIPs this node serves (programmed), sorted — the
    /// ones it hands connections to and asks, and which list it in turn (a node serving no
    /// VIP is no peer of theirs: its probes would be their `redirect_not_from_peer`).
    pub fn probed_peers(&self) -> Vec<u32> {
        let Some(r) = self.redirector() else {
            return Vec::new();
        };
        let mut out: Vec<u32> = self
            .programmed
            .iter()
            .flat_map(|v| match v {
                std::net::IpAddr::V4(a) => r.peers_for(u32::from(*a)),
                std::net::IpAddr::V6(a) => r.peers_for6(&a.octets()),
            })
            .copied()
            .filter(|p| *p != 0 && *p != r.node())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Steers redirected packets to this node once its redirect address is known (see
    /// [`listen_redirects`]).
    pub fn listen_redirects(&self, steering: &mut Steering) -> Result<()> {
        match &self.redirector {
            Some(r) => listen_redirects(steering, r),
            None => Ok(()),
        }
    }

    /// Starts resolving new backends now rather than on their first packet. A backend
    /// address new to the table is re-resolved even when the kernel has an entry: a new
    /// Pod may reuse the address (and not the MAC) of a deleted one. Returns the backend
    /// addresses whose next hop is not known to be current yet: those re-resolved and
    /// those missing.
    fn resolve_backends(&mut self, table: &ServiceTable, ctx: &ControlCtx<'_>) -> Vec<u32> {
        let nb = ctx.nb;
        let mut reverify = Vec::new();
        let mut waiting = std::collections::HashSet::new();
        let mut now_backends = std::collections::HashSet::new();
        for s in table.services() {
            for b in &s.backends {
                let ip = u32::from(b.ip);
                now_backends.insert(ip);
                let new = !self.known_backends.contains(&ip);
                if new {
                    if let Some(r) = nb.route(ip) {
                        if matches!(nb.side_of(r.ifindex), Some((Side::Pod(_), _))) {
                            reverify.push((r.gateway.unwrap_or(ip), r.ifindex));
                            waiting.insert(ip);
                        }
                    }
                }
                if let Resolve::Miss { ip: hop, ifindex } = nb.resolve(ip) {
                    let _ = ctx.miss_tx.try_send(crate::netlink::miss4(hop, ifindex));
                    if new {
                        waiting.insert(ip);
                    }
                }
            }
        }
        self.known_backends = now_backends;
        if !reverify.is_empty() {
            for k in reverify {
                // Full queue: that backend is resolved on its first miss.
                if ctx.shared.reverify.push(k).is_ok() {
                    self.reverify_pushed += 1;
                }
            }
            let _ = ctx.miss_tx.try_send(crate::netlink::REFRESH);
        }
        waiting.into_iter().collect()
    }

    /// Asks the resolver for the next hops of IPv6 backends it cannot resolve yet (so
    /// neighbour discovery starts before their first packet); returns the new ones among
    /// them, which the table waits for like new IPv4 backends. (IPv4's re-verification of
    /// a reused address is not done for IPv6 yet.)
    fn resolve_backends6(&mut self, table: &ServiceTable, ctx: &ControlCtx<'_>) -> Vec<[u8; 16]> {
        let nb = ctx.shared.get();
        let mut waiting = Vec::new();
        let mut now_backends = std::collections::HashSet::new();
        for b in table.v6.services().iter().flat_map(|s| &s.backends) {
            now_backends.insert(b.ip);
            if let crate::neigh::Resolve6::Miss { ip, ifindex } = nb.resolve6(b.ip) {
                let _ = ctx
                    .miss_tx
                    .try_send((std::net::Ipv6Addr::from(ip).into(), ifindex));
                if !self.known_backends6.contains(&b.ip) && !waiting.contains(&b.ip) {
                    waiting.push(b.ip);
                }
            }
        }
        self.known_backends6 = now_backends;
        waiting
    }

    /// Keeps the redirect peers' next hops resolved ahead of the first redirect (an ECMP
    /// change sends a node connections it must redirect at once; each first packet
    /// dropped as `no_neighbour` costs a retransmission). Returns the new peers whose
    /// next hop is not resolved yet: the table waits for them like for new backends.
    fn resolve_peers(
        &mut self,
        cfg: &RuntimeConfig,
        table: &ServiceTable,
        ctx: &ControlCtx<'_>,
    ) -> Vec<u32> {
        let Some(r) = cfg.redirect.as_ref() else {
            return Vec::new();
        };
        let peers = crate::redirect::peers_of(r, table.redirects());
        let mut waiting = Vec::new();
        for &p in &peers {
            if let Resolve::Miss { ip: hop, ifindex } = ctx.nb.resolve(p) {
                let _ = ctx.miss_tx.try_send(crate::netlink::miss4(hop, ifindex));
                if self.known_peers.binary_search(&p).is_err() {
                    waiting.push(p);
                }
            }
        }
        ctx.shared.set_ahead(peers.clone());
        self.known_peers = peers;
        waiting
    }
}

/// Steers redirected packets to this node's redirect address, once it is known (given,
/// or published by the node agent) and whenever it changes, from its peers only (the
/// steering program drops the rest); says once, and on every change, whether the
/// channel is authenticated (the key ids in force).
fn listen_redirects(steering: &mut Steering, r: &Redirector) -> Result<()> {
    if r.active() {
        // The peers first: the program takes redirects only from them.
        let peers: Vec<std::net::Ipv4Addr> = r
            .all_peers()
            .iter()
            .map(|p| std::net::Ipv4Addr::from(*p))
            .collect();
        steering.set_redirect_peers(&peers)?;
        let node = std::net::Ipv4Addr::from(r.node());
        if steering.listening_redirects() != Some((node, r.port())) {
            steering.listen_redirects(node, r.port())?;
            tracing::info!(node = %node, port = r.port(), peers = r.all_peers().len(), "redirects between nodes on");
        }
        log_redirect_keys(r);
    }
    Ok(())
}

/// The key ids last logged (`u32::MAX`: nothing logged yet): a log line when they change.
static LOGGED_KEY_IDS: AtomicU32 = AtomicU32::new(u32::MAX);

fn log_redirect_keys(r: &Redirector) {
    // Count and ids packed (at most two keys), never a key's bytes.
    let ids = r
        .keys()
        .iter()
        .fold(r.keys().len() as u32, |acc, k| (acc << 8) | u32::from(k.id));
    if LOGGED_KEY_IDS.swap(ids, Ordering::Relaxed) == ids {
        return;
    }
    if r.keys().is_empty() {
        tracing::warn!(
            "redirect channel unauthenticated: no key published (Secret juneau-redirect-key); frames go out as wire version 2 (cookie only) and any peer's frame is taken"
        );
    } else {
        let key_ids: Vec<u8> = r.keys().iter().map(|k| k.id).collect();
        tracing::info!(?key_ids, "redirect channel authenticated (wire version 3): sending with the first key id, accepting tags under any");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(waiting: &[u32], since: Instant) -> Held {
        Held {
            table: ServiceTable::default(),
            generation: 7,
            since,
            reverify_target: 10,
            version: None,
            waiting: waiting.to_vec(),
            waiting6: Vec::new(),
            checked: 0,
        }
    }

    #[test]
    fn a_table_without_new_next_hops_goes_in_at_once() {
        let t0 = Instant::now();
        let mut h = held(&[], t0);
        let v = h.verdict(t0, 0, 1, |_| panic!("nothing to look up"));
        assert_eq!(
            v,
            HoldVerdict::Install {
                resolved: true,
                waited: Duration::ZERO
            }
        );
    }

    #[test]
    fn a_resolution_counts_only_from_a_snapshot_after_the_re_request() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut h = held(&[1, 2], t0);
        // The resolver has not re-requested every entry yet: whatever a snapshot says
        // (it may hold an entry about to be dropped), wait.
        assert_eq!(h.verdict(ms(1), 9, 4, |_| true), HoldVerdict::Wait);
        // Re-requested at snapshot 4: snapshot 4 itself does not count.
        assert_eq!(h.verdict(ms(2), 10, 4, |_| true), HoldVerdict::Wait);
        // Snapshot 5 lacks one of them: wait, and look at 5 only once.
        assert_eq!(
            h.verdict(ms(3), 10, 5, |w| {
                assert_eq!(w, [1, 2]);
                false
            }),
            HoldVerdict::Wait
        );
        assert_eq!(
            h.verdict(ms(4), 10, 5, |_| panic!("5 seen already")),
            HoldVerdict::Wait
        );
        // Snapshot 6 has both: in.
        assert_eq!(
            h.verdict(ms(5), 10, 6, |_| true),
            HoldVerdict::Install {
                resolved: true,
                waited: Duration::from_millis(5)
            }
        );
    }

    #[test]
    fn a_table_waits_at_most_hold_max() {
        let t0 = Instant::now();
        let mut h = held(&[1], t0);
        assert_eq!(
            h.verdict(t0 + HOLD_MAX / 2, 0, 1, |_| false),
            HoldVerdict::Wait
        );
        assert_eq!(
            h.verdict(t0 + HOLD_MAX, 0, 1, |_| false),
            HoldVerdict::Install {
                resolved: false,
                waited: HOLD_MAX
            }
        );
    }
}
