//! The shared-memory ABI: one node's [`NodeState`] published by one writer (the node
//! agent) to any number of readers (the dataplane, the BGP speaker), lock-free.
//!
//! # Layout (version [`LAYOUT_VERSION`])
//!
//! One file per node (default [`default_path`]), mapped `MAP_SHARED` by everyone:
//!
//! ```text
//! [0, 4096)                  FileHeader  (#[repr(C)]: magic, version, capacity, generation,
//!                                          change futex, superseded flag, heartbeat, slot seqs)
//! [4096, 4096 + S)           slot 0      (a complete table, S = slot_words * 4 bytes)
//! [4096 + S, 4096 + 2S)      slot 1
//! ```
//!
//! A slot is an array of 32-bit words: an 80-word slot header, then fixed-capacity
//! sections — services ([`SERVICE_WORDS`] each), backends (2), Maglev slots (two u16 per word),
//! advertised VIPs ([`VIP_WORDS`]), peers ([`PEER_WORDS`]), and (layout 4) redirect VIPs
//! ([`REDIRECT_VIP_WORDS`]) with their peer nodes' addresses (one word each), (layout 6)
//! a fixed section of [`MAX_REDIRECT_KEYS`] redirect MAC key records
//! ([`REDIRECT_KEY_WORDS`]), and (layout 8) the frontends' source ranges
//! ([`SOURCE_RANGE_WORDS`] each). Since layout 9 an advertised VIP and a peer's
//! addresses may be IPv6 (a family flag and four words per address); since layout 10 IPv6
//! frontends have sections of their own (services, backends, Maglev tables and source
//! ranges, [`SERVICE6_WORDS`], [`BACKEND6_WORDS`], [`SOURCE_RANGE6_WORDS`]) after the
//! IPv4 ones. Everything is stored as
//! offsets and counts, never pointers; all shared accesses are atomic loads and stores,
//! so there is no data race even in the language model's sense.
//!
//! # Protocol
//!
//! Publishing generation `g` writes slot `g % 2` under that slot's sequence counter
//! (odd while writing — a seqlock), then stores `g` into the header's generation (Release)
//! and wakes futex waiters. Readers load the generation (one atomic load: the per-batch
//! check), copy the slot it names between two reads of the slot's sequence, and retry if
//! the sequence moved or was odd; the copy also carries a checksum. The writer only ever
//! writes the slot that is *not* current, so a reader is only ever retried if it is more
//! than one whole publish behind. Why this is correct is argued in `docs/shared-memory.md`.
//!
//! Growing past capacity writes a complete new file beside the old one and renames it
//! over the path; the old file is then marked superseded (and its generation bumped so a
//! reader notices with the same single load). Nothing ever shrinks a mapped file.
//! A writer that dies mid-update leaves the current slot untouched: readers keep the last
//! good table and can see the writer is gone from [`NodeStateReader::heartbeat_age`].

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use memmap2::MmapRaw;

use crate::maglev::{self, MaglevTable};
use crate::model::{
    AdvertisedVip, BfdAuth, BfdAuthType, BfdSettings, DrainSettings, Frontend, Frontend6,
    LocalBackend, LocalBackend6, NodeService, NodeService6, NodeState, PeerConfig, Protocol,
    RedirectKey, Redirects, SourceRange, VipRedirectPeers, VipRedirectPeers6, BFD_KEY_MAX_BYTES,
    MAX_REDIRECT_KEYS,
};
use crate::secret::{SecretKey, KEY_BYTES};

/// `b"JUNEAUNS"` little-endian: identifies a Juneau node-state file.
pub const MAGIC: u64 = u64::from_le_bytes(*b"JUNEAUNS");
/// Bumped on every incompatible change of the layout below.
///
/// - 1: first release.
/// - 2: graceful drain — a service record carries a terminating-backend count after its
///   Ready count ([`SERVICE_WORDS`] 4 -> 5), the terminating backends follow the Ready
///   ones, and a backend record's port word has [`BACKEND_TERMINATING`] set for them.
///   (Merged with) BFD: 8 more words per peer (BFD and drain settings).
/// - 3: both of the above in one layout (two branches had each bumped to 2).
/// - 4: redirects between nodes — the capacity gains redirect VIPs and redirect
///   node addresses (file header 96 -> 104 bytes), the slot header carries this node's
///   redirect address (words 10, 11) and the two counts (12, 13), and two sections follow
///   the peers: redirect VIP records (vip, first address, count) and node addresses.
/// - 5: the slot checksum (words 6, 7) is no longer FNV-1a over the used words' bytes but
///   a seed plus the wrapping sum of a 64-bit mix of each nonzero used word with its
///   index (`word_sum`): the writer updates it per changed word (hashing 80 MB
///   was 100 ms of a 130 ms publish at 10 000 Services), readers verify it several times
///   faster. Nothing else changed.
/// - 6: the redirect channel's MAC keys — slot header word 14 counts them (at
///   most [`MAX_REDIRECT_KEYS`]), and a fixed section of [`MAX_REDIRECT_KEYS`] records of
///   [`REDIRECT_KEY_WORDS`] (key id, then the 16 key bytes) follows the redirect node
///   addresses. The capacity and the file header are unchanged.
/// - 7: BFD authentication — [`PEER_EXTRA_WORDS`] 8 -> 16: extra word 6 holds
///   the type (1 keyed SHA1, 2 meticulous; 0 none), key id << 8 and key length << 16,
///   words 8-12 the key ([`BFD_KEY_MAX_BYTES`] bytes).
/// - 8: source ranges (`loadBalancerSourceRanges`) and session affinity — [`SERVICE_WORDS`]
///   5 -> 8 (the first source range and the count; the ClientIP affinity timeout in
///   seconds, 0 for none), slot header word 15 counts the ranges, a section of
///   [`SOURCE_RANGE_WORDS`] records (network, prefix length) follows the redirect keys,
///   and the capacity gains `source_ranges` (in the file header's former padding word:
///   the header stays 104 bytes).
/// - 9: IPv6 advertised VIPs and peers (issue 28) — [`VIP_WORDS`] 32 -> 36: word 7 holds
///   the flags ([`VIP_IPV6`]: the VIP is the IPv6 address in words 32-35, word 0 is 0);
///   [`PEER_EXTRA_WORDS`] 16 -> 24: settings word 11 holds [`PEER_IPV6`] and
///   [`PEER_SOURCE_IPV6`], extra words 16-19 the IPv6 peer address and 20-23 the IPv6
///   source address (the IPv4 words 0 and 4 are then 0). An IPv6 address is stored as
///   four words, each the big-endian value of 4 of its bytes, first bytes first.
///   Frontends, backends and redirects stay IPv4.
/// - 10: IPv6 frontends (issue 28) — the capacity gains `services6`, `backends6` and
///   `source_ranges6` (file header 104 -> 120 bytes: the capacity 32 -> 44 bytes, then a
///   padding word), the slot header grows by 8 words before the node name (words 16, 17,
///   18: the IPv6 service, backend and source range counts; 19-23 spare, zero), and four
///   sections follow the source ranges: IPv6 service records ([`SERVICE6_WORDS`]), IPv6
///   backend records ([`BACKEND6_WORDS`]), one Maglev table per IPv6 service (as the
///   IPv4 ones), and IPv6 source ranges ([`SOURCE_RANGE6_WORDS`]). IPv4 records are
///   unchanged; IPv6 addresses are stored as in layout 9. Redirects stay IPv4.
/// - 11: redirects for IPv6 VIPs (issue 28) — slot header word 19 counts the IPv6
///   redirect VIP records (20-23 spare, zero), a section of `redirect_vips` such records
///   ([`REDIRECT_VIP6_WORDS`]: the VIP in 4 words, first node address, count) follows the
///   IPv6 source ranges, their node addresses follow the IPv4 VIPs' in the one node
///   address section (word 13 counts both), and an IPv6 service record's second word
///   may carry [`SERVICE_HAND_OFF`] (the Cluster policy). The capacity and the file
///   header are unchanged: `redirect_vips` bounds each family's records.
/// - 12: slot header words 20, 21 hold the Maglev tables' part of the checksum (the sum of
///   `word_sum` over both Maglev sections' used words; 22, 23 spare, zero), so a reader
///   that needs no table (the BGP speaker: [`NodeStateReader::routing_snapshot`]) copies
///   and verifies every other word without the tables, ~98 % of a slot at scale.
pub const LAYOUT_VERSION: u32 = 12;
/// Bytes before slot 0.
pub const HEADER_BYTES: usize = 4096;
/// Words per service record: vip, protocol | flags | port << 16, first backend, Ready backend
/// count, terminating backend count, first source range, source range count, ClientIP
/// affinity timeout (seconds; 0: none). The service's Ready backends are records
/// `first .. first + ready`, its terminating ones follow them; its source ranges are
/// records `first .. first + count` of that section.
pub const SERVICE_WORDS: usize = 8;
/// Bit of a service record's second word (protocol | flags | port << 16): new connections
/// without a Ready backend here are handed on (`NodeService::hand_off`). Added within
/// layout 8: a reader that ignores it serves the frontend as Local would.
pub const SERVICE_HAND_OFF: u32 = 1 << 8;
/// Bit of a service record's second word: the backends are this node's own stack
/// (`NodeService::host_network`). Added within layout 8: a reader that ignores it
/// forwards to the node's address through userspace, which the node's stack refuses
/// (the frontend is then not served, rather than served wrongly).
pub const SERVICE_HOST_NETWORK: u32 = 1 << 9;
/// Words per source range record (layout 8): the network address, the prefix length.
pub const SOURCE_RANGE_WORDS: usize = 2;
/// Words per IPv6 service record (layout 10): the VIP (4 words), protocol | flags | port
/// << 16 (layout 11: [`SERVICE_HAND_OFF`]), first IPv6 backend, Ready count, terminating count, first IPv6
/// source range, source range count, ClientIP affinity timeout (0: none), spare (0).
pub const SERVICE6_WORDS: usize = 12;
/// Words per IPv6 backend record (layout 10): the address (4 words), port | flags << 16
/// ([`BACKEND_TERMINATING`] as for IPv4).
pub const BACKEND6_WORDS: usize = 5;
/// Words per IPv6 source range record (layout 10): the network (4 words), the prefix
/// length.
pub const SOURCE_RANGE6_WORDS: usize = 5;
/// Words per backend record: ip, port | flags << 16.
pub const BACKEND_WORDS: usize = 2;
/// Flag in a backend record's port word: the backend is `serving` but `terminating`
/// (existing flows only; never in the Maglev table).
pub const BACKEND_TERMINATING: u32 = 1 << 16;
/// Standard communities per advertised VIP.
pub const MAX_COMMUNITIES: usize = 8;
/// Large communities per advertised VIP.
pub const MAX_LARGE_COMMUNITIES: usize = 4;
/// Words per advertised-VIP record: the IPv4 VIP, LOCAL_PREF and whether set, the peer
/// mask (2), the community counts (2), flags, 8 communities, 4 large communities (3
/// each), weight and whether set, 2 spare, and (layout 9) the IPv6 VIP (4).
pub const VIP_WORDS: usize = 36;
/// Flag in an advertised-VIP record's word 7 (layout 9): the VIP is IPv6 (words 32-35).
pub const VIP_IPV6: u32 = 1;
/// Flag in a peer record's settings word 11 (layout 9): the peer address is IPv6 (extra
/// words 16-19).
pub const PEER_IPV6: u32 = 1;
/// Flag in a peer record's settings word 11 (layout 9): the source address is IPv6
/// (extra words 20-23).
pub const PEER_SOURCE_IPV6: u32 = 2;
/// Bytes of a name (node or peer) stored in a slot: Kubernetes names are at most 253.
pub const NAME_BYTES: usize = 256;
/// Bytes of a TCP-MD5 key (the kernel's `TCP_MD5SIG_MAXKEYLEN`).
pub const MD5_BYTES: usize = 80;
/// Words per peer record: name, 12 words of settings, the TCP-MD5 key, then
/// [`PEER_EXTRA_WORDS`] (BFD; layout 2).
pub const PEER_WORDS: usize = NAME_BYTES / 4 + 12 + MD5_BYTES / 4 + PEER_EXTRA_WORDS;
/// Words of a peer record after the TCP-MD5 key: BFD min rx, min tx, multiplier; drain
/// prepend, LOCAL_PREF, wait; BFD authentication type, key id and key length; spare;
/// the BFD key (5 words); spare (layout 7); the IPv6 peer address (4), the IPv6 source
/// address (4) (layout 9).
pub const PEER_EXTRA_WORDS: usize = 24;
/// Peers addressable by an advertised VIP's peer mask.
pub const MAX_PEERS: u32 = 64;
/// Words per redirect VIP record: vip, first node address, count.
pub const REDIRECT_VIP_WORDS: usize = 3;
/// Words per IPv6 redirect VIP record (layout 11): the VIP (4 words), first node
/// address, count.
pub const REDIRECT_VIP6_WORDS: usize = 6;
/// Most redirect peer nodes per VIP (a redirected packet visits at most 8 nodes anyway;
/// the agent keeps the first ones and says so).
pub const MAX_REDIRECT_NODES_PER_VIP: usize = 64;
/// Words per redirect MAC key record (layout 6): the key id (low byte), then the
/// [`KEY_BYTES`] key bytes.
pub const REDIRECT_KEY_WORDS: usize = 1 + KEY_BYTES / 4;
/// Slot header: 16 words of counts/generation/checksum/router id, 8 words of IPv6 counts
/// and spares (layout 10), then the node name.
const SLOT_HEADER_WORDS: usize = 24 + NAME_BYTES / 4;
/// Slot header words 20, 21 (layout 12): the Maglev tables' part of the checksum, low
/// word first.
const TABLES_SUM_WORDS: std::ops::Range<usize> = 20..22;
/// Slot header words 22, 23 (layout 12): spare, zero.
const SLOT_HEADER_SPARE: std::ops::Range<usize> = 22..24;
const READ_RETRIES: usize = 1000;

