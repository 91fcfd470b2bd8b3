//! Socket options BGP needs that no maintained crate wraps: TCP-MD5 (RFC 2385) and the
//! outgoing TTL (IPv4) or hop limit (IPv6) for eBGP (multihop). Both families.

use std::io;
use std::net::IpAddr;
use std::os::fd::RawFd;

/// Longest TCP-MD5 key the kernel takes (`TCP_MD5SIG_MAXKEYLEN`).
pub const MD5_MAX_KEY: usize = 80;

/// `struct tcp_md5sig` from `<linux/tcp.h>`.
#[repr(C)]
struct TcpMd5Sig {
    addr: libc::sockaddr_storage,
    flags: u8,
    prefixlen: u8,
    keylen: u16,
    ifindex: libc::c_int,
    key: [u8; MD5_MAX_KEY],
}

const _: () = assert!(std::mem::size_of::<TcpMd5Sig>() == 128 + 1 + 1 + 2 + 4 + 80);

/// Sets (or with `None`, removes) the TCP-MD5 key for segments to and from `peer` on a
/// socket. On a connecting socket call it before `connect`; on a listening socket once per
/// peer before `accept` (accepted sockets inherit it).
pub fn set_md5(fd: RawFd, peer: impl Into<IpAddr>, key: Option<&[u8]>) -> io::Result<()> {
    let peer = peer.into();
    let key = key.unwrap_or(&[]);
    if key.len() > MD5_MAX_KEY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "TCP-MD5 password longer than 80 bytes",
        ));
    }
    // SAFETY: an all-zero sockaddr_storage / tcp_md5sig is a valid value of these plain
    // C structs.
    let mut sig: TcpMd5Sig = unsafe { std::mem::zeroed() };
    match peer {
        IpAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from(v4).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned for
            // it; we write exactly one sockaddr_in at its start.
            unsafe { std::ptr::write(&mut sig.addr as *mut _ as *mut libc::sockaddr_in, sin) };
        }
        IpAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: 0,
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned
            // for it; we write exactly one sockaddr_in6 at its start.
            unsafe { std::ptr::write(&mut sig.addr as *mut _ as *mut libc::sockaddr_in6, sin6) };
        }
    }
    sig.keylen = key.len() as u16;
    sig.key[..key.len()].copy_from_slice(key);
    // SAFETY: fd is a socket owned by the caller; we pass a pointer to a live, correctly
    // sized tcp_md5sig and its size, as TCP_MD5SIG expects.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_MD5SIG,
            &sig as *const TcpMd5Sig as *const libc::c_void,
            std::mem::size_of::<TcpMd5Sig>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        // Removing a key that was never set is fine.
        if key.is_empty() && e.raw_os_error() == Some(libc::ENOENT) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Sets the TTL (IPv4 socket) or unicast hop limit (IPv6 socket, `ipv6`) of outgoing
/// packets (1 for directly connected eBGP, more for multihop).
pub fn set_ttl(fd: RawFd, ipv6: bool, ttl: u8) -> io::Result<()> {
    let v: libc::c_int = ttl as libc::c_int;
    let (level, name) = if ipv6 {
        (libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS)
    } else {
        (libc::IPPROTO_IP, libc::IP_TTL)
    };
    // SAFETY: fd is a socket owned by the caller; IP_TTL and IPV6_UNICAST_HOPS take an
    // int.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::os::fd::AsRawFd;

    #[test]
    fn md5_and_ttl_are_accepted_by_the_kernel() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        set_md5(l.as_raw_fd(), Ipv4Addr::new(127, 0, 0, 2), Some(b"secret")).unwrap();
        set_md5(l.as_raw_fd(), Ipv4Addr::new(127, 0, 0, 2), None).unwrap();
        set_md5(l.as_raw_fd(), Ipv4Addr::new(127, 0, 0, 3), None).unwrap();
        assert!(set_md5(
            l.as_raw_fd(),
            Ipv4Addr::new(127, 0, 0, 2),
            Some(&[b'x'; 81])
        )
        .is_err());
        set_ttl(l.as_raw_fd(), false, 1).unwrap();
    }

    #[test]
    fn md5_and_hop_limit_are_accepted_on_ipv6_sockets() {
        let Ok(l) = std::net::TcpListener::bind("[::1]:0") else {
            panic!("no IPv6 loopback: the test needs one");
        };
        let peer = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2);
        set_md5(l.as_raw_fd(), peer, Some(b"secret")).unwrap();
        set_md5(l.as_raw_fd(), peer, None).unwrap();
        set_ttl(l.as_raw_fd(), true, 1).unwrap();
        let mut hops: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reading an int socket option into a live int of the given size.
        let rc = unsafe {
            libc::getsockopt(
                l.as_raw_fd(),
                libc::IPPROTO_IPV6,
                libc::IPV6_UNICAST_HOPS,
                &mut hops as *mut libc::c_int as *mut libc::c_void,
                &mut len,
            )
        };
        assert_eq!((rc, hops), (0, 1));
    }
}
