//! # juneau-telemetry — the HTTP endpoint every Juneau process serves
//!
//! Owns: the small HTTP/1.1 server (hyper) behind `--metrics-addr` of every process
//! (controller, agent, dataplane, BGP speaker): `GET /metrics` (OpenMetrics text encoded by `prometheus-client`),
//! `GET /healthz` (liveness) and `GET /readyz` (readiness), and the rule shared by every
//! process for its *default* address: taken → a warning and no endpoint; an address given
//! explicitly must bind; and the [`Limits`] on what clients can hold (connections at
//! once, time to send headers, life of a connection), since the endpoint listens on
//! `0.0.0.0` by default; and [`take_over`], the first step of every node process: wait
//! for the one it replaces (an upgrade's handover, `juneau_control::succession`), logged.
//!
//! Must not touch: what the metrics mean or when a process is live or ready — each
//! process answers that through [`Endpoint`]. Nothing here runs on a forwarding path:
//! the endpoint runs on its own thread or task and calls the process back per request.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use prometheus_client::registry::Registry;

/// The OpenMetrics content type `prometheus-client` encodes.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a process answers on its endpoint.
pub trait Endpoint: Send + Sync + 'static {
    /// Fills `registry` with the process's metrics at scrape time.
    fn collect(&self, registry: &mut Registry);
    /// The OpenMetrics text of `/metrics`: by default a fresh registry filled by
    /// [`Endpoint::collect`] per scrape; a process that keeps one long-lived registry
    /// of metric handles (the controller and the agent) encodes that instead.
    fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::default();
        self.collect(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry)?;
        Ok(text)
    }
    /// `Ok` while the process is alive; `Err(why)` makes `/healthz` answer 503.
    fn live(&self) -> Result<(), String>;
    /// `Ok` once the process does its job; `Err(why)` makes `/readyz` answer 503.
    fn ready(&self) -> Result<(), String>;
}

/// Errors of binding the endpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address could not be bound.
    #[error("binding the metrics address {addr} (--metrics-addr): {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The endpoint's thread or runtime could not be started.
    #[error("starting the metrics endpoint: {0}")]
    Start(std::io::Error),
}

/// Takes `component`'s succession lock on the node whose state file is `state_file`,
/// waiting (logged) while the process this one replaces runs. Keep it until exit, and
/// drop it after the process's ports are closed.
pub fn take_over(
    state_file: &std::path::Path,
    component: &str,
) -> Result<juneau_control::succession::Succession, juneau_control::succession::SuccessionError> {
    let lock = juneau_control::succession::path_for_state_file(state_file, component);
    let asked = std::time::Instant::now();
    let held = juneau_control::succession::take(&lock, |h| {
        tracing::info!(holder_pid = ?h.holder, lock = %lock.display(), "another {component} runs on this node: waiting for it to exit (upgrade handover)");
    })?;
    if held.waited {
        tracing::info!(
            waited_ms = asked.elapsed().as_millis() as u64,
            "the previous {component} exited: taking over"
        );
    }
    Ok(held)
}

/// How long an address given explicitly may stay taken before binding it fails: a
/// node Pod's process that took over from its predecessor (an upgrade's handover,
/// `juneau_control::succession`) starts while that one's sockets are being closed.
pub const GIVEN_ADDR_PATIENCE: std::time::Duration = std::time::Duration::from_secs(3);

/// Binds `given` (must succeed, within [`GIVEN_ADDR_PATIENCE`] while it is in use) or,
/// when none is given, `default` (a failure is logged and `None` returned: several
/// instances on one host cannot all have the default).
pub fn bind(
    given: Option<SocketAddr>,
    default: SocketAddr,
) -> Result<Option<std::net::TcpListener>, Error> {
    let addr = given.unwrap_or(default);
    let patience = if given.is_some() {
        GIVEN_ADDR_PATIENCE
    } else {
        std::time::Duration::ZERO
    };
    match bind_patiently(addr, patience) {
        Ok(l) => Ok(Some(l)),
        Err(e) if given.is_none() => {
            tracing::warn!(%addr, error = %e, "default metrics address taken: running without /metrics, /healthz and /readyz");
            Ok(None)
        }
        Err(source) => Err(Error::Bind { addr, source }),
    }
}

