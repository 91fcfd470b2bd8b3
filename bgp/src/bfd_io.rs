//! BFD over UDP: one tokio task runs every [`bfd::Session`] of the daemon.
//!
//! - Single hop (RFC 5881): packets to port 3784, sent with TTL 255; a received packet
//!   whose TTL is not 255 is discarded (GTSM, RFC 5082), so a packet from beyond the link
//!   cannot keep a session up. IPv4 or IPv6, the BGP peer's family: over IPv6 the hop
//!   limit plays the TTL's part (RFC 5881 §5), on an IPv6-only receiving socket beside
//!   the IPv4 one.
//! - Multihop (RFC 5883), used when the BGP peer is multihop (`ebgp_multihop` > 1): port
//!   4784, sent with TTL 255, any received TTL accepted.
//! - Each session sends from its own source port in 49152-65535; received packets are
//!   matched by Your Discriminator and the peer's address, or while it is 0 by the
//!   peer's address only; an Up session further requires the peer's own discriminator
//!   ([`Session::handle_packet`]). Threat model: `docs/security.md`.
//! - A peer with `bfd_auth` (RFC 5880 6.7.3/6.7.4, keyed or meticulous keyed SHA1)
//!   authenticates every packet both ways; packets that fail are discarded and counted
//!   (`auth_failures` in the status, `juneau_bgp_bfd_auth_failures`).
//!
//! State changes are reported as [`BfdNotice`]s (the speaker tears the BGP session down
//! when an Up session goes Down) and in the status hub.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket as StdUdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use nix::sys::socket::{
    self, sockopt, ControlMessageOwned, MsgFlags, SockaddrLike, SockaddrStorage,
};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;

use crate::bfd::{self, Auth, AuthType, BfdConfig, BfdState, Diag, Packet, Session, SessionEvent};
use crate::status::{BfdStatus, StatusHub};

/// One BFD session the speaker wants, keyed by the BGP peer's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BfdPeer {
    /// The BGP peer's name.
    pub name: String,
    /// The peer's address, IPv4 or IPv6.
    pub peer: IpAddr,
    /// Our source address, of the peer's family (`None`: the kernel chooses).
    pub local: Option<IpAddr>,
    /// RFC 5883 multihop instead of RFC 5881 single hop.
    pub multihop: bool,
    /// Timers.
    pub cfg: BfdConfig,
    /// Authentication (`None`: none).
    pub auth: Option<Auth>,
}

/// The sessions a node state asks for: one per peer with `bfd` set, multihop when the
/// peer is eBGP multihop (TTL > 1). A peer whose BFD authentication cannot be used (a key
/// longer than 20 bytes: the agent refuses those before) gets no session rather than an
/// unauthenticated one; that is logged.
pub fn wanted(state: &juneau_control::model::NodeState) -> Vec<BfdPeer> {
    state
        .peers
        .iter()
        .filter_map(|p| {
            let b = p.bfd?;
            let auth = match &p.bfd_auth {
                None => None,
                Some(a) => {
                    let kind = match a.auth_type {
                        juneau_control::model::BfdAuthType::KeyedSha1 => AuthType::KeyedSha1,
                        juneau_control::model::BfdAuthType::MeticulousKeyedSha1 => {
                            AuthType::MeticulousKeyedSha1
                        }
                    };
                    match Auth::new(kind, a.key_id, a.key.clone()) {
                        Ok(a) => Some(a),
                        Err(e) => {
                            tracing::error!(peer = %p.name, error = %e, "BFD authentication unusable: no BFD session");
                            return None;
                        }
                    }
                }
            };
            Some(BfdPeer {
                name: p.name.clone(),
                peer: p.peer_address,
                // The node state holds a source of the peer's family only.
                local: p
                    .source_address
                    .filter(|a| a.is_ipv6() == p.peer_address.is_ipv6()),
                multihop: p.ebgp_multihop.is_some_and(|t| t > 1),
                cfg: b.into(),
                auth,
            })
        })
        .collect()
}

/// A state change of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BfdNotice {
    /// The BGP peer's name.
    pub peer: String,
    /// Before.
    pub from: BfdState,
    /// After.
    pub to: BfdState,
    /// Why.
    pub diag: Diag,
}

