//! The backend's UDP application: a `recvmmsg` loop on a socket in the backend namespace,
//! counting the datagrams it reads — what a Pod's application receives, so every path
//! pays the backend's socket delivery, as a real Pod's traffic does. Datagrams the socket
//! had to drop (its receive buffer full) are read from the socket itself (`SO_MEMINFO`),
//! so a loss at the backend is named in the report rather than charged to the path.
//!
//! The loop runs on its own thread, pinned to the generator's core at the prober's
//! real-time priority (like the echo server): its `recvmmsg` work is the application's,
//! not the path's; the receive softirq that fills the socket stays on the path core.
//! It never blocks in the socket: an empty read sleeps [`IDLE_SLEEP`] and reads again,
//! as a loaded server finds datagrams waiting. A reader blocked in `recvmmsg` is woken
//! across cores by the path core per datagram or short batch — on this VM an
//! inter-processor interrupt, a hypervisor exit, that cost every path 20-40 % of its
//! core in a first measurement: the hypervisor's price, not the path's.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::bpf::in_netns;

/// `SO_MEMINFO` (asm-generic/socket.h; not in the libc crate).
const SO_MEMINFO: libc::c_int = 55;
/// How long the reader sleeps after finding its socket empty (the receive buffer holds
/// far more than arrives meanwhile).
pub const IDLE_SLEEP: Duration = Duration::from_micros(50);
/// Datagrams per `recvmmsg`.
const BATCH: usize = 64;
/// Room per datagram (the load is 64-byte frames; anything longer is cut and still counted).
const DATAGRAM: usize = 2048;
/// Receive buffer asked for (`SO_RCVBUFFORCE`): bursts while the thread is descheduled
/// must not overflow it.
const RCVBUF: libc::c_int = 16 << 20;

/// The running backend application.
pub struct UdpSink {
    socket: Arc<UdpSocket>,
    received: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// The reading thread's id (0 until it has started).
    tid: Arc<AtomicU32>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl UdpSink {
    /// Binds UDP `ip`:`port` in namespace `ns` (`0.0.0.0` for the IPv4 rows, `::` for the
    /// IPv6 ones) and starts reading on `cpu` (SCHED_FIFO at `rt_priority`).
    pub fn start(ns: &str, ip: IpAddr, port: u16, cpu: u32, rt_priority: u8) -> Result<UdpSink> {
        let socket = in_netns(ns, move || {
            let s = UdpSocket::bind(SocketAddr::new(ip, port))
                .with_context(|| format!("binding UDP {}", SocketAddr::new(ip, port)))?;
            Ok(s)
        })?;
        set_int(&socket, libc::SO_RCVBUFFORCE, RCVBUF).context("SO_RCVBUFFORCE")?;
        let socket = Arc::new(socket);
        let received = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let tid = Arc::new(AtomicU32::new(0));
        let thread = {
            let (socket, received, stop) = (socket.clone(), received.clone(), stop.clone());
            let tid = tid.clone();
            std::thread::Builder::new()
                .name("udp-sink".into())
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    tid.store(unsafe { libc::gettid() } as u32, Ordering::Relaxed);
                    place(cpu, rt_priority)?;
                    read_loop(&socket, &received, &stop)
                })
                .context("starting the sink thread")?
        };
        Ok(UdpSink {
            socket,
            received,
            stop,
            tid,
            thread: Some(thread),
        })
    }

    /// Datagrams the application has read so far.
    pub fn count(&self) -> Result<u64> {
        if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
            bail!("the backend's UDP sink stopped reading");
        }
        Ok(self.received.load(Ordering::Relaxed))
    }

    /// The reading thread as the scheduler sees it (`None` before it started or once
    /// it is gone).
    pub fn thread(&self) -> Option<crate::cpu::ThreadSched> {
        match self.tid.load(Ordering::Relaxed) {
            0 => None,
            tid => crate::cpu::ThreadSched::read(tid),
        }
    }

    /// Datagrams the socket dropped so far (its receive buffer full).
    pub fn socket_drops(&self) -> Result<u64> {
        let mut info = [0u32; 16];
        let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
        // SAFETY: `info` is writable for `len` bytes and outlives the call.
        let rc = unsafe {
            libc::getsockopt(
                self.socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_MEMINFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if rc != 0 {
            bail!("SO_MEMINFO: {}", std::io::Error::last_os_error());
        }
        Ok(u64::from(info[libc::SK_MEMINFO_DROPS as usize]))
    }
}

impl Drop for UdpSink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub(crate) fn set_int(s: &UdpSocket, opt: libc::c_int, v: libc::c_int) -> Result<()> {
    // SAFETY: `v` is a live c_int and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        bail!("{}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Pins the calling thread to `cpu` and makes it SCHED_FIFO at `priority` (the
/// harness's pinning, the dataplane's realtime entry).
fn place(cpu: u32, priority: u8) -> Result<()> {
    // SAFETY: gettid has no preconditions.
    crate::cpu::pin(unsafe { libc::gettid() } as u32, cpu)?;
    juneau_dataplane::sched::make_current_thread_realtime(priority)
        .context("SCHED_FIFO for the backend's UDP sink")
}

fn read_loop(s: &UdpSocket, received: &AtomicU64, stop: &AtomicBool) -> Result<()> {
    let mut bufs = vec![[0u8; DATAGRAM]; BATCH];
    let mut iov: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: DATAGRAM,
        })
        .collect();
    // SAFETY: an all-zero mmsghdr is valid (null name and control, no iovecs yet).
    let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; BATCH];
    for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 1;
    }
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: every mmsghdr points at one live iovec of a live buffer (`bufs`, `iov`
        // outlive the loop); the kernel writes at most `iov_len` bytes into each.
        let n = unsafe {
            libc::recvmmsg(
                s.as_raw_fd(),
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n > 0 {
            received.fetch_add(n as u64, Ordering::Relaxed);
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) => std::thread::sleep(IDLE_SLEEP),
            _ => return Err(e).context("recvmmsg"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs root (a namespace). IPv4 for the IPv4 rows, IPv6 for the IPv6 ones.
    #[test]
    fn counts_what_it_reads_and_reports_socket_drops() {
        juneau_tests::netns::require_root().expect("a namespace");
        let prefix = juneau_tests::netns::unique_prefix("sink");
        let ns = juneau_tests::netns::Netns::new(format!("{prefix}be")).expect("netns");
        ns.exec(&["ip", "link", "set", "lo", "up"]).expect("lo up");
        for (bind, from, to) in [
            ("0.0.0.0", "127.0.0.1:0", "127.0.0.1:9100"),
            ("::", "[::1]:0", "[::1]:9100"),
        ] {
            let sink = UdpSink::start(ns.name(), bind.parse().unwrap(), 9100, 0, 20).expect("sink");
            let sent = in_netns(ns.name(), move || {
                let c = UdpSocket::bind(from)?;
                for _ in 0..500 {
                    c.send_to(&[0u8; 18], to)?;
                }
                Ok(500u64)
            })
            .expect("send");
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while sink.count().unwrap() + sink.socket_drops().unwrap() < sent
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert_eq!(
                sink.count().unwrap() + sink.socket_drops().unwrap(),
                sent,
                "{to}"
            );
        }
    }
}