/// The directory node-state files live in by default.
pub const DEFAULT_DIR: &str = "/run/juneau";
/// Mode of a node-state file: it carries the BGP peers' TCP-MD5 passwords and the
/// redirect and BFD keys, so only its owner (the node agent's user) writes it and only
/// the node processes' group (`deploy/`: the node Pod's `runAsGroup`, see
/// [`crate::node_dir`]) reads it; nobody else.
pub const FILE_MODE: u32 = 0o640;
/// Mode of a node-state directory the writer creates (an existing one is left as is):
/// the group's processes write their own files beside the state.
pub const DIR_MODE: u32 = 0o770;

/// `/run/juneau/<node>.state`.
pub fn default_path(node: &str) -> PathBuf {
    Path::new(DEFAULT_DIR).join(format!("{node}.state"))
}

/// How many of each thing a file holds. A publish that needs more grows the file.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Frontends (`VIP:port/proto`).
    pub services: u32,
    /// Backends over all frontends.
    pub backends: u32,
    /// Advertised VIPs.
    pub vips: u32,
    /// BGP peers (at most [`MAX_PEERS`]).
    pub peers: u32,
    /// Maglev table size per frontend (a prime).
    pub maglev_size: u32,
    /// VIPs with redirect peers (layout 4).
    pub redirect_vips: u32,
    /// Redirect peer addresses over all those VIPs (layout 4).
    pub redirect_nodes: u32,
    /// Source ranges over all frontends (layout 8).
    pub source_ranges: u32,
    /// IPv6 frontends (layout 10); each has a Maglev table of `maglev_size`.
    pub services6: u32,
    /// IPv6 backends over all IPv6 frontends (layout 10).
    pub backends6: u32,
    /// IPv6 source ranges over all IPv6 frontends (layout 10).
    pub source_ranges6: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity {
            services: 64,
            backends: 1024,
            vips: 64,
            peers: 8,
            maglev_size: maglev::DEFAULT_TABLE_SIZE,
            redirect_vips: 64,
            redirect_nodes: 256,
            source_ranges: 64,
            // Small until IPv6 Services are in use: the file grows when they come.
            services6: 8,
            backends6: 128,
            source_ranges6: 16,
        }
    }
}

impl Capacity {
    fn maglev_words(&self) -> usize {
        (self.maglev_size as usize).div_ceil(2)
    }

    fn sections(&self) -> Sections {
        let services = SLOT_HEADER_WORDS;
        let backends = services + self.services as usize * SERVICE_WORDS;
        let maglev = backends + self.backends as usize * BACKEND_WORDS;
        let vips = maglev + self.services as usize * self.maglev_words();
        let peers = vips + self.vips as usize * VIP_WORDS;
        let redirect_vips = peers + self.peers as usize * PEER_WORDS;
        let redirect_nodes = redirect_vips + self.redirect_vips as usize * REDIRECT_VIP_WORDS;
        let redirect_keys = redirect_nodes + self.redirect_nodes as usize;
        let source_ranges = redirect_keys + MAX_REDIRECT_KEYS * REDIRECT_KEY_WORDS;
        let services6 = source_ranges + self.source_ranges as usize * SOURCE_RANGE_WORDS;
        let backends6 = services6 + self.services6 as usize * SERVICE6_WORDS;
        let maglev6 = backends6 + self.backends6 as usize * BACKEND6_WORDS;
        let source_ranges6 = maglev6 + self.services6 as usize * self.maglev_words();
        let redirect_vips6 = source_ranges6 + self.source_ranges6 as usize * SOURCE_RANGE6_WORDS;
        let end = redirect_vips6 + self.redirect_vips as usize * REDIRECT_VIP6_WORDS;
        Sections {
            services,
            backends,
            maglev,
            vips,
            peers,
            redirect_vips,
            redirect_nodes,
            redirect_keys,
            source_ranges,
            services6,
            backends6,
            maglev6,
            source_ranges6,
            redirect_vips6,
            end,
        }
    }

    /// The smallest capacity at least as large as `self` that holds `state`.
    fn grown_for(&self, need: &Capacity) -> Capacity {
        fn grow(have: u32, need: u32) -> u32 {
            let mut c = have.max(1);
            while c < need {
                c = c.saturating_mul(2);
            }
            c
        }
        Capacity {
            services: grow(self.services, need.services),
            backends: grow(self.backends, need.backends),
            vips: grow(self.vips, need.vips),
            peers: grow(self.peers, need.peers).min(MAX_PEERS),
            maglev_size: self.maglev_size,
            redirect_vips: grow(self.redirect_vips, need.redirect_vips),
            redirect_nodes: grow(self.redirect_nodes, need.redirect_nodes),
            source_ranges: grow(self.source_ranges, need.source_ranges),
            services6: grow(self.services6, need.services6),
            backends6: grow(self.backends6, need.backends6),
            source_ranges6: grow(self.source_ranges6, need.source_ranges6),
        }
    }

    fn holds(&self, need: &Capacity) -> bool {
        need.services <= self.services
            && need.backends <= self.backends
            && need.vips <= self.vips
            && need.peers <= self.peers
            && need.redirect_vips <= self.redirect_vips
            && need.redirect_nodes <= self.redirect_nodes
            && need.source_ranges <= self.source_ranges
            && need.services6 <= self.services6
            && need.backends6 <= self.backends6
            && need.source_ranges6 <= self.source_ranges6
    }

    /// Bytes of a whole file with this capacity.
    pub fn file_bytes(&self) -> usize {
        HEADER_BYTES + 2 * self.sections().end * 4
    }
}

#[derive(Debug, Clone, Copy)]
struct Sections {
    services: usize,
    backends: usize,
    maglev: usize,
    vips: usize,
    peers: usize,
    redirect_vips: usize,
    redirect_nodes: usize,
    redirect_keys: usize,
    source_ranges: usize,
    services6: usize,
    backends6: usize,
    maglev6: usize,
    source_ranges6: usize,
    redirect_vips6: usize,
    end: usize,
}

/// The file header. Fields written once at creation are plain; fields that change are
/// atomics (the file is shared between processes, so "change" means any time).
#[repr(C)]
pub struct FileHeader {
    magic: u64,
    layout_version: u32,
    header_bytes: u32,
    capacity: Capacity,
    _pad0: u32,
    slot_words: u64,
    /// Generation of the current table; slot `generation % 2` holds it. 0: none yet.
    generation: AtomicU64,
    /// Low 32 bits of the generation, for futex waiters.
    change_futex: AtomicU32,
    /// 1 once a newer file has been renamed over this one's path.
    superseded: AtomicU32,
    /// Wall-clock nanoseconds since the Unix epoch of the writer's last sign of life.
    heartbeat_unix_ns: AtomicU64,
    writer_pid: AtomicU32,
    _pad1: u32,
    /// Seqlock counter per slot: odd while the writer is writing that slot.
    slot_seq: [AtomicU64; 2],
}

const _: () = assert!(std::mem::size_of::<Capacity>() == 44);
const _: () = assert!(std::mem::size_of::<FileHeader>() == 120);
const _: () = assert!(std::mem::align_of::<FileHeader>() == 8);
const _: () = assert!(std::mem::size_of::<FileHeader>() <= HEADER_BYTES);
const _: () = assert!(PEER_WORDS == 120);

/// Everything that can go wrong with a node-state file.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
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
    /// The file does not start with Juneau's magic number.
    #[error("{path} is not a Juneau node-state file (bad magic)")]
    NotAStateFile {
        /// The file.
        path: PathBuf,
    },
    /// The file was written by a Juneau with another layout: upgrade readers and writer
    /// together.
    #[error("{path} has shared-memory layout version {found}, this binary reads version {expected}; run matching versions of juneau-k8s-sync, juneau-dataplane and juneau-bgp")]
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
    /// The state cannot be represented in this layout at all.
    #[error("node state cannot be published: {0}")]
    Unrepresentable(String),
    /// The writer has not published a table yet.
    #[error("no table has been published yet")]
    NoTable,
    /// A consistent copy could not be taken (the writer republishes faster than this
    /// reader copies); the caller keeps its previous table and tries again later.
    #[error("the writer kept rewriting the table during {0} read attempts")]
    Contended(usize),
    /// The table read back fails its checksum or bounds checks.
    #[error("table of generation {0} is corrupt: {1}")]
    Corrupt(u64, String),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ShmError + 'a {
    move |source| ShmError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn now_unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A mapped node-state file and typed access to its header and slots.
struct Mapping {
    /// Read-write for the writer, read-only for readers (they only load atomics, so the
    /// node group needs no write permission on the file).
    map: MmapRaw,
    capacity: Capacity,
    sections: Sections,
}

impl Mapping {
    fn header(&self) -> &FileHeader {
        // SAFETY: the mapping is at least HEADER_BYTES long (checked in `validate` or
        // created so), page-aligned (so 8-aligned), and FileHeader is repr(C) made of
        // plain integers and atomics for which every bit pattern is valid. Shared
        // mutation of the non-atomic fields never happens after creation.
        unsafe { &*(self.map.as_ptr() as *const FileHeader) }
    }

    fn slot(&self, i: usize) -> &[AtomicU32] {
        let words = self.sections.end;
        let start = HEADER_BYTES + i * words * 4;
        debug_assert!(start + words * 4 <= self.map.len());
        // SAFETY: the range lies inside the mapping (file length validated against the
        // capacity), is 4-aligned (HEADER_BYTES and word counts are multiples of 4), and
        // AtomicU32 has the same layout as u32 with every bit pattern valid. All access
        // by any process to these bytes goes through atomics.
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(start) as *const AtomicU32, words)
        }
    }

    /// Opens for the writer (read-write: it marks an old file superseded).
    fn open(path: &Path) -> Result<Self, ShmError> {
        Self::open_as(path, true)
    }

    /// Opens for a reader (read-only).
    fn open_read(path: &Path) -> Result<Self, ShmError> {
        Self::open_as(path, false)
    }

    fn open_as(path: &Path, write: bool) -> Result<Self, ShmError> {
        // Every shared access is through atomics (see `header` and `slot`), a read-only
        // mapping is only read; the file is never truncated while mapped (growth is by
        // rename), so no SIGBUS.
        let (map, len) =
            crate::mapped::map_whole(path, write).map_err(|(op, e)| io(op, path)(e))?;
        if len < HEADER_BYTES as u64 {
            return Err(ShmError::Truncated {
                path: path.to_path_buf(),
                len,
                needed: HEADER_BYTES as u64,
            });
        }
        // SAFETY: length checked above; see `header` for layout and validity.
        let hdr = unsafe { &*(map.as_ptr() as *const FileHeader) };
        if hdr.magic != MAGIC {
            return Err(ShmError::NotAStateFile {
                path: path.to_path_buf(),
            });
        }
        if hdr.layout_version != LAYOUT_VERSION {
            return Err(ShmError::LayoutVersion {
                path: path.to_path_buf(),
                found: hdr.layout_version,
                expected: LAYOUT_VERSION,
            });
        }
        let capacity = hdr.capacity;
        let sections = capacity.sections();
        let needed = capacity.file_bytes() as u64;
        if len < needed || hdr.slot_words != sections.end as u64 || capacity.peers > MAX_PEERS {
            return Err(ShmError::Truncated {
                path: path.to_path_buf(),
                len,
                needed,
            });
        }
        Ok(Mapping {
            map,
            capacity,
            sections,
        })
    }

    /// Creates a zeroed file of `capacity` at `path` (not yet visible under its final
    /// name) with a valid header.
    fn create(path: &Path, capacity: Capacity, first_generation: u64) -> Result<Self, ShmError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        // The file carries the peers' TCP-MD5 passwords: FILE_MODE, also when a temp file
        // of that name was left behind with other bits (mode applies only on creation,
        // hence the explicit set) or by another user (an earlier version's, root's: it
        // is removed first, since only a file's owner may change its mode).
        let _ = std::fs::remove_file(path);
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(FILE_MODE)
            .open(path)
            .map_err(io("creating", path))?;
        file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
            .map_err(io("restricting the mode of", path))?;
        file.set_len(capacity.file_bytes() as u64)
            .map_err(io("sizing", path))?;
        // As in `open_as`; the file is new and private to this writer until renamed.
        let map = MmapRaw::map_raw(&file).map_err(io("mapping", path))?;
        let sections = capacity.sections();
        let hdr = FileHeader {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            header_bytes: HEADER_BYTES as u32,
            capacity,
            _pad0: 0,
            slot_words: sections.end as u64,
            // The slot that will be written first is `first_generation % 2`; start from
            // the generation before it so readers that remap see a newer number.
            generation: AtomicU64::new(first_generation.saturating_sub(1)),
            change_futex: AtomicU32::new(0),
            superseded: AtomicU32::new(0),
            heartbeat_unix_ns: AtomicU64::new(now_unix_ns()),
            writer_pid: AtomicU32::new(std::process::id()),
            _pad1: 0,
            slot_seq: [AtomicU64::new(0), AtomicU64::new(0)],
        };
        // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned; no other
        // process has this file mapped yet (it is not under its final name).
        unsafe { std::ptr::write(map.as_mut_ptr() as *mut FileHeader, hdr) };
        Ok(Mapping {
            map,
            capacity,
            sections,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Encoding a NodeState into slot words.

fn put_name(words: &mut [u32], name: &str, what: &str) -> Result<(), ShmError> {
    let bytes = name.as_bytes();
    if bytes.len() > NAME_BYTES - 1 {
        return Err(ShmError::Unrepresentable(format!(
            "{what} name {name:?} is longer than {} bytes",
            NAME_BYTES - 1
        )));
    }
    put_bytes(words, bytes);
    Ok(())
}

fn put_bytes(words: &mut [u32], bytes: &[u8]) {
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        words[i] = u32::from_le_bytes(w);
    }
}

fn get_bytes(words: &[u32], len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(len);
    out
}

fn get_name(words: &[u32]) -> Result<String, String> {
    let bytes = get_bytes(words, NAME_BYTES);
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8(bytes[..end].to_vec()).map_err(|_| "name is not UTF-8".to_string())
}

fn ip_word(ip: Ipv4Addr) -> u32 {
    u32::from(ip)
}

/// An IPv6 address as four slot words (layout 9): each the big-endian value of 4 of its
/// bytes, first bytes first.
pub(crate) fn ipv6_words(ip: Ipv6Addr) -> [u32; 4] {
    let b = u128::from(ip);
    [
        (b >> 96) as u32,
        (b >> 64) as u32,
        (b >> 32) as u32,
        b as u32,
    ]
}

/// The IPv6 address of four slot words ([`ipv6_words`]).
pub(crate) fn ipv6_from_words(w: &[u32]) -> Ipv6Addr {
    Ipv6Addr::from(w[..4].iter().fold(0u128, |a, x| (a << 32) | u128::from(*x)))
}

/// Why `ip` cannot be a VIP or a peer address in the file, if it cannot: an IPv6 address
/// that is unspecified, multicast or IPv4-mapped (it would read back as another family).
fn bad_ipv6(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(_) => None,
        IpAddr::V6(a) if a.is_unspecified() => Some("the unspecified address"),
        IpAddr::V6(a) if a.is_multicast() => Some("a multicast address"),
        IpAddr::V6(a) if a.to_ipv4_mapped().is_some() => {
            Some("IPv4-mapped (write the IPv4 address)")
        }
        IpAddr::V6(_) => None,
    }
}

