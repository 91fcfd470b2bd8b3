//! AF_XDP busy polling (`--xsk-busy-poll-budget`): the forwarding thread runs the
//! interface's NAPI itself, inside a non-blocking `recvfrom` when its RX ring is empty (and
//! inside the `sendto` it already makes to transmit), instead of a NAPI kthread or softirq
//! filling the RX ring and the forwarding thread draining it as two tasks taking turns on
//! one core. Socket options: `SO_PREFER_BUSY_POLL` (the kernel leaves the NAPI to the
//! busy poller), `SO_BUSY_POLL` (µs one poll may spin) and `SO_BUSY_POLL_BUDGET` (frames
//! per poll). Off by default.
//!
//! It needs a NAPI id on the socket, and since Linux 6.13 ("xsk: Bring back busy polling
//! support") the kernel sets one only at bind time and only for a **zero-copy** socket on
//! a driver that registers its queues' NAPI. Copy-mode sockets (veth, every Pod
//! interface) get none, so there the options are accepted and nothing is busy-polled:
//! measured with `juneau-perf --scenarios juneau-busy-poll` on Linux 6.18 + veth,
//! `BusyPollRxPackets` of the node's /proc/net/netstat stayed 0 (docs/dataplane.md,
//! "Busy polling"). It is for zero-copy NICs.

use std::io;
use std::os::fd::RawFd;

/// `SO_PREFER_BUSY_POLL` (Linux 5.11; not in every libc crate version).
const SO_PREFER_BUSY_POLL: libc::c_int = 69;
/// `SO_BUSY_POLL_BUDGET` (Linux 5.11).
const SO_BUSY_POLL_BUDGET: libc::c_int = 70;

/// How long one busy poll may spin (µs) when busy polling is on: short, the loop calls
/// it again on the next empty iteration.
pub const BUSY_POLL_US: libc::c_int = 20;

fn set(fd: RawFd, opt: libc::c_int, val: libc::c_int) -> io::Result<()> {
    // SAFETY: `val` is a valid c_int for the call's duration and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Turns busy polling on for an AF_XDP socket: preferred busy polling, `BUSY_POLL_US`
/// per poll, at most `budget` frames per poll.
pub fn enable(fd: RawFd, budget: u32) -> io::Result<()> {
    set(fd, SO_PREFER_BUSY_POLL, 1)?;
    set(fd, libc::SO_BUSY_POLL, BUSY_POLL_US)?;
    set(
        fd,
        SO_BUSY_POLL_BUDGET,
        budget.min(i32::MAX as u32) as libc::c_int,
    )
}

/// Runs the socket's NAPI once (a non-blocking `recvfrom` with no buffer: for an AF_XDP
/// socket with busy polling on, the kernel polls the queue's NAPI, which moves waiting
/// frames into the RX ring). Errors (`EAGAIN` and the like) mean nothing to do.
pub fn poll_rx(fd: RawFd) {
    // SAFETY: a zero-length receive into a null buffer with null address pointers, as
    // the AF_XDP documentation's busy-poll example does; nothing is written.
    unsafe {
        libc::recvfrom(
            fd,
            std::ptr::null_mut(),
            0,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn options_are_accepted_on_a_socket() {
        // The options are SOL_SOCKET options: any socket takes them (an AF_XDP socket
        // needs root and an interface; tests/netns covers that one).
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp socket");
        enable(s.as_raw_fd(), 64).expect("busy-poll options");
        poll_rx(s.as_raw_fd());
    }
}
