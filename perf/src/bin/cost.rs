//! `juneau-perf-cost MODE N`: feeds N recorded frames to the dataplane's pure packet path
//! (`juneau_dataplane::engine::Engine::process`), for `valgrind --tool=callgrind`.
//!
//! Measured the way `dataplane/examples/engine_cost.rs` measures and the way the real
//! forwarding loop (`dataplane/src/runtime/worker.rs`) runs: the engine is inlined into the
//! packet loop (a frame copied in, the verdict consumed by a branch). The whole program
//! is counted; the caller ([`juneau_perf::cost`]) takes the difference of a `2N` and an
//! `N` run (start-up and set-up cancel) and subtracts the same difference for a
//! `baseline` mode that runs the same loop without the engine.
//!
//! Modes: `established` (one flow, after its first packet), `new` (every packet opens a
//! new flow; its frame is written per packet), `reply` (a backend's reply on an
//! established flow, reverse NAT), `baseline` (the `established`/`reply` loop without
//! the engine), `baseline-new` (the `new` loop without the engine); and the redirected
//! path on a TCP connection another node owns: `redirect-ask` (the node the
//! router sends it to follows its redirect record: look-up, encapsulation in place),
//! `redirect-own` (the owner strips the outer headers and serves it as its own), with
//! `baseline-redirect` (their loop without the engine: the same copy of a frame of that
//! size).

use std::hint::black_box;
use std::net::Ipv4Addr;

use anyhow::{bail, Context, Result};
use juneau_control::maglev::MaglevTable;
use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_dataplane::engine::{Engine, EngineConfig, Verdict};
use juneau_dataplane::neigh::{Iface, Neighbours, Route, Side};
use juneau_dataplane::packet::MacAddr;
use juneau_dataplane::services::ServiceTable;
use juneau_perf::packet::{flow, write_frame, Template, FRAME_LEN};
use juneau_perf::topology::*;

const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const NODE_UPLINK_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
const NODE_POD_MAC: [u8; 6] = [2, 0, 0, 0, 0, 3];
const BACKEND_MAC: [u8; 6] = [2, 0, 0, 0, 0, 4];
const UPLINK: u32 = 2;
const POD: u32 = 3;

/// The one Service (VIP:LOAD_PORT over `protocol`, one backend) as the engine's table.
fn service_table(protocol: Protocol) -> Result<ServiceTable> {
    let backends = vec![LocalBackend {
        ip: BACKEND_IP,
        port: BACKEND_LOAD_PORT,
    }];
    let mut state = NodeState {
        node: "cost".into(),
        services: vec![NodeService {
            frontend: Frontend {
                vip: VIP,
                protocol,
                port: LOAD_PORT,
            },
            backends: backends.clone(),
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
            host_network: false,
        }],
        ..Default::default()
    };
    state.normalize();
    let maglev = MaglevTable::new(&backends, juneau_control::maglev::DEFAULT_TABLE_SIZE)
        .context("maglev")?;
    Ok(ServiceTable::new(1, &state, &[maglev.slots().to_vec()]))
}

fn engine() -> Result<Engine> {
    let mut e = Engine::new(EngineConfig::default());
    e.set_services(service_table(Protocol::Udp)?);
    Ok(e)
}

fn neighbours() -> Neighbours {
    let mut nb = Neighbours::new(
        Iface {
            ifindex: UPLINK,
            mac: MacAddr(NODE_UPLINK_MAC),
        },
        vec![Iface {
            ifindex: POD,
            mac: MacAddr(NODE_POD_MAC),
        }],
    );
    nb.add_route(Route {
        prefix: u32::from(Ipv4Addr::new(198, 18, 1, 0)),
        len: 24,
        gateway: None,
        ifindex: UPLINK,
    });
    nb.add_route(Route {
        prefix: u32::from(FLOW_BASE),
        len: 18,
        gateway: Some(u32::from(CLIENT_IP)),
        ifindex: UPLINK,
    });
    nb.add_route(Route {
        prefix: u32::from(Ipv4Addr::new(198, 18, 2, 0)),
        len: 24,
        gateway: None,
        ifindex: POD,
    });
    nb.add_neighbour(u32::from(CLIENT_IP), UPLINK, MacAddr(CLIENT_MAC));
    nb.add_neighbour(u32::from(BACKEND_IP), POD, MacAddr(BACKEND_MAC));
    nb
}

