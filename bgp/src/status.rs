//! Per-peer status: a JSON file the node agent reads (written atomically on every change)
//! and Prometheus metrics.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

use crate::fsm::State;

/// What an operator wants to know about one peer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PeerStatus {
    /// The peer's name (BGPPeer object).
    pub name: String,
    /// The router's address.
    pub peer_address: Ipv4Addr,
    /// Session state.
    pub state: State,
    /// Unix time (seconds) the session became Established, if it is.
    pub established_since_unix: Option<u64>,
    /// Seconds Established, as of `written_unix` (the file is rewritten at least every
    /// [`REFRESH`] while a session is up).
    pub uptime_seconds: u64,
    /// The last error (NOTIFICATION sent/received, connection failure...).
    pub last_error: Option<String>,
    /// /32s currently announced to this peer.
    pub prefixes_announced: usize,
    /// Prefixes the peer sent us (discarded).
    pub prefixes_received: u64,
    /// Times an Established session went down.
    pub session_flaps: u64,
    /// UPDATE messages sent.
    pub updates_sent: u64,
    /// Malformed UPDATEs handled as treat-as-withdraw (RFC 7606).
    pub treat_as_withdraw: u64,
    /// Graceful restart was negotiated on the current session.
    pub graceful_restart: bool,
    /// Which run of the peer's task owns this entry (a reconfigured peer's old task must
    /// not overwrite its successor's status).
    #[serde(skip)]
    pub owner: u64,
}

impl PeerStatus {
    /// A peer that has just been configured.
    pub fn new(name: &str, peer_address: Ipv4Addr) -> Self {
        PeerStatus {
            name: name.to_string(),
            peer_address,
            state: State::Idle,
            established_since_unix: None,
            uptime_seconds: 0,
            last_error: None,
            prefixes_announced: 0,
            prefixes_received: 0,
            session_flaps: 0,
            updates_sent: 0,
            treat_as_withdraw: 0,
            graceful_restart: false,
            owner: 0,
        }
    }
}

/// The whole status file.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    /// The node.
    pub node: String,
    /// Our BGP identifier, once known.
    pub router_id: Option<Ipv4Addr>,
    /// Generation of the control state last applied.
    pub state_generation: u64,
    /// Unix time of this write.
    pub written_unix: u64,
    /// Per peer, by name.
    pub peers: BTreeMap<String, PeerStatus>,
    /// VIPs the agent wants announced that are withdrawn because the dataplane cannot
    /// serve them (dead, stopped, or VIP not programmed), with the reason.
    #[serde(default)]
    pub held_back: BTreeMap<Ipv4Addr, String>,
}

/// A metric: name, help text, value of one peer.
type Metric = (&'static str, &'static str, fn(&PeerStatus) -> u64);

/// Shared status, with a wake-up for the file writer.
#[derive(Debug, Default)]
pub struct StatusHub {
    inner: Mutex<Status>,
    changed: Notify,
}

