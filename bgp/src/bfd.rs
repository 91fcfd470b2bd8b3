//! Bidirectional Forwarding Detection (RFC 5880), asynchronous mode, sans-IO.
//!
//! A [`Session`] is driven by its owner with the current time: [`Session::receive`] for
//! each received datagram (authentication, then [`Session::handle_packet`]),
//! [`Session::handle_timeout`] when [`Session::poll_timeout`] has passed, and
//! [`Session::poll_transmit`] (turned into bytes by [`Session::wire_bytes`]) /
//! [`Session::poll_event`] to collect what to send and what changed. It never reads a
//! clock or touches a socket, so tests run it in virtual time (see `bfd/tests.rs`); the
//! UDP glue (RFC 5881 single hop, RFC 5883 multihop) is [`crate::bfd_io`].
//!
//! Supported: asynchronous mode, the Poll/Final sequence for timer changes, the 1 s slow
//! rate while not Up (RFC 5880 6.8.3), jitter (6.8.7), Keyed SHA1 and Meticulous Keyed
//! SHA1 authentication (6.7.3, 6.7.4; [`Auth`], [`Session::set_auth`]). Not supported
//! (and never asked for by our packets): demand mode, the echo function, the other
//! authentication types (simple password, keyed MD5): a session without authentication
//! discards packets with the A bit, one with authentication discards those without it
//! or of another type, both counting them in [`Session::auth_failures`].

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use serde::Serialize;
use sha1::{Digest, Sha1};
use subtle::ConstantTimeEq;

use juneau_control::secret::Secret;

/// BFD protocol version.
pub const VERSION: u8 = 1;
/// Length of a control packet without authentication.
pub const PACKET_LEN: usize = 24;
/// Destination UDP port of single-hop BFD (RFC 5881).
pub const PORT_SINGLE_HOP: u16 = 3784;
/// Destination UDP port of multihop BFD (RFC 5883).
pub const PORT_MULTI_HOP: u16 = 4784;
/// Rate while the session is not Up (RFC 5880 6.8.3: at least one second).
pub const SLOW_TX: Duration = Duration::from_secs(1);
/// Auth Len of a (Meticulous) Keyed SHA1 section (RFC 5880 4.4).
pub const SHA1_AUTH_LEN: usize = 28;
/// Length of a control packet with a (Meticulous) Keyed SHA1 section.
pub const SHA1_PACKET_LEN: usize = PACKET_LEN + SHA1_AUTH_LEN;
/// Longest Keyed SHA1 key (RFC 5880 4.4: the key is padded with zeros to 20 bytes).
pub const SHA1_KEY_MAX: usize = 20;

/// The authentication types we speak (RFC 5880 4.1, 6.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub enum AuthType {
    /// Keyed SHA1 (type 4): the sequence number may stay or grow, within a window.
    KeyedSha1,
    /// Meticulous Keyed SHA1 (type 5): the sequence number grows with every packet.
    MeticulousKeyedSha1,
}

impl AuthType {
    /// The Auth Type field.
    pub fn code(self) -> u8 {
        match self {
            AuthType::KeyedSha1 => 4,
            AuthType::MeticulousKeyedSha1 => 5,
        }
    }
    /// From the Auth Type field, if we speak it.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            4 => Some(AuthType::KeyedSha1),
            5 => Some(AuthType::MeticulousKeyedSha1),
            _ => None,
        }
    }
}

impl fmt::Display for AuthType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AuthType::KeyedSha1 => "keyed SHA1",
            AuthType::MeticulousKeyedSha1 => "meticulous keyed SHA1",
        })
    }
}

/// Why an authentication setting cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthConfigError {
    /// The key is empty.
    #[error("the BFD authentication key is empty")]
    EmptyKey,
    /// The key is longer than SHA1's 20 bytes.
    #[error("the BFD authentication key is {0} bytes; keyed SHA1 takes at most 20")]
    KeyTooLong(usize),
}

/// A session's authentication: type, Key ID and key (RFC 5880 6.7). `Debug` shows the
/// key as `<redacted>` ([`Secret`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// Keyed or meticulous keyed SHA1.
    pub kind: AuthType,
    /// The Auth Key ID we send and require.
    pub key_id: u8,
    key: Secret,
}

impl Auth {
    /// Checks the key: 1 to 20 bytes.
    pub fn new(kind: AuthType, key_id: u8, key: Secret) -> Result<Self, AuthConfigError> {
        match key.len() {
            0 => Err(AuthConfigError::EmptyKey),
            n if n > SHA1_KEY_MAX => Err(AuthConfigError::KeyTooLong(n)),
            _ => Ok(Auth { kind, key_id, key }),
        }
    }

