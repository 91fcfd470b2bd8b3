//! Health gating: a VIP is announced only while this node's dataplane is alive and has
//! that VIP programmed.
//!
//! The node agent decides *which* VIPs this node should announce (the node-state file);
//! the dataplane says whether it can actually forward them (its status file,
//! `juneau_control::dataplane_status`: a heartbeat on `CLOCK_MONOTONIC` and the VIPs in
//! its XDP steering map). The speaker announces the intersection:
//!
//! - status file missing or unreadable, dataplane stopped, its process gone (its liveness
//!   lock free: known within one poll, default 50 ms, of a crash or `kill -9`), or
//!   heartbeat older than the limit (a hung dataplane): every VIP is held back
//!   (withdrawn);
//! - otherwise a VIP is held back until the dataplane has it programmed, so a restarted
//!   dataplane is announced again only once it can forward.
//!
//! Deliberately *not* a gate: the node agent's heartbeat in the node-state file. An
//! apiserver or agent outage withdraws nothing — the last published state keeps serving
//! (static stability, `docs/bgp.md`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use juneau_control::dataplane_status::{DataplaneStatus, DataplaneStatusReader};
use juneau_control::model::NodeState;
use tokio::sync::watch;

use crate::speaker::SharedState;
use crate::status::StatusHub;

/// Default heartbeat age after which the dataplane is presumed dead.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);

/// How the speaker checks the dataplane.
#[derive(Debug, Clone)]
pub struct GateConfig {
    /// The dataplane's status file.
    pub status_file: PathBuf,
    /// Heartbeat age after which the dataplane is presumed dead.
    pub heartbeat_timeout: Duration,
}

impl GateConfig {
    /// How often the status is re-read between state changes: a tenth of the timeout,
    /// between 10 and 100 ms.
    pub fn poll(&self) -> Duration {
        (self.heartbeat_timeout / 10).clamp(Duration::from_millis(10), Duration::from_millis(100))
    }
}

/// Why a VIP the agent wants announced is held back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HoldReason {
    /// The status file cannot be read (no dataplane started yet, or a bad file).
    StatusUnreadable(String),
    /// The dataplane stopped cleanly.
    DataplaneStopped {
        /// Its pid.
        pid: u32,
    },
    /// The dataplane's process is gone (crashed, killed): nothing holds its liveness
    /// lock.
    DataplaneExited {
        /// Its pid.
        pid: u32,
    },
    /// No heartbeat for longer than the limit: presumed crashed or hung.
    HeartbeatStale {
        /// Its pid.
        pid: u32,
        /// Age of the last heartbeat.
        age: Duration,
        /// The limit.
        limit: Duration,
    },
    /// The dataplane is alive but has not programmed this VIP (yet).
    NotProgrammed {
        /// Node-state generation the dataplane has installed.
        dataplane_generation: u64,
        /// Node-state generation the speaker read.
        state_generation: u64,
    },
}

impl HoldReason {
    /// The kind, without the numbers that change on every poll (for change detection).
    pub fn kind(&self) -> &'static str {
        match self {
            HoldReason::StatusUnreadable(_) => "dataplane_status_unreadable",
            HoldReason::DataplaneStopped { .. } => "dataplane_stopped",
            HoldReason::DataplaneExited { .. } => "dataplane_exited",
            HoldReason::HeartbeatStale { .. } => "dataplane_heartbeat_stale",
            HoldReason::NotProgrammed { .. } => "vip_not_programmed",
        }
    }
}

impl std::fmt::Display for HoldReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HoldReason::StatusUnreadable(e) => write!(f, "dataplane status unreadable: {e}"),
            HoldReason::DataplaneStopped { pid } => write!(f, "dataplane (pid {pid}) stopped"),
            HoldReason::DataplaneExited { pid } => {
                write!(f, "dataplane (pid {pid}) exited without stopping: crashed or killed")
            }
            HoldReason::HeartbeatStale { pid, age, limit } => write!(
                f,
                "dataplane (pid {pid}) heartbeat is {} ms old (limit {} ms): presumed down",
                age.as_millis(),
                limit.as_millis()
            ),
            HoldReason::NotProgrammed {
                dataplane_generation,
                state_generation,
            } => write!(
                f,
                "not programmed in the dataplane yet (dataplane has state generation {dataplane_generation}, agent published {state_generation})"
            ),
        }
    }
}

