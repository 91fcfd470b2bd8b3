//! Where to send a packet next: routes and neighbour MACs of the dataplane's interfaces.
//!
//! A [`Neighbours`] is an immutable copy of the kernel's routes (on the uplink and Pod
//! interfaces) and neighbour entries, built off the packet path by the netlink resolver
//! (`crate::netlink`) and swapped in between batches. The packet path only reads it: a
//! host-route map, a short longest-prefix list, and a neighbour map — no syscalls, no
//! locks. A miss is reported as [`Resolve::Miss`] with the next-hop address, which the
//! I/O loop hands to the resolver so the kernel starts ARP for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::packet::MacAddr;
use crate::services::FastBuild;

/// One of the dataplane's interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Iface {
    /// Kernel interface index.
    pub ifindex: u32,
    /// Its MAC address (the source MAC of frames it sends).
    pub mac: MacAddr,
}

/// Which interface: the uplink or the n-th Pod-facing interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The node's uplink.
    Uplink,
    /// The n-th `--pod-iface`.
    Pod(u16),
}

/// An IPv4 route on one of the dataplane's interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// Destination prefix (host order).
    pub prefix: u32,
    /// Prefix length.
    pub len: u8,
    /// Gateway, `None` for a directly connected destination.
    pub gateway: Option<u32>,
    /// Outgoing interface.
    pub ifindex: u32,
}

/// An IPv6 route on one of the dataplane's interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route6 {
    /// Destination prefix.
    pub prefix: u128,
    /// Prefix length.
    pub len: u8,
    /// Gateway (often link-local), `None` for a directly connected destination.
    pub gateway: Option<u128>,
    /// Outgoing interface.
    pub ifindex: u32,
}

/// The outcome of an IPv6 next-hop lookup (neighbour discovery stands for ARP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve6 {
    /// Send out of `side`, from `src`, to `dst`.
    Found {
        /// Egress interface.
        side: Side,
        /// Source MAC (the egress interface's).
        src: MacAddr,
        /// Destination MAC (the next hop's).
        dst: MacAddr,
    },
    /// The next hop `ip` on `ifindex` has no usable neighbour entry yet.
    Miss {
        /// Next-hop address.
        ip: [u8; 16],
        /// Interface to resolve it on.
        ifindex: u32,
    },
    /// No route out of any of the dataplane's interfaces.
    NoRoute,
}

/// The outcome of a next-hop lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve {
    /// Send out of `side`, from `src`, to `dst`.
    Found {
        /// Egress interface.
        side: Side,
        /// Source MAC (the egress interface's).
        src: MacAddr,
        /// Destination MAC (the next hop's).
        dst: MacAddr,
    },
    /// The next hop `ip` on `ifindex` has no usable neighbour entry yet.
    Miss {
        /// Next-hop address.
        ip: u32,
        /// Interface to resolve it on.
        ifindex: u32,
    },
    /// No route out of any of the dataplane's interfaces.
    NoRoute,
}

/// Routes and neighbours of the dataplane's interfaces.
#[derive(Debug, Clone)]
pub struct Neighbours {
    uplink: Iface,
    pods: Vec<Iface>,
    host_routes: HashMap<u32, Route, FastBuild>,
    prefix_routes: Vec<Route>,
    entries: HashMap<u64, MacAddr, FastBuild>,
    /// IPv6 routes on our interfaces, longest prefix first.
    routes6: Vec<Route6>,
    /// IPv6 neighbours by (address, ifindex).
    entries6: HashMap<([u8; 16], u32), MacAddr, FastBuild>,
    /// Interfaces that take frames an XDP program redirects to them (sorted).
    xdp_frame_targets: Vec<u32>,
    /// Changes whenever the content changes (unique per process), so the engine can
    /// tell with one comparison whether what it derived from this table is still valid.
    stamp: u64,
}

fn next_stamp() -> u64 {
    static STAMP: AtomicU64 = AtomicU64::new(1);
    STAMP.fetch_add(1, Ordering::Relaxed)
}

fn neigh_key(ip: u32, ifindex: u32) -> u64 {
    (u64::from(ifindex) << 32) | u64::from(ip)
}

fn mask6(len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(len.min(128)))
    }
}

fn mask(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len.min(32)))
    }
}

impl Neighbours {
    /// An empty table for these interfaces.
    pub fn new(uplink: Iface, pods: Vec<Iface>) -> Self {
        Neighbours {
            uplink,
            pods,
            host_routes: HashMap::default(),
            prefix_routes: Vec::new(),
            entries: HashMap::default(),
            routes6: Vec::new(),
            entries6: HashMap::default(),
            xdp_frame_targets: Vec::new(),
            stamp: next_stamp(),
        }
    }

    /// Adds an IPv6 route (routes on other interfaces are ignored).
    pub fn add_route6(&mut self, r: Route6) {
        if self.side_of(r.ifindex).is_none() {
            return;
        }
        self.stamp = next_stamp();
        self.routes6.push(Route6 {
            prefix: r.prefix & mask6(r.len),
            ..r
        });
        self.routes6.sort_by_key(|r| std::cmp::Reverse(r.len));
    }

