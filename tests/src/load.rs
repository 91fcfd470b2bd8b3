//! A small HTTP load through a VIP that counts what an operator cares about during a
//! change: requests, failed requests, connection resets and the longest time without a
//! successful response.
//!
//! Three kinds of clients run side by side, each paced (bounded rate) and bounded in time:
//! keep-alive clients (one connection, request after request, like a browser or a
//! connection pool), new-connection clients (connect, one request, close), and bulk
//! clients (one keep-alive connection alternating a [`BULK_DOWNLOAD`] download and a
//! [`BULK_UPLOAD_BYTES`] WebDAV upload, about one of each per second): real payloads
//! beside the small page. A body that stops before its Content-Length is a failure,
//! counted in `truncated`. Beside those paced clients, saturating clients behave like
//! `wrk`: one kept-alive connection each, the next request as soon as the answer is in,
//! no retry — a connection that fails before its answer is complete is a read error, as
//! wrk counts it (see [`SaturatingReport`]). A request
//! that fails on a reused keep-alive connection before any byte of the answer came back
//! is retried once on a new connection, as HTTP clients do for idempotent requests (the
//! server may have closed an idle connection); it counts as a reset or failure only if
//! the retry fails too — the first failure is counted in `keepalive_retries`.
//!
//! Runs where it is started: the lab starts it inside the client's namespace
//! (`juneau-lab load`), so it needs no namespace code of its own.

use std::io::{ErrorKind, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::json;

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// `ip:port` of the VIP.
    pub target: SocketAddr,
    /// The client address connections come from (one of the namespace's), or the
    /// kernel's choice.
    pub source: Option<std::net::IpAddr>,
    /// Keep-alive clients.
    pub keepalive_clients: usize,
    /// New-connection clients.
    pub new_connection_clients: usize,
    /// Requests per second per client at most.
    pub rate_per_client: u32,
    /// Stop after this long at the latest.
    pub max_duration: Duration,
    /// Stop as soon as this file exists.
    pub stop_file: Option<PathBuf>,
    /// Connect timeout and per-request read timeout.
    pub timeout: Duration,
    /// Bulk clients (large downloads and uploads on a keep-alive connection).
    pub bulk_clients: usize,
    /// Saturating clients (wrk-like: unpaced, kept alive, never retried).
    pub saturating_clients: usize,
}

/// What the saturating clients saw, counted as wrk counts (`Socket errors: connect,
/// read, write, timeout` and non-2xx answers). Nothing is retried: a kept-alive
/// connection the server closes while a request is on its way is a read error here even
/// though a browser would retry it — whether the server (the application) or the path
/// closed it is what [`LoadReport::failure_samples`] and the captures tell.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SaturatingReport {
    /// Requests sent.
    pub requests: u64,
    /// Answered `2xx` in full.
    pub ok: u64,
    /// The connection closed, reset or stalled after the request was sent and before
    /// the answer was complete.
    pub read_errors: u64,
    /// Sending the request failed (reset, broken pipe).
    pub write_errors: u64,
    /// A new connection failed (refused, reset, unreachable).
    pub connect_errors: u64,
    /// No answer (or no connection) within the timeout.
    pub timeouts: u64,
    /// An answer other than 2xx.
    pub bad_status: u64,
    /// Answers with `Connection: close`, after which the client opened a new connection
    /// (the server's clean way to end a kept-alive connection: not an error).
    pub closes_announced: u64,
}

impl SaturatingReport {
    /// Requests that failed, whatever the reason.
    pub fn failed(&self) -> u64 {
        self.read_errors + self.write_errors + self.connect_errors + self.timeouts + self.bad_status
    }

    fn to_json(&self) -> serde_json::Value {
        json!({
            "requests": self.requests, "ok": self.ok, "read_errors": self.read_errors,
            "write_errors": self.write_errors, "connect_errors": self.connect_errors,
            "timeouts": self.timeouts, "bad_status": self.bad_status,
            "closes_announced": self.closes_announced,
        })
    }

