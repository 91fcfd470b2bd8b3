//! BGP-4 messages as this speaker uses them, and their wire format.
//!
//! A small crate-own API over `netgauze-bgp-pkt`: OPEN and UPDATE go through netgauze's
//! codec; KEEPALIVE, NOTIFICATION and ROUTE-REFRESH are fixed formats written here. Every
//! decoding error is a [`DecodeError`] that names the NOTIFICATION code and subcode to
//! answer with (RFC 4271 §6), and for UPDATE errors the RFC 7606 action: reset the session
//! or treat the UPDATE as a withdraw.
//!
//! Received UPDATEs are never installed, so the session only needs
//! [`inspect_update`]: a cheap, allocation-free walk that checks the framing RFC 7606
//! says must reset the session and counts prefixes. [`decode`] parses everything (tests,
//! tooling, OPEN).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net};
use netgauze_bgp_pkt::capabilities::{
    BgpCapability, ExtendedNextHopEncoding, ExtendedNextHopEncodingCapability,
    FourOctetAsCapability, GracefulRestartAddressFamily, GracefulRestartCapability,
    MultiProtocolExtensionsCapability,
};
use netgauze_bgp_pkt::community::{Community, LargeCommunity};
use netgauze_bgp_pkt::nlri::{Ipv4Unicast, Ipv4UnicastAddress, Ipv6Unicast, Ipv6UnicastAddress};
use netgauze_bgp_pkt::notification::BgpNotificationMessage;
use netgauze_bgp_pkt::open::{BgpOpenMessage, BgpOpenMessageParameter};
use netgauze_bgp_pkt::path_attribute::{
    As4PathSegment, AsPath, AsPathSegmentType, Communities, LargeCommunities, LocalPreference,
    MpReach as NgMpReach, MpUnreach as NgMpUnreach, NextHop, Origin as NgOrigin, PathAttribute,
    PathAttributeValue,
};
use netgauze_bgp_pkt::update::BgpUpdateMessage;
use netgauze_bgp_pkt::wire::deserializer::BgpParsingContext;
use netgauze_bgp_pkt::BgpMessage;
use netgauze_iana::address_family::{AddressFamily as NgAfi, AddressType};
use netgauze_parse_utils::reader::SliceReader;
use netgauze_parse_utils::traits::ParseFromWithOneInput;
use netgauze_parse_utils::WritablePdu;

pub use crate::family::{AddressFamily, Families};

/// Length of the fixed BGP header (marker, length, type).
pub const HEADER_LEN: usize = 19;
/// Largest message without the Extended Message capability (which we do not offer).
pub const MAX_MESSAGE_LEN: usize = 4096;
/// AS_TRANS (RFC 6793): the 2-byte "My AS" of a speaker whose AS does not fit.
pub const AS_TRANS: u16 = 23456;

/// BGP message type codes.
pub mod msg_type {
    /// OPEN.
    pub const OPEN: u8 = 1;
    /// UPDATE.
    pub const UPDATE: u8 = 2;
    /// NOTIFICATION.
    pub const NOTIFICATION: u8 = 3;
    /// KEEPALIVE.
    pub const KEEPALIVE: u8 = 4;
    /// ROUTE-REFRESH (RFC 2918).
    pub const ROUTE_REFRESH: u8 = 5;
}

/// A BGP message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// OPEN.
    Open(Open),
    /// UPDATE (also End-of-RIB: an UPDATE with nothing in it).
    Update(Update),
    /// NOTIFICATION.
    Notification(Notification),
    /// KEEPALIVE.
    Keepalive,
    /// ROUTE-REFRESH for one address family.
    RouteRefresh {
        /// Address family identifier (1 = IPv4).
        afi: u16,
        /// Subsequent address family identifier (1 = unicast).
        safi: u8,
    },
}

/// An OPEN message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// The sender's AS (the 4-octet one when the capability carries it).
    pub asn: u32,
    /// Proposed hold time in seconds.
    pub hold_time: u16,
    /// BGP identifier.
    pub router_id: Ipv4Addr,
    /// Capabilities this speaker understands (others are ignored).
    pub capabilities: Capabilities,
}

/// The capabilities this speaker sends and understands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// 4-octet AS number (RFC 6793).
    pub four_octet_as: Option<u32>,
    /// Multiprotocol extensions (RFC 4760): one capability per family listed.
    pub multiprotocol: Families,
    /// Extended next hop (RFC 8950) for IPv4 unicast NLRI with an IPv6 next hop.
    pub extended_next_hop: bool,
    /// Route refresh (RFC 2918).
    pub route_refresh: bool,
    /// Graceful restart (RFC 4724).
    pub graceful_restart: Option<GracefulRestart>,
    /// Whether the OPEN carried any capability at all (without one, IPv4 unicast is
    /// implied).
    pub any: bool,
}

/// The graceful-restart capability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GracefulRestart {
    /// "R" bit: the sender has restarted.
    pub restarted: bool,
    /// Restart time in seconds (12 bits).
    pub restart_time: u16,
    /// The families whose routes are preserved over a restart, each with its
    /// "forwarding state preserved" bit.
    pub families: Vec<(AddressFamily, bool)>,
}

impl Capabilities {
    /// The families this OPEN offers: those with a multiprotocol capability, or IPv4
    /// unicast alone when it carries none (RFC 4760 §8: a speaker without the capability
    /// speaks IPv4 unicast only).
    pub fn families(&self) -> Families {
        if self.multiprotocol.is_empty() {
            Families::IPV4
        } else {
            self.multiprotocol
        }
    }
}

/// ORIGIN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Learned from an interior protocol (what a load balancer announces).
    Igp,
    /// Learned from EGP.
    Egp,
    /// Otherwise.
    Incomplete,
}

/// The path attributes this speaker announces a route with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathAttributes {
    /// ORIGIN.
    pub origin: Origin,
    /// AS_PATH as one AS_SEQUENCE of 4-byte ASNs (empty for iBGP).
    pub as_path: Vec<u32>,
    /// NEXT_HOP of the IPv4 NLRI field: sent only with IPv4 NLRI (an UPDATE carrying only
    /// MP_REACH_NLRI has none, RFC 4760 §3); `0.0.0.0` when the UPDATE has none.
    pub next_hop: Ipv4Addr,
    /// LOCAL_PREF (iBGP only).
    pub local_pref: Option<u32>,
    /// COMMUNITIES (RFC 1997).
    pub communities: Vec<u32>,
    /// LARGE_COMMUNITIES (RFC 8092).
    pub large_communities: Vec<[u32; 3]>,
    /// The link-bandwidth extended community (draft-ietf-idr-link-bandwidth): the AS (two
    /// octets; `AS_TRANS` 23456 if ours does not fit) and bytes per second (sent as an
    /// IEEE float).
    pub link_bandwidth: Option<(u32, u64)>,
}

