//! Routes and neighbours from the kernel over rtnetlink, off the packet path.
//!
//! A small synchronous NETLINK_ROUTE client (dump `RTM_GETROUTE` / `RTM_GETNEIGH`, and
//! `RTM_NEWNEIGH` with `NTF_USE` to make the kernel start ARP for a next hop it does not
//! know yet) and the resolver thread that keeps a [`Neighbours`] copy fresh for the
//! forwarding loop: it re-reads the tables about once a second, and within milliseconds
//! after the loop reports a miss.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;

use arc_swap::ArcSwap;
use crossbeam_queue::ArrayQueue;
use std::time::{Duration, Instant};

use crate::neigh::{Iface, Neighbours, Resolve, Route, Route6};
use crate::packet::MacAddr;

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWNEIGH: u16 = 28;
const RTM_DELNEIGH: u16 = 29;
const RTM_GETNEIGH: u16 = 30;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_DUMP: u16 = 0x300;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_TABLE: u16 = 15;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;
const RT_TABLE_MAIN: u32 = 254;
const RTN_UNICAST: u8 = 1;
const NTF_USE: u8 = 0x01;
const NUD_STALE: u16 = 0x04;
/// NUD_REACHABLE | NUD_STALE | NUD_DELAY | NUD_PROBE | NUD_NOARP | NUD_PERMANENT.
const NUD_USABLE: u16 = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80;

/// A NETLINK_ROUTE socket.
#[derive(Debug)]
pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
    /// The generic-netlink socket and `netdev` family id for XDP features, opened on
    /// first use and kept (a snapshot is taken about once a second).
    netdev: Option<Box<(Netlink, u16)>>,
}

fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            return None;
        }
        let v = &b[4..len];
        b = &b[((len + 3) & !3).min(b.len())..];
        Some((ty, v))
    })
}

fn ipv4(v: &[u8]) -> Option<u32> {
    (v.len() == 4).then(|| u32::from_be_bytes([v[0], v[1], v[2], v[3]]))
}

fn ipv6(v: &[u8]) -> Option<[u8; 16]> {
    v.try_into().ok()
}

fn u32_ne(v: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(v.try_into().ok()?))
}

// Generic netlink: the `netdev` family's device dump (`xdp-features`).
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
/// The device takes frames redirected by an XDP program (`ndo_xdp_xmit`); a veth only
/// while its peer runs an XDP program or has GRO on.
const NETDEV_XDP_ACT_NDO_XMIT: u64 = 4;

impl Netlink {
    /// Opens a NETLINK_ROUTE socket in the current network namespace.
    pub fn open() -> io::Result<Self> {
        Self::open_protocol(libc::NETLINK_ROUTE)
    }

