//! Loads and feeds the XDP steering program (`bpf/steer.c`, compiled by `build.rs`).
//!
//! Everything the program uses is **pinned** under one directory per dataplane instance
//! (`--pin-dir`): its maps (`frontends`, `vips`, `ifaces`, `xsks`, and the shared flow
//! table `flow_meta` / `flow_index` / `flow_records`) and one BPF link per interface
//! (`link-<ifname>`). So the program stays attached and its maps keep their contents when
//! the process dies, however it dies: while it is down, packets of Juneau's flows are
//! redirected to empty AF_XDP slots and dropped (TCP retransmits), everything else still
//! passes to the kernel. A restarted process loads the program again over the same pinned
//! maps (after checking their sizes and the flow table's layout version; a mismatch is
//! logged and the pins are replaced by fresh ones), and atomically swaps its new program
//! into each pinned link (`bpf_link_update`). [`Steering::remove_pins`] takes everything
//! away (uninstall, tests).
//!
//! The maps follow the service table: `frontends` holds every `(VIP, port, protocol)`
//! served here (with [`FRONTEND_FILTERED`] when its Service has source ranges),
//! `source_ranges` each such frontend's ranges, and `vips` every VIP address;
//! [`Steering::sync`] applies the difference after each state change (adds first,
//! removes after: a client both the old and the new ranges admit is never dropped).
//!
//! IPv6 ([`ipv6`]): `frontends6` and `vips6` follow the IPv6 frontends
//! ([`Steering::sync6`]); `flows6`, pinned with the flow tables, holds the keys of the
//! IPv6 flows userspace holds, written by the forwarding workers through [`Flows6`].

pub mod ipv6;

pub use ipv6::{Flow6MapKey, Flows6, Frontend6, MAX_FRONTENDS6};

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, XskMap};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::xdp::XdpLink;
use aya::programs::{Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader};

use crate::flow::{Flow, FlowMeta, SharedRegions, FLOW_MAGIC, LAYOUT_VERSION};
use crate::region::Region;
use crate::services::ServiceTable;

/// The compiled steering program.
static STEER_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/steer.o"));

use crate::abi::{
    FRONTEND_EXPOSED, FRONTEND_FILTERED, FRONTEND_HOST_NETWORK, MAX_UPLINKS, ROLE_POD, ROLE_UPLINK,
    SD_NEW_FLOW_PREFIX_RATE, SD_NO_SOCKET, SD_PORT_NOT_EXPOSED, SD_REDIRECT_NOT_FROM_PEER,
    SD_SOURCE_RANGE_DENIED, SD_UNSUPPORTED_PROTOCOL,
};

const BPF_F_MMAPABLE: u32 = 1 << 10;
/// `BPF_F_NO_PREALLOC`: an LPM trie must be created with it; `flows6` is, so that its
/// memory follows the IPv6 flows rather than the capacity.
const BPF_F_NO_PREALLOC: u32 = 1;

/// Most peer nodes the steering program takes redirected packets from (`redirect_from`;
/// Kubernetes supports clusters of 5 000 nodes).
pub const MAX_REDIRECT_PEERS: usize = 8192;

/// `struct admit_conf` in bpf/steer.c: the admission's limit and its slots' seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
struct AdmitConf {
    rate: u64,
    /// [`crate::admission::Admission::tolerance_ns`].
    tolerance_ns: u64,
    seed: u64,
}

// SAFETY: three u64, no padding, matching `struct admit_conf`.
unsafe impl aya::Pod for AdmitConf {}
const _: () = assert!(std::mem::size_of::<AdmitConf>() == crate::abi::ADMIT_CONF_BYTES);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
struct IfaceConf {
    slot_base: u32,
    queues: u32,
    role: u32,
}

// SAFETY: plain `repr(C)` integers without padding, matching `struct iface_conf`.
unsafe impl aya::Pod for IfaceConf {}
const _: () = assert!(std::mem::size_of::<IfaceConf>() == crate::abi::IFACE_CONF_BYTES);

/// The `uplinks` entry (`struct uplink_set` in bpf/steer.c): the uplinks' ifindexes
/// (unused places 0) and each one's `ifaces` configuration, so that a packet from an
/// uplink needs no look-up in the `ifaces` hash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
struct UplinkSet {
    ifindex: [u32; MAX_UPLINKS],
    conf: [IfaceConf; MAX_UPLINKS],
}

// SAFETY: `repr(C)` u32 arrays and `IfaceConf`s (12 bytes, 4-aligned): no padding,
// matching `struct uplink_set`.
unsafe impl aya::Pod for UplinkSet {}
const _: () = assert!(std::mem::size_of::<UplinkSet>() == crate::abi::UPLINK_SET_BYTES);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
struct FrontendKey {
    addr: [u8; 4],
    port: [u8; 2],
    proto: u8,
    pad: u8,
}

// SAFETY: `repr(C)` byte arrays and bytes, 8 bytes without padding, matching
// `struct frontend_key`.
unsafe impl aya::Pod for FrontendKey {}
const _: () = assert!(std::mem::size_of::<FrontendKey>() == crate::abi::FRONTEND_KEY_BYTES);

/// The data of a `source_ranges` key (after its prefix length): the frontend, then the
/// client address, both in network order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
struct SourceRangeData {
    frontend: FrontendKey,
    saddr: [u8; 4],
}

// SAFETY: `repr(C)` of an 8-byte Pod and a byte array, 12 bytes without padding, matching
// `struct source_range_key` after its prefix length.
unsafe impl aya::Pod for SourceRangeData {}
const _: () =
    assert!(std::mem::size_of::<SourceRangeData>() == crate::abi::SOURCE_RANGE_KEY_BYTES - 4);

/// A frontend as the maps key it: `(VIP, port, protocol number)`.
type FrontendTuple = (Ipv4Addr, u16, u8);

/// One installed source range: the frontend and the range.
type RangeEntry = (FrontendTuple, juneau_control::model::SourceRange);

fn range_key(e: &RangeEntry) -> LpmKey<SourceRangeData> {
    LpmKey::new(
        64 + u32::from(e.1.prefix_len),
        SourceRangeData {
            frontend: frontend_key(&e.0),
            saddr: e.1.network.octets(),
        },
    )
}

/// An interface the steering program runs on.
#[derive(Debug, Clone)]
pub struct SteeredIface {
    /// Interface name.
    pub name: String,
    /// Interface index.
    pub ifindex: u32,
    /// The uplink (VIP traffic in) rather than a Pod interface (replies in).
    pub uplink: bool,
    /// Redirect-map index of the socket on RX queue 0.
    pub slot_base: u32,
    /// Number of RX queues with a socket.
    pub queues: u32,
}

/// Handle of an interface's pinned link (give it back to [`Steering::detach_iface`]).
#[derive(Debug)]
pub struct IfaceLink {
    name: String,
}

/// Drops the steering program made itself (packets that never reached userspace).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SteerDrops {
    /// TCP/UDP (or an ICMP error about it) to a VIP on a port/protocol not exposed.
    pub port_not_exposed: u64,
    /// Other traffic to a VIP address (ICMP echo, other protocols).
    pub unsupported_protocol: u64,
    /// Packets of no flow beyond their source /24's new-flow admission.
    pub new_flow_prefix_rate: u64,
    /// Packets for userspace while no AF_XDP socket was in their queue's slot.
    pub no_socket: u64,
    /// UDP to this node's redirect address and port from a source that is no peer node.
    pub redirect_not_from_peer: u64,
    /// Packets of no held flow from a source the Service's source ranges do not admit.
    pub source_range_denied: u64,
}