    fn from_json(v: &serde_json::Value) -> SaturatingReport {
        let g = |k: &str| v[k].as_u64().unwrap_or(0);
        SaturatingReport {
            requests: g("requests"),
            ok: g("ok"),
            read_errors: g("read_errors"),
            write_errors: g("write_errors"),
            connect_errors: g("connect_errors"),
            timeouts: g("timeouts"),
            bad_status: g("bad_status"),
            closes_announced: g("closes_announced"),
        }
    }
}

/// What a bulk client downloads: the lab nginx image's 4 MiB file
/// (`crate::images::LARGE_FILES`).
pub const BULK_DOWNLOAD: &str = "/files/4m";
/// Bytes a bulk client uploads per request (WebDAV `PUT /uploads/bulk-<client>`).
pub const BULK_UPLOAD_BYTES: usize = 1 << 20;

/// What happened. `requests` to `other` count the paced clients (keep-alive,
/// new-connection, bulk); the saturating clients have their own [`SaturatingReport`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Requests sent (a retried request counts once).
    pub requests: u64,
    /// Answered `200 OK`.
    pub ok: u64,
    /// Not answered with `200 OK` (error, timeout, reset, other status).
    pub failed: u64,
    /// Of the failed: connection reset by the peer (or broken pipe).
    pub resets: u64,
    /// Of the failed: timed out (connect or answer).
    pub timeouts: u64,
    /// Of the failed: connection refused (a RST answering the SYN).
    pub refused: u64,
    /// Requests on a reused keep-alive connection that failed before any answer byte
    /// and then succeeded on a new connection.
    pub keepalive_retries: u64,
    /// Requests on a reused keep-alive connection answered with a RST (not a clean
    /// close): a segment of an established connection reached a server that never saw
    /// it. Counted whether or not the retry then succeeded.
    pub keepalive_resets: u64,
    /// Requests on a reused keep-alive connection that got no answer within the timeout
    /// (the connection's packets went nowhere: e.g. dropped by a node that does not hold
    /// it). Counted whether or not the retry then succeeded.
    pub keepalive_timeouts: u64,
    /// Of the failed: an answer whose body stopped before its Content-Length because
    /// the connection closed or was reset mid-body (a cut body).
    pub truncated: u64,
    /// Of the failed: an answer whose body stopped arriving for longer than the timeout
    /// while the connection stayed open (a stall, not a cut: its packets were delayed or
    /// lost and the client gave up first).
    pub body_stalls: u64,
    /// Of the failed: an answer other than 2xx.
    pub bad_status: u64,
    /// Of the failed: any other error (an I/O error none of the above names, an answer
    /// that does not parse); see [`other_samples`](Self::other_samples).
    pub other: u64,
    /// The first few of those `other` errors, as text.
    pub other_samples: Vec<String>,
    /// Body bytes the bulk clients moved (downloads and uploads that succeeded).
    pub bulk_bytes: u64,
    /// The saturating (wrk-like) clients.
    pub saturating: SaturatingReport,
    /// The first failures of any client, as text: when (s after the start), which
    /// connection (local port), which Pod answered last on it (`X-Served-By`) and after
    /// how many answers, and what happened — what to look for in the captures.
    pub failure_samples: Vec<String>,
    /// Longest time between two successful answers (or from start/to end), ms.
    pub longest_gap_ms: u64,
    /// How long the load ran, ms.
    pub duration_ms: u64,
}

