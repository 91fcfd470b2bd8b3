//! # juneau-telemetry — the HTTP endpoint every Juneau process serves
//!
//! Owns: the small HTTP/1.1 server (hyper) behind `--metrics-addr` of every process
//! (controller, agent, dataplane, BGP speaker): `GET /metrics` (OpenMetrics text encoded by `prometheus-client`),
//! `GET /healthz` (liveness) and `GET /readyz` (readiness), and the rule shared by every
//! process for its *default* address: taken → a warning and no endpoint; an address given
//! explicitly must bind.
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

/// Binds `given` (must succeed) or, when none is given, `default` (a failure is logged
/// and `None` returned: several instances on one host cannot all have the default).
pub fn bind(
    given: Option<SocketAddr>,
    default: SocketAddr,
) -> Result<Option<std::net::TcpListener>, Error> {
    let addr = given.unwrap_or(default);
    match std::net::TcpListener::bind(addr) {
        Ok(l) => Ok(Some(l)),
        Err(e) if given.is_none() => {
            tracing::warn!(%addr, error = %e, "default metrics address taken: running without /metrics, /healthz and /readyz");
            Ok(None)
        }
        Err(source) => Err(Error::Bind { addr, source }),
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

/// Serves `ep` on `listener` until the runtime ends.
pub async fn serve(listener: tokio::net::TcpListener, ep: Arc<dyn Endpoint>) {
    if let Ok(a) = listener.local_addr() {
        tracing::info!(addr = %a, "serving /metrics, /healthz and /readyz");
    }
    loop {
        let sock = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener accept");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let ep = ep.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let r = route(req.uri().path(), ep.as_ref());
                async move { Ok::<_, Infallible>(r) }
            });
            let io = hyper_util::rt::TokioIo::new(sock);
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, svc);
            // A client that opens a connection and says nothing is dropped.
            if let Ok(Err(e)) = tokio::time::timeout(std::time::Duration::from_secs(30), conn).await
            {
                tracing::debug!(error = %e, "metrics connection");
            }
        });
    }
}

/// Serves `ep` on `listener` from a thread of its own (with a one-thread runtime), for
/// processes without an async runtime (the dataplane).
pub fn spawn_thread(
    listener: std::net::TcpListener,
    ep: Arc<dyn Endpoint>,
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
                    Ok(l) => serve(l, ep).await,
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
    use std::io::{Read as _, Write as _};
    use std::sync::atomic::{AtomicBool, Ordering};

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

    #[test]
    fn an_explicit_address_must_bind_the_default_may_not() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = held.local_addr().unwrap();
        let e = bind(Some(taken), taken).unwrap_err();
        assert!(e.to_string().contains("--metrics-addr"), "{e}");
        assert!(bind(None, taken).unwrap().is_none());
    }
}