impl SteerDrops {
    /// Each count under the drop reason it is reported as.
    pub fn by_reason(&self) -> [(crate::counters::DropReason, u64); 6] {
        use crate::counters::DropReason;
        [
            (DropReason::PortNotExposed, self.port_not_exposed),
            (DropReason::UnsupportedProtocol, self.unsupported_protocol),
            (
                DropReason::NewFlowPrefixRateLimited,
                self.new_flow_prefix_rate,
            ),
            (DropReason::NoSocket, self.no_socket),
            (DropReason::RedirectNotFromPeer, self.redirect_not_from_peer),
            (DropReason::SourceRangeDenied, self.source_range_denied),
        ]
    }
}

/// The loaded, attached steering program and its maps.
pub struct Steering {
    bpf: Ebpf,
    /// The program found pinned from an earlier run of this build, reused unverified;
    /// `None`: the one in `bpf`, loaded (verified) by this process.
    reused: Option<Xdp>,
    pin_dir: PathBuf,
    /// Whether maps and links are pinned (`pin_dir` is on a BPF filesystem).
    pinned: bool,
    force_generic: bool,
    ifaces: BpfHashMap<MapData, u32, IfaceConf>,
    /// The uplinks among `ifaces`, as the program reads them (`uplinks`, one entry).
    uplinks: Array<MapData, UplinkSet>,
    /// The uplinks in the `uplinks` entry, with their configuration.
    uplink_confs: Vec<(u32, IfaceConf)>,
    xsks: XskMap<MapData>,
    vips: BpfHashMap<MapData, [u8; 4], u8>,
    frontends: BpfHashMap<MapData, FrontendKey, u8>,
    source_ranges: LpmTrie<MapData, SourceRangeData, u8>,
    steer_drops: PerCpuArray<MapData, u64>,
    admit_conf: Array<MapData, AdmitConf>,
    /// The admission's buckets (`admit_open`), until [`Steering::set_new_flow_admission`].
    admit_open: Option<Region<u64>>,
    redirect_from: BpfHashMap<MapData, [u8; 4], u8>,
    installed_redirect_from: HashSet<Ipv4Addr>,
    installed_vips: HashSet<Ipv4Addr>,
    /// Each installed frontend with its `frontends` value.
    installed_frontends: HashMap<FrontendTuple, u8>,
    installed_ranges: HashSet<RangeEntry>,
    vips6: BpfHashMap<MapData, [u8; 16], u8>,
    frontends6: BpfHashMap<MapData, ipv6::Frontend6Key, u8>,
    installed_vips6: HashSet<std::net::Ipv6Addr>,
    installed_frontends6: HashSet<Frontend6>,
    flows6: Flows6,
    links: HashMap<String, FdLink>,
    /// The mode each interface was attached in (`kept` when a pinned link was reused).
    pub modes: Vec<(String, &'static str)>,
    /// The `address:port` redirected packets are steered from, if any.
    redirect_listen: Option<(Ipv4Addr, u16)>,
    /// The XDP fast path's map (`fast_slots`), until the workers take their parts.
    fast: Option<Region<crate::fast::FastSlot>>,
}

impl std::fmt::Debug for Steering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steering")
            .field("pin_dir", &self.pin_dir)
            .field("frontends", &self.installed_frontends.len())
            .finish_non_exhaustive()
    }
}

fn take<T>(bpf: &mut Ebpf, name: &str) -> Result<T>
where
    T: TryFrom<aya::maps::Map>,
    <T as TryFrom<aya::maps::Map>>::Error: std::error::Error + Send + Sync + 'static,
{
    let m = bpf
        .take_map(name)
        .ok_or_else(|| anyhow!("steering program has no map {name}"))?;
    T::try_from(m).with_context(|| format!("map {name}"))
}

/// Sizes a pinned map must have to be reused: `(name, key, value, max_entries, flags)`.
fn expected_maps(
    records: u32,
    slots: u32,
    workers: u32,
) -> [(&'static str, u32, u32, u32, u32); 19] {
    [
        ("xsks", 4, 4, 4096, 0),
        ("ifaces", 4, 12, 256, 0),
        ("uplinks", 4, 16 * MAX_UPLINKS as u32, 1, 0),
        ("vips", 4, 1, 65536, 0),
        ("frontends", 8, 1, 65536, 0),
        ("vips6", 16, 1, 65536, 0),
        ("frontends6", 20, 1, 65536, 0),
        // Two keys per flow, allocated as they come.
        ("flows6", 40, 4, 2 * records, BPF_F_NO_PREALLOC),
        ("source_ranges", 16, 1, 65536, BPF_F_NO_PREALLOC),
        ("flow_meta", 4, 64, workers, BPF_F_MMAPABLE),
        ("flow_index", 4, 8, slots, BPF_F_MMAPABLE),
        ("flow_records", 4, 32, records, BPF_F_MMAPABLE),
        ("redirect_in", 8, 1, 16, 0),
        ("redirect_from", 4, 1, MAX_REDIRECT_PEERS as u32, 0),
        (
            "fast_slots",
            4,
            64,
            workers * crate::fast::STRIDE as u32,
            BPF_F_MMAPABLE,
        ),
        // Pinned so that a reused program (see `PROG_PIN`) and this process count in the
        // same map.
        ("steer_drops", 4, 8, 8, 0),
        ("steer_build", 4, 8, 1, 0),
        ("admit_conf", 4, crate::abi::ADMIT_CONF_BYTES as u32, 1, 0),
        (
            "admit_open",
            4,
            8,
            crate::abi::ADMIT_SLOTS as u32,
            BPF_F_MMAPABLE,
        ),
    ]
}

/// The `uplinks` entry for these uplinks (unused places 0).
fn uplink_entry(uplinks: &[(u32, IfaceConf)]) -> Result<UplinkSet> {
    if uplinks.len() > MAX_UPLINKS {
        bail!(
            "{} uplinks: the steering program tells at most {MAX_UPLINKS} apart",
            uplinks.len()
        );
    }
    let mut entry = UplinkSet::default();
    for (i, (ifindex, conf)) in uplinks.iter().enumerate() {
        entry.ifindex[i] = *ifindex;
        entry.conf[i] = *conf;
    }
    Ok(entry)
}

/// The verified steering program's pin, beside its maps.
const PROG_PIN: &str = "juneau_steer";

/// What identifies the program this binary would load: its object and its maps' sizes.
/// A pinned program with the same identity (`steer_build`) is the same program over the
/// same maps. (`DefaultHasher::new()` has fixed keys: stable for a given binary.)
fn build_id(records: u32, slots: u32, workers: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    STEER_OBJ.hash(&mut h);
    (records, slots, workers, LAYOUT_VERSION).hash(&mut h);
    // 0 is what an unwritten `steer_build` holds.
    h.finish().max(1)
}

/// Index slots for a capacity (as [`crate::flow::FlowTable`] sizes them).
pub fn index_slots(capacity: usize) -> usize {
    (capacity.clamp(1, crate::flow::MAX_TABLE_CAPACITY) * 4).next_power_of_two()
}

/// Records per worker's table for a total `--flow-capacity` shared by `workers`.
pub fn per_worker_capacity(total: usize, workers: usize) -> usize {
    total
        .div_ceil(workers.max(1))
        .clamp(1, crate::flow::MAX_TABLE_CAPACITY)
}

/// Why the pinned maps in `dir` cannot be reused, if they cannot.
/// The program pinned by an earlier run of this build over these same maps, if there is
/// one: its maps were kept (no mismatch) and `steer_build` names this build.
fn reusable_program(bpf: &mut Ebpf, pin_dir: &Path, id: u64) -> Option<Xdp> {
    let pin = pin_dir.join(PROG_PIN);
    if !pin.exists() {
        return None;
    }
    let build: Array<&MapData, u64> = bpf.map("steer_build")?.try_into().ok()?;
    if build.get(&0, 0).ok()? != id {
        return None;
    }
    Xdp::from_pin(&pin, aya_obj::programs::XdpAttachType::Interface).ok()
}

/// Loads (verifies) the program and, with pins, pins it and records its build, replacing
/// an earlier build's pin.
fn load_and_pin_program(bpf: &mut Ebpf, pin_dir: &Path, pinned: bool, id: u64) -> Result<()> {
    let prog: &mut Xdp = bpf
        .program_mut("juneau_steer")
        .ok_or_else(|| anyhow!("no program juneau_steer"))?
        .try_into()?;
    prog.load().context("verifying the XDP steering program")?;
    if !pinned {
        return Ok(());
    }
    let pin = pin_dir.join(PROG_PIN);
    let _ = std::fs::remove_file(&pin);
    prog.pin(&pin)
        .with_context(|| format!("pinning the steering program at {}", pin.display()))?;
    let mut build: Array<&mut MapData, u64> = bpf
        .map_mut("steer_build")
        .ok_or_else(|| anyhow!("steering program has no map steer_build"))?
        .try_into()?;
    build
        .set(0, id, 0)
        .context("recording the pinned program's build")?;
    Ok(())
}

/// Maps whose contents are the flow tables (and the fast path's view of them): replaced
/// together or not at all, and replacing them loses the previous run's flows.
const FLOW_MAPS: [&str; 5] = [
    "flow_meta",
    "flow_index",
    "flow_records",
    "fast_slots",
    "flows6",
];

/// Maps earlier versions pinned that this one no longer has (removed at load).
const RETIRED_PINS: [&str; 1] = [
    // The per-prefix buckets the program kept itself (now `admit_open`, kept by userspace).
    "admit_prefix",
];

/// A pinned map this binary cannot reuse, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mismatch {
    map: &'static str,
    reason: String,
}