impl LoadReport {
    /// As JSON (what `juneau-lab load` prints).
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "requests": self.requests, "ok": self.ok, "failed": self.failed,
            "resets": self.resets, "timeouts": self.timeouts, "refused": self.refused,
            "keepalive_retries": self.keepalive_retries,
            "keepalive_resets": self.keepalive_resets,
            "keepalive_timeouts": self.keepalive_timeouts,
            "truncated": self.truncated, "body_stalls": self.body_stalls,
            "bad_status": self.bad_status,
            "other": self.other, "other_samples": self.other_samples,
            "bulk_bytes": self.bulk_bytes,
            "saturating": self.saturating.to_json(),
            "failure_samples": self.failure_samples,
            "longest_gap_ms": self.longest_gap_ms, "duration_ms": self.duration_ms,
        })
    }

    /// From [`to_json`](Self::to_json)'s output.
    pub fn from_json(v: &serde_json::Value) -> Result<LoadReport> {
        let g = |k: &str| -> Result<u64> {
            v[k].as_u64()
                .ok_or_else(|| anyhow::anyhow!("load report without {k}: {v}"))
        };
        Ok(LoadReport {
            requests: g("requests")?,
            ok: g("ok")?,
            failed: g("failed")?,
            resets: g("resets")?,
            timeouts: g("timeouts")?,
            refused: g("refused")?,
            keepalive_retries: g("keepalive_retries")?,
            // Absent from reports of older builds.
            keepalive_resets: v["keepalive_resets"].as_u64().unwrap_or(0),
            keepalive_timeouts: v["keepalive_timeouts"].as_u64().unwrap_or(0),
            truncated: v["truncated"].as_u64().unwrap_or(0),
            body_stalls: v["body_stalls"].as_u64().unwrap_or(0),
            bad_status: v["bad_status"].as_u64().unwrap_or(0),
            other: v["other"].as_u64().unwrap_or(0),
            other_samples: v["other_samples"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect(),
            bulk_bytes: v["bulk_bytes"].as_u64().unwrap_or(0),
            saturating: SaturatingReport::from_json(&v["saturating"]),
            failure_samples: v["failure_samples"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect(),
            longest_gap_ms: g("longest_gap_ms")?,
            duration_ms: g("duration_ms")?,
        })
    }
}

#[derive(Debug)]
enum Outcome {
    Ok,
    Status,
    Reset,
    /// Closed (FIN) before a full answer; counted with the resets.
    Closed,
    /// The connection closed or was reset before the body's Content-Length.
    Truncated,
    /// The body stopped arriving for the timeout, the connection still open.
    BodyStalled,
    Timeout,
    Refused,
    /// Another error, described.
    Other(String),
}

fn classify(e: &std::io::Error) -> Outcome {
    match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            Outcome::Reset
        }
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Outcome::Timeout,
        ErrorKind::ConnectionRefused => Outcome::Refused,
        _ => Outcome::Other(e.to_string()),
    }
}

/// A request a client sends.
#[derive(Debug, Clone, Copy)]
enum Req<'a> {
    /// `GET /`.
    Page,
    /// `GET path`, the body counted.
    Download(&'a str),
    /// `PUT path` with this body.
    Upload(&'a str, &'a [u8]),
}

impl Req<'_> {
    fn head(&self, host: &str, keepalive: bool) -> String {
        let conn = if keepalive { "keep-alive" } else { "close" };
        let (method, path, len) = match *self {
            Req::Page => ("GET", "/", None),
            Req::Download(p) => ("GET", p, None),
            Req::Upload(p, b) => ("PUT", p, Some(b.len())),
        };
        let len = len
            .map(|n| format!("Content-Length: {n}\r\n"))
            .unwrap_or_default();
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: juneau-load\r\nConnection: {conn}\r\n{len}\r\n")
    }
}

/// A complete answer.
#[derive(Debug)]
struct Answer {
    /// The connection may carry the next request (the server did not announce
    /// `Connection: close`).
    reusable: bool,
    /// Body bytes.
    body: usize,
    /// The answering Pod (`X-Served-By`), if said.
    served_by: Option<String>,
}

/// A failed request.
#[derive(Debug)]
struct Failure {
    outcome: Outcome,
    /// Sending the request failed (nothing was read).
    at_write: bool,
    /// Some of the answer had arrived.
    got_any: bool,
}

impl Failure {
    fn at_write(e: &std::io::Error) -> Failure {
        Failure {
            outcome: classify(e),
            at_write: true,
            got_any: false,
        }
    }

    fn at_read(outcome: Outcome, got_any: bool) -> Failure {
        Failure {
            outcome,
            at_write: false,
            got_any,
        }
    }
}

