//! A test backend Pod's servers and a raw HTTP/1.1 client, for tests that run their own
//! backends on threads inside Pod namespaces (dataplane and static-stability tests): the
//! backend answers `GET /` with `<name> saw <peer>`, `GET /big` with 1 MiB, `GET
//! /bytes/N` with N bytes of [`pattern`] and `POST /upload` (any Content-Length) with
//! `<length> <fnv64 of the body>`, keeps connections alive, can echo UDP, and records
//! the peer of every request (its access log) — the client address a Pod saw is what
//! these tests check. [`download`] and [`upload`] move such bodies with curl from a
//! namespace and fail on any truncated or altered byte.

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
    // Datagrams of any size (fragmented ones included) are echoed whole.
    let mut buf = vec![0u8; 65_536];
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
            let want = content_length(&req);
            if buf.len() < end + 4 + want {
                break; // the request's body is still coming
            }
            buf.drain(..end + 4);
            let sent: Vec<u8> = buf.drain(..want).collect();
            log.lock().unwrap().push(peer);
            let body = if req.starts_with("GET /big") {
                vec![b'x'; 1 << 20]
            } else if let Some(n) = req.strip_prefix("GET /bytes/") {
                let n = n
                    .split(' ')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                pattern(n.min(1 << 30))
            } else if req.starts_with("POST /upload") {
                format!("{} {:016x}\n", sent.len(), fnv64(&sent)).into_bytes()
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

/// The Content-Length of a request head (0 without one).
fn content_length(head: &str) -> usize {
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// `n` bytes of a fixed pseudo-random pattern (every byte depends on its offset, so a
/// lost, duplicated or reordered segment changes the result): what `GET /bytes/N`
/// answers and what [`upload`] sends.
pub fn pattern(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// FNV-1a, 64 bits: the upload check (a cryptographic hash adds nothing against
/// corruption in transit).
pub fn fnv64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Downloads `url` with curl from namespace `ns` (at most `secs` seconds) and checks the
/// body is exactly `expect`: a truncated or altered body is an error saying how much
/// arrived.
pub fn download(ns: &str, url: &str, expect: &[u8], secs: u32) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("body");
    let f = file.to_str().context("path")?;
    let m = secs.to_string();
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sS", "-m", &m, "-o", f, url])
        .output()?;
    same_body(&format!("download from {url}"), expect, &file, &out)
}

/// Whether curl succeeded and the file it wrote holds exactly `want`; the error says
/// how many bytes arrived and curl's own words.
fn same_body(
    what: &str,
    want: &[u8],
    file: &std::path::Path,
    out: &std::process::Output,
) -> Result<()> {
    let got = std::fs::read(file).unwrap_or_default();
    let altered = if got.len() == want.len() {
        ", altered"
    } else {
        ""
    };
    ensure!(
        out.status.success() && got == want,
        "{what}: {} of {} bytes{altered} ({})",
        got.len(),
        want.len(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Uploads `body` with curl from namespace `ns` to a backend's `POST /upload` at `url`
/// (at most `secs` seconds) and checks the backend received exactly `body`.
pub fn upload(ns: &str, url: &str, body: &[u8], secs: u32) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("body");
    std::fs::write(&file, body)?;
    let data = format!("@{}", file.to_str().context("path")?);
    let m = secs.to_string();
    let out = std::process::Command::new("ip")
        .args([
            "netns", "exec", ns, "curl", "-sS", "-m", &m, "-H", "Expect:",
        ])
        .args([
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            &data,
            url,
        ])
        .output()?;
    let want = format!("{} {:016x}", body.len(), fnv64(body));
    let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ensure!(
        out.status.success() && got == want,
        "upload of {} bytes to {url}: backend answered {got:?}, want {want:?} ({})",
        body.len(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Uploads `body` with curl from namespace `ns` by WebDAV `PUT` to `url` (the lab's
/// nginx, `/uploads/...`), then reads it back with `GET` on the same kept-alive
/// connection (so from the same Pod), and checks every byte came back.
pub fn put_and_get(ns: &str, url: &str, body: &[u8], secs: u32) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (src, back) = (dir.path().join("up"), dir.path().join("back"));
    std::fs::write(&src, body)?;
    let m = secs.to_string();
    let (s, b) = (
        src.to_str().context("path")?,
        back.to_str().context("path")?,
    );
    let out = std::process::Command::new("ip")
        .args([
            "netns", "exec", ns, "curl", "-sS", "-f", "-m", &m, "-H", "Expect:",
        ])
        .args([
            "-T",
            s,
            url,
            "-o",
            "/dev/null",
            "--next",
            "-sS",
            "-f",
            "-m",
            &m,
            "-o",
            b,
            url,
        ])
        .output()?;
    same_body(&format!("upload to {url}, read back"), body, &back, &out)
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
        let body = pattern(300_000);
        c.write_all(b"POST /upload HTTP/1.1\r\nHost: vip\r\ncontent-length: 300000\r\n\r\n")?;
        c.write_all(&body)?;
        let want = format!("300000 {:016x}\n", fnv64(&body));
        assert_eq!(read_response(&mut c)?, want);
        assert_eq!(log.lock().unwrap().as_slice(), &[me, me, me, me]);
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        Ok(())
    }
}
