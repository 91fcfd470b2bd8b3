//! `helm uninstall` on the lab's real cluster (real kubelets, BIRD with graceful restart
//! and BFD, Juneau installed by its chart from the image built here) leaves nothing of
//! Juneau on any node: no XDP program attached, nothing pinned under the node's bpffs
//! directory, no file of the node in /run/juneau, no nft or iptables rule mentioning
//! juneau; and the router has no route to the VIP promptly (well under the graceful
//! restart time a speaker that dies without a NOTIFICATION leaves it). Then a fresh
//! `helm install` serves the VIP again, and tearing the lab down leaves nothing.
//!
//! Needs root and what tests/setup.sh installs. It brings up the one lab of the machine
//! (netns jlab-*, /run/juneau-lab), so it fails if a lab is already up.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use juneau_tests::daemon::wait_for;
use juneau_tests::install::NAMESPACE;
use juneau_tests::lab::{
    self, in_ns, kubectl, node_leftovers, router_next_hops, JuneauBins, Lab, JUNEAU_ROLLOUT, NODES,
    VIP,
};

/// The router's graceful-restart time (tests/src/lab.rs): what a speaker that vanishes
/// without a NOTIFICATION leaves the stale routes for. An uninstall must withdraw far
/// sooner.
const ROUTES_GONE_WITHIN: Duration = Duration::from_secs(30);

#[test]
fn helm_uninstall_leaves_nothing_on_any_node_and_install_works_again() -> Result<()> {
    lab::clear_leftovers_or_refuse()?;
    let bins = JuneauBins::build_and_locate()?;
    let mut lab = Lab::up(bins)?;
    let result = scenario(&mut lab);
    if let Err(e) = &result {
        lab::keep_logs_and_outcome(&format!("{e:?}"));
    }
    drop(lab);
    lab::check_nothing_left()?;
    result
}

fn scenario(lab: &mut Lab) -> Result<()> {
    wait_for(
        "the router's route to the VIP over node-a and node-c",
        Duration::from_secs(120),
        Duration::from_millis(250),
        || Ok((router_next_hops()?.len() == 2).then_some(())),
    )?;
    let bird = lab.bird()?;
    let release = lab.release();

    let t0 = Instant::now();
    let out = release
        .uninstall(JUNEAU_ROLLOUT)
        .context("helm uninstall")?;
    let took = t0.elapsed();
    println!("helm uninstall took {took:.1?}:\n{out}");
    // The router: no BGP route and no kernel route to the VIP, checked at once and for
    // at most ROUTES_GONE_WITHIN since the uninstall began.
    let gone = wait_for(
        "the router without any route to the VIP",
        ROUTES_GONE_WITHIN.saturating_sub(took),
        Duration::from_millis(100),
        || {
            let bgp = bird.bgp_nexthops(VIP)?;
            let kernel = router_next_hops()?;
            Ok((bgp.is_empty() && kernel.is_empty()).then(|| t0.elapsed()))
        },
    )
    .with_context(|| {
        format!(
            "{:.1?} after helm uninstall began; BIRD: {}",
            t0.elapsed(),
            bird.route_text(VIP).unwrap_or_default()
        )
    })?;
    println!("router without a route to {VIP} {gone:.1?} after helm uninstall began");

    // The node Pods go (helm --wait waited for the DaemonSet; its Pods terminate after).
    wait_for(
        "every juneau-node Pod gone",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || {
            let pods = kubectl(&["-n", NAMESPACE, "get", "pods", "-o", "name"])?;
            Ok(pods.trim().is_empty().then_some(()))
        },
    )?;
    let mut left = Vec::new();
    for n in NODES {
        left.extend(node_leftovers(n.name)?);
    }
    ensure!(
        left.is_empty(),
        "helm uninstall left on the nodes:\n  {}",
        left.join("\n  ")
    );
    let page = in_ns(
        "client",
        &["curl", "-sS", "-m", "3", &format!("http://{VIP}/")],
    );
    ensure!(
        page.is_err(),
        "the VIP still answers after uninstall: {page:?}"
    );

    // A fresh install serves again.
    release
        .install(&[], JUNEAU_ROLLOUT)
        .context("helm install again")?;
    wait_for(
        "the router's route to the VIP over node-a and node-c again",
        Duration::from_secs(120),
        Duration::from_millis(250),
        || Ok((router_next_hops()?.len() == 2).then_some(())),
    )?;
    let page = wait_for(
        "curl through the VIP after the new install",
        Duration::from_secs(60),
        Duration::from_secs(1),
        || {
            Ok(in_ns(
                "client",
                &["curl", "-sS", "-m", "5", &format!("http://{VIP}/")],
            )
            .ok()
            .filter(|p| p.contains("Welcome to nginx")))
        },
    )?;
    ensure!(page.contains("Welcome to nginx"));
    Ok(())
}