impl Mismatch {
    fn holds_flows(&self) -> bool {
        FLOW_MAPS.contains(&self.map)
    }
}

/// The pinned maps in `dir` that cannot be reused (another size, flags or flow-table
/// layout). A map missing from `dir` is no mismatch: it is created.
fn pinned_mismatches(dir: &Path, records: u32, slots: u32, workers: u32) -> Vec<Mismatch> {
    let mut found = Vec::new();
    for (name, key, value, max, flags) in expected_maps(records, slots, workers) {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = match MapData::from_pin(&path).and_then(|m| m.info()) {
            Ok(i) => i,
            Err(e) => {
                found.push(Mismatch {
                    map: name,
                    reason: format!("pinned map {} unreadable: {e}", path.display()),
                });
                continue;
            }
        };
        let got = (
            info.key_size(),
            info.value_size(),
            info.max_entries(),
            info.map_flags(),
        );
        if got != (key, value, max, flags) {
            found.push(Mismatch {
                map: name,
                reason: format!(
                    "pinned map {name} has key/value/entries/flags {got:?}, this binary needs {:?} (changed --flow-capacity, --workers or a new version)",
                    (key, value, max, flags)
                ),
            });
        }
    }
    if let Some(reason) = flow_layout_mismatch(dir) {
        found.push(Mismatch {
            map: "flow_meta",
            reason,
        });
    }
    found
}

/// Why the pinned flow table's layout is not this binary's, if it is not.
fn flow_layout_mismatch(dir: &Path) -> Option<String> {
    let meta = dir.join("flow_meta");
    if !meta.exists() {
        return None;
    }
    let m = MapData::from_pin(&meta)
        .map_err(anyhow::Error::from)
        .and_then(|m| {
            Ok(Array::<MapData, [u64; 8]>::try_from(
                aya::maps::Map::Array(m),
            )?)
        })
        .and_then(|a| Ok(a.get(&0, 0)?));
    match m {
        Ok(words) if words[0] == FLOW_MAGIC && words[1] as u32 != LAYOUT_VERSION => Some(format!(
            "pinned flow table has layout version {}, this binary uses {LAYOUT_VERSION}",
            words[1] as u32
        )),
        Ok(_) => None,
        Err(e) => Some(format!("pinned flow_meta unreadable: {e}")),
    }
}

/// The pins to remove for `mismatches`: the mismatched maps, and every flow map with
/// any of them (the flow tables go together).
fn pins_to_replace(mismatches: &[Mismatch]) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = mismatches.iter().map(|m| m.map).collect();
    if mismatches.iter().any(Mismatch::holds_flows) {
        names.extend(FLOW_MAPS);
    }
    names.sort_unstable();
    names.dedup();
    names
}

fn link_pin(dir: &Path, iface: &str) -> PathBuf {
    dir.join(format!("link-{iface}"))
}

