//! The IPv6 next hop of a session: this node's IPv6 addresses on the interface that
//! carries the session (the one holding the session's local address).
//!
//! Global: the session's own address if it is a global IPv6 one, else the first global
//! (or unique-local) IPv6 address of that interface. Link-local: only on sessions over
//! IPv6 (RFC 2545 §3: the peer is on the link), the session's own address if it is
//! link-local, else the interface's. A session whose interface has no global IPv6
//! address has no IPv6 next hop, and sends no IPv6 route (counted in the status).

use std::net::{IpAddr, Ipv6Addr};

use crate::rib::Ipv6NextHop;

/// Whether `a` is in `fe80::/10`.
pub fn is_link_local(a: Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

fn usable_global(a: Ipv6Addr) -> bool {
    !a.is_loopback() && !a.is_unspecified() && !a.is_multicast() && !is_link_local(a)
}

/// The next hop for a session whose local address is `local`, from the node's
/// interface addresses `(interface, address)`.
pub fn pick(addrs: &[(String, IpAddr)], local: IpAddr) -> Option<Ipv6NextHop> {
    let iface = addrs.iter().find(|(_, a)| *a == local).map(|(i, _)| i)?;
    let on_link = || {
        addrs.iter().filter_map(move |(i, a)| match a {
            IpAddr::V6(v6) if i == iface => Some(*v6),
            _ => None,
        })
    };
    let global = match local {
        IpAddr::V6(l) if usable_global(l) => Some(l),
        _ => on_link().find(|a| usable_global(*a)),
    }?;
    let link_local = match local {
        IpAddr::V4(_) => None,
        IpAddr::V6(l) if is_link_local(l) => Some(l),
        IpAddr::V6(_) => on_link().find(|a| is_link_local(*a)),
    };
    Some(Ipv6NextHop { global, link_local })
}

/// The node's interface addresses, from `getifaddrs(3)`.
pub fn interface_addresses() -> Vec<(String, IpAddr)> {
    let Ok(list) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    list.filter_map(|ifa| {
        let a = ifa.address?;
        let ip = if let Some(v4) = a.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else {
            IpAddr::V6(a.as_sockaddr_in6()?.ip())
        };
        Some((ifa.interface_name, ip))
    })
    .collect()
}

/// The IPv6 next hop of a session whose local address is `local`, looked up on this
/// node's interfaces.
pub fn for_session(local: IpAddr) -> Option<Ipv6NextHop> {
    pick(&interface_addresses(), local)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs() -> Vec<(String, IpAddr)> {
        [
            ("lo", "127.0.0.1"),
            ("lo", "::1"),
            ("eth0", "10.0.0.2"),
            ("eth0", "fe80::2"),
            ("eth0", "2001:db8::2"),
            ("eth1", "10.0.1.2"),
            ("eth1", "fe80::12"),
        ]
        .iter()
        .map(|(i, a)| (i.to_string(), a.parse().unwrap()))
        .collect()
    }

    #[test]
    fn ipv4_session_uses_the_global_address_of_its_interface_without_link_local() {
        let nh = pick(&addrs(), "10.0.0.2".parse().unwrap()).unwrap();
        assert_eq!(nh.global, "2001:db8::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(nh.link_local, None);
    }

    #[test]
    fn ipv6_session_adds_the_link_local_address() {
        let nh = pick(&addrs(), "2001:db8::2".parse().unwrap()).unwrap();
        assert_eq!(nh.global, "2001:db8::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(nh.link_local, Some("fe80::2".parse().unwrap()));
        let nh = pick(&addrs(), "fe80::2".parse().unwrap()).unwrap();
        assert_eq!(nh.global, "2001:db8::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(nh.link_local, Some("fe80::2".parse().unwrap()));
    }

    #[test]
    fn no_global_address_on_the_link_means_no_ipv6_next_hop() {
        assert_eq!(pick(&addrs(), "10.0.1.2".parse().unwrap()), None);
        assert_eq!(pick(&addrs(), "192.0.2.9".parse().unwrap()), None);
    }

    #[test]
    fn loopback_is_read_from_the_kernel() {
        let all = interface_addresses();
        assert!(
            all.iter().any(|(_, a)| *a == IpAddr::from([127, 0, 0, 1])),
            "{all:?}"
        );
    }
}
