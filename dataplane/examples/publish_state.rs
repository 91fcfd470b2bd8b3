//! Publishes a node state for `juneau-dataplane` by hand (labs, perf runs, debugging).
//!
//! ```text
//! cargo run -p juneau-dataplane --example publish_state -- PATH SERVICE...
//! SERVICE = tcp|udp:VIP:PORT=BACKEND_IP:PORT[,BACKEND_IP:PORT...]   (no '=' part: no backend)
//! ```
//! e.g. `publish_state /run/juneau/node-a.state tcp:203.0.113.10:80=10.1.0.5:8080,10.1.1.5:8080`

use anyhow::{bail, Context, Result};
use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_control::shm::{Capacity, NodeStateWriter};

fn parse_service(s: &str) -> Result<NodeService> {
    let (front, backs) = s.split_once('=').unwrap_or((s, ""));
    let mut parts = front.splitn(3, ':');
    let (Some(proto), Some(vip), Some(port)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("bad service {s:?}: want proto:VIP:PORT=IP:PORT,...");
    };
    let protocol: Protocol = proto.parse()?;
    let frontend = Frontend {
        vip: vip.parse().context("VIP")?,
        protocol,
        port: port.parse().context("port")?,
    };
    let mut backends = Vec::new();
    for b in backs.split(',').filter(|b| !b.is_empty()) {
        let (ip, port) = b.split_once(':').context("backend IP:PORT")?;
        backends.push(LocalBackend {
            ip: ip.parse()?,
            port: port.parse()?,
        });
    }
    Ok(NodeService {
        frontend,
        backends,
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        client_ip_affinity: None,
        hand_off: false,
        host_network: false,
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((path, specs)) = args.split_first() else {
        bail!("usage: publish_state PATH SERVICE...");
    };
    let mut state = NodeState {
        node: "manual".into(),
        ..Default::default()
    };
    for s in specs {
        state.services.push(parse_service(s)?);
    }
    let mut w = NodeStateWriter::create(path, Capacity::default())?;
    let g = w.publish(&state)?;
    println!("published generation {g} to {path}");
    Ok(())
}
