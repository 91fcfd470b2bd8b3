//! The benchmark topology, identical for every scenario:
//!
//! ```text
//!  client ns                node ns                        backend ns
//!  [c] 198.18.1.2/24 <-> [nc] 198.18.1.1/24
//!                          [nb] 198.18.2.1/24 <-> [b] 198.18.2.2/24
//! ```
//! Addresses are from 198.18.0.0/15, the range set aside for benchmarking (RFC 2544).
//! Generated flows come from 198.18.64.0/18 (routed to the client by the node), the VIP
//! is 198.19.0.10. The same links carry IPv6 (the IPv6 rows) from 2001:2::/48, the
//! range set aside for benchmarking IPv6 (RFC 5180): `2001:2:0:1::/64` between client
//! and node, `2001:2:0:2::/64` between node and backend, flows from `2001:2:0:40::/64`,
//! the VIP `2001:2:0:ff::10`; addresses without duplicate address detection and static
//! neighbours, as IPv4's. Namespaces and links get names unique to this process and call
//! (`juneau_tests::netns::unique_prefix`), and everything is deleted when the topology is
//! dropped — on success, on error and on Ctrl-C (the main loop turns it into an error).

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result};
use juneau_tests::netns::{unique_prefix, veth, Netns};

use crate::packet::parse_mac;

/// The client's address.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// The node's address on the client side.
pub const NODE_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
/// The node's address on the backend side.
pub const NODE_BACKEND_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);
/// The backend Pod's address.
pub const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
/// The first generated client address (flows use up to a /18 from here).
pub const FLOW_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 64, 0);
/// The load balancer's VIP.
pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// The client's IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 1, 0, 0, 0, 2);
/// The node's IPv6 address on the client side.
pub const NODE_CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 1, 0, 0, 0, 1);
/// The node's IPv6 address on the backend side.
pub const NODE_BACKEND_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 2, 0, 0, 0, 1);
/// The backend Pod's IPv6 address.
pub const BACKEND_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 2, 0, 0, 0, 2);
/// The first generated IPv6 client address (flows count up its last 32 bits, 64 source
/// ports per address, as IPv4's).
pub const FLOW_BASE6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0x40, 0, 0, 0, 0);
/// The prefix the IPv6 flows come from (routed to the client by the node).
const FLOW_NET6: &str = "2001:2:0:40::/64";
/// The load balancer's IPv6 VIP.
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, 0x10);
/// The service port of the throughput load (UDP) at the VIP.
pub const LOAD_PORT: u16 = 9000;
/// The backend's port for the throughput load (counted and dropped by the sink).
pub const BACKEND_LOAD_PORT: u16 = 9100;
/// The service port of the latency probes (UDP echo) at the VIP.
pub const ECHO_PORT: u16 = 9001;
/// The backend's echo server port.
pub const BACKEND_ECHO_PORT: u16 = 9101;
/// The service port of the TCP bulk download at the VIP.
pub const BULK_PORT: u16 = 9002;
/// The backend's TCP bulk server port.
pub const BACKEND_BULK_PORT: u16 = 9102;

/// What the client and backend ends are set up for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ends {
    /// The UDP scenarios: checksum offload off on both ends (the generator's frames and
    /// the echo server's replies carry finished checksums).
    Udp,
    /// The TCP bulk download (the `bulk` module): the backend's veth as a CNI leaves a Pod's
    /// (TSO, GSO and tx checksum offload on, no XDP program, no NAPI); the client's with
    /// tx checksum offload off (kernel sockets sending into the uplink must send finished
    /// checksums) and threaded NAPI (GRO on, so that frames the node redirects with XDP
    /// are taken; its kthread pinned to `endpoint_cpu` by the bulk run). And RPS on all
    /// four ends: a veth hands an skb from a TSO-capable sender to its peer's backlog on
    /// the *sending* core (its NAPI takes only skbs from a sender without TSO, and XDP
    /// frames), so without RPS the node would forward the backend's TSO skbs on the
    /// endpoints' core and the client would receive the node's frames on the path core.
    /// RPS sends what arrives on the client's and backend's veths to `endpoint_cpu`, what
    /// arrives on the node's to `path_cpu`: each side's receive work runs on its own core.
    Bulk {
        /// The core of the TCP server and client.
        endpoint_cpu: u32,
        /// The core of the node's forwarding work.
        path_cpu: u32,
    },
}

