//! The engine fixture shared by the criterion bench (`benches/engine.rs`) and the
//! callgrind harness (`examples/engine_cost.rs`): one UDP service with one backend, a
//! default route on the uplink and a host route to the backend, frames built by hand.

use std::net::Ipv4Addr;

use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_dataplane::engine::{Engine, EngineConfig};
use juneau_dataplane::neigh::{Iface, Neighbours, Route};
use juneau_dataplane::packet::{self, MacAddr, Parsed};
use juneau_dataplane::services::ServiceTable;

pub const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const B: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 5);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

/// A UDP frame with valid IPv4 and UDP checksums.
pub fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, payload: usize) -> Vec<u8> {
    let total = 28 + payload;
    let mut f = vec![0u8; 14 + total];
    f[12..14].copy_from_slice(&[0x08, 0]);
    f[14] = 0x45;
    f[16..18].copy_from_slice(&(total as u16).to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&src.octets());
    f[30..34].copy_from_slice(&dst.octets());
    let c = packet::ipv4_header_checksum(&f[14..34]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    if let Ok(Parsed::Ipv4(v)) = packet::parse(&f) {
        packet::fill_l4_checksum(&mut f, &v);
    }
    f
}

/// An engine serving VIP:53/UDP -> B:5353 and the neighbours to reach client and backend.
pub fn setup(recompute: bool, capacity: usize) -> (Engine, Neighbours) {
    setup_engine(Engine::new(EngineConfig {
        flow_capacity: capacity,
        recompute_pod_checksums: recompute,
        ..Default::default()
    }))
}

/// [`setup`] over a given engine (e.g. one over a shared, BPF-map flow table).
#[allow(dead_code)]
pub fn setup_engine(mut e: Engine) -> (Engine, Neighbours) {
    let mut state = NodeState {
        node: "n".into(),
        services: vec![NodeService {
            frontend: Frontend {
                vip: VIP,
                protocol: Protocol::Udp,
                port: 53,
            },
            backends: vec![LocalBackend { ip: B, port: 5353 }],
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            client_ip_affinity: None,
            hand_off: false,
            host_network: false,
        }],
        ..Default::default()
    };
    state.normalize();
    e.set_services(ServiceTable::new(1, &state, &[vec![0; 65537]]));
    let mut nb = Neighbours::new(
        Iface {
            ifindex: 1,
            mac: MacAddr([0xa; 6]),
        },
        vec![Iface {
            ifindex: 2,
            mac: MacAddr([0xb; 6]),
        }],
    );
    nb.add_route(Route {
        prefix: 0,
        len: 0,
        gateway: Some(u32::from(Ipv4Addr::new(192, 0, 2, 254))),
        ifindex: 1,
    });
    nb.add_route(Route {
        prefix: u32::from(B),
        len: 32,
        gateway: None,
        ifindex: 2,
    });
    nb.add_neighbour(u32::from(Ipv4Addr::new(192, 0, 2, 254)), 1, MacAddr([1; 6]));
    nb.add_neighbour(u32::from(B), 2, MacAddr([2; 6]));
    (e, nb)
}
