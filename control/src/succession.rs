//! One running process per node component: how a new node Pod's process waits for the
//! one it replaces (an upgrade handover without a gap).
//!
//! The DaemonSet of the node components surges (`maxSurge: 1, maxUnavailable: 0`): the
//! new Pod starts beside the old one, and the old one is stopped once the new one is
//! Ready. Two dataplanes cannot share a node's AF_XDP queues, two speakers its BGP port,
//! two agents its state file; so each process first takes its component's **succession
//! lock**, `<node>.<component>.succession` beside the node's state file (an exclusive
//! `flock`), and keeps it for its whole life. A successor blocks on it with everything
//! it needs already loaded, and goes on the moment its predecessor exits (the kernel
//! releases the lock with the process, also on a crash). The holder writes its pid into
//! the file, so a waiting successor can say whom it waits for.
//!
//! Nothing here decides *when* a process exits: the kubelet stops the old Pod, and each
//! process releases the lock last, after its sockets and ports are closed
//! ([`Succession`] is dropped at the very end of `main`).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};

/// Why the succession lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum SuccessionError {
    /// The lock file could not be created or opened.
    #[error("opening the succession lock {path}: {source}")]
    Open {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Locking failed for another reason than its being held.
    #[error("locking the succession lock {path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// The succession lock of `component` (`dataplane`, `agent`, `bgp`, `bfd`) on the node
/// whose state file is `state_file`: `/run/juneau/<node>.<component>.succession`.
pub fn path_for_state_file(state_file: &Path, component: &str) -> PathBuf {
    state_file.with_extension(format!("{component}.succession"))
}

/// A held succession lock: this process is the node component's one running instance
/// until it is dropped (or the process exits).
#[derive(Debug)]
pub struct Succession {
    _file: File,
    /// Whether another process held the lock when this one asked for it.
    pub waited: bool,
}

/// What a successor learns when the lock is held: the holder's pid, if it wrote one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The pid the holder wrote into the lock file.
    pub holder: Option<u32>,
}

fn open(path: &Path) -> Result<File, SuccessionError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| SuccessionError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| SuccessionError::Open {
            path: path.to_path_buf(),
            source,
        })
}

fn holder_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Writes this process's pid into the held lock file (best effort: only for the log
/// line of a later successor).
fn write_pid(file: &mut File) {
    let _ = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()));
}

/// Takes the succession lock at `path` without waiting: `Err(Held)` while another
/// process holds it.
pub fn try_take(path: &Path) -> Result<Result<Succession, Held>, SuccessionError> {
    let mut file = open(path)?;
    match file.try_lock() {
        Ok(()) => Ok(Ok(taken(file, false))),
        Err(std::fs::TryLockError::WouldBlock) => Ok(Err(Held {
            holder: holder_pid(&mut file),
        })),
        Err(std::fs::TryLockError::Error(source)) => Err(SuccessionError::Lock {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Takes the succession lock at `path`, waiting as long as another process holds it;
/// `waiting` is called once, before the wait, with what is known of the holder. A
/// signal's default action (SIGTERM: exit) ends the wait with the process.
pub fn take(path: &Path, waiting: impl FnOnce(Held)) -> Result<Succession, SuccessionError> {
    let mut file = open(path)?;
    let lock_error = |source| SuccessionError::Lock {
        path: path.to_path_buf(),
        source,
    };
    match file.try_lock() {
        Ok(()) => return Ok(taken(file, false)),
        Err(std::fs::TryLockError::WouldBlock) => {}
        Err(std::fs::TryLockError::Error(e)) => return Err(lock_error(e)),
    }
    waiting(Held {
        holder: holder_pid(&mut file),
    });
    file.lock().map_err(lock_error)?;
    Ok(taken(file, true))
}

/// The lock just taken on `file`: this process's pid written into it.
fn taken(mut file: File, waited: bool) -> Succession {
    write_pid(&mut file);
    Succession {
        _file: file,
        waited,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn the_lock_sits_beside_the_state_file() {
        assert_eq!(
            path_for_state_file(Path::new("/run/juneau/node-a.state"), "dataplane"),
            Path::new("/run/juneau/node-a.dataplane.succession")
        );
    }

    #[test]
    fn a_successor_waits_for_the_holder_and_learns_its_pid() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/n.bgp.succession");
        let first = take(&path, |_| panic!("nobody holds it yet")).unwrap();
        assert!(!first.waited);
        let held = try_take(&path).unwrap().unwrap_err();
        assert_eq!(held.holder, Some(std::process::id()));

        let (told, heard) = mpsc::channel();
        let (done, finished) = mpsc::channel();
        let p = path.clone();
        let successor = std::thread::spawn(move || {
            let s = take(&p, |h| told.send(h).unwrap()).unwrap();
            done.send(()).unwrap();
            s
        });
        assert_eq!(
            heard.recv_timeout(Duration::from_secs(10)).unwrap().holder,
            Some(std::process::id())
        );
        // Still held: the successor must not have gone on.
        assert!(finished.recv_timeout(Duration::from_millis(200)).is_err());
        drop(first);
        finished.recv_timeout(Duration::from_secs(10)).unwrap();
        let second = successor.join().unwrap();
        assert!(second.waited);
        assert!(try_take(&path).unwrap().is_err(), "the successor holds it");
        drop(second);
        assert!(try_take(&path).unwrap().is_ok(), "released with its holder");
    }

    #[test]
    fn an_unusable_path_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        let e = try_take(&file.join("n.agent.succession")).unwrap_err();
        assert!(e.to_string().contains("plain/n.agent.succession"), "{e}");
    }
}