    /// Adds an IPv6 neighbour entry.
    pub fn add_neighbour6(&mut self, ip: [u8; 16], ifindex: u32, mac: MacAddr) {
        self.stamp = next_stamp();
        self.entries6.insert((ip, ifindex), mac);
    }

    /// Longest-prefix match over our interfaces' IPv6 routes.
    pub fn route6(&self, dst: [u8; 16]) -> Option<Route6> {
        let d = u128::from_be_bytes(dst);
        self.routes6
            .iter()
            .find(|r| d & mask6(r.len) == r.prefix)
            .copied()
    }

    /// Where an IPv6 packet to `dst` goes next.
    pub fn resolve6(&self, dst: [u8; 16]) -> Resolve6 {
        let Some(r) = self.route6(dst) else {
            return Resolve6::NoRoute;
        };
        let Some((side, src)) = self.side_of(r.ifindex) else {
            return Resolve6::NoRoute;
        };
        let nh = r.gateway.map_or(dst, u128::to_be_bytes);
        match self.entries6.get(&(nh, r.ifindex)) {
            Some(&mac) => Resolve6::Found {
                side,
                src,
                dst: mac,
            },
            None => Resolve6::Miss {
                ip: nh,
                ifindex: r.ifindex,
            },
        }
    }

    /// Sets the interfaces that take XDP-redirected frames (`xdp-features` `ndo-xmit`).
    pub fn set_xdp_frame_targets(&mut self, mut ifindexes: Vec<u32>) {
        ifindexes.sort_unstable();
        ifindexes.dedup();
        self.stamp = next_stamp();
        self.xdp_frame_targets = ifindexes;
    }

    /// Whether the XDP program may redirect frames to `ifindex` (a veth only while its
    /// peer runs XDP or has GRO on: otherwise the kernel drops them).
    pub fn takes_xdp_frames(&self, ifindex: u32) -> bool {
        self.xdp_frame_targets.binary_search(&ifindex).is_ok()
    }

    /// Identifies this content: equal stamps mean equal tables.
    #[inline]
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    /// The uplink.
    pub fn uplink(&self) -> Iface {
        self.uplink
    }

    /// The Pod-facing interfaces, in `--pod-iface` order.
    pub fn pods(&self) -> &[Iface] {
        &self.pods
    }

    /// Whether `ifindex` is one of ours.
    pub fn side_of(&self, ifindex: u32) -> Option<(Side, MacAddr)> {
        if ifindex == self.uplink.ifindex {
            return Some((Side::Uplink, self.uplink.mac));
        }
        self.pods
            .iter()
            .position(|p| p.ifindex == ifindex)
            .map(|i| (Side::Pod(i as u16), self.pods[i].mac))
    }

    /// Adds a route (routes on other interfaces are ignored).
    pub fn add_route(&mut self, r: Route) {
        if self.side_of(r.ifindex).is_none() {
            return;
        }
        self.stamp = next_stamp();
        let r = Route {
            prefix: r.prefix & mask(r.len),
            ..r
        };
        if r.len == 32 {
            self.host_routes.insert(r.prefix, r);
        } else {
            self.prefix_routes.push(r);
            self.prefix_routes.sort_by_key(|r| std::cmp::Reverse(r.len));
        }
    }

    /// Adds a neighbour entry.
    pub fn add_neighbour(&mut self, ip: u32, ifindex: u32, mac: MacAddr) {
        self.stamp = next_stamp();
        self.entries.insert(neigh_key(ip, ifindex), mac);
    }

    /// Whether the next hop `ip` on `ifindex` has an entry (either family).
    pub fn has_neighbour(&self, ip: std::net::IpAddr, ifindex: u32) -> bool {
        match ip {
            std::net::IpAddr::V4(a) => self.entries.contains_key(&neigh_key(a.into(), ifindex)),
            std::net::IpAddr::V6(a) => self.entries6.contains_key(&(a.octets(), ifindex)),
        }
    }

    /// Number of neighbour entries.
    pub fn neighbour_count(&self) -> usize {
        self.entries.len()
    }

    /// Longest-prefix match over our interfaces' routes.
    #[inline]
    pub fn route(&self, dst: u32) -> Option<Route> {
        if let Some(r) = self.host_routes.get(&dst) {
            return Some(*r);
        }
        self.prefix_routes
            .iter()
            .find(|r| dst & mask(r.len) == r.prefix)
            .copied()
    }