/// The three namespaces and their links.
pub struct Topology {
    /// Client namespace (generator, latency prober).
    pub client: Netns,
    /// Node namespace (the load balancer under test).
    pub node: Netns,
    /// Backend namespace (sink, echo server).
    pub backend: Netns,
    /// Client interface (in `client`).
    pub c_if: String,
    /// Node's client-facing interface (in `node`).
    pub nc_if: String,
    /// Node's backend-facing interface (in `node`).
    pub nb_if: String,
    /// Backend interface (in `backend`).
    pub b_if: String,
    /// MAC of `c_if`.
    pub c_mac: [u8; 6],
    /// MAC of `nc_if`.
    pub nc_mac: [u8; 6],
    /// MAC of `nb_if`.
    pub nb_mac: [u8; 6],
    /// MAC of `b_if`.
    pub b_mac: [u8; 6],
}

fn mac_of(ns: &Netns, iface: &str) -> Result<[u8; 6]> {
    let out = ns.exec(&["cat", &format!("/sys/class/net/{iface}/address")])?;
    parse_mac(out.trim()).with_context(|| format!("bad MAC {out:?} of {iface}"))
}

impl Topology {
    /// Builds the topology: addresses, routes, forwarding on in the node, checksum
    /// offload off on the client and backend ends (kernel sockets there must send
    /// finished checksums, or they fail after NAT: FACTS.md).
    pub fn build() -> Result<Topology> {
        Topology::build_for(Ends::Udp)
    }

    /// Builds the topology with its ends set up for `ends` (the node namespace is the
    /// same for every kind).
    pub fn build_for(ends: Ends) -> Result<Topology> {
        let p = unique_prefix("prf");
        let client = Netns::new(format!("{p}cl"))?;
        let node = Netns::new(format!("{p}nd"))?;
        let backend = Netns::new(format!("{p}be"))?;
        let (c_if, nc_if, nb_if, b_if) = (
            format!("{p}c"),
            format!("{p}nc"),
            format!("{p}nb"),
            format!("{p}b"),
        );
        veth(&client, &c_if, &node, &nc_if)?;
        veth(&node, &nb_if, &backend, &b_if)?;
        client.addr(&c_if, "198.18.1.2/24")?;
        node.addr(&nc_if, "198.18.1.1/24")?;
        node.addr(&nb_if, "198.18.2.1/24")?;
        backend.addr(&b_if, "198.18.2.2/24")?;
        client.exec(&["ip", "route", "add", "default", "via", "198.18.1.1"])?;
        backend.exec(&["ip", "route", "add", "default", "via", "198.18.2.1"])?;
        node.exec(&["ip", "route", "add", "198.18.64.0/18", "via", "198.18.1.2"])?;
        node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        address_ipv6(&client, &node, &backend, [&c_if, &nc_if, &nb_if, &b_if])?;
        // Generated sources are not the client's own address; let them through.
        for ns in [&client, &node, &backend] {
            ns.exec(&["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"])?;
            ns.exec(&["sysctl", "-qw", "net.ipv4.conf.default.rp_filter=0"])?;
        }
        node.exec(&[
            "sysctl",
            "-qw",
            &format!("net.ipv4.conf.{nc_if}.rp_filter=0"),
        ])?;
        node.exec(&[
            "sysctl",
            "-qw",
            &format!("net.ipv4.conf.{nb_if}.rp_filter=0"),
        ])?;
        client.exec(&["ethtool", "-K", &c_if, "tx", "off"])?;
        // Threaded NAPI on both node ends (GRO on so that the veth has NAPI even without
        // an XDP program): the node's receive work runs in `napi/<iface>-*` kthreads that
        // the suite pins to the path core, instead of in the softirq of whichever core
        // sent the frame (FACTS.md, "A generator fast enough").
        for i in [&nc_if, &nb_if] {
            node.exec(&["ethtool", "-K", i, "gro", "on"])?;
            node.exec(&["sh", "-c", &format!("echo 1 > /sys/class/net/{i}/threaded")])?;
        }
        match ends {
            Ends::Udp => {
                // As a CNI leaves a Pod's end: GRO off (a veth's default), so no NAPI.
                backend.exec(&["ethtool", "-K", &b_if, "tx", "off", "gro", "off"])?;
            }
            Ends::Bulk {
                endpoint_cpu,
                path_cpu,
            } => {
                client.exec(&["ethtool", "-K", &c_if, "gro", "on"])?;
                client.exec(&[
                    "sh",
                    "-c",
                    &format!("echo 1 > /sys/class/net/{c_if}/threaded"),
                ])?;
                let rps = |ns: &Netns, iface: &str, cpu: u32| {
                    ns.exec(&[
                        "sh",
                        "-c",
                        &format!(
                            "echo {:x} > /sys/class/net/{iface}/queues/rx-0/rps_cpus",
                            1u64 << cpu
                        ),
                    ])
                };
                rps(&client, &c_if, endpoint_cpu)?;
                rps(&backend, &b_if, endpoint_cpu)?;
                rps(&node, &nc_if, path_cpu)?;
                rps(&node, &nb_if, path_cpu)?;
            }
        }
        let t = Topology {
            c_mac: mac_of(&client, &c_if)?,
            nc_mac: mac_of(&node, &nc_if)?,
            nb_mac: mac_of(&node, &nb_if)?,
            b_mac: mac_of(&backend, &b_if)?,
            client,
            node,
            backend,
            c_if,
            nc_if,
            nb_if,
            b_if,
        };
        // Static neighbours, so no scenario waits on ARP in its first packets.
        let mac = crate::packet::format_mac;
        t.node.exec(&[
            "ip",
            "neigh",
            "replace",
            "198.18.2.2",
            "lladdr",
            &mac(&t.b_mac),
            "dev",
            &t.nb_if,
            "nud",
            "permanent",
        ])?;
        t.node.exec(&[
            "ip",
            "neigh",
            "replace",
            "198.18.1.2",
            "lladdr",
            &mac(&t.c_mac),
            "dev",
            &t.nc_if,
            "nud",
            "permanent",
        ])?;
        t.client.exec(&[
            "ip",
            "neigh",
            "replace",
            "198.18.1.1",
            "lladdr",
            &mac(&t.nc_mac),
            "dev",
            &t.c_if,
            "nud",
            "permanent",
        ])?;
        t.backend.exec(&[
            "ip",
            "neigh",
            "replace",
            "198.18.2.1",
            "lladdr",
            &mac(&t.nb_mac),
            "dev",
            &t.b_if,
            "nud",
            "permanent",
        ])?;
        t.static_neighbours6()?;
        Ok(t)
    }

