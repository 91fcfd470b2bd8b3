//! The node's IPv6 frontends compiled for the packet path (issue #28): frontend look-up
//! by `(VIP, protocol, port)`, the IPv6 VIP set, each service's backends, Maglev slots and
//! admitted client prefixes. Built off the packet path, like [`crate::services`], and only
//! read by the engine.

use std::collections::{HashMap, HashSet};

/// An IPv6 backend: address and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Backend6 {
    /// The Pod's IPv6 address.
    pub ip: [u8; 16],
    /// The Pod port.
    pub port: u16,
}

/// One IPv6 frontend with its local backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service6 {
    /// The VIP.
    pub vip: [u8; 16],
    /// TCP or UDP.
    pub proto: u8,
    /// The Service port.
    pub port: u16,
    /// Ready backends (sorted), then draining ones (sorted): a draining backend keeps
    /// its flows and gets no new one.
    pub backends: Vec<Backend6>,
    /// How many of `backends` are Ready.
    pub ready: usize,
    /// Maglev slots over the Ready backends.
    pub maglev: Vec<u16>,
    /// Admitted client prefixes (`loadBalancerSourceRanges`): `(network, length)`; empty
    /// admits every client.
    pub source_ranges: Vec<(u128, u8)>,
    /// `sessionAffinity: ClientIP` with its timeout (ms): a client's new connections go
    /// to the backend its earlier ones went to ([`crate::affinity`]), else by its address
    /// alone. `None`: per connection.
    pub client_ip_affinity_ms: Option<u64>,
    /// Whether the frontend hands new flows without a Ready backend here to a peer (the
    /// Cluster policy, as [`crate::services::Service::hand_off`]).
    pub hand_off: bool,
}

impl Service6 {
    /// Whether the service admits this client.
    pub fn admits(&self, client: [u8; 16]) -> bool {
        let c = u128::from_be_bytes(client);
        self.source_ranges.is_empty()
            || self.source_ranges.iter().any(|&(net, len)| {
                let mask = if len == 0 {
                    0
                } else {
                    u128::MAX << (128 - u32::from(len.min(128)))
                };
                c & mask == net & mask
            })
    }

    /// The Ready backend for a new flow with this Maglev hash.
    pub fn pick(&self, hash: u64) -> Option<Backend6> {
        self.pick_index(hash).map(|i| self.backends[i])
    }

    /// The index in `backends` (a Ready one) Maglev gives this hash.
    pub fn pick_index(&self, hash: u64) -> Option<usize> {
        let i = juneau_control::maglev::pick_in(&self.maglev, hash)?;
        (i < self.ready).then_some(i)
    }

    /// The Ready backends, sorted.
    pub fn ready_backends(&self) -> &[Backend6] {
        &self.backends[..self.ready]
    }

    /// Whether `b` is one of the backends (Ready or draining).
    pub fn has_backend(&self, b: Backend6) -> bool {
        self.backends.contains(&b)
    }
}

/// The IPv6 service table of one generation of the node's state.
#[derive(Debug, Clone, Default)]
pub struct Services6 {
    generation: u64,
    services: Vec<Service6>,
    by_frontend: HashMap<([u8; 16], u8, u16), u32>,
    vips: HashSet<[u8; 16]>,
    /// The VIPs with a peer to hand new connections to (this node's redirect address
    /// known): a hand-off frontend serves them without a Ready backend here.
    handing_on: HashSet<[u8; 16]>,
}

impl Services6 {
    /// The table of `services` (generation `generation` of the node's state).
    pub fn new(generation: u64, services: Vec<Service6>) -> Self {
        let by_frontend = services
            .iter()
            .enumerate()
            .map(|(i, s)| ((s.vip, s.proto, s.port), i as u32))
            .collect();
        let vips = services.iter().map(|s| s.vip).collect();
        Services6 {
            generation,
            services,
            by_frontend,
            vips,
            handing_on: HashSet::new(),
        }
    }