/// The client's request template (client -> VIP).
fn template() -> Template {
    Template {
        src_mac: CLIENT_MAC,
        dst_mac: NODE_UPLINK_MAC,
        dst_ip: VIP,
        dst_port: LOAD_PORT,
    }
}

fn request(i: u32) -> [u8; 64] {
    let mut f = [0u8; 64];
    write_frame(&mut f, &template(), flow(FLOW_BASE, i));
    f
}

/// The backend's reply to flow `i` (backend -> client source, from the backend port).
fn reply(i: u32) -> [u8; 64] {
    let fl = flow(FLOW_BASE, i);
    let mut f = [0u8; 64];
    let t = Template {
        src_mac: BACKEND_MAC,
        dst_mac: NODE_POD_MAC,
        dst_ip: fl.src_ip,
        dst_port: fl.src_port,
    };
    write_frame(
        &mut f,
        &t,
        juneau_perf::packet::Flow {
            src_ip: BACKEND_IP,
            src_port: BACKEND_LOAD_PORT,
        },
    );
    f
}

fn expect_tx(v: Verdict, what: &str) -> Result<()> {
    if !matches!(v, Verdict::Tx(_)) {
        bail!("{what}: the engine answered {v:?}, not Tx (the recorded frames no longer match its policy)");
    }
    Ok(())
}

/// Runs `n` packets of a recorded frame through the engine, inlined into the loop as
/// the forwarding loop inlines it; every verdict must be Tx.
#[inline(always)]
fn run_recorded(
    e: &mut Engine,
    nb: &Neighbours,
    rec: &[u8; 64],
    ingress: Side,
    n: u32,
) -> Result<()> {
    let mut buf = [0u8; 64];
    let mut tx = 0u32;
    for _ in 0..n {
        buf.copy_from_slice(rec);
        if let Verdict::Tx(_) = e.process(&mut buf[..FRAME_LEN], ingress, nb, 1_000) {
            tx += 1;
        }
    }
    if black_box(tx) != n {
        bail!("{tx} of {n} packets forwarded (the recorded frames no longer match the engine's policy)");
    }
    Ok(())
}

/// The redirected path: node addresses on the node network.
const NODE_A: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 2);
const NODE_B: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 3);
const NODE_B_MAC: [u8; 6] = [2, 0, 0, 0, 0, 5];
const NODE_A_MAC: [u8; 6] = [2, 0, 0, 0, 0, 6];
/// Room for the outer headers of an encapsulated frame.
const REDIRECT_BUF: usize = 256;

/// A node serving the VIP over TCP with redirects to/from the other node on.
fn tcp_node(me: Ipv4Addr, peer: Ipv4Addr) -> Result<Engine> {
    use juneau_dataplane::redirect::{RedirectConfig, Redirector, DEFAULT_PORT};
    let mut e = Engine::new(EngineConfig::default());
    e.set_redirect(Redirector::new(RedirectConfig {
        node: u32::from(me),
        port: DEFAULT_PORT,
        peers: vec![u32::from(peer)],
        rate_per_s: 1_000_000,
        burst: 1_000_000,
        prefix_rate_per_s: 1_000_000,
        prefix_burst: 1_000_000,
        node_from_state: false,
    }));
    e.set_services(service_table(Protocol::Tcp)?);
    Ok(e)
}