/// Counts what a state needs, validating what cannot grow.
fn requirements(state: &NodeState, maglev_size: u32) -> Result<Capacity, ShmError> {
    let backends: usize = state
        .services
        .iter()
        .map(|s| s.backends.len() + s.terminating.len())
        .sum();
    for s in &state.services {
        if s.backends.len() >= maglev_size as usize {
            return Err(ShmError::Unrepresentable(format!(
                "{} has {} local backends; at most {} fit a Maglev table of {maglev_size}",
                s.frontend,
                s.backends.len(),
                maglev_size - 1
            )));
        }
    }
    if state.peers.len() > MAX_PEERS as usize {
        return Err(ShmError::Unrepresentable(format!(
            "{} BGP peers; at most {MAX_PEERS} per node",
            state.peers.len()
        )));
    }
    let r = &state.redirects;
    let lists = r.vips.iter().map(|v| (IpAddr::V4(v.vip), &v.nodes));
    let lists6 = r.vips6.iter().map(|v| (IpAddr::V6(v.vip), &v.nodes));
    for (vip, nodes) in lists.chain(lists6) {
        if nodes.len() > MAX_REDIRECT_NODES_PER_VIP {
            return Err(ShmError::Unrepresentable(format!(
                "VIP {vip} has {} redirect peer nodes; at most {MAX_REDIRECT_NODES_PER_VIP}",
                nodes.len()
            )));
        }
        if nodes.iter().any(|n| n.is_unspecified()) {
            return Err(ShmError::Unrepresentable(format!(
                "VIP {vip} lists redirect peer node 0.0.0.0"
            )));
        }
    }
    if let Some(why) = r.vips6.iter().find_map(|v| bad_ipv6(IpAddr::V6(v.vip))) {
        return Err(ShmError::Unrepresentable(format!(
            "an IPv6 redirect VIP is {why}"
        )));
    }
    if state.redirects.keys.len() > MAX_REDIRECT_KEYS {
        return Err(ShmError::Unrepresentable(format!(
            "{} redirect keys; at most {MAX_REDIRECT_KEYS} (current and next)",
            state.redirects.keys.len()
        )));
    }
    if state.redirects.node_address == Some(Ipv4Addr::UNSPECIFIED) {
        return Err(ShmError::Unrepresentable(
            "this node's redirect address is 0.0.0.0".into(),
        ));
    }
    for s in &state.services {
        if let Some(r) = s
            .source_ranges
            .iter()
            .find(|r| r.prefix_len > 32 || SourceRange::new(r.network, r.prefix_len) != Some(**r))
        {
            return Err(ShmError::Unrepresentable(format!(
                "{}: source range {}/{} is not a network and prefix length",
                s.frontend, r.network, r.prefix_len
            )));
        }
    }
    if let Some(s) = state
        .services
        .iter()
        .find(|s| s.client_ip_affinity == Some(0))
    {
        return Err(ShmError::Unrepresentable(format!(
            "{}: a ClientIP affinity of 0 seconds",
            s.frontend
        )));
    }
    requirements6(state, maglev_size)?;
    let redirect_nodes = redirect_node_count(state);
    let source_ranges: usize = state.services.iter().map(|s| s.source_ranges.len()).sum();
    let (backends6, source_ranges6) = counts6(state);
    let c = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Ok(Capacity {
        services: c(state.services.len()),
        backends: c(backends),
        vips: c(state.advertised.len()),
        peers: c(state.peers.len()),
        maglev_size,
        redirect_vips: c(state.redirects.vips.len().max(state.redirects.vips6.len())),
        redirect_nodes: c(redirect_nodes),
        source_ranges: c(source_ranges),
        services6: c(state.services6.len()),
        backends6: c(backends6),
        source_ranges6: c(source_ranges6),
    })
}

/// Redirect node addresses of both families' VIPs (one section holds them all).
fn redirect_node_count(state: &NodeState) -> usize {
    let r = &state.redirects;
    let v4: usize = r.vips.iter().map(|v| v.nodes.len()).sum();
    v4 + r.vips6.iter().map(|v| v.nodes.len()).sum::<usize>()
}

/// IPv6 backends (Ready and terminating) and source ranges over all IPv6 services.
fn counts6(state: &NodeState) -> (usize, usize) {
    state.services6.iter().fold((0, 0), |(b, r), s| {
        (
            b + s.backends.len() + s.terminating.len(),
            r + s.source_ranges.len(),
        )
    })
}

/// What [`requirements`] refuses of the IPv6 services (layout 10): too many backends for
/// a Maglev table, an address that would read back as something else, a source range
/// with host bits, an affinity of 0 seconds.
fn requirements6(state: &NodeState, maglev_size: u32) -> Result<(), ShmError> {
    let refuse = |f: &Frontend6, why: String| Err(ShmError::Unrepresentable(format!("{f}: {why}")));
    for s in &state.services6 {
        let f = &s.frontend;
        if s.backends.len() >= maglev_size as usize {
            return refuse(
                f,
                format!(
                    "{} local backends; at most {} fit a Maglev table of {maglev_size}",
                    s.backends.len(),
                    maglev_size - 1
                ),
            );
        }
        if let Some(why) = bad_ipv6(IpAddr::V6(f.vip)) {
            return refuse(f, format!("the VIP is {why}"));
        }
        let all = s.backends.iter().chain(&s.terminating);
        if let Some((b, why)) = all
            .filter_map(|b| bad_ipv6(IpAddr::V6(b.ip)).map(|why| (b, why)))
            .next()
        {
            return refuse(f, format!("backend {b} is {why}"));
        }
        if let Some(r) = s.source_ranges.iter().find(|r| r.trunc() != **r) {
            return refuse(
                f,
                format!("source range {r} is not a network and prefix length"),
            );
        }
        if s.client_ip_affinity == Some(0) {
            return refuse(f, "a ClientIP affinity of 0 seconds".into());
        }
    }
    Ok(())
}

/// Checks everything [`encode`] would refuse, before it changes anything: an encode that
/// fails half-way would leave the writer's [`Image`] describing a slot no one wrote.
fn validate(state: &NodeState, tables: &Tables, mw: usize) -> Result<(), ShmError> {
    let name_ok = |name: &str, what: &str| {
        if name.len() > NAME_BYTES - 1 {
            return Err(ShmError::Unrepresentable(format!(
                "{what} name {name:?} is longer than {} bytes",
                NAME_BYTES - 1
            )));
        }
        Ok(())
    };
    name_ok(&state.node, "node")?;
    let services = &state.services;
    let services6 = &state.services6;
    tables_fit(
        &tables.v4,
        services.len(),
        |i| services[i].frontend.to_string(),
        mw,
    )?;
    tables_fit(
        &tables.v6,
        services6.len(),
        |i| services6[i].frontend.to_string(),
        mw,
    )?;
    for a in &state.advertised {
        if let Some(why) = bad_ipv6(a.vip) {
            return Err(ShmError::Unrepresentable(format!(
                "advertised VIP {} is {why}",
                a.vip
            )));
        }
        if a.communities.len() > MAX_COMMUNITIES
            || a.large_communities.len() > MAX_LARGE_COMMUNITIES
        {
            return Err(ShmError::Unrepresentable(format!(
                "VIP {} carries {} communities and {} large communities; at most {MAX_COMMUNITIES} and {MAX_LARGE_COMMUNITIES}",
                a.vip,
                a.communities.len(),
                a.large_communities.len()
            )));
        }
        if let Some(p) = a
            .peers
            .iter()
            .find(|p| usize::from(**p) >= state.peers.len())
        {
            return Err(ShmError::Unrepresentable(format!(
                "VIP {} names peer #{p}, but the node has {} peers",
                a.vip,
                state.peers.len()
            )));
        }
    }
    for p in &state.peers {
        name_ok(&p.name, "peer")?;
        if let Some(why) = bad_ipv6(p.peer_address) {
            return Err(ShmError::Unrepresentable(format!(
                "peer {}: address {} is {why}",
                p.name, p.peer_address
            )));
        }
        if matches!(p.peer_address, IpAddr::V6(a) if a.is_unicast_link_local()) {
            return Err(ShmError::Unrepresentable(format!(
                "peer {}: link-local address {} needs an interface, which the file does not carry; use a global address",
                p.name, p.peer_address
            )));
        }
        if let Some(src) = p.source_address {
            if src.is_ipv6() != p.peer_address.is_ipv6() || bad_ipv6(src).is_some() {
                return Err(ShmError::Unrepresentable(format!(
                    "peer {}: source address {src} is not a usable address of the family of its peer address {}",
                    p.name, p.peer_address
                )));
            }
        }
        let md5 = p.md5_password.as_ref().map_or(0, |s| s.len());
        if md5 > MD5_BYTES {
            return Err(ShmError::Unrepresentable(format!(
                "the TCP-MD5 password of peer {} is {md5} bytes; the kernel takes at most {MD5_BYTES}",
                p.name,
            )));
        }
        let bfd_key = p.bfd_auth.as_ref().map_or(0, |a| a.key.len());
        if bfd_key > BFD_KEY_MAX_BYTES {
            return Err(ShmError::Unrepresentable(format!(
                "the BFD key of peer {} is {bfd_key} bytes; keyed SHA1 takes at most {BFD_KEY_MAX_BYTES}",
                p.name,
            )));
        }
    }
    Ok(())
}

/// Whether there is one Maglev table of `mw` words for each of `n` frontends (named by
/// `frontend(i)`).
fn tables_fit(
    tables: &[Arc<[u32]>],
    n: usize,
    frontend: impl Fn(usize) -> String,
    mw: usize,
) -> Result<(), ShmError> {
    if tables.len() != n {
        return Err(ShmError::Unrepresentable(format!(
            "{} Maglev tables for {n} services",
            tables.len(),
        )));
    }
    if let Some(i) = tables.iter().position(|t| t.len() != mw) {
        return Err(ShmError::Unrepresentable(format!(
            "{}: Maglev table of {} words, the file's tables have {mw}",
            frontend(i),
            tables[i].len()
        )));
    }
    Ok(())
}

/// The packed Maglev tables of a publish: `v4[i]` of `state.services[i]`, `v6[i]` of
/// `state.services6[i]`.
struct Tables {
    v4: Vec<Arc<[u32]>>,
    v6: Vec<Arc<[u32]>>,
}