/// One request on `conn`.
fn request(
    conn: &mut TcpStream,
    host: &str,
    keepalive: bool,
    req: Req<'_>,
) -> Result<Answer, Failure> {
    conn.write_all(req.head(host, keepalive).as_bytes())
        .map_err(|e| Failure::at_write(&e))?;
    if let Req::Upload(_, body) = req {
        conn.write_all(body).map_err(|e| Failure::at_write(&e))?;
    }
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let header_end;
    loop {
        let n = conn
            .read(&mut chunk)
            .map_err(|e| Failure::at_read(classify(&e), !buf.is_empty()))?;
        if n == 0 {
            // Closed before a full header: for a reused connection, a server close.
            return Err(Failure::at_read(Outcome::Closed, !buf.is_empty()));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            header_end = p + 4;
            break;
        }
        if buf.len() > 64 * 1024 {
            return Err(Failure::at_read(
                Outcome::Other("an answer without a header end".into()),
                true,
            ));
        }
    }
    let head = String::from_utf8_lossy(&buf[..header_end]).to_ascii_lowercase();
    let status_ok = head.starts_with("http/1.1 2");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let server_closes = head
        .lines()
        .filter_map(|l| l.strip_prefix("connection:"))
        .any(|v| v.trim() == "close");
    let served_by = head
        .lines()
        .find_map(|l| l.strip_prefix("x-served-by:"))
        .map(|v| v.trim().to_string());
    let mut have = buf.len() - header_end;
    while have < len {
        match conn.read(&mut chunk) {
            Err(e) if matches!(classify(&e), Outcome::Timeout) => {
                return Err(Failure::at_read(Outcome::BodyStalled, true))
            }
            Ok(0) | Err(_) => return Err(Failure::at_read(Outcome::Truncated, true)),
            Ok(n) => have += n,
        }
    }
    if !status_ok {
        return Err(Failure::at_read(Outcome::Status, true));
    }
    Ok(Answer {
        reusable: !server_closes,
        body: have,
        served_by,
    })
}

#[derive(Default)]
struct Shared {
    report: LoadReport,
    last_ok: Option<Instant>,
}

fn record(shared: &Mutex<Shared>, start: Instant, outcome: Outcome) {
    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
    s.report.requests += 1;
    match outcome {
        Outcome::Ok => {
            let now = Instant::now();
            let since = s.last_ok.unwrap_or(start);
            let gap = now.duration_since(since).as_millis() as u64;
            s.report.longest_gap_ms = s.report.longest_gap_ms.max(gap);
            s.last_ok = Some(now);
            s.report.ok += 1;
        }
        o => {
            s.report.failed += 1;
            match o {
                Outcome::Reset | Outcome::Closed => s.report.resets += 1,
                Outcome::Truncated => s.report.truncated += 1,
                Outcome::BodyStalled => s.report.body_stalls += 1,
                Outcome::Timeout => s.report.timeouts += 1,
                Outcome::Refused => s.report.refused += 1,
                Outcome::Status => s.report.bad_status += 1,
                Outcome::Other(what) => {
                    s.report.other += 1;
                    if s.report.other_samples.len() < 5 {
                        s.report.other_samples.push(what);
                    }
                }
                Outcome::Ok => {}
            }
        }
    }
}

/// Counts a bulk request's payload (the download's body, or the upload's).
fn note_bulk(shared: &Mutex<Shared>, req: Req<'_>, body_in: usize) {
    let bytes = match req {
        Req::Page => return,
        Req::Download(_) => body_in,
        Req::Upload(_, b) => b.len(),
    };
    shared
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .report
        .bulk_bytes += bytes as u64;
}

fn connect(spec: &LoadSpec) -> Result<TcpStream, Outcome> {
    let c = match spec.source {
        None => TcpStream::connect_timeout(&spec.target, spec.timeout),
        Some(ip) => connect_from(ip, spec),
    }
    .map_err(|e| classify(&e))?;
    let _ = c.set_read_timeout(Some(spec.timeout));
    let _ = c.set_write_timeout(Some(spec.timeout));
    let _ = c.set_nodelay(true);
    Ok(c)
}

/// A connection from `ip` (a port the kernel picks) to the target.
fn connect_from(ip: std::net::IpAddr, spec: &LoadSpec) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(
        Domain::for_address(spec.target),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    s.bind(&SocketAddr::new(ip, 0).into())?;
    s.connect_timeout(&spec.target.into(), spec.timeout)?;
    Ok(s.into())
}

