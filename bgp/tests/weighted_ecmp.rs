//! Weighted ECMP against FRR: each node announces the VIP with the link-bandwidth
//! extended community in proportion to its Ready local Pods (`AdvertisedVip.weight`);
//! FRR (weighted ECMP by link bandwidth, `bgp bestpath bandwidth`) installs the kernel
//! route with nexthop weights in that proportion: 2 Pods on node 0 and 1 on node 1 give
//! 2:1, and a Pod added on node 1 makes it 1:1. The same for an IPv6 VIP (over the IPv4
//! sessions, with the nodes' IPv6 next hops).

mod common;

use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;
use std::time::Duration;

use anyhow::Result;
use common::*;
use juneau_control::model::AdvertisedVip;

const UP: Duration = Duration::from_secs(60);

const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);

/// (next hop, weight) of the kernel route to `vip` in the router namespace.
fn kernel_weights<A: FromStr + Ord>(topo: &Topo, vip: IpAddr) -> Result<Vec<(A, u32)>>
where
    A::Err: std::error::Error + Send + Sync + 'static,
{
    let (family, prefix) = match vip {
        IpAddr::V4(v) => ("-4", format!("{v}/32")),
        IpAddr::V6(v) => ("-6", format!("{v}/128")),
    };
    let out = topo
        .router
        .exec(&["ip", family, "route", "show", &prefix])?;
    let words: Vec<&str> = out.split_whitespace().collect();
    let mut v = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if *w != "via" {
            continue;
        }
        let hop: A = words[i + 1].parse()?;
        // This nexthop's words run up to the next `nexthop` (or the end).
        let rest = &words[i + 2..];
        let end = rest
            .iter()
            .position(|w| *w == "nexthop")
            .unwrap_or(rest.len());
        let weight = rest[..end]
            .windows(2)
            .find(|p| p[0] == "weight")
            .and_then(|p| p[1].parse().ok())
            .unwrap_or(1);
        v.push((hop, weight));
    }
    v.sort();
    Ok(v)
}

fn publish(s: &mut Speaker, vip: IpAddr, pods: u32) -> Result<()> {
    let mut st = s.state.clone();
    st.advertised = vec![AdvertisedVip {
        vip,
        communities: vec![],
        large_communities: vec![],
        local_pref: None,
        peers: vec![],
        weight: Some(pods),
    }];
    s.publish_state(&st)
}

fn wait_ratio<A: FromStr + Ord>(topo: &Topo, vip: IpAddr, want: f64) -> Result<Vec<(A, u32)>>
where
    A::Err: std::error::Error + Send + Sync + 'static,
{
    wait_for(&format!("kernel nexthop weights {want}:1"), UP, || {
        let w = kernel_weights(topo, vip)?;
        if w.len() != 2 {
            return Ok(None);
        }
        let ratio = f64::from(w[0].1) / f64::from(w[1].1);
        Ok(((ratio - want).abs() / want < 0.1).then_some(w))
    })
}

/// FRR weighing the two nodes' paths to `vip` by link bandwidth, over IPv4 sessions
/// (IPv6 unicast activated too when `vip` is IPv6); `A`: the next hops' family.
fn frr_spreads<A>(tag: &str, vip: IpAddr, node0_hop: A) -> Result<()>
where
    A: FromStr + Ord + PartialEq + std::fmt::Debug,
    A::Err: std::error::Error + Send + Sync + 'static,
{
    let topo = Topo::new(tag, 2)?;
    topo.add_ipv6()?;
    let mut cfg = format!(
        "frr defaults traditional\nhostname router\nlog stdout debugging\n!\nrouter bgp {ROUTER_ASN}\n \
         bgp router-id {}\n no bgp ebgp-requires-policy\n bgp bestpath as-path multipath-relax\n \
         bgp bestpath bandwidth default-weight-for-missing\n",
        router_addr(0)
    );
    for n in 0..2 {
        let na = node_addr(n);
        cfg += &format!(
            " neighbor {na} remote-as {NODE_ASN}\n neighbor {na} timers 3 9\n neighbor {na} timers connect 1\n"
        );
    }
    cfg += " address-family ipv4 unicast\n  maximum-paths 8\n exit-address-family\n";
    cfg += " address-family ipv6 unicast\n  maximum-paths 8\n";
    for n in 0..2 {
        cfg += &format!("  neighbor {} activate\n", node_addr(n));
    }
    cfg += " exit-address-family\n!\n";
    let router = Router::start_frr_with_config(&topo, &cfg, None)?;
    let mut n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    let mut n1 = Speaker::start(&topo, 1, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    n1.wait_established("router", UP)?;

    publish(&mut n0, vip, 2)?;
    publish(&mut n1, vip, 1)?;
    let w = wait_ratio::<A>(&topo, vip, 2.0).map_err(|e| {
        e.context(format!(
            "{:?}\n{}",
            kernel_weights::<A>(&topo, vip),
            router.logs()
        ))
    })?;
    println!("{vip}: 2 Pods / 1 Pod: kernel weights {w:?}");
    assert_eq!(w[0].0, node0_hop);

    // A Pod is added on node 1: 2 / 2.
    publish(&mut n1, vip, 2)?;
    let w = wait_ratio::<A>(&topo, vip, 1.0)?;
    println!("{vip}: 2 Pods / 2 Pods: kernel weights {w:?}");
    Ok(())
}

#[test]
fn frr_spreads_per_pod_with_link_bandwidth() -> Result<()> {
    frr_spreads("wecmp", VIP.into(), node_addr(0))
}

#[test]
fn frr_spreads_an_ipv6_vip_per_pod_with_link_bandwidth() -> Result<()> {
    frr_spreads("wecmp6", VIP6.into(), node_addr6(0))
}