    /// The IPv6 neighbours, static as IPv4's: no neighbour discovery in a measured window.
    fn static_neighbours6(&self) -> Result<()> {
        let mac = crate::packet::format_mac;
        for (ns, ip, lladdr, dev) in [
            (&self.node, BACKEND_IP6, &self.b_mac, &self.nb_if),
            (&self.node, CLIENT_IP6, &self.c_mac, &self.nc_if),
            (&self.client, NODE_CLIENT_IP6, &self.nc_mac, &self.c_if),
            (&self.backend, NODE_BACKEND_IP6, &self.nb_mac, &self.b_if),
        ] {
            ns.exec(&[
                "ip",
                "-6",
                "neigh",
                "replace",
                &ip.to_string(),
                "lladdr",
                &mac(lladdr),
                "dev",
                dev,
                "nud",
                "permanent",
            ])?;
        }
        Ok(())
    }

    /// The names of the namespaces (for messages).
    pub fn describe(&self) -> String {
        format!(
            "{} -> {} -> {}",
            self.client.name(),
            self.node.name(),
            self.backend.name()
        )
    }
}

/// The IPv6 side of the links (`ifs`: client, node's client side, node's backend side,
/// backend): addresses without duplicate address detection (usable at once), the routes
/// as IPv4's (client and backend via the node, the flows' prefix via the client),
/// forwarding on in the node.
fn address_ipv6(client: &Netns, node: &Netns, backend: &Netns, ifs: [&str; 4]) -> Result<()> {
    let [c_if, nc_if, nb_if, b_if] = ifs;
    client.addr6(c_if, &format!("{CLIENT_IP6}/64"))?;
    node.addr6(nc_if, &format!("{NODE_CLIENT_IP6}/64"))?;
    node.addr6(nb_if, &format!("{NODE_BACKEND_IP6}/64"))?;
    backend.addr6(b_if, &format!("{BACKEND_IP6}/64"))?;
    let via = |ns: &Netns, to: &str, gw: Ipv6Addr| {
        ns.exec(&["ip", "-6", "route", "add", to, "via", &gw.to_string()])
    };
    via(client, "default", NODE_CLIENT_IP6)?;
    via(backend, "default", NODE_BACKEND_IP6)?;
    via(node, FLOW_NET6, CLIENT_IP6)?;
    node.exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])?;
    Ok(())
}
