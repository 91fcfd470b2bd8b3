//! `juneau-bfd`: the node's BFD sessions (RFC 5880/5881/5883), apart from the BGP speaker.
//!
//! BFD that lives in the speaker's process dies with it, so a speaker restart (an upgrade,
//! a crash) would look like a dead path to the router, which then withdraws the node's
//! routes although graceful restart would have kept them. Run here, the sessions survive
//! juneau-bgp restarts and announce it with the C bit (control-plane independent, RFC
//! 5880 4.1 / RFC 5882 4.3): the router keeps our routes through a speaker restart
//! (graceful restart) and still withdraws them within the detection time when the node
//! or its link dies. juneau-bgp follows this process's status file
//! (`juneau-bgp --bfd-status-file`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::Parser;
use juneau_bgp::bfd_io::{self, BfdFile};
use juneau_bgp::speaker;
use juneau_bgp::status::{unix_now, write_atomically, BfdStatus};
use juneau_control::decommission::{self, Component};
use tokio::sync::{mpsc, Notify};

/// Runs BFD for every BGP peer of the node that asks for it, and reports session states.
#[derive(Debug, Parser)]
#[command(name = "juneau-bfd", version)]
struct Args {
    /// The node's shared control state (written by the node agent).
    #[arg(long, env = "JUNEAU_STATE_FILE")]
    state_file: PathBuf,
    /// Session states as JSON, replaced atomically on every change (juneau-bgp reads it).
    #[arg(long)]
    status_file: PathBuf,
    /// On SIGTERM, Up sessions announce this transmit interval (ms) before the process
    /// exits, so the routers keep them Up for 3 x this long while a new juneau-bfd starts
    /// and resumes them (0: send AdminDown instead). A node that dies in that window is
    /// detected only when it ends.
    #[arg(long, default_value_t = 20_000)]
    restart_hold_ms: u64,
    /// The node Pod's decommission directory (an emptyDir shared with the node agent):
    /// when the agent's request stands there (helm uninstall), sessions go AdminDown
    /// (never held), the status file is removed, and the process idles until stopped,
    /// also after a restart.
    #[arg(long, value_name = "DIR")]
    decommission_dir: Option<PathBuf>,
}

/// Removes the status file, acknowledges, and idles until SIGTERM/SIGINT.
async fn decommissioned(args: &Args, token: &str) -> anyhow::Result<()> {
    decommission::finish(
        [args.status_file.as_path()],
        args.decommission_dir.as_deref(),
        Component::Bfd,
    )?;
    tracing::info!(
        token,
        "decommissioned: sessions AdminDown, status file removed; idle until stopped"
    );
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    juneau_bgp::daemon::init_logging();
    let args = Args::parse();
    let (state_file, decommission_dir) = (args.state_file.clone(), args.decommission_dir.clone());
    juneau_bgp::daemon::run("bfd", &state_file, decommission_dir.as_deref(), run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    // A restarted juneau-bfd on a decommissioned node starts no session.
    if let Some(token) = args
        .decommission_dir
        .as_deref()
        .and_then(decommission::requested)
    {
        return decommissioned(&args, &token).await;
    }
    let sessions: Arc<Mutex<BTreeMap<String, BfdStatus>>> = Arc::default();
    let changed = Arc::new(Notify::new());
    let report: bfd_io::Report = {
        let (sessions, changed) = (sessions.clone(), changed.clone());
        Arc::new(move |name: &str, st: Option<BfdStatus>| {
            let mut m = sessions.lock().unwrap_or_else(|e| e.into_inner());
            match st {
                Some(st) => m.insert(name.to_string(), st),
                None => m.remove(name),
            };
            changed.notify_one();
        })
    };
    let (notice_tx, mut notice_rx) = mpsc::unbounded_channel();
    // Sessions an earlier juneau-bfd held for its restart.
    let resume = std::fs::read(&args.status_file)
        .ok()
        .and_then(|b| serde_json::from_slice::<BfdFile>(&b).ok())
        .map(|f| f.resumable(unix_ms()))
        .unwrap_or_default();
    if !resume.is_empty() {
        tracing::info!(
            sessions = resume.len(),
            "resuming BFD sessions held by the previous process"
        );
    }
    let bfd = bfd_io::spawn_resuming(report, notice_tx, true, resume);
    let held_until: Arc<Mutex<Option<u64>>> = Arc::default();
    tokio::spawn(async move { while notice_rx.recv().await.is_some() {} });

    let mut state_rx = speaker::watch_state(args.state_file.clone());
    let node = Arc::new(Mutex::new(String::new()));
    let writer;
    {
        let (sessions, changed, node, path, held_until) = (
            sessions.clone(),
            changed.clone(),
            node.clone(),
            args.status_file.clone(),
            held_until.clone(),
        );
        writer = tokio::spawn(async move {
            loop {
                let file = BfdFile {
                    node: node.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                    pid: std::process::id(),
                    written_unix: unix_now(),
                    sessions: sessions.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                    held_until_unix_ms: *held_until.lock().unwrap_or_else(|e| e.into_inner()),
                };
                if let Err(e) = write_atomically(&path, &file) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot write status file");
                }
                changed.notified().await;
            }
        });
    }

    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let request = juneau_bgp::decommission_watch::requested(args.decommission_dir.clone());
    tokio::pin!(request);
    let mut decommission = None;
    loop {
        {
            let st = state_rx.borrow_and_update().clone();
            *node.lock().unwrap_or_else(|e| e.into_inner()) = st.1.node.clone();
            bfd.set(bfd_io::wanted(&st.1));
        }
        tokio::select! {
            r = state_rx.changed() => if r.is_err() { break },
            _ = term.recv() => break,
            _ = int.recv() => break,
            token = &mut request => {
                decommission = Some(token);
                break;
            }
        }
    }
    if let Some(token) = decommission {
        tracing::info!(token = %token, "decommission requested: sessions go AdminDown");
        drop(bfd);
        // AdminDown is sent; the status file must not be written again.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        writer.abort();
        let _ = writer.await;
        return decommissioned(&args, &token).await;
    }
    if args.restart_hold_ms == 0 {
        tracing::info!("shutting down: sessions go AdminDown");
        drop(bfd);
    } else {
        let hold = std::time::Duration::from_millis(args.restart_hold_ms);
        bfd.hold_for_restart(hold).await;
        // The routers time us out after our multiplier (3 or more) x hold: resume within
        // 2 x hold to leave a margin.
        *held_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(unix_ms() + 2 * args.restart_hold_ms);
        changed.notify_one();
        tracing::info!(
            hold_ms = args.restart_hold_ms,
            "shutting down: sessions held for the next juneau-bfd"
        );
    }
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    Ok(())
}
