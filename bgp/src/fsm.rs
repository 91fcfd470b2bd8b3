//! The RFC 4271 session state machine for one peer, without I/O.
//!
//! Like `quinn-proto`, a [`Peer`] owns no socket, no clock and no task: the caller feeds it
//! [`Event`]s with the current time (a [`Duration`] since any fixed origin) and carries out
//! the [`Action`]s it returns — connect, send bytes, close, arm or cancel a timer, report
//! a state change. A peer may have two TCP connections at once while a connection
//! collision (RFC 4271 §6.8) is being resolved; every connection-scoped event and action
//! names its [`ConnId`].

use std::net::Ipv4Addr;
use std::time::Duration;

use crate::family::Families;
use crate::wire::{
    self, cease, Capabilities, DecodeContext, GracefulRestart, Message, Notification, Open,
    OpenError,
};

/// Identifies one TCP connection of a peer.
pub type ConnId = u64;

/// The RFC 4271 session states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum State {
    /// Not trying (stopped, or waiting out the idle-hold backoff after an error).
    Idle,
    /// Connecting.
    Connect,
    /// Waiting for the peer to connect (passive peer, or between connection attempts).
    Active,
    /// OPEN sent, waiting for the peer's OPEN.
    OpenSent,
    /// OPENs exchanged, waiting for a KEEPALIVE.
    OpenConfirm,
    /// Up: routes are exchanged.
    Established,
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// What the FSM needs to know about the session's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Our AS.
    pub local_asn: u32,
    /// The AS the peer must open with.
    pub peer_asn: u32,
    /// Our BGP identifier.
    pub router_id: Ipv4Addr,
    /// Proposed hold time (0 or >= 3 seconds).
    pub hold_time: u16,
    /// Keepalive interval (0: a third of the negotiated hold time).
    pub keepalive_time: u16,
    /// Base interval between connection attempts (doubles on failure, up to 120 s).
    pub connect_retry_time: u16,
    /// Never connect; wait for the peer.
    pub passive: bool,
    /// Offer graceful restart (RFC 4724) with this restart time.
    pub graceful_restart_time: Option<u16>,
    /// The families to offer (one multiprotocol capability each, RFC 4760); graceful
    /// restart lists the same families.
    pub families: Families,
    /// Offer IPv4 routes with an IPv6 next hop (RFC 8950): for sessions over IPv6.
    pub extended_next_hop: bool,
}

impl SessionConfig {
    fn open(&self) -> Open {
        Open {
            asn: self.local_asn,
            hold_time: self.hold_time,
            router_id: self.router_id,
            capabilities: Capabilities {
                four_octet_as: Some(self.local_asn),
                multiprotocol: self.families,
                extended_next_hop: self.extended_next_hop,
                route_refresh: true,
                // Forwarding state is preserved: the dataplane keeps forwarding while the
                // speaker restarts, so the peer may keep using our routes. Only the
                // families we offer are listed (a peer that negotiates fewer ignores the
                // rest, RFC 4724 §3).
                graceful_restart: self.graceful_restart_time.map(|t| GracefulRestart {
                    restarted: false,
                    restart_time: t.min(4095),
                    families: self.families.iter().map(|af| (af, true)).collect(),
                }),
                any: true,
            },
        }
    }

    /// Whether the session is internal BGP.
    pub fn is_ibgp(&self) -> bool {
        self.local_asn == self.peer_asn
    }
}

/// Timers the FSM arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Timer {
    /// Next connection attempt.
    ConnectRetry,
    /// Automatic restart after the session went down (backs off).
    IdleHold,
    /// Hold timer of a connection.
    Hold(ConnId),
    /// Keepalive timer of a connection.
    Keepalive(ConnId),
}

/// Input to the FSM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<'a> {
    /// Administrative start.
    Start,
    /// Administrative stop: send this NOTIFICATION (if any) and stay in Idle.
    Stop(Option<Notification>),
    /// The configuration changed. Changes to what the OPEN carries (ASNs, router ID, hold
    /// and keepalive times, graceful restart) reset the session with Cease 6/6 and
    /// reconnect at once; `connect_retry_time` and `passive` apply without a reset.
    ConfigChanged(SessionConfig),
    /// An outbound connection ([`Action::Connect`]) or an accepted inbound one is up.
    Connected {
        /// The connection.
        conn: ConnId,
        /// We initiated it.
        outbound: bool,
    },
    /// The outbound connection attempt failed.
    ConnectFailed(ConnId),
    /// The peer closed the connection (or it broke).
    Closed(ConnId),
    /// Bytes arrived on a connection.
    Received(ConnId, &'a [u8]),
    /// A timer armed earlier fired.
    TimerFired(Timer),
}