impl Steering {
    /// Runs the loaded program once on `frame` as if it had arrived on RX queue 0 of
    /// `ingress_ifindex` (`BPF_PROG_TEST_RUN`: nothing is sent, no redirect happens);
    /// returns the program's action and the frame as it left it. For tests that compare
    /// the program with the engine.
    pub fn test_run(&self, frame: &[u8], ingress_ifindex: u32) -> Result<(u32, Vec<u8>)> {
        use aya::programs::{TestRun, TestRunOptions};
        let (prog, ctx) = self.test_run_input(frame, ingress_ifindex)?;
        let mut out = vec![0u8; frame.len() + 256];
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                ..Default::default()
            })
            .context("BPF_PROG_TEST_RUN of the steering program")?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out))
    }

    /// Runs the loaded program `repeat` times on `frame` (as [`Steering::test_run`]) and
    /// returns its action and the kernel's mean time per run (which includes one clock
    /// read). For cost measurements (`examples/engine_cost.rs xdp-flows`).
    pub fn test_run_timed(
        &self,
        frame: &[u8],
        ingress_ifindex: u32,
        repeat: u32,
    ) -> Result<(u32, std::time::Duration)> {
        use aya::programs::{TestRun, TestRunOptions};
        let (prog, ctx) = self.test_run_input(frame, ingress_ifindex)?;
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat,
                ..Default::default()
            })
            .context("BPF_PROG_TEST_RUN of the steering program")?;
        Ok((r.return_value, r.duration))
    }

    /// The loaded program and the `xdp_md` context of a test run of `frame` arriving on
    /// `ingress_ifindex`.
    fn test_run_input(&self, frame: &[u8], ingress_ifindex: u32) -> Result<(&Xdp, Vec<u8>)> {
        let prog: &Xdp = match self.reused.as_ref() {
            Some(p) => p,
            None => self
                .bpf
                .program("juneau_steer")
                .ok_or_else(|| anyhow!("no program juneau_steer"))?
                .try_into()?,
        };
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
        // egress_ifindex.
        let md: [u32; 6] = [0, frame.len() as u32, 0, ingress_ifindex, 0, 0];
        Ok((prog, md.iter().flat_map(|w| w.to_ne_bytes()).collect()))
    }

    /// Configures this namespace's loopback as the uplink in the program's `ifaces` map,
    /// for test runs only: nothing is attached, a test run sends nothing.
    pub fn configure_test_uplink(&mut self) -> Result<()> {
        self.configure_iface(&SteeredIface {
            name: "lo".into(),
            ifindex: 1,
            uplink: true,
            slot_base: 0,
            queues: 1,
        })
    }

    /// Configures an interface in the program's `ifaces` map (what
    /// [`Steering::attach_iface`] does before attaching; alone, with
    /// [`Steering::test_run`]).
    pub fn configure_iface(&mut self, i: &SteeredIface) -> Result<()> {
        let conf = IfaceConf {
            slot_base: i.slot_base,
            queues: i.queues,
            role: if i.uplink { ROLE_UPLINK } else { ROLE_POD },
        };
        self.ifaces.insert(i.ifindex, conf, 0)?;
        if let Err(e) = self.set_uplink(i.ifindex, i.uplink.then_some(conf)) {
            let _ = self.ifaces.remove(&i.ifindex);
            return Err(e);
        }
        Ok(())
    }

    /// Removes an interface from `ifaces` (and from `uplinks`).
    fn forget_iface(&mut self, ifindex: u32) {
        let _ = self.ifaces.remove(&ifindex);
        if let Err(e) = self.set_uplink(ifindex, None) {
            tracing::warn!(ifindex, error = %e, "could not remove an uplink from the steering program's uplinks");
        }
    }

    /// Makes `ifindex` one of the uplinks the program reads with `conf`, or none (`None`);
    /// writes the entry (replaced whole) only when that changes it.
    fn set_uplink(&mut self, ifindex: u32, conf: Option<IfaceConf>) -> Result<()> {
        let now = self
            .uplink_confs
            .iter()
            .find(|(i, _)| *i == ifindex)
            .map(|(_, c)| *c);
        if now == conf {
            return Ok(());
        }
        let mut uplinks = self.uplink_confs.clone();
        match conf {
            Some(c) => match uplinks.iter_mut().find(|(i, _)| *i == ifindex) {
                Some(u) => u.1 = c,
                None => uplinks.push((ifindex, c)),
            },
            None => uplinks.retain(|(i, _)| *i != ifindex),
        }
        self.uplinks
            .set(0, uplink_entry(&uplinks)?, 0)
            .context("writing the steering program's uplinks")?;
        self.uplink_confs = uplinks;
        Ok(())
    }

    /// The XDP fast path's parts, one per forwarding worker (in worker order), each
    /// turned off until its worker publishes it; empty after the first call.
    pub fn take_fast_parts(&mut self, workers: usize) -> Vec<crate::fast::FastPath> {
        let Some(region) = self.fast.take() else {
            return Vec::new();
        };
        let workers = workers.clamp(1, crate::flow::MAX_WORKERS);
        if region.len() != workers * crate::fast::STRIDE {
            tracing::warn!(
                entries = region.len(),
                workers,
                "the fast-path map does not fit the workers: the XDP fast path stays off"
            );
            return Vec::new();
        }
        region
            .split(workers)
            .into_iter()
            .map(crate::fast::FastPath::new)
            .collect()
    }

    /// Loads the program with its maps pinned under `pin_dir` (created if missing),
    /// reusing the pinned maps of a previous run when they fit (same sizes and flow-table
    /// layout), otherwise replacing them: a map that holds no flows alone, the flow maps
    /// together (why is returned, for the log: the previous run's flows are lost). Returns
    /// the flow tables' shared regions (mapped; one table per forwarding worker, each of
    /// `flow_capacity / workers` flows), for [`crate::flow::FlowTable::open_group`].
    pub fn load(
        pin_dir: &Path,
        flow_capacity: usize,
        workers: usize,
        force_generic: bool,
    ) -> Result<(Self, SharedRegions, Option<String>)> {
        let pinned = on_bpffs(pin_dir);
        if pinned {
            std::fs::create_dir_all(pin_dir)
                .with_context(|| format!("creating the pin directory {}", pin_dir.display()))?;
        } else {
            tracing::warn!(pin_dir = %pin_dir.display(), "the pin directory is not on a BPF filesystem (mount -t bpf bpf /sys/fs/bpf): nothing is pinned, flows will NOT survive a restart and the XDP program goes with the process");
        }
        let workers = workers.clamp(1, crate::flow::MAX_WORKERS);
        let each = per_worker_capacity(flow_capacity, workers);
        let records = (each * workers) as u32;
        let slots = (index_slots(each) * workers) as u32;
        let workers = workers as u32;
        let mismatches = if pinned {
            pinned_mismatches(pin_dir, records, slots, workers)
        } else {
            Vec::new()
        };
        // Only a replaced flow map loses flows (returned, for the log); the others (drop
        // counters, admission, redirect maps) are replaced alone.
        let replaced = mismatches
            .iter()
            .find(|m| m.holds_flows())
            .map(|m| m.reason.clone());
        for m in mismatches.iter().filter(|m| !m.holds_flows()) {
            tracing::info!(map = m.map, reason = %m.reason, "pinned map replaced (flows kept)");
        }
        for name in pins_to_replace(&mismatches).into_iter().chain(RETIRED_PINS) {
            let _ = std::fs::remove_file(pin_dir.join(name));
        }
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries("flow_meta", workers)
            .map_max_entries("flow_index", slots)
            .map_max_entries("flow_records", records)
            .map_max_entries("fast_slots", workers * crate::fast::STRIDE as u32)
            .map_max_entries("flows6", 2 * records);
        let names = expected_maps(records, slots, workers);
        let paths: Vec<(&str, PathBuf)> =
            names.iter().map(|(n, ..)| (*n, pin_dir.join(n))).collect();
        if pinned {
            for (n, p) in &paths {
                loader.map_pin_path(n, p.as_path());
            }
        }
        let mut bpf = loader
            .load(STEER_OBJ)
            .context("loading the XDP steering program")?;
        let regions = SharedRegions {
            meta: map_region::<FlowMeta>(&bpf, "flow_meta")?,
            index: map_region::<u64>(&bpf, "flow_index")?,
            records: map_region::<Flow>(&bpf, "flow_records")?,
        };
        let fast = map_region::<crate::fast::FastSlot>(&bpf, "fast_slots")?;
        let admit_open = map_region::<u64>(&bpf, "admit_open")?;
        let mut ifaces: BpfHashMap<MapData, u32, IfaceConf> = take(&mut bpf, "ifaces")?;
        // Entries of interfaces that no longer exist (a previous run's Pod veths).
        let present = present_ifindexes();
        let stale: Vec<u32> = ifaces
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| !present.contains(k))
            .collect();
        for k in stale {
            let _ = ifaces.remove(&k);
        }
        // The uplinks the program reads are those of `ifaces` (rewritten: a previous run
        // may have stopped between the two maps' writes).
        let mut uplinks: Array<MapData, UplinkSet> = take(&mut bpf, "uplinks")?;
        let mut uplink_confs: Vec<(u32, IfaceConf)> = ifaces
            .iter()
            .filter_map(|e| e.ok())
            .filter(|(_, c)| c.role == ROLE_UPLINK)
            .collect();
        uplink_confs.sort_unstable_by_key(|(k, _)| *k);
        uplink_confs.truncate(MAX_UPLINKS);
        uplinks
            .set(0, uplink_entry(&uplink_confs)?, 0)
            .context("writing the steering program's uplinks")?;
        let xsks: XskMap<MapData> = take(&mut bpf, "xsks")?;
        let vips: BpfHashMap<MapData, [u8; 4], u8> = take(&mut bpf, "vips")?;
        let frontends: BpfHashMap<MapData, FrontendKey, u8> = take(&mut bpf, "frontends")?;
        let source_ranges: LpmTrie<MapData, SourceRangeData, u8> = take(&mut bpf, "source_ranges")?;
        let steer_drops = take(&mut bpf, "steer_drops")?;
        let admit_conf = take(&mut bpf, "admit_conf")?;
        let redirect_from: BpfHashMap<MapData, [u8; 4], u8> = take(&mut bpf, "redirect_from")?;
        // What a previous run installed stays until the first sync removes what is gone.
        let (installed_vips, installed_frontends, installed_ranges, installed_redirect_from) =
            installed_entries(&vips, &frontends, &source_ranges, &redirect_from)?;
        let vips6 = take(&mut bpf, "vips6")?;
        let frontends6 = take(&mut bpf, "frontends6")?;
        let (installed_vips6, installed_frontends6) = ipv6::installed6(&vips6, &frontends6)?;
        let flows6 = Flows6::new(take(&mut bpf, "flows6")?);
        let id = build_id(records, slots, workers);
        // A pinned program uses the pinned maps: reused only when every one was kept.
        let reused = if pinned && mismatches.is_empty() {
            reusable_program(&mut bpf, pin_dir, id)
        } else {
            None
        };
        if reused.is_none() {
            load_and_pin_program(&mut bpf, pin_dir, pinned, id)?;
        }
        if pinned {
            remove_stale_link_pins(pin_dir);
        }
        let st = Steering {
            bpf,
            reused,
            pin_dir: pin_dir.to_path_buf(),
            pinned,
            force_generic,
            ifaces,
            uplinks,
            uplink_confs,
            xsks,
            vips,
            frontends,
            source_ranges,
            steer_drops,
            admit_conf,
            admit_open: Some(admit_open),
            redirect_from,
            installed_redirect_from,
            installed_vips,
            installed_frontends,
            installed_ranges,
            vips6,
            frontends6,
            installed_vips6,
            installed_frontends6,
            flows6,
            links: HashMap::new(),
            modes: Vec::new(),
            redirect_listen: None,
            fast: Some(fast),
        };
        Ok((st, regions, replaced))
    }

    /// Starts steering on the given interfaces (see [`Steering::attach_iface`]).
    pub fn attach_all(&mut self, ifaces: &[SteeredIface]) -> Result<()> {
        for i in ifaces {
            self.attach_iface(i)?;
        }
        Ok(())
    }

    /// Whether the program was found pinned and reused (the start's log says so).
    pub fn program_reused(&self) -> bool {
        self.reused.is_some()
    }

    fn prog(&mut self) -> Result<&mut Xdp> {
        if let Some(p) = self.reused.as_mut() {
            return Ok(p);
        }
        Ok(self
            .bpf
            .program_mut("juneau_steer")
            .ok_or_else(|| anyhow!("no program juneau_steer"))?
            .try_into()?)
    }

    /// Puts the program on `name` through its pinned link: the link a previous run
    /// pinned gets this program swapped in atomically; otherwise a new link is made
    /// (native XDP, generic as fall-back) and pinned.
    fn attach_program(&mut self, name: &str) -> Result<()> {
        let pin = link_pin(&self.pin_dir, name);
        if self.pinned && pin.exists() {
            let kept = PinnedLink::from_pin(&pin)
                .map_err(anyhow::Error::from)
                .and_then(|p| Ok(XdpLink::try_from(FdLink::from(p))?))
                .and_then(|l| Ok(self.prog()?.attach_to_link(l)?))
                .and_then(|id| Ok(FdLink::try_from(self.prog()?.take_link(id)?)?));
            match kept {
                Ok(fd) => {
                    self.links.insert(name.to_string(), fd);
                    self.modes.retain(|(n, _)| n != name);
                    self.modes.push((name.to_string(), "kept"));
                    return Ok(());
                }
                Err(e) => {
                    tracing::info!(iface = %name, error = %e, "pinned XDP link not reusable (interface re-created?); attaching anew");
                    let _ = std::fs::remove_file(&pin);
                }
            }
        }
        let force_generic = self.force_generic;
        let prog = self.prog()?;
        let (id, mode) = if force_generic {
            let l = prog
                .attach(name, XdpMode::Skb)
                .with_context(|| format!("attaching XDP (generic) to {name}"))?;
            (l, "generic")
        } else {
            match prog.attach(name, XdpMode::Driver) {
                Ok(l) => (l, "native"),
                Err(e) => {
                    tracing::warn!(iface = %name, error = %e, "native XDP failed, using generic XDP");
                    let l = prog
                        .attach(name, XdpMode::Skb)
                        .with_context(|| format!("attaching XDP to {name}"))?;
                    (l, "generic")
                }
            }
        };
        let link: XdpLink = prog.take_link(id)?;
        let fd = FdLink::try_from(link).context("XDP link is not a BPF link")?;
        let fd =
            if self.pinned {
                FdLink::from(fd.pin(&pin).with_context(|| {
                    format!("pinning the XDP link of {name} at {}", pin.display())
                })?)
            } else {
                fd
            };
        self.links.insert(name.to_string(), fd);
        self.modes.retain(|(n, _)| n != name);
        self.modes.push((name.to_string(), mode));
        Ok(())
    }

    /// Starts steering on an interface (at start, or a Pod's veth that appeared while
    /// running): its sockets must be registered at `slot_base ..` (until then what is
    /// Juneau's there is dropped, everything else passes). Returns the handle to give
    /// to [`Steering::detach_iface`].
    pub fn attach_iface(&mut self, i: &SteeredIface) -> Result<IfaceLink> {
        self.configure_iface(i)?;
        match self.attach_program(&i.name) {
            Ok(()) => Ok(IfaceLink {
                name: i.name.clone(),
            }),
            Err(e) => {
                self.forget_iface(i.ifindex);
                Err(e)
            }
        }
    }

    /// Stops steering on an interface (it may already be gone, which detached the
    /// program by itself): unpins and closes its link, clears its redirect-map slots.
    pub fn detach_iface(&mut self, i: &SteeredIface, link: IfaceLink) {
        self.forget_iface(i.ifindex);
        if self.pinned {
            let _ = std::fs::remove_file(link_pin(&self.pin_dir, &link.name));
        }
        drop(self.links.remove(&link.name));
        for q in 0..i.queues {
            let _ = self.xsks.unset(i.slot_base + q);
        }
        self.modes.retain(|(n, _)| n != &i.name);
    }

    /// Steers UDP datagrams to `addr:port` arriving on the uplink to userspace: redirected
    /// packets and notices from other nodes (`redirect_in` in bpf/steer.c).
    /// A later call with another address (taken from the node state) replaces the
    /// earlier one; the same address again changes nothing.
    pub fn listen_redirects(&mut self, addr: Ipv4Addr, port: u16) -> Result<()> {
        if self.redirect_listen == Some((addr, port)) {
            return Ok(());
        }
        let m = self
            .bpf
            .map_mut("redirect_in")
            .ok_or_else(|| anyhow!("steering program has no map redirect_in"))?;
        let mut m: BpfHashMap<&mut MapData, FrontendKey, u8> =
            BpfHashMap::try_from(m).context("map redirect_in")?;
        m.insert(frontend_key(&(addr, port, 17)), 1, 0)
            .with_context(|| format!("steering redirects to {addr}:{port}"))?;
        if let Some(old) = self.redirect_listen.replace((addr, port)) {
            let _ = m.remove(&frontend_key(&(old.0, old.1, 17)));
        }
        Ok(())
    }

    /// The `address:port` redirected packets are steered from, if any.
    pub fn listening_redirects(&self) -> Option<(Ipv4Addr, u16)> {
        self.redirect_listen
    }

    /// Makes `redirect_from` hold exactly `peers`: the nodes whose redirected packets and
    /// notices reach userspace (the program drops the rest as `redirect_not_from_peer`).
    /// New peers are added before old ones are removed; the same set again changes
    /// nothing. More than [`MAX_REDIRECT_PEERS`] is an error and changes nothing.
    pub fn set_redirect_peers(&mut self, peers: &[Ipv4Addr]) -> Result<()> {
        let want: HashSet<Ipv4Addr> = peers.iter().copied().collect();
        if want == self.installed_redirect_from {
            return Ok(());
        }
        if want.len() > MAX_REDIRECT_PEERS {
            bail!(
                "{} redirect peers: the steering program takes at most {MAX_REDIRECT_PEERS}",
                want.len()
            );
        }
        let new: Vec<Ipv4Addr> = want
            .difference(&self.installed_redirect_from)
            .copied()
            .collect();
        for p in new {
            self.redirect_from
                .insert(p.octets(), 1, 0)
                .with_context(|| format!("taking redirects from {p}"))?;
            self.installed_redirect_from.insert(p);
        }
        let gone: Vec<Ipv4Addr> = self
            .installed_redirect_from
            .difference(&want)
            .copied()
            .collect();
        for p in gone {
            let _ = self.redirect_from.remove(&p.octets());
            self.installed_redirect_from.remove(&p);
        }
        Ok(())
    }

    /// Puts an AF_XDP socket into the redirect map at `slot`.
    pub fn register_socket(&mut self, slot: u32, fd: &impl AsRawFd) -> Result<()> {
        self.xsks
            .set(slot, fd.as_raw_fd(), 0)
            .with_context(|| format!("registering AF_XDP socket in slot {slot}"))
    }

    /// Makes the maps match the service table.
    pub fn sync(&mut self, table: &ServiceTable) -> Result<()> {
        let vips: HashSet<Ipv4Addr> = table.vips().collect();
        let (frontends, ranges) = wanted_frontends(table);
        // Add first, remove after, so a VIP moving between entries is never missing;
        // a frontend's ranges before the bit that makes the program read them, and the
        // bit cleared before they go.
        for v in vips.difference(&self.installed_vips) {
            self.vips
                .insert(v.octets(), 1, 0)
                .with_context(|| format!("adding VIP {v}"))?;
        }
        let new: Vec<RangeEntry> = ranges.difference(&self.installed_ranges).copied().collect();
        for r in new {
            self.source_ranges
                .insert(&range_key(&r), 1, 0)
                .with_context(|| format!("adding source range {} of {:?}", r.1, r.0))?;
            self.installed_ranges.insert(r);
        }
        for (f, bits) in &frontends {
            if self.installed_frontends.get(f) != Some(bits) {
                self.frontends
                    .insert(frontend_key(f), bits, 0)
                    .with_context(|| format!("adding frontend {f:?}"))?;
                self.installed_frontends.insert(*f, *bits);
            }
        }
        for v in self.installed_vips.difference(&vips) {
            let _ = self.vips.remove(&v.octets());
        }
        self.installed_frontends.retain(|f, _| {
            let keep = frontends.contains_key(f);
            if !keep {
                let _ = self.frontends.remove(&frontend_key(f));
            }
            keep
        });
        self.installed_ranges.retain(|r| {
            let keep = ranges.contains(r);
            if !keep {
                let _ = self.source_ranges.remove(&range_key(r));
            }
            keep
        });
        self.installed_vips = vips;
        Ok(())
    }

    /// The program's own drop counters, summed over CPUs (since this process loaded
    /// it).
    pub fn drops(&self) -> SteerDrops {
        let sum = |i: u32| -> u64 {
            self.steer_drops
                .get(&i, 0)
                .map(|v| v.iter().sum())
                .unwrap_or(0)
        };
        SteerDrops {
            port_not_exposed: sum(SD_PORT_NOT_EXPOSED),
            unsupported_protocol: sum(SD_UNSUPPORTED_PROTOCOL),
            new_flow_prefix_rate: sum(SD_NEW_FLOW_PREFIX_RATE),
            no_socket: sum(SD_NO_SOCKET),
            redirect_not_from_peer: sum(SD_REDIRECT_NOT_FROM_PEER),
            source_range_denied: sum(SD_SOURCE_RANGE_DENIED),
        }
    }

    /// Sets the new-flow admission on the uplink (`rate` 0: none) and returns its buckets,
    /// which the forwarding workers debit and the program reads. Once per process. The
    /// slots' seed of a previous run (pinned) is kept, so its buckets stay those of the
    /// same prefixes.
    pub fn set_new_flow_admission(
        &mut self,
        limit: crate::admission::Limit,
    ) -> Result<std::sync::Arc<crate::admission::Admission>> {
        let slots = self
            .admit_open
            .take()
            .ok_or_else(|| anyhow!("the new-flow admission is set once per process"))?;
        let kept = self.admit_conf.get(&0, 0).map(|c| c.seed).unwrap_or(0);
        let seed = if kept != 0 { kept } else { random_seed() };
        let admission = crate::admission::Admission::new(slots, seed, limit);
        let conf = AdmitConf {
            rate: limit.rate,
            tolerance_ns: admission.tolerance_ns(),
            seed,
        };
        self.admit_conf
            .set(0, conf, 0)
            .context("writing the new-flow admission (admit_conf)")?;
        Ok(std::sync::Arc::new(admission))
    }

    /// Removes everything a dataplane instance pinned under `pin_dir`: its XDP links
    /// (which detaches the program from every interface, once no process holds them)
    /// and its maps (the flow table is lost), then the directory. Stop the dataplane
    /// first. Returns how many pins were removed; a missing directory is not an error.
    pub fn remove_pins(pin_dir: &Path) -> Result<usize> {
        let entries = match std::fs::read_dir(pin_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e).with_context(|| format!("reading {}", pin_dir.display())),
        };
        let mut n = 0;
        for e in entries {
            let p = e?.path();
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
            n += 1;
        }
        if let Err(e) = std::fs::remove_dir(pin_dir) {
            bail!("removing {}: {e}", pin_dir.display());
        }
        Ok(n)
    }
}

