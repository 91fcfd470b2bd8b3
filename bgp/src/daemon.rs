//! The life of a node daemon (`juneau-bgp`, `juneau-bfd`) around its work: logging, the
//! succession lock (an upgrade's new process waits for the one it replaces), a
//! single-threaded runtime, and the order they end in — the runtime, hence every socket,
//! before the lock, so a waiting successor finds the ports free.

use std::future::Future;
use std::path::Path;

use anyhow::Context;
use juneau_control::decommission;

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
}

/// Runs `work` as `component` of the node whose state file is `state_file`: after the
/// process it replaces has exited, unless the node is decommissioned (then the process
/// only idles and leaves no file on the node).
pub fn run<F>(
    component: &str,
    state_file: &Path,
    decommission_dir: Option<&Path>,
    work: F,
) -> anyhow::Result<()>
where
    F: Future<Output = anyhow::Result<()>>,
{
    let succession = match decommission_dir.and_then(decommission::requested) {
        Some(_) => None,
        None => Some(juneau_telemetry::take_over(state_file, component)?),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let r = rt.block_on(work);
    drop(rt);
    drop(succession);
    r
}