impl BfdNotice {
    /// An Up session went down because the path failed (not because the peer was
    /// administratively disabled, which RFC 5882 3.2 says must not affect the client).
    pub fn is_path_failure(&self) -> bool {
        self.from == BfdState::Up
            && self.to == BfdState::Down
            && self.diag != Diag::AdministrativelyDown
    }
}

enum Cmd {
    Set(Vec<BfdPeer>),
    Hold(std::time::Duration, tokio::sync::oneshot::Sender<()>),
}

/// Hands the wanted set of sessions to the BFD task.
#[derive(Debug, Clone)]
pub struct BfdHandle {
    tx: mpsc::UnboundedSender<Cmd>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Set(_) => "Set",
            Cmd::Hold(..) => "Hold",
        })
    }
}

impl BfdHandle {
    /// Replaces the set of sessions: new ones start Down, removed ones are dropped,
    /// changed ones restart.
    pub fn set(&self, peers: Vec<BfdPeer>) {
        let _ = self.tx.send(Cmd::Set(peers));
    }

    /// Before a restart: every Up session announces the slow rate `tx` and waits (at most
    /// a second) for the peer to acknowledge; then the task stops without AdminDown, so
    /// the peers keep the sessions Up for their multiplier x `tx` (see
    /// [`Session::hold_for_restart`]).
    pub async fn hold_for_restart(&self, tx: std::time::Duration) {
        let (ack, done) = tokio::sync::oneshot::channel();
        if self.tx.send(Cmd::Hold(tx, ack)).is_ok() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), done).await;
        }
    }
}

/// A session an earlier process held for its restart: resumed with these discriminators
/// (local, remote) and, when authenticated, the next sequence number to send.
pub type Resume = HashMap<String, (u32, u32, Option<u32>)>;

/// Where session status goes: `(peer, Some(status))` on every change, `(peer, None)`
/// when the session is removed.
pub type Report = Arc<dyn Fn(&str, Option<BfdStatus>) + Send + Sync>;

/// A [`Report`] into the speaker's status hub (the peer's `bfd` field).
pub fn report_to_hub(hub: Arc<StatusHub>) -> Report {
    Arc::new(move |name: &str, st: Option<BfdStatus>| hub.peer_bfd(name, st))
}

/// Starts the BFD task. `control_plane_independent` sets the C bit: true only when BFD
/// runs apart from the BGP speaker (juneau-bfd), so that it survives the speaker's
/// restarts.
pub fn spawn(
    report: Report,
    notices: mpsc::UnboundedSender<BfdNotice>,
    control_plane_independent: bool,
) -> BfdHandle {
    spawn_resuming(report, notices, control_plane_independent, Resume::new())
}

/// [`spawn`], resuming the sessions an earlier process held for its restart.
pub fn spawn_resuming(
    report: Report,
    notices: mpsc::UnboundedSender<BfdNotice>,
    control_plane_independent: bool,
    resume: Resume,
) -> BfdHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = BfdTask {
        resume,
        report,
        notices,
        control_plane_independent,
        sessions: HashMap::new(),
        receivers: [None, None, None, None],
        next_disc: initial_discriminator(),
        next_port: 49152,
        holding: false,
    };
    tokio::spawn(tracing::Instrument::instrument(
        task.run(rx),
        tracing::info_span!("bfd"),
    ));
    BfdHandle { tx }
}

/// The first of our discriminators: unpredictable from off the path (RFC 5880 6.8.1
/// says it should be random, to make spoofing harder): SipHash with the standard
/// library's randomly keyed `RandomState` (seeded from the OS) over pid and time.
fn initial_discriminator() -> u32 {
    random_u32() | 1
}

/// 32 unpredictable bits (a randomly keyed SipHash of pid and time): the first
/// discriminator, and each authenticated session's first sequence number (RFC 5880 6.8.1:
/// bfd.XmitAuthSeq starts random).
fn random_u32() -> u32 {
    use std::hash::BuildHasher;
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(1);
    let h = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), t));
    h as u32
}

