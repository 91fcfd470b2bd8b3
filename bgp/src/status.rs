//! Per-peer status: a JSON file the node agent reads (written atomically on every change)
//! and Prometheus metrics.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::Notify;

use crate::bfd::BfdState;
use crate::fsm::State;

/// What an operator wants to know about one peer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PeerStatus {
    /// The peer's name (BGPPeer object).
    pub name: String,
    /// The router's address.
    pub peer_address: IpAddr,
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
    /// The address families negotiated on the current session (`["ipv4-unicast"]`...).
    pub families: crate::family::Families,
    /// VIPs not sent to this peer, by reason (a family the peer did not negotiate, no
    /// next hop of the family).
    pub not_sent: crate::rib::Withheld,
    /// BFD on the path to the peer, when configured.
    pub bfd: Option<BfdStatus>,
    /// Which run of the peer's task owns this entry (a reconfigured peer's old task must
    /// not overwrite its successor's status).
    #[serde(skip)]
    pub owner: u64,
}

impl PeerStatus {
    /// A peer that has just been configured.
    pub fn new(name: &str, peer_address: impl Into<IpAddr>) -> Self {
        PeerStatus {
            name: name.to_string(),
            peer_address: peer_address.into(),
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
            families: crate::family::Families::NONE,
            not_sent: crate::rib::Withheld::default(),
            bfd: None,
            owner: 0,
        }
    }
}

/// The BFD session of one peer.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct BfdStatus {
    /// AdminDown, Down, Init or Up.
    pub state: BfdState,
    /// Why the session last went down (ours) or the peer's reason when it signalled it.
    pub diag: String,
    /// The peer's last diagnostic.
    pub peer_diag: String,
    /// Negotiated detection time, once the peer is heard.
    pub detection_time_ms: Option<u64>,
    /// Times an Up session went down.
    pub down_events: u64,
    /// Why the session could not be set up, if it could not.
    pub error: Option<String>,
    /// Our discriminator (0: no session).
    #[serde(default)]
    pub local_discriminator: u32,
    /// The peer's discriminator (0: not heard).
    #[serde(default)]
    pub remote_discriminator: u32,
    /// Authentication (RFC 5880 6.7): "keyed SHA1", "meticulous keyed SHA1", or none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authentication: Option<String>,
    /// Packets discarded by authentication: A bit not as configured, another type or key
    /// id, a sequence number outside the window, a wrong digest.
    #[serde(default)]
    pub auth_failures: u64,
    /// Written when the session is held for a restart: the next sequence number to send,
    /// for the process that resumes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_auth_seq: Option<u32>,
}

impl BfdStatus {
    /// The status of a running session.
    pub fn new(s: &crate::bfd::Session) -> Self {
        BfdStatus {
            state: s.state(),
            diag: s.local_diag().to_string(),
            peer_diag: s.remote_diag().to_string(),
            detection_time_ms: s.detection_time().map(|d| d.as_millis() as u64),
            down_events: 0,
            error: None,
            local_discriminator: s.local_disc(),
            remote_discriminator: s.remote_disc(),
            authentication: s.auth_type().map(|t| t.to_string()),
            auth_failures: s.auth_failures,
            next_auth_seq: None,
        }
    }

