//! Loads and feeds the XDP steering program (`bpf/steer.c`, compiled by `build.rs`).
//!
//! The program is attached (native XDP, falling back to generic) to the uplink and every
//! Pod-facing interface through BPF links, which the kernel detaches when this process
//! exits, however it exits. Its maps follow the service table: `vips` holds every VIP
//! served here, `backends` every `(backend ip, port, proto)`, `backend_ips` every backend
//! address; [`Steering::sync`] applies the difference after each state change.

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

use anyhow::{anyhow, Context, Result};
use aya::maps::{HashMap as BpfHashMap, MapData, XskMap};
use aya::programs::xdp::XdpLinkId;
use aya::programs::{Xdp, XdpMode};
use aya::Ebpf;

use crate::services::ServiceTable;

/// The compiled steering program.
static STEER_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/steer.o"));

const ROLE_UPLINK: u32 = 0;
const ROLE_POD: u32 = 1;

#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct IfaceConf {
    slot_base: u32,
    queues: u32,
    role: u32,
}

// SAFETY: plain `repr(C)` integers without padding, matching `struct iface_conf`.
unsafe impl aya::Pod for IfaceConf {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
struct BackendKey {
    addr: [u8; 4],
    port: [u8; 2],
    proto: u8,
    pad: u8,
}

// SAFETY: `repr(C)` byte arrays and bytes, 8 bytes without padding, matching
// `struct backend_key`.
unsafe impl aya::Pod for BackendKey {}

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

/// The loaded, attached steering program and its maps.
pub struct Steering {
    bpf: Ebpf,
    force_generic: bool,
    ifaces: BpfHashMap<MapData, u32, IfaceConf>,
    xsks: XskMap<MapData>,
    vips: BpfHashMap<MapData, [u8; 4], u8>,
    backends: BpfHashMap<MapData, BackendKey, u8>,
    backend_ips: BpfHashMap<MapData, [u8; 4], u8>,
    installed_vips: HashSet<Ipv4Addr>,
    installed_backends: HashSet<(Ipv4Addr, u16, u8)>,
    installed_backend_ips: HashSet<Ipv4Addr>,
    /// The mode each interface was attached in.
    pub modes: Vec<(String, &'static str)>,
}

impl std::fmt::Debug for Steering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steering")
            .field("vips", &self.installed_vips.len())
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

impl Steering {
    /// Loads the program and attaches it to the interfaces. The AF_XDP socket of RX
    /// queue `q` of an interface goes into the redirect map at `slot_base + q` (see
    /// [`Steering::register_socket`]).
    pub fn attach(ifaces_in: &[SteeredIface], force_generic: bool) -> Result<Self> {
        let mut bpf = Ebpf::load(STEER_OBJ).context("loading the XDP steering program")?;
        let mut ifaces: BpfHashMap<MapData, u32, IfaceConf> = take(&mut bpf, "ifaces")?;
        for i in ifaces_in {
            let conf = IfaceConf {
                slot_base: i.slot_base,
                queues: i.queues,
                role: if i.uplink { ROLE_UPLINK } else { ROLE_POD },
            };
            ifaces.insert(i.ifindex, conf, 0)?;
        }
        let xsks: XskMap<MapData> = take(&mut bpf, "xsks")?;
        let vips = take(&mut bpf, "vips")?;
        let backends = take(&mut bpf, "backends")?;
        let backend_ips = take(&mut bpf, "backend_ips")?;
        let prog: &mut Xdp = bpf
            .program_mut("juneau_steer")
            .ok_or_else(|| anyhow!("no program juneau_steer"))?
            .try_into()?;
        prog.load().context("verifying the XDP steering program")?;
        // The program must stay in the map-owning object; maps were taken out above and
        // stay valid while `bpf` (owning the program and its links) lives.
        let mut st = Steering {
            bpf,
            force_generic,
            ifaces,
            xsks,
            vips,
            backends,
            backend_ips,
            installed_vips: HashSet::new(),
            installed_backends: HashSet::new(),
            installed_backend_ips: HashSet::new(),
            modes: Vec::new(),
        };
        for i in ifaces_in {
            st.attach_program(&i.name)?;
        }
        Ok(st)
    }

    fn attach_program(&mut self, name: &str) -> Result<XdpLinkId> {
        let prog: &mut Xdp = self
            .bpf
            .program_mut("juneau_steer")
            .ok_or_else(|| anyhow!("no program juneau_steer"))?
            .try_into()?;
        let (link, mode) = if self.force_generic {
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
        self.modes.retain(|(n, _)| n != name);
        self.modes.push((name.to_string(), mode));
        Ok(link)
    }

    /// Starts steering on an interface that appeared while running (a Pod's veth): its
    /// sockets must already be registered at `slot_base ..` (until then the program
    /// passes its packets to the kernel). Returns the link to give to
    /// [`Steering::detach_iface`].
    pub fn attach_iface(&mut self, i: &SteeredIface) -> Result<XdpLinkId> {
        let conf = IfaceConf {
            slot_base: i.slot_base,
            queues: i.queues,
            role: if i.uplink { ROLE_UPLINK } else { ROLE_POD },
        };
        self.ifaces.insert(i.ifindex, conf, 0)?;
        match self.attach_program(&i.name) {
            Ok(l) => Ok(l),
            Err(e) => {
                let _ = self.ifaces.remove(&i.ifindex);
                Err(e)
            }
        }
    }

    /// Stops steering on an interface (it may already be gone, which detached the
    /// program by itself) and clears its redirect-map slots.
    pub fn detach_iface(&mut self, i: &SteeredIface, link: XdpLinkId) {
        let _ = self.ifaces.remove(&i.ifindex);
        if let Some(prog) = self.bpf.program_mut("juneau_steer") {
            if let Ok(prog) = <&mut Xdp>::try_from(prog) {
                if let Err(e) = prog.detach(link) {
                    tracing::debug!(iface = %i.name, error = %e, "detaching XDP (interface already gone?)");
                }
            }
        }
        for q in 0..i.queues {
            let _ = self.xsks.unset(i.slot_base + q);
        }
        self.modes.retain(|(n, _)| n != &i.name);
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
        let backends = table.backend_keys();
        let ips: HashSet<Ipv4Addr> = backends.iter().map(|b| b.0).collect();
        // Add first, remove after, so a VIP moving between entries is never missing.
        for v in vips.difference(&self.installed_vips) {
            self.vips
                .insert(v.octets(), 1, 0)
                .with_context(|| format!("adding VIP {v}"))?;
        }
        for b in backends.difference(&self.installed_backends) {
            self.backends
                .insert(key(b), 1, 0)
                .with_context(|| format!("adding backend {b:?}"))?;
        }
        for ip in ips.difference(&self.installed_backend_ips) {
            self.backend_ips.insert(ip.octets(), 1, 0)?;
        }
        for v in self.installed_vips.difference(&vips) {
            let _ = self.vips.remove(&v.octets());
        }
        for b in self.installed_backends.difference(&backends) {
            let _ = self.backends.remove(&key(b));
        }
        for ip in self.installed_backend_ips.difference(&ips) {
            let _ = self.backend_ips.remove(&ip.octets());
        }
        self.installed_vips = vips;
        self.installed_backends = backends;
        self.installed_backend_ips = ips;
        Ok(())
    }
}

fn key(b: &(Ipv4Addr, u16, u8)) -> BackendKey {
    BackendKey {
        addr: b.0.octets(),
        port: b.1.to_be_bytes(),
        proto: b.2,
        pad: 0,
    }
}