/// What was agreed in the OPEN exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Hold time in effect (0: none).
    pub hold_time: Duration,
    /// Keepalive interval in effect (0: none).
    pub keepalive: Duration,
    /// The peer's OPEN.
    pub peer: Open,
    /// Both sides offered graceful restart.
    pub graceful_restart: bool,
    /// The families both sides offered: only these are sent, and each gets an
    /// End-of-RIB.
    pub families: Families,
    /// Both sides offered IPv4 routes with an IPv6 next hop (RFC 8950).
    pub extended_next_hop: bool,
}

/// Why a session went down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DownReason {
    /// We sent this NOTIFICATION.
    Sent(Notification),
    /// The peer sent this NOTIFICATION.
    Received(Notification),
    /// The TCP connection closed or the connection attempt failed.
    ConnectionClosed,
    /// Administratively stopped.
    Stopped,
}

impl std::fmt::Display for DownReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DownReason::Sent(n) => write!(f, "sent NOTIFICATION {}", n.describe()),
            DownReason::Received(n) => write!(f, "received NOTIFICATION {}", n.describe()),
            DownReason::ConnectionClosed => f.write_str("connection closed"),
            DownReason::Stopped => f.write_str("stopped"),
        }
    }
}

/// Output of the FSM, to carry out in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Open an outbound TCP connection; report [`Event::Connected`] or
    /// [`Event::ConnectFailed`] with this id.
    Connect(ConnId),
    /// Write these bytes (one or more whole messages) to the connection.
    Send(ConnId, Vec<u8>),
    /// Close the connection (after sending what was queued) and forget it.
    Close(ConnId),
    /// (Re)arm a timer to fire after this long.
    ArmTimer(Timer, Duration),
    /// Cancel a timer.
    CancelTimer(Timer),
    /// The peer's state changed.
    StateChanged(State),
    /// The session is Established on this connection: send the routes, then End-of-RIB.
    Established(ConnId, Negotiated),
    /// The Established session went down.
    Down(DownReason),
    /// The peer asked for our routes again (ROUTE-REFRESH).
    RouteRefresh(ConnId),
    /// A malformed UPDATE was handled by RFC 7606 treat-as-withdraw (nothing to do for a
    /// speaker that installs nothing; counted for the operator).
    TreatAsWithdraw(String),
    /// An error worth showing the operator (the last one goes to status).
    Error(String),
}

#[derive(Debug)]
struct Conn {
    id: ConnId,
    outbound: bool,
    state: State,
    rx: Vec<u8>,
    peer_open: Option<Open>,
    negotiated: Option<Negotiated>,
}

/// One peer's session FSM.
#[derive(Debug)]
pub struct Peer {
    cfg: SessionConfig,
    started: bool,
    next_id: ConnId,
    /// Outbound connection attempt in progress.
    connecting: Option<ConnId>,
    conns: Vec<Conn>,
    connect_failures: u32,
    idle_failures: u32,
    in_idle_hold: bool,
    last_state: State,
    /// Prefixes received and discarded.
    pub prefixes_received: u64,
}

/// The longest a connection attempt backs off to.
pub const MAX_CONNECT_RETRY: Duration = Duration::from_secs(120);
/// Hold timer while waiting for the peer's OPEN (RFC 4271 suggests 4 minutes).
pub const LARGE_HOLD: Duration = Duration::from_secs(240);
/// First automatic restart delay after a session failure; doubles up to [`MAX_IDLE_HOLD`].
pub const IDLE_HOLD: Duration = Duration::from_secs(1);
/// Longest automatic restart delay.
pub const MAX_IDLE_HOLD: Duration = Duration::from_secs(60);

/// Which connection survives a collision (RFC 4271 §6.8): the one initiated by the
/// speaker with the higher BGP identifier. Returns `true` if our outbound connection wins.
pub fn outbound_wins_collision(local_id: Ipv4Addr, remote_id: Ipv4Addr) -> bool {
    u32::from(local_id) > u32::from(remote_id)
}