/// An UPDATE message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Update {
    /// Withdrawn prefixes.
    pub withdrawn: Vec<Ipv4Net>,
    /// Attributes of the announced prefixes (`None` if only withdrawing).
    pub attributes: Option<PathAttributes>,
    /// Announced prefixes.
    pub announced: Vec<Ipv4Net>,
    /// MP_REACH_NLRI (RFC 4760): announcements of another family, or IPv4 with an IPv6
    /// next hop (RFC 8950). Sent with [`Update::attributes`].
    pub mp_reach: Option<MpReach>,
    /// MP_UNREACH_NLRI (RFC 4760): withdrawals of one family.
    pub mp_unreach: Option<MpUnreach>,
}

/// MP_REACH_NLRI for one of our families.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpReach {
    /// AFI/SAFI of the prefixes.
    pub family: AddressFamily,
    /// Global next hop (IPv6 for IPv6 unicast and for RFC 8950 IPv4 routes).
    pub next_hop: IpAddr,
    /// Link-local next hop, sent after the global one as a 32-byte next hop (RFC 2545).
    pub link_local: Option<Ipv6Addr>,
    /// Announced prefixes, all of `family`.
    pub announced: Vec<IpNet>,
}

/// MP_UNREACH_NLRI for one of our families.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpUnreach {
    /// AFI/SAFI of the prefixes.
    pub family: AddressFamily,
    /// Withdrawn prefixes, all of `family` (none: End-of-RIB).
    pub withdrawn: Vec<IpNet>,
}

impl Update {
    /// The IPv4 unicast End-of-RIB marker (RFC 4724): an empty UPDATE.
    pub fn end_of_rib() -> Self {
        Update::default()
    }

    /// The End-of-RIB marker of `family`: an empty UPDATE for IPv4 unicast, an UPDATE
    /// holding only an empty MP_UNREACH_NLRI for the others (RFC 4724 §2).
    pub fn end_of_rib_for(family: AddressFamily) -> Self {
        match family {
            AddressFamily::Ipv4Unicast => Update::end_of_rib(),
            _ => Update {
                mp_unreach: Some(MpUnreach {
                    family,
                    withdrawn: vec![],
                }),
                ..Update::default()
            },
        }
    }

    /// Whether this UPDATE is the IPv4 unicast End-of-RIB marker.
    pub fn is_end_of_rib(&self) -> bool {
        self.end_of_rib_family() == Some(AddressFamily::Ipv4Unicast)
    }

    /// The family this UPDATE is the End-of-RIB marker of, if it is one.
    pub fn end_of_rib_family(&self) -> Option<AddressFamily> {
        if !self.withdrawn.is_empty()
            || !self.announced.is_empty()
            || self.attributes.is_some()
            || self.mp_reach.is_some()
        {
            return None;
        }
        // RFC 4724 §2: IPv4 unicast's marker is the empty UPDATE; the other families'
        // an UPDATE with only their empty MP_UNREACH_NLRI (an empty MP_UNREACH_NLRI of
        // IPv4 unicast is not a marker, just an UPDATE withdrawing nothing).
        match &self.mp_unreach {
            None => Some(AddressFamily::Ipv4Unicast),
            Some(u) if u.withdrawn.is_empty() && u.family != AddressFamily::Ipv4Unicast => {
                Some(u.family)
            }
            Some(_) => None,
        }
    }

    /// Prefixes announced, IPv4 NLRI and MP_REACH_NLRI together.
    pub fn announced_count(&self) -> usize {
        self.announced.len() + self.mp_reach.as_ref().map_or(0, |r| r.announced.len())
    }

    /// Prefixes withdrawn, IPv4 withdrawn routes and MP_UNREACH_NLRI together.
    pub fn withdrawn_count(&self) -> usize {
        self.withdrawn.len() + self.mp_unreach.as_ref().map_or(0, |u| u.withdrawn.len())
    }
}

/// A NOTIFICATION message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Error code.
    pub code: u8,
    /// Error subcode.
    pub subcode: u8,
    /// Data.
    pub data: Vec<u8>,
}

/// NOTIFICATION error codes (RFC 4271 §4.5).
pub mod code {
    /// Message Header Error.
    pub const MESSAGE_HEADER: u8 = 1;
    /// OPEN Message Error.
    pub const OPEN_MESSAGE: u8 = 2;
    /// UPDATE Message Error.
    pub const UPDATE_MESSAGE: u8 = 3;
    /// Hold Timer Expired.
    pub const HOLD_TIMER_EXPIRED: u8 = 4;
    /// Finite State Machine Error.
    pub const FSM: u8 = 5;
    /// Cease.
    pub const CEASE: u8 = 6;
    /// ROUTE-REFRESH Message Error (RFC 7313).
    pub const ROUTE_REFRESH: u8 = 7;
}

/// Cease subcodes (RFC 4486).
pub mod cease {
    /// Administrative Shutdown.
    pub const ADMINISTRATIVE_SHUTDOWN: u8 = 2;
    /// Peer De-configured.
    pub const PEER_DECONFIGURED: u8 = 3;
    /// Connection Rejected.
    pub const CONNECTION_REJECTED: u8 = 5;
    /// Other Configuration Change.
    pub const OTHER_CONFIGURATION_CHANGE: u8 = 6;
    /// Connection Collision Resolution.
    pub const CONNECTION_COLLISION_RESOLUTION: u8 = 7;
    /// BFD Down (RFC 9384).
    pub const BFD_DOWN: u8 = 10;
}

impl Notification {
    /// A NOTIFICATION with no data.
    pub fn new(code: u8, subcode: u8) -> Self {
        Notification {
            code,
            subcode,
            data: Vec::new(),
        }
    }

    /// Hold Timer Expired.
    pub fn hold_timer_expired() -> Self {
        Notification::new(code::HOLD_TIMER_EXPIRED, 0)
    }

    /// Finite State Machine Error with a subcode (RFC 6608: 1 OpenSent, 2 OpenConfirm,
    /// 3 Established).
    pub fn fsm_error(subcode: u8) -> Self {
        Notification::new(code::FSM, subcode)
    }