    /// A session that could not be set up.
    pub fn error(e: String) -> Self {
        BfdStatus {
            state: BfdState::Down,
            diag: String::new(),
            peer_diag: String::new(),
            detection_time_ms: None,
            down_events: 0,
            error: Some(e),
            local_discriminator: 0,
            remote_discriminator: 0,
            authentication: None,
            auth_failures: 0,
            next_auth_seq: None,
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
    pub held_back: BTreeMap<IpAddr, String>,
}

/// What the dataplane gate last read from the dataplane's status file, for metrics
/// (kept out of [`Status`]: it changes every poll, the status file would be rewritten
/// every 50 ms).
#[derive(Debug, Clone, PartialEq)]
pub struct DataplaneSeen {
    /// When it was read.
    pub at: std::time::Instant,
    /// Age of the dataplane's heartbeat then (`None`: status file unreadable or missing).
    pub heartbeat_age: Option<std::time::Duration>,
    /// Alive as the gate judges it (readable, not stopped, heartbeat within the limit).
    pub alive: bool,
    /// VIPs the dataplane has programmed.
    pub programmed_vips: usize,
    /// Why each held-back VIP is held back (`HoldReason::kind`).
    pub held_back: BTreeMap<IpAddr, &'static str>,
}

/// Shared status, with a wake-up for the file writer.
#[derive(Debug)]
pub struct StatusHub {
    inner: Mutex<Status>,
    changed: Notify,
    update_latency: prometheus_client::metrics::histogram::Histogram,
    dataplane: Mutex<Option<DataplaneSeen>>,
    /// BFD states reported for a peer not configured (yet, or any more): its BFD session
    /// may come Up before the speaker configures the peer (separate processes, both
    /// following the same node state), and a state is reported only when it changes —
    /// dropped, the peer showed no BFD for good (found in the lab, 2026-12-07).
    bfd_unclaimed: Mutex<BTreeMap<String, BfdStatus>>,
}

impl Default for StatusHub {
    fn default() -> Self {
        StatusHub {
            inner: Mutex::default(),
            changed: Notify::default(),
            // 50 us .. ~3 s.
            update_latency: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(50e-6, 4.0, 9),
            ),
            dataplane: Mutex::new(None),
            bfd_unclaimed: Mutex::default(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct PeerLabel {
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct PeerStateLabel {
    peer: String,
    state: String,
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

    /// A peer's BFD session state (`None`: no session); kept for a peer not configured
    /// yet until [`claim_bfd`](Self::claim_bfd) takes it.
    pub fn peer_bfd(&self, name: &str, st: Option<BfdStatus>) {
        self.update(|s| match s.peers.get_mut(name) {
            Some(p) => p.bfd = st,
            None => {
                let mut u = self.bfd_unclaimed.lock().unwrap_or_else(|e| e.into_inner());
                match st {
                    Some(b) => u.insert(name.to_string(), b),
                    None => u.remove(name),
                };
            }
        })
    }

    /// The BFD state last reported for `name` while it was not configured, if any (for
    /// the peer being configured now).
    pub fn claim_bfd(&self, name: &str) -> Option<BfdStatus> {
        self.bfd_unclaimed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
    }

    /// Removes a deconfigured peer, keeping its BFD state for a peer configured again
    /// under its name.
    pub fn remove_peer(&self, name: &str) {
        self.update(|s| {
            if let Some(b) = s.peers.remove(name).and_then(|p| p.bfd) {
                self.bfd_unclaimed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.to_string(), b);
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

    /// Records how long one peer took from a control-state change reaching it to its
    /// UPDATEs written to the socket.
    pub fn observe_update_latency(&self, d: std::time::Duration) {
        self.update_latency.observe(d.as_secs_f64());
    }

    /// Records what the dataplane gate read (every poll; no file write, no wake-up).
    pub fn set_dataplane(&self, seen: DataplaneSeen) {
        *self.dataplane.lock().unwrap_or_else(|e| e.into_inner()) = Some(seen);
    }

    /// What the dataplane gate last read, if it runs.
    pub fn dataplane(&self) -> Option<DataplaneSeen> {
        self.dataplane
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The OpenMetrics text of the current status (see [`juneau_telemetry::Endpoint`]).
    pub fn metrics(&self) -> String {
        juneau_telemetry::encode(self).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot encode metrics");
            String::new()
        })
    }

    fn collect_dataplane(&self, reg: &mut prometheus_client::registry::Registry) {
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        let Some(d) = self.dataplane() else { return };
        if let Some(age) = d.heartbeat_age {
            let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
            g.set((age + d.at.elapsed()).as_secs_f64());
            reg.register(
                "juneau_dataplane_heartbeat_age_seconds",
                "Age of the node's dataplane heartbeat, read by the speaker from the dataplane status file.",
                g,
            );
        }
        let alive = Gauge::<i64>::default();
        alive.set(i64::from(d.alive));
        reg.register(
            "juneau_bgp_dataplane_alive",
            "1 while the dataplane status is readable, not stopped and its heartbeat within --dataplane-heartbeat-timeout-ms.",
            alive,
        );
        let programmed = Gauge::<i64>::default();
        programmed.set(d.programmed_vips as i64);
        reg.register(
            "juneau_bgp_dataplane_programmed_vips",
            "VIPs the dataplane reports as programmed.",
            programmed,
        );
        let held = Family::<VipReasonLabel, Gauge>::default();
        for (vip, reason) in &d.held_back {
            held.get_or_create(&VipReasonLabel {
                vip: vip.to_string(),
                reason: (*reason).to_string(),
            })
            .set(1);
        }
        reg.register(
            "juneau_bgp_vip_held_back",
            "1 for each VIP the agent wants announced that the speaker withholds, with the reason.",
            held,
        );
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct VipReasonLabel {
    vip: String,
    reason: String,
}

impl juneau_telemetry::Endpoint for StatusHub {
    fn live(&self) -> Result<(), String> {
        Ok(())
    }

    fn ready(&self) -> Result<(), String> {
        if self.snapshot().state_generation == 0 {
            Err("not ready: no node state read yet (is the node agent publishing?)".into())
        } else {
            Ok(())
        }
    }

    /// The per-peer values are taken from the status at scrape time.
    fn collect(&self, reg: &mut prometheus_client::registry::Registry) {
        use prometheus_client::metrics::gauge::Gauge;

        let s = self.snapshot();
        let now = unix_now();
        self.collect_dataplane(reg);
        collect_sessions(&s, now, reg);
        collect_bfd(&s, reg);
        let held_back = Gauge::<i64>::default();
        held_back.set(s.held_back.len() as i64);
        reg.register(
            "juneau_bgp_vips_held_back",
            "VIPs withheld because the dataplane cannot serve them.",
            held_back,
        );
        reg.register(
            "juneau_bgp_update_latency_seconds",
            "From a control-state change reaching a peer's task to its UPDATEs written.",
            self.update_latency.clone(),
        );
    }
}

/// Registers the BGP session metrics of every peer of `s` (`now`: the scrape's Unix time).
fn collect_sessions(s: &Status, now: u64, reg: &mut prometheus_client::registry::Registry) {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;

    let gauge = |reg: &mut Registry, name: &str, help: &str, f: &dyn Fn(&PeerStatus) -> i64| {
        let fam = Family::<PeerLabel, Gauge>::default();
        for p in s.peers.values() {
            fam.get_or_create(&PeerLabel {
                peer: p.name.clone(),
            })
            .set(f(p));
        }
        reg.register(name, help, fam);
    };
    let counter = |reg: &mut Registry, name: &str, help: &str, f: &dyn Fn(&PeerStatus) -> u64| {
        let fam = Family::<PeerLabel, Counter>::default();
        for p in s.peers.values() {
            fam.get_or_create(&PeerLabel {
                peer: p.name.clone(),
            })
            .inc_by(f(p));
        }
        reg.register(name, help, fam);
    };
    gauge(
        &mut *reg,
        "juneau_bgp_peer_up",
        "1 if the session with the peer is Established.",
        &|p| i64::from(p.state == State::Established),
    );
    let states = Family::<PeerStateLabel, Gauge>::default();
    for p in s.peers.values() {
        for st in [
            State::Idle,
            State::Connect,
            State::Active,
            State::OpenSent,
            State::OpenConfirm,
            State::Established,
        ] {
            states
                .get_or_create(&PeerStateLabel {
                    peer: p.name.clone(),
                    state: st.to_string(),
                })
                .set(i64::from(p.state == st));
        }
    }
    reg.register(
        "juneau_bgp_peer_state",
        "Session state (1 for the current state).",
        states,
    );
    gauge(
        &mut *reg,
        "juneau_bgp_prefixes_announced",
        "VIPs currently announced to the peer.",
        &|p| p.prefixes_announced as i64,
    );
    gauge(
        &mut *reg,
        "juneau_bgp_peer_uptime_seconds",
        "Seconds since the session became Established.",
        &|p| {
            p.established_since_unix
                .map(|t| now.saturating_sub(t) as i64)
                .unwrap_or(0)
        },
    );
    counter(
        &mut *reg,
        "juneau_bgp_prefixes_received",
        "Prefixes received from the peer and discarded.",
        &|p| p.prefixes_received,
    );
    counter(
        &mut *reg,
        "juneau_bgp_session_flaps",
        "Established sessions that went down.",
        &|p| p.session_flaps,
    );
    counter(
        &mut *reg,
        "juneau_bgp_updates_sent",
        "UPDATE messages sent.",
        &|p| p.updates_sent,
    );
    counter(
        &mut *reg,
        "juneau_bgp_treat_as_withdraw",
        "Malformed UPDATEs handled as treat-as-withdraw.",
        &|p| p.treat_as_withdraw,
    );
}

/// Registers the BFD metrics of the peers of `s` that have BFD.
fn collect_bfd(s: &Status, reg: &mut prometheus_client::registry::Registry) {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;

    // BFD, for the peers that have it.
    let bfd_up = Family::<PeerLabel, Gauge>::default();
    let bfd_state = Family::<PeerStateLabel, Gauge>::default();
    let bfd_detect = Family::<PeerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let bfd_downs = Family::<PeerLabel, Counter>::default();
    let bfd_auth_failures = Family::<PeerLabel, Counter>::default();
    for p in s.peers.values() {
        let Some(b) = &p.bfd else { continue };
        let peer = PeerLabel {
            peer: p.name.clone(),
        };
        bfd_up
            .get_or_create(&peer)
            .set(i64::from(b.state == BfdState::Up));
        for st in [
            BfdState::AdminDown,
            BfdState::Down,
            BfdState::Init,
            BfdState::Up,
        ] {
            bfd_state
                .get_or_create(&PeerStateLabel {
                    peer: p.name.clone(),
                    state: st.to_string(),
                })
                .set(i64::from(b.state == st));
        }
        if let Some(ms) = b.detection_time_ms {
            bfd_detect.get_or_create(&peer).set(ms as f64 / 1e3);
        }
        bfd_downs.get_or_create(&peer).inc_by(b.down_events);
        bfd_auth_failures
            .get_or_create(&peer)
            .inc_by(b.auth_failures);
    }
    reg.register(
        "juneau_bgp_bfd_up",
        "1 if the BFD session to the peer is Up.",
        bfd_up,
    );
    reg.register(
        "juneau_bgp_bfd_state",
        "BFD session state (1 for the current state).",
        bfd_state,
    );
    reg.register(
        "juneau_bgp_bfd_detection_time_seconds",
        "Negotiated BFD detection time.",
        bfd_detect,
    );
    reg.register(
        "juneau_bgp_bfd_down_events",
        "Times an Up BFD session went down.",
        bfd_downs,
    );
    reg.register(
        "juneau_bgp_bfd_auth_failures",
        "BFD packets discarded by authentication (A bit not as configured, wrong type, key id, sequence number or digest).",
        bfd_auth_failures,
    );
}

/// Writes `value` as JSON to `path` so a reader sees the old or the new file, never
/// half of one (`juneau_control::mapped::write_atomically`).
pub fn write_atomically(path: &Path, value: &impl Serialize) -> std::io::Result<()> {
    let data = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    juneau_control::mapped::write_atomically(path, &data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bfd_state_reported_before_its_peer_is_configured_is_kept_for_it() {
        let hub = StatusHub::new();
        let session = |state| BfdStatus {
            state,
            diag: String::new(),
            peer_diag: String::new(),
            detection_time_ms: Some(900),
            down_events: 0,
            error: None,
            local_discriminator: 1,
            remote_discriminator: 2,
            authentication: None,
            auth_failures: 0,
            next_auth_seq: None,
        };
        let up = session(BfdState::Up);
        hub.peer_bfd("tor", Some(up.clone()));
        assert!(hub.snapshot().peers.is_empty());
        assert_eq!(hub.claim_bfd("tor"), Some(up.clone()));
        assert_eq!(hub.claim_bfd("tor"), None, "claimed once");
        // A peer removed keeps its state for when it is configured again.
        hub.update(|s| {
            let mut p = PeerStatus::new("tor", Ipv4Addr::new(10, 0, 0, 1));
            p.bfd = Some(up.clone());
            s.peers.insert("tor".into(), p);
        });
        hub.remove_peer("tor");
        assert_eq!(hub.claim_bfd("tor"), Some(up));
        // A session gone while the peer was not configured leaves nothing behind.
        hub.peer_bfd("tor", Some(session(BfdState::Down)));
        hub.peer_bfd("tor", None);
        assert_eq!(hub.claim_bfd("tor"), None);
    }

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
        assert!(m.contains("# TYPE juneau_bgp_session_flaps counter"), "{m}");
        assert!(
            m.contains("juneau_bgp_session_flaps_total{peer=\"tor\"} 0"),
            "{m}"
        );
        assert!(
            !m.contains("juneau_bgp_bfd_up{"),
            "no BFD series without BFD: {m}"
        );
        hub.peer("tor", |p| {
            p.bfd = Some(BfdStatus {
                state: BfdState::Up,
                diag: String::new(),
                peer_diag: String::new(),
                detection_time_ms: Some(900),
                down_events: 2,
                error: None,
                local_discriminator: 1,
                remote_discriminator: 2,
                authentication: Some("keyed SHA1".into()),
                auth_failures: 5,
                next_auth_seq: None,
            })
        });
        hub.observe_update_latency(std::time::Duration::from_micros(300));
        let m = hub.metrics();
        assert!(m.contains("juneau_bgp_bfd_up{peer=\"tor\"} 1"), "{m}");
        assert!(
            m.contains("juneau_bgp_bfd_auth_failures_total{peer=\"tor\"} 5"),
            "{m}"
        );
        assert!(
            m.contains("juneau_bgp_bfd_state{peer=\"tor\",state=\"Up\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("juneau_bgp_bfd_detection_time_seconds{peer=\"tor\"} 0.9"),
            "{m}"
        );
        assert!(
            m.contains("juneau_bgp_bfd_down_events_total{peer=\"tor\"} 2"),
            "{m}"
        );
        assert!(
            m.contains("juneau_bgp_update_latency_seconds_count 1"),
            "{m}"
        );
        assert!(m.ends_with("# EOF\n"), "{m}");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