impl Peer {
    /// A stopped peer; send [`Event::Start`] to bring it up.
    pub fn new(cfg: SessionConfig) -> Self {
        Peer {
            cfg,
            started: false,
            next_id: 1,
            connecting: None,
            conns: Vec::new(),
            connect_failures: 0,
            idle_failures: 0,
            in_idle_hold: false,
            last_state: State::Idle,
            prefixes_received: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    /// The peer's state: that of its most advanced connection, else Connect/Active/Idle.
    pub fn state(&self) -> State {
        if let Some(s) = self.conns.iter().map(|c| c.state).max() {
            return s;
        }
        if !self.started || self.in_idle_hold {
            State::Idle
        } else if self.connecting.is_some() {
            State::Connect
        } else {
            State::Active
        }
    }

    /// The Established connection and what was negotiated on it.
    pub fn established(&self) -> Option<(ConnId, &Negotiated)> {
        self.conns
            .iter()
            .find(|c| c.state == State::Established)
            .and_then(|c| c.negotiated.as_ref().map(|n| (c.id, n)))
    }

    /// An id for an accepted inbound connection (pass it in [`Event::Connected`]).
    pub fn new_conn_id(&mut self) -> ConnId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Whether an inbound connection would be taken now (otherwise accept and close it).
    pub fn accepts_inbound(&self) -> bool {
        self.started
            && self.conns.len() < 2
            && !self.conns.iter().any(|c| c.state == State::Established)
    }

    /// Feeds one event; returns what to do.
    pub fn handle(&mut self, event: Event<'_>) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Start => self.start(&mut out),
            Event::Stop(notification) => {
                self.started = false;
                self.in_idle_hold = false;
                out.push(Action::CancelTimer(Timer::IdleHold));
                out.push(Action::CancelTimer(Timer::ConnectRetry));
                self.connecting = None;
                let ids: Vec<_> = self.conns.iter().map(|c| c.id).collect();
                for id in ids {
                    self.drop_conn(id, notification.clone(), DownReason::Stopped, &mut out);
                }
            }
            Event::ConfigChanged(cfg) => self.reconfigure(cfg, &mut out),
            Event::Connected { conn, outbound } => self.connected(conn, outbound, &mut out),
            Event::ConnectFailed(conn) => {
                if self.connecting == Some(conn) {
                    self.connecting = None;
                    self.connect_failures += 1;
                    out.push(Action::Error("connection attempt failed".into()));
                    out.push(Action::ArmTimer(Timer::ConnectRetry, self.retry_delay()));
                }
            }
            Event::Closed(conn) => {
                if self.conn(conn).is_some() {
                    self.drop_conn(conn, None, DownReason::ConnectionClosed, &mut out);
                }
            }
            Event::Received(conn, bytes) => self.received(conn, bytes, &mut out),
            Event::TimerFired(t) => self.timer(t, &mut out),
        }
        let s = self.state();
        if s != self.last_state {
            self.last_state = s;
            out.push(Action::StateChanged(s));
        }
        out
    }

    fn retry_delay(&self) -> Duration {
        let base = Duration::from_secs(self.cfg.connect_retry_time.max(1) as u64);
        base.saturating_mul(1 << self.connect_failures.saturating_sub(1).min(8))
            .min(MAX_CONNECT_RETRY)
    }

    fn start(&mut self, out: &mut Vec<Action>) {
        if self.started && !self.in_idle_hold {
            return;
        }
        self.started = true;
        self.in_idle_hold = false;
        if !self.cfg.passive {
            self.start_connecting(out);
        }
    }

    fn reconfigure(&mut self, new: SessionConfig, out: &mut Vec<Action>) {
        if new == self.cfg {
            return;
        }
        let old = std::mem::replace(&mut self.cfg, new);
        let open_changed = {
            let (a, b) = (&old, &self.cfg);
            (
                a.local_asn,
                a.peer_asn,
                a.router_id,
                a.hold_time,
                a.keepalive_time,
                a.graceful_restart_time,
                a.families,
                a.extended_next_hop,
            ) != (
                b.local_asn,
                b.peer_asn,
                b.router_id,
                b.hold_time,
                b.keepalive_time,
                b.graceful_restart_time,
                b.families,
                b.extended_next_hop,
            )
        };
        if open_changed {
            let started = self.started;
            let n = Notification::cease(cease::OTHER_CONFIGURATION_CHANGE);
            let ids: Vec<_> = self.conns.iter().map(|c| c.id).collect();
            // Not `started` while dropping: no idle-hold backoff, we restart right away.
            self.started = false;
            self.connecting = None;
            for id in ids {
                self.drop_conn(id, Some(n.clone()), DownReason::Sent(n.clone()), out);
            }
            out.push(Action::CancelTimer(Timer::IdleHold));
            out.push(Action::CancelTimer(Timer::ConnectRetry));
            self.in_idle_hold = false;
            self.connect_failures = 0;
            self.idle_failures = 0;
            if started {
                self.start(out);
            }
            return;
        }
        if self.cfg.passive && !old.passive {
            // Stop connecting; an attempt in flight is closed when it completes.
            self.connecting = None;
            out.push(Action::CancelTimer(Timer::ConnectRetry));
        } else if !self.cfg.passive && old.passive && self.started && !self.in_idle_hold {
            self.start_connecting(out);
        }
    }

    fn start_connecting(&mut self, out: &mut Vec<Action>) {
        if self.connecting.is_none() && self.conns.is_empty() {
            let id = self.new_conn_id();
            self.connecting = Some(id);
            out.push(Action::Connect(id));
        }
    }

    fn conn(&self, id: ConnId) -> Option<&Conn> {
        self.conns.iter().find(|c| c.id == id)
    }

    fn conn_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.conns.iter_mut().find(|c| c.id == id)
    }