    /// Cease with a subcode.
    pub fn cease(subcode: u8) -> Self {
        Notification::new(code::CEASE, subcode)
    }

    /// An OPEN Message Error.
    pub fn open_error(kind: OpenError, data: Vec<u8>) -> Self {
        Notification {
            code: code::OPEN_MESSAGE,
            subcode: kind as u8,
            data,
        }
    }

    /// A short operator-facing description: `"code/subcode (name)"`.
    pub fn describe(&self) -> String {
        let name = match (self.code, self.subcode) {
            (1, 1) => "connection not synchronized",
            (1, 2) => "bad message length",
            (1, 3) => "bad message type",
            (1, _) => "message header error",
            (2, 1) => "unsupported version number",
            (2, 2) => "bad peer AS",
            (2, 3) => "bad BGP identifier",
            (2, 4) => "unsupported optional parameter",
            (2, 6) => "unacceptable hold time",
            (2, 7) => "unsupported capability",
            (2, _) => "OPEN message error",
            (3, 1) => "malformed attribute list",
            (3, 10) => "invalid network field",
            (3, 11) => "malformed AS_PATH",
            (3, _) => "UPDATE message error",
            (4, _) => "hold timer expired",
            (5, _) => "finite state machine error",
            (6, 2) => "cease: administrative shutdown",
            (6, 3) => "cease: peer de-configured",
            (6, 4) => "cease: administrative reset",
            (6, 5) => "cease: connection rejected",
            (6, 6) => "cease: other configuration change",
            (6, 7) => "cease: connection collision resolution",
            (6, _) => "cease",
            (7, _) => "route-refresh message error",
            _ => "unknown error",
        };
        format!("{}/{} ({name})", self.code, self.subcode)
    }
}

/// Message Header Error subcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum HeaderError {
    /// The marker is not all ones.
    ConnectionNotSynchronized = 1,
    /// Length out of range for the type.
    BadMessageLength = 2,
    /// Unknown message type.
    BadMessageType = 3,
}

/// OPEN Message Error subcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpenError {
    /// No specific subcode.
    Unspecific = 0,
    /// Version is not 4.
    UnsupportedVersionNumber = 1,
    /// The peer's AS is not the configured one.
    BadPeerAs = 2,
    /// Invalid BGP identifier.
    BadBgpIdentifier = 3,
    /// Unknown optional parameter.
    UnsupportedOptionalParameter = 4,
    /// Hold time 1 or 2.
    UnacceptableHoldTime = 6,
    /// A required capability is missing.
    UnsupportedCapability = 7,
    /// BGP role mismatch (RFC 9234).
    RoleMismatch = 11,
}

/// UPDATE Message Error subcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum UpdateError {
    /// No specific subcode.
    Unspecific = 0,
    /// Lengths do not add up.
    MalformedAttributeList = 1,
    /// Unknown well-known attribute.
    UnrecognizedWellKnownAttribute = 2,
    /// Missing well-known attribute.
    MissingWellKnownAttribute = 3,
    /// Flags wrong for the attribute.
    AttributeFlagsError = 4,
    /// Length wrong for the attribute.
    AttributeLengthError = 5,
    /// Bad ORIGIN value.
    InvalidOriginAttribute = 6,
    /// Bad NEXT_HOP.
    InvalidNextHopAttribute = 8,
    /// Bad optional attribute.
    OptionalAttributeError = 9,
    /// Bad NLRI or withdrawn routes.
    InvalidNetworkField = 10,
    /// Bad AS_PATH.
    MalformedAsPath = 11,
}

/// What RFC 7606 says to do with a malformed UPDATE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rfc7606Action {
    /// The prefixes cannot be located: send the NOTIFICATION and reset the session.
    SessionReset,
    /// Treat every prefix in the UPDATE as withdrawn; the session stays up.
    TreatAsWithdraw,
}

/// A message that could not be decoded, named as the NOTIFICATION that answers it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Message Header Error (code 1).
    #[error("message header error: {kind:?}")]
    Header {
        /// Subcode.
        kind: HeaderError,
        /// NOTIFICATION data.
        data: Vec<u8>,
    },
    /// OPEN Message Error (code 2).
    #[error("OPEN message error: {kind:?} ({detail})")]
    Open {
        /// Subcode.
        kind: OpenError,
        /// NOTIFICATION data.
        data: Vec<u8>,
        /// What was wrong.
        detail: String,
    },
    /// UPDATE Message Error (code 3).
    #[error("UPDATE message error: {kind:?} ({action:?}: {detail})")]
    Update {
        /// Subcode.
        kind: UpdateError,
        /// NOTIFICATION data.
        data: Vec<u8>,
        /// RFC 7606 handling.
        action: Rfc7606Action,
        /// What was wrong.
        detail: String,
    },
    /// A NOTIFICATION that cannot be parsed: close without answering (RFC 4271 §6.4).
    #[error("malformed NOTIFICATION message")]
    Notification,
    /// ROUTE-REFRESH Message Error (code 7, subcode 1: invalid length).
    #[error("malformed ROUTE-REFRESH message")]
    RouteRefresh {
        /// NOTIFICATION data.
        data: Vec<u8>,
    },
}

impl DecodeError {
    /// The NOTIFICATION to send, or `None` if the session should stay up (RFC 7606
    /// treat-as-withdraw) or close silently (a malformed NOTIFICATION).
    pub fn notification(&self) -> Option<Notification> {
        match self {
            DecodeError::Header { kind, data } => Some(Notification {
                code: code::MESSAGE_HEADER,
                subcode: *kind as u8,
                data: data.clone(),
            }),
            DecodeError::Open { kind, data, .. } => Some(Notification {
                code: code::OPEN_MESSAGE,
                subcode: *kind as u8,
                data: data.clone(),
            }),
            DecodeError::Update {
                kind,
                data,
                action: Rfc7606Action::SessionReset,
                ..
            } => Some(Notification {
                code: code::UPDATE_MESSAGE,
                subcode: *kind as u8,
                data: data.clone(),
            }),
            DecodeError::Update {
                action: Rfc7606Action::TreatAsWithdraw,
                ..
            } => None,
            DecodeError::Notification => None,
            DecodeError::RouteRefresh { data } => Some(Notification {
                code: code::ROUTE_REFRESH,
                subcode: 1,
                data: data.clone(),
            }),
        }
    }