/// The state to announce from: `state` with every VIP the dataplane cannot serve removed
/// from `advertised`, and why each was removed. Pure.
pub fn apply(
    state: &NodeState,
    state_generation: u64,
    dataplane: Result<&DataplaneStatus, &str>,
    limit: Duration,
) -> (NodeState, BTreeMap<IpAddr, HoldReason>) {
    let mut held = BTreeMap::new();
    let mut out = state.clone();
    let whole_node = match dataplane {
        Err(e) => Some(HoldReason::StatusUnreadable(e.to_string())),
        Ok(d) if d.stopped => Some(HoldReason::DataplaneStopped { pid: d.pid }),
        Ok(d) if d.exited => Some(HoldReason::DataplaneExited { pid: d.pid }),
        Ok(d) if d.heartbeat_age > limit => Some(HoldReason::HeartbeatStale {
            pid: d.pid,
            age: d.heartbeat_age,
            limit,
        }),
        Ok(_) => None,
    };
    out.advertised.retain(|a| {
        let reason = match (&whole_node, dataplane) {
            (Some(r), _) => r.clone(),
            (None, Ok(d)) if d.has_vip(a.vip) => return true,
            (None, Ok(d)) => HoldReason::NotProgrammed {
                dataplane_generation: d.state_generation,
                state_generation,
            },
            (None, Err(e)) => HoldReason::StatusUnreadable(e.to_string()),
        };
        held.insert(a.vip, reason);
        false
    });
    (out, held)
}

/// Like [`crate::speaker::watch_state`], but publishes the node state with the VIPs the
/// dataplane cannot serve removed. Wakes on every publish of the node state (futex) and
/// every [`GateConfig::poll`] to re-read the dataplane status; sends only when what is to
/// be announced changed. Held-back VIPs are logged when their reason changes and shown in
/// the speaker's status (`held_back`).
pub fn watch_gated_state(
    path: PathBuf,
    gate: GateConfig,
    hub: Arc<StatusHub>,
) -> watch::Receiver<SharedState> {
    let (tx, rx) = watch::channel(Arc::new((0, NodeState::default())));
    std::thread::Builder::new()
        .name("state-watch".into())
        .spawn(move || run(path, gate, hub, tx))
        .expect("spawn state watcher");
    rx
}

