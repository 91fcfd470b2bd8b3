//! The steering program's IPv6 maps (issue #28): `frontends6` and `vips6`, which
//! [`Steering::sync6`] keeps equal to the IPv6 frontends served here, and `flows6`, the
//! IPv6 flows userspace holds, written through [`Flows6`] by the forwarding workers
//! (each flow's forward and reverse key while it lives). See bpf/steer.c for what the
//! program does with them, and docs/ipv6-steering.md.

use std::collections::HashSet;
use std::net::Ipv6Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use aya::maps::{HashMap as BpfHashMap, IterableMap, MapData};

use super::Steering;
use crate::abi::{FLOW6_KEY_BYTES, FRONTEND6_KEY_BYTES, FRONTEND_EXPOSED};
use crate::proto::{IPPROTO_TCP, IPPROTO_UDP};

/// Most entries of `frontends6` (and of `vips6`), as bpf/steer.c sizes them.
pub const MAX_FRONTENDS6: usize = 65_536;

/// An IPv6 frontend as [`Steering::sync6`] takes it: VIP, IP protocol number, port
/// (host order).
pub type Frontend6 = (Ipv6Addr, u8, u16);

/// A `frontends6` key (`struct frontend6_key`): VIP and port in network order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
pub(super) struct Frontend6Key {
    addr: [u8; 16],
    port: [u8; 2],
    proto: u8,
    pad: u8,
}

// SAFETY: `repr(C)` byte arrays and bytes, 20 bytes without padding, matching
// `struct frontend6_key`.
unsafe impl aya::Pod for Frontend6Key {}
const _: () = assert!(std::mem::size_of::<Frontend6Key>() == FRONTEND6_KEY_BYTES);

impl Frontend6Key {
    fn of(f: &Frontend6) -> Self {
        Frontend6Key {
            addr: f.0.octets(),
            port: f.2.to_be_bytes(),
            proto: f.1,
            pad: 0,
        }
    }

    fn frontend(&self) -> Frontend6 {
        (
            Ipv6Addr::from(self.addr),
            self.proto,
            u16::from_be_bytes(self.port),
        )
    }
}

/// A key of `flows6` (`struct flow6_key`): an IPv6 flow's 5-tuple as a packet of one
/// direction holds it, in network order — the forward key (client -> VIP) or the reverse
/// key (backend -> client).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct Flow6MapKey {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// Source port, network order.
    pub sport: [u8; 2],
    /// Destination port, network order.
    pub dport: [u8; 2],
    /// IP protocol number (TCP or UDP).
    pub proto: u8,
    /// Zero.
    pub pad: [u8; 3],
}

// SAFETY: `repr(C)` byte arrays and a byte, 40 bytes without padding, matching
// `struct flow6_key`.
unsafe impl aya::Pod for Flow6MapKey {}
const _: () = assert!(std::mem::size_of::<Flow6MapKey>() == FLOW6_KEY_BYTES);

impl Flow6MapKey {
    /// The key of a packet from `src:sport` to `dst:dport` (ports in host order).
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr, sport: u16, dport: u16, proto: u8) -> Self {
        Flow6MapKey {
            src: src.octets(),
            dst: dst.octets(),
            sport: sport.to_be_bytes(),
            dport: dport.to_be_bytes(),
            proto,
            pad: [0; 3],
        }
    }
}

/// `BPF_MAP_UPDATE_ELEM` (`enum bpf_cmd`).
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
/// `BPF_MAP_DELETE_ELEM`.
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;