    /// Whether the session must go down.
    pub fn resets_session(&self) -> bool {
        !matches!(
            self,
            DecodeError::Update {
                action: Rfc7606Action::TreatAsWithdraw,
                ..
            }
        )
    }

    fn header(kind: HeaderError, data: Vec<u8>) -> Self {
        DecodeError::Header { kind, data }
    }

    fn update(kind: UpdateError, action: Rfc7606Action, detail: impl Into<String>) -> Self {
        DecodeError::Update {
            kind,
            data: Vec::new(),
            action,
            detail: detail.into(),
        }
    }
}

/// An encoding error: the message does not fit the wire format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The message is longer than 4096 bytes.
    #[error("message of {0} bytes exceeds the 4096-byte BGP maximum")]
    TooLong(usize),
    /// A prefix is not a valid unicast network of its family.
    #[error("{0} is not a valid unicast network of its address family")]
    InvalidPrefix(IpNet),
    /// netgauze refused the message.
    #[error("codec: {0}")]
    Codec(String),
}

/// Session-dependent decoding input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeContext {
    /// Both sides announced 4-octet AS: AS_PATH carries 4-byte ASNs.
    pub four_octet_as: bool,
}

impl Default for DecodeContext {
    fn default() -> Self {
        DecodeContext {
            four_octet_as: true,
        }
    }
}

/// Checks the header at the start of `buf` and returns the length of the first message
/// when all of it is in `buf` (`Ok(None)`: read more). Errors are Message Header Errors.
pub fn frame(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let marker_len = buf.len().min(16);
    if buf[..marker_len].iter().any(|&b| b != 0xff) {
        return Err(DecodeError::header(
            HeaderError::ConnectionNotSynchronized,
            Vec::new(),
        ));
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = u16::from_be_bytes([buf[16], buf[17]]) as usize;
    let ty = buf[18];
    let bad_len = || {
        DecodeError::header(
            HeaderError::BadMessageLength,
            (len as u16).to_be_bytes().to_vec(),
        )
    };
    if !(HEADER_LEN..=MAX_MESSAGE_LEN).contains(&len) {
        return Err(bad_len());
    }
    let ok = match ty {
        msg_type::OPEN => len >= 29,
        msg_type::UPDATE => len >= 23,
        msg_type::NOTIFICATION => len >= 21,
        msg_type::KEEPALIVE => len == 19,
        msg_type::ROUTE_REFRESH => len >= 19,
        _ => return Err(DecodeError::header(HeaderError::BadMessageType, vec![ty])),
    };
    if !ok {
        return Err(bad_len());
    }
    Ok((buf.len() >= len).then_some(len))
}

/// The message type of a framed message (0 if `msg` is shorter than a header).
pub fn message_type(msg: &[u8]) -> u8 {
    msg.get(18).copied().unwrap_or(0)
}

/// What [`inspect_update`] found in an UPDATE it did not fully parse.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpdateSummary {
    /// Prefixes in the Withdrawn Routes field.
    pub withdrawn: usize,
    /// Prefixes in the NLRI field.
    pub announced: usize,
    /// Whether it is the IPv4 unicast End-of-RIB marker.
    pub end_of_rib: bool,
    /// Prefixes of our families (IPv4 and IPv6 unicast) in MP_REACH_NLRI.
    pub mp_announced: usize,
    /// Prefixes of our families in MP_UNREACH_NLRI.
    pub mp_withdrawn: usize,
}

fn walk_prefixes(field: &[u8]) -> Result<usize, ()> {
    walk_prefixes_of(field, 32)
}

fn walk_prefixes_of(mut field: &[u8], max_bits: u8) -> Result<usize, ()> {
    let mut n = 0;
    while let Some((&bits, rest)) = field.split_first() {
        if bits > max_bits {
            return Err(());
        }
        let bytes = (bits as usize).div_ceil(8);
        if rest.len() < bytes {
            return Err(());
        }
        field = &rest[bytes..];
        n += 1;
    }
    Ok(n)
}

/// Counts the prefixes of an MP_REACH_NLRI (type 14) or MP_UNREACH_NLRI (15) attribute
/// value of one of our families; 0 for other families, whose NLRI is not looked at.
/// `Err`: the NLRI cannot be located, which resets the session (RFC 7606 §7.11).
fn walk_mp(ty: u8, v: &[u8]) -> Result<usize, ()> {
    let fixed = if ty == 14 { 5 } else { 3 };
    if v.len() < fixed {
        return Err(());
    }
    let family = AddressFamily::from_afi_safi(u16::from_be_bytes([v[0], v[1]]), v[2]);
    let nlri_start = if ty == 14 {
        // Next-hop lengths: IPv6 16 or 32 (global + link-local, RFC 2545); IPv4 4, or
        // 16/32 with an IPv6 next hop (RFC 8950). Any other is a malformed attribute.
        let nh_len = v[3];
        let valid = match family {
            Some(AddressFamily::Ipv4Unicast) => matches!(nh_len, 4 | 16 | 32),
            Some(AddressFamily::Ipv6Unicast) => matches!(nh_len, 16 | 32),
            None => true,
        };
        let start = fixed + usize::from(nh_len);
        if !valid || start > v.len() {
            return Err(());
        }
        start
    } else {
        fixed
    };
    match family {
        Some(AddressFamily::Ipv4Unicast) => walk_prefixes_of(&v[nlri_start..], 32),
        Some(AddressFamily::Ipv6Unicast) => walk_prefixes_of(&v[nlri_start..], 128),
        None => Ok(0),
    }
}

