//! The node directory (`/run/juneau`) shared by a node's four processes: its group and
//! modes.
//!
//! The agent and BFD run as a non-root user, the dataplane and the speaker as root
//! without `CAP_DAC_OVERRIDE`; all four share one group (the node Pod's `runAsGroup`).
//! Files are read through that group: the node-state file is `0640`
//! ([`crate::shm::FILE_MODE`]), the others `0644`. A host path is created root-owned,
//! so before the processes start, a set-up step ([`prepare`], the node Pod's init
//! container) gives the directory to the group (`2770`: setgid, so every file made in it
//! later is the group's) and gives the group read and write on the files already there
//! (those of an earlier version, all root's), so the new processes can take over their
//! locks and files.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The directory's mode after [`prepare`]: owner and group read, write and search,
/// setgid (files made in it belong to its group), nothing for others.
pub const PREPARED_DIR_MODE: u32 = 0o2770;

/// What [`prepare`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Whether the directory had to be created.
    pub created: bool,
    /// Entries whose group or mode changed (the directory itself included).
    pub changed: Vec<PathBuf>,
}

/// Why [`prepare`] failed, with the path.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}: {source}")]
pub struct PrepareError {
    what: &'static str,
    path: PathBuf,
    #[source]
    source: io::Error,
}

fn err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> PrepareError {
    let path = path.to_path_buf();
    move |source| PrepareError { what, path, source }
}

/// Gives `dir` (created if missing) to group `gid` with [`PREPARED_DIR_MODE`], and every
/// regular file directly in it to `gid` with group read and write added (its other bits
/// kept). Symbolic links and other entries are left alone (never followed). Idempotent:
/// what already has the group and bits is not touched. Needs `CAP_CHOWN` and
/// `CAP_FOWNER` for entries another user owns.
pub fn prepare(dir: &Path, gid: u32) -> Result<Prepared, PrepareError> {
    let mut done = Prepared::default();
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(err("creating", dir))?;
        done.created = true;
    }
    let meta = std::fs::symlink_metadata(dir).map_err(err("reading", dir))?;
    if !meta.is_dir() {
        return Err(PrepareError {
            what: "preparing",
            path: dir.to_path_buf(),
            source: io::Error::other("not a directory"),
        });
    }
    if give(dir, &meta, gid, PREPARED_DIR_MODE)? {
        done.changed.push(dir.to_path_buf());
    }
    for entry in std::fs::read_dir(dir).map_err(err("listing", dir))? {
        let path = entry.map_err(err("listing", dir))?.path();
        let meta = std::fs::symlink_metadata(&path).map_err(err("reading", &path))?;
        if !meta.file_type().is_file() {
            continue;
        }
        let mode = (meta.mode() & 0o7777) | 0o060;
        if give(&path, &meta, gid, mode)? {
            done.changed.push(path);
        }
    }
    Ok(done)
}

/// Sets `path`'s group to `gid` and its mode to `mode`, each only if it differs; whether
/// anything changed.
fn give(path: &Path, meta: &std::fs::Metadata, gid: u32, mode: u32) -> Result<bool, PrepareError> {
    let chown = meta.gid() != gid;
    let mut changed = false;
    let mut current = meta.mode();
    if chown {
        std::os::unix::fs::lchown(path, None, Some(gid))
            .map_err(err("changing the group of", path))?;
        changed = true;
        // chown may clear setgid: compare with what the file has now.
        current = std::fs::symlink_metadata(path)
            .map_err(err("reading", path))?
            .mode();
    }
    if current & 0o7777 != mode {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(err("changing the mode of", path))?;
        changed = true;
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    fn gid(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().gid()
    }

    /// A group this test may give files to: the process's own primary group when not
    /// root, else an arbitrary one (root may give any).
    fn some_group() -> u32 {
        let me = std::fs::metadata("/proc/self").unwrap();
        if me.uid() == 0 {
            65532
        } else {
            me.gid()
        }
    }

    #[test]
    fn a_missing_directory_is_created_and_given_to_the_group() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("run-juneau");
        let g = some_group();
        let done = prepare(&dir, g).unwrap();
        assert!(done.created);
        assert_eq!(mode(&dir), PREPARED_DIR_MODE);
        assert_eq!(gid(&dir), g);
        // A file made in it afterwards is the group's (setgid directory).
        let f = dir.join("node-a.bfd.json");
        std::fs::write(&f, "{}").unwrap();
        assert_eq!(gid(&f), g);
        // A second run gives that file group write; a third changes nothing.
        let again = prepare(&dir, g).unwrap();
        assert_eq!(again.changed, std::slice::from_ref(&f));
        assert_eq!(mode(&f) & 0o060, 0o060);
        assert_eq!(prepare(&dir, g).unwrap(), Prepared::default());
    }

    /// An earlier version's files (owner only, or world-readable) get group read and
    /// write, their other bits kept; links and subdirectories are not touched.
    #[test]
    fn existing_files_get_group_read_and_write() {
        let dir = tempfile::tempdir().unwrap();
        let g = some_group();
        let state = dir.path().join("node-a.state");
        let lock = dir.path().join("node-a.agent.succession");
        std::fs::write(&state, "s").unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&lock, "1").unwrap();
        std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o644)).unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/etc/hostname", &link).unwrap();
        let done = prepare(dir.path(), g).unwrap();
        assert!(!done.created);
        assert_eq!(mode(&state), 0o660);
        assert_eq!(mode(&lock), 0o664);
        assert_eq!(gid(&state), g);
        assert_eq!(mode(&sub), 0o700, "subdirectories untouched");
        assert!(!done.changed.contains(&link));
        assert_eq!(mode(dir.path()), PREPARED_DIR_MODE);
    }

    #[test]
    fn a_file_where_the_directory_should_be_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let f = base.path().join("run-juneau");
        std::fs::write(&f, "").unwrap();
        let e = prepare(&f, some_group()).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
