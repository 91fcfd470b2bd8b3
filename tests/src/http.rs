//! A test backend Pod's servers and a raw HTTP/1.1 client, for tests that run their own
//! backends on threads inside Pod namespaces (dataplane and static-stability tests): the
//! backend answers `GET /` with `<name> saw <peer>` and `GET /big` with 1 MiB, keeps
//! connections alive, can echo UDP, and records the peer of every request (its access
//! log) — the client address a Pod saw is what these tests check.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use crate::netns::in_ns;

/// A backend Pod's HTTP (and optionally UDP echo) servers with their access log; stops
/// on drop.
pub struct TestBackend {
    pub name: String,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<SocketAddr>>>,
    threads: Vec<JoinHandle<()>>,
}

impl TestBackend {
    /// Starts the servers in namespace `ns`: HTTP on `http`, UDP echo on `udp` if given
    /// (the UDP answer is `<name> saw <peer> ` followed by the datagram).
    pub fn start(ns: &str, name: &str, http: SocketAddr, udp: Option<SocketAddr>) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tcp, udp) = in_ns(ns, move || -> Result<(TcpListener, Option<UdpSocket>)> {
            let t = TcpListener::bind(http).with_context(|| format!("binding {http}"))?;
            let u = match udp {
                Some(a) => Some(UdpSocket::bind(a).with_context(|| format!("binding {a}"))?),
                None => None,
            };
            Ok((t, u))
        })?;
        tcp.set_nonblocking(true)?;
        let mut threads = Vec::new();
        let (s, l, n) = (stop.clone(), log.clone(), name.to_string());
        threads.push(std::thread::spawn(move || accept_loop(tcp, &n, &l, &s)));
        if let Some(udp) = udp {
            udp.set_read_timeout(Some(Duration::from_millis(100)))?;
            let (s, l, n) = (stop.clone(), log.clone(), name.to_string());
            threads.push(std::thread::spawn(move || udp_echo(udp, &n, &l, &s)));
        }
        Ok(TestBackend {
            name: name.to_string(),
            stop,
            log,
            threads,
        })
    }

    /// The peers of every request served so far (HTTP requests and UDP datagrams).
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for TestBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    tcp: TcpListener,
    name: &str,
    log: &Arc<Mutex<Vec<SocketAddr>>>,
    stop: &Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        match tcp.accept() {
            Ok((conn, peer)) => {
                let (stop, log, name) = (stop.clone(), log.clone(), name.to_string());
                std::thread::spawn(move || serve_http(conn, peer, &name, &log, &stop));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn udp_echo(udp: UdpSocket, name: &str, log: &Mutex<Vec<SocketAddr>>, stop: &AtomicBool) {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((n, peer)) = udp.recv_from(&mut buf) {
            log.lock().unwrap().push(peer);
            let mut reply = format!("{name} saw {peer} ").into_bytes();
            reply.extend_from_slice(&buf[..n]);
            let _ = udp.send_to(&reply, peer);
        }
    }
}

/// Minimal HTTP/1.1 with keep-alive: `GET /big` answers 1 MiB, anything else
/// `<name> saw <peer>`.
fn serve_http(
    mut conn: TcpStream,
    peer: SocketAddr,
    name: &str,
    log: &Mutex<Vec<SocketAddr>>,
    stop: &AtomicBool,
) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match conn.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        }
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let req = String::from_utf8_lossy(&buf[..end]).to_string();
            buf.drain(..end + 4);
            log.lock().unwrap().push(peer);
            let body = if req.starts_with("GET /big") {
                vec![b'x'; 1 << 20]
            } else {
                format!("{name} saw {peer}\n").into_bytes()
            };
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: text/plain\r\n\r\n",
                body.len()
            );
            if conn
                .write_all(head.as_bytes())
                .and_then(|_| conn.write_all(&body))
                .is_err()
            {
                return;
            }
        }
    }
}

/// Sends `GET /` on a kept-alive connection and returns the body.
pub fn http_get(conn: &mut TcpStream) -> Result<String> {
    conn.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")?;
    read_response(conn)
}

/// Reads one HTTP/1.1 response (with Content-Length) and returns the body.
pub fn read_response(conn: &mut TcpStream) -> Result<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .context("no Content-Length")?
                .trim()
                .parse()?;
            if buf.len() >= end + 4 + len {
                return Ok(String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).to_string());
            }
        }
        let n = match conn.read(&mut chunk) {
            // A signal interrupted the read (seen once in a full parallel run): retry,
            // as std's `read_exact` does.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => r?,
        };
        ensure!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On loopback (no namespace needed beyond the current one): keep-alive requests,
    /// the big answer, and the access log.
    #[test]
    fn answers_keep_alive_requests_and_logs_the_peer() -> Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let (stop, log) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(Vec::new())),
        );
        let (s, l) = (stop.clone(), log.clone());
        let t = std::thread::spawn(move || accept_loop(listener, "pod9", &l, &s));
        let mut c = TcpStream::connect(addr)?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        let me = c.local_addr()?;
        assert_eq!(http_get(&mut c)?, format!("pod9 saw {me}\n"));
        assert_eq!(http_get(&mut c)?, format!("pod9 saw {me}\n"));
        c.write_all(b"GET /big HTTP/1.1\r\nHost: vip\r\n\r\n")?;
        assert_eq!(read_response(&mut c)?.len(), 1 << 20);
        assert_eq!(log.lock().unwrap().as_slice(), &[me, me, me]);
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        Ok(())
    }
}