struct Entry {
    want: BfdPeer,
    session: Session,
    /// Sending only (non-blocking; a full socket buffer drops the packet, as the wire
    /// would).
    sock: StdUdpSocket,
    down_events: u64,
    reported: Option<BfdStatus>,
    /// When `reported` was reported (a change of counters only is reported at most once a
    /// second: a flood of forged packets must not rewrite the status file per packet).
    reported_at: Instant,
}

struct BfdTask {
    resume: Resume,
    report: Report,
    notices: mpsc::UnboundedSender<BfdNotice>,
    control_plane_independent: bool,
    sessions: HashMap<String, Entry>,
    /// Receiving sockets, by [`receiver_index`]: single hop and multihop, IPv4 and IPv6.
    receivers: [Option<UdpSocket>; 4],
    next_disc: u32,
    next_port: u16,
    /// A restart hold has started.
    holding: bool,
}

/// A datagram: payload, source, TTL (IPv4) or hop limit (IPv6) it arrived with.
type Datagram = (Vec<u8>, SocketAddr, Option<u8>);

/// Index into [`BfdTask::receivers`] of the socket for `multihop` sessions of the family
/// `ipv6`.
fn receiver_index(multihop: bool, ipv6: bool) -> usize {
    usize::from(multihop) * 2 + usize::from(ipv6)
}

async fn recv_opt(sock: &Option<UdpSocket>) -> io::Result<Datagram> {
    match sock {
        Some(s) => recv_with_ttl(s).await,
        None => std::future::pending().await,
    }
}

async fn recv_with_ttl(sock: &UdpSocket) -> io::Result<Datagram> {
    sock.async_io(Interest::READABLE, || {
        let mut buf = [0u8; 128];
        let mut iov = [io::IoSliceMut::new(&mut buf)];
        let mut cmsg = nix::cmsg_space!(libc::c_int);
        let msg = socket::recvmsg::<SockaddrStorage>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_DONTWAIT,
        )
        .map_err(io::Error::from)?;
        let mut ttl = None;
        for c in msg.cmsgs().map_err(io::Error::from)? {
            match c {
                ControlMessageOwned::Ipv4Ttl(t) | ControlMessageOwned::Ipv6HopLimit(t) => {
                    ttl = u8::try_from(t).ok();
                }
                _ => {}
            }
        }
        let from = msg
            .address
            .and_then(|a| match a.family() {
                Some(socket::AddressFamily::Inet) => a
                    .as_sockaddr_in()
                    .map(|a| SocketAddr::new(a.ip().into(), a.port())),
                Some(socket::AddressFamily::Inet6) => a
                    .as_sockaddr_in6()
                    .map(|a| SocketAddr::new(a.ip().into(), a.port())),
                _ => None,
            })
            .ok_or_else(|| io::Error::other("datagram without a source address"))?;
        let n = msg.bytes;
        Ok((buf[..n].to_vec(), from, ttl))
    })
    .await
}

/// The receiving socket of `port` for one family: IPv4, or IPv6 only (`IPV6_V6ONLY`,
/// so it can sit beside the IPv4 one on the same port), reporting each datagram's TTL
/// or hop limit.
fn bind_receiver(port: u16, ipv6: bool) -> io::Result<UdpSocket> {
    use socket::{AddressFamily, SockFlag, SockType};
    let family = if ipv6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    let fd = socket::socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
        .map_err(io::Error::from)?;
    let addr: SockaddrStorage = if ipv6 {
        socket::setsockopt(&fd, sockopt::Ipv6V6Only, &true).map_err(io::Error::from)?;
        socket::setsockopt(&fd, sockopt::Ipv6RecvHopLimit, &true).map_err(io::Error::from)?;
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port).into()
    } else {
        socket::setsockopt(&fd, sockopt::Ipv4RecvTtl, &true).map_err(io::Error::from)?;
        SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port).into()
    };
    socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr).map_err(io::Error::from)?;
    let s = StdUdpSocket::from(fd);
    s.set_nonblocking(true)?;
    UdpSocket::from_std(s)
}