/// What a client thread does.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// `GET /` on one kept-alive connection.
    KeepAlive,
    /// `GET /`, one connection per request.
    Fresh,
    /// Bulk client number n: alternately a [`BULK_DOWNLOAD`] and an upload, kept alive,
    /// two requests a second at most.
    Bulk(usize),
}

fn client(spec: &LoadSpec, kind: Kind, shared: &Mutex<Shared>, stop: &AtomicBool, start: Instant) {
    let host = spec.target.ip().to_string();
    let keepalive = !matches!(kind, Kind::Fresh);
    let rate = match kind {
        Kind::Bulk(_) => 2,
        _ => spec.rate_per_client.max(1),
    };
    let pace = Duration::from_secs_f64(1.0 / f64::from(rate));
    let upload = crate::http::pattern(BULK_UPLOAD_BYTES);
    let upload_path = match kind {
        Kind::Bulk(n) => format!("/uploads/bulk-{n}"),
        _ => String::new(),
    };
    let mut sent = 0u64;
    let mut conn: Option<TcpStream> = None;
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < spec.max_duration {
        let req = match kind {
            Kind::Bulk(_) if sent.is_multiple_of(2) => Req::Download(BULK_DOWNLOAD),
            Kind::Bulk(_) => Req::Upload(&upload_path, &upload),
            _ => Req::Page,
        };
        sent += 1;
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next += pace;
        if next < Instant::now() {
            next = Instant::now();
        }
        let reused = conn.is_some();
        let mut c = match conn.take() {
            Some(c) => c,
            None => match connect(spec) {
                Ok(c) => c,
                Err(o) => {
                    sample(shared, start, &format!("{kind:?} client: connect: {o:?}"));
                    record(shared, start, o);
                    continue;
                }
            },
        };
        // The failed connection's port, to find it in a capture (JUNEAU_LAB_CAPTURE).
        let mut port = c.local_addr().map(|a| a.port()).unwrap_or(0);
        let outcome = match request(&mut c, &host, keepalive, req) {
            Ok(a) => {
                if keepalive && a.reusable {
                    conn = Some(c);
                }
                note_bulk(shared, req, a.body);
                Outcome::Ok
            }
            Err(Failure {
                outcome: first,
                got_any: false,
                ..
            }) if reused => {
                {
                    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
                    match first {
                        Outcome::Reset => s.report.keepalive_resets += 1,
                        Outcome::Timeout => s.report.keepalive_timeouts += 1,
                        _ => {}
                    }
                }
                // The reused connection failed before any answer: retry once, new connection.
                let retried = match connect(spec) {
                    Ok(mut c2) => {
                        port = c2.local_addr().map(|a| a.port()).unwrap_or(0);
                        match request(&mut c2, &host, keepalive, req) {
                            Ok(a) => {
                                if a.reusable {
                                    conn = Some(c2);
                                }
                                note_bulk(shared, req, a.body);
                                Outcome::Ok
                            }
                            Err(f) => f.outcome,
                        }
                    }
                    Err(o) => o,
                };
                if matches!(retried, Outcome::Ok) {
                    shared
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .report
                        .keepalive_retries += 1;
                }
                retried
            }
            Err(f) => f.outcome,
        };
        if !matches!(outcome, Outcome::Ok) {
            let what = format!("{kind:?} client port {port}: {outcome:?}");
            sample(shared, start, &what);
        }
        record(shared, start, outcome);
    }
}

/// Keeps the first [`MAX_SAMPLES`] failures' descriptions, with their time.
fn sample(shared: &Mutex<Shared>, start: Instant, what: &str) {
    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
    if s.report.failure_samples.len() < MAX_SAMPLES {
        let t = start.elapsed().as_secs_f64();
        s.report.failure_samples.push(format!("t={t:.3}s {what}"));
    }
}

/// Failures described in [`LoadReport::failure_samples`] at most.
const MAX_SAMPLES: usize = 20;

