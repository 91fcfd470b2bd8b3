//! The daemon: one tokio task per peer drives a [`fsm::Peer`] over real TCP, announcing
//! exactly the VIPs the node's control state lists.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use juneau_control::model::{NodeState, PeerConfig};
use juneau_control::secret::Secret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::family::{AddressFamily, Families};
use crate::fsm::{self, Action, ConnId, Event, Peer, SessionConfig, Timer};
use crate::rib::{self, AdjRibOut, SessionParams};
use crate::sockopt;
use crate::status::{unix_now, PeerStatus, StatusHub};
use crate::wire::{self, cease, Message, Notification, Update};

/// The control state as the speaker sees it: generation and state.
pub type SharedState = Arc<(u64, NodeState)>;

/// Daemon-wide settings from the command line.
#[derive(Debug, Clone)]
pub struct SpeakerConfig {
    /// Router ID override (else `NodeState.router_id`, else the first peer's source
    /// address).
    pub router_id: Option<Ipv4Addr>,
    /// Where to accept BGP connections.
    pub listen: SocketAddr,
    /// BFD runs in juneau-bfd, which writes this status file; `None`: BFD runs in this
    /// process (see `crate::bfd_io`).
    pub bfd_status_file: Option<std::path::PathBuf>,
    /// Offer IPv6 unicast on every session from the start (`--offer-ipv6`), not only
    /// once a peer has an IPv6 VIP.
    pub offer_ipv6: bool,
}

impl SpeakerConfig {
    /// The families every session offers before any VIP asks for more.
    fn base_families(&self) -> Families {
        if self.offer_ipv6 {
            Families::BOTH
        } else {
            Families::IPV4
        }
    }
}

/// Reads the node's control state in a thread (futex wake-ups, no polling) and publishes
/// each new generation on a watch channel.
pub fn watch_state(path: std::path::PathBuf) -> watch::Receiver<SharedState> {
    let (tx, rx) = watch::channel(Arc::new((0, NodeState::default())));
    std::thread::Builder::new()
        .name("state-watch".into())
        .spawn(move || {
            let Some(mut state) = StateFollower::open(&path, || tx.is_closed()) else {
                return;
            };
            loop {
                let next = state.next(Duration::from_secs(1));
                if tx.is_closed() {
                    return;
                }
                if let Some(s) = next {
                    let _ = tx.send(Arc::new(s));
                }
            }
        })
        .expect("spawn state watcher");
    rx
}

/// Follows the node-state file for the state watchers ([`watch_state`],
/// `crate::gate::watch_gated_state`): waits for the file, then hands out each new
/// generation.
pub(crate) struct StateFollower {
    reader: juneau_control::shm::NodeStateReader,
    seen: u64,
}

