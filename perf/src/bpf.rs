//! Loading the harness's XDP programs (compiled from `perf/bpf/*.c` by build.rs) with aya,
//! inside a given network namespace.
//!
//! XDP attachments are bpf_link file descriptors: attaching must happen in the interface's
//! namespace (the kernel resolves the ifindex there), so it runs on a short-lived thread
//! that joined that namespace; closing the link (dropping the returned object) detaches it
//! from anywhere.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

use anyhow::{anyhow, bail, Context, Result};
use aya::maps::{Array, HashMap};
use aya::programs::{Xdp, XdpMode};
use aya::Ebpf;

/// The pass program object (embedded).
pub static PASS_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pass.o"));
/// The XDP DNAT baseline object (embedded).
pub static XDP_DNAT_OBJ: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdp_dnat.o"));
/// The AF_XDP steering program for the l2fwd baseline (embedded).
pub static XSK_STEER_OBJ: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xsk_steer.o"));

/// Runs `f` on a thread that has joined network namespace `ns` (by name, as `ip netns`).
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let path = format!("/var/run/netns/{ns}");
    let handle = std::thread::spawn(move || -> Result<T> {
        let file = File::open(&path).with_context(|| format!("opening {path}"))?;
        // SAFETY: setns on a valid namespace fd; it changes only this thread's namespace.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            bail!("setns({path}): {}", std::io::Error::last_os_error());
        }
        f()
    });
    handle
        .join()
        .map_err(|_| anyhow!("thread in netns {ns} panicked"))?
}

fn ifindex(iface: &str) -> Result<u32> {
    let c = std::ffi::CString::new(iface)?;
    // SAFETY: a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no interface {iface} in this namespace");
    }
    Ok(idx)
}

/// Loads (verifies) program `prog` of `bpf`.
fn load_program<'b>(bpf: &'b mut Ebpf, prog: &str) -> Result<&'b mut Xdp> {
    let p: &mut Xdp = bpf
        .program_mut(prog)
        .with_context(|| format!("program {prog} missing"))?
        .try_into()?;
    p.load().with_context(|| format!("loading {prog}"))?;
    Ok(p)
}

fn attach(bpf: &mut Ebpf, prog: &str, iface: &str) -> Result<()> {
    load_program(bpf, prog)?
        .attach(iface, XdpMode::Driver)
        .with_context(|| format!("attaching {prog} to {iface} (native XDP)"))?;
    Ok(())
}

/// A pass-everything XDP program, so that XDP_REDIRECT into this veth's peer is delivered.
pub struct PassProgram {
    _bpf: Ebpf,
}

impl PassProgram {
    /// Attaches `xdp_pass` to `iface` in namespace `ns`.
    pub fn attach(ns: &str, iface: &str) -> Result<PassProgram> {
        let iface = iface.to_string();
        in_netns(ns, move || {
            let mut bpf = Ebpf::load(PASS_OBJ).context("loading pass.o")?;
            attach(&mut bpf, "xdp_pass", &iface)?;
            Ok(PassProgram { _bpf: bpf })
        })
    }
}