/// `neighbours()` plus the node network: both nodes on the uplink.
fn node_network() -> Neighbours {
    let mut nb = neighbours();
    nb.add_route(Route {
        prefix: u32::from(Ipv4Addr::new(10, 1, 0, 0)),
        len: 24,
        gateway: None,
        ifindex: UPLINK,
    });
    nb.add_route(Route {
        prefix: u32::from(Ipv4Addr::new(198, 18, 0, 0)),
        len: 15,
        gateway: Some(u32::from(CLIENT_IP)),
        ifindex: UPLINK,
    });
    nb.add_neighbour(u32::from(NODE_A), UPLINK, MacAddr(NODE_A_MAC));
    nb.add_neighbour(u32::from(NODE_B), UPLINK, MacAddr(NODE_B_MAC));
    nb
}

/// One TCP segment of the client's connection with `flags` (valid checksums).
fn tcp_segment(flags: u8) -> Vec<u8> {
    juneau_tests::frames::TcpFlood {
        dst_mac: NODE_UPLINK_MAC,
        src_mac: CLIENT_MAC,
        dst: VIP,
        dst_port: LOAD_PORT,
        flags,
        seed: 42,
    }
    .frames(1)
    .remove(0)
}

/// What the asking node's loop does with a redirect verdict: the frame encapsulated in
/// place in its buffer; returns the new length.
fn encapsulate(e: &mut Engine, buf: &mut [u8; REDIRECT_BUF]) -> Result<usize> {
    use juneau_dataplane::redirect::DEFAULT_PORT;
    let out = e
        .take_redirect()
        .context("no redirect after a Redirect verdict")?;
    let key = e.redirect().and_then(|r| r.send_key());
    juneau_dataplane::redirect_wire::encapsulate(
        buf,
        &out,
        u32::from(NODE_A),
        DEFAULT_PORT,
        1600,
        key,
    )
    .context("encapsulation")
}

/// Node B owns the connection (SYN, ACK through it); node A, which the router now sends
/// it to, asked B once and holds B's notice as a redirect record. Returns both nodes, the
/// client's ACK as A receives it and that ACK encapsulated by A as B receives it.
fn redirect_pair(nb: &Neighbours) -> Result<(Engine, Engine, Vec<u8>, Vec<u8>)> {
    use juneau_dataplane::redirect::DEFAULT_PORT;
    let now = 1_000u64;
    let (mut a, mut b) = (tcp_node(NODE_A, NODE_B)?, tcp_node(NODE_B, NODE_A)?);
    for (flags, what) in [(0x02, "SYN at the owner"), (0x10, "ACK at the owner")] {
        let mut f = tcp_segment(flags);
        let v = b.process(&mut f, Side::Uplink, nb, now);
        if !matches!(v, Verdict::Tx(Side::Pod(_))) {
            bail!("{what}: {v:?}");
        }
    }
    let ack = tcp_segment(0x10);
    let mut buf = [0u8; REDIRECT_BUF];
    buf[..ack.len()].copy_from_slice(&ack);
    let v = a.process(&mut buf[..ack.len()], Side::Uplink, nb, now);
    if v != Verdict::Redirect {
        bail!("unknown ACK at the other node: {v:?}, not Redirect");
    }
    let len = encapsulate(&mut a, &mut buf)?;
    let encapsulated = buf[..len].to_vec();
    let mut inner = encapsulated.clone();
    let v = b.process(&mut inner, Side::Uplink, nb, now);
    if !matches!(v, Verdict::TxResized(Side::Pod(_), _)) {
        bail!("redirected ACK at the owner: {v:?}");
    }
    let notices: Vec<_> = b
        .redirect_mut()
        .map(|r| r.take_notices().collect())
        .unwrap_or_default();
    for n in notices {
        let mut nbuf = [0u8; REDIRECT_BUF];
        let l = juneau_dataplane::redirect_wire::build_notice(
            &mut nbuf,
            &n.macs,
            u32::from(NODE_B),
            n.to,
            DEFAULT_PORT,
            n.key,
            n.cookie,
            b.redirect().and_then(|r| r.send_key()),
        )
        .context("notice")?;
        let v = a.process(&mut nbuf[..l], Side::Uplink, nb, now);
        if v != Verdict::Consumed {
            bail!("owner's notice: {v:?}");
        }
    }
    if a.flows().is_empty() {
        bail!("no redirect record at the asking node after the owner's notice");
    }
    Ok((a, b, ack, encapsulated))
}