    /// The 20 key bytes, zero-padded (RFC 5880 6.7.3).
    fn padded_key(&self) -> [u8; SHA1_KEY_MAX] {
        let mut k = [0u8; SHA1_KEY_MAX];
        let b = self.key.expose().as_bytes();
        k[..b.len()].copy_from_slice(b);
        k
    }

    /// SHA1 over the packet with the padded key in the digest field.
    fn digest(&self, packet: &[u8; SHA1_PACKET_LEN]) -> [u8; SHA1_KEY_MAX] {
        let mut b = *packet;
        b[32..52].copy_from_slice(&self.padded_key());
        Sha1::digest(b).into()
    }
}

/// The authentication section of a received packet (RFC 5880 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthSection {
    /// Auth Type.
    pub auth_type: u8,
    /// Auth Key ID (0 for types without one).
    pub key_id: u8,
    /// Sequence Number (types 2-5).
    pub seq: u32,
}

/// Session state (RFC 5880 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub enum BfdState {
    /// Administratively down.
    AdminDown,
    /// Down.
    Down,
    /// Init: the peer is heard, but the peer does not hear us yet.
    Init,
    /// Up.
    Up,
}

impl BfdState {
    fn from_bits(b: u8) -> Self {
        match b & 3 {
            0 => BfdState::AdminDown,
            1 => BfdState::Down,
            2 => BfdState::Init,
            _ => BfdState::Up,
        }
    }
    fn bits(self) -> u8 {
        match self {
            BfdState::AdminDown => 0,
            BfdState::Down => 1,
            BfdState::Init => 2,
            BfdState::Up => 3,
        }
    }
}

impl fmt::Display for BfdState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Diagnostic codes (RFC 5880 4.1): why the session last went down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Diag {
    /// No diagnostic.
    None,
    /// Control detection time expired: no packet from the peer in time.
    DetectionTimeExpired,
    /// Echo function failed.
    EchoFailed,
    /// The neighbor signaled session down.
    NeighborSignaledDown,
    /// Forwarding plane reset.
    ForwardingPlaneReset,
    /// Path down.
    PathDown,
    /// Concatenated path down.
    ConcatenatedPathDown,
    /// Administratively down.
    AdministrativelyDown,
    /// Reverse concatenated path down.
    ReverseConcatenatedPathDown,
    /// A code this implementation does not know.
    Other(u8),
}

impl Diag {
    fn from_bits(b: u8) -> Self {
        match b {
            0 => Diag::None,
            1 => Diag::DetectionTimeExpired,
            2 => Diag::EchoFailed,
            3 => Diag::NeighborSignaledDown,
            4 => Diag::ForwardingPlaneReset,
            5 => Diag::PathDown,
            6 => Diag::ConcatenatedPathDown,
            7 => Diag::AdministrativelyDown,
            8 => Diag::ReverseConcatenatedPathDown,
            n => Diag::Other(n),
        }
    }
    fn bits(self) -> u8 {
        match self {
            Diag::None => 0,
            Diag::DetectionTimeExpired => 1,
            Diag::EchoFailed => 2,
            Diag::NeighborSignaledDown => 3,
            Diag::ForwardingPlaneReset => 4,
            Diag::PathDown => 5,
            Diag::ConcatenatedPathDown => 6,
            Diag::AdministrativelyDown => 7,
            Diag::ReverseConcatenatedPathDown => 8,
            Diag::Other(n) => n & 0x1f,
        }
    }
}

impl fmt::Display for Diag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Diag::None => "no diagnostic",
            Diag::DetectionTimeExpired => "control detection time expired",
            Diag::EchoFailed => "echo function failed",
            Diag::NeighborSignaledDown => "neighbor signaled session down",
            Diag::ForwardingPlaneReset => "forwarding plane reset",
            Diag::PathDown => "path down",
            Diag::ConcatenatedPathDown => "concatenated path down",
            Diag::AdministrativelyDown => "administratively down",
            Diag::ReverseConcatenatedPathDown => "reverse concatenated path down",
            Diag::Other(_) => "unknown diagnostic",
        })
    }
}