/// The entries of the maps a sync maintains, as a previous run left them: VIPs,
/// frontends with their bits, source ranges, redirect peers.
fn installed_entries(
    vips: &BpfHashMap<MapData, [u8; 4], u8>,
    frontends: &BpfHashMap<MapData, FrontendKey, u8>,
    source_ranges: &LpmTrie<MapData, SourceRangeData, u8>,
    redirect_from: &BpfHashMap<MapData, [u8; 4], u8>,
) -> Result<Installed> {
    let installed_redirect_from = redirect_from
        .keys()
        .filter_map(|k| k.ok())
        .map(Ipv4Addr::from)
        .collect();
    let installed_vips = vips
        .keys()
        .filter_map(|k| k.ok())
        .map(Ipv4Addr::from)
        .collect();
    let installed_frontends = frontends
        .iter()
        .filter_map(|e| e.ok())
        .map(|(k, v)| {
            let f = (Ipv4Addr::from(k.addr), u16::from_be_bytes(k.port), k.proto);
            (f, v)
        })
        .collect();
    // A previous run's ranges must all be known: one left behind would admit a
    // client the new ranges deny.
    let installed_ranges = source_ranges
        .keys()
        .map(|k| {
            let k = k.context("reading the pinned source_ranges")?;
            let d = k.data();
            let f = d.frontend;
            let len = k.prefix_len().saturating_sub(64).min(32) as u8;
            let range = juneau_control::model::SourceRange::new(Ipv4Addr::from(d.saddr), len)
                .context("a pinned source range")?;
            Ok((
                (Ipv4Addr::from(f.addr), u16::from_be_bytes(f.port), f.proto),
                range,
            ))
        })
        .collect::<Result<HashSet<RangeEntry>>>()?;
    Ok((
        installed_vips,
        installed_frontends,
        installed_ranges,
        installed_redirect_from,
    ))
}