    fn connected(&mut self, id: ConnId, outbound: bool, out: &mut Vec<Action>) {
        if outbound {
            if self.connecting != Some(id) {
                out.push(Action::Close(id));
                return;
            }
            self.connecting = None;
            out.push(Action::CancelTimer(Timer::ConnectRetry));
        } else if !self.accepts_inbound() {
            if self.started {
                out.push(Action::Send(
                    id,
                    notification_bytes(&Notification::cease(cease::CONNECTION_REJECTED)),
                ));
            }
            out.push(Action::Close(id));
            return;
        }
        let open = wire::encode(&Message::Open(self.cfg.open())).expect("our OPEN fits");
        out.push(Action::Send(id, open));
        out.push(Action::ArmTimer(Timer::Hold(id), LARGE_HOLD));
        self.conns.push(Conn {
            id,
            outbound,
            state: State::OpenSent,
            rx: Vec::new(),
            peer_open: None,
            negotiated: None,
        });
    }

    /// Sends a NOTIFICATION (if any), closes the connection and, if it was the last one,
    /// schedules an automatic restart.
    fn drop_conn(
        &mut self,
        id: ConnId,
        n: Option<Notification>,
        reason: DownReason,
        out: &mut Vec<Action>,
    ) {
        let Some(pos) = self.conns.iter().position(|c| c.id == id) else {
            return;
        };
        let conn = self.conns.remove(pos);
        if let Some(n) = &n {
            out.push(Action::Send(id, notification_bytes(n)));
        }
        out.push(Action::Close(id));
        out.push(Action::CancelTimer(Timer::Hold(id)));
        out.push(Action::CancelTimer(Timer::Keepalive(id)));
        let reason = match (&reason, n) {
            (DownReason::ConnectionClosed, Some(n)) => DownReason::Sent(n),
            _ => reason,
        };
        if conn.state == State::Established {
            out.push(Action::Down(reason.clone()));
        } else if reason != DownReason::Stopped {
            out.push(Action::Error(reason.to_string()));
        }
        if self.conns.is_empty() && self.started && self.connecting.is_none() {
            if conn.state == State::Established {
                self.idle_failures = 0;
            }
            let delay = IDLE_HOLD
                .saturating_mul(1 << self.idle_failures.min(6))
                .min(MAX_IDLE_HOLD);
            self.idle_failures += 1;
            self.in_idle_hold = true;
            out.push(Action::CancelTimer(Timer::ConnectRetry));
            out.push(Action::ArmTimer(Timer::IdleHold, delay));
        }
    }

    fn timer(&mut self, t: Timer, out: &mut Vec<Action>) {
        match t {
            Timer::IdleHold => {
                if self.in_idle_hold {
                    self.start(out);
                }
            }
            Timer::ConnectRetry => {
                if self.started && !self.in_idle_hold && !self.cfg.passive {
                    self.start_connecting(out);
                }
            }
            Timer::Hold(id) => {
                if self.conn(id).is_some() {
                    self.drop_conn(
                        id,
                        Some(Notification::hold_timer_expired()),
                        DownReason::ConnectionClosed,
                        out,
                    );
                }
            }
            Timer::Keepalive(id) => {
                if let Some(c) = self.conn(id) {
                    if let Some(n) = &c.negotiated {
                        if !n.keepalive.is_zero() {
                            out.push(Action::Send(id, keepalive_bytes()));
                            out.push(Action::ArmTimer(Timer::Keepalive(id), n.keepalive));
                        }
                    }
                }
            }
        }
    }

