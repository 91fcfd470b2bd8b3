//! `juneau-perf-cost MODE N`: feeds N recorded frames to the dataplane's pure packet path
//! (`juneau_dataplane::engine::Engine::process`), for `valgrind --tool=callgrind
//! --toggle-collect=*process_one*`, which counts only the instructions executed inside
//! [`process_one`] (the engine call plus a call/return).
//!
//! Modes: `established` (one flow, after its first packet), `new` (every packet opens a
//! new flow), `reply` (a backend's reply on an established flow, reverse NAT).

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

/// The measured call: everything callgrind counts happens in here.
#[inline(never)]
fn process_one(
    e: &mut Engine,
    frame: &mut [u8],
    ingress: Side,
    nb: &Neighbours,
    now_ms: u64,
) -> Verdict {
    e.process(frame, ingress, nb, now_ms)
}

fn engine() -> Result<Engine> {
    let backends = vec![LocalBackend {
        ip: BACKEND_IP,
        port: BACKEND_LOAD_PORT,
    }];
    let mut state = NodeState {
        node: "cost".into(),
        services: vec![NodeService {
            frontend: Frontend {
                vip: VIP,
                protocol: Protocol::Udp,
                port: LOAD_PORT,
            },
            backends: backends.clone(),
        }],
        ..Default::default()
    };
    state.normalize();
    let maglev = MaglevTable::new(&backends, juneau_control::maglev::DEFAULT_TABLE_SIZE)
        .context("maglev")?;
    let table = ServiceTable::new(1, &state, &[maglev.slots().to_vec()]);
    let mut e = Engine::new(EngineConfig::default());
    e.set_services(table);
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

fn request(i: u32) -> [u8; 64] {
    let mut f = [0u8; 64];
    let t = Template {
        src_mac: CLIENT_MAC,
        dst_mac: NODE_UPLINK_MAC,
        dst_ip: VIP,
        dst_port: LOAD_PORT,
    };
    write_frame(&mut f, &t, flow(FLOW_BASE, i));
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

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        bail!("usage: juneau-perf-cost established|new|reply N");
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
                process_one(&mut e, &mut buf[..FRAME_LEN], Side::Uplink, &nb, now),
                "first packet",
            )?;
            for _ in 0..n {
                buf.copy_from_slice(&rec);
                let v = process_one(
                    &mut e,
                    black_box(&mut buf[..FRAME_LEN]),
                    Side::Uplink,
                    &nb,
                    now,
                );
                black_box(v);
            }
            buf.copy_from_slice(&rec);
            expect_tx(
                process_one(&mut e, &mut buf[..FRAME_LEN], Side::Uplink, &nb, now),
                "established",
            )?;
        }
        "new" => {
            let frames: Vec<[u8; 64]> = (1..=n).map(request).collect();
            for f in &frames {
                buf.copy_from_slice(f);
                let v = process_one(
                    &mut e,
                    black_box(&mut buf[..FRAME_LEN]),
                    Side::Uplink,
                    &nb,
                    now,
                );
                expect_tx(v, "new flow")?;
            }
        }
        "reply" => {
            let mut req = request(0);
            expect_tx(
                process_one(&mut e, &mut req[..FRAME_LEN], Side::Uplink, &nb, now),
                "request",
            )?;
            let rec = reply(0);
            for _ in 0..n {
                buf.copy_from_slice(&rec);
                let v = process_one(
                    &mut e,
                    black_box(&mut buf[..FRAME_LEN]),
                    Side::Pod(0),
                    &nb,
                    now,
                );
                black_box(v);
            }
            buf.copy_from_slice(&rec);
            expect_tx(
                process_one(&mut e, &mut buf[..FRAME_LEN], Side::Pod(0), &nb, now),
                "reply",
            )?;
        }
        m => bail!("unknown mode {m}"),
    }
    Ok(())
}