/// [`installed_entries`]: VIPs, frontends with their bits, source ranges, redirect peers.
type Installed = (
    HashSet<Ipv4Addr>,
    HashMap<FrontendTuple, u8>,
    HashSet<RangeEntry>,
    HashSet<Ipv4Addr>,
);

/// The `frontends` entries (with their bits) and the `source_ranges` entries a service
/// table wants.
fn wanted_frontends(table: &ServiceTable) -> (HashMap<FrontendTuple, u8>, HashSet<RangeEntry>) {
    let mut frontends = HashMap::new();
    let mut ranges = HashSet::new();
    for s in table.services() {
        let f = (
            s.frontend.vip,
            s.frontend.port,
            s.frontend.protocol.number(),
        );
        let filtered = !s.source_ranges.is_empty();
        frontends.insert(
            f,
            FRONTEND_EXPOSED
                | if filtered { FRONTEND_FILTERED } else { 0 }
                | if s.host_network {
                    FRONTEND_HOST_NETWORK
                } else {
                    0
                },
        );
        ranges.extend(s.source_ranges.iter().map(|r| (f, *r)));
    }
    (frontends, ranges)
}

fn frontend_key(f: &FrontendTuple) -> FrontendKey {
    FrontendKey {
        addr: f.0.octets(),
        port: f.1.to_be_bytes(),
        proto: f.2,
        pad: 0,
    }
}

