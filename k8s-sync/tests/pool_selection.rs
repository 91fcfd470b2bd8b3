//! AddressPools' `serviceAllocation` against a real kube-apiserver, with the real
//! controller on its ServiceAccount's token (so it must be allowed to watch Namespaces):
//! a Service in a namespace labelled `env=prod` gets its VIP from the prod pool (it has
//! priority over the general one), a Service elsewhere from the general pool, and one
//! that asks for a prod address from outside fails with `RequestedIPNotAllowed` and a
//! Warning Event; labelling its namespace afterwards serves it.

mod common;

use anyhow::{ensure, Result};
use common::*;

const OBJECTS: &str = "apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {env: prod}}
---
apiVersion: v1
kind: Namespace
metadata: {name: lab}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: general}
spec: {advertiseMode: bgp, addresses: [198.18.3.0/30]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata: {name: prod}
spec:
  advertiseMode: bgp
  addresses: [198.18.4.0/30]
  serviceAllocation:
    priority: 1
    namespaceSelector: {matchLabels: {env: prod}}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: ExternalNetwork
metadata: {name: public}
spec: {type: bgp, addressPools: [general, prod]}
---
apiVersion: juneau.loutres.me/v1alpha1
kind: BGPAdvertisement
metadata: {name: all}
spec: {}
";

/// The seed's Service shape in namespace `ns`, with extra annotations.
fn service_in(ns: &str, name: &str, annotations: &[(&str, &str)]) -> String {
    service(name, annotations, "").replace("namespace: default", &format!("namespace: {ns}"))
}

/// `.status` of the ServiceLoadBalancer `ns/name`, once it has a phase.
fn status_in(env: &Env, ns: &str, name: &str) -> Result<Option<serde_json::Value>> {
    Ok(env
        .get("serviceloadbalancer", name, Some(ns))?
        .and_then(|v| v.get("status").cloned())
        .filter(|s| s.get("phase").is_some()))
}

#[test]
fn pools_serve_the_namespaces_and_services_their_allocation_selects() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[("node-a", "192.168.62.1")])?;
    env.apply(OBJECTS)?;
    let _ctl = env.controller("c1")?;
    env.apply(&service_in("shop", "web", &[]))?;
    env.apply(&service_in("lab", "web", &[]))?;
    let pool_of = |ns: &str| -> Result<String> {
        eventually(&format!("{ns}/web allocated"), || {
            Ok(status_in(&env, ns, "web")?
                .and_then(|s| s["addressPool"].as_str().map(String::from)))
        })
    };
    assert_eq!(
        pool_of("shop")?,
        "prod",
        "the labelled namespace: its own pool first"
    );
    assert_eq!(pool_of("lab")?, "general", "elsewhere: the general pool");

    // Asking for a prod address from an unlabelled namespace: refused, said, Event.
    env.apply(&service_in(
        "lab",
        "asks",
        &[("juneau.loutres.me/load-balancer-requested-ip", "198.18.4.2")],
    ))?;
    let st = eventually("lab/asks refused", || {
        Ok(status_in(&env, "lab", "asks")?.filter(|s| s["phase"] == "Failed"))
    })?;
    let vip_cond = st["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "VIPAllocated"))
        .cloned()
        .unwrap_or_default();
    ensure!(
        vip_cond["reason"] == "RequestedIPNotAllowed"
            && vip_cond["message"]
                .as_str()
                .is_some_and(|m| m.contains("AddressPool \"prod\"")),
        "{st}"
    );
    eventually("a RequestedIPNotAllowed Warning on lab/asks", || {
        Ok(env
            .events("lab", "asks")?
            .into_iter()
            .find(|(kind, reason, _)| kind == "Warning" && reason == "RequestedIPNotAllowed"))
    })?;

    // The namespace labelled: the same request is now served from the prod pool.
    env.kubectl(&["label", "namespace", "lab", "env=prod"])?;
    let st = eventually("lab/asks served once its namespace is labelled", || {
        Ok(status_in(&env, "lab", "asks")?.filter(|s| s["phase"] != "Failed"))
    })?;
    assert_eq!(st["vip"], "198.18.4.2", "{st}");
    assert_eq!(st["addressPool"], "prod", "{st}");
    // lab/web keeps the general address it held.
    assert_eq!(pool_of("lab")?, "general");

    // The annotation removed: the record's spec no longer has it (whichever way the
    // controller writes the spec, a field it no longer sets must go), and the Service
    // keeps the VIP it holds.
    env.kubectl(&[
        "annotate",
        "service",
        "asks",
        "-n",
        "lab",
        "juneau.loutres.me/load-balancer-requested-ip-",
    ])?;
    let spec = eventually("lab/asks's record without requestedIp", || {
        let r = env.json(&["get", "serviceloadbalancer", "asks", "-n", "lab"])?;
        Ok(r["spec"]
            .get("requestedIp")
            .is_none()
            .then(|| r["spec"].clone()))
    })?;
    assert_eq!(spec["serviceName"], "asks", "{spec}");
    let st = status_in(&env, "lab", "asks")?.unwrap_or_default();
    assert_eq!(st["vip"], "198.18.4.2", "{st}");
    Ok(())
}