impl BfdTask {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        let mut holding: Option<(Instant, tokio::sync::oneshot::Sender<()>)> = None;
        loop {
            let deadline = self
                .sessions
                .values()
                .map(|e| e.session.poll_timeout())
                .min();
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(Cmd::Set(w)) => self.apply(w),
                    Some(Cmd::Hold(tx, ack)) => {
                        tracing::info!(tx_ms = tx.as_millis() as u64, "holding BFD sessions for a restart");
                        for e in self.sessions.values_mut() {
                            e.session.hold_for_restart(tx);
                        }
                        // After this, the status carries the next authenticated sequence
                        // number: the next process continues from there.
                        self.holding = true;
                        holding = Some((Instant::now(), ack));
                    }
                    None => break,
                },
                r = recv_opt(&self.receivers[0]) => self.on_datagram(r, false),
                r = recv_opt(&self.receivers[1]) => self.on_datagram(r, false),
                r = recv_opt(&self.receivers[2]) => self.on_datagram(r, true),
                r = recv_opt(&self.receivers[3]) => self.on_datagram(r, true),
                _ = sleep_until_opt(deadline.map(|d| if holding.is_some() { d.min(Instant::now() + std::time::Duration::from_millis(20)) } else { d })) => {}
            }
            self.drive();
            if let Some((since, _)) = &holding {
                let acked = self.sessions.values().all(|e| !e.session.poll_active());
                if acked || since.elapsed() > std::time::Duration::from_secs(1) {
                    tracing::info!(acked, "BFD sessions held; stopping without AdminDown");
                    if let Some((_, ack)) = holding.take() {
                        let _ = ack.send(());
                    }
                    // Stop here: no AdminDown, the peers wait for the next process.
                    std::future::pending::<()>().await;
                }
            }
        }
        // Tell the peers we are going away on purpose (RFC 5882: AdminDown is not a path
        // failure).
        let now = Instant::now();
        for e in self.sessions.values_mut() {
            e.session.set_admin_down(true, now);
        }
        self.drive();
    }

    fn apply(&mut self, want: Vec<BfdPeer>) {
        let names: Vec<String> = self.sessions.keys().cloned().collect();
        for name in names {
            if !want
                .iter()
                .any(|w| w.name == name && self.sessions[&name].want == *w)
            {
                let mut e = self.sessions.remove(&name).expect("listed");
                tracing::info!(peer = %name, "BFD session removed");
                e.session.set_admin_down(true, Instant::now());
                send_due(&mut e, Instant::now());
                (self.report)(&name, None);
            }
        }
        for w in want {
            if self.sessions.contains_key(&w.name) {
                continue;
            }
            if let Err(e) = self.ensure_receiver(w.multihop, w.peer.is_ipv6()) {
                tracing::error!(peer = %w.name, error = %e, "cannot receive BFD packets");
                (self.report)(
                    &w.name,
                    Some(BfdStatus::error(format!("receive socket: {e}"))),
                );
                continue;
            }
            let sock = match self.bind_sender(&w) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(peer = %w.name, error = %e, "cannot send BFD packets");
                    (self.report)(&w.name, Some(BfdStatus::error(format!("send socket: {e}"))));
                    continue;
                }
            };
            self.next_disc = self.next_disc.wrapping_add(1).max(1);
            let disc = self.next_disc;
            tracing::info!(peer = %w.name, address = %w.peer, multihop = w.multihop,
                tx_ms = w.cfg.desired_min_tx.as_millis() as u64, rx_ms = w.cfg.required_min_rx.as_millis() as u64,
                multiplier = w.cfg.detect_mult, discriminator = disc,
                authentication = w.auth.as_ref().map(|a| a.kind.to_string()), key_id = w.auth.as_ref().map(|a| a.key_id),
                "BFD session configured");
            let cfg = BfdConfig {
                control_plane_independent: self.control_plane_independent,
                ..w.cfg
            };
            let mut seq = random_u32();
            let mut session = match self.resume.remove(&w.name) {
                Some((local, remote, next_seq)) if local != 0 && remote != 0 => {
                    tracing::info!(peer = %w.name, discriminator = local, "BFD session resumed after a restart");
                    if let Some(n) = next_seq {
                        seq = n;
                    }
                    Session::resume(cfg, local, remote, Instant::now())
                }
                _ => Session::new(cfg, disc, Instant::now()),
            };
            session.set_auth(w.auth.clone(), seq);
            let name = w.name.clone();
            (self.report)(&name, Some(BfdStatus::new(&session)));
            self.sessions.insert(
                name,
                Entry {
                    want: w,
                    session,
                    sock,
                    down_events: 0,
                    reported: None,
                    reported_at: Instant::now(),
                },
            );
        }
    }

    fn ensure_receiver(&mut self, multihop: bool, ipv6: bool) -> io::Result<()> {
        let port = if multihop {
            bfd::PORT_MULTI_HOP
        } else {
            bfd::PORT_SINGLE_HOP
        };
        let slot = &mut self.receivers[receiver_index(multihop, ipv6)];
        if slot.is_none() {
            *slot = Some(bind_receiver(port, ipv6)?);
            tracing::info!(port, ipv6, "receiving BFD packets");
        }
        Ok(())
    }

    fn bind_sender(&mut self, w: &BfdPeer) -> io::Result<StdUdpSocket> {
        let ipv6 = w.peer.is_ipv6();
        let ip = w.local.unwrap_or(if ipv6 {
            Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        });
        let mut last = None;
        for _ in 0..16_384 {
            let port = self.next_port;
            self.next_port = if port == 65535 { 49152 } else { port + 1 };
            match StdUdpSocket::bind(SocketAddr::new(ip, port)) {
                Ok(s) => {
                    // TTL or hop limit 255 (RFC 5881 §5, RFC 5883 §2).
                    crate::sockopt::set_ttl(s.as_raw_fd(), ipv6, 255)?;
                    s.set_nonblocking(true)?;
                    return Ok(s);
                }
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free source port")))
    }

    fn on_datagram(&mut self, r: io::Result<Datagram>, multihop: bool) {
        let (bytes, from, ttl) = match r {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(error = %e, "BFD receive failed");
                return;
            }
        };
        if !multihop && ttl != Some(255) {
            tracing::debug!(%from, ?ttl, "single-hop BFD packet without TTL 255 discarded");
            return;
        }
        let p = match Packet::decode_any(&bytes) {
            Ok((p, _)) => p,
            Err(e) => {
                tracing::debug!(%from, error = %e, "BFD packet discarded");
                return;
            }
        };
        let entry = self.sessions.values_mut().find(|e| {
            e.want.multihop == multihop
                && e.want.peer == from.ip()
                && (p.your_disc == 0 || p.your_disc == e.session.local_disc())
        });
        let Some(e) = entry else {
            tracing::debug!(%from, your = p.your_disc, "BFD packet for no session");
            return;
        };
        if let Err(err) = e.session.receive(Instant::now(), &bytes) {
            tracing::debug!(%from, error = %err, "BFD packet discarded");
        }
    }

    /// Runs timers, sends what is due, reports state changes.
    fn drive(&mut self) {
        let now = Instant::now();
        for (name, e) in &mut self.sessions {
            e.session.handle_timeout(now);
            send_due(e, now);
            while let Some(SessionEvent::StateChanged { from, to, diag }) = e.session.poll_event() {
                if from == BfdState::Up {
                    e.down_events += 1;
                }
                if to == BfdState::Init {
                    tracing::info!(peer = %name, "BFD session Init (the peer is heard)");
                } else if to == BfdState::Up {
                    tracing::info!(peer = %name, %from, detection_ms = e.session.detection_time().map(|d| d.as_millis() as u64), "BFD session up");
                } else {
                    tracing::warn!(peer = %name, %from, %to, %diag, "BFD session {to}");
                }
                let _ = self.notices.send(BfdNotice {
                    peer: name.clone(),
                    from,
                    to,
                    diag,
                });
            }
            // Report state, diagnostics or a renegotiated detection time when they change;
            // counters alone at most once a second.
            let mut st = BfdStatus::new(&e.session);
            st.down_events = e.down_events;
            if self.holding {
                st.next_auth_seq = e.session.auth_type().map(|_| e.session.next_auth_seq());
            }
            let counters_only = e.reported.as_ref().is_some_and(|r| {
                BfdStatus {
                    auth_failures: st.auth_failures,
                    ..r.clone()
                } == st
            });
            let due = !counters_only
                || now.duration_since(e.reported_at) >= std::time::Duration::from_secs(1);
            if e.reported.as_ref() != Some(&st) && due {
                e.reported = Some(st.clone());
                e.reported_at = now;
                (self.report)(name, Some(st));
            }
        }
    }
}