/// The checksum contribution (layout 5) of word `w` at index `p` of a slot: 0 for a zero
/// word, else a 64-bit mix (SplitMix64's finaliser) of the index and the word. A slot's
/// checksum is [`CHECKSUM_SEED`] plus the wrapping sum of its used words' contributions
/// (the checksum words 6 and 7 left out): any one word's change moves it, a word moved
/// to another index moves it, and the writer updates it per changed word instead of
/// hashing the whole slot again (the byte-serial FNV-1a of layouts 1-4 was 100 ms of a
/// 130 ms publish at 10 000 Services). Zero words counting nothing makes the writer's
/// sum over its whole image (zero past the counts) equal the readers' sum over the used
/// ranges.
#[inline]
fn word_sum(p: usize, w: u32) -> u64 {
    if w == 0 {
        return 0;
    }
    let mut z = ((p as u64) << 32) | u64::from(w);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The checksum of an all-zero slot (layout 5).
const CHECKSUM_SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// Slot words holding the checksum itself.
const CHECKSUM_WORDS: std::ops::Range<usize> = 6..8;

/// The writer's copy of the slot image it last encoded, kept between publishes: the next
/// publish changes, re-checksums and writes only the words that differ.
/// Invariants: `words` is zero past the ranges its counts use (so `sum` over all of it is
/// the readers' sum over the used ranges); `sum` is the sum of [`word_sum`] over `words`
/// but the checksum words; `tables[i]` (`tables6[i]`) is the table `words` holds for
/// service (IPv6 service) `i`.
struct Image {
    words: Vec<u32>,
    sum: u64,
    /// The part of `sum` from the Maglev sections (`table_sections`).
    tables_sum: u64,
    /// Both Maglev sections, whole capacity: `[start, end)`.
    table_sections: [(usize, usize); 2],
    tables: Vec<Arc<[u32]>>,
    tables6: Vec<Arc<[u32]>>,
    /// Word ranges `[start, end)` this publish changed, and those the one before changed.
    dirty: Vec<(usize, usize)>,
    prev_dirty: Vec<(usize, usize)>,
}

impl Image {
    /// An all-zero image of a slot of `cap`. A new buffer comes zeroed from the allocator
    /// (untouched pages cost nothing until encoded into).
    fn new(cap: &Capacity) -> Self {
        let sec = cap.sections();
        Image {
            words: vec![0; sec.end],
            sum: 0,
            tables_sum: 0,
            table_sections: table_sections(&sec, cap),
            tables: Vec::new(),
            tables6: Vec::new(),
            dirty: Vec::new(),
            prev_dirty: Vec::new(),
        }
    }

    /// Stores `new` at `start`, keeping the sum and the dirty ranges.
    fn set(&mut self, start: usize, new: &[u32]) {
        let Image {
            words,
            sum,
            tables_sum,
            table_sections,
            ..
        } = self;
        // A store never straddles a section: the whole store is in a table or not.
        let in_tables = table_sections.iter().any(|&(s, e)| (s..e).contains(&start));
        let mut changed: Option<(usize, usize)> = None;
        for (i, (o, n)) in words[start..start + new.len()]
            .iter_mut()
            .zip(new)
            .enumerate()
        {
            if *o != *n {
                let p = start + i;
                if !CHECKSUM_WORDS.contains(&p) {
                    let delta = word_sum(p, *n).wrapping_sub(word_sum(p, *o));
                    *sum = sum.wrapping_add(delta);
                    if in_tables {
                        *tables_sum = tables_sum.wrapping_add(delta);
                    }
                }
                *o = *n;
                changed = Some((changed.map_or(p, |c| c.0), p + 1));
            }
        }
        if let Some((s, e)) = changed {
            self.mark(s, e);
        }
    }

    /// Zeroes `[start, end)`.
    fn clear(&mut self, start: usize, end: usize) {
        const ZEROS: [u32; 1024] = [0; 1024];
        let mut at = start;
        while at < end {
            let n = (end - at).min(ZEROS.len());
            self.set(at, &ZEROS[..n]);
            at += n;
        }
    }

    fn mark(&mut self, start: usize, end: usize) {
        // Close ranges are merged: a few words written twice cost less than a long list.
        if let Some(last) = self.dirty.last_mut() {
            if start >= last.0 && start <= last.1 + 16 {
                last.1 = last.1.max(end);
                return;
            }
        }
        self.dirty.push((start, end));
    }
}

/// Encodes `state` (normalized, [`validate`]d) into `img` as generation `generation`,
/// `tables[i]` being the packed Maglev table of `state.services[i]`
/// ([`MaglevCache::tables_for`]): only words that differ from the last encode change; a
/// service whose table is the very one `img` holds at its index is skipped. Records are
/// written whole (their unused words 0) and what the last encode used past the new
/// counts is zeroed. Then the checksum is sealed into words 6, 7.
fn encode(
    img: &mut Image,
    state: &NodeState,
    cap: &Capacity,
    generation: u64,
    tables: &Tables,
) -> Result<(), ShmError> {
    let sec = cap.sections();
    img.prev_dirty = std::mem::take(&mut img.dirty);
    let old = used_ranges(&img.words, &sec, cap)
        .ok_or_else(|| ShmError::Unrepresentable("image counts exceed the capacity".into()))?;

    // [6], [7]: checksum, kept as is here and sealed later.
    let hdr = slot_header(state, generation, [img.words[6], img.words[7]])?;
    let new = used_ranges(&hdr, &sec, cap).ok_or_else(|| {
        ShmError::Unrepresentable("counts exceed the capacity (writer bug)".into())
    })?;
    img.set(0, &hdr);
    // What the last encode used past the new counts goes back to zero.
    for ((start, old_len), (_, new_len)) in old.iter().zip(&new).skip(1) {
        if old_len > new_len {
            img.clear(start + new_len, start + old_len);
        }
    }

    encode_services(img, state, &sec, cap.maglev_words(), &tables.v4);
    encode_services6(img, state, &sec, cap.maglev_words(), &tables.v6);

    for (i, a) in state.advertised.iter().enumerate() {
        img.set(sec.vips + i * VIP_WORDS, &vip_record(a));
    }

    for (i, p) in state.peers.iter().enumerate() {
        let rec = peer_record(p)?;
        img.set(sec.peers + i * PEER_WORDS, &rec);
    }

    let mut next_node = 0usize;
    for (i, v) in state.redirects.vips.iter().enumerate() {
        let rec = [ip_word(v.vip), next_node as u32, v.nodes.len() as u32];
        img.set(sec.redirect_vips + i * REDIRECT_VIP_WORDS, &rec);
        for n in &v.nodes {
            img.set(sec.redirect_nodes + next_node, &[ip_word(*n)]);
            next_node += 1;
        }
    }

    for (i, v) in state.redirects.vips6.iter().enumerate() {
        let mut rec = [0u32; REDIRECT_VIP6_WORDS];
        rec[..4].copy_from_slice(&ipv6_words(v.vip));
        rec[4] = next_node as u32;
        rec[5] = v.nodes.len() as u32;
        img.set(sec.redirect_vips6 + i * REDIRECT_VIP6_WORDS, &rec);
        for n in &v.nodes {
            img.set(sec.redirect_nodes + next_node, &[ip_word(*n)]);
            next_node += 1;
        }
    }

    for (i, k) in state.redirects.keys.iter().enumerate() {
        let mut rec = [0u32; REDIRECT_KEY_WORDS];
        rec[0] = u32::from(k.id);
        put_bytes(&mut rec[1..], k.key.expose());
        img.set(sec.redirect_keys + i * REDIRECT_KEY_WORDS, &rec);
    }
    Ok(())
}

/// The slot header of `state` as generation `generation`, its checksum words 6, 7 being
/// `checksum` (sealed later).
fn slot_header(
    state: &NodeState,
    generation: u64,
    checksum: [u32; 2],
) -> Result<[u32; SLOT_HEADER_WORDS], ShmError> {
    let mut hdr = [0u32; SLOT_HEADER_WORDS];
    hdr[0] = generation as u32;
    hdr[1] = (generation >> 32) as u32;
    hdr[2] = state.services.len() as u32;
    let n_backends: usize = state
        .services
        .iter()
        .map(|s| s.backends.len() + s.terminating.len())
        .sum();
    hdr[3] = n_backends as u32;
    hdr[4] = state.advertised.len() as u32;
    hdr[5] = state.peers.len() as u32;
    hdr[6] = checksum[0];
    hdr[7] = checksum[1];
    hdr[8] = state.router_id.map(ip_word).unwrap_or(0);
    hdr[9] = u32::from(state.router_id.is_some());
    hdr[10] = state.redirects.node_address.map(ip_word).unwrap_or(0);
    hdr[11] = u32::from(state.redirects.node_address.is_some());
    hdr[12] = state.redirects.vips.len() as u32;
    hdr[13] = redirect_node_count(state) as u32;
    hdr[14] = state.redirects.keys.len() as u32;
    hdr[15] = state
        .services
        .iter()
        .map(|s| s.source_ranges.len() as u32)
        .sum();
    let (backends6, source_ranges6) = counts6(state);
    hdr[16] = state.services6.len() as u32;
    hdr[17] = backends6 as u32;
    hdr[18] = source_ranges6 as u32;
    hdr[19] = state.redirects.vips6.len() as u32;
    put_name(
        &mut hdr[SLOT_HEADER_WORDS - NAME_BYTES / 4..],
        &state.node,
        "node",
    )?;
    Ok(hdr)
}

/// Writes every Frontend of `state` into `img` (sections `sec`, `mw` words per Maglev
/// table) with its Backends (ready, then terminating) and its Maglev table `tables[i]`,
/// unless `img` already holds that very table at its index.
fn encode_services(
    img: &mut Image,
    state: &NodeState,
    sec: &Sections,
    mw: usize,
    tables: &[Arc<[u32]>],
) {
    let mut next_backend = 0usize;
    let mut next_range = 0usize;
    img.tables.truncate(state.services.len());
    for (i, s) in state.services.iter().enumerate() {
        let rec = [
            ip_word(s.frontend.vip),
            u32::from(s.frontend.protocol.number())
                | if s.hand_off { SERVICE_HAND_OFF } else { 0 }
                | if s.host_network {
                    SERVICE_HOST_NETWORK
                } else {
                    0
                }
                | (u32::from(s.frontend.port) << 16),
            next_backend as u32,
            s.backends.len() as u32,
            s.terminating.len() as u32,
            next_range as u32,
            s.source_ranges.len() as u32,
            s.client_ip_affinity.unwrap_or(0),
        ];
        img.set(sec.services + i * SERVICE_WORDS, &rec);
        for r in &s.source_ranges {
            img.set(
                sec.source_ranges + next_range * SOURCE_RANGE_WORDS,
                &[ip_word(r.network), u32::from(r.prefix_len)],
            );
            next_range += 1;
        }
        let ready = s.backends.iter().map(|b| (b, 0));
        let draining = s.terminating.iter().map(|b| (b, BACKEND_TERMINATING));
        for (b, flags) in ready.chain(draining) {
            img.set(
                sec.backends + next_backend * BACKEND_WORDS,
                &[ip_word(b.ip), u32::from(b.port) | flags],
            );
            next_backend += 1;
        }
        set_table(img, false, i, sec.maglev + i * mw, &tables[i]);
    }
}

/// Stores Maglev table `table` of service `i` (IPv6 if `v6`) at word `at`, unless the
/// image holds that very table there already.
fn set_table(img: &mut Image, v6: bool, i: usize, at: usize, table: &Arc<[u32]>) {
    let held = if v6 { &img.tables6 } else { &img.tables };
    if matches!(held.get(i), Some(t) if Arc::ptr_eq(t, table)) {
        return;
    }
    img.set(at, table);
    let held = if v6 {
        &mut img.tables6
    } else {
        &mut img.tables
    };
    if i < held.len() {
        held[i] = Arc::clone(table);
    } else {
        held.push(Arc::clone(table));
    }
}

/// Writes every IPv6 frontend of `state` into `img` (layout 10) as [`encode_services`]
/// does the IPv4 ones.
fn encode_services6(
    img: &mut Image,
    state: &NodeState,
    sec: &Sections,
    mw: usize,
    tables: &[Arc<[u32]>],
) {
    let mut next_backend = 0usize;
    let mut next_range = 0usize;
    img.tables6.truncate(state.services6.len());
    for (i, s) in state.services6.iter().enumerate() {
        let mut rec = [0u32; SERVICE6_WORDS];
        rec[..4].copy_from_slice(&ipv6_words(s.frontend.vip));
        let flags = if s.hand_off { SERVICE_HAND_OFF } else { 0 };
        rec[4] =
            u32::from(s.frontend.protocol.number()) | flags | (u32::from(s.frontend.port) << 16);
        rec[5] = next_backend as u32;
        rec[6] = s.backends.len() as u32;
        rec[7] = s.terminating.len() as u32;
        rec[8] = next_range as u32;
        rec[9] = s.source_ranges.len() as u32;
        rec[10] = s.client_ip_affinity.unwrap_or(0);
        img.set(sec.services6 + i * SERVICE6_WORDS, &rec);
        for r in &s.source_ranges {
            let mut rr = [0u32; SOURCE_RANGE6_WORDS];
            rr[..4].copy_from_slice(&ipv6_words(r.network()));
            rr[4] = u32::from(r.prefix_len());
            img.set(sec.source_ranges6 + next_range * SOURCE_RANGE6_WORDS, &rr);
            next_range += 1;
        }
        let ready = s.backends.iter().map(|b| (b, 0));
        let draining = s.terminating.iter().map(|b| (b, BACKEND_TERMINATING));
        for (b, flags) in ready.chain(draining) {
            let mut br = [0u32; BACKEND6_WORDS];
            br[..4].copy_from_slice(&ipv6_words(b.ip));
            br[4] = u32::from(b.port) | flags;
            img.set(sec.backends6 + next_backend * BACKEND6_WORDS, &br);
            next_backend += 1;
        }
        set_table(img, true, i, sec.maglev6 + i * mw, &tables[i]);
    }
}

/// The record of one advertised VIP.
fn vip_record(a: &AdvertisedVip) -> [u32; VIP_WORDS] {
    let mut mask = 0u64;
    for &p in &a.peers {
        mask |= 1 << p;
    }
    let mut rec = [0u32; VIP_WORDS];
    match a.vip {
        IpAddr::V4(v4) => rec[0] = ip_word(v4),
        IpAddr::V6(v6) => {
            rec[7] = VIP_IPV6;
            rec[32..36].copy_from_slice(&ipv6_words(v6));
        }
    }
    rec[1] = a.local_pref.unwrap_or(0);
    rec[2] = u32::from(a.local_pref.is_some());
    rec[3] = mask as u32;
    rec[4] = (mask >> 32) as u32;
    rec[5] = a.communities.len() as u32;
    rec[6] = a.large_communities.len() as u32;
    rec[8..8 + a.communities.len()].copy_from_slice(&a.communities);
    for (j, l) in a.large_communities.iter().enumerate() {
        rec[16 + 3 * j..19 + 3 * j].copy_from_slice(l);
    }
    rec[28] = a.weight.unwrap_or(0);
    rec[29] = u32::from(a.weight.is_some());
    rec
}

/// The record of one BGP peer (its name, session settings, MD5 password, BFD, drain and
/// BFD authentication), or why its name does not fit.
fn peer_record(p: &PeerConfig) -> Result<[u32; PEER_WORDS], ShmError> {
    let mut rec = [0u32; PEER_WORDS];
    put_name(&mut rec[..NAME_BYTES / 4], &p.name, "peer")?;
    let f = &mut rec[NAME_BYTES / 4..];
    let mut v6 = [[0u32; 4]; 2];
    match p.peer_address {
        IpAddr::V4(a) => f[0] = ip_word(a),
        IpAddr::V6(a) => {
            f[11] |= PEER_IPV6;
            v6[0] = ipv6_words(a);
        }
    }
    f[1] = p.peer_asn;
    f[2] = p.local_asn;
    f[3] = u32::from(p.peer_port) | (u32::from(p.passive) << 16);
    match p.source_address {
        None => {}
        Some(IpAddr::V4(a)) => f[4] = ip_word(a),
        Some(IpAddr::V6(a)) => {
            f[11] |= PEER_SOURCE_IPV6;
            v6[1] = ipv6_words(a);
        }
    }
    f[5] = u32::from(p.source_address.is_some());
    f[6] = u32::from(p.hold_time) | (u32::from(p.keepalive_time) << 16);
    f[7] = u32::from(p.connect_retry_time)
        | (u32::from(p.ebgp_multihop.unwrap_or(0)) << 16)
        | (u32::from(p.ebgp_multihop.is_some()) << 24);
    f[8] = u32::from(p.graceful_restart_time.unwrap_or(0))
        | (u32::from(p.graceful_restart_time.is_some()) << 16);
    let md5 = p
        .md5_password
        .as_ref()
        .map_or(&b""[..], |s| s.expose().as_bytes());
    f[9] = md5.len() as u32;
    f[10] = u32::from(p.md5_password.is_some());
    put_bytes(&mut f[12..12 + MD5_BYTES / 4], md5);
    let x = &mut f[12 + MD5_BYTES / 4..];
    if let Some(b) = &p.bfd {
        x[0] = b.min_rx_ms;
        x[1] = b.min_tx_ms;
        x[2] = u32::from(b.multiplier) | (1 << 8);
    }
    if let Some(d) = &p.drain {
        x[3] = u32::from(d.as_path_prepend) | (1 << 8);
        x[4] = d.local_pref;
        x[5] = u32::from(d.wait_seconds);
    }
    if let Some(a) = &p.bfd_auth {
        let kind = match a.auth_type {
            BfdAuthType::KeyedSha1 => 1,
            BfdAuthType::MeticulousKeyedSha1 => 2,
        };
        let key = a.key.expose().as_bytes();
        x[6] = kind | (u32::from(a.key_id) << 8) | ((key.len() as u32) << 16);
        put_bytes(&mut x[8..8 + BFD_KEY_MAX_BYTES / 4], key);
    }
    x[16..20].copy_from_slice(&v6[0]);
    x[20..24].copy_from_slice(&v6[1]);
    Ok(rec)
}

/// Stores the Maglev tables' part of the checksum into words 20, 21, then the checksum
/// into words 6, 7.
fn seal(img: &mut Image, cap: &Capacity) {
    let t = img.tables_sum;
    img.set(TABLES_SUM_WORDS.start, &[t as u32, (t >> 32) as u32]);
    let sum = CHECKSUM_SEED.wrapping_add(img.sum);
    img.set(CHECKSUM_WORDS.start, &[sum as u32, (sum >> 32) as u32]);
    debug_assert_eq!(
        (sum, t),
        checksums(&img.words, &cap.sections(), cap, true),
        "the image's running checksum drifted"
    );
}

/// Both Maglev sections, whole capacity: `[start, end)` (layout 12: their part of the
/// checksum is kept apart).
fn table_sections(sec: &Sections, cap: &Capacity) -> [(usize, usize); 2] {
    let mw = cap.maglev_words();
    [
        (sec.maglev, sec.maglev + cap.services as usize * mw),
        (sec.maglev6, sec.maglev6 + cap.services6 as usize * mw),
    ]
}

/// The ranges of a slot that hold data for its counts (the Maglev sections at
/// [`TABLE_RANGES`]).
fn used_ranges(hdr: &[u32], sec: &Sections, cap: &Capacity) -> Option<[(usize, usize); 15]> {
    let (ns, nb, nv, np) = (
        hdr[2] as usize,
        hdr[3] as usize,
        hdr[4] as usize,
        hdr[5] as usize,
    );
    let (nrv, nrn, nk) = (hdr[12] as usize, hdr[13] as usize, hdr[14] as usize);
    let nsr = hdr[15] as usize;
    let (ns6, nb6, nsr6) = (hdr[16] as usize, hdr[17] as usize, hdr[18] as usize);
    let nrv6 = hdr[19] as usize;
    if ns6 > cap.services6 as usize
        || nrv6 > cap.redirect_vips as usize
        || nb6 > cap.backends6 as usize
        || nsr6 > cap.source_ranges6 as usize
        || nk > MAX_REDIRECT_KEYS
        || nsr > cap.source_ranges as usize
        || ns > cap.services as usize
        || nb > cap.backends as usize
        || nv > cap.vips as usize
        || np > cap.peers as usize
        || nrv > cap.redirect_vips as usize
        || nrn > cap.redirect_nodes as usize
    {
        return None;
    }
    Some([
        (0, SLOT_HEADER_WORDS),
        (sec.services, ns * SERVICE_WORDS),
        (sec.backends, nb * BACKEND_WORDS),
        (sec.maglev, ns * cap.maglev_words()),
        (sec.vips, nv * VIP_WORDS),
        (sec.peers, np * PEER_WORDS),
        (sec.redirect_vips, nrv * REDIRECT_VIP_WORDS),
        (sec.redirect_nodes, nrn),
        (sec.redirect_keys, nk * REDIRECT_KEY_WORDS),
        (sec.source_ranges, nsr * SOURCE_RANGE_WORDS),
        (sec.services6, ns6 * SERVICE6_WORDS),
        (sec.backends6, nb6 * BACKEND6_WORDS),
        (sec.maglev6, ns6 * cap.maglev_words()),
        (sec.source_ranges6, nsr6 * SOURCE_RANGE6_WORDS),
        (sec.redirect_vips6, nrv6 * REDIRECT_VIP6_WORDS),
    ])
}

/// The slot checksum of `words` and the Maglev tables' part of it (layout 12). With
/// `tables` false the tables are not read (they may not have been copied): their part is
/// taken from words 20, 21, as the writer stored it.
fn checksums(words: &[u32], sec: &Sections, cap: &Capacity, tables: bool) -> (u64, u64) {
    let Some(ranges) = used_ranges(words, sec, cap) else {
        return (0, 0);
    };
    let sum_of = |start: usize, len: usize| {
        words[start..start + len]
            .iter()
            .enumerate()
            .fold(0u64, |h, (i, w)| h.wrapping_add(word_sum(start + i, *w)))
    };
    let (mut rest, mut in_tables) = (0u64, 0u64);
    for (i, (start, len)) in ranges.into_iter().enumerate() {
        if TABLE_RANGES.contains(&i) {
            if tables {
                in_tables = in_tables.wrapping_add(sum_of(start, len));
            }
        } else {
            rest = rest.wrapping_add(sum_of(start, len));
        }
    }
    if !tables {
        in_tables = stored_tables_sum(words);
    }
    // The header range (always first, SLOT_HEADER_WORDS long) holds the checksum words,
    // which count as nothing.
    let total = CHECKSUM_WORDS.fold(
        CHECKSUM_SEED.wrapping_add(rest).wrapping_add(in_tables),
        |h, p| h.wrapping_sub(word_sum(p, words[p])),
    );
    (total, in_tables)
}

/// The indices of the Maglev sections in [`used_ranges`]' answer.
const TABLE_RANGES: [usize; 2] = [3, 12];

/// The Maglev tables' part of the checksum as the writer stored it (words 20, 21).
fn stored_tables_sum(words: &[u32]) -> u64 {
    u64::from(words[TABLES_SUM_WORDS.start]) | (u64::from(words[TABLES_SUM_WORDS.start + 1]) << 32)
}

// ---------------------------------------------------------------------------------------
// The writer.

/// The steps of a publish, in order, as [`NodeStateWriter::publish_traced`] reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PublishPhase {
    /// The state copied and normalized.
    Normalize,
    /// What the state needs counted and validated.
    Requirements,
    /// The Maglev tables found or built.
    Maglev,
    /// The slot image encoded.
    Encode,
    /// Its checksum computed.
    Checksum,
    /// The image written into the slot and the new generation announced.
    WriteSlot,
    /// Instead of the last two: a new, larger file written and renamed over the path.
    ReplaceFile,
}