/// Parses a `--metrics-addr` value: `IPv4:PORT`, `[IPv6]:PORT`, or `IPv6:PORT` without
/// brackets (the port after the last colon), so a manifest can write `$(HOST_IP):9743`
/// whatever the family of the node's address (the Downward API gives it bare).
pub fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let bad = || format!("{s:?} is not ADDRESS:PORT (e.g. 10.0.0.1:9743, [fd00::1]:9743)");
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let ip = host.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
    let port = port.parse::<u16>().map_err(|_| bad())?;
    Ok(SocketAddr::new(ip.into(), port))
}

/// Binds `addr`, trying again every 10 ms for up to `patience` while it is in use.
fn bind_patiently(
    addr: SocketAddr,
    patience: std::time::Duration,
) -> std::io::Result<std::net::TcpListener> {
    let started = std::time::Instant::now();
    loop {
        match std::net::TcpListener::bind(addr) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && started.elapsed() < patience => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => {
                if r.is_ok() && started.elapsed() >= std::time::Duration::from_millis(10) {
                    tracing::info!(%addr, waited_ms = started.elapsed().as_millis() as u64, "metrics address freed by the process this one replaces");
                }
                return r;
            }
        }
    }
}

/// Encodes what `ep` serves on `/metrics` ([`Endpoint::encode`]).
pub fn encode(ep: &dyn Endpoint) -> Result<String, std::fmt::Error> {
    ep.encode()
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn probe(result: Result<(), String>, ok: &str) -> Response<Full<Bytes>> {
    match result {
        Ok(()) => reply(StatusCode::OK, "text/plain", format!("{ok}\n")),
        Err(why) => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("{why}\n"),
        ),
    }
}

/// The answer to one request.
pub fn route(path: &str, ep: &dyn Endpoint) -> Response<Full<Bytes>> {
    match path {
        "/metrics" => match encode(ep) {
            Ok(text) => reply(StatusCode::OK, OPENMETRICS, text),
            Err(e) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                format!("encoding metrics: {e}\n"),
            ),
        },
        "/healthz" => probe(ep.live(), "ok"),
        "/readyz" => probe(ep.ready(), "ready"),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}

/// Bounds on what clients of the endpoint can hold. The endpoint listens on `0.0.0.0` by
/// default (restrict it with `--metrics-addr`, see docs/security.md), so anyone who reaches
/// the port may connect: without a bound, idle or slow connections would pile up as tasks
/// and file descriptors in the process they probe (the dataplane, the BGP speaker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; one more is accepted and closed at once (so the
    /// listen backlog does not fill with connections no one will serve).
    pub max_connections: usize,
    /// Time a client has to send the headers of a request, counted from when the server
    /// starts reading them: a client that trickles them, or says nothing at all, is cut
    /// off after this.
    pub header_timeout: std::time::Duration,
    /// Longest life of one connection, whatever it does: a client that never sends a
    /// byte, or reads its answer slowly, is cut off after this.
    pub connection_lifetime: std::time::Duration,
}

impl Default for Limits {
    /// 64 connections (Prometheus and the kubelet need a handful), 5 s for headers, 30 s
    /// per connection.
    fn default() -> Self {
        Limits {
            max_connections: 64,
            header_timeout: std::time::Duration::from_secs(5),
            connection_lifetime: std::time::Duration::from_secs(30),
        }
    }
}

/// Serves `ep` on `listener` until the runtime ends, within the default [`Limits`].
pub async fn serve(listener: tokio::net::TcpListener, ep: Arc<dyn Endpoint>) {
    serve_with_limits(listener, ep, Limits::default()).await
}