/// Validates an UPDATE's framing (a whole message, header included, as [`frame`] cut it)
/// without allocating, as RFC 7606 asks: errors that make
/// the prefixes impossible to locate (withdrawn routes, total attribute length, NLRI,
/// MP_REACH/MP_UNREACH attributes) reset the session; an attribute that overruns the
/// attribute field is treat-as-withdraw. Attribute contents are not looked at: this
/// speaker installs nothing, so a malformed attribute could only ever cause a withdraw of
/// a route it never keeps.
pub fn inspect_update(msg: &[u8]) -> Result<UpdateSummary, DecodeError> {
    use Rfc7606Action::*;
    let body = msg.get(HEADER_LEN..).unwrap_or_default();
    if body.len() < 4 {
        return Err(DecodeError::header(
            HeaderError::BadMessageLength,
            (msg.len() as u16).to_be_bytes().to_vec(),
        ));
    }
    let wlen = u16::from_be_bytes([body[0], body[1]]) as usize;
    if 2 + wlen + 2 > body.len() {
        return Err(DecodeError::update(
            UpdateError::MalformedAttributeList,
            SessionReset,
            "withdrawn routes length overruns the message",
        ));
    }
    let withdrawn = walk_prefixes(&body[2..2 + wlen]).map_err(|()| {
        DecodeError::update(
            UpdateError::InvalidNetworkField,
            SessionReset,
            "malformed withdrawn routes",
        )
    })?;
    let alen = u16::from_be_bytes([body[2 + wlen], body[3 + wlen]]) as usize;
    let attrs_start = 4 + wlen;
    if attrs_start + alen > body.len() {
        return Err(DecodeError::update(
            UpdateError::MalformedAttributeList,
            SessionReset,
            "total path attribute length overruns the message",
        ));
    }
    let announced = walk_prefixes(&body[attrs_start + alen..]).map_err(|()| {
        DecodeError::update(
            UpdateError::InvalidNetworkField,
            SessionReset,
            "malformed NLRI",
        )
    })?;
    let mut attrs = &body[attrs_start..attrs_start + alen];
    let mut overrun = false;
    let (mut mp_reach, mut mp_unreach) = (0, 0);
    let (mut mp_announced, mut mp_withdrawn) = (0, 0);
    while !attrs.is_empty() {
        if attrs.len() < 3 {
            overrun = true;
            break;
        }
        let (flags, ty) = (attrs[0], attrs[1]);
        let (len, hdr) = if flags & 0x10 != 0 {
            if attrs.len() < 4 {
                overrun = true;
                break;
            }
            (u16::from_be_bytes([attrs[2], attrs[3]]) as usize, 4)
        } else {
            (attrs[2] as usize, 3)
        };
        if hdr + len > attrs.len() {
            if ty == 14 || ty == 15 {
                return Err(DecodeError::update(
                    UpdateError::OptionalAttributeError,
                    SessionReset,
                    "MP_REACH/MP_UNREACH attribute overruns the attribute list",
                ));
            }
            overrun = true;
            break;
        }
        if ty == 14 || ty == 15 {
            let n = walk_mp(ty, &attrs[hdr..hdr + len]).map_err(|()| {
                DecodeError::update(
                    UpdateError::OptionalAttributeError,
                    SessionReset,
                    "malformed MP_REACH_NLRI or MP_UNREACH_NLRI",
                )
            })?;
            if ty == 14 {
                mp_reach += 1;
                mp_announced += n;
            } else {
                mp_unreach += 1;
                mp_withdrawn += n;
            }
        }
        attrs = &attrs[hdr + len..];
    }
    if mp_reach > 1 || mp_unreach > 1 {
        return Err(DecodeError::update(
            UpdateError::MalformedAttributeList,
            SessionReset,
            "MP_REACH_NLRI or MP_UNREACH_NLRI appears more than once",
        ));
    }
    if overrun {
        return Err(DecodeError::update(
            UpdateError::AttributeLengthError,
            TreatAsWithdraw,
            "a path attribute overruns the attribute list",
        ));
    }
    Ok(UpdateSummary {
        withdrawn,
        announced,
        end_of_rib: withdrawn == 0 && announced == 0 && alen == 0,
        mp_announced,
        mp_withdrawn,
    })
}

fn header_bytes(ty: u8, body_len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + body_len);
    v.extend_from_slice(&[0xff; 16]);
    v.extend_from_slice(&((HEADER_LEN + body_len) as u16).to_be_bytes());
    v.push(ty);
    v
}

/// Encodes a message.
pub fn encode(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    let bytes = match msg {
        Message::Keepalive => header_bytes(msg_type::KEEPALIVE, 0),
        Message::Notification(n) => {
            let mut v = header_bytes(msg_type::NOTIFICATION, 2 + n.data.len());
            v.push(n.code);
            v.push(n.subcode);
            v.extend_from_slice(&n.data);
            v
        }
        Message::RouteRefresh { afi, safi } => {
            let mut v = header_bytes(msg_type::ROUTE_REFRESH, 4);
            v.extend_from_slice(&afi.to_be_bytes());
            v.push(0);
            v.push(*safi);
            v
        }
        Message::Open(open) => write_ng(&BgpMessage::Open(open_to_ng(open)))?,
        Message::Update(update) => write_ng(&BgpMessage::Update(update_to_ng(update)?))?,
    };
    if bytes.len() > MAX_MESSAGE_LEN {
        return Err(EncodeError::TooLong(bytes.len()));
    }
    Ok(bytes)
}

fn write_ng(msg: &BgpMessage) -> Result<Vec<u8>, EncodeError> {
    let mut buf = Vec::with_capacity(msg.len());
    msg.write(&mut buf)
        .map_err(|e| EncodeError::Codec(e.to_string()))?;
    Ok(buf)
}

fn open_to_ng(open: &Open) -> BgpOpenMessage {
    let caps = &open.capabilities;
    let mut list = Vec::new();
    for af in caps.multiprotocol.iter() {
        list.push(BgpCapability::MultiProtocolExtensions(
            MultiProtocolExtensionsCapability::new(address_type(af)),
        ));
    }
    if caps.extended_next_hop {
        list.push(BgpCapability::ExtendedNextHopEncoding(
            ExtendedNextHopEncodingCapability::new(vec![ExtendedNextHopEncoding::new(
                AddressType::Ipv4Unicast,
                NgAfi::IPv6,
            )]),
        ));
    }
    if caps.route_refresh {
        list.push(BgpCapability::RouteRefresh);
    }
    if let Some(gr) = &caps.graceful_restart {
        let afs: Vec<_> = gr
            .families
            .iter()
            .map(|&(af, fwd)| GracefulRestartAddressFamily::new(fwd, address_type(af)))
            .collect();
        list.push(BgpCapability::GracefulRestartCapability(
            GracefulRestartCapability::new(gr.restarted, false, gr.restart_time & 0x0fff, afs),
        ));
    }
    if let Some(asn) = caps.four_octet_as {
        list.push(BgpCapability::FourOctetAs(FourOctetAsCapability::new(asn)));
    }
    let my_as = u16::try_from(open.asn).unwrap_or(AS_TRANS);
    let params = if list.is_empty() {
        vec![]
    } else {
        vec![BgpOpenMessageParameter::new_capabilities(list)]
    };
    BgpOpenMessage::new(my_as, open.hold_time, open.router_id, params)
}