/// A BFD control packet (RFC 5880 4.1), without authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packet {
    /// Diagnostic.
    pub diag: Diag,
    /// The sender's session state.
    pub state: BfdState,
    /// P: the sender starts a Poll Sequence.
    pub poll: bool,
    /// F: the sender answers a Poll.
    pub final_: bool,
    /// C: the sender's BFD does not share fate with its control plane.
    pub control_plane_independent: bool,
    /// D: demand mode (we never set it).
    pub demand: bool,
    /// Detection multiplier.
    pub detect_mult: u8,
    /// The sender's discriminator.
    pub my_disc: u32,
    /// The receiver's discriminator as the sender knows it (0: unknown).
    pub your_disc: u32,
    /// Desired min TX interval, microseconds.
    pub desired_min_tx_us: u32,
    /// Required min RX interval, microseconds.
    pub required_min_rx_us: u32,
    /// Required min echo RX interval, microseconds (0: no echo).
    pub required_min_echo_rx_us: u32,
}

/// Why a received packet was discarded (RFC 5880 6.8.6).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    /// Shorter than the mandatory section.
    #[error("packet of {0} bytes is shorter than 24")]
    TooShort(usize),
    /// Not version 1.
    #[error("BFD version {0} (expected 1)")]
    Version(u8),
    /// Length field below 24 or beyond the datagram.
    #[error("length field {field} does not fit the {datagram}-byte datagram")]
    Length {
        /// The Length field.
        field: u8,
        /// Bytes received.
        datagram: usize,
    },
    /// Authentication present, but not configured for the session.
    #[error("authenticated packet (authentication is not configured)")]
    Authenticated,
    /// Authentication configured, but the packet has none.
    #[error("unauthenticated packet (the session requires {0})")]
    AuthMissing(AuthType),
    /// The authentication section does not fit the Length, or has the wrong Auth Len.
    #[error("authentication section of type {auth_type} with Auth Len {auth_len} in a {len}-byte packet")]
    AuthLength {
        /// Auth Type.
        auth_type: u8,
        /// Auth Len.
        auth_len: u8,
        /// The Length field.
        len: u8,
    },
    /// Another authentication type than the session's.
    #[error("auth type {got} (the session requires {want})")]
    AuthType {
        /// In the packet.
        got: u8,
        /// The session's.
        want: AuthType,
    },
    /// Another Key ID than the session's.
    #[error("auth key id {got} (the session's is {want})")]
    AuthKeyId {
        /// In the packet.
        got: u8,
        /// The session's.
        want: u8,
    },
    /// The sequence number is outside the window (RFC 5880 6.7.3, 6.7.4): a replay.
    #[error("auth sequence number {got} outside the window after {last}")]
    AuthSequence {
        /// In the packet.
        got: u32,
        /// The last one accepted.
        last: u32,
    },
    /// The digest is not the packet's with our key.
    #[error("wrong auth digest")]
    AuthDigest,
    /// Detect Mult is zero.
    #[error("detect multiplier is zero")]
    ZeroDetectMult,
    /// Multipoint bit set.
    #[error("multipoint bit set")]
    Multipoint,
    /// My Discriminator is zero.
    #[error("my discriminator is zero")]
    ZeroMyDiscriminator,
    /// Your Discriminator zero while the sender claims Init or Up.
    #[error("your discriminator is zero in state {0}")]
    ZeroYourDiscriminator(BfdState),
    /// While Up, My Discriminator is not the one the session learned from its peer: not
    /// the peer (or a peer that restarted, which the detection time takes down).
    #[error("my discriminator {got} is not the Up session's peer's ({peer})")]
    NotThePeer {
        /// In the packet.
        got: u32,
        /// The one the session learned.
        peer: u32,
    },
    /// Your Discriminator is not ours.
    #[error("your discriminator {got} is not ours ({ours})")]
    WrongDiscriminator {
        /// In the packet.
        got: u32,
        /// Ours.
        ours: u32,
    },
}

impl Packet {
    /// The 24 bytes on the wire.
    pub fn encode(&self) -> [u8; PACKET_LEN] {
        let mut b = [0u8; PACKET_LEN];
        b[0] = (VERSION << 5) | self.diag.bits();
        b[1] = (self.state.bits() << 6)
            | (u8::from(self.poll) << 5)
            | (u8::from(self.final_) << 4)
            | (u8::from(self.control_plane_independent) << 3)
            | (u8::from(self.demand) << 1);
        b[2] = self.detect_mult;
        b[3] = PACKET_LEN as u8;
        b[4..8].copy_from_slice(&self.my_disc.to_be_bytes());
        b[8..12].copy_from_slice(&self.your_disc.to_be_bytes());
        b[12..16].copy_from_slice(&self.desired_min_tx_us.to_be_bytes());
        b[16..20].copy_from_slice(&self.required_min_rx_us.to_be_bytes());
        b[20..24].copy_from_slice(&self.required_min_echo_rx_us.to_be_bytes());
        b
    }

