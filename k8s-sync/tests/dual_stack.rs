//! IPv6 in AddressPools and a PreferDualStack Service against a real kube-apiserver (a
//! single-stack IPv4 cluster, as the test control plane is), with the real controller:
//!
//! * the CRD's CEL rule takes IPv6 CIDRs, ranges and addresses, and pools holding both
//!   families, and refuses a range across families and an IPv6 CIDR with host bits;
//! * the pool status counts both families, capped at int64 (a /64 alone holds 2^64);
//! * a PreferDualStack Service (one family here: the cluster is IPv4-only) is served on
//!   IPv4, its requested-ip annotation listing one address per family, and its record
//!   lists the VIP in `status.vips`.

mod common;

use anyhow::{ensure, Result};
use common::*;

const POOLS: &str = "apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: dual}
spec: {advertiseMode: bgp, addresses: [198.18.2.0/30, 2001:db8:2::/64, 2001:db8:3::10-2001:db8:3::1f]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: ExternalNetwork
metadata: {name: public}
spec: {type: bgp, addressPools: [dual]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: BGPAdvertisement
metadata: {name: all}
spec: {}
";

fn bad_pool(entry: &str) -> String {
    format!(
        "apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {{name: bad}}
spec: {{advertiseMode: bgp, addresses: [\"{entry}\"]}}
"
    )
}

#[test]
fn ipv6_pools_and_a_prefer_dual_stack_service() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.62.1")])?;
    env.apply(POOLS)?;
    for entry in ["198.18.2.1-2001:db8::1", "2001:db8::1/64", "2001:db8::/129"] {
        let r = env.apply(&bad_pool(entry));
        ensure!(
            r.as_ref()
                .is_err_and(|e| format!("{e:#}").contains("each address must be")),
            "{entry} must be refused by the schema's rule: {r:?}"
        );
    }
    let _ctl = env.controller("c1")?;

    let st = eventually("dual's status", || {
        let p = env.get("addresspool", "dual", None)?;
        Ok(p.map(|p| p["status"].clone())
            .filter(|s| s["addressesTotal"].is_u64()))
    })?;
    // 2 + (2^64 - 1) + 16 addresses: capped, not wrapped.
    assert_eq!(st["addressesTotal"], i64::MAX);

    env.apply(&service(
        "web",
        &[(
            "juneau.loutres.me/load-balancer-requested-ip",
            "2001:db8:2::5,198.18.2.2",
        )],
        "  ipFamilyPolicy: PreferDualStack\n",
    ))?;
    let shown = eventually("web's ingress", || ingress_ip(&env, "web"))?;
    assert_eq!(shown, "198.18.2.2");
    let st = eventually("web's record", || {
        Ok(slb_status(&env, "web")?.filter(|s| s["vips"].is_array()))
    })?;
    assert_eq!(st["vip"], "198.18.2.2");
    assert_eq!(st["vips"][0]["family"], "IPv4");
    assert_eq!(st["vips"][0]["addressPool"], "dual");
    assert_eq!(st["vips"].as_array().map(Vec::len), Some(1));
    Ok(())
}