fn address_type(af: AddressFamily) -> AddressType {
    match af {
        AddressFamily::Ipv4Unicast => AddressType::Ipv4Unicast,
        AddressFamily::Ipv6Unicast => AddressType::Ipv6Unicast,
    }
}

fn family_of(t: AddressType) -> Option<AddressFamily> {
    match t {
        AddressType::Ipv4Unicast => Some(AddressFamily::Ipv4Unicast),
        AddressType::Ipv6Unicast => Some(AddressFamily::Ipv6Unicast),
        _ => None,
    }
}

fn attr(
    value: PathAttributeValue,
    optional: bool,
    transitive: bool,
    extended: bool,
) -> Result<PathAttribute, EncodeError> {
    PathAttribute::from(optional, transitive, false, extended, value)
        .map_err(|(_, e)| EncodeError::Codec(format!("{e:?}")))
}

fn prefix_to_ng(p: &Ipv4Net) -> Result<Ipv4UnicastAddress, EncodeError> {
    Ipv4Unicast::from_net(*p)
        .map(Ipv4UnicastAddress::new_no_path_id)
        .map_err(|_| EncodeError::InvalidPrefix(IpNet::V4(*p)))
}

fn v4_prefixes(ps: &[IpNet]) -> Result<Vec<Ipv4UnicastAddress>, EncodeError> {
    ps.iter()
        .map(|p| match p {
            IpNet::V4(n) => prefix_to_ng(n),
            IpNet::V6(_) => Err(EncodeError::InvalidPrefix(*p)),
        })
        .collect()
}

fn v6_prefixes(ps: &[IpNet]) -> Result<Vec<Ipv6UnicastAddress>, EncodeError> {
    ps.iter()
        .map(|p| match p {
            IpNet::V6(n) => Ipv6Unicast::from_net(*n)
                .map(|u| Ipv6UnicastAddress::new(None, u))
                .map_err(|_| EncodeError::InvalidPrefix(*p)),
            IpNet::V4(_) => Err(EncodeError::InvalidPrefix(*p)),
        })
        .collect()
}

/// Bytes of a list of prefixes in NLRI encoding (length octet and the prefix).
fn nlri_len(ps: &[IpNet]) -> usize {
    ps.iter()
        .map(|p| 1 + usize::from(p.prefix_len()).div_ceil(8))
        .sum()
}

fn mp_reach_to_ng(r: &MpReach) -> Result<PathAttribute, EncodeError> {
    let bad_next_hop = || EncodeError::Codec(format!("next hop {} for {}", r.next_hop, r.family));
    let value = match (r.family, r.next_hop) {
        (AddressFamily::Ipv6Unicast, IpAddr::V6(global)) => NgMpReach::Ipv6Unicast {
            next_hop_global: global,
            next_hop_local: r.link_local,
            nlri: v6_prefixes(&r.announced)?.into(),
        },
        (AddressFamily::Ipv4Unicast, next_hop) => NgMpReach::Ipv4Unicast {
            next_hop,
            next_hop_local: r.link_local,
            nlri: v4_prefixes(&r.announced)?.into(),
        },
        _ => return Err(bad_next_hop()),
    };
    let next_hop_len = match r.next_hop {
        IpAddr::V4(_) => 4,
        IpAddr::V6(_) => 16,
    } + r.link_local.map_or(0, |_| 16);
    let len = 5 + next_hop_len + nlri_len(&r.announced);
    attr(PathAttributeValue::MpReach(value), true, false, len > 255)
}

fn mp_unreach_to_ng(u: &MpUnreach) -> Result<PathAttribute, EncodeError> {
    let value = match u.family {
        AddressFamily::Ipv6Unicast => NgMpUnreach::Ipv6Unicast {
            nlri: v6_prefixes(&u.withdrawn)?.into(),
        },
        AddressFamily::Ipv4Unicast => NgMpUnreach::Ipv4Unicast {
            nlri: v4_prefixes(&u.withdrawn)?.into(),
        },
    };
    let len = 3 + nlri_len(&u.withdrawn);
    attr(PathAttributeValue::MpUnreach(value), true, false, len > 255)
}

fn update_to_ng(u: &Update) -> Result<BgpUpdateMessage, EncodeError> {
    let withdrawn = u
        .withdrawn
        .iter()
        .map(prefix_to_ng)
        .collect::<Result<Vec<_>, _>>()?;
    let nlri = u
        .announced
        .iter()
        .map(prefix_to_ng)
        .collect::<Result<Vec<_>, _>>()?;
    let mut attrs = Vec::new();
    if let Some(a) = &u.attributes {
        path_attributes_to_ng(a, u, &mut attrs)?;
    } else if u.mp_reach.is_some() {
        return Err(EncodeError::Codec(
            "MP_REACH_NLRI without path attributes".into(),
        ));
    }
    if let Some(un) = &u.mp_unreach {
        attrs.push(mp_unreach_to_ng(un)?);
    }
    Ok(BgpUpdateMessage::new(withdrawn, attrs, nlri))
}

