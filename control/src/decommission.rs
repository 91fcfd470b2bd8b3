//! Decommissioning a node (`helm uninstall`): the node agent's request to the node's
//! other components, their acknowledgements, and which files in `/run/juneau` are the
//! node's.
//!
//! The request and the acknowledgements live in a directory of the node's Pod (an
//! `emptyDir` every container mounts, `--decommission-dir`): they survive a restart of
//! any container, so a restarted dataplane or speaker does not attach or announce again
//! while the request stands, and they go with the Pod, so nothing of them is left on
//! the node. Protocol (docs/decisions.md, "Uninstall"):
//!
//! 1. the agent writes [`REQUEST_FILE`] holding the request's token;
//! 2. each component that sees it (at start, or while running) undoes what it did on
//!    the node — the speaker closes its sessions with a Cease, the dataplane detaches
//!    its XDP program and removes its pins, each removes its own files in `/run/juneau`
//!    — then writes its acknowledgement ([`acknowledge`]) and idles until stopped;
//! 3. once every component acknowledged, the agent removes the node's remaining files
//!    ([`remove_node_files`]) and reports the token in the API.

use std::io;
use std::path::{Path, PathBuf};

/// The request file in the decommission directory; its content is the request's token.
pub const REQUEST_FILE: &str = "request";

/// A node component that acknowledges a decommission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// `juneau-dataplane`: XDP program detached, pins and its files removed.
    Dataplane,
    /// `juneau-bgp`: sessions closed with a Cease (the peers drop the routes at once).
    Speaker,
    /// `juneau-bfd`: sessions stopped, its status file removed.
    Bfd,
}

impl Component {
    /// Every component the agent waits for.
    pub const ALL: [Component; 3] = [Component::Dataplane, Component::Speaker, Component::Bfd];

    /// The component's name, as its acknowledgement file is called.
    pub fn name(self) -> &'static str {
        match self {
            Component::Dataplane => "dataplane",
            Component::Speaker => "bgp",
            Component::Bfd => "bfd",
        }
    }

    fn ack_path(self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.done", self.name()))
    }
}

/// The token of the decommission request standing in `dir`, if one does (an empty or
/// unreadable file is no request).
pub fn requested(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(REQUEST_FILE)).ok()?;
    let token = text.trim();
    (!token.is_empty()).then(|| token.to_string())
}

/// Writes the request (atomically: a reader sees the whole token or nothing).
pub fn request(dir: &Path, token: &str) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    crate::mapped::write_atomically(&dir.join(REQUEST_FILE), format!("{token}\n").as_bytes())
}

/// Records that `component` carried the request out.
pub fn acknowledge(dir: &Path, component: Component) -> io::Result<()> {
    std::fs::write(component.ack_path(dir), b"done\n")
}

/// Whether `component` acknowledged.
pub fn acknowledged(dir: &Path, component: Component) -> bool {
    component.ack_path(dir).exists()
}

/// The names (after `<node>.`) of the files Juneau's node components keep in
/// `/run/juneau`: the agent's state, the dataplane's status and statistics, the
/// speaker's and BFD's status, each component's succession lock (crate::succession).
const NODE_FILES: [&str; 10] = [
    "state",
    "dataplane",
    "dataplane.lock",
    "dataplane-stats.json",
    "bgp-status.json",
    "bfd.json",
    "dataplane.succession",
    "agent.succession",
    "bgp.succession",
    "bfd.succession",
];

/// Whether `name`, a file in `/run/juneau`, is one of `node`'s: a file of
/// [`NODE_FILES`], or a temporary file one of its writers renames into place.
pub fn is_node_file(name: &str, node: &str) -> bool {
    let Some(rest) = name.strip_prefix(node).and_then(|r| r.strip_prefix('.')) else {
        return false;
    };
    if NODE_FILES.contains(&rest) {
        return true;
    }
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // A writer's temporary file: `<node file>.tmp<pid>`
    // (`crate::mapped::temporary_beside`); and the names earlier versions used: the
    // state `<node>.tmp<pid>`, the statistics `<node>.dataplane-stats.tmp`, the
    // speaker's and BFD's `<node>.<name>.tmp.<pid>`.
    let temporary = rest
        .rsplit_once(".tmp")
        .is_some_and(|(file, pid)| NODE_FILES.contains(&file) && digits(pid));
    temporary
        || rest.strip_prefix("tmp").is_some_and(digits)
        || rest.strip_prefix("dataplane.tmp").is_some_and(digits)
        || rest == "dataplane-stats.tmp"
        || rest.strip_prefix("bgp-status.tmp.").is_some_and(digits)
        || rest.strip_prefix("bfd.tmp.").is_some_and(digits)
}