impl StateFollower {
    /// Opens `path`, waiting (logged once) until the agent has created it; `None` once
    /// `gone()` says nobody listens any more.
    pub(crate) fn open(path: &std::path::Path, gone: impl Fn() -> bool) -> Option<Self> {
        let mut warned = false;
        loop {
            match juneau_control::shm::NodeStateReader::open(path) {
                Ok(reader) => return Some(StateFollower { reader, seen: 0 }),
                Err(e) => {
                    if !warned {
                        tracing::warn!(path = %path.display(), error = %e, "waiting for the node state file");
                        warned = true;
                    }
                    if gone() {
                        return None;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// The state if a newer generation was published, waiting for one at most `wait`
    /// (futex); `None` when none came (or it could not be read yet: tried again next).
    pub(crate) fn next(&mut self, wait: Duration) -> Option<(u64, NodeState)> {
        if self.reader.wait_change(self.seen, wait) == self.seen {
            return None;
        }
        // The routing part only: the services and their Maglev tables are the
        // dataplane's (at 10 000 Services a full snapshot is ~0.3 s of CPU per publish).
        match self.reader.routing_snapshot() {
            Ok(s) => {
                self.seen = s.generation;
                tracing::debug!(
                    generation = self.seen,
                    vips = s.state.advertised.len(),
                    "control state changed"
                );
                Some((s.generation, s.state))
            }
            Err(e) => {
                tracing::debug!(error = %e, "state not readable yet");
                std::thread::sleep(Duration::from_millis(20));
                None
            }
        }
    }
}

/// Why the speaker stops (the value of `run`'s `shutdown` channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Stop {
    /// Running.
    #[default]
    No,
    /// SIGTERM: a restart (rolling upgrade); sessions with graceful restart close
    /// without a NOTIFICATION so the peers keep the routes while the node forwards on.
    Restart,
    /// The node is decommissioned (helm uninstall): every session closes with a Cease
    /// (Administrative Shutdown), so the peers drop the routes at once.
    Decommission,
}

enum PeerCmd {
    Inbound(TcpStream),
    /// Daemon shutdown: keep routes at the peer if graceful restart was negotiated.
    Shutdown,
    /// Node decommissioned: Cease, the peer drops the routes.
    Decommission,
    /// Peer removed.
    Stop(Notification),
    /// BFD says the path to the peer failed: tear the session down at once (RFC 5882).
    BfdDown(String),
    /// Peer reconfigured; `reset`: connection-level settings changed (address, port,
    /// source, TTL, password), so the session restarts on new sockets.
    Reconfigure {
        cfg: PeerConfig,
        router_id: Ipv4Addr,
        reset: bool,
    },
}

/// Settings that only take effect on a new TCP connection.
fn socket_settings(p: &PeerConfig) -> impl PartialEq + '_ {
    (
        p.peer_address,
        p.peer_port,
        p.source_address,
        p.ebgp_multihop,
        &p.md5_password,
    )
}

/// `families`: what the OPEN offers (IPv4 unicast always; IPv6 unicast once the peer has
/// an IPv6 VIP to carry or the session runs over IPv6). Over IPv6 the OPEN also offers
/// IPv4 routes with an IPv6 next hop (RFC 8950).
fn session_config(cfg: &PeerConfig, router_id: Ipv4Addr, families: Families) -> SessionConfig {
    let over_ipv6 = cfg.peer_address.is_ipv6();
    SessionConfig {
        families: if over_ipv6 {
            families.with(AddressFamily::Ipv6Unicast)
        } else {
            families
        },
        extended_next_hop: over_ipv6,
        local_asn: cfg.local_asn,
        peer_asn: cfg.peer_asn,
        router_id,
        hold_time: cfg.hold_time,
        keepalive_time: cfg.keepalive_time,
        connect_retry_time: cfg.connect_retry_time,
        passive: cfg.passive,
        graceful_restart_time: cfg.graceful_restart_time,
    }
}

struct PeerHandle {
    cfg: PeerConfig,
    router_id: Ipv4Addr,
    tx: mpsc::UnboundedSender<PeerCmd>,
    task: JoinHandle<()>,
}

fn router_id(cfg: &SpeakerConfig, state: &NodeState) -> Option<Ipv4Addr> {
    cfg.router_id.or(state.router_id).or_else(|| {
        state.peers.iter().find_map(|p| match p.source_address {
            Some(IpAddr::V4(a)) => Some(a),
            _ => None,
        })
    })
}

/// Runs the speaker until `shutdown` says to stop, and how ([`Stop`]).
pub async fn run(
    cfg: SpeakerConfig,
    mut state_rx: watch::Receiver<SharedState>,
    hub: Arc<StatusHub>,
    mut shutdown: watch::Receiver<Stop>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    // An IPv6 listening address (`[::]:179`) also takes IPv4 peers, as v4-mapped
    // addresses (unless the host sets net.ipv6.bindv6only).
    let sock = if cfg.listen.is_ipv6() {
        TcpSocket::new_v6()
    } else {
        TcpSocket::new_v4()
    }
    .context("creating listening socket")?;
    sock.set_reuseaddr(true)?;
    sock.bind(cfg.listen)
        .with_context(|| format!("binding {}", cfg.listen))?;
    let listener: TcpListener = sock
        .listen(64)
        .with_context(|| format!("listening on {}", cfg.listen))?;
    tracing::info!(listen = %cfg.listen, "accepting BGP connections");

    let mut peers: HashMap<String, PeerHandle> = HashMap::new();
    let mut md5_keys: HashMap<IpAddr, Secret> = HashMap::new();
    let (bfd_tx, mut bfd_rx) = mpsc::unbounded_channel();
    let bfd = match &cfg.bfd_status_file {
        None => Some(crate::bfd_io::spawn(
            crate::bfd_io::report_to_hub(hub.clone()),
            bfd_tx,
            false,
        )),
        Some(path) => {
            tokio::spawn(crate::bfd_io::follow_status_file(
                path.clone(),
                crate::bfd_io::report_to_hub(hub.clone()),
                bfd_tx,
            ));
            None
        }
    };
    let mut changed = true;
    loop {
        if changed {
            changed = false;
            let st = state_rx.borrow_and_update().clone();
            if let Some(bfd) = &bfd {
                bfd.set(crate::bfd_io::wanted(&st.1));
            }
            reconcile(
                &cfg,
                &st,
                &mut peers,
                &mut md5_keys,
                &listener,
                &state_rx,
                &hub,
            );
        }
        tokio::select! {
            r = state_rx.changed() => {
                if r.is_err() { break; }
                changed = true;
            }
            acc = listener.accept() => {
                let Ok((stream, addr)) = acc else { continue };
                let ip = addr.ip().to_canonical();
                match peers.values().find(|p| p.cfg.peer_address == ip) {
                    Some(p) => { let _ = p.tx.send(PeerCmd::Inbound(stream)); }
                    None => tracing::info!(%addr, "connection from an unconfigured address closed"),
                }
            }
            Some(n) = bfd_rx.recv() => {
                if n.is_path_failure() {
                    if let Some(p) = peers.get(&n.peer) {
                        let _ = p.tx.send(PeerCmd::BfdDown(format!("BFD session down: {}", n.diag)));
                    }
                }
            }
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() != Stop::No { break; }
            }
        }
    }
    let decommission = *shutdown.borrow() == Stop::Decommission;
    tracing::info!(decommission, "shutting down");
    for p in peers.values() {
        let _ = p.tx.send(if decommission {
            PeerCmd::Decommission
        } else {
            PeerCmd::Shutdown
        });
    }
    for (_, p) in peers.drain() {
        let _ = tokio::time::timeout(Duration::from_secs(3), p.task).await;
    }
    Ok(())
}

fn reconcile(
    cfg: &SpeakerConfig,
    st: &SharedState,
    peers: &mut HashMap<String, PeerHandle>,
    md5_keys: &mut HashMap<IpAddr, Secret>,
    listener: &TcpListener,
    state_rx: &watch::Receiver<SharedState>,
    hub: &Arc<StatusHub>,
) {
    let (generation, state) = (&st.0, &st.1);
    let rid = router_id(cfg, state);
    hub.update(|s| {
        s.node = state.node.clone();
        s.router_id = rid;
        s.state_generation = *generation;
    });
    let Some(rid) = rid else {
        if !state.peers.is_empty() {
            tracing::error!("no router ID: pass --router-id or publish NodeState.router_id");
        }
        return;
    };

    // Stop peers that are gone; hand changed configuration to the others.
    let wanted: BTreeMap<&str, &PeerConfig> =
        state.peers.iter().map(|p| (p.name.as_str(), p)).collect();
    let names: Vec<String> = peers.keys().cloned().collect();
    for name in names {
        match wanted.get(name.as_str()) {
            None => {
                let p = peers.remove(&name).expect("listed");
                tracing::info!(peer = %name, "peer removed");
                let _ =
                    p.tx.send(PeerCmd::Stop(Notification::cease(cease::PEER_DECONFIGURED)));
                hub.remove_peer(&name);
            }
            Some(c) => {
                let p = peers.get_mut(&name).expect("listed");
                if **c == p.cfg && p.router_id == rid {
                    continue;
                }
                let reset = socket_settings(c) != socket_settings(&p.cfg);
                tracing::info!(peer = %name, reset, "peer reconfigured");
                p.cfg = (*c).clone();
                p.router_id = rid;
                let addr = c.peer_address;
                hub.update(|s| {
                    if let Some(st) = s.peers.get_mut(&name) {
                        st.peer_address = addr;
                    }
                });
                let _ = p.tx.send(PeerCmd::Reconfigure {
                    cfg: (*c).clone(),
                    router_id: rid,
                    reset,
                });
            }
        }
    }

    // TCP-MD5 keys on the listening socket, per peer address (as the socket's family
    // sees it).
    let listen_v6 = cfg.listen.is_ipv6();
    let new_keys: HashMap<IpAddr, Secret> = state
        .peers
        .iter()
        .filter_map(|p| {
            // An IPv4 listener never accepts an IPv6 peer: no key to set for it there.
            if p.peer_address.is_ipv6() && !listen_v6 {
                return None;
            }
            let addr = md5_key_address(listen_v6, p.peer_address);
            p.md5_password.clone().map(|k| (addr, k))
        })
        .collect();
    for addr in md5_keys.keys() {
        if !new_keys.contains_key(addr) {
            if let Err(e) = sockopt::set_md5(listener.as_raw_fd(), *addr, None) {
                tracing::warn!(peer = %addr, error = %e, "cannot remove TCP-MD5 key");
            }
        }
    }
    for (addr, key) in &new_keys {
        if md5_keys.get(addr) != Some(key) {
            if let Err(e) =
                sockopt::set_md5(listener.as_raw_fd(), *addr, Some(key.expose().as_bytes()))
            {
                tracing::error!(peer = %addr, error = %e, "cannot set TCP-MD5 key on the listening socket");
            }
        }
    }
    *md5_keys = new_keys;

    // Start new peers.
    for pc in &state.peers {
        if peers.contains_key(&pc.name) {
            continue;
        }
        tracing::info!(peer = %pc.name, address = %pc.peer_address, asn = pc.peer_asn, "peer configured");
        if pc.peer_address.is_ipv6() && !listen_v6 {
            tracing::warn!(peer = %pc.name, listen = %cfg.listen, "IPv6 peer, IPv4 listener: its own connections are refused, only ours go out (listen on [::]:179 to accept them)");
        }
        let owner = NEXT_OWNER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        hub.update(|s| {
            let p = s
                .peers
                .entry(pc.name.clone())
                .or_insert_with(|| PeerStatus::new(&pc.name, pc.peer_address));
            // Claimed under the hub's lock, as reports are kept: none slips in between.
            if let Some(b) = hub.claim_bfd(&pc.name) {
                p.bfd = Some(b);
            }
            // A reconfigured peer keeps its counters and last error; the new task owns it.
            p.owner = owner;
            p.peer_address = pc.peer_address;
            p.state = fsm::State::Idle;
            p.established_since_unix = None;
            p.prefixes_announced = 0;
            p.graceful_restart = false;
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let task = PeerTask::new(
            pc.clone(),
            rid,
            owner,
            cfg.base_families(),
            state_rx.clone(),
            hub.clone(),
        );
        let span = tracing::info_span!("peer", peer = %pc.name);
        let task = tokio::spawn(tracing::Instrument::instrument(task.run(rx), span));
        peers.insert(
            pc.name.clone(),
            PeerHandle {
                cfg: pc.clone(),
                router_id: rid,
                tx,
                task,
            },
        );
    }
}

/// The address a listening socket's TCP-MD5 key for `peer` is set on: an IPv4 peer
/// reaches an IPv6 socket as its v4-mapped address.
fn md5_key_address(listen_v6: bool, peer: IpAddr) -> IpAddr {
    match peer {
        IpAddr::V4(v4) if listen_v6 => IpAddr::V6(v4.to_ipv6_mapped()),
        _ => peer,
    }
}

static NEXT_OWNER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

enum Io {
    Connected(ConnId, TcpStream),
    ConnectFailed(ConnId, String),
    Data(ConnId, Vec<u8>),
    Closed(ConnId),
}

struct ConnIo {
    writer: OwnedWriteHalf,
    reader: JoinHandle<()>,
    local: SocketAddr,
}

struct PeerTask {
    cfg: PeerConfig,
    fsm: Peer,
    timers: HashMap<Timer, Instant>,
    conns: HashMap<ConnId, ConnIo>,
    connecting: HashMap<ConnId, JoinHandle<()>>,
    io_tx: mpsc::UnboundedSender<Io>,
    io_rx: mpsc::UnboundedReceiver<Io>,
    state_rx: watch::Receiver<SharedState>,
    hub: Arc<StatusHub>,
    owner: u64,
    router_id: Ipv4Addr,
    /// The families the OPEN offers; IPv6 unicast is added (a session reset) when the
    /// first IPv6 VIP for this peer appears, and kept until the task ends.
    offered: Families,
    /// FSM actions to carry out at the top of the task's loop (a reset decided while
    /// carrying out other actions).
    deferred: Vec<Action>,
    /// The established connection, its announcement parameters, and what the peer has.
    session: Option<(ConnId, SessionParams, bool)>,
    rib_out: AdjRibOut,
    /// When the current drain (graceful maintenance) began, and whether its withdrawal
    /// was sent.
    drain: Option<(Instant, bool)>,
    /// What the session could not carry at the last sync (logged when it changes).
    withheld: rib::Withheld,
    /// While routes are withheld for want of a next hop: when to look at the session
    /// interface's addresses again (one may have been added since the session came up).
    next_hop_recheck: Option<Instant>,
}

/// How often the interface addresses are looked at again while routes wait for a next
/// hop.
const NEXT_HOP_RECHECK: Duration = Duration::from_secs(5);

impl PeerTask {
    fn new(
        cfg: PeerConfig,
        router_id: Ipv4Addr,
        owner: u64,
        base: Families,
        state_rx: watch::Receiver<SharedState>,
        hub: Arc<StatusHub>,
    ) -> Self {
        let offered = base.or(families_of(&rib::desired_for(
            &state_rx.borrow().1,
            &cfg.name,
        )));
        let sc = session_config(&cfg, router_id, offered);
        // What the OPEN offers: a session over IPv6 always offers IPv6 unicast, so its
        // first IPv6 VIP is no new family (no reset, and the VIP is sent at once).
        let offered = sc.families;
        let (io_tx, io_rx) = mpsc::unbounded_channel();
        PeerTask {
            cfg,
            fsm: Peer::new(sc),
            timers: HashMap::new(),
            conns: HashMap::new(),
            connecting: HashMap::new(),
            io_tx,
            io_rx,
            state_rx,
            hub,
            owner,
            router_id,
            offered,
            deferred: Vec::new(),
            session: None,
            rib_out: AdjRibOut::new(),
            drain: None,
            withheld: rib::Withheld::default(),
            next_hop_recheck: None,
        }
    }

    /// Starts or ends a drain when the configuration says so.
    fn update_drain(&mut self) {
        match (&self.cfg.drain, self.drain) {
            (Some(d), None) => {
                tracing::info!(
                    as_path_prepend = d.as_path_prepend,
                    local_pref = d.local_pref,
                    wait_seconds = d.wait_seconds,
                    "graceful maintenance: announcing less preferred, then withdrawing"
                );
                self.drain = Some((Instant::now(), false));
            }
            (None, Some(_)) => {
                tracing::info!("graceful maintenance ended: announcing normally");
                self.drain = None;
            }
            _ => {}
        }
    }

    /// When the drain's withdrawal is due, if it has not been sent.
    fn drain_deadline(&self) -> Option<Instant> {
        let d = self.cfg.drain?;
        match self.drain? {
            (since, false) => Some(since + Duration::from_secs(u64::from(d.wait_seconds))),
            (_, true) => None,
        }
    }

    fn ttl(&self) -> u8 {
        if self.cfg.local_asn == self.cfg.peer_asn {
            self.cfg.ebgp_multihop.unwrap_or(64)
        } else {
            self.cfg.ebgp_multihop.unwrap_or(1)
        }
    }

    async fn run(mut self, mut cmds: mpsc::UnboundedReceiver<PeerCmd>) {
        self.update_drain();
        let acts = self.fsm.handle(Event::Start);
        self.apply(acts).await;
        loop {
            let deferred = std::mem::take(&mut self.deferred);
            if !deferred.is_empty() {
                self.apply(deferred).await;
            }
            let deadline = self.timers.values().min().copied();
            tokio::select! {
                _ = sleep_until_opt(self.next_hop_recheck) => {
                    self.next_hop_recheck = None;
                    self.recheck_next_hop();
                    self.sync_routes().await;
                }
                _ = sleep_until_opt(self.drain_deadline()) => {
                    tracing::info!("graceful maintenance: withdrawing");
                    self.sync_routes().await;
                    if let Some((_, done)) = &mut self.drain {
                        *done = true;
                    }
                }
                io = self.io_rx.recv() => {
                    let Some(io) = io else { break };
                    self.on_io(io).await;
                }
                cmd = cmds.recv() => match cmd {
                    Some(PeerCmd::Inbound(stream)) => {
                        let id = self.fsm.new_conn_id();
                        if self.register(id, stream) {
                            let acts = self.fsm.handle(Event::Connected { conn: id, outbound: false });
                            self.apply(acts).await;
                        }
                    }
                    Some(PeerCmd::Reconfigure { cfg, router_id, reset }) => {
                        let sc = session_config(&cfg, router_id, self.offered);
                        self.cfg = cfg;
                        self.router_id = router_id;
                        let mut acts = Vec::new();
                        if reset {
                            let n = Notification::cease(cease::OTHER_CONFIGURATION_CHANGE);
                            acts.extend(self.fsm.handle(Event::Stop(Some(n))));
                            acts.extend(self.fsm.handle(Event::ConfigChanged(sc)));
                            acts.extend(self.fsm.handle(Event::Start));
                        } else {
                            acts.extend(self.fsm.handle(Event::ConfigChanged(sc)));
                        }
                        self.apply(acts).await;
                        self.update_drain();
                        self.sync_routes().await;
                    }
                    Some(PeerCmd::Stop(n)) => {
                        let acts = self.fsm.handle(Event::Stop(Some(n)));
                        self.apply(acts).await;
                        break;
                    }
                    Some(PeerCmd::BfdDown(reason)) => {
                        tracing::warn!(%reason, "tearing the session down");
                        let mut acts = self.fsm.handle(Event::Stop(Some(Notification::cease(cease::BFD_DOWN))));
                        acts.extend(self.fsm.handle(Event::Start));
                        self.apply(acts).await;
                        self.hub.peer_owned(&self.cfg.name, self.owner, |p| p.last_error = Some(reason));
                    }
                    Some(PeerCmd::Decommission) => {
                        tracing::info!("decommissioned: Cease (Administrative Shutdown), the peer drops our routes");
                        let acts = self.fsm.handle(Event::Stop(Some(Notification::cease(cease::ADMINISTRATIVE_SHUTDOWN))));
                        self.apply(acts).await;
                        break;
                    }
                    Some(PeerCmd::Shutdown) | None => {
                        let graceful = matches!(self.session, Some((_, _, true)));
                        if graceful {
                            // Close without a NOTIFICATION: the peer keeps our routes for
                            // the restart time (RFC 4724) while the dataplane forwards on.
                            tracing::info!("closing for restart; the peer keeps our routes (graceful restart)");
                            self.conns.clear();
                        } else {
                            let acts = self.fsm.handle(Event::Stop(Some(Notification::cease(cease::ADMINISTRATIVE_SHUTDOWN))));
                            self.apply(acts).await;
                        }
                        break;
                    }
                },
                r = self.state_rx.changed() => {
                    if r.is_err() { break; }
                    let seen = Instant::now();
                    if self.sync_routes().await {
                        self.hub.observe_update_latency(seen.elapsed());
                    }
                }
                _ = sleep_until_opt(deadline) => {
                    let now = Instant::now();
                    let due: Vec<Timer> = self.timers.iter().filter(|(_, at)| **at <= now).map(|(t, _)| *t).collect();
                    for t in due {
                        self.timers.remove(&t);
                        let acts = self.fsm.handle(Event::TimerFired(t));
                        self.apply(acts).await;
                    }
                }
            }
        }
        for (_, c) in self.conns.drain() {
            c.reader.abort();
        }
        for (_, h) in self.connecting.drain() {
            h.abort();
        }
    }

    async fn on_io(&mut self, io: Io) {
        let acts = match io {
            Io::Connected(id, stream) => {
                self.connecting.remove(&id);
                if !self.register(id, stream) {
                    self.fsm.handle(Event::ConnectFailed(id))
                } else {
                    self.fsm.handle(Event::Connected {
                        conn: id,
                        outbound: true,
                    })
                }
            }
            Io::ConnectFailed(id, e) => {
                self.connecting.remove(&id);
                tracing::debug!(error = %e, "connect failed");
                self.hub.peer_owned(&self.cfg.name, self.owner, |p| {
                    p.last_error = Some(format!("connect: {e}"))
                });
                self.fsm.handle(Event::ConnectFailed(id))
            }
            Io::Data(id, bytes) => {
                let before = self.fsm.prefixes_received;
                let acts = self.fsm.handle(Event::Received(id, &bytes));
                if self.fsm.prefixes_received != before {
                    let n = self.fsm.prefixes_received;
                    self.hub
                        .peer_owned(&self.cfg.name, self.owner, |p| p.prefixes_received = n);
                }
                acts
            }
            Io::Closed(id) => {
                if self.conns.contains_key(&id) {
                    self.fsm.handle(Event::Closed(id))
                } else {
                    vec![]
                }
            }
        };
        self.apply(acts).await;
    }

    /// Splits a connected stream, starts its reader; false if it is unusable.
    fn register(&mut self, id: ConnId, stream: TcpStream) -> bool {
        let Ok(local) = stream.local_addr() else {
            return false;
        };
        if let Err(e) = sockopt::set_ttl(stream.as_raw_fd(), local.is_ipv6(), self.ttl()) {
            tracing::warn!(error = %e, "cannot set TTL");
        }
        let _ = stream.set_nodelay(true);
        let (mut rd, wr) = stream.into_split();
        let tx = self.io_tx.clone();
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(Io::Closed(id));
                        return;
                    }
                    Ok(n) => {
                        if tx.send(Io::Data(id, buf[..n].to_vec())).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        self.conns.insert(
            id,
            ConnIo {
                writer: wr,
                reader,
                local,
            },
        );
        true
    }

    fn connect(&mut self, id: ConnId) {
        let cfg = self.cfg.clone();
        let ttl = self.ttl();
        let tx = self.io_tx.clone();
        let timeout = Duration::from_secs(cfg.connect_retry_time.clamp(2, 30) as u64);
        let h = tokio::spawn(async move {
            let r = async {
                let peer_ip = cfg.peer_address;
                let sock = if peer_ip.is_ipv6() {
                    TcpSocket::new_v6()?
                } else {
                    TcpSocket::new_v4()?
                };
                if let Some(pw) = &cfg.md5_password {
                    sockopt::set_md5(sock.as_raw_fd(), peer_ip, Some(pw.expose().as_bytes()))?;
                }
                sockopt::set_ttl(sock.as_raw_fd(), peer_ip.is_ipv6(), ttl)?;
                if let Some(src) = cfg.source_address {
                    sock.bind(SocketAddr::new(src, 0))?;
                }
                let peer = SocketAddr::new(peer_ip, cfg.peer_port);
                match tokio::time::timeout(timeout, sock.connect(peer)).await {
                    Ok(r) => r,
                    Err(_) => Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "connect timed out",
                    )),
                }
            }
            .await;
            let _ = match r {
                Ok(s) => tx.send(Io::Connected(id, s)),
                Err(e) => tx.send(Io::ConnectFailed(id, e.to_string())),
            };
        });
        self.connecting.insert(id, h);
    }

    async fn send(&mut self, id: ConnId, bytes: &[u8]) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        match tokio::time::timeout(Duration::from_secs(10), c.writer.write_all(bytes)).await {
            Ok(Ok(())) => true,
            _ => {
                let _ = self.io_tx.send(Io::Closed(id));
                false
            }
        }
    }

    async fn apply(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Connect(id) => self.connect(id),
                Action::Send(id, b) => {
                    self.send(id, &b).await;
                }
                Action::Close(id) => {
                    if let Some(mut c) = self.conns.remove(&id) {
                        let _ =
                            tokio::time::timeout(Duration::from_millis(500), c.writer.shutdown())
                                .await;
                        c.reader.abort();
                    }
                    if let Some(h) = self.connecting.remove(&id) {
                        h.abort();
                    }
                }
                Action::ArmTimer(t, d) => {
                    self.timers.insert(t, Instant::now() + d);
                }
                Action::CancelTimer(t) => {
                    self.timers.remove(&t);
                }
                Action::StateChanged(s) => {
                    tracing::info!(state = %s, "session state");
                    self.hub
                        .peer_owned(&self.cfg.name, self.owner, |p| p.state = s);
                }
                Action::Established(id, neg) => {
                    let Some(c) = self.conns.get(&id) else {
                        continue;
                    };
                    let params = self.session_params(c.local.ip(), &neg);
                    tracing::info!(peer_router_id = %neg.peer.router_id, hold = ?neg.hold_time, graceful_restart = neg.graceful_restart, families = ?neg.families, next_hop = ?params.next_hop, next_hop_v6 = ?params.next_hop_v6, "established");
                    self.session = Some((id, params, neg.graceful_restart));
                    self.rib_out.clear();
                    let (gr, families) = (neg.graceful_restart, neg.families);
                    self.hub.peer_owned(&self.cfg.name, self.owner, |p| {
                        p.established_since_unix = Some(unix_now());
                        p.graceful_restart = gr;
                        p.families = families;
                    });
                    self.sync_routes().await;
                    // End-of-RIB after the initial announcements (RFC 4724), one per
                    // negotiated family and only those.
                    for af in families.iter() {
                        let eor = wire::encode(&Message::Update(Update::end_of_rib_for(af)))
                            .expect("fixed");
                        self.send(id, &eor).await;
                    }
                }
                Action::Down(reason) => {
                    tracing::warn!(%reason, "session down");
                    self.session = None;
                    self.next_hop_recheck = None;
                    self.rib_out.clear();
                    let r = reason.to_string();
                    self.hub.peer_owned(&self.cfg.name, self.owner, |p| {
                        p.session_flaps += 1;
                        p.last_error = Some(r);
                        p.established_since_unix = None;
                        p.prefixes_announced = 0;
                        p.graceful_restart = false;
                        p.families = Families::NONE;
                    });
                }
                Action::RouteRefresh(_) => {
                    tracing::info!("route refresh requested");
                    self.rib_out.clear();
                    self.sync_routes().await;
                }
                Action::TreatAsWithdraw(e) => {
                    tracing::warn!(error = %e, "malformed UPDATE treated as withdraw");
                    self.hub
                        .peer_owned(&self.cfg.name, self.owner, |p| p.treat_as_withdraw += 1);
                }
                Action::Error(e) => {
                    tracing::info!(error = %e, "session error");
                    self.hub
                        .peer_owned(&self.cfg.name, self.owner, |p| p.last_error = Some(e));
                }
            }
        }
    }

    /// Brings the peer's routes in line with the control state; true if UPDATEs were sent.
    async fn sync_routes(&mut self) -> bool {
        let mut desired = {
            let st = self.state_rx.borrow_and_update();
            rib::desired_for(&st.1, &self.cfg.name)
        };
        if self.offer_families(&desired) {
            return false;
        }
        let Some((id, params, _)) = self.session else {
            return false;
        };
        if let (Some(d), Some((since, _))) = (&self.cfg.drain, self.drain) {
            let phase = crate::maintenance::phase(d, since.elapsed());
            desired = crate::maintenance::apply(desired, d, phase);
        }
        let (desired, withheld) = rib::sendable(desired, &params);
        self.note_withheld(withheld);
        let updates = rib::diff(&self.rib_out, &desired, params);
        if updates.is_empty() {
            return false;
        }
        let mut bytes = Vec::new();
        for u in &updates {
            match wire::encode(&Message::Update(u.clone())) {
                Ok(b) => bytes.extend_from_slice(&b),
                Err(e) => tracing::error!(error = %e, "cannot encode UPDATE"),
            }
        }
        let (ann, wd): (usize, usize) = updates.iter().fold((0, 0), |(a, w), u| {
            (a + u.announced_count(), w + u.withdrawn_count())
        });
        if self.send(id, &bytes).await {
            tracing::info!(
                announced = ann,
                withdrawn = wd,
                total = desired.len(),
                "routes updated"
            );
            self.rib_out = desired;
            let n = self.rib_out.len();
            let sent = updates.len() as u64;
            self.hub.peer_owned(&self.cfg.name, self.owner, |p| {
                p.prefixes_announced = n;
                p.updates_sent += sent;
            });
            return true;
        }
        false
    }
}