    /// The packet with a (Meticulous) Keyed SHA1 section: A bit set, Length 52, sequence
    /// number `seq`, digest computed with `auth`'s key (RFC 5880 6.7.3).
    pub fn encode_sha1(&self, auth: &Auth, seq: u32) -> [u8; SHA1_PACKET_LEN] {
        let mut b = [0u8; SHA1_PACKET_LEN];
        b[..PACKET_LEN].copy_from_slice(&self.encode());
        b[1] |= 0x04;
        b[3] = SHA1_PACKET_LEN as u8;
        b[24] = auth.kind.code();
        b[25] = SHA1_AUTH_LEN as u8;
        b[26] = auth.key_id;
        b[28..32].copy_from_slice(&seq.to_be_bytes());
        let d = auth.digest(&b);
        b[32..52].copy_from_slice(&d);
        b
    }

    /// Parses and checks a datagram's payload (the session-independent checks of RFC 5880
    /// 6.8.6); an authenticated packet is an error ([`PacketError::Authenticated`]).
    pub fn decode(b: &[u8]) -> Result<Packet, PacketError> {
        match Packet::decode_any(b)? {
            (p, None) => Ok(p),
            (_, Some(_)) => Err(PacketError::Authenticated),
        }
    }

    /// [`decode`](Self::decode), also for a packet with the A bit: its authentication
    /// section (checked to fit the Length; a SHA1 section must have Auth Len 28 and make
    /// the Length 52), not yet verified: that is [`Session::receive`]'s.
    pub fn decode_any(b: &[u8]) -> Result<(Packet, Option<AuthSection>), PacketError> {
        if b.len() < PACKET_LEN {
            return Err(PacketError::TooShort(b.len()));
        }
        let version = b[0] >> 5;
        if version != VERSION {
            return Err(PacketError::Version(version));
        }
        let len = b[3];
        if usize::from(len) < PACKET_LEN || usize::from(len) > b.len() {
            return Err(PacketError::Length {
                field: len,
                datagram: b.len(),
            });
        }
        let auth = if b[1] & 0x04 != 0 {
            let bad = |auth_len: u8| PacketError::AuthLength {
                auth_type: b.get(PACKET_LEN).copied().unwrap_or(0),
                auth_len,
                len,
            };
            if usize::from(len) < PACKET_LEN + 2 {
                return Err(bad(0));
            }
            let (auth_type, auth_len) = (b[24], b[25]);
            if usize::from(auth_len) < 2 || PACKET_LEN + usize::from(auth_len) != usize::from(len) {
                return Err(bad(auth_len));
            }
            let sha1 = AuthType::from_code(auth_type).is_some();
            if sha1 && usize::from(auth_len) != SHA1_AUTH_LEN {
                return Err(bad(auth_len));
            }
            let key_id = if usize::from(auth_len) >= 3 { b[26] } else { 0 };
            let seq = if usize::from(auth_len) >= 8 {
                u32::from_be_bytes([b[28], b[29], b[30], b[31]])
            } else {
                0
            };
            Some(AuthSection {
                auth_type,
                key_id,
                seq,
            })
        } else {
            None
        };
        if b[2] == 0 {
            return Err(PacketError::ZeroDetectMult);
        }
        if b[1] & 0x01 != 0 {
            return Err(PacketError::Multipoint);
        }
        let word = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let p = Packet {
            diag: Diag::from_bits(b[0] & 0x1f),
            state: BfdState::from_bits(b[1] >> 6),
            poll: b[1] & 0x20 != 0,
            final_: b[1] & 0x10 != 0,
            control_plane_independent: b[1] & 0x08 != 0,
            demand: b[1] & 0x02 != 0,
            detect_mult: b[2],
            my_disc: word(4),
            your_disc: word(8),
            desired_min_tx_us: word(12),
            required_min_rx_us: word(16),
            required_min_echo_rx_us: word(20),
        };
        if p.my_disc == 0 {
            return Err(PacketError::ZeroMyDiscriminator);
        }
        if p.your_disc == 0 && matches!(p.state, BfdState::Init | BfdState::Up) {
            return Err(PacketError::ZeroYourDiscriminator(p.state));
        }
        Ok((p, auth))
    }
}