    fn received(&mut self, id: ConnId, bytes: &[u8], out: &mut Vec<Action>) {
        let Some(c) = self.conn_mut(id) else { return };
        c.rx.extend_from_slice(bytes);
        loop {
            let Some(c) = self.conn_mut(id) else { return };
            let len = match wire::frame(&c.rx) {
                Ok(Some(len)) => len,
                Ok(None) => return,
                Err(e) => {
                    let n = e.notification();
                    self.drop_conn(id, n, DownReason::ConnectionClosed, out);
                    return;
                }
            };
            let msg: Vec<u8> = c.rx.drain(..len).collect();
            self.message(id, &msg, out);
        }
    }

    fn restart_hold(&self, id: ConnId, out: &mut Vec<Action>) {
        if let Some(n) = self.conn(id).and_then(|c| c.negotiated.as_ref()) {
            if !n.hold_time.is_zero() {
                out.push(Action::ArmTimer(Timer::Hold(id), n.hold_time));
            }
        }
    }

    fn message(&mut self, id: ConnId, msg: &[u8], out: &mut Vec<Action>) {
        let state = match self.conn(id) {
            Some(c) => c.state,
            None => return,
        };
        let ty = wire::message_type(msg);
        // Fast path: UPDATEs in Established are only checked and counted.
        if ty == wire::msg_type::UPDATE && state == State::Established {
            self.restart_hold(id, out);
            match wire::inspect_update(msg) {
                Ok(s) => self.prefixes_received += (s.announced + s.mp_announced) as u64,
                Err(e) if !e.resets_session() => out.push(Action::TreatAsWithdraw(e.to_string())),
                Err(e) => {
                    out.push(Action::Error(e.to_string()));
                    self.drop_conn(id, e.notification(), DownReason::ConnectionClosed, out);
                }
            }
            return;
        }
        let decoded = wire::decode(
            msg,
            DecodeContext {
                four_octet_as: true,
            },
        );
        let m = match decoded {
            Ok(m) => m,
            Err(e) => {
                out.push(Action::Error(e.to_string()));
                self.drop_conn(id, e.notification(), DownReason::ConnectionClosed, out);
                return;
            }
        };
        match (state, m) {
            (_, Message::Notification(n)) => {
                self.drop_conn(id, None, DownReason::Received(n), out);
            }
            (State::OpenSent, Message::Open(open)) => self.open_received(id, open, out),
            (State::OpenConfirm, Message::Keepalive) => {
                let c = self.conn_mut(id).expect("checked");
                c.state = State::Established;
                let neg = c.negotiated.clone().expect("set in OpenConfirm");
                self.connect_failures = 0;
                self.idle_failures = 0;
                self.restart_hold(id, out);
                out.push(Action::Established(id, neg));
            }
            (State::Established, Message::Keepalive) => self.restart_hold(id, out),
            (State::Established, Message::RouteRefresh { afi: 1, safi: 1 }) => {
                self.restart_hold(id, out);
                out.push(Action::RouteRefresh(id));
            }
            (State::Established, Message::RouteRefresh { .. }) => self.restart_hold(id, out),
            (s, _) => {
                // RFC 6608 subcodes: 1 OpenSent, 2 OpenConfirm, 3 Established.
                let sub = match s {
                    State::OpenSent => 1,
                    State::OpenConfirm => 2,
                    _ => 3,
                };
                self.drop_conn(
                    id,
                    Some(Notification::fsm_error(sub)),
                    DownReason::ConnectionClosed,
                    out,
                );
            }
        }
    }

