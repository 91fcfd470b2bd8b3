//! Shared files, the parts every writer and reader of one does alike: mapping it whole
//! (what the node state, [`crate::shm`], and the dataplane status,
//! [`crate::dataplane_status`], do before reading their own headers), and replacing a
//! whole file atomically ([`write_atomically`]: the stats and status files, the
//! decommission request).

use std::fs::OpenOptions;
use std::io;
use std::path::Path;

use memmap2::{MmapOptions, MmapRaw};

/// The temporary file a new version of `path` is written to before it is renamed over
/// `path`: beside it (a rename within one filesystem), named after this process (two
/// writers never share one).
pub fn temporary_beside(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

/// Replaces `path` with `contents` so a reader sees the old or the new file whole,
/// never part of one: written to [`temporary_beside`] `path`, then renamed over it.
pub fn write_atomically(path: &Path, contents: &[u8]) -> io::Result<()> {
    let tmp = temporary_beside(path);
    std::fs::write(&tmp, contents)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Opens `path` and maps it whole (`MAP_SHARED`): read-write for a writer, read-only for
/// a reader (which then needs no write permission on the file). Returns the mapping and
/// the file's length, or the step that failed with its error. The caller checks the
/// length against its header before reading it, and accesses shared words only through
/// atomics (a read-only mapping is only loaded from).
pub(crate) fn map_whole(
    path: &Path,
    writable: bool,
) -> Result<(MmapRaw, u64), (&'static str, io::Error)> {
    let file = OpenOptions::new()
        .read(true)
        .write(writable)
        .open(path)
        .map_err(|e| ("opening", e))?;
    let len = file
        .metadata()
        .map_err(|e| ("reading metadata of", e))?
        .len();
    let map = if writable {
        MmapOptions::new().map_raw(&file)
    } else {
        MmapOptions::new().map_raw_read_only(&file)
    }
    .map_err(|e| ("mapping", e))?;
    Ok((map, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_file_is_replaced_and_no_temporary_file_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n1.stats.json");
        write_atomically(&path, b"old").unwrap();
        write_atomically(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["n1.stats.json"]);
        assert_eq!(
            temporary_beside(&path).parent(),
            path.parent(),
            "beside it: the rename stays within one filesystem"
        );
        let missing = dir.path().join("no-such-dir/file");
        assert!(write_atomically(&missing, b"x").is_err());
    }

    #[test]
    fn a_reader_maps_a_file_it_may_only_read_and_errors_name_the_step() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, [1u8; 64]).unwrap();
        let (map, len) = map_whole(&p, false).unwrap();
        assert_eq!(len, 64);
        assert_eq!(map.len(), 64);
        let (op, e) = map_whole(&dir.path().join("missing"), true).unwrap_err();
        assert_eq!(op, "opening");
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