/// `union bpf_attr` as the map element commands read it.
#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// One map element command on `fd` (`value`: 0 for a delete).
fn map_elem(
    cmd: libc::c_long,
    fd: BorrowedFd<'_>,
    key: &Flow6MapKey,
    value: u64,
) -> std::io::Result<()> {
    let attr = MapElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        pad: 0,
        key: key as *const Flow6MapKey as u64,
        value,
        flags: 0, // BPF_ANY
    };
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the map element commands (the
    // kernel reads `size_of::<MapElemAttr>()` bytes of it); `key` points to a live
    // 40-byte key, `value` is 0 or points to a live u32 the caller owns, both read by
    // the kernel during the call only.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            &attr as *const MapElemAttr,
            std::mem::size_of::<MapElemAttr>() as libc::c_uint,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A handle on `flows6` for the forwarding workers: cheap to clone (one per worker),
/// `Send` and `Sync`; its writes are `bpf()` calls without a lock (the kernel's hash map
/// takes its own per-bucket locks), one per new or ended IPv6 flow, never per packet.
#[derive(Debug, Clone)]
pub struct Flows6 {
    map: Arc<BpfHashMap<MapData, Flow6MapKey, u32>>,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Flows6>()
};

impl Flows6 {
    pub(super) fn new(map: BpfHashMap<MapData, Flow6MapKey, u32>) -> Self {
        Flows6 { map: Arc::new(map) }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.map.map().fd().as_fd()
    }

    /// Records that forwarding worker `worker` holds the flow of packets with `key`
    /// (replacing what it held).
    pub fn insert(&self, key: &Flow6MapKey, worker: u32) -> Result<()> {
        map_elem(
            BPF_MAP_UPDATE_ELEM,
            self.fd(),
            key,
            &worker as *const u32 as u64,
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::E2BIG) => anyhow::anyhow!(
                "flows6 is full ({} keys: two per flow of --flow-capacity)",
                self.capacity()
            ),
            _ => anyhow::Error::from(e),
        })
        .with_context(|| format!("adding IPv6 flow key {}", describe(key)))
    }

    /// Forgets `key` (a key not held is no error).
    pub fn remove(&self, key: &Flow6MapKey) -> Result<()> {
        match map_elem(BPF_MAP_DELETE_ELEM, self.fd(), key, 0) {
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
                Err(e).with_context(|| format!("removing IPv6 flow key {}", describe(key)))
            }
            _ => Ok(()),
        }
    }

    /// Every key held, with its worker (for a restarted dataplane).
    pub fn entries(&self) -> Result<Vec<(Flow6MapKey, u32)>> {
        self.map
            .iter()
            .map(|e| e.context("reading flows6"))
            .collect()
    }

    /// Keys the map holds at most.
    pub fn capacity(&self) -> u32 {
        self.map.map().info().map(|i| i.max_entries()).unwrap_or(0)
    }
}

/// One forwarding worker's IPv6 flow table publishing its keys into `flows6`
/// ([`crate::flow6::Flow6Mirror`]). A refused key is logged (the first one, then every
/// 1000th) and the flow is not created: the engine counts it as `flow_not_published`.
#[derive(Debug)]
pub struct Flows6Mirror {
    flows: Flows6,
    worker: u32,
    refused: u64,
}

impl Flows6Mirror {
    /// The mirror of worker `worker`'s table.
    pub fn new(flows: Flows6, worker: u32) -> Self {
        Flows6Mirror {
            flows,
            worker,
            refused: 0,
        }
    }
}

/// The map's form of an engine key.
pub fn map_key(k: &crate::flow6::Flow6Key) -> Flow6MapKey {
    Flow6MapKey::new(k.src.into(), k.dst.into(), k.src_port, k.dst_port, k.proto)
}

/// The engine's form of a map key.
pub fn flow_key(k: &Flow6MapKey) -> crate::flow6::Flow6Key {
    crate::flow6::Flow6Key {
        src: k.src,
        dst: k.dst,
        src_port: u16::from_be_bytes(k.sport),
        dst_port: u16::from_be_bytes(k.dport),
        proto: k.proto,
    }
}

impl crate::flow6::Flow6Mirror for Flows6Mirror {
    fn publish(&mut self, key: &crate::flow6::Flow6Key) -> bool {
        match self.flows.insert(&map_key(key), self.worker) {
            Ok(()) => true,
            Err(e) => {
                if self.refused.is_multiple_of(1000) {
                    tracing::warn!(error = %format!("{e:#}"), refused = self.refused + 1, "an IPv6 flow's key was refused by the steering map; the flow is not created");
                }
                self.refused += 1;
                false
            }
        }
    }

    fn withdraw(&mut self, key: &crate::flow6::Flow6Key) {
        if let Err(e) = self.flows.remove(&map_key(key)) {
            tracing::warn!(error = %format!("{e:#}"), "removing an ended IPv6 flow's key failed");
        }
    }
}

