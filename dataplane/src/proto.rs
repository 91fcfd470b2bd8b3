//! Protocol numbers and TCP flag bits: the few wire constants the flow table and the
//! wire views (`crate::packet`) both use, kept apart so neither depends on the other.

/// IP protocol number of TCP.
pub const IPPROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;
/// IP protocol number of ICMP.
pub const IPPROTO_ICMP: u8 = 1;

/// TCP flag bits (byte 13 of the TCP header).
pub mod tcp_flags {
    /// FIN.
    pub const FIN: u8 = crate::abi::TCP_FIN;
    /// SYN.
    pub const SYN: u8 = crate::abi::TCP_SYN;
    /// RST.
    pub const RST: u8 = crate::abi::TCP_RST;
    /// ACK.
    pub const ACK: u8 = 0x10;

    /// A SYN without ACK or RST: a client opening (or re-trying to open) a connection.
    #[inline(always)]
    pub fn lone_syn(flags: u8) -> bool {
        flags & (SYN | ACK | RST) == SYN
    }
}

/// The name of a protocol a frontend may carry, as Services and the metrics spell it.
pub const fn protocol_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        _ => "other",
    }
}