fn run(path: PathBuf, gate: GateConfig, hub: Arc<StatusHub>, tx: watch::Sender<SharedState>) {
    let Some(mut follower) = crate::speaker::StateFollower::open(&path, || tx.is_closed()) else {
        return;
    };
    tracing::info!(
        status_file = %gate.status_file.display(),
        heartbeat_timeout_ms = gate.heartbeat_timeout.as_millis() as u64,
        "announcing only VIPs the dataplane has programmed while its heartbeat is fresh"
    );
    let mut dp: Option<DataplaneStatusReader> = None;
    let mut current: Option<(u64, NodeState)> = None;
    let mut sent: Option<(u64, NodeState)> = None;
    let mut held_kinds: BTreeMap<IpAddr, &'static str> = BTreeMap::new();
    loop {
        // Also every poll without a new state: the dataplane status is re-read.
        let next = follower.next(gate.poll());
        if tx.is_closed() {
            return;
        }
        if next.is_some() {
            current = next;
        }
        let Some((generation, state)) = &current else {
            continue;
        };
        if dp.is_none() {
            dp = DataplaneStatusReader::open(&gate.status_file).ok();
        }
        let status = match dp.as_mut().map(|r| r.read()) {
            Some(Ok(s)) => {
                if !s.alive(gate.heartbeat_timeout) {
                    // Re-open the path on the next poll: a restarted dataplane's new file
                    // is found even if it could not mark this one superseded.
                    dp = None;
                }
                Ok(s)
            }
            Some(Err(e)) => {
                dp = None;
                Err(e.to_string())
            }
            None => Err(format!(
                "{} not found (is juneau-dataplane running with this --status-file?)",
                gate.status_file.display()
            )),
        };
        let (gated, held) = apply(
            state,
            *generation,
            status.as_ref().map_err(String::as_str),
            gate.heartbeat_timeout,
        );
        let kinds: BTreeMap<IpAddr, &'static str> =
            held.iter().map(|(v, r)| (*v, r.kind())).collect();
        hub.set_dataplane(crate::status::DataplaneSeen {
            at: std::time::Instant::now(),
            heartbeat_age: status.as_ref().ok().map(|s| s.heartbeat_age),
            alive: status
                .as_ref()
                .is_ok_and(|s| s.alive(gate.heartbeat_timeout)),
            programmed_vips: status.as_ref().map_or(0, |s| s.vips.len()),
            held_back: kinds.clone(),
        });
        if kinds != held_kinds {
            for (vip, reason) in &held {
                if held_kinds.get(vip) != Some(&reason.kind()) {
                    tracing::warn!(%vip, reason = reason.kind(), "VIP held back: {reason}");
                }
            }
            for vip in held_kinds.keys().filter(|v| !held.contains_key(v)) {
                if gated.advertised.iter().any(|a| a.vip == *vip) {
                    tracing::info!(%vip, "VIP released: the dataplane has it programmed");
                }
            }
            hub.update(|s| {
                s.held_back = held.iter().map(|(v, r)| (*v, r.to_string())).collect();
            });
            held_kinds = kinds;
        }
        let next = (*generation, gated);
        if sent.as_ref() != Some(&next) {
            let _ = tx.send(Arc::new(next.clone()));
            sent = Some(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use juneau_control::model::AdvertisedVip;

    /// An IPv4 VIP for `n` < 100, an IPv6 one (`2001:db8::n`) from 100 on.
    fn vip(n: u8) -> IpAddr {
        if n < 100 {
            IpAddr::from([203, 0, 113, n])
        } else {
            IpAddr::from(std::net::Ipv6Addr::new(
                0x2001,
                0xdb8,
                0,
                0,
                0,
                0,
                0,
                n.into(),
            ))
        }
    }

    fn state(vips: &[u8]) -> NodeState {
        NodeState {
            node: "n".into(),
            advertised: vips
                .iter()
                .map(|n| AdvertisedVip {
                    vip: vip(*n),
                    communities: vec![],
                    large_communities: vec![],
                    local_pref: None,
                    peers: vec![],
                    weight: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn dp(vips: &[u8], age_ms: u64, stopped: bool) -> DataplaneStatus {
        DataplaneStatus {
            pid: 42,
            heartbeat_age: Duration::from_millis(age_ms),
            uptime: Duration::from_secs(1),
            state_generation: 3,
            vips: vips.iter().map(|n| vip(*n)).collect(),
            stopped,
            exited: false,
        }
    }

    const LIMIT: Duration = Duration::from_millis(500);

    fn announced(s: &NodeState) -> Vec<IpAddr> {
        s.advertised.iter().map(|a| a.vip).collect()
    }

    #[test]
    fn only_programmed_vips_of_a_live_dataplane_are_announced() {
        let st = state(&[1, 2, 3]);
        let (g, held) = apply(&st, 4, Ok(&dp(&[1, 3, 9], 10, false)), LIMIT);
        assert_eq!(announced(&g), vec![vip(1), vip(3)]);
        assert_eq!(held.len(), 1);
        assert_eq!(
            held[&vip(2)],
            HoldReason::NotProgrammed {
                dataplane_generation: 3,
                state_generation: 4
            }
        );
        assert!(held[&vip(2)].to_string().contains("not programmed"));
        // Everything else is untouched.
        assert_eq!(g.node, st.node);
    }

    #[test]
    fn ipv6_vips_are_gated_like_ipv4_ones() {
        let st = state(&[1, 101, 102]);
        let (g, held) = apply(&st, 4, Ok(&dp(&[1, 101], 10, false)), LIMIT);
        assert_eq!(announced(&g), vec![vip(1), vip(101)]);
        assert_eq!(held.keys().copied().collect::<Vec<_>>(), vec![vip(102)]);
        assert_eq!(held[&vip(102)].kind(), "vip_not_programmed");
        let (g, held) = apply(&st, 4, Ok(&dp(&[1, 101, 102], 501, false)), LIMIT);
        assert!(g.advertised.is_empty());
        assert_eq!(held[&vip(101)].kind(), "dataplane_heartbeat_stale");
    }

    #[test]
    fn a_dead_stopped_or_missing_dataplane_holds_back_everything() {
        let st = state(&[1, 2]);
        let (g, held) = apply(&st, 4, Ok(&dp(&[1, 2], 501, false)), LIMIT);
        assert!(g.advertised.is_empty());
        assert!(held
            .values()
            .all(|r| r.kind() == "dataplane_heartbeat_stale"));
        assert!(
            held[&vip(1)].to_string().contains("501 ms old"),
            "{}",
            held[&vip(1)]
        );

        let (g, held) = apply(&st, 4, Ok(&dp(&[1, 2], 0, true)), LIMIT);
        assert!(g.advertised.is_empty());
        assert_eq!(held[&vip(2)], HoldReason::DataplaneStopped { pid: 42 });

        let (g, held) = apply(&st, 4, Err("no such file"), LIMIT);
        assert!(g.advertised.is_empty());
        assert!(held[&vip(1)].to_string().contains("no such file"));

        // At the limit still alive.
        let (g, _) = apply(&st, 4, Ok(&dp(&[1, 2], 500, false)), LIMIT);
        assert_eq!(g.advertised.len(), 2);

        // A process gone is dead at once, whatever its last heartbeat's age.
        let gone = DataplaneStatus {
            exited: true,
            ..dp(&[1, 2], 0, false)
        };
        let (g, held) = apply(&st, 4, Ok(&gone), LIMIT);
        assert!(g.advertised.is_empty());
        assert_eq!(held[&vip(1)], HoldReason::DataplaneExited { pid: 42 });
    }

    #[test]
    fn poll_interval_follows_the_timeout() {
        let g = |ms| {
            GateConfig {
                status_file: PathBuf::new(),
                heartbeat_timeout: Duration::from_millis(ms),
            }
            .poll()
        };
        assert_eq!(g(500), Duration::from_millis(50));
        assert_eq!(g(50), Duration::from_millis(10));
        assert_eq!(g(5000), Duration::from_millis(100));
    }
}