/// A session's timers and role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BfdConfig {
    /// Fastest rate we want to send at while Up.
    pub desired_min_tx: Duration,
    /// Fastest rate we can receive at.
    pub required_min_rx: Duration,
    /// Detection multiplier we announce (the peer uses it to time us out).
    pub detect_mult: u8,
    /// Set the C bit: our BFD survives a restart of the control plane.
    pub control_plane_independent: bool,
}

impl From<juneau_control::model::BfdSettings> for BfdConfig {
    fn from(s: juneau_control::model::BfdSettings) -> Self {
        BfdConfig {
            desired_min_tx: Duration::from_millis(u64::from(s.min_tx_ms.max(1))),
            required_min_rx: Duration::from_millis(u64::from(s.min_rx_ms.max(1))),
            detect_mult: s.multiplier.max(1),
            control_plane_independent: false,
        }
    }
}

/// What a session reports to its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEvent {
    /// The state changed.
    StateChanged {
        /// Before.
        from: BfdState,
        /// After.
        to: BfdState,
        /// The local diagnostic (why we went down) or, for a peer-signaled down, the
        /// peer's.
        diag: Diag,
    },
}

/// One BFD session (RFC 5880 6.8.1 state variables), sans-IO.
#[derive(Debug)]
pub struct Session {
    cfg: BfdConfig,
    local_disc: u32,
    remote_disc: u32,
    state: BfdState,
    remote_state: BfdState,
    local_diag: Diag,
    remote_diag: Diag,
    /// What we currently announce as Desired Min TX (1 s while not Up).
    desired_tx: Duration,
    /// What is used for our transmit timer (an increase waits for the Poll to end).
    tx_basis: Duration,
    remote_min_rx: Duration,
    remote_desired_tx: Duration,
    remote_detect_mult: u8,
    poll_active: bool,
    send_final: bool,
    send_now: bool,
    next_tx: Instant,
    detect_at: Option<Instant>,
    events: VecDeque<SessionEvent>,
    rng: u64,
    /// Packets discarded by the session checks (authentication failures included).
    pub discarded: u64,
    /// Packets discarded by authentication (RFC 5880 6.7): A bit not as configured, other
    /// type or key id, sequence number outside the window, wrong digest.
    pub auth_failures: u64,
    auth: Option<Auth>,
    /// bfd.XmitAuthSeq: the sequence number of our next authenticated packet.
    xmit_auth_seq: u32,
    /// bfd.RcvAuthSeq, with until when it is known (bfd.AuthSeqKnown: reset when no
    /// packet was accepted for twice the detection time, RFC 5880 6.8.1).
    rcv_auth_seq: Option<(u32, Instant)>,
}