/// Removes `node`'s files in `shm_dir` ([`is_node_file`]); returns those removed.
/// Nothing else in the directory is touched (several nodes may share it in tests).
pub fn remove_node_files(shm_dir: &Path, node: &str) -> io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(shm_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut removed = Vec::new();
    for e in entries {
        let e = e?;
        let name = e.file_name();
        if name.to_str().is_some_and(|n| is_node_file(n, node)) {
            match std::fs::remove_file(e.path()) {
                Ok(()) => removed.push(e.path()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(err) => return Err(err),
            }
        }
    }
    removed.sort();
    Ok(removed)
}

/// Why a component could not finish its decommission.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    /// A file of the component could not be removed.
    #[error("removing {path}: {source}")]
    Remove {
        /// The file.
        path: PathBuf,
        /// What the file system said.
        source: io::Error,
    },
    /// The component was started without a decommission directory.
    #[error("decommissioned without a decommission directory")]
    NoDirectory,
    /// The acknowledgement could not be written.
    #[error("acknowledging in {dir}: {source}")]
    Acknowledge {
        /// The decommission directory.
        dir: PathBuf,
        /// What the file system said.
        source: io::Error,
    },
}

/// The last step of every node component's decommission: removes its `files` (those
/// present) and acknowledges for `component` in the Pod's decommission directory `dir`.
pub fn finish<'a>(
    files: impl IntoIterator<Item = &'a Path>,
    dir: Option<&Path>,
    component: Component,
) -> Result<(), FinishError> {
    for path in files {
        remove_if_present(path).map_err(|source| FinishError::Remove {
            path: path.to_path_buf(),
            source,
        })?;
    }
    let dir = dir.ok_or(FinishError::NoDirectory)?;
    acknowledge(dir, component).map_err(|source| FinishError::Acknowledge {
        dir: dir.to_path_buf(),
        source,
    })
}

/// Removes `path` if it exists.
pub fn remove_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finishing_removes_the_files_present_and_acknowledges() {
        let d = tempfile::tempdir().unwrap();
        let (status, absent) = (d.path().join("n.bgp-status.json"), d.path().join("n.x"));
        std::fs::write(&status, "{}").unwrap();
        let dir = d.path().join("decommission");
        std::fs::create_dir(&dir).unwrap();
        finish(
            [status.as_path(), absent.as_path()],
            Some(&dir),
            Component::Speaker,
        )
        .unwrap();
        assert!(!status.exists() && acknowledged(&dir, Component::Speaker));
        assert!(!acknowledged(&dir, Component::Bfd));
        // Started without a directory: said, after the files went.
        std::fs::write(&status, "{}").unwrap();
        let e = finish([status.as_path()], None, Component::Bfd).unwrap_err();
        assert!(matches!(e, FinishError::NoDirectory), "{e}");
        assert!(!status.exists());
    }

    #[test]
    fn a_node_s_files_and_nothing_else() {
        for f in [
            "node-a.state",
            "node-a.dataplane",
            "node-a.dataplane-stats.json",
            "node-a.bgp-status.json",
            "node-a.bfd.json",
            "node-a.tmp4242",
            "node-a.dataplane.tmp17",
            "node-a.dataplane-stats.tmp",
            "node-a.bgp-status.tmp.99",
            "node-a.bfd.tmp.1",
            "node-a.state.tmp4242",
            "node-a.dataplane-stats.json.tmp9",
            "node-a.bgp-status.json.tmp99",
            "node-a.bfd.json.tmp1",
        ] {
            assert!(is_node_file(f, "node-a"), "{f}");
        }
        for f in [
            "node-b.state",
            "node-a",
            "node-a.",
            "node-ab.state",
            "node-a.example.state",
            "node-a.tmp",
            "node-a.tmpx",
            "node-a.bfd.tmp.x",
            "node-a.state.tmp",
            "node-a.other.json.tmp1",
            "other",
            "node-a.state.bak",
        ] {
            assert!(!is_node_file(f, "node-a"), "{f}");
        }
        // A node whose name extends another's is its own.
        assert!(is_node_file("node-a.example.state", "node-a.example"));
    }

    #[test]
    fn request_acknowledge_and_remove() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("decommission");
        assert_eq!(requested(&dir), None);
        request(&dir, "uninstall-1").unwrap();
        assert_eq!(requested(&dir).as_deref(), Some("uninstall-1"));
        std::fs::write(dir.join(REQUEST_FILE), "  \n").unwrap();
        assert_eq!(requested(&dir), None, "an empty request is none");
        request(&dir, "uninstall-2").unwrap();
        assert!(!acknowledged(&dir, Component::Dataplane));
        acknowledge(&dir, Component::Dataplane).unwrap();
        assert!(acknowledged(&dir, Component::Dataplane));
        assert!(!acknowledged(&dir, Component::Speaker));

        let shm = d.path().join("run");
        std::fs::create_dir_all(&shm).unwrap();
        for f in ["node-a.state", "node-a.bfd.json", "node-b.state", "keep"] {
            std::fs::write(shm.join(f), "x").unwrap();
        }
        let removed = remove_node_files(&shm, "node-a").unwrap();
        assert_eq!(
            removed,
            vec![shm.join("node-a.bfd.json"), shm.join("node-a.state")]
        );
        assert!(shm.join("node-b.state").exists() && shm.join("keep").exists());
        assert!(remove_node_files(&d.path().join("missing"), "node-a")
            .unwrap()
            .is_empty());
        remove_if_present(&shm.join("node-b.state")).unwrap();
        remove_if_present(&shm.join("node-b.state")).unwrap();
    }
}