    fn open_received(&mut self, id: ConnId, open: Open, out: &mut Vec<Action>) {
        // Validate against configuration (RFC 4271 §6.2, RFC 6793).
        let reject = |kind: OpenError, data: Vec<u8>| Some(Notification::open_error(kind, data));
        let err = if open.asn != self.cfg.peer_asn {
            reject(
                OpenError::BadPeerAs,
                (u16::try_from(open.asn).unwrap_or(wire::AS_TRANS))
                    .to_be_bytes()
                    .to_vec(),
            )
        } else if open.router_id.is_unspecified()
            || open.router_id.is_broadcast()
            || open.router_id.is_multicast()
            || (self.cfg.is_ibgp() && open.router_id == self.cfg.router_id)
        {
            reject(
                OpenError::BadBgpIdentifier,
                open.router_id.octets().to_vec(),
            )
        } else if open.hold_time == 1 || open.hold_time == 2 {
            reject(
                OpenError::UnacceptableHoldTime,
                open.hold_time.to_be_bytes().to_vec(),
            )
        } else if open.capabilities.four_octet_as.is_none() {
            // We always encode AS_PATH with 4-byte ASNs; a peer without RFC 6793 could not
            // read it. Data: the capability we require.
            let mut data = vec![65, 4];
            data.extend_from_slice(&self.cfg.local_asn.to_be_bytes());
            reject(OpenError::UnsupportedCapability, data)
        } else {
            None
        };
        if let Some(n) = err {
            out.push(Action::Error(format!("rejected OPEN: {}", n.describe())));
            self.drop_conn(id, Some(n), DownReason::ConnectionClosed, out);
            return;
        }

        // Collision detection (RFC 4271 §6.8) against the other connection, if any.
        let other = self
            .conns
            .iter()
            .find(|c| c.id != id)
            .map(|c| (c.id, c.outbound, c.state));
        if let Some((other_id, other_outbound, other_state)) = other {
            let this_outbound = self.conn(id).map(|c| c.outbound).unwrap_or(false);
            let loser = if other_state == State::Established {
                id
            } else if this_outbound == other_outbound {
                // Two connections in the same direction: keep the older one.
                id
            } else {
                let outbound_wins = outbound_wins_collision(self.cfg.router_id, open.router_id);
                if outbound_wins == this_outbound {
                    other_id
                } else {
                    id
                }
            };
            let n = Notification::cease(cease::CONNECTION_COLLISION_RESOLUTION);
            self.drop_conn(loser, Some(n), DownReason::ConnectionClosed, out);
            if loser == id {
                return;
            }
        }

        let proposed = Duration::from_secs(self.cfg.hold_time as u64);
        let hold_time = proposed.min(Duration::from_secs(open.hold_time as u64));
        let keepalive = if hold_time.is_zero() {
            Duration::ZERO
        } else if self.cfg.keepalive_time == 0 {
            hold_time / 3
        } else {
            Duration::from_secs(self.cfg.keepalive_time as u64)
                .min(hold_time / 3)
                .max(Duration::from_secs(1))
        };
        let neg = Negotiated {
            hold_time,
            keepalive,
            graceful_restart: self.cfg.graceful_restart_time.is_some()
                && open.capabilities.graceful_restart.is_some(),
            families: self.cfg.families.and(open.capabilities.families()),
            extended_next_hop: self.cfg.extended_next_hop && open.capabilities.extended_next_hop,
            peer: open.clone(),
        };
        let c = self.conn_mut(id).expect("checked");
        c.state = State::OpenConfirm;
        c.peer_open = Some(open);
        c.negotiated = Some(neg);
        out.push(Action::Send(id, keepalive_bytes()));
        if hold_time.is_zero() {
            out.push(Action::CancelTimer(Timer::Hold(id)));
        } else {
            out.push(Action::ArmTimer(Timer::Hold(id), hold_time));
        }
        if !keepalive.is_zero() {
            out.push(Action::ArmTimer(Timer::Keepalive(id), keepalive));
        }
    }

    /// The peer's router id on a connection, once its OPEN arrived.
    pub fn peer_router_id(&self, id: ConnId) -> Option<Ipv4Addr> {
        self.conn(id)
            .and_then(|c| c.peer_open.as_ref())
            .map(|o| o.router_id)
    }
}

/// A KEEPALIVE on the wire.
pub fn keepalive_bytes() -> Vec<u8> {
    wire::encode(&Message::Keepalive).expect("fixed size")
}

/// A NOTIFICATION on the wire.
pub fn notification_bytes(n: &Notification) -> Vec<u8> {
    let mut n = n.clone();
    n.data
        .truncate(wire::MAX_MESSAGE_LEN - wire::HEADER_LEN - 2);
    wire::encode(&Message::Notification(n)).expect("data truncated to fit")
}

#[cfg(test)]
mod tests;
