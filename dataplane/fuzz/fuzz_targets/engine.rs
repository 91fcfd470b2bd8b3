//! Fuzzes `packet::parse`, the NAT rewrites and `Engine::process` with arbitrary frames.
//! The first input byte picks the ingress side (even: uplink, odd: Pod 0).
#![no_main]

use std::net::Ipv4Addr;

use juneau_control::model::{Frontend, LocalBackend, NodeService, NodeState, Protocol};
use juneau_dataplane::engine::{Engine, EngineConfig, Verdict};
use juneau_dataplane::neigh::{Iface, Neighbours, Route, Side};
use juneau_dataplane::packet::{self, MacAddr, Parsed};
use juneau_dataplane::services::ServiceTable;
use libfuzzer_sys::fuzz_target;

fn setup() -> (Engine, Neighbours) {
    let vip = Ipv4Addr::new(203, 0, 113, 10);
    let b = Ipv4Addr::new(10, 1, 0, 5);
    let mut state = NodeState {
        node: "n".into(),
        services: vec![
            NodeService { frontend: Frontend { vip, protocol: Protocol::Tcp, port: 80 }, backends: vec![LocalBackend { ip: b, port: 8080 }], terminating: Vec::new() },
            NodeService { frontend: Frontend { vip, protocol: Protocol::Udp, port: 53 }, backends: vec![LocalBackend { ip: b, port: 5353 }], terminating: Vec::new() },
        ],
        ..Default::default()
    };
    state.normalize();
    let mut e = Engine::new(EngineConfig { flow_capacity: 1024, ..Default::default() });
    e.set_services(ServiceTable::new(1, &state, &[vec![0; 13], vec![0; 13]]));
    let mut nb = Neighbours::new(Iface { ifindex: 1, mac: MacAddr([0xa; 6]) }, vec![Iface { ifindex: 2, mac: MacAddr([0xb; 6]) }]);
    nb.add_route(Route { prefix: 0, len: 0, gateway: Some(u32::from(Ipv4Addr::new(192, 0, 2, 254))), ifindex: 1 });
    nb.add_route(Route { prefix: u32::from(b), len: 32, gateway: None, ifindex: 2 });
    nb.add_neighbour(u32::from(Ipv4Addr::new(192, 0, 2, 254)), 1, MacAddr([1; 6]));
    nb.add_neighbour(u32::from(b), 2, MacAddr([2; 6]));
    (e, nb)
}

fuzz_target!(|data: &[u8]| {
    let Some((&tag, frame)) = data.split_first() else { return };
    let _ = packet::parse(frame);
    let (mut e, nb) = setup();
    let side = if tag % 2 == 0 { Side::Uplink } else { Side::Pod(0) };
    let mut f = frame.to_vec();
    if let Verdict::Tx(_) = e.process(&mut f, side, &nb, 1) {
        assert!(matches!(packet::parse(&f), Ok(Parsed::Ipv4(_))));
    }
});