/// The one writer of a node-state file (the node agent).
pub struct NodeStateWriter {
    path: PathBuf,
    capacity: Capacity,
    /// The live file, once the first table is published.
    live: Option<Mapping>,
    /// Generation of the last publish (0: none).
    generation: u64,
    /// Generation found in an earlier file at `path`, continued so numbers only grow.
    inherited_generation: u64,
    /// The image of the last publish, updated in place by the next one (`None` before
    /// the first publish and after a failed one).
    image: Option<Image>,
    /// What each slot of the live file holds.
    slots: [SlotHolds; 2],
    maglev: MaglevCache<LocalBackend>,
    maglev6: MaglevCache<LocalBackend6>,
}

/// What a slot of the live file holds, as far as the writer knows: how much of it
/// the next write must cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotHolds {
    /// Zeros (a new file): only the image's used ranges need writing.
    Zero,
    /// The image of this generation: only what changed since needs writing.
    Image(u64),
    /// Unknown (after a failed publish): the whole image is written.
    Unknown,
}

/// Packs Maglev slots as a slot stores them: two u16 per word, low half first, the odd
/// last one paired with [`maglev::NO_BACKEND`].
fn pack_maglev(table: &MaglevTable) -> Arc<[u32]> {
    table
        .slots()
        .chunks(2)
        .map(|pair| {
            let lo = u32::from(pair[0]);
            let hi = u32::from(*pair.get(1).unwrap_or(&maglev::NO_BACKEND));
            lo | (hi << 16)
        })
        .collect()
}

/// The packed Maglev tables of the last publish, by Ready backend list (normalized:
/// sorted, no duplicates). A table depends only on that list and the table size, so a
/// publish rebuilds only the tables of services whose Ready backends changed (rebuilding
/// all 10 000 was two thirds of a publish). A service whose list is the one
/// the same index had last time is found without hashing; the map serves the others
/// (services that moved). Holds only the tables in use ([`collect`](Self::collect)), so
/// it never grows past the state.
/// One cache per family (`B`: [`LocalBackend`] or [`LocalBackend6`]).
struct MaglevCache<B> {
    size: u32,
    tables: HashMap<Vec<B>, Arc<[u32]>>,
    /// The last publish's lists and tables, by service index.
    last: Vec<(Vec<B>, Arc<[u32]>)>,
    /// Whether the last `tables_for` missed the positional match somewhere.
    moved: bool,
    /// Tables built (not found in the cache) since the writer was created.
    built: u64,
}

impl<B> Default for MaglevCache<B> {
    fn default() -> Self {
        MaglevCache {
            size: 0,
            tables: HashMap::new(),
            last: Vec::new(),
            moved: false,
            built: 0,
        }
    }
}

/// A service as the Maglev cache sees it: its Ready backends and, for errors, its name.
trait MaglevService {
    /// [`LocalBackend`] or [`LocalBackend6`].
    type Backend;
    /// The Ready backends the table is built over.
    fn ready(&self) -> &Vec<Self::Backend>;
    /// The frontend, for messages.
    fn name(&self) -> String;
}