    fn open_protocol(protocol: i32) -> io::Result<Self> {
        // SAFETY: plain socket(2) call; the returned fd is checked and owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh, valid descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: 2,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a correctly sized timeval on our own socket.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
        }
        Ok(Netlink {
            fd,
            seq: 1,
            buf: vec![0; 1 << 16],
            netdev: None,
        })
    }

    fn send(&mut self, ty: u16, flags: u16, payload: &[u8]) -> io::Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let len = 16 + payload.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&(len as u32).to_ne_bytes());
        msg.extend_from_slice(&ty.to_ne_bytes());
        msg.extend_from_slice(&flags.to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(payload);
        // SAFETY: zeroed sockaddr_nl is a valid "to the kernel" address.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `msg` and `addr` are valid for the lengths passed.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(self.seq)
    }

    /// Receives replies to `seq` until DONE / an ACK; calls `each(type, payload)` for
    /// every data message.
    fn recv_all(&mut self, seq: u32, mut each: impl FnMut(u16, &[u8])) -> io::Result<()> {
        loop {
            // SAFETY: `buf` is valid for writes of its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut b = &self.buf[..n as usize];
            while b.len() >= 16 {
                let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
                let ty = u16::from_ne_bytes([b[4], b[5]]);
                let mseq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
                if len < 16 || len > b.len() {
                    break;
                }
                let payload = &b[16..len];
                b = &b[((len + 3) & !3).min(b.len())..];
                if mseq != seq {
                    continue;
                }
                match ty {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let code = payload
                            .get(..4)
                            .map(|e| i32::from_ne_bytes([e[0], e[1], e[2], e[3]]))
                            .unwrap_or(0);
                        return if code == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-code))
                        };
                    }
                    _ => each(ty, payload),
                }
            }
        }
    }

    /// IPv4 unicast routes of the main table.
    pub fn routes(&mut self) -> io::Result<Vec<Route>> {
        Ok(self
            .route_dump(libc::AF_INET, ipv4)?
            .into_iter()
            .map(|(dst, len, gateway, ifindex)| Route {
                prefix: dst.unwrap_or(0),
                len,
                gateway,
                ifindex,
            })
            .collect())
    }

    /// IPv6 unicast routes of the main table (gateways are often link-local).
    pub fn routes6(&mut self) -> io::Result<Vec<Route6>> {
        Ok(self
            .route_dump(libc::AF_INET6, ipv6)?
            .into_iter()
            .map(|(dst, len, gateway, ifindex)| Route6 {
                prefix: dst.map_or(0, u128::from_be_bytes),
                len,
                gateway: gateway.map(u128::from_be_bytes),
                ifindex,
            })
            .collect())
    }

    /// Unicast routes of the main table of one family: `(destination, prefix length,
    /// gateway, interface)`, addresses read by `addr`.
    fn route_dump<A>(
        &mut self,
        family: i32,
        addr: fn(&[u8]) -> Option<A>,
    ) -> io::Result<Vec<RouteRow<A>>> {
        let mut rtmsg = [0u8; 12];
        rtmsg[0] = family as u8;
        let seq = self.send(RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP, &rtmsg)?;
        let mut out = Vec::new();
        self.recv_all(seq, |ty, p| {
            if ty != RTM_NEWROUTE || p.len() < 12 || p[0] != family as u8 || p[7] != RTN_UNICAST {
                return;
            }
            let mut table = u32::from(p[4]);
            let (mut dst, mut gw, mut oif) = (None, None, None);
            for (t, v) in attrs(&p[12..]) {
                match t {
                    RTA_DST => dst = addr(v),
                    RTA_GATEWAY => gw = addr(v),
                    RTA_OIF => oif = u32_ne(v),
                    RTA_TABLE => table = u32_ne(v).unwrap_or(table),
                    _ => {}
                }
            }
            if let (RT_TABLE_MAIN, Some(ifindex)) = (table, oif) {
                out.push((dst, p[1], gw, ifindex));
            }
        })?;
        Ok(out)
    }

    /// Usable IPv6 neighbour entries.
    pub fn neighbours6(&mut self) -> io::Result<Vec<Neighbour6>> {
        self.neighbour_dump(libc::AF_INET6, ipv6)
    }

    /// Usable IPv4 neighbour entries: `(ip, ifindex, mac, NUD state)`.
    pub fn neighbours(&mut self) -> io::Result<Vec<(u32, u32, MacAddr, u16)>> {
        self.neighbour_dump(libc::AF_INET, ipv4)
    }

    /// Usable neighbour entries of one family, addresses read by `addr`.
    fn neighbour_dump<A>(
        &mut self,
        family: i32,
        addr: fn(&[u8]) -> Option<A>,
    ) -> io::Result<Vec<(A, u32, MacAddr, u16)>> {
        let mut ndmsg = [0u8; 12];
        ndmsg[0] = family as u8;
        let seq = self.send(RTM_GETNEIGH, NLM_F_REQUEST | NLM_F_DUMP, &ndmsg)?;
        let mut out = Vec::new();
        self.recv_all(seq, |ty, p| {
            if ty != RTM_NEWNEIGH || p.len() < 12 || p[0] != family as u8 {
                return;
            }
            let ifindex = u32::from_ne_bytes([p[4], p[5], p[6], p[7]]);
            let state = u16::from_ne_bytes([p[8], p[9]]);
            if state & NUD_USABLE == 0 {
                return;
            }
            let (mut dst, mut mac) = (None, None);
            for (t, v) in attrs(&p[12..]) {
                match t {
                    NDA_DST => dst = addr(v),
                    NDA_LLADDR if v.len() == 6 => {
                        mac = Some(MacAddr([v[0], v[1], v[2], v[3], v[4], v[5]]))
                    }
                    _ => {}
                }
            }
            if let (Some(d), Some(m)) = (dst, mac) {
                out.push((d, ifindex, m, state));
            }
        })?;
        Ok(out)
    }

    /// Asks the kernel to resolve `ip` on `ifindex` (creates the entry if needed and
    /// "uses" it, which starts ARP).
    pub fn request_resolution(&mut self, ip: u32, ifindex: u32) -> io::Result<()> {
        self.use_neighbour(IpAddr::V4(Ipv4Addr::from(ip)), ifindex)
    }

    /// Asks the kernel to resolve a next hop of either family (ARP, or neighbour
    /// discovery for IPv6).
    pub fn use_neighbour(&mut self, ip: IpAddr, ifindex: u32) -> io::Result<()> {
        let (family, addr) = match ip {
            IpAddr::V4(a) => (libc::AF_INET, a.octets().to_vec()),
            IpAddr::V6(a) => (libc::AF_INET6, a.octets().to_vec()),
        };
        let mut p = vec![0u8; 16 + addr.len()];
        p[0] = family as u8;
        p[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        p[8..10].copy_from_slice(&0u16.to_ne_bytes()); // NUD_NONE
        p[10] = NTF_USE;
        p[12..14].copy_from_slice(&(4 + addr.len() as u16).to_ne_bytes());
        p[14..16].copy_from_slice(&NDA_DST.to_ne_bytes());
        p[16..].copy_from_slice(&addr);
        let seq = self.send(
            RTM_NEWNEIGH,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
            &p,
        )?;
        self.recv_all(seq, |_, _| {})
    }

    /// Removes the kernel's neighbour entry for `ip` on `ifindex` (an error if there is
    /// none). Used before re-resolving a backend address that just (re)appeared: a new
    /// Pod may reuse the address of a deleted one, and the old entry — still REACHABLE or
    /// STALE with the old Pod's MAC — would black-hole its traffic until it ages out.
    pub fn forget_neighbour(&mut self, ip: u32, ifindex: u32) -> io::Result<()> {
        let mut p = [0u8; 20];
        p[0] = libc::AF_INET as u8;
        p[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        p[12..14].copy_from_slice(&8u16.to_ne_bytes());
        p[14..16].copy_from_slice(&NDA_DST.to_ne_bytes());
        p[16..20].copy_from_slice(&ip.to_be_bytes());
        let seq = self.send(RTM_DELNEIGH, NLM_F_REQUEST | NLM_F_ACK, &p)?;
        self.recv_all(seq, |_, _| {})
    }

    /// A fresh [`Neighbours`] for these interfaces from the kernel's tables.
    pub fn snapshot(&mut self, uplink: Iface, pods: &[Iface]) -> io::Result<Neighbours> {
        let routes = self.routes()?;
        self.snapshot_with_routes(uplink, pods, &routes)
    }

    /// Like [`Netlink::snapshot`], with routes already read.
    pub fn snapshot_with_routes(
        &mut self,
        uplink: Iface,
        pods: &[Iface],
        routes: &[Route],
    ) -> io::Result<Neighbours> {
        let mut n = Neighbours::new(uplink, pods.to_vec());
        for r in routes {
            n.add_route(*r);
        }
        for (ip, ifindex, mac, _) in self.neighbours()? {
            if n.side_of(ifindex).is_some() {
                n.add_neighbour(ip, ifindex, mac);
            }
        }
        // IPv6 (issue #28): a kernel without IPv6 answers with an error; IPv4 goes on.
        match self.routes6().and_then(|r| Ok((r, self.neighbours6()?))) {
            Ok((routes6, neighbours6)) => {
                for r in routes6 {
                    n.add_route6(r);
                }
                for (ip, ifindex, mac, _) in neighbours6 {
                    if n.side_of(ifindex).is_some() {
                        n.add_neighbour6(ip, ifindex, mac);
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "reading IPv6 routes/neighbours failed"),
        }
        match self.xdp_frame_targets() {
            Ok(targets) => n.set_xdp_frame_targets(targets),
            // Older kernels have no `netdev` family: the XDP fast path stays off.
            Err(e) => {
                self.netdev = None; // opened again next time
                tracing::debug!(error = %e, "reading XDP features over netlink failed");
            }
        }
        Ok(n)
    }

    /// Keeps the neighbours the dataplane forwards to alive. Traffic forwarded with
    /// AF_XDP never confirms the kernel's entries, so they age to STALE and, on a busy
    /// table, get garbage-collected — costing a drop and a resolution on the next
    /// packet. This asks the kernel to re-probe (unicast ARP) every STALE entry on a Pod
    /// interface, and every STALE route gateway or `ahead` address (the redirect peers)
    /// on the uplink, at most `limit` of them. Returns how many were asked for.
    pub fn keep_alive(
        &mut self,
        uplink: Iface,
        pods: &[Iface],
        ahead: &[u32],
        limit: usize,
    ) -> io::Result<usize> {
        let ours =
            |ifindex: u32| ifindex == uplink.ifindex || pods.iter().any(|p| p.ifindex == ifindex);
        let gateways: std::collections::HashSet<(u32, u32)> = self
            .routes()?
            .into_iter()
            .filter(|r| ours(r.ifindex))
            .filter_map(|r| r.gateway.map(|g| (g, r.ifindex)))
            .collect();
        let stale: Vec<(u32, u32)> = self
            .neighbours()?
            .into_iter()
            .filter(|&(ip, ifindex, _, state)| {
                state == NUD_STALE
                    && ours(ifindex)
                    && (ifindex != uplink.ifindex
                        || gateways.contains(&(ip, ifindex))
                        || ahead.contains(&ip))
            })
            .map(|(ip, ifindex, _, _)| (ip, ifindex))
            .take(limit)
            .collect();
        for &(ip, ifindex) in &stale {
            self.request_resolution(ip, ifindex)?;
        }
        let stale6 = self
            .keep_alive6(&ours, uplink.ifindex, limit.saturating_sub(stale.len()))
            .unwrap_or_else(|e| {
                tracing::debug!(error = %e, "IPv6 neighbour keep-alive failed");
                0
            });
        Ok(stale.len() + stale6)
    }

    /// [`Netlink::keep_alive`] for IPv6: STALE neighbours on Pod interfaces and STALE
    /// route gateways on the uplink are probed again (neighbour discovery).
    fn keep_alive6(
        &mut self,
        ours: &dyn Fn(u32) -> bool,
        uplink: u32,
        limit: usize,
    ) -> io::Result<usize> {
        let gateways: std::collections::HashSet<([u8; 16], u32)> = self
            .routes6()?
            .into_iter()
            .filter(|r| ours(r.ifindex))
            .filter_map(|r| r.gateway.map(|g| (g.to_be_bytes(), r.ifindex)))
            .collect();
        let stale: Vec<([u8; 16], u32)> = self
            .neighbours6()?
            .into_iter()
            .filter(|&(ip, ifindex, _, state)| {
                state == NUD_STALE
                    && ours(ifindex)
                    && (ifindex != uplink || gateways.contains(&(ip, ifindex)))
            })
            .map(|(ip, ifindex, _, _)| (ip, ifindex))
            .take(limit)
            .collect();
        for &(ip, ifindex) in &stale {
            self.use_neighbour(std::net::Ipv6Addr::from(ip).into(), ifindex)?;
        }
        Ok(stale.len())
    }
}

impl Netlink {
    /// The interfaces (ifindexes) of this namespace that take frames an XDP program
    /// redirects to them (`xdp-features` has `ndo-xmit`), from the `netdev`
    /// generic-netlink family (Linux >= 6.3).
    pub fn xdp_frame_targets(&mut self) -> io::Result<Vec<u32>> {
        if self.netdev.is_none() {
            let mut nl = Netlink::open_protocol(libc::NETLINK_GENERIC)?;
            let family = genl_family(&mut nl, "netdev")?;
            self.netdev = Some(Box::new((nl, family)));
        }
        let Some(netdev) = self.netdev.as_mut() else {
            return Ok(Vec::new());
        };
        let (nl, family) = &mut **netdev;
        let seq = nl.send(
            *family,
            NLM_F_REQUEST | NLM_F_DUMP,
            &[NETDEV_CMD_DEV_GET, 1, 0, 0],
        )?;
        let mut out = Vec::new();
        nl.recv_all(seq, |_, payload| {
            let (mut ifindex, mut features) = (None, 0u64);
            for (ty, v) in attrs(payload.get(4..).unwrap_or_default()) {
                match ty {
                    NETDEV_A_DEV_IFINDEX if v.len() == 4 => {
                        ifindex = Some(u32::from_ne_bytes([v[0], v[1], v[2], v[3]]));
                    }
                    NETDEV_A_DEV_XDP_FEATURES if v.len() == 8 => {
                        features = u64::from_ne_bytes(v.try_into().unwrap_or_default());
                    }
                    _ => {}
                }
            }
            if let Some(i) = ifindex.filter(|_| features & NETDEV_XDP_ACT_NDO_XMIT != 0) {
                out.push(i);
            }
        })?;
        Ok(out)
    }
}

/// The id of generic-netlink family `name`.
fn genl_family(nl: &mut Netlink, name: &str) -> io::Result<u16> {
    let mut msg = vec![CTRL_CMD_GETFAMILY, 1, 0, 0];
    let attr_len = 4 + name.len() + 1;
    msg.extend_from_slice(&(attr_len as u16).to_ne_bytes());
    msg.extend_from_slice(&CTRL_ATTR_FAMILY_NAME.to_ne_bytes());
    msg.extend_from_slice(name.as_bytes());
    msg.push(0);
    msg.resize((msg.len() + 3) & !3, 0);
    let seq = nl.send(GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK, &msg)?;
    let mut id = None;
    nl.recv_all(seq, |_, payload| {
        for (ty, v) in attrs(payload.get(4..).unwrap_or_default()) {
            if ty == CTRL_ATTR_FAMILY_ID && v.len() == 2 {
                id = Some(u16::from_ne_bytes([v[0], v[1]]));
            }
        }
    })?;
    id.ok_or_else(|| io::Error::other(format!("no generic netlink family {name}")))
}

/// The interface each backend address is routed out of, by longest-prefix match over
/// the main table's `routes` (what `ip route get` answers for it), skipping the uplink and
/// loopback: the Pod-facing interfaces of these backends, each once, in first-seen order.
pub fn pod_ifindexes_of(routes: &[Route], backends: &[u32], uplink: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &ip in backends {
        let best = routes
            .iter()
            .filter(|r| {
                let m = if r.len == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(r.len.min(32)))
                };
                ip & m == r.prefix & m
            })
            .max_by_key(|r| r.len);
        if let Some(r) = best {
            if r.ifindex != uplink && r.ifindex != 1 && !out.contains(&r.ifindex) {
                out.push(r.ifindex);
            }
        }
    }
    out
}

/// An interface's name by index.
pub fn iface_name(ifindex: u32) -> io::Result<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has room for IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success if_indextoname wrote a NUL-terminated name into `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// Where the Pod-facing interfaces come from.
#[derive(Debug, Clone)]
pub struct PodSource {
    /// Interfaces named on the command line (always served).
    pub explicit: Vec<Iface>,
    /// When set, the backend addresses of the current service table (written by the
    /// forwarding loop on every generation change): the interfaces the kernel routes
    /// them out of are served too.
    pub from_routes: Option<Arc<ArcSwap<Vec<u32>>>>,
}

impl PodSource {
    /// The Pod interfaces for these routes: the explicit ones, then those discovered.
    pub fn resolve(&self, uplink: Iface, routes: &[Route]) -> Vec<Iface> {
        let mut pods = self.explicit.clone();
        if let Some(b) = &self.from_routes {
            let backends = b.load_full();
            for ifindex in pod_ifindexes_of(routes, &backends, uplink.ifindex) {
                if pods.iter().any(|p| p.ifindex == ifindex) {
                    continue;
                }
                // The interface may vanish between the dump and this look-up: skip it
                // this round.
                if let Ok(i) = iface_name(ifindex).and_then(|n| iface(&n)) {
                    if i.ifindex == ifindex {
                        pods.push(i);
                    }
                }
            }
        }
        pods
    }
}

/// An interface's index and MAC address, by name.
pub fn iface(name: &str) -> io::Result<Iface> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "bad name"))?;
    // SAFETY: `c` is a valid NUL-terminated string.
    let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if ifindex == 0 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no interface named {name}"),
        ));
    }
    let text = std::fs::read_to_string(format!("/sys/class/net/{name}/address"))?;
    let mut mac = [0u8; 6];
    let parts: Vec<_> = text.trim().split(':').collect();
    if parts.len() != 6 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{name}: MAC {text:?}"),
        ));
    }
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidData, format!("{name}: MAC {text:?}"))
        })?;
    }
    Ok(Iface {
        ifindex,
        mac: MacAddr(mac),
    })
}

/// Backends waiting to be re-resolved; more than this many new backends in one table
/// change are re-resolved on their first miss instead.
const REVERIFY_QUEUE: usize = 4096;

/// The neighbour table shared between the resolver thread and the forwarding loop: the
/// resolver swaps the whole table in (lock-free, `ArcSwap`); the loop checks `version`
/// once per batch and loads the new `Arc` only when it changed. Neither side ever waits.
#[derive(Debug)]
pub struct SharedNeighbours {
    version: AtomicU64,
    table: ArcSwap<Neighbours>,
    /// Resolution requests sent to the kernel.
    pub requests: AtomicU64,
    /// Backend next hops that just appeared in the service table: their kernel entries
    /// are dropped and re-resolved (see [`Netlink::forget_neighbour`]). Filled by the
    /// forwarding loop (then it wakes the resolver), drained by the resolver.
    /// A bounded lock-free queue: the forwarding loop never waits on the resolver.
    pub reverify: ArrayQueue<(u32, u32)>,
    /// Entries taken off `reverify` so far, each dropped and re-requested before this
    /// counts it (the queue is FIFO: a pusher knows when its entries were handled).
    pub reverified: AtomicU64,
    /// Addresses whose next hop is kept resolved ahead of any packet to them: the other
    /// nodes this one redirects packets to. A first redirect to a node whose
    /// MAC is not known yet would be dropped as `no_neighbour` — right when an ECMP
    /// change moves connections, so each cost its client a retransmission. Written by the
    /// forwarding loop on a table change; the resolver requests any that is missing on
    /// every pass (at least once per `period`).
    ahead: ArcSwap<Vec<u32>>,
}

impl SharedNeighbours {
    /// Starts with `n`.
    pub fn new(n: Neighbours) -> Self {
        SharedNeighbours {
            version: AtomicU64::new(1),
            table: ArcSwap::from_pointee(n),
            requests: AtomicU64::new(0),
            reverify: ArrayQueue::new(REVERIFY_QUEUE),
            reverified: AtomicU64::new(0),
            ahead: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// Sets the addresses kept resolved ahead of traffic (sorted, deduplicated by the
    /// caller); returns whether they changed.
    pub fn set_ahead(&self, ips: Vec<u32>) -> bool {
        if **self.ahead.load() == ips {
            return false;
        }
        self.ahead.store(Arc::new(ips));
        true
    }

    /// The next hops of [`Self::set_ahead`]'s addresses that the current table cannot
    /// resolve yet.
    pub fn ahead_misses(&self) -> Vec<(u32, u32)> {
        let nb = self.get();
        self.ahead
            .load()
            .iter()
            .filter_map(|ip| match nb.resolve(*ip) {
                Resolve::Miss { ip, ifindex } => Some((ip, ifindex)),
                _ => None,
            })
            .collect()
    }

    /// The current version (one atomic load).
    #[inline]
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// The current table.
    pub fn get(&self) -> Arc<Neighbours> {
        self.table.load_full()
    }

    fn set(&self, n: Neighbours) {
        self.table.store(Arc::new(n));
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}

/// Waits between the re-reads of the kernel's tables after resolution requests, until
/// every next hop asked for has an entry: quickly at first (an answer takes
/// milliseconds), then every 250 ms for as long as the kernel itself tries (three
/// solicitations a second apart; about 2.9 s in all). Stopping at 400 ms, as this once
/// did, left an entry the kernel found on its second try unseen until the next packet's
/// miss — that packet dropped, a client's retransmitted SYN among them.
const REREAD_MS: [u64; 17] = [
    2, 5, 10, 20, 50, 100, 200, 250, 250, 250, 250, 250, 250, 250, 250, 250, 250,
];

/// Runs the resolver until `stop` is set: refreshes the table every `period`; when a
/// miss arrives on `misses`, asks the kernel to resolve it and re-reads the table on the
/// [`REREAD_MS`] schedule until every entry asked for appears — also for any address kept
/// resolved ahead ([`SharedNeighbours::set_ahead`]) that has no entry; every `keepalive`,
/// re-probes stale entries the dataplane depends on ([`Netlink::keep_alive`]).
#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename them
pub fn run_resolver(
    mut nl: Netlink,
    uplink: Iface,
    pods: PodSource,
    shared: Arc<SharedNeighbours>,
    misses: Receiver<Miss>,
    stop: Arc<AtomicBool>,
    period: Duration,
    keepalive: Duration,
) {
    let mut last_keepalive = Instant::now();
    let mut last_request: std::collections::HashMap<Miss, Instant> = Default::default();
    let mut current: Vec<Iface> = pods.explicit.clone();
    let refresh = |nl: &mut Netlink, current: &mut Vec<Iface>| {
        let r = nl.routes().and_then(|routes| {
            *current = pods.resolve(uplink, &routes);
            nl.snapshot_with_routes(uplink, current, &routes)
        });
        match r {
            Ok(n) => shared.set(n),
            Err(e) => tracing::warn!(error = %e, "reading routes/neighbours over netlink failed"),
        }
    };
    // A request that arrived while waiting for an answer: handled at once.
    let mut carried: Option<Miss> = None;
    // Position in the re-read schedule after requests (`REREAD_MS.len()`: none running).
    let mut reread = REREAD_MS.len();
    // The next hops asked for that the table read last had no entry for.
    let mut awaiting: Vec<Miss> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let first = match carried.take() {
            Some(m) => Ok(m),
            None => misses.recv_timeout(period),
        };
        let pending: Vec<Miss> = match first {
            Ok(first) => std::iter::once(first).chain(misses.try_iter()).collect(),
            // Also in case a wake-up was lost (full channel).
            Err(RecvTimeoutError::Timeout) => Vec::new(),
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let now = Instant::now();
        last_request.retain(|_, t| now.duration_since(*t) < Duration::from_secs(1));
        let mut asked = false;
        for (ip, ifindex) in reverify_new_backends(&mut nl, &shared) {
            asked = true;
            last_request.insert((IpAddr::V4(Ipv4Addr::from(ip)), ifindex), now);
            awaiting.push((IpAddr::V4(Ipv4Addr::from(ip)), ifindex));
        }
        let ahead = shared
            .ahead_misses()
            .into_iter()
            .map(|(ip, ifindex)| (IpAddr::V4(Ipv4Addr::from(ip)), ifindex));
        for (ip, ifindex) in pending.into_iter().chain(ahead) {
            // `REFRESH` only asks for a refresh (the backend set changed).
            if (ip, ifindex) == REFRESH {
                continue;
            }
            // At most one request per next hop per second.
            if last_request.contains_key(&(ip, ifindex)) {
                continue;
            }
            last_request.insert((ip, ifindex), now);
            shared.requests.fetch_add(1, Ordering::Relaxed);
            asked = true;
            awaiting.push((ip, ifindex));
            tracing::debug!(next_hop = %ip, ifindex, "resolving neighbour");
            if let Err(e) = nl.use_neighbour(ip, ifindex) {
                tracing::warn!(next_hop = %ip, error = %e, "neighbour resolution request failed");
            }
        }
        if asked {
            reread = 0;
        }
        if reread < REREAD_MS.len() {
            // Re-read until the answers are in. A new request (a miss, or new backends
            // to re-resolve) is taken at once, so one that never gets an answer (a
            // neighbour that is down) delays no other; the re-reads resume after it.
            while reread < REREAD_MS.len() {
                let next = misses.recv_timeout(Duration::from_millis(REREAD_MS[reread]));
                refresh(&mut nl, &mut current);
                reread += 1;
                let table = shared.get();
                awaiting.retain(|&(ip, ifindex)| !table.has_neighbour(ip, ifindex));
                if awaiting.is_empty() {
                    reread = REREAD_MS.len();
                } else if reread == REREAD_MS.len() {
                    awaiting.clear(); // the kernel gave up too: the next miss asks again
                }
                match next {
                    Ok(m) => {
                        carried = Some(m);
                        break;
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        } else {
            refresh(&mut nl, &mut current);
        }
        if last_keepalive.elapsed() >= keepalive {
            last_keepalive = Instant::now();
            let ahead = shared.ahead.load_full();
            match nl.keep_alive(uplink, &current, &ahead, 1024) {
                Ok(n) if n > 0 => tracing::debug!(count = n, "re-probing stale neighbours"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "neighbour keep-alive failed"),
            }
        }
    }
}

/// Drops and re-resolves the kernel entries of backends new to the service table
/// ([`SharedNeighbours::reverify`]); returns the next hops asked for.
fn reverify_new_backends(nl: &mut Netlink, shared: &SharedNeighbours) -> Vec<(u32, u32)> {
    let list: Vec<(u32, u32)> = std::iter::from_fn(|| shared.reverify.pop()).collect();
    for &(ip, ifindex) in &list {
        // No entry is fine: there is nothing stale to forget.
        let _ = nl.forget_neighbour(ip, ifindex);
        shared.requests.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(backend = %Ipv4Addr::from(ip), ifindex, "re-resolving a new backend");
        if let Err(e) = nl.request_resolution(ip, ifindex) {
            tracing::warn!(backend = %Ipv4Addr::from(ip), error = %e, "neighbour resolution request failed");
        }
        shared.reverified.fetch_add(1, Ordering::Release);
    }
    list
}

/// A route as the kernel dumps it: destination (none: the default route), prefix
/// length, gateway, interface.
type RouteRow<A> = (Option<A>, u8, Option<A>, u32);

/// An IPv6 neighbour entry: address, interface, MAC, NUD state.
pub type Neighbour6 = ([u8; 16], u32, MacAddr, u16);

/// A next hop to resolve: its address (IPv4 or IPv6) and interface.
pub type Miss = (IpAddr, u32);

/// Not a next hop: asks the resolver to re-read the tables (the backend set changed).
pub const REFRESH: Miss = (IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);

/// An IPv4 next hop as a [`Miss`].
pub fn miss4(ip: u32, ifindex: u32) -> Miss {
    (IpAddr::V4(Ipv4Addr::from(ip)), ifindex)
}

/// A sender for misses that never blocks the packet path (drops requests when full).
pub type MissSender = SyncSender<Miss>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_map_to_the_interface_of_their_longest_prefix_route() {
        let ip = |a: [u8; 4]| u32::from_be_bytes(a);
        let r = |p: [u8; 4], len: u8, ifindex: u32| Route {
            prefix: ip(p),
            len,
            gateway: None,
            ifindex,
        };
        let routes = [
            r([0, 0, 0, 0], 0, 2),    // default via the uplink
            r([10, 1, 0, 0], 16, 9),  // a Pod CIDR on a bridge-like device
            r([10, 1, 0, 5], 32, 11), // Calico-style /32 on a per-Pod veth
            r([10, 1, 0, 6], 32, 12),
            r([127, 0, 0, 0], 8, 1), // loopback
        ];
        let got = pod_ifindexes_of(
            &routes,
            &[
                ip([10, 1, 0, 5]),
                ip([10, 1, 0, 6]),
                ip([10, 1, 0, 5]),
                ip([10, 1, 7, 7]),
                ip([192, 0, 2, 1]),
                ip([127, 0, 0, 9]),
            ],
            2,
        );
        assert_eq!(
            got,
            vec![11, 12, 9],
            "per-Pod veths, the /16 device, not uplink or lo"
        );
        assert!(pod_ifindexes_of(&[], &[ip([10, 1, 0, 5])], 2).is_empty());
    }

    #[test]
    fn attr_parser_handles_padding_and_garbage() {
        let mut b = Vec::new();
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&1u16.to_ne_bytes());
        b.extend_from_slice(&[10, 0, 0, 1]);
        b.extend_from_slice(&5u16.to_ne_bytes());
        b.extend_from_slice(&2u16.to_ne_bytes());
        b.extend_from_slice(&[7, 0, 0, 0]);
        b.extend_from_slice(&[0xff, 0xff]); // truncated trailing attribute
        let v: Vec<_> = attrs(&b).collect();
        assert_eq!(v, vec![(1, &[10u8, 0, 0, 1][..]), (2, &[7u8][..])]);
    }

    #[test]
    fn reads_loopback_routes_in_this_namespace() {
        // Every namespace has at least the local table; the main table may be empty, so
        // only check that a dump round-trips without error.
        let mut nl = Netlink::open().expect("netlink socket");
        nl.routes().expect("route dump");
        nl.neighbours().expect("neighbour dump");
        nl.routes6().expect("IPv6 route dump");
        nl.neighbours6().expect("IPv6 neighbour dump");
        let lo = iface("lo").expect("lo");
        assert_eq!(lo.mac, MacAddr([0; 6]));
    }
}