fn us(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

impl Session {
    /// A session in state Down that starts sending at `now`. `local_disc` must be
    /// non-zero and unique among this system's sessions.
    pub fn new(cfg: BfdConfig, local_disc: u32, now: Instant) -> Self {
        assert_ne!(local_disc, 0, "BFD discriminators are non-zero");
        let slow = cfg.desired_min_tx.max(SLOW_TX);
        Session {
            cfg,
            local_disc,
            remote_disc: 0,
            state: BfdState::Down,
            remote_state: BfdState::Down,
            local_diag: Diag::None,
            remote_diag: Diag::None,
            desired_tx: slow,
            tx_basis: slow,
            remote_min_rx: Duration::from_micros(1),
            remote_desired_tx: SLOW_TX,
            remote_detect_mult: 0,
            poll_active: false,
            send_final: false,
            send_now: false,
            next_tx: now,
            detect_at: None,
            events: VecDeque::new(),
            rng: u64::from(local_disc) ^ 0x9e37_79b9_7f4a_7c15,
            discarded: 0,
            auth_failures: 0,
            auth: None,
            xmit_auth_seq: 0,
            rcv_auth_seq: None,
        }
    }

    /// Authenticates the session's packets (`None`: none). `initial_seq` is the first
    /// sequence number we send: random for a new session (RFC 5880 6.8.1), the one after
    /// the last sent for a resumed one ([`next_auth_seq`](Self::next_auth_seq)).
    pub fn set_auth(&mut self, auth: Option<Auth>, initial_seq: u32) {
        self.auth = auth;
        self.xmit_auth_seq = initial_seq;
        self.rcv_auth_seq = None;
    }

    /// The authentication type, if any.
    pub fn auth_type(&self) -> Option<AuthType> {
        self.auth.as_ref().map(|a| a.kind)
    }

    /// The sequence number of our next authenticated packet.
    pub fn next_auth_seq(&self) -> u32 {
        self.xmit_auth_seq
    }

    /// A packet from [`poll_transmit`](Self::poll_transmit) as it goes on the wire:
    /// authenticated when the session is, the sequence number then advancing by one per
    /// packet (required for meticulous keyed SHA1, allowed for keyed SHA1).
    pub fn wire_bytes(&mut self, p: &Packet) -> Vec<u8> {
        match &self.auth {
            None => p.encode().to_vec(),
            Some(a) => {
                let b = p.encode_sha1(a, self.xmit_auth_seq);
                self.xmit_auth_seq = self.xmit_auth_seq.wrapping_add(1);
                b.to_vec()
            }
        }
    }

    /// Handles a received datagram for this session: decoding, authentication (RFC 5880
    /// 6.7.3, 6.7.4; a failure is counted in [`auth_failures`](Self::auth_failures) and
    /// leaves the session untouched), then [`handle_packet`](Self::handle_packet).
    pub fn receive(&mut self, now: Instant, bytes: &[u8]) -> Result<(), PacketError> {
        let (p, section) = Packet::decode_any(bytes)?;
        if let Err(e) = self.authenticate(now, &p, section, bytes) {
            self.discarded += 1;
            self.auth_failures += 1;
            return Err(e);
        }
        self.handle_packet(now, &p)
    }

    fn authenticate(
        &mut self,
        now: Instant,
        p: &Packet,
        section: Option<AuthSection>,
        bytes: &[u8],
    ) -> Result<(), PacketError> {
        let (auth, section) = match (&self.auth, section) {
            (None, None) => return Ok(()),
            (None, Some(_)) => return Err(PacketError::Authenticated),
            (Some(a), None) => return Err(PacketError::AuthMissing(a.kind)),
            (Some(a), Some(s)) => (a, s),
        };
        if section.auth_type != auth.kind.code() {
            return Err(PacketError::AuthType {
                got: section.auth_type,
                want: auth.kind,
            });
        }
        if section.key_id != auth.key_id {
            return Err(PacketError::AuthKeyId {
                got: section.key_id,
                want: auth.key_id,
            });
        }
        // decode_any checked that a SHA1 section makes the packet 52 bytes.
        let Some(packet) = bytes
            .get(..SHA1_PACKET_LEN)
            .and_then(|b| <[u8; SHA1_PACKET_LEN]>::try_from(b).ok())
        else {
            return Err(PacketError::TooShort(bytes.len()));
        };
        if let Some((last, until)) = self.rcv_auth_seq {
            if now < until {
                // Within 3 x Detect Mult after the last accepted (circular); meticulous:
                // strictly after it.
                let ahead = section.seq.wrapping_sub(last);
                let min = u32::from(auth.kind == AuthType::MeticulousKeyedSha1);
                if ahead < min || ahead > 3 * u32::from(p.detect_mult) {
                    return Err(PacketError::AuthSequence {
                        got: section.seq,
                        last,
                    });
                }
            }
        }
        let want = auth.digest(&packet);
        if !bool::from(want[..].ct_eq(&packet[32..52])) {
            return Err(PacketError::AuthDigest);
        }
        let remote_tx = Duration::from_micros(u64::from(p.desired_min_tx_us.max(1)));
        let detect = self.cfg.required_min_rx.max(remote_tx) * u32::from(p.detect_mult);
        self.rcv_auth_seq = Some((section.seq, now + 2 * detect));
        Ok(())
    }

    /// Current state.
    pub fn state(&self) -> BfdState {
        self.state
    }
    /// Our discriminator.
    pub fn local_disc(&self) -> u32 {
        self.local_disc
    }
    /// The peer's discriminator (0 until heard).
    pub fn remote_disc(&self) -> u32 {
        self.remote_disc
    }
    /// Why the session last went down.
    pub fn local_diag(&self) -> Diag {
        self.local_diag
    }
    /// The peer's last diagnostic.
    pub fn remote_diag(&self) -> Diag {
        self.remote_diag
    }
    /// The configuration.
    pub fn config(&self) -> BfdConfig {
        self.cfg
    }

    /// The negotiated detection time (async mode: the peer's multiplier times the slower
    /// of our required RX and the peer's desired TX); `None` before the peer is heard.
    pub fn detection_time(&self) -> Option<Duration> {
        (self.remote_detect_mult > 0).then(|| {
            self.cfg.required_min_rx.max(self.remote_desired_tx)
                * u32::from(self.remote_detect_mult)
        })
    }

    /// The interval between our packets before jitter.
    pub fn transmit_interval(&self) -> Duration {
        self.tx_basis.max(self.remote_min_rx)
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next.
    pub fn poll_timeout(&self) -> Instant {
        match self.detect_at {
            Some(d) => d.min(self.next_tx),
            None => self.next_tx,
        }
    }

    /// Handles the timers due at `now`: detection-time expiry and the periodic transmit
    /// (collected with [`poll_transmit`](Self::poll_transmit)).
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(at) = self.detect_at {
            if at <= now {
                self.detect_at = None;
                self.remote_disc = 0;
                self.remote_detect_mult = 0;
                self.remote_state = BfdState::Down;
                self.remote_min_rx = Duration::from_micros(1);
                self.remote_desired_tx = SLOW_TX;
                if matches!(self.state, BfdState::Init | BfdState::Up) {
                    self.local_diag = Diag::DetectionTimeExpired;
                    self.set_state(BfdState::Down);
                }
            }
        }
    }

    /// The packet to send now, if one is due (periodic, or a Final answering a Poll).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Packet> {
        if self.send_final {
            self.send_final = false;
            return Some(self.packet(false, true));
        }
        if now < self.next_tx && !self.send_now {
            return None;
        }
        self.send_now = false;
        let interval = self.transmit_interval();
        // Jitter (RFC 5880 6.8.7): 75-100 % of the interval, 75-90 % with multiplier 1.
        let max = if self.cfg.detect_mult == 1 { 90 } else { 100 };
        let pct = 75 + (self.next_random() % (max - 75 + 1));
        self.next_tx = now + interval * pct as u32 / 100;
        Some(self.packet(self.poll_active, false))
    }

    /// The next event for the owner.
    pub fn poll_event(&mut self) -> Option<SessionEvent> {
        self.events.pop_front()
    }

    /// Takes the session administratively down (sent to the peer, which must not treat it
    /// as a path failure), or back up to Down.
    pub fn set_admin_down(&mut self, down: bool, now: Instant) {
        if down && self.state != BfdState::AdminDown {
            self.local_diag = Diag::AdministrativelyDown;
            self.set_state(BfdState::AdminDown);
            self.next_tx = now;
        } else if !down && self.state == BfdState::AdminDown {
            self.local_diag = Diag::None;
            self.set_state(BfdState::Down);
        }
    }

    /// Before this process exits for a restart: announces a slow rate `tx` with a Poll, so
    /// that the peer's detection time (its view of our multiplier x `tx`) covers the time
    /// until a new process [`resume`](Self::resume)s the session. Only an Up session is
    /// held; [`poll_active`](Self::poll_active) turns false once the peer acknowledged.
    pub fn hold_for_restart(&mut self, tx: Duration) {
        if self.state != BfdState::Up {
            return;
        }
        self.desired_tx = tx;
        self.poll_active = true;
        self.send_now = true;
    }

    /// A Poll Sequence is running (not yet answered with a Final).
    pub fn poll_active(&self) -> bool {
        self.poll_active
    }

    /// Continues a session that an earlier process held Up with
    /// [`hold_for_restart`](Self::hold_for_restart): same discriminators, state Up, the
    /// fast rate requested again with a Poll at once. If the peer has meanwhile declared
    /// the session down it says so in its next packet, and the session goes Down.
    pub fn resume(cfg: BfdConfig, local_disc: u32, remote_disc: u32, now: Instant) -> Self {
        let mut s = Session::new(cfg, local_disc, now);
        s.state = BfdState::Up;
        s.remote_state = BfdState::Up;
        s.remote_disc = remote_disc;
        s.remote_detect_mult = 3;
        s.desired_tx = cfg.desired_min_tx;
        s.tx_basis = cfg.desired_min_tx;
        s.poll_active = true;
        s.send_now = true;
        s.detect_at = s.detection_time().map(|d| now + d);
        s.events.push_back(SessionEvent::StateChanged {
            from: BfdState::Down,
            to: BfdState::Up,
            diag: Diag::None,
        });
        s
    }

    /// Handles a received, decoded packet for this session (RFC 5880 6.8.6; the
    /// session-independent checks are [`Packet::decode`]'s).
    ///
    /// A packet with Your Discriminator 0 is matched to the session by its source address
    /// only, which anyone on the path can forge. So while the session is Up, a packet
    /// must also carry the peer's discriminator learned when the session came up (My
    /// Discriminator): otherwise it is discarded without touching the session, and in
    /// particular cannot take it down or overwrite what it learned. The price: a peer
    /// that restarted with a new discriminator is not heard until the session has timed
    /// out (one detection time); a peer that timed out on its side and says Down with its
    /// own discriminator still brings the session down at once. See docs/security.md.
    pub fn handle_packet(&mut self, now: Instant, p: &Packet) -> Result<(), PacketError> {
        if p.your_disc != 0 && p.your_disc != self.local_disc {
            self.discarded += 1;
            return Err(PacketError::WrongDiscriminator {
                got: p.your_disc,
                ours: self.local_disc,
            });
        }
        if self.state == BfdState::Up && p.my_disc != self.remote_disc {
            self.discarded += 1;
            return Err(PacketError::NotThePeer {
                got: p.my_disc,
                peer: self.remote_disc,
            });
        }
        self.remote_disc = p.my_disc;
        self.remote_state = p.state;
        self.remote_diag = p.diag;
        self.remote_detect_mult = p.detect_mult;
        let old_remote_tx = self.remote_desired_tx;
        self.remote_desired_tx = Duration::from_micros(u64::from(p.desired_min_tx_us.max(1)));
        let new_min_rx = Duration::from_micros(u64::from(p.required_min_rx_us));
        if new_min_rx > Duration::ZERO && new_min_rx < self.remote_min_rx {
            // The peer can take packets faster: no need to wait out a slow timer.
            self.next_tx = self.next_tx.min(now + new_min_rx);
        }
        self.remote_min_rx = new_min_rx;
        if p.final_ && self.poll_active {
            self.poll_active = false;
            self.tx_basis = self.desired_tx;
        }
        if self.state == BfdState::AdminDown {
            return Ok(());
        }
        // A peer that polls to change its rate may keep its old (slower) schedule until
        // the Poll ends (BIRD does): until then, time it out on the slower of the two.
        let remote_tx = if p.poll {
            old_remote_tx.max(self.remote_desired_tx)
        } else {
            self.remote_desired_tx
        };
        self.detect_at =
            Some(now + self.cfg.required_min_rx.max(remote_tx) * u32::from(p.detect_mult));
        if p.state == BfdState::AdminDown {
            if self.state != BfdState::Down {
                self.local_diag = Diag::NeighborSignaledDown;
                self.set_state(BfdState::Down);
            }
        } else {
            match (self.state, p.state) {
                (BfdState::Down, BfdState::Down) => self.set_state(BfdState::Init),
                (BfdState::Down, BfdState::Init) => self.set_state(BfdState::Up),
                (BfdState::Init, BfdState::Init | BfdState::Up) => self.set_state(BfdState::Up),
                (BfdState::Up, BfdState::Down) => {
                    self.local_diag = Diag::NeighborSignaledDown;
                    self.set_state(BfdState::Down);
                }
                _ => {}
            }
        }
        if p.poll {
            self.send_final = true;
        }
        Ok(())
    }

    fn set_state(&mut self, to: BfdState) {
        let from = self.state;
        if from == to {
            return;
        }
        self.state = to;
        if to == BfdState::Up {
            self.local_diag = Diag::None;
        }
        // Fast timers only while Up; a change of what we announce starts a Poll Sequence.
        let want = if to == BfdState::Up {
            self.cfg.desired_min_tx
        } else {
            self.cfg.desired_min_tx.max(SLOW_TX)
        };
        if want != self.desired_tx {
            if want < self.desired_tx || to != BfdState::Up {
                self.tx_basis = want;
            }
            self.desired_tx = want;
            self.poll_active = to == BfdState::Up;
        }
        if to == BfdState::Up {
            // Tell the peer at once (with the Poll for the faster rate): it times us out
            // on the rate we announce, not on our old slow schedule.
            self.send_now = true;
        }
        // A peer that signals Down reports its own reason, when it gives one.
        let diag = if to == BfdState::Down
            && self.local_diag == Diag::NeighborSignaledDown
            && self.remote_diag != Diag::None
        {
            self.remote_diag
        } else {
            self.local_diag
        };
        self.events
            .push_back(SessionEvent::StateChanged { from, to, diag });
    }

    fn packet(&self, poll: bool, final_: bool) -> Packet {
        Packet {
            diag: self.local_diag,
            state: self.state,
            poll,
            final_,
            control_plane_independent: self.cfg.control_plane_independent,
            demand: false,
            detect_mult: self.cfg.detect_mult,
            my_disc: self.local_disc,
            your_disc: self.remote_disc,
            desired_min_tx_us: us(self.desired_tx),
            required_min_rx_us: us(self.cfg.required_min_rx),
            required_min_echo_rx_us: 0,
        }
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64: jitter only needs to decorrelate senders, not to be unpredictable.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[cfg(test)]
mod tests;