/// Addresses the XDP DNAT baseline needs.
#[derive(Debug, Clone)]
pub struct DnatConfig {
    /// Node's client-facing interface.
    pub client_iface: String,
    /// Node's backend-facing interface.
    pub backend_iface: String,
    /// MAC of the node's client-facing interface.
    pub node_client_mac: [u8; 6],
    /// MAC of the client.
    pub client_mac: [u8; 6],
    /// MAC of the node's backend-facing interface.
    pub node_backend_mac: [u8; 6],
    /// MAC of the backend.
    pub backend_mac: [u8; 6],
    /// Services: (vip, port) -> (backend ip, backend port).
    pub services: Vec<((Ipv4Addr, u16), (Ipv4Addr, u16))>,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct SvcKey {
    vip: u32,
    port: u16,
    pad: u16,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct SvcVal {
    ring_id: u32,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct BackendC {
    ip: u32,
    port: u16,
    pad: u16,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct LinkCfg {
    client_ifindex: u32,
    backend_ifindex: u32,
    node_client_mac: [u8; 6],
    client_mac: [u8; 6],
    node_backend_mac: [u8; 6],
    backend_mac: [u8; 6],
}
// SAFETY: plain #[repr(C)] structs of integers with no padding holes that matter to BPF.
unsafe impl aya::Pod for SvcKey {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcVal {}
// SAFETY: as above.
unsafe impl aya::Pod for BackendC {}
// SAFETY: as above.
unsafe impl aya::Pod for LinkCfg {}

const RING_SIZE: u32 = 64;

fn be32(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

/// The in-kernel XDP DNAT baseline, attached on both node interfaces.
pub struct XdpDnat {
    _bpf: Ebpf,
}

impl XdpDnat {
    /// Loads and configures the program in the node namespace `ns`.
    pub fn attach(ns: &str, cfg: DnatConfig) -> Result<XdpDnat> {
        in_netns(ns, move || {
            let client = ifindex(&cfg.client_iface)?;
            let backend = ifindex(&cfg.backend_iface)?;
            let mut bpf = load_xdp_dnat(&cfg, client, backend)?;
            attach(&mut bpf, "xdp_dnat_in", &cfg.client_iface)?;
            attach(&mut bpf, "xdp_dnat_out", &cfg.backend_iface)?;
            Ok(XdpDnat { _bpf: bpf })
        })
    }
}

/// `xdp_dnat.o` loaded (not attached) with its maps filled from `cfg`, the interfaces
/// given by index.
fn load_xdp_dnat(cfg: &DnatConfig, client_ifindex: u32, backend_ifindex: u32) -> Result<Ebpf> {
    let mut bpf = Ebpf::load(XDP_DNAT_OBJ).context("loading xdp_dnat.o")?;
    {
        let mut links: Array<_, LinkCfg> = Array::try_from(bpf.map_mut("LINKS").context("LINKS")?)?;
        links.set(
            0,
            LinkCfg {
                client_ifindex,
                backend_ifindex,
                node_client_mac: cfg.node_client_mac,
                client_mac: cfg.client_mac,
                node_backend_mac: cfg.node_backend_mac,
                backend_mac: cfg.backend_mac,
            },
            0,
        )?;
    }
    for (ring_id, ((vip, vport), (bip, bport))) in cfg.services.iter().enumerate() {
        let ring_id = ring_id as u32;
        {
            let mut rings: Array<_, BackendC> =
                Array::try_from(bpf.map_mut("RINGS").context("RINGS")?)?;
            for slot in 0..RING_SIZE {
                rings.set(
                    ring_id * RING_SIZE + slot,
                    BackendC {
                        ip: be32(*bip),
                        port: bport.to_be(),
                        pad: 0,
                    },
                    0,
                )?;
            }
        }
        {
            let mut svcs: HashMap<_, SvcKey, SvcVal> =
                HashMap::try_from(bpf.map_mut("SERVICES").context("SERVICES")?)?;
            svcs.insert(
                SvcKey {
                    vip: be32(*vip),
                    port: vport.to_be(),
                    pad: 0,
                },
                SvcVal { ring_id },
                0,
            )?;
        }
        {
            let mut rev: HashMap<_, SvcKey, SvcKey> =
                HashMap::try_from(bpf.map_mut("REVERSE").context("REVERSE")?)?;
            rev.insert(
                SvcKey {
                    vip: be32(*bip),
                    port: bport.to_be(),
                    pad: 0,
                },
                SvcKey {
                    vip: be32(*vip),
                    port: vport.to_be(),
                    pad: 0,
                },
                0,
            )?;
        }
    }
    Ok(bpf)
}

/// One of the harness's XDP programs loaded for `BPF_PROG_TEST_RUN` only (nothing
/// attached, nothing sent): the XDP DNAT baseline's forward program, or `xdp_pass` (the
/// test run's own overhead), for per-packet costs beside the steering program's
/// (`examples/xdp_cost.rs`).
pub struct TestRunProgram {
    bpf: Ebpf,
    name: &'static str,
}

impl TestRunProgram {
    /// `xdp_dnat_in` with `cfg`'s services; both interfaces are the loopback.
    pub fn xdp_dnat(cfg: &DnatConfig) -> Result<TestRunProgram> {
        Self::loaded(load_xdp_dnat(cfg, 1, 1)?, "xdp_dnat_in")
    }

    /// `xdp_pass`: returns XDP_PASS and does nothing else.
    pub fn pass() -> Result<TestRunProgram> {
        Self::loaded(Ebpf::load(PASS_OBJ).context("loading pass.o")?, "xdp_pass")
    }

    fn loaded(mut bpf: Ebpf, name: &'static str) -> Result<TestRunProgram> {
        load_program(&mut bpf, name)?;
        Ok(TestRunProgram { bpf, name })
    }

    /// One run of the program on `frame`: its action and the kernel's time.
    pub fn run(&self, frame: &[u8]) -> Result<(u32, std::time::Duration)> {
        use aya::programs::{TestRun, TestRunOptions};
        let p: &Xdp = self
            .bpf
            .program(self.name)
            .with_context(|| format!("program {} missing", self.name))?
            .try_into()?;
        let r = p
            .test_run(TestRunOptions {
                data_in: Some(frame),
                repeat: 1,
                ..Default::default()
            })
            .with_context(|| format!("BPF_PROG_TEST_RUN of {}", self.name))?;
        Ok((r.return_value, r.duration))
    }
}

/// The AF_XDP steering program of the l2fwd baseline.
pub struct XskSteer {
    bpf: Ebpf,
}

impl XskSteer {
    /// Attaches the steering program to `iface` (current namespace), steering UDP to `port`.
    pub fn attach_here(iface: &str, port: u16) -> Result<XskSteer> {
        let mut bpf = Ebpf::load(XSK_STEER_OBJ).context("loading xsk_steer.o")?;
        let mut ports: Array<_, u32> =
            Array::try_from(bpf.map_mut("STEER_PORT").context("STEER_PORT")?)?;
        ports.set(0, u32::from(port.to_be()), 0)?;
        attach(&mut bpf, "xsk_steer", iface)?;
        Ok(XskSteer { bpf })
    }

    /// Puts an AF_XDP socket into the XSKMAP slot of queue `queue`.
    pub fn register(&mut self, queue: u32, fd: std::os::fd::RawFd) -> Result<()> {
        let mut m = aya::maps::XskMap::try_from(self.bpf.map_mut("XSKS").context("XSKS")?)?;
        m.set(queue, fd, 0)?;
        Ok(())
    }
}