impl PeerTask {
    /// Shows `withheld` in the status, and logs it when it changed: routes of a family
    /// the session negotiated but cannot carry for want of a next hop are an operator's
    /// problem (an IPv6 VIP on a link without a global IPv6 address).
    fn note_withheld(&mut self, withheld: rib::Withheld) {
        self.hub
            .peer_owned(&self.cfg.name, self.owner, |p| p.not_sent = withheld);
        if withheld.no_next_hop > self.withheld.no_next_hop {
            tracing::warn!(
                routes = withheld.no_next_hop,
                "routes not sent: their family is negotiated but this node has no address \
                 of it on the session's interface to use as the next hop (for IPv6: a \
                 global or unique-local address on the link towards the peer)"
            );
        }
        if withheld.family_not_negotiated > self.withheld.family_not_negotiated {
            tracing::info!(
                routes = withheld.family_not_negotiated,
                "routes not sent: the peer did not negotiate their address family"
            );
        }
        self.withheld = withheld;
        self.next_hop_recheck = match withheld.no_next_hop {
            0 => None,
            _ => self
                .next_hop_recheck
                .or_else(|| Some(Instant::now() + NEXT_HOP_RECHECK)),
        };
    }

    /// Looks the established session's IPv6 next hop up again: an address added to the
    /// link after the session came up lets its withheld routes go out.
    fn recheck_next_hop(&mut self) {
        let Some((id, params, _)) = self.session.as_mut() else {
            return;
        };
        let Some(c) = self.conns.get(id) else {
            return;
        };
        let nh = crate::next_hop::for_session(c.local.ip());
        if nh != params.next_hop_v6 {
            tracing::info!(next_hop_v6 = ?nh, "the session's IPv6 next hop changed");
            params.next_hop_v6 = nh;
        }
    }