/// Serves `ep` on `listener` until the runtime ends, within `limits`.
pub async fn serve_with_limits(
    listener: tokio::net::TcpListener,
    ep: Arc<dyn Endpoint>,
    limits: Limits,
) {
    if let Ok(a) = listener.local_addr() {
        tracing::info!(addr = %a, max_connections = limits.max_connections, "serving /metrics, /healthz and /readyz");
    }
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut refused: u64 = 0;
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener accept");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refused += 1;
            // Powers of two only: a flood must not become a flood of log lines.
            if refused.is_power_of_two() {
                tracing::warn!(%peer, refused, max = limits.max_connections, "metrics endpoint full: connection closed");
            }
            drop(sock);
            continue;
        };
        let ep = ep.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let r = route(req.uri().path(), ep.as_ref());
                async move { Ok::<_, Infallible>(r) }
            });
            let io = hyper_util::rt::TokioIo::new(sock);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(io, svc);
            if let Ok(Err(e)) = tokio::time::timeout(limits.connection_lifetime, conn).await {
                tracing::debug!(error = %e, "metrics connection");
            }
        });
    }
}

/// Serves `ep` on `listener` from a thread of its own (with a one-thread runtime), for
/// processes without an async runtime (the dataplane), within the default [`Limits`].
pub fn spawn_thread(
    listener: std::net::TcpListener,
    ep: Arc<dyn Endpoint>,
) -> Result<std::thread::JoinHandle<()>, Error> {
    spawn_thread_with_limits(listener, ep, Limits::default())
}

