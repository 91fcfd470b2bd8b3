//! The dataplane status: what this node's `juneau-dataplane` has programmed, and whether it
//! is alive — published by the dataplane (one writer), read by `juneau-bgp` (which
//! announces a VIP only while the dataplane is alive and has that VIP programmed).
//!
//! # Layout (version [`STATUS_LAYOUT_VERSION`])
//!
//! One small file per node, default [`default_path`] (`/run/juneau/<node>.dataplane`, next
//! to the node-state file), mapped `MAP_SHARED` by both processes:
//!
//! ```text
//! [0, 4096)              StatusHeader (#[repr(C)], 64 bytes used): magic "JUNEAUDP",
//!                        layout_version, vip_capacity, seq, state_generation,
//!                        heartbeat_mono_ns, started_mono_ns, pid, vip_count, stopped,
//!                        superseded
//! [4096, 4096 + 4*w*cap) programmed VIPs, w words each, sorted (IPv4 first), no repeats:
//!                        layout 1 (w = 1): an IPv4 address (host order);
//!                        layout 2 (w = 4): the IPv6 address, an IPv4 VIP IPv4-mapped,
//!                        each word the big-endian value of 4 of its bytes, first first
//! ```
//!
//! Layout 2 (issue 28) holds IPv6 VIPs too. The writer writes layout 1 while every VIP is
//! IPv4 and layout 2 once one is IPv6 (a new file, renamed over the path, as when it
//! grows); readers read both. So a speaker of before issue 28 (layout 1 only) keeps
//! reading a new dataplane's file in an upgrade, as long as no IPv6 VIP is programmed.
//!
//! # Protocol
//!
//! `state_generation`, `vip_count` and the VIP words are written under a seqlock (`seq`
//! odd while writing; the same argument as `docs/shared-memory.md`, with every shared
//! access atomic). The heartbeat is a single atomic store of `CLOCK_MONOTONIC` nanoseconds
//! — a system-wide clock, so the dataplane and the speaker compare it across processes and
//! containers (unless they run in different time namespaces, which Juneau's manifests do
//! not do) — made from the dataplane's per-iteration housekeeping, never per packet.
//!
//! A clean stop sets `stopped` (readers withdraw at once); a crash leaves the heartbeat to
//! age — and releases the writer's lock on `<path>.lock` ([`lock_path`]), which the
//! writer holds shared for its whole life: the kernel drops it the moment the process
//! dies, even by `kill -9`, so a reader that can take it exclusively knows the writer is
//! gone without waiting for the heartbeat to age ([`DataplaneStatus::exited`]). A new writer never reuses the old file: it writes a new one beside it, renames it
//! over the path and then sets `superseded` in the old one, so a reader re-opens the path
//! (and a reader still mapping the old file never sees it truncated).

use std::fs::OpenOptions;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};

/// `b"JUNEAUDP"` little-endian: identifies a Juneau dataplane-status file.
pub const STATUS_MAGIC: u64 = u64::from_le_bytes(*b"JUNEAUDP");
/// Bumped on every incompatible change of the layout: the newest this binary writes.
pub const STATUS_LAYOUT_VERSION: u32 = 2;
/// The layout of a file whose VIPs are all IPv4: one word per VIP. Still written (and
/// read) beside layout 2.
pub const STATUS_LAYOUT_IPV4: u32 = 1;
/// Words per programmed VIP in layout 2: an IPv6 address, IPv4 ones IPv4-mapped.
pub const STATUS_VIP_WORDS: usize = 4;

/// Words per VIP in `layout` (1 or 2).
fn words_per_vip(layout: u32) -> usize {
    if layout == STATUS_LAYOUT_IPV4 {
        1
    } else {
        STATUS_VIP_WORDS
    }
}
/// Bytes before the VIP words.
pub const STATUS_HEADER_BYTES: usize = 4096;
/// VIPs a new file holds; a publish that needs more grows the file (new file + rename).
pub const DEFAULT_VIP_CAPACITY: u32 = 1024;
const READ_RETRIES: usize = 1000;

/// `/run/juneau/<node>.dataplane`.
pub fn default_path(node: &str) -> PathBuf {
    Path::new(crate::shm::DEFAULT_DIR).join(format!("{node}.dataplane"))
}