/// A key as an operator reads it: `[src]:sport -> [dst]:dport/proto`.
fn describe(k: &Flow6MapKey) -> String {
    format!(
        "[{}]:{} -> [{}]:{}/{}",
        Ipv6Addr::from(k.src),
        u16::from_be_bytes(k.sport),
        Ipv6Addr::from(k.dst),
        u16::from_be_bytes(k.dport),
        k.proto
    )
}

/// What a previous run left in `vips6` and `frontends6`.
pub(super) fn installed6(
    vips6: &BpfHashMap<MapData, [u8; 16], u8>,
    frontends6: &BpfHashMap<MapData, Frontend6Key, u8>,
) -> Result<(HashSet<Ipv6Addr>, HashSet<Frontend6>)> {
    let vips = vips6
        .keys()
        .map(|k| Ok(Ipv6Addr::from(k.context("reading the pinned vips6")?)))
        .collect::<Result<_>>()?;
    let frontends = frontends6
        .keys()
        .map(|k| Ok(k.context("reading the pinned frontends6")?.frontend()))
        .collect::<Result<_>>()?;
    Ok((vips, frontends))
}

/// The frontends `sync6` was given, checked: TCP or UDP only, at most
/// [`MAX_FRONTENDS6`].
fn wanted6(frontends: &[Frontend6]) -> Result<HashSet<Frontend6>> {
    if let Some((vip, proto, port)) = frontends
        .iter()
        .find(|f| f.1 != IPPROTO_TCP && f.1 != IPPROTO_UDP)
    {
        bail!("IPv6 frontend [{vip}]:{port} has IP protocol {proto}: only TCP (6) and UDP (17) are steered");
    }
    let want: HashSet<Frontend6> = frontends.iter().copied().collect();
    if want.len() > MAX_FRONTENDS6 {
        bail!(
            "{} IPv6 frontends: the steering program takes at most {MAX_FRONTENDS6}",
            want.len()
        );
    }
    Ok(want)
}

impl Steering {
    /// Makes `frontends6` hold exactly `frontends` and `vips6` their VIPs (the
    /// difference only; VIPs added first and removed last, so a frontend's VIP is never
    /// missing). A protocol other than TCP or UDP, or more than [`MAX_FRONTENDS6`]
    /// frontends, is an error and changes nothing.
    pub fn sync6(&mut self, frontends: &[Frontend6]) -> Result<()> {
        let want = wanted6(frontends)?;
        let vips: HashSet<Ipv6Addr> = want.iter().map(|f| f.0).collect();
        for v in vips.difference(&self.installed_vips6) {
            self.vips6
                .insert(v.octets(), 1, 0)
                .with_context(|| format!("adding IPv6 VIP {v}"))?;
        }
        self.installed_vips6.extend(vips.iter().copied());
        let new: Vec<Frontend6> = want
            .difference(&self.installed_frontends6)
            .copied()
            .collect();
        for f in new {
            self.frontends6
                .insert(Frontend6Key::of(&f), FRONTEND_EXPOSED, 0)
                .with_context(|| format!("adding IPv6 frontend [{}]:{}/{}", f.0, f.2, f.1))?;
            self.installed_frontends6.insert(f);
        }
        self.installed_frontends6.retain(|f| {
            let keep = want.contains(f);
            if !keep {
                let _ = self.frontends6.remove(&Frontend6Key::of(f));
            }
            keep
        });
        self.installed_vips6.retain(|v| {
            let keep = vips.contains(v);
            if !keep {
                let _ = self.vips6.remove(&v.octets());
            }
            keep
        });
        Ok(())
    }

    /// The handle on `flows6` the forwarding workers write their IPv6 flows' keys
    /// through (clone it for each).
    pub fn flows6(&self) -> &Flows6 {
        &self.flows6
    }

    /// Whether `vip` is an IPv6 VIP the steering maps hold (at start: a previous run's).
    pub fn is_vip6(&self, vip: &[u8; 16]) -> bool {
        self.installed_vips6.contains(&Ipv6Addr::from(*vip))
    }
}

#[cfg(test)]
mod tests;