fn send_due(e: &mut Entry, now: Instant) {
    let port = if e.want.multihop {
        bfd::PORT_MULTI_HOP
    } else {
        bfd::PORT_SINGLE_HOP
    };
    let to = SocketAddr::new(e.want.peer, port);
    while let Some(p) = e.session.poll_transmit(now) {
        let bytes = e.session.wire_bytes(&p);
        if let Err(err) = e.sock.send_to(&bytes, to) {
            tracing::debug!(%to, error = %err, "BFD send failed");
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}

/// What juneau-bfd writes (temp file + rename) on every change.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct BfdFile {
    /// The node.
    pub node: String,
    /// juneau-bfd's process id.
    pub pid: u32,
    /// Unix time of this write.
    pub written_unix: u64,
    /// Per BGP peer name.
    pub sessions: std::collections::BTreeMap<String, BfdStatus>,
    /// Set by a juneau-bfd that stopped for a restart: until then (Unix ms) the peers keep
    /// its Up sessions, and the next juneau-bfd resumes them.
    #[serde(default)]
    pub held_until_unix_ms: Option<u64>,
}

impl BfdFile {
    /// The sessions a new process may resume at `now_unix_ms`.
    pub fn resumable(&self, now_unix_ms: u64) -> Resume {
        match self.held_until_unix_ms {
            Some(until) if until > now_unix_ms => self
                .sessions
                .iter()
                .filter(|(_, st)| st.state == BfdState::Up)
                .map(|(n, st)| {
                    (
                        n.clone(),
                        (
                            st.local_discriminator,
                            st.remote_discriminator,
                            st.next_auth_seq,
                        ),
                    )
                })
                .collect(),
            _ => Resume::new(),
        }
    }
}

/// How often juneau-bgp reads juneau-bfd's status file: adds at most this much to the
/// time from a BFD Down to our side of the BGP session going down (the router acts on
/// its own BFD session anyway).
pub const FOLLOW_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// juneau-bgp's side of an external juneau-bfd: reads its status file every
/// [`FOLLOW_INTERVAL`], reports each session into the status hub and turns state changes
/// into [`BfdNotice`]s.
pub async fn follow_status_file(
    path: std::path::PathBuf,
    report: Report,
    notices: mpsc::UnboundedSender<BfdNotice>,
) {
    let mut last: std::collections::BTreeMap<String, BfdStatus> = Default::default();
    let mut warned = false;
    let mut tick = tokio::time::interval(FOLLOW_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if notices.is_closed() {
            return;
        }
        let file: BfdFile = match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            Ok(f) => f,
            Err(e) => {
                if !warned {
                    tracing::warn!(path = %path.display(), error = %e, "cannot read juneau-bfd's status file");
                    warned = true;
                }
                continue;
            }
        };
        warned = false;
        for (name, st) in &file.sessions {
            let before = last.get(name);
            if before == Some(st) {
                continue;
            }
            let from = before.map(|b| b.state).unwrap_or(BfdState::Down);
            let missed_down = before.is_some_and(|b| b.down_events < st.down_events);
            if from != st.state || missed_down {
                // A Down and back Up between two reads still counts as a failure.
                let from = if missed_down { BfdState::Up } else { from };
                let to = if missed_down && st.state == BfdState::Up {
                    BfdState::Down
                } else {
                    st.state
                };
                let admin = Diag::AdministrativelyDown.to_string();
                let diag = if st.diag == admin
                    || (st.diag == Diag::NeighborSignaledDown.to_string() && st.peer_diag == admin)
                {
                    Diag::AdministrativelyDown
                } else if st.diag == Diag::NeighborSignaledDown.to_string() {
                    Diag::NeighborSignaledDown
                } else {
                    Diag::DetectionTimeExpired
                };
                let _ = notices.send(BfdNotice {
                    peer: name.clone(),
                    from,
                    to,
                    diag,
                });
            }
            report(name, Some(st.clone()));
        }
        for name in last.keys() {
            if !file.sessions.contains_key(name) {
                report(name, None);
            }
        }
        last = file.sessions;
    }
}