/// The status file that goes with a node-state file: same directory and stem, extension
/// `.dataplane` (`/run/juneau/node-a.state` -> `/run/juneau/node-a.dataplane`). Both the
/// dataplane and the speaker derive their default from their `--state-file` this way.
pub fn path_for_state_file(state_file: &Path) -> PathBuf {
    state_file.with_extension("dataplane")
}

/// Nanoseconds of `CLOCK_MONOTONIC` (system-wide, never jumps, counts since boot).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer; CLOCK_MONOTONIC
    // always exists on Linux (vDSO, no syscall).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// The header. Written once at creation: magic, version, capacity. Everything else is
/// atomic (shared between processes).
#[repr(C)]
pub struct StatusHeader {
    magic: u64,
    layout_version: u32,
    vip_capacity: u32,
    /// Seqlock over `state_generation`, `vip_count` and the VIP words.
    seq: AtomicU64,
    /// Generation of the node-state table the dataplane has programmed (0: none yet).
    state_generation: AtomicU64,
    /// `CLOCK_MONOTONIC` ns of the writer's last sign of life.
    heartbeat_mono_ns: AtomicU64,
    /// `CLOCK_MONOTONIC` ns when the writer started.
    started_mono_ns: AtomicU64,
    /// The writer's process id (in its own pid namespace: informational only).
    pid: AtomicU32,
    /// VIPs in use of the VIP words.
    vip_count: AtomicU32,
    /// 1 once the writer stopped cleanly: nothing is programmed any more.
    stopped: AtomicU32,
    /// 1 once a newer file has been renamed over this one's path.
    superseded: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<StatusHeader>() == 64);
const _: () = assert!(std::mem::align_of::<StatusHeader>() == 8);
const _: () = assert!(std::mem::size_of::<StatusHeader>() <= STATUS_HEADER_BYTES);

/// Everything that can go wrong with a dataplane-status file.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The file could not be created, opened, sized, mapped or renamed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file does not start with the dataplane-status magic number.
    #[error("{path} is not a Juneau dataplane-status file (bad magic)")]
    NotAStatusFile {
        /// The file.
        path: PathBuf,
    },
    /// Written by a dataplane with another layout.
    #[error("{path} has dataplane-status layout version {found}, this binary reads versions 1 to {expected}; run matching versions of juneau-dataplane and juneau-bgp")]
    LayoutVersion {
        /// The file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this binary speaks.
        expected: u32,
    },
    /// The file is shorter than its header says.
    #[error("{path} is truncated: {len} bytes, layout needs {needed}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The length its header implies.
        needed: u64,
    },
    /// The writer kept rewriting the VIP set during every read attempt.
    #[error("the dataplane kept rewriting its status during {0} read attempts")]
    Contended(usize),
    /// A VIP that cannot be written: an IPv4-mapped IPv6 address (it would read back as
    /// IPv4).
    #[error("VIP {0} cannot be published: an IPv4-mapped IPv6 address (publish the IPv4 address)")]
    MappedVip(Ipv6Addr),
    /// The VIP count exceeds the file's capacity, or the VIPs are not sorted.
    #[error("{path} is corrupt: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StatusError + 'a {
    move |source| StatusError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn file_bytes(capacity: u32, layout: u32) -> u64 {
    STATUS_HEADER_BYTES as u64 + 4 * words_per_vip(layout) as u64 * u64::from(capacity)
}

struct Mapping {
    map: MmapRaw,
    capacity: u32,
    /// [`STATUS_LAYOUT_IPV4`] or [`STATUS_LAYOUT_VERSION`].
    layout: u32,
}

impl Mapping {
    fn header(&self) -> &StatusHeader {
        // SAFETY: the mapping is at least STATUS_HEADER_BYTES long (checked in `open`, or
        // created so), page-aligned, and StatusHeader is repr(C) of plain integers and
        // atomics, valid for every bit pattern. Its plain fields are only written before
        // the file is visible under its final name.
        unsafe { &*(self.map.as_ptr() as *const StatusHeader) }
    }

