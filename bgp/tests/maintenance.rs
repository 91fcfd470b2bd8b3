//! Graceful maintenance (RFC 8326) against BIRD 2 and FRR: two nodes announce a VIP (ECMP
//! in the router's kernel); node 0 goes into maintenance (its peer config gets `drain`,
//! as the agent sets it when one of the peer's triggers holds: k8s-sync's
//! `maintenance`; each trigger in the lab, `lab_e2e`): it
//! re-announces less preferred (AS_PATH prepended, GRACEFUL_SHUTDOWN community), so the
//! router takes it out of the kernel's ECMP route while still holding its path, and only
//! after the configured wait is the path withdrawn. Ending the maintenance announces it
//! normally again.

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use common::*;
use juneau_control::model::DrainSettings;

const UP: Duration = Duration::from_secs(60);
const WAIT: u16 = 4;

fn drain(kind: RouterKind) -> Result<()> {
    let topo = Topo::new(&format!("m{kind:?}").to_lowercase(), 2)?;
    let neighbors = [0, 1].map(|node| Neighbor {
        node,
        password: None,
    });
    let router = Router::start(&topo, kind, &neighbors)?;
    let mut n0 = Speaker::start(&topo, 0, &NodePeering::default())?;
    let mut n1 = Speaker::start(&topo, 1, &NodePeering::default())?;
    n0.wait_established("router", UP)?;
    n1.wait_established("router", UP)?;
    n0.publish_vips(&[VIP])?;
    n1.publish_vips(&[VIP])?;
    router.wait_nexthops(VIP, &[node_addr(0), node_addr(1)], UP)?;
    wait_for("ECMP over both nodes in the router's kernel", UP, || {
        Ok((topo.kernel_nexthops(VIP)? == vec![node_addr(0), node_addr(1)]).then_some(()))
    })?;

    // Cordon node 0.
    let mut st = n0.state.clone();
    st.peers[0].drain = Some(DrainSettings {
        as_path_prepend: 2,
        local_pref: 0,
        wait_seconds: WAIT,
    });
    let t0 = Instant::now();
    n0.publish_state(&st)?;
    // 1. Less preferred: out of the kernel's ECMP route, but its path is still there.
    wait_for("node 0 out of the kernel route", UP, || {
        Ok((topo.kernel_nexthops(VIP)? == vec![node_addr(1)]).then_some(()))
    })
    .map_err(|e| e.context(router.logs()))?;
    let depreferred = t0.elapsed();
    assert_eq!(
        router.bgp_nexthops(VIP)?,
        vec![node_addr(0), node_addr(1)],
        "node 0's path is still held while it loses preference"
    );
    let text = router.route_text(VIP)?;
    let (prepended, gshut) = match kind {
        RouterKind::Bird => ("65001 65001 65001", "(65535,0)"),
        _ => ("65001 65001 65001", "graceful-shutdown"),
    };
    assert!(
        text.contains(prepended),
        "{kind:?}: no prepended AS_PATH in\n{text}"
    );
    assert!(
        text.contains(gshut),
        "{kind:?}: no GRACEFUL_SHUTDOWN in\n{text}"
    );
    assert!(
        depreferred < Duration::from_secs(u64::from(WAIT)),
        "lost preference after {depreferred:?}, before the withdrawal"
    );
    record(
        kind,
        "maintenance: drain set -> out of the kernel route",
        depreferred,
    );

    // 2. Withdrawn after the wait.
    router.wait_nexthops(VIP, &[node_addr(1)], UP)?;
    let withdrawn = t0.elapsed();
    record(kind, "maintenance: drain set -> withdrawn", withdrawn);
    assert!(
        withdrawn >= Duration::from_secs(u64::from(WAIT)),
        "withdrawn after {withdrawn:?}, before the {WAIT} s wait"
    );
    assert_eq!(topo.kernel_nexthops(VIP)?, vec![node_addr(1)]);

    // 3. Uncordoned: back to normal, ECMP again.
    st.peers[0].drain = None;
    n0.publish_state(&st)?;
    router.wait_nexthops(VIP, &[node_addr(0), node_addr(1)], UP)?;
    wait_for("ECMP over both nodes again", UP, || {
        Ok((topo.kernel_nexthops(VIP)? == vec![node_addr(0), node_addr(1)]).then_some(()))
    })?;
    Ok(())
}

#[test]
fn bird_sees_a_node_in_maintenance_lose_preference_before_it_is_withdrawn() -> Result<()> {
    drain(RouterKind::Bird)
}

#[test]
fn frr_sees_a_node_in_maintenance_lose_preference_before_it_is_withdrawn() -> Result<()> {
    drain(RouterKind::Frr)
}