/// The attributes of an UPDATE that announces, in type-code order (MP_REACH_NLRI
/// goes after COMMUNITIES).
fn path_attributes_to_ng(
    a: &PathAttributes,
    u: &Update,
    attrs: &mut Vec<PathAttribute>,
) -> Result<(), EncodeError> {
    let origin = match a.origin {
        Origin::Igp => NgOrigin::IGP,
        Origin::Egp => NgOrigin::EGP,
        Origin::Incomplete => NgOrigin::Incomplete,
    };
    attrs.push(attr(
        PathAttributeValue::Origin(origin),
        false,
        true,
        false,
    )?);
    let segments = if a.as_path.is_empty() {
        vec![]
    } else {
        a.as_path
            .chunks(255)
            .map(|c| As4PathSegment::new(AsPathSegmentType::AsSequence, c.to_vec()))
            .collect()
    };
    let long_path = a.as_path.len() * 4 + 2 > 255;
    attrs.push(attr(
        PathAttributeValue::AsPath(AsPath::As4PathSegments(segments.into())),
        false,
        true,
        long_path,
    )?);
    // An UPDATE with only MP_REACH_NLRI carries no NEXT_HOP (RFC 4760 §3).
    if !u.announced.is_empty() || u.mp_reach.is_none() {
        attrs.push(attr(
            PathAttributeValue::NextHop(NextHop::new(a.next_hop)),
            false,
            true,
            false,
        )?);
    }
    if let Some(lp) = a.local_pref {
        attrs.push(attr(
            PathAttributeValue::LocalPreference(LocalPreference::new(lp)),
            false,
            true,
            false,
        )?);
    }
    if !a.communities.is_empty() {
        let c: Vec<_> = a.communities.iter().map(|&c| Community::new(c)).collect();
        attrs.push(attr(
            PathAttributeValue::Communities(Communities::new(c)),
            true,
            true,
            a.communities.len() * 4 > 255,
        )?);
    }
    if let Some(r) = &u.mp_reach {
        attrs.push(mp_reach_to_ng(r)?);
    }
    if !a.large_communities.is_empty() {
        let c: Vec<_> = a
            .large_communities
            .iter()
            .map(|c| LargeCommunity::new(c[0], c[1], c[2]))
            .collect();
        attrs.push(attr(
            PathAttributeValue::LargeCommunities(LargeCommunities::new(c)),
            true,
            true,
            a.large_communities.len() * 12 > 255,
        )?);
    }
    if let Some((asn, bw)) = a.link_bandwidth {
        use netgauze_bgp_pkt::community::{
            ExtendedCommunity, NonTransitiveTwoOctetExtendedCommunity,
        };
        let c = ExtendedCommunity::NonTransitiveTwoOctet(
            NonTransitiveTwoOctetExtendedCommunity::LinkBandwidth {
                global_admin: u16::try_from(asn).unwrap_or(23456),
                local_admin: (bw as f32).to_bits(),
            },
        );
        attrs.push(attr(
            PathAttributeValue::ExtendedCommunities(
                netgauze_bgp_pkt::path_attribute::ExtendedCommunities::new(vec![c]),
            ),
            true,
            true,
            false,
        )?);
    }
    Ok(())
}

/// Decodes one framed message (as returned by [`frame`]).
pub fn decode(msg: &[u8], ctx: DecodeContext) -> Result<Message, DecodeError> {
    let len = match frame(msg)? {
        Some(len) if len == msg.len() => len,
        _ => {
            return Err(DecodeError::header(
                HeaderError::BadMessageLength,
                (msg.len().min(u16::MAX as usize) as u16)
                    .to_be_bytes()
                    .to_vec(),
            ))
        }
    };
    let body = &msg[HEADER_LEN..len];
    match message_type(msg) {
        msg_type::KEEPALIVE => Ok(Message::Keepalive),
        msg_type::NOTIFICATION => {
            if body.len() < 2 {
                return Err(DecodeError::Notification);
            }
            Ok(Message::Notification(Notification {
                code: body[0],
                subcode: body[1],
                data: body[2..].to_vec(),
            }))
        }
        msg_type::ROUTE_REFRESH => {
            if body.len() != 4 {
                return Err(DecodeError::RouteRefresh { data: msg.to_vec() });
            }
            Ok(Message::RouteRefresh {
                afi: u16::from_be_bytes([body[0], body[1]]),
                safi: body[3],
            })
        }
        msg_type::UPDATE => {
            inspect_update(msg)?;
            match parse_ng(msg, ctx) {
                Ok(BgpMessage::Update(u)) => update_from_ng(&u),
                Ok(_) => unreachable_kind(),
                // The framing is sound (checked above): RFC 7606 treat-as-withdraw.
                Err(n) => Err(DecodeError::Update {
                    kind: update_subcode(n.subcode),
                    data: n.data,
                    action: Rfc7606Action::TreatAsWithdraw,
                    detail: n.detail,
                }),
            }
        }
        _ => match parse_ng(msg, ctx) {
            Ok(BgpMessage::Open(o)) => Ok(Message::Open(open_from_ng(&o))),
            Ok(_) => unreachable_kind(),
            Err(n) if n.code == code::OPEN_MESSAGE => Err(DecodeError::Open {
                kind: open_subcode(n.subcode),
                data: n.data,
                detail: n.detail,
            }),
            Err(n) => Err(DecodeError::Open {
                kind: OpenError::Unspecific,
                data: Vec::new(),
                detail: n.detail,
            }),
        },
    }
}

fn unreachable_kind() -> Result<Message, DecodeError> {
    // netgauze dispatches on the same type byte we matched on.
    Err(DecodeError::header(HeaderError::BadMessageType, Vec::new()))
}

struct NgError {
    code: u8,
    subcode: u8,
    data: Vec<u8>,
    detail: String,
}

fn parse_ng(msg: &[u8], ctx: DecodeContext) -> Result<BgpMessage, NgError> {
    let mut pctx = BgpParsingContext::default();
    pctx.set_asn4(ctx.four_octet_as);
    BgpMessage::parse(&mut SliceReader::new(msg), &mut pctx).map_err(|e| {
        let detail = e.to_string();
        let n: BgpNotificationMessage = e.into();
        // netgauze knows the code/subcode/data of its own error; read them back off the
        // wire form rather than mirroring its enum here.
        match write_ng(&BgpMessage::Notification(n)) {
            Ok(b) if b.len() >= HEADER_LEN + 2 => NgError {
                code: b[HEADER_LEN],
                subcode: b[HEADER_LEN + 1],
                data: b[HEADER_LEN + 2..].to_vec(),
                detail,
            },
            _ => NgError {
                code: 0,
                subcode: 0,
                data: Vec::new(),
                detail,
            },
        }
    })
}

fn open_subcode(s: u8) -> OpenError {
    use OpenError::*;
    match s {
        1 => UnsupportedVersionNumber,
        2 => BadPeerAs,
        3 => BadBgpIdentifier,
        4 => UnsupportedOptionalParameter,
        6 => UnacceptableHoldTime,
        7 => UnsupportedCapability,
        11 => RoleMismatch,
        _ => Unspecific,
    }
}

fn update_subcode(s: u8) -> UpdateError {
    use UpdateError::*;
    match s {
        1 => MalformedAttributeList,
        2 => UnrecognizedWellKnownAttribute,
        3 => MissingWellKnownAttribute,
        4 => AttributeFlagsError,
        5 => AttributeLengthError,
        6 => InvalidOriginAttribute,
        8 => InvalidNextHopAttribute,
        9 => OptionalAttributeError,
        10 => InvalidNetworkField,
        11 => MalformedAsPath,
        _ => Unspecific,
    }
}