    fn vips(&self) -> &[AtomicU32] {
        // SAFETY: [STATUS_HEADER_BYTES, + 4 * words per VIP * capacity) lies inside the
        // mapping (length validated against capacity and layout), is 4-aligned, and
        // AtomicU32 has u32's layout; every process accesses these words only through
        // atomics.
        unsafe {
            std::slice::from_raw_parts(
                self.map.as_ptr().add(STATUS_HEADER_BYTES) as *const AtomicU32,
                self.capacity as usize * words_per_vip(self.layout),
            )
        }
    }

    /// Maps an existing file: read-only for readers (the speaker needs no write access
    /// to the dataplane's file), read-write for a writer marking it superseded.
    fn open(path: &Path, writable: bool) -> Result<Self, StatusError> {
        // MAP_SHARED mapping of a file only Juneau writes; every shared access is atomic
        // (see `header`, `vips`); the file is never truncated while in use (a new writer
        // renames a new file over it), so no SIGBUS. A read-only mapping is only ever
        // loaded from (atomic loads of at most 8 bytes, which never write on any target
        // Juneau builds for).
        let (map, len) =
            crate::mapped::map_whole(path, writable).map_err(|(op, e)| io(op, path)(e))?;
        if len < STATUS_HEADER_BYTES as u64 {
            return Err(StatusError::Truncated {
                path: path.to_path_buf(),
                len,
                needed: STATUS_HEADER_BYTES as u64,
            });
        }
        let m = Mapping {
            map,
            capacity: 0,
            layout: STATUS_LAYOUT_VERSION,
        };
        let h = m.header();
        if h.magic != STATUS_MAGIC {
            return Err(StatusError::NotAStatusFile {
                path: path.to_path_buf(),
            });
        }
        let layout = h.layout_version;
        if layout != STATUS_LAYOUT_VERSION && layout != STATUS_LAYOUT_IPV4 {
            return Err(StatusError::LayoutVersion {
                path: path.to_path_buf(),
                found: h.layout_version,
                expected: STATUS_LAYOUT_VERSION,
            });
        }
        let capacity = h.vip_capacity;
        if len < file_bytes(capacity, layout) {
            return Err(StatusError::Truncated {
                path: path.to_path_buf(),
                len,
                needed: file_bytes(capacity, layout),
            });
        }
        Ok(Mapping {
            capacity,
            layout,
            ..m
        })
    }