impl MaglevService for NodeService {
    type Backend = LocalBackend;
    fn ready(&self) -> &Vec<LocalBackend> {
        &self.backends
    }
    fn name(&self) -> String {
        self.frontend.to_string()
    }
}

impl MaglevService for NodeService6 {
    type Backend = LocalBackend6;
    fn ready(&self) -> &Vec<LocalBackend6> {
        &self.backends
    }
    fn name(&self) -> String {
        self.frontend.to_string()
    }
}

impl<B: maglev::MaglevBackend + Clone + Eq + std::hash::Hash> MaglevCache<B> {
    /// The tables of `services` in order, from the last publish where the backend list is
    /// the same, built otherwise.
    fn tables_for<S: MaglevService<Backend = B>>(
        &mut self,
        services: &[S],
        size: u32,
    ) -> Result<Vec<Arc<[u32]>>, ShmError> {
        if size != self.size {
            self.tables.clear();
            self.last.clear();
            self.size = size;
        }
        let mut out = Vec::with_capacity(services.len());
        let mut last = Vec::with_capacity(services.len());
        self.moved = services.len() != self.last.len();
        for (i, s) in services.iter().enumerate() {
            let backends = s.ready();
            let table = match self.last.get(i) {
                Some((k, t)) if k == backends => Arc::clone(t),
                _ => {
                    self.moved = true;
                    match self.tables.get(backends) {
                        Some(t) => Arc::clone(t),
                        None => {
                            let t = MaglevTable::new(backends, size).map_err(|e| {
                                ShmError::Unrepresentable(format!("{}: {e}", s.name()))
                            })?;
                            self.built += 1;
                            let t = pack_maglev(&t);
                            self.tables.insert(backends.clone(), Arc::clone(&t));
                            t
                        }
                    }
                }
            };
            last.push((backends.clone(), Arc::clone(&table)));
            out.push(table);
        }
        self.last = last;
        Ok(out)
    }

    /// Forgets the tables no longer in use: held only by the map, once the caller dropped
    /// the list `tables_for` returned and the image holds the new tables.
    fn collect(&mut self) {
        if std::mem::take(&mut self.moved) {
            self.tables.retain(|_, t| Arc::strong_count(t) > 1);
        }
    }
}

impl NodeStateWriter {
    /// Prepares to publish at `path` (the directory is created if missing). Nothing is
    /// visible to readers until the first [`publish`](Self::publish): readers of a file
    /// left by an earlier writer keep its last table until then.
    pub fn create(path: impl AsRef<Path>, capacity: Capacity) -> Result<Self, ShmError> {
        let path = path.as_ref().to_path_buf();
        if !maglev::is_prime(capacity.maglev_size) || capacity.maglev_size > 65521 {
            return Err(ShmError::Unrepresentable(format!(
                "Maglev table size {} is not a prime up to 65521",
                capacity.maglev_size
            )));
        }
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(DIR_MODE)
                    .create(dir)
                    .map_err(io("creating directory", dir))?;
                // The umask took bits the group needs.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE))
                    .map_err(io("setting the mode of", dir))?;
            }
        }
        let inherited_generation = Mapping::open(&path)
            .map(|m| m.header().generation.load(Ordering::Acquire))
            .unwrap_or(0);
        Ok(NodeStateWriter {
            path,
            capacity: Capacity {
                peers: capacity.peers.min(MAX_PEERS),
                ..capacity
            },
            live: None,
            generation: inherited_generation,
            inherited_generation,
            image: None,
            slots: [SlotHolds::Unknown; 2],
            maglev: MaglevCache::default(),
            maglev6: MaglevCache::default(),
        })
    }

    /// The path readers open.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The capacity of the live file.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// Publishes `state` as the next generation and wakes waiting readers. Grows the file
    /// (new file + rename) when the state does not fit. On error nothing is published and
    /// readers keep the previous table.
    pub fn publish(&mut self, state: &NodeState) -> Result<u64, ShmError> {
        self.publish_traced(state, &mut |_| {})
    }

    /// [`publish`](Self::publish), calling `phase` with each [`PublishPhase`] as it ends
    /// (for measurements: the caller reads its clock there; this module keeps none).
    pub fn publish_traced(
        &mut self,
        state: &NodeState,
        phase: &mut dyn FnMut(PublishPhase),
    ) -> Result<u64, ShmError> {
        let mut state = state.clone();
        state.normalize();
        phase(PublishPhase::Normalize);
        let need = requirements(&state, self.capacity.maglev_size)?;
        let generation = self.generation + 1;
        phase(PublishPhase::Requirements);
        let tables = Tables {
            v4: self
                .maglev
                .tables_for(&state.services, self.capacity.maglev_size)?,
            v6: self
                .maglev6
                .tables_for(&state.services6, self.capacity.maglev_size)?,
        };
        validate(&state, &tables, self.capacity.maglev_words())?;
        phase(PublishPhase::Maglev);
        let result = match (&self.live, &mut self.image) {
            (Some(live), Some(img)) if self.capacity.holds(&need) => {
                let cap = self.capacity;
                let encoded = encode(img, &state, &cap, generation, &tables);
                phase(PublishPhase::Encode);
                match encoded {
                    Ok(()) => {
                        seal(img, &cap);
                        phase(PublishPhase::Checksum);
                        let idx = (generation % 2) as usize;
                        write_slot(live, generation, img, self.slots[idx]);
                        self.slots[idx] = SlotHolds::Image(generation);
                        publish_generation(live.header(), generation);
                        phase(PublishPhase::WriteSlot);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            _ => {
                let capacity = self.capacity.grown_for(&need);
                let r = self.replace_file(&state, &tables, capacity, generation);
                phase(PublishPhase::ReplaceFile);
                r
            }
        };
        drop(tables);
        if let Err(e) = result {
            // The image may be half-updated (validate() makes that unlikely): forget it;
            // the next publish writes a new file.
            self.image = None;
            self.slots = [SlotHolds::Unknown; 2];
            self.maglev.moved = true;
            self.maglev.collect();
            self.maglev6.moved = true;
            self.maglev6.collect();
            return Err(e);
        }
        self.maglev.collect();
        self.maglev6.collect();
        self.generation = generation;
        Ok(generation)
    }

    /// Writes a complete new file holding `state` as `generation`, renames it over the
    /// path, then tells readers of the old file to move.
    fn replace_file(
        &mut self,
        state: &NodeState,
        tables: &Tables,
        capacity: Capacity,
        generation: u64,
    ) -> Result<(), ShmError> {
        // A new image: the old one's words sit at the old capacity's offsets.
        self.image = None;
        let mut img = Image::new(&capacity);
        encode(&mut img, state, &capacity, generation, tables)?;
        seal(&mut img, &capacity);
        let tmp = crate::mapped::temporary_beside(&self.path);
        let new = Mapping::create(&tmp, capacity, generation)?;
        write_slot(&new, generation, &img, SlotHolds::Zero);
        new.header().generation.store(generation, Ordering::Release);
        new.header()
            .change_futex
            .store(generation as u32, Ordering::Release);
        new.map.flush().map_err(io("flushing", &tmp))?;
        // The old file (ours, or one left by an earlier writer) is superseded only once
        // the new one is in place.
        let old = self.live.take().or_else(|| {
            (self.inherited_generation > 0)
                .then(|| Mapping::open(&self.path).ok())
                .flatten()
        });
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            self.live = old;
            return Err(ShmError::Io {
                op: "renaming the new node-state file over",
                path: self.path.clone(),
                source: e,
            });
        }
        if let Some(old) = old {
            let h = old.header();
            h.superseded.store(1, Ordering::Release);
            let g = h.generation.load(Ordering::Relaxed);
            // A generation the old file never had: a reader's one load sees a change.
            publish_generation(h, g.wrapping_add(2) | (1 << 63));
        }
        self.live = Some(new);
        self.capacity = capacity;
        self.image = Some(img);
        let idx = (generation % 2) as usize;
        self.slots[idx] = SlotHolds::Image(generation);
        self.slots[1 - idx] = SlotHolds::Zero;
        Ok(())
    }

    /// Stamps the heartbeat readers use to tell whether the writer is alive. Call it about
    /// once a second.
    pub fn heartbeat(&self) {
        if let Some(live) = &self.live {
            live.header()
                .heartbeat_unix_ns
                .store(now_unix_ns(), Ordering::Release);
        }
    }

    /// The last published generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Maglev tables built since this writer was created; a service whose Ready backends
    /// did not change since the last publish reuses its table and does not count.
    pub fn maglev_tables_built(&self) -> u64 {
        self.maglev.built + self.maglev6.built
    }
}

/// Writes the image `img` (sealed) into slot `generation % 2` under its sequence
/// counter. What is written depends on what the slot holds (`holds`): the image of
/// `generation - 2` needs only the ranges the last two encodes changed (one
/// changed Service at 10 000 writes a few KiB, not 80 MB); a new file's zeroed slot, the
/// ranges the counts use (the image is zero elsewhere); anything else, the whole image. A
/// word that already holds its value is not stored again. Words past the counts may keep
/// old values only where the image has them too, or where the slot is zero.
fn write_slot(m: &Mapping, generation: u64, img: &Image, holds: SlotHolds) {
    let idx = (generation % 2) as usize;
    let seq = &m.header().slot_seq[idx];
    let slot = m.slot(idx);
    let words = &img.words;
    debug_assert_eq!(slot.len(), words.len());
    let s = seq.load(Ordering::Relaxed);
    seq.store(s.wrapping_add(1) | 1, Ordering::Relaxed);
    fence(Ordering::Release);
    let copy = |start: usize, end: usize| {
        for (dst, w) in slot[start..end].iter().zip(&words[start..end]) {
            // Only this process writes the slot, so reading it back is reading our own
            // last store.
            if dst.load(Ordering::Relaxed) != *w {
                dst.store(*w, Ordering::Relaxed);
            }
        }
    };
    match holds {
        SlotHolds::Image(g) if g.wrapping_add(2) == generation => {
            for &(start, end) in img.prev_dirty.iter().chain(&img.dirty) {
                copy(start, end);
            }
        }
        SlotHolds::Zero => {
            // `encode` made the counts fit the capacity; a slot without ranges is never
            // built.
            let ranges = used_ranges(words, &m.sections, &m.capacity).unwrap_or_default();
            for (start, len) in ranges {
                copy(start, start + len);
            }
        }
        _ => copy(0, words.len()),
    }
    seq.store((s | 1).wrapping_add(1), Ordering::Release);
}

fn publish_generation(h: &FileHeader, generation: u64) {
    h.generation.store(generation, Ordering::Release);
    h.heartbeat_unix_ns.store(now_unix_ns(), Ordering::Release);
    h.change_futex.fetch_add(1, Ordering::Release);
    futex_wake_all(&h.change_futex);
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 inside a live MAP_SHARED mapping; the
    // kernel only reads the address. Not FUTEX_PRIVATE: waiters are other processes.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid aligned u32 inside a live MAP_SHARED mapping with a
    // valid relative timeout; the kernel returns at once if the word != expected.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

// ---------------------------------------------------------------------------------------
// Readers.

/// A consistent copy of one published table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The generation it was published as.
    pub generation: u64,
    /// The node's state.
    pub state: NodeState,
    /// Maglev slots per service: `maglev[i]` indexes `state.services[i].backends`.
    pub maglev: Vec<Vec<u16>>,
    /// Maglev slots per IPv6 service: `maglev6[i]` indexes
    /// `state.services6[i].backends`.
    pub maglev6: Vec<Vec<u16>>,
}

impl Snapshot {
    /// The backend for a new flow of service `service_index` with hash `flow_hash`.
    #[inline]
    pub fn pick(&self, service_index: usize, flow_hash: u64) -> Option<LocalBackend> {
        let svc = self.state.services.get(service_index)?;
        let i = maglev::pick_in(self.maglev.get(service_index)?, flow_hash)?;
        svc.backends.get(i).copied()
    }

    /// The index of the service serving `frontend`.
    pub fn service_index(&self, frontend: &Frontend) -> Option<usize> {
        self.state
            .services
            .binary_search_by_key(frontend, |s| s.frontend)
            .ok()
    }

    /// The backend for a new flow of IPv6 service `service_index` with hash `flow_hash`.
    #[inline]
    pub fn pick6(&self, service_index: usize, flow_hash: u64) -> Option<LocalBackend6> {
        let svc = self.state.services6.get(service_index)?;
        let i = maglev::pick_in(self.maglev6.get(service_index)?, flow_hash)?;
        svc.backends.get(i).copied()
    }

    /// The index of the IPv6 service serving `frontend`.
    pub fn service_index6(&self, frontend: &Frontend6) -> Option<usize> {
        self.state
            .services6
            .binary_search_by_key(frontend, |s| s.frontend)
            .ok()
    }
}

/// A reader of a node-state file (the dataplane, the BGP speaker, tests).
pub struct NodeStateReader {
    path: PathBuf,
    map: Mapping,
    buf: Vec<u32>,
}

impl NodeStateReader {
    /// Opens and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        let path = path.as_ref().to_path_buf();
        let map = Mapping::open_read(&path)?;
        Ok(NodeStateReader {
            path,
            map,
            buf: Vec::new(),
        })
    }

    /// The generation of the current table: one atomic load. Any change (a publish, or
    /// the file being replaced) changes it; call [`snapshot`](Self::snapshot) then.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.map.header().generation.load(Ordering::Acquire)
    }

    /// How long ago the writer last showed a sign of life (publish or heartbeat).
    pub fn heartbeat_age(&self) -> Option<Duration> {
        let stamp = self.map.header().heartbeat_unix_ns.load(Ordering::Acquire);
        now_unix_ns().checked_sub(stamp).map(Duration::from_nanos)
    }

    /// The process id of the writer that created the file.
    pub fn writer_pid(&self) -> u32 {
        self.map.header().writer_pid.load(Ordering::Relaxed)
    }

    /// The capacity of the mapped file.
    pub fn capacity(&self) -> Capacity {
        self.map.capacity
    }

    fn remap_if_superseded(&mut self) -> Result<(), ShmError> {
        if self.map.header().superseded.load(Ordering::Acquire) != 0 {
            self.map = Mapping::open_read(&self.path)?;
        }
        Ok(())
    }

    /// Blocks until the generation differs from `seen` or `timeout` passes; returns the
    /// current generation. Wakes within microseconds of a publish (futex), so daemons
    /// react at once without polling.
    pub fn wait_change(&mut self, seen: u64, timeout: Duration) -> u64 {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let _ = self.remap_if_superseded();
            let h = self.map.header();
            let f = h.change_futex.load(Ordering::Acquire);
            let g = h.generation.load(Ordering::Acquire);
            if g != seen {
                return g;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return g;
            }
            futex_wait(&h.change_futex, f, deadline - now);
        }
    }

    /// Copies the slot named by the current generation into `self.buf`, consistently,
    /// without its Maglev tables unless `tables` (the checksum then takes their part from
    /// the slot header). Returns the generation found.
    fn copy_current(&mut self, tables: bool) -> Result<u64, ShmError> {
        self.remap_if_superseded()?;
        for _ in 0..READ_RETRIES {
            let h = self.map.header();
            let g = h.generation.load(Ordering::Acquire);
            if g == 0 {
                return Err(ShmError::NoTable);
            }
            if h.superseded.load(Ordering::Acquire) != 0 {
                self.map = Mapping::open_read(&self.path)?;
                continue;
            }
            let idx = (g % 2) as usize;
            let seq = &h.slot_seq[idx];
            let s1 = seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let slot = self.map.slot(idx);
            let cap = self.map.capacity;
            let sec = self.map.sections;
            // Only the used ranges are read back: the rest may hold an older table
            // (no zeroing of a slot-sized buffer per read).
            self.buf.resize(sec.end, 0);
            for (d, w) in self.buf[..SLOT_HEADER_WORDS].iter_mut().zip(slot) {
                *d = w.load(Ordering::Relaxed);
            }
            let ranges = used_ranges(&self.buf, &sec, &cap);
            if let Some(ranges) = ranges {
                for (i, (start, len)) in ranges.iter().enumerate().skip(1) {
                    if !tables && TABLE_RANGES.contains(&i) {
                        continue;
                    }
                    for (d, w) in self.buf[*start..start + len]
                        .iter_mut()
                        .zip(&slot[*start..start + len])
                    {
                        *d = w.load(Ordering::Relaxed);
                    }
                }
            }
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) != s1 {
                continue;
            }
            let slot_gen = u64::from(self.buf[0]) | (u64::from(self.buf[1]) << 32);
            if ranges.is_none() {
                return Err(ShmError::Corrupt(
                    slot_gen,
                    "counts exceed the file's capacity".into(),
                ));
            }
            let want = u64::from(self.buf[6]) | (u64::from(self.buf[7]) << 32);
            let (got, got_tables) = checksums(&self.buf, &sec, &cap, tables);
            if want != got {
                return Err(ShmError::Corrupt(
                    slot_gen,
                    format!("checksum {got:#x} != {want:#x}"),
                ));
            }
            // Without the tables their part was taken from the header: nothing to compare.
            let want_tables = stored_tables_sum(&self.buf);
            if tables && got_tables != want_tables {
                return Err(ShmError::Corrupt(
                    slot_gen,
                    format!("Maglev tables' checksum {got_tables:#x} != {want_tables:#x}"),
                ));
            }
            return Ok(slot_gen);
        }
        Err(ShmError::Contended(READ_RETRIES))
    }

    /// A consistent copy of the current table. Allocates: call it when
    /// [`generation`](Self::generation) changed, not per packet.
    pub fn snapshot(&mut self) -> Result<Snapshot, ShmError> {
        let generation = self.copy_current(true)?;
        decode(&self.buf, &self.map.capacity, generation)
            .map_err(|e| ShmError::Corrupt(generation, e))
    }

    /// What a BGP speaker reads of the current table: the node, its router ID, the
    /// advertised VIPs and the peers (`state.services`, `services6` and `redirects` are
    /// left empty, the Maglev tables unread). Verified like [`snapshot`](Self::snapshot)
    /// (the tables' part of the checksum from the slot header), at a fraction of its cost
    /// at scale: the tables are ~98 % of a slot and a snapshot's decode is mostly them.
    pub fn routing_snapshot(&mut self) -> Result<Snapshot, ShmError> {
        let generation = self.copy_current(false)?;
        decode_routing(&self.buf, &self.map.capacity, generation)
            .map_err(|e| ShmError::Corrupt(generation, e))
    }

    /// Looks up the backend for a new flow directly in shared memory, without copying
    /// the table: a binary search over the services and one Maglev slot, validated by the
    /// slot's sequence counter (retried if the writer overtook the read).
    pub fn lookup(&self, frontend: &Frontend, flow_hash: u64) -> Option<LocalBackend> {
        let cap = self.map.capacity;
        let sec = self.map.sections;
        for _ in 0..READ_RETRIES {
            let h = self.map.header();
            let g = h.generation.load(Ordering::Acquire);
            if g == 0 {
                return None;
            }
            let idx = (g % 2) as usize;
            let seq = &h.slot_seq[idx];
            let s1 = seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let slot = self.map.slot(idx);
            let result = lookup_in(slot, &sec, &cap, frontend, flow_hash);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return result;
            }
        }
        None
    }
}

