//! `juneau-lab`: the lab (`./lab/lab up|show|down` runs it) and its HTTP load client.
//!
//! - `up`: brings the whole lab up on real parts and walks the user guide (see
//!   docs/lab.md); leaves it running. Idempotent: a running lab is left alone, the
//!   leftovers of a failed one are removed first.
//! - `show`: the guide's "what you see" part again.
//! - `down`: removes everything the lab made.
//! - `load`: an HTTP load through the VIP that counts requests, failures, resets and the
//!   longest gap without success (run inside the client's namespace; prints JSON).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use juneau_tests::daemon::alive;
use juneau_tests::lab::{self, JuneauBins, Lab};
use juneau_tests::load::{self, LoadSpec};

/// The Juneau lab.
#[derive(Parser, Debug)]
#[command(name = "juneau-lab")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Bring the lab up and walk the guide.
    Up,
    /// Show the guide's "what you see" part again.
    Show,
    /// Remove everything the lab made.
    Down,
    /// HTTP load through a VIP (run it in the client's namespace); prints a JSON report.
    Load {
        /// ip:port to load.
        #[arg(long, default_value = "203.0.113.10:80")]
        target: std::net::SocketAddr,
        /// Connect from this address (one of the namespace's) instead of the kernel's
        /// choice.
        #[arg(long)]
        source: Option<std::net::IpAddr>,
        /// Keep-alive clients.
        #[arg(long, default_value_t = 2)]
        keepalive: usize,
        /// New-connection clients.
        #[arg(long, default_value_t = 2)]
        fresh: usize,
        /// Requests per second per client at most.
        #[arg(long, default_value_t = 20)]
        rate: u32,
        /// Bulk clients: a 4 MiB download and a 1 MiB upload a second each, on a
        /// kept-alive connection (real payloads beside the small page).
        #[arg(long, default_value_t = 2)]
        bulk: usize,
        /// Saturating clients (wrk-like: one kept-alive connection each, the next
        /// request as soon as the answer is in, nothing retried).
        #[arg(long, default_value_t = 0)]
        saturating: usize,
        /// Stop after this many seconds at the latest.
        #[arg(long, default_value_t = 120)]
        max_seconds: u64,
        /// Stop when this file appears.
        #[arg(long)]
        stop_file: Option<PathBuf>,
        /// Write the JSON report here (also printed).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

fn need_root() -> Result<()> {
    let uid = std::fs::read_to_string("/proc/self/status")?
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_default();
    if uid != "0" {
        bail!("the lab needs root (network namespaces, containerd, kubelets)");
    }
    Ok(())
}

/// Whether a lab that `up` finished is running (its marker and every recorded process).
fn running() -> bool {
    let state = PathBuf::from(lab::STATE);
    if !state.join("up").exists() {
        return false;
    }
    let Ok(rd) = std::fs::read_dir(state.join("pids")) else {
        return false;
    };
    let mut any = false;
    for e in rd.flatten() {
        any = true;
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        match text.split_whitespace().next().and_then(|p| p.parse().ok()) {
            Some(pid) if alive(pid) => {}
            _ => return false,
        }
    }
    any
}

fn up() -> Result<()> {
    need_root()?;
    let bins = JuneauBins::locate()?;
    if running() {
        lab::step("The lab is already up");
        lab::hint(&bins);
        return Ok(());
    }
    if lab::exists() {
        lab::step("Leftovers of an earlier lab found: removing them first");
        lab::down()?;
    }
    let lab = Lab::up(bins.clone())?;
    if let Err(e) = lab::show_walk(&bins) {
        lab::keep_logs();
        drop(lab);
        return Err(e);
    }
    lab.detach()?;
    std::fs::write(PathBuf::from(lab::STATE).join("up"), "up\n")?;
    lab::hint(&bins);
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Up => up().map_err(|e| {
            e.context(
                "lab: FAILED (what the lab made is removed; its logs are kept where printed above)",
            )
        }),
        Cmd::Show => {
            need_root()?;
            if !lab::admin_kubeconfig().exists() {
                bail!("the lab is not up (./lab/lab up)");
            }
            lab::show_walk(&JuneauBins::locate()?)
        }
        Cmd::Down => {
            need_root()?;
            lab::down()
        }
        Cmd::Load {
            target,
            source,
            keepalive,
            fresh,
            rate,
            bulk,
            saturating,
            max_seconds,
            stop_file,
            out,
        } => {
            let report = load::run(&LoadSpec {
                target,
                source,
                keepalive_clients: keepalive,
                new_connection_clients: fresh,
                rate_per_client: rate,
                max_duration: Duration::from_secs(max_seconds),
                stop_file,
                timeout: Duration::from_secs(2),
                bulk_clients: bulk,
                saturating_clients: saturating,
            })?;
            let text = report.to_json().to_string();
            if let Some(p) = out {
                std::fs::write(&p, &text).with_context(|| format!("writing {}", p.display()))?;
            }
            println!("{text}");
            Ok(())
        }
    }
}