    /// Creates a new file at `path` (a temporary name, not yet visible to readers).
    fn create(path: &Path, capacity: u32, layout: u32, started: u64) -> Result<Self, StatusError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io("creating", path))?;
        file.set_len(file_bytes(capacity, layout))
            .map_err(io("sizing", path))?;
        // The file is private to this writer until renamed; see `open`.
        let map = MmapOptions::new()
            .map_raw(&file)
            .map_err(io("mapping", path))?;
        let hdr = StatusHeader {
            magic: STATUS_MAGIC,
            layout_version: layout,
            vip_capacity: capacity,
            seq: AtomicU64::new(0),
            state_generation: AtomicU64::new(0),
            heartbeat_mono_ns: AtomicU64::new(monotonic_ns()),
            started_mono_ns: AtomicU64::new(started),
            pid: AtomicU32::new(std::process::id()),
            vip_count: AtomicU32::new(0),
            stopped: AtomicU32::new(0),
            superseded: AtomicU32::new(0),
        };
        // SAFETY: the mapping is at least STATUS_HEADER_BYTES long and page-aligned; no
        // other process has this file mapped yet.
        unsafe { std::ptr::write(map.as_mut_ptr() as *mut StatusHeader, hdr) };
        Ok(Mapping {
            map,
            capacity,
            layout,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The writer (juneau-dataplane).

/// The one writer of a dataplane-status file.
pub struct DataplaneStatusWriter {
    path: PathBuf,
    live: Mapping,
    started: u64,
    /// `<path>.lock`, locked shared while this writer lives.
    _alive: std::fs::File,
}

/// The liveness lock beside the status file at `path`: `<node>.dataplane.lock`.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Opens the liveness lock of the status file at `path` (`None`: no lock file, a writer
/// of an older version or none ever started).
fn open_lock(path: &Path) -> Option<std::fs::File> {
    std::fs::File::open(lock_path(path)).ok()
}

/// Whether the status writer whose liveness lock is `lock` has exited: `Some(true)` when
/// nothing holds it, `Some(false)` while a writer holds it, `None` when that cannot be
/// told.
fn writer_exited(lock: &std::fs::File) -> Option<bool> {
    match lock.try_lock() {
        // Nobody holds it: let it go at once, a writer starting now must get it.
        Ok(()) => {
            let _ = lock.unlock();
            Some(true)
        }
        Err(std::fs::TryLockError::WouldBlock) => Some(false),
        Err(std::fs::TryLockError::Error(_)) => None,
    }
}

impl DataplaneStatusWriter {
    /// Creates a fresh status (nothing programmed, heartbeat now) and renames it over
    /// `path`; a file left by an earlier dataplane is marked superseded so its readers
    /// move to this one. The directory is created if missing.
    pub fn create(path: impl AsRef<Path>) -> Result<Self, StatusError> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("creating directory", dir))?;
        }
        // The lock before the file: a reader never sees this writer's status unlocked.
        let lock = lock_path(&path);
        let alive = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .map_err(io("creating the liveness lock", &lock))?;
        alive
            .lock_shared()
            .map_err(io("locking the liveness lock", &lock))?;
        let started = monotonic_ns();
        let live = Self::replace(&path, DEFAULT_VIP_CAPACITY, started, 0, &[])?;
        Ok(DataplaneStatusWriter {
            path,
            live,
            started,
            _alive: alive,
        })
    }

    /// Writes a complete new file holding `vips` (sorted; in the layout they need),
    /// renames it over `path`, marks the old file superseded.
    fn replace(
        path: &Path,
        capacity: u32,
        started: u64,
        generation: u64,
        vips: &[IpAddr],
    ) -> Result<Mapping, StatusError> {
        let tmp = crate::mapped::temporary_beside(path);
        let new = Mapping::create(&tmp, capacity, layout_for(vips), started)?;
        write_vips(&new, generation, vips);
        let old = Mapping::open(path, true).ok();
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(StatusError::Io {
                op: "renaming the new dataplane status over",
                path: path.to_path_buf(),
                source: e,
            });
        }
        if let Some(old) = old {
            old.header().superseded.store(1, Ordering::Release);
        }
        Ok(new)
    }

    /// The path readers open.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records that the node-state table of `state_generation` is installed and these
    /// VIPs (IPv4 or IPv6) are programmed (steered to the dataplane); also a heartbeat.
    /// Grows the file when the VIPs do not fit. Call it after each table is installed,
    /// not per packet. An IPv4-mapped IPv6 VIP is refused ([`StatusError::MappedVip`]),
    /// and nothing is published.
    pub fn publish<V: Into<IpAddr>>(
        &mut self,
        state_generation: u64,
        vips: impl IntoIterator<Item = V>,
    ) -> Result<(), StatusError> {
        let mut vips: Vec<IpAddr> = vips.into_iter().map(Into::into).collect();
        if let Some(m) = vips.iter().find_map(|v| match v {
            IpAddr::V6(a) if a.to_ipv4_mapped().is_some() => Some(*a),
            _ => None,
        }) {
            return Err(StatusError::MappedVip(m));
        }
        vips.sort_unstable();
        vips.dedup();
        let need = u32::try_from(vips.len()).unwrap_or(u32::MAX);
        if need > self.live.capacity || layout_for(&vips) != self.live.layout {
            let mut cap = self.live.capacity.max(1);
            while cap < need {
                cap = cap.saturating_mul(2);
            }
            self.live = Self::replace(&self.path, cap, self.started, state_generation, &vips)?;
        } else {
            write_vips(&self.live, state_generation, &vips);
        }
        self.heartbeat();
        Ok(())
    }

    /// Stamps the heartbeat: one clock read (vDSO) and one atomic store. Call it from the
    /// forwarding loop's housekeeping (at least every `idle_sleep`, never per packet).
    #[inline]
    pub fn heartbeat(&self) {
        self.heartbeat_at(monotonic_ns());
    }

    /// Stamps the heartbeat with a `CLOCK_MONOTONIC` reading the caller already has.
    #[inline]
    pub fn heartbeat_at(&self, mono_ns: u64) {
        self.live
            .header()
            .heartbeat_mono_ns
            .store(mono_ns, Ordering::Release);
    }

    /// Marks the dataplane stopped (nothing forwarded any more): readers withdraw at once
    /// instead of waiting for the heartbeat to age. Also done on drop.
    pub fn mark_stopped(&self) {
        self.live.header().stopped.store(1, Ordering::Release);
    }
}