fn lookup_in(
    slot: &[AtomicU32],
    sec: &Sections,
    cap: &Capacity,
    f: &Frontend,
    flow_hash: u64,
) -> Option<LocalBackend> {
    let ld = |i: usize| slot.get(i).map(|w| w.load(Ordering::Relaxed));
    let n = (ld(2)? as usize).min(cap.services as usize);
    let key = (
        u32::from(f.vip),
        u32::from(f.protocol.number()) | (u32::from(f.port) << 16),
    );
    let (mut lo, mut hi) = (0usize, n);
    // Services are sorted by (vip, protocol, port); the record's second word packs
    // protocol | port << 16, so compare (vip, protocol, port) explicitly.
    let order = |w1: u32| (w1 & 0xff, w1 >> 16);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let base = sec.services + mid * SERVICE_WORDS;
        let (vip, w1) = (ld(base)?, ld(base + 1)?);
        match (vip, order(w1)).cmp(&(key.0, order(key.1))) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => {
                let first = ld(base + 2)? as usize;
                let count = ld(base + 3)? as usize;
                let m = cap.maglev_size as usize;
                let s = (flow_hash % m as u64) as usize;
                let word = ld(sec.maglev + mid * cap.maglev_words() + s / 2)?;
                let b = if s.is_multiple_of(2) {
                    word & 0xffff
                } else {
                    word >> 16
                } as usize;
                if b >= count || first + b >= cap.backends as usize {
                    return None;
                }
                let br = sec.backends + (first + b) * BACKEND_WORDS;
                // `count` is the Ready count: a terminating backend is never picked.
                return Some(LocalBackend {
                    ip: Ipv4Addr::from(ld(br)?),
                    port: ld(br + 1)? as u16,
                });
            }
        }
    }
    None
}

fn decode(w: &[u32], cap: &Capacity, generation: u64) -> Result<Snapshot, String> {
    let mut snap = decode_routing(w, cap, generation)?;
    let sec = cap.sections();
    let (ns, nb) = (w[2] as usize, w[3] as usize);
    let (services, maglev) = (0..ns)
        .map(|i| decode_service(w, cap, &sec, nb, i))
        .collect::<Result<(Vec<_>, Vec<_>), _>>()?;
    let (services6, maglev6) = decode_services6(w, cap, &sec)?;
    let state = &mut snap.state;
    state.services = services;
    state.services6 = services6;
    state.redirects = decode_redirects(w, &sec)?;
    snap.maglev = maglev;
    snap.maglev6 = maglev6;
    Ok(snap)
}

/// The routing part of a slot ([`NodeStateReader::routing_snapshot`]): the header, the
/// advertised VIPs and the peers; no service, redirect or Maglev table is read.
fn decode_routing(w: &[u32], cap: &Capacity, generation: u64) -> Result<Snapshot, String> {
    let sec = cap.sections();
    if w[SLOT_HEADER_SPARE].iter().any(|x| *x != 0) {
        return Err("slot header spare words 22, 23 are not zero".into());
    }
    let (nv, np) = (w[4] as usize, w[5] as usize);
    let node = get_name(&w[SLOT_HEADER_WORDS - NAME_BYTES / 4..SLOT_HEADER_WORDS])?;
    let router_id = (w[9] != 0).then(|| Ipv4Addr::from(w[8]));
    let advertised = (0..nv)
        .map(|i| decode_vip(w, &sec, i))
        .collect::<Result<_, _>>()?;
    let peers = (0..np)
        .map(|i| decode_peer(w, &sec, i))
        .collect::<Result<_, _>>()?;
    Ok(Snapshot {
        generation,
        state: NodeState {
            node,
            router_id,
            advertised,
            peers,
            ..NodeState::default()
        },
        maglev: Vec::new(),
        maglev6: Vec::new(),
    })
}

/// The IPv6 services of a slot (layout 10) and their Maglev tables: each record
/// bounds-checked against the counts (which `used_ranges` checked against the capacity),
/// the frontends strictly ascending (lookups binary-search them).
#[allow(clippy::type_complexity)]
fn decode_services6(
    w: &[u32],
    cap: &Capacity,
    sec: &Sections,
) -> Result<(Vec<NodeService6>, Vec<Vec<u16>>), String> {
    let (services, maglev): (Vec<_>, Vec<_>) = (0..w[16] as usize)
        .map(|i| decode_service6(w, cap, sec, i))
        .collect::<Result<_, _>>()?;
    if let Some(i) = services
        .windows(2)
        .position(|p| p[0].frontend >= p[1].frontend)
    {
        return Err(format!(
            "IPv6 services {i} and {} are not in ascending order ({}, {})",
            i + 1,
            services[i].frontend,
            services[i + 1].frontend
        ));
    }
    Ok((services, maglev))
}

/// IPv6 service record `i` (layout 10) and its Maglev table.
fn decode_service6(
    w: &[u32],
    cap: &Capacity,
    sec: &Sections,
    i: usize,
) -> Result<(NodeService6, Vec<u16>), String> {
    let rec = &w[sec.services6 + i * SERVICE6_WORDS..][..SERVICE6_WORDS];
    let vip = ipv6_from_words(&rec[..4]);
    if let Some(why) = bad_ipv6(IpAddr::V6(vip)) {
        return Err(format!("IPv6 service {i}: VIP {vip} is {why}"));
    }
    let protocol = Protocol::from_number((rec[4] & 0xff) as u8)
        .ok_or_else(|| format!("IPv6 service {i}: unknown protocol {}", rec[4] & 0xff))?;
    let unknown = rec[4] & 0xff00 & !SERVICE_HAND_OFF;
    if unknown != 0 || rec[11] != 0 {
        return Err(format!(
            "IPv6 service {i}: unknown flags {unknown:#x} or spare word {:#x}",
            rec[11]
        ));
    }
    let hand_off = rec[4] & SERVICE_HAND_OFF != 0;
    let (first, count, draining) = (rec[5] as usize, rec[6] as usize, rec[7] as usize);
    if first + count + draining > w[17] as usize {
        return Err(format!("IPv6 service {i}: backends out of range"));
    }
    let backends = (first..first + count)
        .map(|b| decode_backend6(w, sec, i, b, false))
        .collect::<Result<Vec<_>, _>>()?;
    let terminating = (first + count..first + count + draining)
        .map(|b| decode_backend6(w, sec, i, b, true))
        .collect::<Result<Vec<_>, _>>()?;
    let slots = maglev_slots(w, cap, sec.maglev6, i);
    if slots
        .iter()
        .any(|s| *s != maglev::NO_BACKEND && usize::from(*s) >= count)
    {
        return Err(format!(
            "IPv6 service {i}: Maglev slot names a missing backend"
        ));
    }
    let service = NodeService6 {
        frontend: Frontend6 {
            vip,
            protocol,
            port: (rec[4] >> 16) as u16,
        },
        backends,
        terminating,
        source_ranges: decode_source_ranges6(w, sec, i, rec)?,
        client_ip_affinity: (rec[10] != 0).then_some(rec[10]),
        hand_off,
    };
    Ok((service, slots))
}