    /// Where a packet to `dst` goes next.
    #[inline]
    pub fn resolve(&self, dst: u32) -> Resolve {
        let Some(r) = self.route(dst) else {
            return Resolve::NoRoute;
        };
        let Some((side, src)) = self.side_of(r.ifindex) else {
            return Resolve::NoRoute;
        };
        let nh = r.gateway.unwrap_or(dst);
        match self.entries.get(&neigh_key(nh, r.ifindex)) {
            Some(&mac) => Resolve::Found {
                side,
                src,
                dst: mac,
            },
            None => Resolve::Miss {
                ip: nh,
                ifindex: r.ifindex,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_longest_prefix_then_neighbour_with_a_link_local_gateway() {
        let up = Iface {
            ifindex: 2,
            mac: MacAddr([0xa; 6]),
        };
        let p0 = Iface {
            ifindex: 5,
            mac: MacAddr([0xb; 6]),
        };
        let a = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap();
        let mut n = Neighbours::new(up, vec![p0]);
        let gw = u128::from(a("fe80::1"));
        n.add_route6(Route6 {
            prefix: 0,
            len: 0,
            gateway: Some(gw),
            ifindex: 2,
        });
        n.add_route6(Route6 {
            prefix: u128::from(a("fd00:10:1::5")),
            len: 64, // host bits are masked off
            gateway: None,
            ifindex: 5,
        });
        n.add_route6(Route6 {
            prefix: 0,
            len: 0,
            gateway: None,
            ifindex: 99,
        }); // not ours
        let pod = a("fd00:10:1::7").octets();
        assert_eq!(
            n.resolve6(pod),
            Resolve6::Miss {
                ip: pod,
                ifindex: 5
            }
        );
        n.add_neighbour6(pod, 5, MacAddr([7; 6]));
        assert_eq!(
            n.resolve6(pod),
            Resolve6::Found {
                side: Side::Pod(0),
                src: MacAddr([0xb; 6]),
                dst: MacAddr([7; 6])
            }
        );
        let client = a("2001:db8::9").octets();
        assert_eq!(
            n.resolve6(client),
            Resolve6::Miss {
                ip: gw.to_be_bytes(),
                ifindex: 2
            }
        );
        n.add_neighbour6(gw.to_be_bytes(), 2, MacAddr([1; 6]));
        assert!(matches!(
            n.resolve6(client),
            Resolve6::Found {
                side: Side::Uplink,
                ..
            }
        ));
        assert_eq!(
            Neighbours::new(up, vec![]).resolve6(client),
            Resolve6::NoRoute
        );
    }

    fn ip(a: [u8; 4]) -> u32 {
        u32::from_be_bytes(a)
    }

    #[test]
    fn longest_prefix_then_neighbour() {
        let up = Iface {
            ifindex: 2,
            mac: MacAddr([0xa; 6]),
        };
        let p0 = Iface {
            ifindex: 5,
            mac: MacAddr([0xb; 6]),
        };
        let mut n = Neighbours::new(up, vec![p0]);
        n.add_route(Route {
            prefix: 0,
            len: 0,
            gateway: Some(ip([192, 0, 2, 254])),
            ifindex: 2,
        });
        n.add_route(Route {
            prefix: ip([192, 0, 2, 0]),
            len: 24,
            gateway: None,
            ifindex: 2,
        });
        n.add_route(Route {
            prefix: ip([10, 1, 0, 5]),
            len: 32,
            gateway: None,
            ifindex: 5,
        });
        n.add_route(Route {
            prefix: ip([10, 9, 0, 0]),
            len: 16,
            gateway: None,
            ifindex: 77,
        }); // not ours
        assert_eq!(
            n.resolve(ip([10, 9, 1, 1])),
            Resolve::Miss {
                ip: ip([192, 0, 2, 254]),
                ifindex: 2
            }
        );
        n.add_neighbour(ip([192, 0, 2, 254]), 2, MacAddr([1; 6]));
        n.add_neighbour(ip([192, 0, 2, 7]), 2, MacAddr([7; 6]));
        n.add_neighbour(ip([10, 1, 0, 5]), 5, MacAddr([5; 6]));
        assert_eq!(
            n.resolve(ip([198, 51, 100, 1])),
            Resolve::Found {
                side: Side::Uplink,
                src: up.mac,
                dst: MacAddr([1; 6])
            }
        );
        assert_eq!(
            n.resolve(ip([192, 0, 2, 7])),
            Resolve::Found {
                side: Side::Uplink,
                src: up.mac,
                dst: MacAddr([7; 6])
            }
        );
        assert_eq!(
            n.resolve(ip([10, 1, 0, 5])),
            Resolve::Found {
                side: Side::Pod(0),
                src: p0.mac,
                dst: MacAddr([5; 6])
            }
        );
        assert_eq!(
            n.resolve(ip([192, 0, 2, 8])),
            Resolve::Miss {
                ip: ip([192, 0, 2, 8]),
                ifindex: 2
            }
        );
        let mut bare = Neighbours::new(up, vec![]);
        bare.add_route(Route {
            prefix: ip([10, 0, 0, 0]),
            len: 8,
            gateway: None,
            ifindex: 2,
        });
        assert_eq!(bare.resolve(ip([11, 0, 0, 1])), Resolve::NoRoute);
    }
}