impl Drop for DataplaneStatusWriter {
    fn drop(&mut self) {
        self.mark_stopped();
    }
}

/// The words of `vip` (IPv4 IPv4-mapped): [`crate::shm`]'s IPv6 word order.
fn vip_words(vip: IpAddr) -> [u32; STATUS_VIP_WORDS] {
    let v6 = match vip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    crate::shm::ipv6_words(v6)
}

/// The VIP of [`vip_words`].
fn vip_of(words: &[u32]) -> IpAddr {
    IpAddr::V6(crate::shm::ipv6_from_words(words)).to_canonical()
}

/// The layout a file holding `vips` is written in: 1 while they are all IPv4.
fn layout_for(vips: &[IpAddr]) -> u32 {
    if vips.iter().any(IpAddr::is_ipv6) {
        STATUS_LAYOUT_VERSION
    } else {
        STATUS_LAYOUT_IPV4
    }
}

/// Writes `vips` (sorted, of a family `m`'s layout holds) under the seqlock.
fn write_vips(m: &Mapping, generation: u64, vips: &[IpAddr]) {
    let h = m.header();
    let s = h.seq.load(Ordering::Relaxed);
    h.seq.store(s.wrapping_add(1) | 1, Ordering::Relaxed);
    fence(Ordering::Release);
    h.state_generation.store(generation, Ordering::Relaxed);
    h.vip_count.store(vips.len() as u32, Ordering::Relaxed);
    let w = words_per_vip(m.layout);
    for (dst, v) in m.vips().chunks_exact(w).zip(vips) {
        let words = vip_words(*v);
        let words = match v {
            IpAddr::V4(a) if w == 1 => [u32::from(*a), 0, 0, 0],
            _ => words,
        };
        for (d, x) in dst.iter().zip(words) {
            d.store(x, Ordering::Relaxed);
        }
    }
    h.seq.store((s | 1).wrapping_add(1), Ordering::Release);
}

// ---------------------------------------------------------------------------------------
// The reader (juneau-bgp, tests).

/// A consistent reading of the dataplane status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataplaneStatus {
    /// The dataplane's process id (in its own pid namespace).
    pub pid: u32,
    /// Time since its last heartbeat (zero if the stamp is in the future).
    pub heartbeat_age: Duration,
    /// How long the writer has been running.
    pub uptime: Duration,
    /// Generation of the node-state table it has programmed (0: none yet).
    pub state_generation: u64,
    /// The VIPs it has programmed, sorted (IPv4 first).
    pub vips: Vec<IpAddr>,
    /// It stopped cleanly: nothing is forwarded.
    pub stopped: bool,
    /// Its process is gone (crashed, killed): nothing holds its liveness lock. Known
    /// at once, before the heartbeat ages.
    pub exited: bool,
}

impl DataplaneStatus {
    /// Alive: not stopped, not exited, and a heartbeat younger than `max_age`.
    pub fn alive(&self, max_age: Duration) -> bool {
        !self.stopped && !self.exited && self.heartbeat_age <= max_age
    }

    /// Whether `vip` is programmed.
    pub fn has_vip(&self, vip: impl Into<IpAddr>) -> bool {
        self.vips.binary_search(&vip.into()).is_ok()
    }
}

/// A reader of a dataplane-status file. Follows the path when a new dataplane replaces
/// the file.
pub struct DataplaneStatusReader {
    path: PathBuf,
    map: Mapping,
    /// The writer's liveness lock, opened once (again when a new writer replaced the
    /// file, or while there is none).
    lock: Option<std::fs::File>,
}