/// A random, non-zero seed (0 marks a map never configured).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(crate::region::monotonic_ns());
    h.finish() | 1
}

/// Maps the values of one of the program's `BPF_F_MMAPABLE` array maps.
fn map_region<T: Copy + 'static>(bpf: &Ebpf, name: &str) -> Result<Region<T>> {
    let map = bpf
        .map(name)
        .ok_or_else(|| anyhow!("steering program has no map {name}"))?;
    let data: &MapData = match map {
        aya::maps::Map::Array(d) => d,
        _ => bail!("map {name} is not an array"),
    };
    let info = data.info().with_context(|| format!("map {name} info"))?;
    Region::map_bpf_array(
        data.fd().as_fd(),
        info.max_entries() as usize,
        info.value_size() as usize,
    )
    .with_context(|| format!("mapping {name} ({} entries)", info.max_entries()))
}

/// Whether `path` (or, if it does not exist yet, its nearest existing ancestor) is on a
/// BPF filesystem, from `/proc/self/mountinfo`.
pub fn on_bpffs(path: &Path) -> bool {
    let mut p = path.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            return false;
        }
    }
    let Ok(p) = p.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    // Field 5 is the mount point; the file-system type follows " - ".
    let mut best: Option<(usize, bool)> = None;
    for line in info.lines() {
        let mut f = line.split(' ');
        let Some(mnt) = f.nth(4) else { continue };
        let Some((_, rest)) = line.split_once(" - ") else {
            continue;
        };
        let fstype = rest.split(' ').next().unwrap_or("");
        let mnt = Path::new(mnt);
        if p.starts_with(mnt) {
            let depth = mnt.components().count();
            if best.is_none_or(|(d, _)| depth >= d) {
                best = Some((depth, fstype == "bpf"));
            }
        }
    }
    best.is_some_and(|(_, bpf)| bpf)
}

/// Interface indexes of this network namespace.
fn present_ifindexes() -> HashSet<u32> {
    let mut out = HashSet::new();
    if let Ok(dir) = std::fs::read_dir("/sys/class/net") {
        for e in dir.flatten() {
            if let Ok(s) = std::fs::read_to_string(e.path().join("ifindex")) {
                if let Ok(i) = s.trim().parse() {
                    out.insert(i);
                }
            }
        }
    }
    out
}

