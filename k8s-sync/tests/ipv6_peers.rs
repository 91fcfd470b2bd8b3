//! IPv6 BGPPeers (issue 28) against a real kube-apiserver: the CRD admits an IPv6
//! `peerAddress` with an IPv6 `sourceAddress`, and the real agent publishes the peer
//! (addresses and TCP-MD5 password) into the node state file (layout 9) beside the
//! IPv4 one. Bad input first: a link-local or IPv4-mapped address, or a source of the
//! other family, is refused by the apiserver with a message saying why.

mod common;

use std::net::IpAddr;

use anyhow::{ensure, Result};
use common::*;
use juneau_control::shm::NodeStateReader;

fn peer(name: &str, address: &str, source: Option<&str>) -> String {
    let source = source
        .map(|s| format!("  sourceAddress: \"{s}\"\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: juneau.loutres.me/v1alpha1\nkind: BGPPeer\nmetadata:\n  name: {name}\nspec:\n  \
         peerAddress: \"{address}\"\n{source}  peerASN: 65000\n  localASN: 65001\n  \
         passwordSecretRef:\n    name: tor-password\n"
    )
}

#[test]
fn an_ipv6_bgppeer_reaches_the_node_state_and_bad_addresses_are_refused() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.64.1")])?;
    env.apply(SEED_NETWORK)?;

    for (address, source, says) in [
        ("fe80::1", None, "global (or unique-local) IPv6 address"),
        (
            "::ffff:192.0.2.1",
            None,
            "global (or unique-local) IPv6 address",
        ),
        (
            "2001:db8::1",
            Some("192.0.2.11"),
            "sourceAddress must be of the family",
        ),
        (
            "192.0.2.1",
            Some("2001:db8::11"),
            "sourceAddress must be of the family",
        ),
        ("tor.example", None, "global (or unique-local) IPv6 address"),
    ] {
        let e = env
            .apply(&peer("bad", address, source))
            .err()
            .ok_or_else(|| anyhow::anyhow!("{address} / {source:?} was admitted"))?;
        let msg = format!("{e:#}");
        ensure!(msg.contains(says), "{address} / {source:?}: {msg}");
    }

    env.apply(&peer("tor-v6", "2001:db8::1", Some("2001:db8::11")))?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("node-a.state");
    let mut agent = env.agent("node-a", &path)?;
    let state = eventually("both peers in the node state", || {
        agent.check_running()?;
        if !path.exists() {
            return Ok(None);
        }
        let s = NodeStateReader::open(&path)?.snapshot()?.state;
        Ok((s.peers.len() == 2).then_some(s))
    })?;
    let v6 = state
        .peers
        .iter()
        .find(|p| p.name == "tor-v6")
        .expect("listed");
    assert_eq!(v6.peer_address, "2001:db8::1".parse::<IpAddr>()?);
    assert_eq!(v6.source_address, Some("2001:db8::11".parse()?));
    assert_eq!(
        v6.md5_password.as_ref().map(|p| p.expose().to_string()),
        Some("s3cret".to_string())
    );
    let v4 = state
        .peers
        .iter()
        .find(|p| p.name == "tor")
        .expect("listed");
    assert_eq!(v4.peer_address, "192.0.2.1".parse::<IpAddr>()?);
    Ok(())
}