/// `n` packets of the redirected path at the asking node (`own` false) or the owner.
fn run_redirect(own: bool, n: u32) -> Result<()> {
    let nb = node_network();
    let (mut a, mut b, ack, encapsulated) = redirect_pair(&nb)?;
    let rec = if own { &encapsulated } else { &ack };
    let mut buf = [0u8; REDIRECT_BUF];
    let mut done = 0u32;
    for _ in 0..n {
        buf[..rec.len()].copy_from_slice(rec);
        if own {
            if let Verdict::TxResized(Side::Pod(_), _) =
                b.process(&mut buf[..rec.len()], Side::Uplink, &nb, 1_000)
            {
                done += 1;
            }
        } else if a.process(&mut buf[..rec.len()], Side::Uplink, &nb, 1_000) == Verdict::Redirect
            && encapsulate(&mut a, &mut buf).is_ok()
        {
            done += 1;
        }
    }
    if black_box(done) != n {
        bail!("{done} of {n} redirected packets handled as expected");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        bail!("usage: juneau-perf-cost established|new|reply|baseline|baseline-new|redirect-ask|redirect-own|baseline-redirect N");
    }
    let n: u32 = args[2].parse().context("N")?;
    let mut e = engine()?;
    let nb = neighbours();
    let now = 1_000u64;
    let mut buf = [0u8; 64];
    match args[1].as_str() {
        "established" => {
            let rec = request(0);
            buf.copy_from_slice(&rec);
            expect_tx(
                e.process(&mut buf[..FRAME_LEN], Side::Uplink, &nb, now),
                "first packet",
            )?;
            run_recorded(&mut e, &nb, &rec, Side::Uplink, n)?;
        }
        "reply" => {
            let mut req = request(0);
            expect_tx(
                e.process(&mut req[..FRAME_LEN], Side::Uplink, &nb, now),
                "request",
            )?;
            run_recorded(&mut e, &nb, &reply(0), Side::Pod(0), n)?;
        }
        "baseline" => {
            // The `established`/`reply` loop without the engine: same copy, same branch.
            let rec = request(0);
            let mut tx = 0u32;
            for _ in 0..n {
                buf.copy_from_slice(&rec);
                if black_box(&mut buf[..FRAME_LEN]).len() == FRAME_LEN {
                    tx += 1;
                }
            }
            if black_box(tx) != n {
                bail!("baseline loop miscounted");
            }
        }
        "new" | "baseline-new" => {
            // A new flow per packet: its frame is written in the loop (in both modes).
            let with_engine = args[1] == "new";
            let mut tx = 0u32;
            for i in 1..=n {
                write_frame(&mut buf, &template(), flow(FLOW_BASE, i));
                let forwarded = if with_engine {
                    matches!(
                        e.process(&mut buf[..FRAME_LEN], Side::Uplink, &nb, now),
                        Verdict::Tx(_)
                    )
                } else {
                    black_box(&mut buf[..FRAME_LEN]).len() == FRAME_LEN
                };
                if forwarded {
                    tx += 1;
                }
            }
            if black_box(tx) != n {
                bail!("{tx} of {n} new flows forwarded");
            }
        }
        "redirect-ask" => run_redirect(false, n)?,
        "redirect-own" => run_redirect(true, n)?,
        "baseline-redirect" => {
            // Their loop without the engine: the copy of a frame of the encapsulated size.
            let (_, _, _, rec) = redirect_pair(&node_network())?;
            let mut rbuf = [0u8; REDIRECT_BUF];
            let mut done = 0u32;
            for _ in 0..n {
                rbuf[..rec.len()].copy_from_slice(&rec);
                if black_box(&mut rbuf[..rec.len()]).len() == rec.len() {
                    done += 1;
                }
            }
            if black_box(done) != n {
                bail!("baseline-redirect loop miscounted");
            }
        }
        m => bail!("unknown mode {m}"),
    }
    Ok(())
}