/// A saturating client: like a wrk connection, the next request as soon as an answer is
/// in, on one kept-alive connection; a new connection only after a failure or an
/// announced close; nothing retried.
fn saturating_client(spec: &LoadSpec, shared: &Mutex<Shared>, stop: &AtomicBool, start: Instant) {
    let host = spec.target.ip().to_string();
    // The open connection, with the Pod that answered last on it and how many times.
    let mut conn: Option<(TcpStream, Option<String>, u64)> = None;
    let mut counts = SaturatingReport::default();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < spec.max_duration {
        let (mut c, served_by, answers) = match conn.take() {
            Some(c) => c,
            None => match connect(spec) {
                Ok(c) => (c, None, 0),
                Err(o) => {
                    counts.requests += 1;
                    match o {
                        Outcome::Timeout => counts.timeouts += 1,
                        _ => counts.connect_errors += 1,
                    }
                    sample(shared, start, &format!("saturating client: connect: {o:?}"));
                    // As wrk does not, but a refused connect would spin: a short pause.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            },
        };
        counts.requests += 1;
        match request(&mut c, &host, true, Req::Page) {
            Ok(a) => {
                counts.ok += 1;
                if a.reusable {
                    conn = Some((c, a.served_by, answers + 1));
                } else {
                    counts.closes_announced += 1;
                }
            }
            Err(f) => {
                match (&f.outcome, f.at_write) {
                    (Outcome::Timeout | Outcome::BodyStalled, _) => counts.timeouts += 1,
                    (Outcome::Status, _) => counts.bad_status += 1,
                    (_, true) => counts.write_errors += 1,
                    (_, false) => counts.read_errors += 1,
                }
                let port = c.local_addr().map(|a| a.port()).unwrap_or(0);
                let pod = served_by.as_deref().unwrap_or("-");
                let stage = if f.at_write {
                    "writing"
                } else if f.got_any {
                    "reading the answer"
                } else {
                    "before any answer byte"
                };
                sample(
                    shared,
                    start,
                    &format!(
                        "saturating client port {port} (last answered by {pod}, {answers} answers): {:?} {stage}",
                        f.outcome
                    ),
                );
            }
        }
    }
    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
    let t = &mut s.report.saturating;
    t.requests += counts.requests;
    t.ok += counts.ok;
    t.read_errors += counts.read_errors;
    t.write_errors += counts.write_errors;
    t.connect_errors += counts.connect_errors;
    t.timeouts += counts.timeouts;
    t.bad_status += counts.bad_status;
    t.closes_announced += counts.closes_announced;
}

/// Runs the load until `max_duration` or the stop file; returns the counts.
pub fn run(spec: &LoadSpec) -> Result<LoadReport> {
    if spec.keepalive_clients
        + spec.new_connection_clients
        + spec.bulk_clients
        + spec.saturating_clients
        == 0
    {
        bail!("no clients");
    }
    let shared = Arc::new(Mutex::new(Shared::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut threads = Vec::new();
    let small = spec.keepalive_clients + spec.new_connection_clients;
    for i in 0..small + spec.bulk_clients {
        let kind = if i < spec.keepalive_clients {
            Kind::KeepAlive
        } else if i < small {
            Kind::Fresh
        } else {
            Kind::Bulk(i - small)
        };
        let (spec, shared, stop) = (spec.clone(), shared.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            client(&spec, kind, &shared, &stop, start)
        }));
    }
    for _ in 0..spec.saturating_clients {
        let (spec, shared, stop) = (spec.clone(), shared.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            saturating_client(&spec, &shared, &stop, start)
        }));
    }
    while start.elapsed() < spec.max_duration {
        if spec.stop_file.as_ref().is_some_and(|f| f.exists()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
    let end = Instant::now();
    let tail_gap = end.duration_since(s.last_ok.unwrap_or(start)).as_millis() as u64;
    s.report.longest_gap_ms = s.report.longest_gap_ms.max(tail_gap);
    s.report.duration_ms = end.duration_since(start).as_millis() as u64;
    Ok(s.report.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// How the test server ends a connection.
    #[derive(Clone, Copy)]
    enum End {
        /// Answers 3 requests, then closes without notice (FIN, as nginx does at its
        /// idle `keepalive_timeout`), reading what comes after so the close stays clean.
        Silent,
        /// Answers 3 requests, the last with `Connection: close` (as nginx does at
        /// `keepalive_requests`), then closes.
        Announced,
        /// Resets every connection.
        Reset,
    }

    fn server(end: End) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 2048];
                    for i in 0..3 {
                        if matches!(end, End::Reset) {
                            // Closing with the request unread makes the kernel send RST.
                            let _ = c.peek(&mut buf);
                            return;
                        }
                        let Ok(n) = c.read(&mut buf) else { return };
                        if n == 0 {
                            return;
                        }
                        let announce = matches!(end, End::Announced) && i == 2;
                        let close = if announce {
                            "Connection: close\r\n"
                        } else {
                            ""
                        };
                        let answer =
                            format!("HTTP/1.1 200 OK\r\n{close}Content-Length: 2\r\n\r\nok");
                        let _ = c.write_all(answer.as_bytes());
                    }
                    // FIN first, then drain: a request already on its way is read, not
                    // answered with RST.
                    let _ = c.shutdown(std::net::Shutdown::Write);
                    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                    while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
                });
            }
        });
        addr
    }

    fn spec(target: SocketAddr) -> LoadSpec {
        LoadSpec {
            target,
            source: None,
            keepalive_clients: 1,
            new_connection_clients: 1,
            rate_per_client: 100,
            max_duration: Duration::from_millis(600),
            stop_file: None,
            timeout: Duration::from_secs(1),
            bulk_clients: 0,
            saturating_clients: 0,
        }
    }

    #[test]
    fn a_healthy_server_gives_no_failures_and_closed_keepalives_are_retried() -> Result<()> {
        let r = run(&spec(server(End::Silent)))?;
        assert!(r.requests > 40, "{r:?}");
        assert_eq!(r.failed, 0, "{r:?}");
        assert_eq!(r.ok, r.requests, "{r:?}");
        // The server closes each connection after 3 answers.
        assert!(r.keepalive_retries > 0, "{r:?}");
        assert!(r.longest_gap_ms < 500, "{r:?}");
        Ok(())
    }

    /// A body that stops before its Content-Length is a failure counted as truncated.
    #[test]
    fn a_body_cut_short_is_a_truncated_failure() -> Result<()> {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                let mut buf = [0u8; 2048];
                let _ = c.read(&mut buf);
                let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\npartial");
                let _ = c.shutdown(std::net::Shutdown::Write);
                while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
            }
        });
        let r = run(&spec(addr))?;
        assert!(r.requests > 0, "{r:?}");
        assert_eq!(r.truncated, r.failed, "{r:?}");
        assert_eq!(r.ok, 0, "{r:?}");
        Ok(())
    }

    /// A body that stops arriving while the connection stays open is a stall, not a cut.
    #[test]
    fn a_body_that_stops_arriving_is_a_stall_not_a_cut() -> Result<()> {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 2048];
                    let _ = c.read(&mut buf);
                    let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\npart");
                    // Open, silent, longer than the client's 1 s timeout.
                    std::thread::sleep(Duration::from_secs(2));
                });
            }
        });
        let mut sp = spec(addr);
        sp.new_connection_clients = 0;
        let r = run(&sp)?;
        assert!(r.body_stalls > 0, "{r:?}");
        assert_eq!((r.truncated, r.ok), (0, 0), "{r:?}");
        assert_eq!(r.body_stalls, r.failed, "{r:?}");
        Ok(())
    }

    /// A server that answers the first request of each connection and, on the second,
    /// resets the connection (what a Pod that never saw a connection does) or, with
    /// `reset` false, never answers (what a node dropping the connection's packets does).
    fn server_failing_reused_connections(reset: bool) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 2048];
                    if !matches!(c.read(&mut buf), Ok(n) if n > 0) {
                        return;
                    }
                    let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
                    if !reset {
                        std::thread::sleep(Duration::from_secs(3));
                        return;
                    }
                    // Wait for the next request, then close with it unread: RST.
                    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                    let _ = c.peek(&mut buf);
                });
            }
        });
        addr
    }

    #[test]
    fn resets_and_stalls_of_reused_keepalive_connections_are_counted_even_when_the_retry_works(
    ) -> Result<()> {
        let mut sp = spec(server_failing_reused_connections(true));
        sp.new_connection_clients = 0;
        let r = run(&sp)?;
        assert!(r.keepalive_resets > 0 && r.keepalive_timeouts == 0, "{r:?}");
        assert_eq!(r.failed, 0, "the retries on new connections work: {r:?}");
        // A server that stops answering on a reused connection: a keep-alive timeout.
        let mut sp = spec(server_failing_reused_connections(false));
        sp.new_connection_clients = 0;
        let r = run(&sp)?;
        assert!(r.keepalive_timeouts > 0 && r.keepalive_resets == 0, "{r:?}");
        assert_eq!(r.failed, 0, "{r:?}");
        // A server that closes cleanly is not a reset.
        let r = run(&spec(server(End::Silent)))?;
        assert!(r.keepalive_retries > 0 && r.keepalive_resets == 0, "{r:?}");
        Ok(())
    }

    #[test]
    fn an_announced_close_is_honoured_without_a_retry() -> Result<()> {
        let r = run(&spec(server(End::Announced)))?;
        assert!(r.requests > 40, "{r:?}");
        assert_eq!(r.failed, 0, "{r:?}");
        assert_eq!(r.keepalive_retries, 0, "{r:?}");
        assert_eq!(r.keepalive_resets + r.keepalive_timeouts, 0, "{r:?}");
        Ok(())
    }

    fn saturating(target: SocketAddr) -> LoadSpec {
        LoadSpec {
            keepalive_clients: 0,
            new_connection_clients: 0,
            saturating_clients: 2,
            ..spec(target)
        }
    }

    /// wrk's semantics: no retry, so a server that closes a kept-alive connection
    /// without saying so makes a read error, before any byte of the next answer.
    #[test]
    fn a_silent_close_is_a_read_error_for_a_saturating_client() -> Result<()> {
        let r = run(&saturating(server(End::Silent)))?;
        let t = &r.saturating;
        assert!(t.requests > 100, "unpaced: {r:?}");
        assert!(t.read_errors > 0, "{r:?}");
        assert_eq!(t.failed(), t.read_errors, "{r:?}");
        assert_eq!(t.ok + t.failed(), t.requests, "{r:?}");
        assert!(
            r.failure_samples
                .iter()
                .any(|f| f.contains("before any answer byte") && f.contains("3 answers")),
            "{:?}",
            r.failure_samples
        );
        assert_eq!(r.requests, 0, "no paced client ran: {r:?}");
        Ok(())
    }

    /// An announced close (`Connection: close`) is the clean way: no error.
    #[test]
    fn an_announced_close_is_no_error_for_a_saturating_client() -> Result<()> {
        let r = run(&saturating(server(End::Announced)))?;
        let t = &r.saturating;
        assert!(t.requests > 100 && t.closes_announced > 0, "{r:?}");
        assert_eq!(t.failed(), 0, "{r:?}");
        assert_eq!(t.ok, t.requests, "{r:?}");
        // Resets are errors; nothing listening: connect errors.
        let r = run(&saturating(server(End::Reset)))?;
        assert!(r.saturating.ok == 0 && r.saturating.failed() > 0, "{r:?}");
        let closed = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let r = run(&saturating(closed))?;
        assert!(
            r.saturating.connect_errors > 0 && r.saturating.failed() == r.saturating.requests,
            "{r:?}"
        );
        Ok(())
    }

    #[test]
    fn a_report_survives_its_json() -> Result<()> {
        let r = run(&saturating(server(End::Silent)))?;
        assert_eq!(LoadReport::from_json(&r.to_json())?, r);
        Ok(())
    }

    #[test]
    fn resets_and_refused_connections_count_as_failures() -> Result<()> {
        let r = run(&spec(server(End::Reset)))?;
        assert_eq!(r.ok, 0, "{r:?}");
        assert_eq!(r.failed, r.requests, "{r:?}");
        assert!(r.resets > 0, "{r:?}");
        assert!(r.longest_gap_ms >= 500, "{r:?}");
        // Nothing listens: connection refused.
        let closed = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let r = run(&spec(closed))?;
        assert_eq!(r.ok, 0, "{r:?}");
        assert!(r.failed > 0 && r.refused == r.failed, "{r:?}");
        Ok(())
    }
}