    /// The announcement parameters of a session established from local address `local`.
    fn session_params(&self, local: IpAddr, neg: &fsm::Negotiated) -> SessionParams {
        // The IPv4 next hop: the configured source address of an IPv4 session, else its
        // local address; a session over IPv6 has none (RFC 8950 or no IPv4 routes).
        let next_hop = match self.cfg.source_address.unwrap_or(local) {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        };
        let needs_v6 = neg.families.contains(AddressFamily::Ipv6Unicast)
            || (next_hop.is_none() && neg.extended_next_hop);
        SessionParams {
            local_asn: self.cfg.local_asn,
            ibgp: self.cfg.local_asn == self.cfg.peer_asn,
            next_hop,
            next_hop_v6: needs_v6
                .then(|| crate::next_hop::for_session(local))
                .flatten(),
            families: neg.families,
            extended_next_hop: neg.extended_next_hop,
        }
    }

    /// Adds IPv6 unicast to the families the OPEN offers once `desired` holds an IPv6
    /// VIP. Capabilities are only exchanged in the OPEN, so an established session is
    /// reset (Cease, Other Configuration Change; carried out by the task's loop) to
    /// offer it; true if it is.
    fn offer_families(&mut self, desired: &AdjRibOut) -> bool {
        let wanted = self.offered.or(families_of(desired));
        if wanted == self.offered {
            return false;
        }
        tracing::info!(families = ?wanted, "offering new address families: the session restarts");
        self.offered = wanted;
        let sc = session_config(&self.cfg, self.router_id, wanted);
        let acts = self.fsm.handle(Event::ConfigChanged(sc));
        self.deferred.extend(acts);
        true
    }
}

/// The families of the routes in `rib`.
fn families_of(rib: &AdjRibOut) -> Families {
    rib.keys().map(|v| AddressFamily::of(*v)).collect()
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_keys_of_ipv4_peers_on_an_ipv6_listener_are_v4_mapped() {
        let v4: IpAddr = "10.0.1.1".parse().unwrap();
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(md5_key_address(false, v4), v4);
        assert_eq!(
            md5_key_address(true, v4),
            "::ffff:10.0.1.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(md5_key_address(true, v6), v6);
        // The kernel takes the mapped key on an IPv6 socket.
        let l = std::net::TcpListener::bind("[::]:0").unwrap();
        sockopt::set_md5(l.as_raw_fd(), md5_key_address(true, v4), Some(b"k")).unwrap();
        assert!(sockopt::set_md5(l.as_raw_fd(), v4, Some(b"k")).is_err());
    }
}