/// [`spawn_thread`] within `limits`.
pub fn spawn_thread_with_limits(
    listener: std::net::TcpListener,
    ep: Arc<dyn Endpoint>,
    limits: Limits,
) -> Result<std::thread::JoinHandle<()>, Error> {
    listener.set_nonblocking(true).map_err(Error::Start)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Start)?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => serve_with_limits(l, ep, limits).await,
                    Err(e) => tracing::error!(error = %e, "metrics listener"),
                }
            })
        })
        .map_err(Error::Start)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use std::io::{ErrorKind, Read as _, Write as _};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn a_listen_address_is_parsed_in_either_family_bracketed_or_not() {
        for (given, want) in [
            ("10.0.0.7:9743", "10.0.0.7:9743"),
            ("0.0.0.0:0", "0.0.0.0:0"),
            ("[fd00::7]:9743", "[fd00::7]:9743"),
            ("fd00::7:9743", "[fd00::7]:9743"),
        ] {
            assert_eq!(
                parse_listen_addr(given),
                Ok(want.parse().unwrap()),
                "{given}"
            );
        }
        for bad in [
            "",
            "10.0.0.7",
            ":9743",
            "10.0.0.7:port",
            "10.0.0.7:70000",
            "node-a:9743",
            "$(HOST_IP):9743",
        ] {
            let e = parse_listen_addr(bad).unwrap_err();
            assert!(e.contains("ADDRESS:PORT"), "{bad}: {e}");
        }
    }

    struct Fake {
        ready: AtomicBool,
    }

    impl Endpoint for Fake {
        fn collect(&self, registry: &mut Registry) {
            let c = Counter::<u64>::default();
            c.inc_by(7);
            registry.register("juneau_fake_things", "Things counted", c);
        }
        fn live(&self) -> Result<(), String> {
            Ok(())
        }
        fn ready(&self) -> Result<(), String> {
            if self.ready.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("not ready: nothing programmed yet".into())
            }
        }
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_and_probes_from_a_thread() {
        let fake = Arc::new(Fake {
            ready: AtomicBool::new(false),
        });
        let l = bind(
            Some("127.0.0.1:0".parse().unwrap()),
            "127.0.0.1:1".parse().unwrap(),
        )
        .unwrap()
        .unwrap();
        let addr = l.local_addr().unwrap();
        spawn_thread(l, fake.clone()).unwrap();
        let m = get(addr, "/metrics");
        assert!(m.starts_with("HTTP/1.1 200"), "{m}");
        assert!(m.contains("# TYPE juneau_fake_things counter"), "{m}");
        assert!(m.contains("juneau_fake_things_total 7"), "{m}");
        assert!(m.contains("# EOF"), "{m}");
        assert!(get(addr, "/healthz").starts_with("HTTP/1.1 200"));
        let r = get(addr, "/readyz");
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(r.contains("nothing programmed yet"), "{r}");
        fake.ready.store(true, Ordering::Relaxed);
        assert!(get(addr, "/readyz").starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/nope").starts_with("HTTP/1.1 404"));
    }

    fn start(limits: Limits) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fake = Arc::new(Fake {
            ready: AtomicBool::new(true),
        });
        spawn_thread_with_limits(l, fake, limits).unwrap();
        addr
    }

    /// How long until the server closes `s` (EOF or reset), at most `within`; `None`:
    /// still open then.
    fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> Option<Duration> {
        let t0 = Instant::now();
        let mut buf = [0u8; 256];
        loop {
            let left = within.checked_sub(t0.elapsed())?;
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match s.read(&mut buf) {
                Ok(0) => return Some(t0.elapsed()),
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return None
                }
                Err(_) => return Some(t0.elapsed()),
            }
        }
    }

    #[test]
    fn connections_beyond_the_cap_are_closed_and_healthz_answers_once_they_go() {
        let addr = start(Limits {
            max_connections: 8,
            header_timeout: Duration::from_secs(10),
            connection_lifetime: Duration::from_secs(30),
        });
        // Eight idle connections take every slot.
        let held: Vec<_> = (0..8)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // Every one beyond the cap is closed at once instead of being held.
        let mut extra: Vec<_> = (0..20)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        for s in &mut extra {
            assert!(
                closed_within(s, Duration::from_secs(2)).is_some(),
                "a connection beyond the cap was held"
            );
        }
        // The held ones are still served (a request on one is answered).
        let mut first = held.into_iter();
        let mut s = first.next().unwrap();
        write!(
            s,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        // Once the clients go away, /healthz answers at once.
        drop(first);
        let t0 = Instant::now();
        let ok = loop {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let _ = write!(
                s,
                "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            );
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.starts_with("HTTP/1.1 200") || t0.elapsed() > Duration::from_secs(2) {
                break out;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok:?}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_slow_client_is_cut_off() {
        let addr = start(Limits {
            max_connections: 8,
            header_timeout: Duration::from_millis(500),
            connection_lifetime: Duration::from_secs(2),
        });
        // Headers one byte every 100 ms: cut at the header timeout.
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let t0 = Instant::now();
        for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\n" {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            if t0.elapsed() > Duration::from_secs(2) {
                break;
            }
        }
        closed_within(&mut s, Duration::from_secs(3)).expect("a trickling client is cut off");
        let cut = t0.elapsed();
        assert!(cut < Duration::from_millis(1_800), "cut after {cut:?}");
        // A client that never says anything is cut too (by the header timeout: 0.5 s
        // measured; at the latest by the lifetime).
        let mut idle = std::net::TcpStream::connect(addr).unwrap();
        let d =
            closed_within(&mut idle, Duration::from_secs(4)).expect("an idle client is cut off");
        assert!(d < Duration::from_millis(2_500), "{d:?}");
    }

    #[test]
    fn an_explicit_address_must_bind_the_default_may_not() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = held.local_addr().unwrap();
        let e = bind(Some(taken), taken).unwrap_err();
        assert!(e.to_string().contains("--metrics-addr"), "{e}");
        assert!(bind(None, taken).unwrap().is_none());
    }

    #[test]
    fn an_explicit_address_freed_while_waiting_is_bound() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = held.local_addr().unwrap();
        // The predecessor closes its listener a moment after the successor tries.
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        let l = bind(Some(taken), taken).unwrap().expect("bound once freed");
        assert_eq!(l.local_addr().unwrap(), taken);
        closer.join().unwrap();
    }
}
