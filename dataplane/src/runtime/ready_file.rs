//! The Pod-private readiness file (`--ready-file`) and the kubelet's probe of it
//! (`juneau-dataplane --probe-ready PATH`).
//!
//! Why not `/readyz` alone: on the host network an upgrade's new dataplane starts beside
//! the old one and cannot bind the metrics port until the old one exits, so the kubelet's
//! HTTP probe of the new Pod is answered by the *old* process — the new Pod counted Ready
//! at once, and the DaemonSet deleted the old Pod while the new process was still
//! loading its program, maps and UMEMs: seconds without a socket on a loaded node
//! (`no_socket` drops, connections stalled past their retransmission backoff;
//! docs/operations.md). The file lives in the Pod's own emptyDir, so only this Pod's
//! process writes what its probe reads:
//!
//! - absent: starting (or stopped, or decommissioned) — not ready;
//! - `prepared`: everything loaded, waiting only for the predecessor to exit — ready, so
//!   the DaemonSet may now delete the old Pod (its exit is what this process waits for);
//! - `ready` / `not ready: <why>`: forwarding, the verdict `/readyz` gives, rewritten by
//!   the statistics thread about once a second; older than [`STALE_AFTER`]: not ready.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The line written once everything is loaded and only the predecessor is waited for.
pub const PREPARED: &str = "prepared";
/// The line written while forwarding and ready.
pub const READY: &str = "ready";
/// The line written once the process stopped forwarding.
pub const STOPPED: &str = "not ready: stopped";
/// A forwarding verdict older than this is not believed (the statistics thread writes
/// one about every second).
pub const STALE_AFTER: Duration = Duration::from_secs(10);

/// Where this process says whether it is ready (`--ready-file`); without one, nothing is
/// written.
#[derive(Debug, Clone, Default)]
pub struct ReadyFile(pub Option<PathBuf>);

impl ReadyFile {
    /// Removes a previous run's file (a restart in the same Pod must not look ready early).
    pub fn clear(&self) {
        if let Some(p) = &self.0 {
            clear(p);
        }
    }

    /// Writes `line` ([`PREPARED`], [`READY`], [`STOPPED`] or why not ready).
    pub fn say(&self, line: &str) {
        if let Some(p) = &self.0 {
            write(p, line);
        }
    }
}

fn clear(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "removing the ready file failed")
        }
    }
}

/// Writes `line` (atomically, by rename), warning on failure: a probe then finds the
/// Pod not ready, never a wrong verdict.
fn write(path: &Path, line: &str) {
    let text = format!("{line}\n");
    if let Err(e) = juneau_control::mapped::write_atomically(path, text.as_bytes()) {
        tracing::warn!(path = %path.display(), error = %e, "writing the ready file failed");
    }
}

/// The probe: `Ok` with what to print when the Pod is ready, `Err` with why not.
pub fn probe(path: &Path, now: SystemTime) -> Result<String, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "not ready: starting ({} not written yet)",
                path.display()
            ))
        }
        Err(e) => return Err(format!("not ready: reading {}: {e}", path.display())),
    };
    let age = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|m| now.duration_since(m).ok())
        .unwrap_or_default();
    verdict(&text, age)
}

/// What the file's `text`, written `age` ago, says.
pub fn verdict(text: &str, age: Duration) -> Result<String, String> {
    let line = text.lines().next().unwrap_or("").trim();
    match line {
        PREPARED => Ok("ready: prepared, taking over once the predecessor exits".into()),
        READY if age <= STALE_AFTER => Ok("ready".into()),
        READY => Err(format!(
            "not ready: the verdict is {} s old (a hung process?)",
            age.as_secs()
        )),
        "" => Err("not ready: empty ready file".into()),
        other => Err(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_is_ready_whatever_its_age_and_a_forwarding_verdict_only_while_fresh() {
        let hour = Duration::from_secs(3600);
        assert!(verdict("prepared\n", hour).is_ok());
        assert!(verdict("ready\n", Duration::from_secs(1)).is_ok());
        let stale = verdict("ready\n", hour).unwrap_err();
        assert!(stale.contains("3600 s old"), "{stale}");
        let why = "not ready: forwarding loop heartbeat 2500 ms old";
        assert_eq!(verdict(why, Duration::ZERO).unwrap_err(), why);
        assert!(verdict("", Duration::ZERO).is_err());
    }

    #[test]
    fn a_missing_file_is_not_ready_and_a_written_one_is_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dataplane.ready");
        let file = ReadyFile(Some(path.clone()));
        let now = SystemTime::now();
        assert!(probe(&path, now).unwrap_err().contains("starting"));
        file.say(PREPARED);
        assert!(probe(&path, now).is_ok());
        file.say("not ready: stopping");
        assert_eq!(probe(&path, now).unwrap_err(), "not ready: stopping");
        file.say(READY);
        assert!(probe(&path, now + Duration::from_secs(2)).is_ok());
        assert!(probe(&path, now + Duration::from_secs(60)).is_err());
        file.clear();
        file.clear();
        assert!(probe(&path, now).is_err());
    }
}
