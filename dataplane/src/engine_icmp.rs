//! ICMP "fragmentation needed" for a packet this engine NATed that its egress cannot
//! take whole (a non-TCP packet with DF set): written with [`crate::icmp::frag_needed`]
//! as if the packet's next hop had sent it, then translated by the same code that
//! translates a router's or a backend's ICMP error, so the sender gets the packet it
//! sent quoted (docs/decisions.md, "ICMP fragmentation needed from the dataplane").

use super::*;
use crate::icmp;

impl Engine {
    /// `frame` was NATed by this engine and is larger than its egress takes (`mtu`, the
    /// egress interface's MTU) with DF set. Writes into `out` (at least
    /// [`icmp::FRAG_NEEDED_MAX`] bytes) the ICMP "fragmentation needed" for its sender
    /// and returns where it goes and its length:
    ///
    /// - towards a Pod (`to_pod`, `frame` is `client -> backend`): to the client, from
    ///   the VIP it sent to, quoting `client -> VIP:port`;
    /// - towards the uplink (`frame` is a reply `VIP:port -> client`): to the backend,
    ///   quoting `backend:port -> client`, from `node_source(backend)` (the node's
    ///   address the kernel would use towards the Pod), or from the client's address
    ///   when that is `None`.
    ///
    /// `None` (nothing sent) when no error may be sent about the packet, its flow is
    /// unknown, or the worker's rate is exceeded (counted as
    /// `icmp_frag_needed_limited`). The oversized packet's own drop is the caller's.
    #[allow(clippy::too_many_arguments)]
    pub fn frag_needed(
        &mut self,
        frame: &[u8],
        to_pod: bool,
        mtu: u16,
        node_source: impl FnOnce(u32) -> Option<u32>,
        nb: &Neighbours,
        now_ms: u64,
        out: &mut [u8],
    ) -> Option<(Side, usize)> {
        let Ok(Parsed::Ipv4(v)) = packet::parse(frame) else {
            return None;
        };
        // Written as the packet's destination would answer it: the backend (towards a
        // Pod), or the client (a reply; the source is replaced below) to the VIP.
        let n = icmp::frag_needed(frame, v.dst, v.src, mtu, out)?;
        if !self.icmp_bucket.take(now_ms) {
            self.counters.icmp_frag_needed_limited += 1;
            return None;
        }
        let err = &mut out[..n];
        let Ok(Parsed::Ipv4(ev)) = packet::parse(err) else {
            return None;
        };
        let e = packet::parse_icmp_error(err, &ev)?;
        let verdict = if to_pod {
            self.reverse_icmp_error(err, ev, e, nb, now_ms)
        } else {
            self.forward_icmp_error(err, ev, e, nb, now_ms)
        };
        let Verdict::Tx(side) = verdict else {
            return None;
        };
        if !to_pod {
            // The translated error goes to the backend; its source is the node.
            let backend = u32::from_be_bytes([err[30], err[31], err[32], err[33]]);
            let from = node_source(backend).unwrap_or(v.dst);
            err[26..30].copy_from_slice(&from.to_be_bytes());
            err[24..26].fill(0);
            let c = packet::ipv4_header_checksum(&err[14..34]);
            err[24..26].copy_from_slice(&c.to_be_bytes());
        }
        self.counters.icmp_frag_needed_sent += 1;
        Some((side, n))
    }
}