/// IPv6 backend record `b` of IPv6 service `i`, which must be (not) terminating.
fn decode_backend6(
    w: &[u32],
    sec: &Sections,
    i: usize,
    b: usize,
    terminating: bool,
) -> Result<LocalBackend6, String> {
    let br = &w[sec.backends6 + b * BACKEND6_WORDS..][..BACKEND6_WORDS];
    if (br[4] & BACKEND_TERMINATING != 0) != terminating || br[4] >> 17 != 0 {
        return Err(format!(
            "IPv6 service {i} backend {b} has inconsistent flags"
        ));
    }
    let ip = ipv6_from_words(&br[..4]);
    if let Some(why) = bad_ipv6(IpAddr::V6(ip)) {
        return Err(format!("IPv6 service {i} backend {b}: {ip} is {why}"));
    }
    Ok(LocalBackend6 {
        ip,
        port: br[4] as u16,
    })
}

/// The IPv6 source ranges of IPv6 service record `rec` (number `i`; layout 10).
fn decode_source_ranges6(
    w: &[u32],
    sec: &Sections,
    i: usize,
    rec: &[u32],
) -> Result<Vec<ipnet::Ipv6Net>, String> {
    let (first, count) = (rec[8] as usize, rec[9] as usize);
    if first + count > w[18] as usize {
        return Err(format!("IPv6 service {i}: source ranges out of range"));
    }
    (first..first + count)
        .map(|r| {
            let rr = &w[sec.source_ranges6 + r * SOURCE_RANGE6_WORDS..][..SOURCE_RANGE6_WORDS];
            let network = ipv6_from_words(&rr[..4]);
            u8::try_from(rr[4])
                .ok()
                .and_then(|len| ipnet::Ipv6Net::new(network, len).ok())
                .filter(|n| n.trunc() == *n)
                .ok_or_else(|| {
                    format!(
                        "IPv6 service {i}: source range {network}/{} is not a network",
                        rr[4]
                    )
                })
        })
        .collect()
}

/// The Maglev slots of table `i` of the section at `start`.
fn maglev_slots(w: &[u32], cap: &Capacity, start: usize, i: usize) -> Vec<u16> {
    let mw = cap.maglev_words();
    let mut slots: Vec<u16> = w[start + i * mw..][..mw]
        .iter()
        .flat_map(|x| [(*x & 0xffff) as u16, (*x >> 16) as u16])
        .collect();
    slots.truncate(cap.maglev_size as usize);
    slots
}

/// Service record `i` of a slot holding `nb` backend records, and its Maglev table.
fn decode_service(
    w: &[u32],
    cap: &Capacity,
    sec: &Sections,
    nb: usize,
    i: usize,
) -> Result<(NodeService, Vec<u16>), String> {
    let rec = &w[sec.services + i * SERVICE_WORDS..][..SERVICE_WORDS];
    let protocol = Protocol::from_number((rec[1] & 0xff) as u8).ok_or("unknown protocol")?;
    let (first, count, draining) = (rec[2] as usize, rec[3] as usize, rec[4] as usize);
    if first + count + draining > nb {
        return Err(format!("service {i} backends out of range"));
    }
    let source_ranges = decode_source_ranges(w, sec, i, rec)?;
    let backend = |b: usize, terminating: bool| {
        let br = &w[sec.backends + b * BACKEND_WORDS..][..BACKEND_WORDS];
        if (br[1] & BACKEND_TERMINATING != 0) != terminating || br[1] >> 17 != 0 {
            return Err(format!("service {i} backend {b} has inconsistent flags"));
        }
        Ok(LocalBackend {
            ip: Ipv4Addr::from(br[0]),
            port: br[1] as u16,
        })
    };
    let backends = (first..first + count)
        .map(|b| backend(b, false))
        .collect::<Result<Vec<_>, _>>()?;
    let terminating = (first + count..first + count + draining)
        .map(|b| backend(b, true))
        .collect::<Result<Vec<_>, _>>()?;
    let slots = maglev_slots(w, cap, sec.maglev, i);
    if slots
        .iter()
        .any(|s| *s != maglev::NO_BACKEND && usize::from(*s) >= count)
    {
        return Err(format!("service {i} Maglev slot names a missing backend"));
    }
    let service = NodeService {
        frontend: Frontend {
            vip: Ipv4Addr::from(rec[0]),
            protocol,
            port: (rec[1] >> 16) as u16,
        },
        backends,
        terminating,
        source_ranges,
        client_ip_affinity: (rec[7] != 0).then_some(rec[7]),
        hand_off: rec[1] & SERVICE_HAND_OFF != 0,
        host_network: rec[1] & SERVICE_HOST_NETWORK != 0,
    };
    Ok((service, slots))
}

/// VIP record `i`.
fn decode_vip(w: &[u32], sec: &Sections, i: usize) -> Result<AdvertisedVip, String> {
    let rec = &w[sec.vips + i * VIP_WORDS..][..VIP_WORDS];
    let mask = u64::from(rec[3]) | (u64::from(rec[4]) << 32);
    let (nc, nl) = (rec[5] as usize, rec[6] as usize);
    if nc > MAX_COMMUNITIES || nl > MAX_LARGE_COMMUNITIES {
        return Err(format!("VIP record {i} has too many communities"));
    }
    let vip = decode_address(rec[7], VIP_IPV6, rec[0], &rec[32..36])
        .map_err(|e| format!("VIP record {i}: {e}"))?;
    if rec[7] & !VIP_IPV6 != 0 {
        return Err(format!("VIP record {i} has unknown flags {:#x}", rec[7]));
    }
    Ok(AdvertisedVip {
        vip,
        local_pref: (rec[2] != 0).then_some(rec[1]),
        communities: rec[8..8 + nc].to_vec(),
        large_communities: (0..nl)
            .map(|j| [rec[16 + 3 * j], rec[17 + 3 * j], rec[18 + 3 * j]])
            .collect(),
        peers: (0..64u16).filter(|p| mask & (1 << p) != 0).collect(),
        weight: (rec[29] != 0).then_some(rec[28]),
    })
}

/// An address stored as an IPv4 word `v4` and four IPv6 words `v6`, IPv6 when `flags`
/// has `bit`: the words of the other family must be zero, an IPv6 one usable
/// ([`bad_ipv6`]).
fn decode_address(flags: u32, bit: u32, v4: u32, v6: &[u32]) -> Result<IpAddr, String> {
    if flags & bit == 0 {
        if v6.iter().any(|w| *w != 0) {
            return Err("IPv4, with IPv6 address words set".into());
        }
        return Ok(IpAddr::V4(Ipv4Addr::from(v4)));
    }
    if v4 != 0 {
        return Err("IPv6, with an IPv4 address word set".into());
    }
    let ip = IpAddr::V6(ipv6_from_words(v6));
    match bad_ipv6(ip) {
        Some(why) => Err(format!("IPv6 address {ip} is {why}")),
        None => Ok(ip),
    }
}

/// Peer record `i`.
fn decode_peer(w: &[u32], sec: &Sections, i: usize) -> Result<PeerConfig, String> {
    let rec = &w[sec.peers + i * PEER_WORDS..][..PEER_WORDS];
    let name = get_name(&rec[..NAME_BYTES / 4])?;
    let f = &rec[NAME_BYTES / 4..];
    let md5_len = (f[9] as usize).min(MD5_BYTES);
    let md5 = get_bytes(&f[12..12 + MD5_BYTES / 4], md5_len);
    let x = &f[12 + MD5_BYTES / 4..];
    if f[11] & !(PEER_IPV6 | PEER_SOURCE_IPV6) != 0 {
        return Err(format!("peer record {i} has unknown flags {:#x}", f[11]));
    }
    let peer_address = decode_address(f[11], PEER_IPV6, f[0], &x[16..20])
        .map_err(|e| format!("peer record {i} address: {e}"))?;
    let source_address = if f[5] != 0 {
        Some(
            decode_address(f[11], PEER_SOURCE_IPV6, f[4], &x[20..24])
                .map_err(|e| format!("peer record {i} source address: {e}"))?,
        )
    } else if f[11] & PEER_SOURCE_IPV6 != 0 || f[4] != 0 || x[20..24].iter().any(|w| *w != 0) {
        return Err(format!(
            "peer record {i} has source address words but no source address"
        ));
    } else {
        None
    };
    Ok(PeerConfig {
        name,
        peer_address,
        peer_asn: f[1],
        local_asn: f[2],
        peer_port: f[3] as u16,
        passive: (f[3] >> 16) & 1 == 1,
        source_address,
        hold_time: f[6] as u16,
        keepalive_time: (f[6] >> 16) as u16,
        connect_retry_time: f[7] as u16,
        ebgp_multihop: ((f[7] >> 24) & 1 == 1).then_some((f[7] >> 16) as u8),
        graceful_restart_time: ((f[8] >> 16) & 1 == 1).then_some(f[8] as u16),
        md5_password: if f[10] != 0 {
            Some(
                String::from_utf8(md5)
                    .map_err(|_| "MD5 password is not UTF-8")?
                    .into(),
            )
        } else {
            None
        },
        bfd: ((x[2] >> 8) & 1 == 1).then_some(BfdSettings {
            min_rx_ms: x[0],
            min_tx_ms: x[1],
            multiplier: x[2] as u8,
        }),
        drain: ((x[3] >> 8) & 1 == 1).then_some(DrainSettings {
            as_path_prepend: x[3] as u8,
            local_pref: x[4],
            wait_seconds: x[5] as u16,
        }),
        bfd_auth: match x[6] & 0xff {
            0 => None,
            kind => Some(BfdAuth {
                auth_type: if kind == 2 {
                    BfdAuthType::MeticulousKeyedSha1
                } else {
                    BfdAuthType::KeyedSha1
                },
                key_id: (x[6] >> 8) as u8,
                key: String::from_utf8(get_bytes(
                    &x[8..8 + BFD_KEY_MAX_BYTES / 4],
                    ((x[6] >> 16) as usize).min(BFD_KEY_MAX_BYTES),
                ))
                .map_err(|_| "BFD key is not UTF-8")?
                .into(),
            }),
        },
    })
}

/// The source ranges of service record `rec` (number `i`; layout 8), bounds-checked
/// against the slot's count, which `used_ranges` checked against the capacity.
fn decode_source_ranges(
    w: &[u32],
    sec: &Sections,
    i: usize,
    rec: &[u32],
) -> Result<Vec<SourceRange>, String> {
    let (first, count) = (rec[5] as usize, rec[6] as usize);
    if first + count > w[15] as usize {
        return Err(format!("service {i} source ranges out of range"));
    }
    (first..first + count)
        .map(|r| {
            let rr = &w[sec.source_ranges + r * SOURCE_RANGE_WORDS..][..SOURCE_RANGE_WORDS];
            let (network, len) = (Ipv4Addr::from(rr[0]), rr[1]);
            u8::try_from(len)
                .ok()
                .and_then(|len| SourceRange::new(network, len))
                .filter(|r| r.network == network)
                .ok_or_else(|| format!("service {i} source range {network}/{len} is not a network"))
        })
        .collect()
}

/// The redirect part of a slot (layout 4): bounds-checked against the counts, which
/// `used_ranges` checked against the capacity.
fn decode_redirects(w: &[u32], sec: &Sections) -> Result<Redirects, String> {
    let (nrv, nrn) = (w[12] as usize, w[13] as usize);
    let node_address = (w[11] != 0).then(|| Ipv4Addr::from(w[10]));
    let mut vips = Vec::with_capacity(nrv);
    for i in 0..nrv {
        let rec = &w[sec.redirect_vips + i * REDIRECT_VIP_WORDS..][..REDIRECT_VIP_WORDS];
        let (first, count) = (rec[1] as usize, rec[2] as usize);
        if count > MAX_REDIRECT_NODES_PER_VIP || first + count > nrn {
            return Err(format!("redirect VIP {i} nodes out of range"));
        }
        vips.push(VipRedirectPeers {
            vip: Ipv4Addr::from(rec[0]),
            nodes: w[sec.redirect_nodes + first..][..count]
                .iter()
                .map(|a| Ipv4Addr::from(*a))
                .collect(),
        });
    }
    let mut vips6 = Vec::with_capacity(w[19] as usize);
    for i in 0..w[19] as usize {
        let rec = &w[sec.redirect_vips6 + i * REDIRECT_VIP6_WORDS..][..REDIRECT_VIP6_WORDS];
        let (first, count) = (rec[4] as usize, rec[5] as usize);
        if count > MAX_REDIRECT_NODES_PER_VIP || first + count > nrn {
            return Err(format!("IPv6 redirect VIP {i} nodes out of range"));
        }
        vips6.push(VipRedirectPeers6 {
            vip: ipv6_from_words(&rec[..4]),
            nodes: w[sec.redirect_nodes + first..][..count]
                .iter()
                .map(|a| Ipv4Addr::from(*a))
                .collect(),
        });
    }
    let keys = (0..w[14] as usize)
        .map(|i| {
            let rec = &w[sec.redirect_keys + i * REDIRECT_KEY_WORDS..][..REDIRECT_KEY_WORDS];
            let mut key = [0u8; KEY_BYTES];
            key.copy_from_slice(&get_bytes(&rec[1..], KEY_BYTES));
            RedirectKey {
                id: rec[0] as u8,
                key: SecretKey::new(key),
            }
        })
        .collect();
    Ok(Redirects {
        node_address,
        vips,
        vips6,
        keys,
    })
}

#[cfg(test)]
mod tests;