fn open_from_ng(o: &BgpOpenMessage) -> Open {
    let mut caps = Capabilities::default();
    for cap in o.capabilities() {
        caps.any = true;
        match cap {
            BgpCapability::MultiProtocolExtensions(mp) => {
                if let Some(af) = family_of(mp.address_type()) {
                    caps.multiprotocol = caps.multiprotocol.with(af);
                }
            }
            BgpCapability::ExtendedNextHopEncoding(enh) => {
                caps.extended_next_hop |= enh.encodings().iter().any(|e| {
                    e.address_type() == AddressType::Ipv4Unicast && e.next_hop_afi() == NgAfi::IPv6
                })
            }
            BgpCapability::RouteRefresh => caps.route_refresh = true,
            BgpCapability::FourOctetAs(a) => caps.four_octet_as = Some(a.asn4()),
            BgpCapability::GracefulRestartCapability(gr) => {
                caps.graceful_restart = Some(GracefulRestart {
                    restarted: gr.restart(),
                    restart_time: gr.time(),
                    families: gr
                        .address_families()
                        .iter()
                        .filter_map(|af| {
                            family_of(af.address_type()).map(|f| (f, af.forwarding_state()))
                        })
                        .collect(),
                })
            }
            _ => {}
        }
    }
    Open {
        asn: caps.four_octet_as.unwrap_or(o.my_as() as u32),
        hold_time: o.hold_time(),
        router_id: o.bgp_id(),
        capabilities: caps,
    }
}

fn update_from_ng(u: &BgpUpdateMessage) -> Result<Message, DecodeError> {
    let net = |a: &Ipv4UnicastAddress| a.network().address();
    let withdrawn: Vec<Ipv4Net> = u.withdraw_routes().iter().map(net).collect();
    let announced: Vec<Ipv4Net> = u.nlri().iter().map(net).collect();
    let mut attributes = None;
    let (mut mp_reach, mut mp_unreach) = (None, None);
    for pa in u.path_attributes() {
        match pa.value() {
            PathAttributeValue::MpReach(r) => mp_reach = mp_reach_from_ng(r),
            PathAttributeValue::MpUnreach(r) => mp_unreach = mp_unreach_from_ng(r),
            _ => {}
        }
    }
    // MP attributes of our families are read into `mp_reach`/`mp_unreach`; any other
    // attribute (an MP one of another family included) makes `attributes` present, so
    // such an UPDATE is never mistaken for an End-of-RIB.
    let mp_only = |pa: &PathAttribute| match pa.value() {
        PathAttributeValue::MpReach(r) => mp_reach_from_ng(r).is_some(),
        PathAttributeValue::MpUnreach(u) => mp_unreach_from_ng(u).is_some(),
        _ => false,
    };
    if !u.path_attributes().iter().all(mp_only) {
        let mut a = PathAttributes {
            origin: Origin::Incomplete,
            as_path: Vec::new(),
            next_hop: Ipv4Addr::UNSPECIFIED,
            local_pref: None,
            communities: Vec::new(),
            large_communities: Vec::new(),
            link_bandwidth: None,
        };
        for pa in u.path_attributes() {
            match pa.value() {
                PathAttributeValue::Origin(o) => {
                    a.origin = match o {
                        NgOrigin::IGP => Origin::Igp,
                        NgOrigin::EGP => Origin::Egp,
                        NgOrigin::Incomplete => Origin::Incomplete,
                    }
                }
                PathAttributeValue::AsPath(p) => a.as_path = Vec::<u32>::from(p.clone()),
                PathAttributeValue::NextHop(n) => a.next_hop = n.next_hop(),
                PathAttributeValue::LocalPreference(l) => a.local_pref = Some(l.metric()),
                PathAttributeValue::Communities(c) => {
                    a.communities = c.communities().iter().map(|c| c.value()).collect()
                }
                PathAttributeValue::ExtendedCommunities(c) => {
                    use netgauze_bgp_pkt::community::{
                        ExtendedCommunity, NonTransitiveTwoOctetExtendedCommunity,
                    };
                    for ec in c.communities() {
                        if let ExtendedCommunity::NonTransitiveTwoOctet(
                            NonTransitiveTwoOctetExtendedCommunity::LinkBandwidth {
                                global_admin,
                                local_admin,
                            },
                        ) = ec
                        {
                            a.link_bandwidth = Some((
                                u32::from(*global_admin),
                                f32::from_bits(*local_admin) as u64,
                            ));
                        }
                    }
                }
                PathAttributeValue::LargeCommunities(c) => {
                    a.large_communities = c
                        .communities()
                        .iter()
                        .map(|c| [c.global_admin(), c.local_data1(), c.local_data2()])
                        .collect()
                }
                _ => {}
            }
        }
        attributes = Some(a);
    }
    Ok(Message::Update(Update {
        withdrawn,
        attributes,
        announced,
        mp_reach,
        mp_unreach,
    }))
}

fn v4_nets(ps: &[Ipv4UnicastAddress]) -> Vec<IpNet> {
    ps.iter()
        .map(|a| IpNet::V4(a.network().address()))
        .collect()
}

fn v6_nets(ps: &[Ipv6UnicastAddress]) -> Vec<IpNet> {
    ps.iter()
        .map(|a| IpNet::V6(a.network().address()))
        .collect()
}

/// Our view of a received MP_REACH_NLRI; `None` for families we do not speak.
fn mp_reach_from_ng(r: &NgMpReach) -> Option<MpReach> {
    match r {
        NgMpReach::Ipv6Unicast {
            next_hop_global,
            next_hop_local,
            nlri,
        } => Some(MpReach {
            family: AddressFamily::Ipv6Unicast,
            next_hop: IpAddr::V6(*next_hop_global),
            link_local: *next_hop_local,
            announced: v6_nets(nlri),
        }),
        NgMpReach::Ipv4Unicast {
            next_hop,
            next_hop_local,
            nlri,
        } => Some(MpReach {
            family: AddressFamily::Ipv4Unicast,
            next_hop: *next_hop,
            link_local: *next_hop_local,
            announced: v4_nets(nlri),
        }),
        _ => None,
    }
}

fn mp_unreach_from_ng(u: &NgMpUnreach) -> Option<MpUnreach> {
    match u {
        NgMpUnreach::Ipv6Unicast { nlri } => Some(MpUnreach {
            family: AddressFamily::Ipv6Unicast,
            withdrawn: v6_nets(nlri),
        }),
        NgMpUnreach::Ipv4Unicast { nlri } => Some(MpUnreach {
            family: AddressFamily::Ipv4Unicast,
            withdrawn: v4_nets(nlri),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