/// How often the status file is rewritten while a session is up, to refresh uptimes.
pub const REFRESH: std::time::Duration = std::time::Duration::from_secs(10);

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl StatusHub {
    /// A new, empty hub.
    pub fn new() -> Arc<Self> {
        Arc::new(StatusHub::default())
    }

    /// Changes the status and wakes the writer.
    pub fn update(&self, f: impl FnOnce(&mut Status)) {
        {
            let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut s);
        }
        self.changed.notify_one();
    }

    /// Changes one peer's status (if the peer is known).
    pub fn peer(&self, name: &str, f: impl FnOnce(&mut PeerStatus)) {
        self.update(|s| {
            if let Some(p) = s.peers.get_mut(name) {
                f(p)
            }
        })
    }

    /// Changes one peer's status if `owner` still owns the entry.
    pub fn peer_owned(&self, name: &str, owner: u64, f: impl FnOnce(&mut PeerStatus)) {
        self.update(|s| {
            if let Some(p) = s.peers.get_mut(name).filter(|p| p.owner == owner) {
                f(p)
            }
        })
    }

    /// A copy of the current status.
    pub fn snapshot(&self) -> Status {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Writes the status file (temp file + rename) every time something changed, and
    /// every [`REFRESH`] while a session is up so that `uptime_seconds` stays current.
    pub async fn write_loop(self: Arc<Self>, path: PathBuf) {
        loop {
            let mut s = self.snapshot();
            s.written_unix = unix_now();
            let mut any_up = false;
            for p in s.peers.values_mut() {
                if let Some(t) = p.established_since_unix {
                    p.uptime_seconds = s.written_unix.saturating_sub(t);
                    any_up = true;
                }
            }
            if let Err(e) = write_atomically(&path, &s) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write status file");
            }
            if any_up {
                let _ = tokio::time::timeout(REFRESH, self.changed.notified()).await;
            } else {
                self.changed.notified().await;
            }
        }
    }

    /// The Prometheus text exposition of the current status.
    pub fn metrics(&self) -> String {
        let s = self.snapshot();
        let mut m = String::new();
        let states = [
            State::Idle,
            State::Connect,
            State::Active,
            State::OpenSent,
            State::OpenConfirm,
            State::Established,
        ];
        m.push_str("# HELP juneau_bgp_peer_up 1 if the session with the peer is Established.\n# TYPE juneau_bgp_peer_up gauge\n");
        for p in s.peers.values() {
            let _ = writeln!(
                m,
                "juneau_bgp_peer_up{{peer=\"{}\"}} {}",
                p.name,
                (p.state == State::Established) as u8
            );
        }
        m.push_str("# HELP juneau_bgp_peer_state Session state (1 for the current state).\n# TYPE juneau_bgp_peer_state gauge\n");
        for p in s.peers.values() {
            for st in states {
                let _ = writeln!(
                    m,
                    "juneau_bgp_peer_state{{peer=\"{}\",state=\"{st}\"}} {}",
                    p.name,
                    (p.state == st) as u8
                );
            }
        }
        let gauges: [Metric; 1] = [(
            "juneau_bgp_prefixes_announced",
            "VIPs currently announced to the peer.",
            |p| p.prefixes_announced as u64,
        )];
        let counters: [Metric; 4] = [
            (
                "juneau_bgp_prefixes_received_total",
                "Prefixes received from the peer and discarded.",
                |p| p.prefixes_received,
            ),
            (
                "juneau_bgp_session_flaps_total",
                "Established sessions that went down.",
                |p| p.session_flaps,
            ),
            (
                "juneau_bgp_updates_sent_total",
                "UPDATE messages sent.",
                |p| p.updates_sent,
            ),
            (
                "juneau_bgp_treat_as_withdraw_total",
                "Malformed UPDATEs handled as treat-as-withdraw.",
                |p| p.treat_as_withdraw,
            ),
        ];
        for (kind, list) in [("gauge", &gauges[..]), ("counter", &counters[..])] {
            for (name, help, f) in list {
                let _ = writeln!(m, "# HELP {name} {help}\n# TYPE {name} {kind}");
                for p in s.peers.values() {
                    let _ = writeln!(m, "{name}{{peer=\"{}\"}} {}", p.name, f(p));
                }
            }
        }
        let _ = writeln!(
            m,
            "# HELP juneau_bgp_vips_held_back VIPs withheld because the dataplane cannot serve them.\n# TYPE juneau_bgp_vips_held_back gauge\njuneau_bgp_vips_held_back {}",
            s.held_back.len()
        );
        m.push_str("# HELP juneau_bgp_peer_uptime_seconds Seconds since the session became Established.\n# TYPE juneau_bgp_peer_uptime_seconds gauge\n");
        let now = unix_now();
        for p in s.peers.values() {
            let up = p
                .established_since_unix
                .map(|t| now.saturating_sub(t))
                .unwrap_or(0);
            let _ = writeln!(
                m,
                "juneau_bgp_peer_uptime_seconds{{peer=\"{}\"}} {up}",
                p.name
            );
        }
        m
    }

    /// Serves `/metrics` (any path) over plain HTTP/1.1.
    pub async fn serve_metrics(self: Arc<Self>, listener: tokio::net::TcpListener) {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let hub = self.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let _ =
                    tokio::time::timeout(std::time::Duration::from_secs(2), sock.read(&mut buf))
                        .await;
                let body = hub.metrics();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    }
}

/// Writes JSON to `path` via a temporary file in the same directory and a rename, so a
/// reader sees the old or the new file, never half of one.
pub fn write_atomically(path: &Path, value: &impl Serialize) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let data = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_file_is_replaced_atomically_and_metrics_render() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bgp.json");
        let hub = StatusHub::new();
        hub.update(|s| {
            s.peers.insert(
                "tor".into(),
                PeerStatus::new("tor", Ipv4Addr::new(10, 0, 0, 1)),
            );
        });
        hub.peer("tor", |p| {
            p.state = State::Established;
            p.prefixes_announced = 3;
        });
        write_atomically(&path, &hub.snapshot()).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(v["peers"]["tor"]["state"], "Established");
        assert_eq!(v["peers"]["tor"]["prefixes_announced"], 3);
        let m = hub.metrics();
        assert!(m.contains("juneau_bgp_peer_up{peer=\"tor\"} 1"));
        assert!(m.contains("juneau_bgp_prefixes_announced{peer=\"tor\"} 3"));
        assert!(m.contains("juneau_bgp_peer_state{peer=\"tor\",state=\"Idle\"} 0"));
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