    /// Takes the IPv6 VIPs' redirect peers the agent published: a hand-off
    /// ([`Service6::hand_off`]) frontend of a VIP with a peer is served without a Ready
    /// backend here ([`Services6::serving_vips`]).
    pub fn set_redirects(&mut self, r: &juneau_control::model::Redirects) {
        self.handing_on = match r.node_address {
            Some(_) => r
                .vips6
                .iter()
                .filter(|v| !v.nodes.is_empty())
                .map(|v| v.vip.octets())
                .collect(),
            None => HashSet::new(),
        };
    }

    /// The IPv6 frontends of a node state with their Maglev tables (`maglev[i]` belongs
    /// to `services[i]`, as in `juneau_control::shm::Snapshot::maglev6`).
    pub fn from_state(
        generation: u64,
        services: &[juneau_control::model::NodeService6],
        maglev: &[Vec<u16>],
    ) -> Self {
        let compiled = services
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let b6 = |b: &juneau_control::model::LocalBackend6| Backend6 {
                    ip: b.ip.octets(),
                    port: b.port,
                };
                let mut backends: Vec<Backend6> = s.backends.iter().map(b6).collect();
                backends.dedup();
                let ready = backends.len();
                let mut draining: Vec<Backend6> = s
                    .terminating
                    .iter()
                    .map(b6)
                    .filter(|b| !backends[..ready].contains(b))
                    .collect();
                draining.sort();
                draining.dedup();
                backends.extend(draining);
                Service6 {
                    vip: s.frontend.vip.octets(),
                    proto: s.frontend.protocol.number(),
                    port: s.frontend.port,
                    backends,
                    ready,
                    maglev: maglev.get(i).cloned().unwrap_or_default(),
                    source_ranges: s
                        .source_ranges
                        .iter()
                        .map(|r| (u128::from(r.network()), r.prefix_len()))
                        .collect(),
                    client_ip_affinity_ms: s.client_ip_affinity.map(|t| u64::from(t) * 1000),
                    hand_off: s.hand_off,
                }
            })
            .collect();
        Services6::new(generation, compiled)
    }

    /// The frontends as the steering program's `frontends6` map takes them.
    pub fn frontends(&self) -> Vec<(std::net::Ipv6Addr, u8, u16)> {
        self.services
            .iter()
            .map(|s| (s.vip.into(), s.proto, s.port))
            .collect()
    }

    /// The IPv6 VIPs with a backend new flows can go to (what the node may announce): a
    /// Ready backend here, or for a hand-off (Cluster-policy) frontend a peer to hand
    /// new connections to, as IPv4's [`crate::services::ServiceTable::serving_vips`].
    pub fn serving_vips(&self) -> Vec<std::net::Ipv6Addr> {
        let mut v: Vec<std::net::Ipv6Addr> = self
            .services
            .iter()
            .filter(|s| s.ready > 0 || (s.hand_off && self.handing_on.contains(&s.vip)))
            .map(|s| s.vip.into())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// The state generation this table was built from.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether `ip` is one of the node's IPv6 VIPs.
    pub fn is_vip(&self, ip: [u8; 16]) -> bool {
        self.vips.contains(&ip)
    }

    /// The service of a frontend.
    pub fn find(&self, vip: [u8; 16], proto: u8, port: u16) -> Option<u32> {
        self.by_frontend.get(&(vip, proto, port)).copied()
    }

    /// Service `i`.
    pub fn service(&self, i: u32) -> Option<&Service6> {
        self.services.get(i as usize)
    }

    /// Every service.
    pub fn services(&self) -> &[Service6] {
        &self.services
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_states_ipv6_frontends_compile_with_draining_backends_after_ready_ones() {
        use juneau_control::model::{Frontend6, LocalBackend6, NodeService6, Protocol};
        let ip = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap();
        let b = |s: &str| LocalBackend6 {
            ip: ip(s),
            port: 8080,
        };
        let mut s = NodeService6::new(
            Frontend6 {
                vip: ip("2001:db8::1"),
                protocol: Protocol::Tcp,
                port: 80,
            },
            vec![b("fd00::2"), b("fd00::3")],
        );
        s.terminating = vec![b("fd00::9"), b("fd00::2")];
        s.source_ranges = vec!["2001:db8:9::/48".parse().unwrap()];
        let empty = NodeService6::new(
            Frontend6 {
                vip: ip("2001:db8::2"),
                protocol: Protocol::Udp,
                port: 53,
            },
            vec![],
        );
        let t = Services6::from_state(7, &[s, empty], &[vec![0, 1, 0], vec![]]);
        let svc = t
            .service(t.find(ip("2001:db8::1").octets(), 6, 80).unwrap())
            .unwrap();
        assert_eq!(svc.ready, 2);
        let order: Vec<_> = svc
            .backends
            .iter()
            .map(|b| std::net::Ipv6Addr::from(b.ip))
            .collect();
        assert_eq!(order, vec![ip("fd00::2"), ip("fd00::3"), ip("fd00::9")]);
        assert_eq!(
            svc.source_ranges,
            vec![(u128::from(ip("2001:db8:9::")), 48)]
        );
        assert_eq!(svc.pick(1).map(|b| b.ip), Some(ip("fd00::3").octets()));
        assert_eq!(t.frontends().len(), 2);
        assert_eq!(
            t.serving_vips(),
            vec![ip("2001:db8::1")],
            "no Ready backend, not served"
        );
        assert_eq!(t.generation(), 7);
    }

    #[test]
    fn a_hand_off_frontend_without_a_ready_backend_is_served_while_a_peer_takes_it() {
        use juneau_control::model::{
            Frontend6, NodeService6, Protocol, Redirects, VipRedirectPeers6,
        };
        let vip: std::net::Ipv6Addr = "2001:db8::1".parse().unwrap();
        let mut s = NodeService6::new(
            Frontend6 {
                vip,
                protocol: Protocol::Tcp,
                port: 80,
            },
            vec![],
        );
        s.hand_off = true;
        let mut t = Services6::from_state(1, &[s.clone()], &[vec![]]);
        assert!(t.service(0).unwrap().hand_off);
        assert!(t.serving_vips().is_empty(), "no peer known yet");
        let peers = |me: Option<std::net::Ipv4Addr>| Redirects {
            node_address: me,
            vips6: vec![VipRedirectPeers6 {
                vip,
                nodes: vec![std::net::Ipv4Addr::new(192, 0, 2, 2)],
            }],
            ..Redirects::default()
        };
        t.set_redirects(&peers(Some(std::net::Ipv4Addr::new(192, 0, 2, 1))));
        assert_eq!(t.serving_vips(), vec![vip]);
        // Without this node's redirect address, nothing can be handed on.
        t.set_redirects(&peers(None));
        assert!(t.serving_vips().is_empty());
        // Not a hand-off frontend: a peer is no reason to announce.
        s.hand_off = false;
        let mut t = Services6::from_state(1, &[s], &[vec![]]);
        t.set_redirects(&peers(Some(std::net::Ipv4Addr::new(192, 0, 2, 1))));
        assert!(t.serving_vips().is_empty());
    }

    #[test]
    fn source_ranges_match_by_prefix_and_an_empty_list_admits_all() {
        let ip = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap();
        let mut s = Service6 {
            vip: ip("2001:db8::1").octets(),
            proto: 6,
            port: 80,
            backends: vec![],
            ready: 0,
            maglev: vec![],
            source_ranges: vec![],
            client_ip_affinity_ms: None,
            hand_off: false,
        };
        assert!(s.admits(ip("2001:db8:9::1").octets()));
        s.source_ranges = vec![(u128::from(ip("2001:db8:9::")), 48)];
        assert!(s.admits(ip("2001:db8:9:ffff::1").octets()));
        assert!(!s.admits(ip("2001:db8:a::1").octets()));
        assert_eq!(s.pick(7), None, "no Ready backend, no pick");
    }
}