impl DataplaneStatusReader {
    /// Opens and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StatusError> {
        let path = path.as_ref().to_path_buf();
        let map = Mapping::open(&path, false)?;
        let lock = open_lock(&path);
        Ok(DataplaneStatusReader { path, map, lock })
    }

    /// The file read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the current status (re-opening the path first if a new dataplane replaced
    /// the file). Allocates; call it on a timer, not per packet.
    pub fn read(&mut self) -> Result<DataplaneStatus, StatusError> {
        if self.map.header().superseded.load(Ordering::Acquire) != 0 {
            self.map = Mapping::open(&self.path, false)?;
            self.lock = None;
        }
        if self.lock.is_none() {
            self.lock = open_lock(&self.path);
        }
        let h = self.map.header();
        let mut vips = Vec::new();
        for _ in 0..READ_RETRIES {
            let s1 = h.seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let generation = h.state_generation.load(Ordering::Relaxed);
            let n = h.vip_count.load(Ordering::Relaxed) as usize;
            vips.clear();
            let mut words = [0u32; STATUS_VIP_WORDS];
            let wpv = words_per_vip(self.map.layout);
            for vip in self.map.vips().chunks_exact(wpv).take(n) {
                for (w, a) in words.iter_mut().zip(vip) {
                    *w = a.load(Ordering::Relaxed);
                }
                vips.push(if wpv == 1 {
                    IpAddr::V4(words[0].into())
                } else {
                    vip_of(&words)
                });
            }
            fence(Ordering::Acquire);
            if h.seq.load(Ordering::Relaxed) != s1 {
                continue;
            }
            if n > self.map.capacity as usize {
                return Err(StatusError::Corrupt {
                    path: self.path.clone(),
                    what: format!("{n} VIPs in a file for {}", self.map.capacity),
                });
            }
            if !vips.is_sorted_by(|a, b| a < b) {
                return Err(StatusError::Corrupt {
                    path: self.path.clone(),
                    what: "VIPs are not sorted or repeat".into(),
                });
            }
            let now = monotonic_ns();
            let beat = h.heartbeat_mono_ns.load(Ordering::Acquire);
            let started = h.started_mono_ns.load(Ordering::Relaxed);
            return Ok(DataplaneStatus {
                pid: h.pid.load(Ordering::Relaxed),
                heartbeat_age: Duration::from_nanos(now.saturating_sub(beat)),
                uptime: Duration::from_nanos(now.saturating_sub(started)),
                state_generation: generation,
                vips,
                stopped: h.stopped.load(Ordering::Acquire) != 0,
                exited: self.lock.as_ref().and_then(writer_exited).unwrap_or(false),
            });
        }
        Err(StatusError::Contended(READ_RETRIES))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([203, 0, 113, n])
    }

    fn ip6(n: u16) -> IpAddr {
        IpAddr::from(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, n))
    }

    #[test]
    fn ipv6_vips_round_trip_beside_ipv4_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        w.publish(5, [ip6(2), ip(9), ip6(1), ip(1), ip6(2)])
            .unwrap();
        let s = r.read().unwrap();
        assert_eq!(s.vips, vec![ip(1), ip(9), ip6(1), ip6(2)]);
        assert!(s.has_vip(ip6(1)) && !s.has_vip(ip6(3)));
        assert!(s.has_vip(Ipv4Addr::new(203, 0, 113, 9)));
        // The words on disk: an IPv4 VIP is IPv4-mapped, the last word its address.
        let bytes = std::fs::read(&path).unwrap();
        let word = |i: usize| {
            let at = STATUS_HEADER_BYTES + 4 * i;
            u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
        };
        assert_eq!(bytes[8..12], 2u32.to_le_bytes(), "layout 2");
        assert_eq!(
            [word(0), word(1), word(2), word(3)],
            [0, 0, 0xffff, 0xcb00_7101]
        );
        assert_eq!(
            [word(8), word(9), word(10), word(11)],
            [0x2001_0db8, 0, 0, 1]
        );
    }

    /// While every VIP is IPv4 the file is layout 1, word for word what a dataplane of
    /// before issue 28 wrote, so an older speaker reads it during an upgrade; an IPv6
    /// VIP moves it to layout 2 (a new file: the reader follows), and back.
    #[test]
    fn ipv4_only_sets_are_written_in_layout_1_and_an_ipv6_vip_moves_to_layout_2() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        let layout_and_words = || {
            let b = std::fs::read(&path).unwrap();
            let word = |i: usize| {
                let at = STATUS_HEADER_BYTES + 4 * i;
                u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
            };
            (
                u32::from_le_bytes(b[8..12].try_into().unwrap()),
                [word(0), word(1)],
            )
        };
        w.publish(1, [ip(2), ip(1)]).unwrap();
        assert_eq!(layout_and_words(), (1, [0xcb00_7101, 0xcb00_7102]));
        assert_eq!(r.read().unwrap().vips, vec![ip(1), ip(2)]);
        w.publish(2, [ip(1), ip6(7)]).unwrap();
        assert_eq!(layout_and_words(), (2, [0, 0]));
        let s = r.read().unwrap();
        assert_eq!((s.state_generation, s.vips), (2, vec![ip(1), ip6(7)]));
        w.publish(3, [ip(3)]).unwrap();
        assert_eq!(layout_and_words(), (1, [0xcb00_7103, 0]));
        let s = r.read().unwrap();
        assert_eq!((s.state_generation, s.vips), (3, vec![ip(3)]));
    }

    #[test]
    fn an_ipv4_mapped_vip_is_refused_and_nothing_is_published() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        w.publish(1, [ip(1)]).unwrap();
        let mapped: Ipv6Addr = "::ffff:203.0.113.2".parse().unwrap();
        let e = w.publish(2, [ip(3), IpAddr::V6(mapped)]).unwrap_err();
        assert!(matches!(e, StatusError::MappedVip(m) if m == mapped), "{e}");
        assert!(e.to_string().contains("IPv4-mapped"), "{e}");
        let s = DataplaneStatusReader::open(&path).unwrap().read().unwrap();
        assert_eq!((s.state_generation, s.vips), (1, vec![ip(1)]));
    }

    #[test]
    fn unsorted_or_repeated_vips_in_the_file_are_refused_as_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        w.publish(1, [ip(1), ip(2)]).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // The second VIP (layout 1: word 1) := the first: a repeat.
        let at = STATUS_HEADER_BYTES + 4;
        bytes[at..at + 4].copy_from_slice(&0xcb00_7101u32.to_le_bytes());
        let bad = dir.path().join("bad.dataplane");
        std::fs::write(&bad, &bytes).unwrap();
        let e = DataplaneStatusReader::open(&bad)
            .unwrap()
            .read()
            .unwrap_err();
        assert!(matches!(e, StatusError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("not sorted or repeat"), "{e}");
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_for_state_file(&dir.path().join("node-a.state"));
        assert_eq!(path, dir.path().join("node-a.dataplane"));
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        let s = r.read().unwrap();
        assert_eq!(s.state_generation, 0);
        assert!(s.vips.is_empty());
        assert_eq!(s.pid, std::process::id());
        assert!(s.alive(Duration::from_secs(5)), "{s:?}");

        w.publish(7, [ip(2), ip(1), ip(2)]).unwrap();
        let s = r.read().unwrap();
        assert_eq!(s.state_generation, 7);
        assert_eq!(s.vips, vec![ip(1), ip(2)]);
        assert!(s.has_vip(ip(1)) && !s.has_vip(ip(3)));

        w.publish(8, [ip(3)]).unwrap();
        let s = r.read().unwrap();
        assert_eq!((s.state_generation, s.vips.clone()), (8, vec![ip(3)]));
    }

    /// The liveness lock tells a gone writer at once: held by a live process, free the
    /// moment it is killed (`kill -9`: no chance to mark anything stopped).
    #[test]
    fn a_killed_writer_is_known_gone_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        assert!(open_lock(&path).is_none(), "no lock file: cannot tell");
        // This process as the writer: alive while it holds the lock.
        let w = DataplaneStatusWriter::create(&path).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        let s = r.read().unwrap();
        assert!(!s.exited && s.alive(Duration::from_secs(5)), "{s:?}");
        drop(w);
        let s = r.read().unwrap();
        assert!(s.exited && s.stopped, "{s:?}");
        // Another process holding the lock shared, as a dataplane does, then killed.
        // --no-fork: flock execs the command, so killing it kills the lock's holder.
        let mut holder = std::process::Command::new("flock")
            .args(["--shared", "--no-fork"])
            .arg(lock_path(&path))
            .args(["sleep", "30"])
            .spawn()
            .expect("flock (util-linux)");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while r.read().unwrap().exited {
            assert!(
                std::time::Instant::now() < deadline,
                "flock never took the lock"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        holder.kill().unwrap();
        holder.wait().unwrap();
        assert!(r.read().unwrap().exited, "the kernel released it");
        // The reader's own look at the lock took nothing: a new writer gets it.
        let _w = DataplaneStatusWriter::create(&path).unwrap();
        assert!(!r.read().unwrap().exited);
    }

    #[test]
    fn heartbeat_ages_and_refreshes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let w = DataplaneStatusWriter::create(&path).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        // A beat 2 s in the past: stale for a 1 s limit.
        w.heartbeat_at(monotonic_ns() - 2_000_000_000);
        let s = r.read().unwrap();
        assert!(s.heartbeat_age >= Duration::from_secs(2), "{s:?}");
        assert!(!s.alive(Duration::from_secs(1)));
        assert!(s.alive(Duration::from_secs(10)));
        w.heartbeat();
        assert!(r.read().unwrap().alive(Duration::from_secs(1)));
    }

    #[test]
    fn writer_gone_stopped_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        w.publish(3, [ip(1)]).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        drop(w);
        // A clean stop is visible at once; the last VIP set stays readable.
        let s = r.read().unwrap();
        assert!(s.stopped && !s.alive(Duration::from_secs(60)), "{s:?}");
        assert_eq!(s.vips, vec![ip(1)]);

        // A restarted dataplane: a fresh file, nothing programmed, the reader follows.
        let mut w2 = DataplaneStatusWriter::create(&path).unwrap();
        let s = r.read().unwrap();
        assert!(
            !s.stopped && s.vips.is_empty() && s.state_generation == 0,
            "{s:?}"
        );
        w2.publish(4, [ip(1)]).unwrap();
        assert_eq!(r.read().unwrap().vips, vec![ip(1)]);
        // No temporary file is left behind: the status and its liveness lock.
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["n.dataplane", "n.dataplane.lock"], "{names:?}");
    }

    #[test]
    fn grows_past_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        let mut r = DataplaneStatusReader::open(&path).unwrap();
        let many: Vec<IpAddr> = (0..3000u32)
            .map(|i| IpAddr::from(Ipv4Addr::from(0x0a00_0000 + i)))
            .collect();
        w.publish(9, many.clone()).unwrap();
        let s = r.read().unwrap();
        assert_eq!(s.vips, many);
        assert!(!s.stopped);
    }

    #[test]
    fn version_mismatch_and_bad_files_are_refused_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        DataplaneStatusWriter::create(&path)
            .unwrap()
            .publish(1, [ip(1)])
            .unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = DataplaneStatusReader::open(&path).err().unwrap();
        assert!(
            matches!(
                e,
                StatusError::LayoutVersion {
                    found: 99,
                    expected: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("juneau-bgp"), "{e}");
        // A layout newer than this reader's is refused the same way, not misread.
        bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = DataplaneStatusReader::open(&path).err().unwrap();
        assert!(
            matches!(e, StatusError::LayoutVersion { found: 3, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("reads versions 1 to 2"), "{e}");

        std::fs::write(&path, b"JUNEAUNS").unwrap();
        let e = DataplaneStatusReader::open(&path).err().unwrap();
        assert!(matches!(e, StatusError::Truncated { .. }), "{e}");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let e = DataplaneStatusReader::open(&path).err().unwrap();
        assert!(matches!(e, StatusError::NotAStatusFile { .. }), "{e}");
        let e = DataplaneStatusReader::open(dir.path().join("missing"))
            .err()
            .unwrap();
        assert!(matches!(e, StatusError::Io { .. }), "{e}");
    }

    #[test]
    fn concurrent_reader_never_sees_a_torn_set() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.dataplane");
        let mut w = DataplaneStatusWriter::create(&path).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (path, stop) = (path.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut r = DataplaneStatusReader::open(&path).unwrap();
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let s = match r.read() {
                        Ok(s) => s,
                        Err(StatusError::Contended(_)) => continue,
                        Err(e) => panic!("{e}"),
                    };
                    // Generation g publishes exactly the VIPs 1..=g%50.
                    let want: Vec<IpAddr> = (1..=(s.state_generation % 50) as u32)
                        .map(|a| IpAddr::from(Ipv4Addr::from(a)))
                        .collect();
                    assert_eq!(s.vips, want, "torn at generation {}", s.state_generation);
                    seen += 1;
                }
                seen
            })
        };
        for g in 1..20_000u64 {
            w.publish(g, (1..=(g % 50) as u32).map(Ipv4Addr::from))
                .unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
    }
}
