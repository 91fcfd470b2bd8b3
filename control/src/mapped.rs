//! Mapping a shared file whole: what the node state ([`crate::shm`]) and the dataplane
//! status ([`crate::dataplane_status`]) do alike before reading their own headers.

use std::fs::OpenOptions;
use std::io;
use std::path::Path;

use memmap2::{MmapOptions, MmapRaw};

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