/// Removes link pins of interfaces that no longer exist (their links are defunct).
fn remove_stale_link_pins(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(iface) = name.strip_prefix("link-") {
            if !Path::new("/sys/class/net").join(iface).exists() {
                tracing::info!(
                    iface,
                    "removing the pinned XDP link of a vanished interface"
                );
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_network_frontend_is_exposed_with_its_bit_and_brings_no_backend_key() {
        use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
        let frontend = |port| Frontend {
            vip: std::net::Ipv4Addr::new(203, 0, 113, 30),
            protocol: Protocol::Tcp,
            port,
        };
        let backend = |ip: [u8; 4]| LocalBackend {
            ip: ip.into(),
            port: 8080,
        };
        let mut host = NodeService::new(frontend(80), vec![backend([10, 0, 0, 2])]);
        host.host_network = true;
        let pod = NodeService::new(frontend(81), vec![backend([10, 244, 1, 5])]);
        let st = NodeState {
            services: vec![host, pod],
            ..Default::default()
        };
        let table = ServiceTable::new(1, &st, &[Vec::new(), Vec::new()]);
        let (f, _) = wanted_frontends(&table);
        let vip = std::net::Ipv4Addr::new(203, 0, 113, 30);
        assert_eq!(f[&(vip, 80, 6)], FRONTEND_EXPOSED | FRONTEND_HOST_NETWORK);
        assert_eq!(f[&(vip, 81, 6)], FRONTEND_EXPOSED);
        let keys = table.backend_keys();
        assert!(keys.contains(&(std::net::Ipv4Addr::new(10, 244, 1, 5), 8080, 6)));
        assert!(!keys.contains(&(std::net::Ipv4Addr::new(10, 0, 0, 2), 8080, 6)));
    }

    #[test]
    fn the_uplinks_entry_holds_up_to_four_and_refuses_more() {
        let up = |i: u32| {
            (
                i,
                IfaceConf {
                    slot_base: 10 * i,
                    queues: 2,
                    role: ROLE_UPLINK,
                },
            )
        };
        assert_eq!(uplink_entry(&[]).unwrap(), UplinkSet::default());
        let e = uplink_entry(&[up(7), up(3)]).unwrap();
        assert_eq!(e.ifindex, [7, 3, 0, 0]);
        assert_eq!(e.conf[1], up(3).1);
        assert_eq!(e.conf[2], IfaceConf::default());
        let four: Vec<_> = (1..=4).map(up).collect();
        assert_eq!(uplink_entry(&four).unwrap().ifindex, [1, 2, 3, 4]);
        let five: Vec<_> = (1..=5).map(up).collect();
        let e = uplink_entry(&five).unwrap_err().to_string();
        assert!(e.contains("5 uplinks") && e.contains("at most 4"), "{e}");
        assert_eq!(std::mem::size_of::<UplinkSet>(), 16 * MAX_UPLINKS);
    }

    #[test]
    fn pin_dirs_off_a_bpf_filesystem_are_recognised() {
        // procfs and a path that does not exist (its nearest ancestor is `/`).
        assert!(!on_bpffs(Path::new("/proc/self")));
        assert!(!on_bpffs(Path::new("/nonexistent-juneau/a/b")));
    }

    /// A private bpffs, unmounted (pins and all) on drop.
    pub(super) struct Bpffs(pub(super) tempfile::TempDir);

    impl Bpffs {
        pub(super) fn new() -> Self {
            let d = tempfile::tempdir().unwrap();
            let ok = std::process::Command::new("mount")
                .args(["-t", "bpf", "bpf"])
                .arg(d.path())
                .status()
                .unwrap()
                .success();
            assert!(ok, "mounting a bpffs (needs root)");
            Bpffs(d)
        }
    }

    impl Drop for Bpffs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(self.0.path())
                .status();
        }
    }

    fn program_id(s: &mut Steering) -> u32 {
        s.prog().unwrap().info().unwrap().id()
    }

    /// A restart of the same build over kept maps reuses the pinned, verified program
    /// (the verifier's ~2 s is what a restarted node's connections would wait for); a
    /// changed flow capacity (maps replaced) loads it again. Loads BPF: needs root.
    #[test]
    fn a_restart_of_the_same_build_reuses_the_verified_program() {
        let fs = Bpffs::new();
        let pin = fs.0.path().join("node");
        let (mut first, _, replaced) = Steering::load(&pin, 1024, 1, false).unwrap();
        assert!(replaced.is_none() && !first.program_reused());
        let id = program_id(&mut first);
        drop(first);
        let (mut again, _, _) = Steering::load(&pin, 1024, 1, false).unwrap();
        assert!(again.program_reused());
        assert_eq!(program_id(&mut again), id, "the same kernel program");
        // It runs: a frame to no VIP passes.
        again.configure_test_uplink().unwrap();
        let frame = vec![0u8; 64];
        let (verdict, _) = again.test_run(&frame, 1).unwrap();
        assert_eq!(verdict, 2, "XDP_PASS");
        drop(again);
        let (mut other, _, replaced) = Steering::load(&pin, 4096, 1, false).unwrap();
        assert!(replaced.is_some(), "another capacity replaces the maps");
        assert!(!other.program_reused());
        assert_ne!(program_id(&mut other), id);
    }

    /// The new-flow admission's buckets and their slots' seed are pinned: a restarted
    /// dataplane finds a prefix's bucket as the previous run left it (empty here), while
    /// the buckets of other prefixes are untouched. Loads BPF: needs root.
    #[test]
    fn a_restart_keeps_the_admission_buckets_of_each_prefix() {
        use crate::admission::{key_v4, Limit};
        let fs = Bpffs::new();
        let pin = fs.0.path().join("node");
        let limit = Limit { rate: 1, burst: 1 };
        let (emptied, other) = (key_v4(0xcb00_7109), key_v4(0xc633_6407));
        let (mut first, _, _) = Steering::load(&pin, 1024, 1, false).unwrap();
        let buckets = first.set_new_flow_admission(limit).unwrap();
        let now = crate::region::monotonic_ns();
        assert!(buckets.admit(emptied, now));
        assert!(
            first.set_new_flow_admission(limit).is_err(),
            "set once per process"
        );
        drop((first, buckets));
        let (mut again, _, _) = Steering::load(&pin, 1024, 1, false).unwrap();
        let buckets = again.set_new_flow_admission(limit).unwrap();
        assert!(!buckets.admit(emptied, now), "the same slot, still empty");
        assert!(buckets.admit(other, now));
    }

    /// UDP to the node's redirect address and port reaches userspace from a peer node
    /// only: from any other source the program drops it as `redirect_not_from_peer`; a
    /// peer that left the set is a stranger again. Loads BPF: needs root.
    #[test]
    fn redirects_from_a_node_that_is_no_peer_are_dropped_in_the_program() {
        use juneau_tests::frames::{ethernet_ipv4, ipv4_header};
        let dir = tempfile::tempdir().unwrap();
        let (mut st, _, _) = Steering::load(dir.path(), 1024, 1, false)
            .expect("loading the steering program (run as root)");
        st.configure_test_uplink().unwrap();
        let node = Ipv4Addr::new(10, 0, 0, 1);
        let peer = Ipv4Addr::new(10, 0, 0, 2);
        st.listen_redirects(node, 7411).unwrap();
        st.set_redirect_peers(&[peer]).unwrap();
        let from = |src: Ipv4Addr| {
            let mut udp = vec![0u8; 40];
            udp[0..2].copy_from_slice(&7411u16.to_be_bytes());
            udp[2..4].copy_from_slice(&7411u16.to_be_bytes());
            udp[4..6].copy_from_slice(&40u16.to_be_bytes());
            ethernet_ipv4(
                [2; 6],
                [4; 6],
                ipv4_header(src.octets(), node.octets(), 17, udp.len()),
                &udp,
            )
        };
        const XDP_DROP: u32 = 1;
        let (v, _) = st
            .test_run(&from(Ipv4Addr::new(203, 0, 113, 9)), 1)
            .unwrap();
        assert_eq!(v, XDP_DROP);
        assert_eq!(st.drops().redirect_not_from_peer, 1);
        assert_eq!(st.drops().no_socket, 0);
        // The peer's datagram goes to userspace: no socket in this test, so the
        // program counts it as no_socket, not as a stranger's.
        st.test_run(&from(peer), 1).unwrap();
        assert_eq!(st.drops().redirect_not_from_peer, 1);
        assert_eq!(st.drops().no_socket, 1);
        // The same set again changes nothing; an empty one makes the peer a stranger.
        st.set_redirect_peers(&[peer, peer]).unwrap();
        st.test_run(&from(peer), 1).unwrap();
        assert_eq!(st.drops().no_socket, 2);
        st.set_redirect_peers(&[]).unwrap();
        st.test_run(&from(peer), 1).unwrap();
        assert_eq!(st.drops().redirect_not_from_peer, 2);
        // Too many peers is refused and changes nothing.
        let many: Vec<Ipv4Addr> = (0..=MAX_REDIRECT_PEERS as u32)
            .map(|i| Ipv4Addr::from(0x0a01_0000 + i))
            .collect();
        let e = st.set_redirect_peers(&many).unwrap_err().to_string();
        assert!(e.contains("at most 8192"), "{e}");
        st.set_redirect_peers(&[peer]).unwrap();
        st.test_run(&from(peer), 1).unwrap();
        assert_eq!(st.drops().no_socket, 3);
    }

    /// A mismatched map that holds no flows is replaced alone (an upgrade that grows
    /// the drop counters keeps the flows); any flow map takes the others with it.
    #[test]
    fn only_a_mismatched_flow_map_replaces_the_flow_tables() {
        let m = |map| Mismatch {
            map,
            reason: String::new(),
        };
        assert_eq!(pins_to_replace(&[]), Vec::<&str>::new());
        assert_eq!(pins_to_replace(&[m("steer_drops")]), ["steer_drops"]);
        assert!(!m("steer_drops").holds_flows());
        let all = pins_to_replace(&[m("admit_conf"), m("flow_index")]);
        assert_eq!(
            all,
            [
                "admit_conf",
                "fast_slots",
                "flow_index",
                "flow_meta",
                "flow_records",
                "flows6"
            ]
        );
    }

    /// Pinned maps of another size are replaced on load; the flows survive when only a
    /// map without flows changed. Loads BPF: needs root.
    #[test]
    fn a_grown_counter_map_is_replaced_without_losing_the_flow_tables() {
        let fs = Bpffs::new();
        let pin = fs.0.path().join("node");
        let (first, _, _) = Steering::load(&pin, 1024, 1, false).unwrap();
        drop(first);
        // An older build's smaller drop counters.
        let old = pin.join("steer_drops");
        std::fs::remove_file(&old).unwrap();
        let ok = std::process::Command::new("bpftool")
            .args(["map", "create"])
            .arg(&old)
            .args([
                "type",
                "percpu_array",
                "key",
                "4",
                "value",
                "8",
                "entries",
                "4",
                "name",
                "steer_drops",
            ])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "bpftool map create (bpftool is a test prerequisite)");
        let (mut again, _, replaced) = Steering::load(&pin, 1024, 1, false).unwrap();
        assert!(replaced.is_none(), "flows kept: {replaced:?}");
        assert!(!again.program_reused(), "its maps changed: verified again");
        again.configure_test_uplink().unwrap();
        assert_eq!(again.drops(), SteerDrops::default());
    }

    #[test]
    fn index_size_matches_the_flow_table() {
        for cap in [1, 3, 1000, 1 << 20] {
            assert!(index_slots(cap).is_power_of_two());
            assert!(index_slots(cap) >= 4 * cap);
        }
    }
}
