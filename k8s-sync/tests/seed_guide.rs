//! The seed guide, step by step, against a real kube-apiserver, with the real controller
//! and agents running on the ServiceAccount tokens of `deploy/rbac.yaml`; then requested
//! IPs, every bad input, backends moving, the shared-memory table following, and release.
//! One cluster for all of it (starting one is most of the time); each step is a function
//! of its own over the [`Guide`] the steps share, called in order by the one test.

mod common;

use std::net::Ipv4Addr;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use common::*;
use juneau_control::shm::NodeStateReader;
use juneau_control::{NodeState, Protocol};

const SEED_TREE: &str = "ServiceLoadBalancer  default/nginx  (vip: 203.0.113.10, phase: Ready)
├── parent Service  default/nginx  (type=LoadBalancer, externalTrafficPolicy=Local)
├── ExternalNetwork  public  type=bgp  pools=public-v4
├── AllocatedFrom  AddressPool/public-v4
├── Ports
│   └── TCP/80  ->  80
├── AdvertisingNodes  (2)
│   ├── node-a
│   └── node-c
└── Backends  totalReady=3  localReadyNodes=2
";

fn shm_state(path: &Path) -> Result<Option<NodeState>> {
    if !path.exists() {
        return Ok(None);
    }
    let mut r = NodeStateReader::open(path)?;
    Ok(Some(r.snapshot()?.state))
}

/// What every step of the guide's test works with.
struct Guide {
    env: Env,
    controller: Daemon,
    agent_a: Daemon,
    agent_c: Daemon,
    shm_a: std::path::PathBuf,
    shm_c: std::path::PathBuf,
    /// nginx's VIP, once allocated.
    vip: Ipv4Addr,
    _state_dir: tempfile::TempDir,
}

#[test]
fn seed_guide_and_everything_an_operator_sees() -> Result<()> {
    let env = Env::start()?;
    env.nodes(&[
        ("node-a", "192.168.50.1"),
        ("node-b", "192.168.50.2"),
        ("node-c", "192.168.50.3"),
    ])?;
    let state_dir = tempfile::tempdir()?;
    let shm_a = state_dir.path().join("node-a.state");
    let shm_c = state_dir.path().join("node-c.state");
    let mut g = Guide {
        controller: env.controller("replica-1")?,
        agent_a: env.agent("node-a", &shm_a)?,
        agent_c: env.agent("node-c", &shm_c)?,
        env,
        shm_a,
        shm_c,
        vip: Ipv4Addr::UNSPECIFIED,
        _state_dir: state_dir,
    };

    the_foreign_service_and_the_guides_nginx(&mut g)?;
    nginx_gets_its_vip_and_is_announced(&mut g)?;
    kubectl_shows_the_record(&mut g)?;
    the_agents_publish_their_tables(&mut g)?;
    bfd_authentication_reaches_the_node_state(&mut g)?;
    requested_addresses_are_honoured_once(&mut g)?;
    every_bad_input_is_refused(&mut g)?;
    the_foreign_service_was_never_touched(&mut g)?;
    backends_change_and_the_tables_follow(&mut g)?;
    an_excluded_node_withdraws(&mut g)?;
    deleting_the_service_releases_its_vip(&mut g)?;
    leaving_the_class_releases_the_vip(&mut g)?;
    the_processes_ran_unrefused(&mut g)?;
    Ok(())
}

/// A Service of another class, then the guide: ExternalNetwork, AddressPool, the nginx Service and its backends.
fn the_foreign_service_and_the_guides_nginx(g: &mut Guide) -> Result<()> {
    let Guide { env, .. } = g;
    // A Service of another class: Juneau must leave it strictly alone.
    env.apply(
        "apiVersion: v1\nkind: Service\nmetadata: {name: foreign, namespace: default}\n\
         spec: {type: LoadBalancer, loadBalancerClass: other.example/lb, externalTrafficPolicy: Local, \
         ports: [{port: 80, protocol: TCP}]}\n",
    )?;

    // 1. ExternalNetwork and AddressPool (+ the BGP setup the guide asks for).
    env.apply(SEED_NETWORK)?;
    // 2. The nginx Service exactly as in the guide, and its 3 backends.
    env.apply(
        "apiVersion: v1
kind: Service
metadata:
  name: nginx
  annotations:
    juneau.loutres.me/load-balancer-external-network: public
spec:
  type: LoadBalancer
  loadBalancerClass: juneau.loutres.me/load-balancer
  externalTrafficPolicy: Local
  selector:
    app: nginx
  ports:
    - name: http
      protocol: TCP
      port: 80
      targetPort: http
",
    )?;
    env.apply(&endpoint_slice(
        "nginx",
        "nginx-abc",
        &[
            ("10.244.1.10", "node-a", true, false),
            ("10.244.1.11", "node-a", true, false),
            ("10.244.3.10", "node-c", true, false),
        ],
        80,
    ))?;
    Ok(())
}

/// The VIP and the advertisement state of the guide's step 3.
fn nginx_gets_its_vip_and_is_announced(g: &mut Guide) -> Result<()> {
    let Guide {
        env, controller, ..
    } = g;
    // 3. VIP and advertisement state.
    let st = eventually("ServiceLoadBalancer nginx Ready", || {
        controller.check_running()?;
        Ok(slb_status(env, "nginx")?.filter(|s| s["phase"] == "Ready"))
    })?;
    let vip: Ipv4Addr = st["vip"].as_str().context("status.vip")?.parse()?;
    ensure!(
        vip.octets()[..3] == [203, 0, 113],
        "vip {vip} not in 203.0.113.0/24"
    );
    assert_eq!(st["addressPool"], "public-v4");
    assert_eq!(strs(&st["advertisingNodes"]), ["node-a", "node-c"]);
    assert_eq!(st["backendSummary"]["totalReady"], 3);
    assert_eq!(st["backendSummary"]["localReadyNodes"], 2);
    let conds = st["conditions"].as_array().context("conditions")?;
    for t in ["Supported", "VIPAllocated", "Advertised", "Ready"] {
        assert!(
            conds
                .iter()
                .any(|c| c["type"] == t && c["status"] == "True"),
            "condition {t} not True: {conds:?}"
        );
    }
    let shown = eventually("Service nginx ingress IP", || ingress_ip(env, "nginx"))?;
    assert_eq!(shown, vip.to_string());

    g.vip = vip;
    Ok(())
}

/// The record, its owner, `kubectl get` and `kubectl juneau describe` in every namespace form.
fn kubectl_shows_the_record(g: &mut Guide) -> Result<()> {
    let Guide { env, .. } = g;
    let vip = g.vip;
    // The ServiceLoadBalancer is owned by the Service; `kubectl get` shows the columns.
    let slb = env
        .get("serviceloadbalancer", "nginx", Some("default"))?
        .unwrap();
    let svc = env.get("service", "nginx", Some("default"))?.unwrap();
    assert_eq!(
        slb["metadata"]["ownerReferences"][0]["uid"],
        svc["metadata"]["uid"]
    );
    assert_eq!(slb["metadata"]["ownerReferences"][0]["kind"], "Service");
    // No finalizer: deleting a Service never waits for Juneau (its VIP is released
    // from the watch, deleting_the_service_releases_its_vip).
    assert!(
        strs(&svc["metadata"]["finalizers"]).is_empty(),
        "{}",
        svc["metadata"]
    );
    let table = env.kubectl(&["get", "serviceloadbalancers", "-n", "default"])?;
    let header = table.lines().next().unwrap_or_default();
    for col in ["VIP", "PHASE", "ADVERTISING NODES"] {
        assert!(header.contains(col), "column {col} missing: {table}");
    }
    assert!(
        table.contains(&vip.to_string()) && table.contains("Ready"),
        "{table}"
    );

    // kubectl juneau describe loadbalancer nginx: the seed tree, with our VIP.
    let out = kubectl_juneau(env, &["describe", "loadbalancer", "nginx"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout)?,
        SEED_TREE.replace("203.0.113.10", &vip.to_string())
    );
    let out = kubectl_juneau(env, &["describe", "loadbalancer", "nginx", "-n", "default"])?;
    assert!(out.status.success());
    let out = kubectl_juneau(env, &["describe", "loadbalancer", "missing"])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no ServiceLoadBalancer and no Service named \"missing\""),
        "{err}"
    );
    // The namespace comes from the kubeconfig context when -n is not given.
    env.kubectl(&["create", "namespace", "team"])?;
    env.apply(&service("web", &[], "").replace("namespace: default", "namespace: team"))?;
    eventually("team/web has its ServiceLoadBalancer", || {
        Ok(env
            .get("serviceloadbalancer", "web", Some("team"))?
            .and_then(|s| s["status"]["vip"].as_str().map(String::from)))
    })?;
    let team_kubeconfig = env.k.dir().join("team.kubeconfig");
    std::fs::write(
        &team_kubeconfig,
        std::fs::read_to_string(env.k.kubeconfig())?
            .replace("namespace: default", "namespace: team"),
    )?;
    let out = kubectl_juneau_with(&team_kubeconfig, &["describe", "lb", "web"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8(out.stdout)?
        .starts_with("ServiceLoadBalancer  team/web  (vip: 203.0.113."));
    let out = kubectl_juneau(env, &["describe", "loadbalancer", "web"])?;
    assert!(
        !out.status.success(),
        "web is not in the admin context's namespace"
    );

    let out = kubectl_juneau(env, &["describe", "loadbalancer", "foreign"])?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not managed by Juneau"));
    for args in [
        &["--help"][..],
        &["describe", "--help"],
        &["describe", "loadbalancer", "--help"],
    ] {
        let out = kubectl_juneau(env, args)?;
        assert!(out.status.success(), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage: kubectl juneau"),
            "{args:?}"
        );
    }

    Ok(())
}

/// The agents' shared-memory tables.
fn the_agents_publish_their_tables(g: &mut Guide) -> Result<()> {
    let Guide {
        agent_a,
        agent_c,
        shm_a,
        shm_c,
        ..
    } = g;
    let vip = g.vip;
    // The agents' shared-memory tables.
    let a = eventually("node-a state with 2 backends", || {
        agent_a.check_running()?;
        Ok(shm_state(shm_a)?.filter(|s| s.services.iter().any(|x| x.backends.len() == 2)))
    })?;
    // nginx, plus team/web (a VIP without backends: an empty table, not announced).
    assert_eq!(a.services.len(), 2, "{a:?}");
    let nginx_a = a
        .services
        .iter()
        .find(|x| x.frontend.vip == vip)
        .context("nginx frontend")?;
    assert_eq!(nginx_a.frontend.protocol, Protocol::Tcp);
    assert_eq!(nginx_a.frontend.port, 80);
    assert_eq!(nginx_a.backends.len(), 2);
    assert!(nginx_a.backends.iter().all(|b| b.port == 80));
    assert!(a
        .services
        .iter()
        .filter(|x| x.frontend.vip != vip)
        .all(|x| x.backends.is_empty()));
    assert_eq!(a.advertised.len(), 1);
    assert_eq!(a.advertised[0].vip, vip);
    assert_eq!(a.advertised[0].communities, vec![64512 << 16 | 100]);
    assert_eq!(a.advertised[0].local_pref, Some(150));
    assert_eq!(a.peers.len(), 1);
    assert_eq!(
        a.peers[0].md5_password.as_ref().map(|p| p.expose()),
        Some("s3cret")
    );
    assert_eq!(a.peers[0].hold_time, 9);
    assert_eq!(a.router_id, Some(Ipv4Addr::new(192, 168, 50, 1)));
    let hb = NodeStateReader::open(&shm_a)?.heartbeat_age();
    assert!(
        hb.is_some_and(|age| age < std::time::Duration::from_secs(30)),
        "agent heartbeat missing or stale: {hb:?}"
    );
    eventually("node-c state with 1 backend", || {
        agent_c.check_running()?;
        Ok(shm_state(shm_c)?.filter(|s| {
            s.services.iter().any(|x| x.backends.len() == 1) && s.advertised.len() == 1
        }))
    })?;

    Ok(())
}

/// BFD authentication: the key from its Secret reaches the node state.
fn bfd_authentication_reaches_the_node_state(g: &mut Guide) -> Result<()> {
    let Guide {
        env,
        agent_a,
        shm_a,
        ..
    } = g;
    // BFD authentication: the key from its Secret reaches the node state; the
    // BGPPeer as before afterwards.
    const TOR: &str = "apiVersion: juneau.loutres.me/v1alpha1\nkind: BGPPeer\nmetadata:\n  name: tor\nspec:\n  peerAddress: 192.0.2.1\n  peerASN: 65000\n  localASN: 65001\n  holdTimeSeconds: 9\n  passwordSecretRef:\n    name: tor-password\n";
    env.apply(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: tor-bfd-key\n  namespace: juneau-system\nstringData:\n  password: bfd-s3cret\n",
    )?;
    env.apply(&format!(
        "{TOR}  bfd:\n    authentication: {{type: meticulousKeyedSHA1, keyID: 3, secretRef: {{name: tor-bfd-key}}}}\n"
    ))?;
    let auth = eventually("node-a state with BFD authentication", || {
        agent_a.check_running()?;
        Ok(shm_state(shm_a)?.and_then(|s| s.peers.first().and_then(|p| p.bfd_auth.clone())))
    })?;
    assert_eq!(
        auth.auth_type,
        juneau_control::model::BfdAuthType::MeticulousKeyedSha1
    );
    assert_eq!(auth.key_id, 3);
    assert_eq!(auth.key.expose(), "bfd-s3cret");
    env.apply(TOR)?;
    eventually("node-a state without BFD again", || {
        Ok(shm_state(shm_a)?.filter(|s| s.peers.first().is_some_and(|p| p.bfd.is_none())))
    })?;

    Ok(())
}

/// Requested IPs: honoured, one holder at a time, the waiting Service served when freed.
fn requested_addresses_are_honoured_once(g: &mut Guide) -> Result<()> {
    let Guide { env, .. } = g;
    // Requested IP honoured.
    env.apply(&service(
        "req",
        &[(
            "juneau.loutres.me/load-balancer-requested-ip",
            "203.0.113.77",
        )],
        "",
    ))?;
    env.apply(&endpoint_slice(
        "req",
        "req-1",
        &[("10.244.1.20", "node-a", true, false)],
        8080,
    ))?;
    let st = eventually("req Ready", || {
        Ok(slb_status(env, "req")?.filter(|s| s["phase"] == "Ready"))
    })?;
    assert_eq!(st["vip"], "203.0.113.77");
    assert_eq!(
        eventually("req ingress", || ingress_ip(env, "req"))?,
        "203.0.113.77"
    );

    // Two Services asking for one IP: exactly one gets it.
    env.apply(&service(
        "dup-1",
        &[(
            "juneau.loutres.me/load-balancer-requested-ip",
            "203.0.113.99",
        )],
        "",
    ))?;
    env.apply(&service(
        "dup-2",
        &[(
            "juneau.loutres.me/load-balancer-requested-ip",
            "203.0.113.99",
        )],
        "",
    ))?;
    let (s1, s2) = eventually("dup-1 and dup-2 decided", || {
        Ok(
            match (slb_status(env, "dup-1")?, slb_status(env, "dup-2")?) {
                (Some(a), Some(b)) => Some((a, b)),
                _ => None,
            },
        )
    })?;
    let holders: Vec<_> = [&s1, &s2]
        .iter()
        .filter(|s| s["vip"] == "203.0.113.99")
        .map(|_| ())
        .collect();
    assert_eq!(holders.len(), 1, "{s1:?} {s2:?}");
    let loser = if s1["vip"] == "203.0.113.99" {
        "dup-2"
    } else {
        "dup-1"
    };
    let loser_st = slb_status(env, loser)?.unwrap();
    assert!(loser_st.get("vip").is_none(), "{loser_st:?}");
    assert_eq!(ingress_ip(env, loser)?, None);
    let ev = eventually("RequestedIPTaken event", || {
        Ok(env
            .events("default", loser)?
            .into_iter()
            .find(|e| e.1 == "RequestedIPTaken"))
    })?;
    assert_eq!(ev.0, "Warning");
    assert!(ev.2.contains("203.0.113.99"), "{ev:?}");

    // When the holder goes away, the waiting Service gets the address by itself.
    let winner = if loser == "dup-1" { "dup-2" } else { "dup-1" };
    env.kubectl(&[
        "delete",
        "service",
        winner,
        "-n",
        "default",
        "--wait=true",
        "--timeout=60s",
    ])?;
    eventually("the waiting Service gets 203.0.113.99", || {
        Ok(slb_status(env, loser)?.filter(|s| s["vip"] == "203.0.113.99"))
    })?;

    Ok(())
}

/// Every bad input: its condition, its Event, phase not Ready, nothing advertised; and what the schema refuses.
fn every_bad_input_is_refused(g: &mut Guide) -> Result<()> {
    let Guide { env, shm_c, .. } = g;
    // Every bad input: its condition, its Event, phase not Ready, nothing advertised.
    env.apply(
        "apiVersion: juneau.loutres.me/v1alpha1\nkind: AddressPool\nmetadata: {name: tiny}\n\
         spec: {advertiseMode: bgp, addresses: [198.51.100.7/32]}\n---\n\
         apiVersion: juneau.loutres.me/v1alpha1\nkind: ExternalNetwork\nmetadata: {name: tiny}\n\
         spec: {type: bgp, addressPools: [tiny]}\n---\n\
         apiVersion: juneau.loutres.me/v1alpha1\nkind: ExternalNetwork\nmetadata: {name: dangling}\n\
         spec: {type: bgp, addressPools: [no-such-pool]}\n",
    )?;
    let no_net = "apiVersion: v1\nkind: Service\nmetadata: {name: bad-no-network, namespace: default}\n\
         spec: {type: LoadBalancer, loadBalancerClass: juneau.loutres.me/load-balancer, externalTrafficPolicy: Local, \
         ports: [{port: 80, protocol: TCP}]}\n";
    env.apply(no_net)?;
    let mut tiny1 = service("tiny-1", &[], "");
    tiny1 = tiny1.replace("external-network: public", "external-network: tiny");
    env.apply(&tiny1)?;
    eventually("tiny-1 got the only address", || {
        Ok(slb_status(env, "tiny-1")?.filter(|s| s["vip"] == "198.51.100.7"))
    })?;
    let cases: Vec<(&str, String, &str, &str)> = vec![
        (
            "bad-sctp",
            service("bad-sctp", &[], "").replace("protocol: TCP", "protocol: SCTP"),
            "ProtocolNotSupported",
            "Failed",
        ),
        (
            "bad-ranges",
            service(
                "bad-ranges",
                &[],
                "  loadBalancerSourceRanges: [\"2001:db8::/32\"]\n",
            ),
            "InvalidSourceRanges",
            "Failed",
        ),
        (
            "bad-no-network",
            String::new(),
            "ExternalNetworkMissing",
            "Failed",
        ),
        (
            "bad-unknown-net",
            service("bad-unknown-net", &[], "")
                .replace("external-network: public", "external-network: nope"),
            "ExternalNetworkNotFound",
            "Failed",
        ),
        (
            "bad-dangling",
            service("bad-dangling", &[], "")
                .replace("external-network: public", "external-network: dangling"),
            "AddressPoolNotFound",
            "Failed",
        ),
        (
            "bad-outside",
            service(
                "bad-outside",
                &[(
                    "juneau.loutres.me/load-balancer-requested-ip",
                    "198.51.100.1",
                )],
                "",
            ),
            "RequestedIPOutsidePools",
            "Failed",
        ),
        (
            "bad-reqip",
            service(
                "bad-reqip",
                &[("juneau.loutres.me/load-balancer-requested-ip", "not-an-ip")],
                "",
            ),
            "RequestedIPInvalid",
            "Failed",
        ),
        (
            "tiny-2",
            service("tiny-2", &[], "")
                .replace("external-network: public", "external-network: tiny"),
            "AddressPoolExhausted",
            "Pending",
        ),
        (
            "bad-hostnet",
            // A host-network backend is served under the Local policy only (its node's
            // own stack delivers it; no node can hand a connection to it).
            service("bad-hostnet", &[], "").replace(
                "externalTrafficPolicy: Local",
                "externalTrafficPolicy: Cluster",
            ),
            "HostNetworkBackendsNeedLocalPolicy",
            "Failed",
        ),
    ];
    for (name, yaml, _, _) in &cases {
        if !yaml.is_empty() {
            env.apply(yaml)
                .with_context(|| format!("applying {name}"))?;
        }
    }
    env.apply(&endpoint_slice(
        "bad-hostnet",
        "bad-hostnet-1",
        &[("192.168.50.3", "node-c", true, false)],
        80,
    ))?;
    for (name, _, reason, phase) in &cases {
        let st = eventually(&format!("{name}: condition {reason}"), || {
            Ok(slb_status(env, name)?.filter(|s| {
                s["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["reason"] == *reason && c["status"] == "False")
                })
            }))
        })?;
        assert_eq!(st["phase"], *phase, "{name}: {st}");
        assert!(strs(&st["advertisingNodes"]).is_empty(), "{name}: {st}");
        assert_eq!(ingress_ip(env, name)?, None, "{name}");
        let ev = eventually(&format!("{name}: Event {reason}"), || {
            Ok(env
                .events("default", name)?
                .into_iter()
                .find(|e| e.1 == *reason))
        })?;
        assert_eq!(ev.0, "Warning", "{name}");
        assert!(ev.2.len() > 20, "{name}: message too terse: {ev:?}");
    }
    // Failed Services are not served by any agent (bad-hostnet has a Ready backend on
    // node-c).
    let c = shm_state(shm_c)?.unwrap();
    assert!(
        c.advertised
            .iter()
            .all(|a| matches!(a.vip, std::net::IpAddr::V4(v) if v.octets()[..3] == [203, 0, 113])),
        "{c:?}"
    );
    // The apiserver itself refuses what the schema forbids, with a message.
    for (bad, needle) in [
        (
            "advertiseMode: layer2\n  addresses: [192.0.2.0/24]",
            "advertiseMode",
        ),
        (
            "advertiseMode: bgp\n  addresses: [192.0.2.0/33]",
            "CIDR without host bits",
        ),
        (
            "advertiseMode: bgp\n  addresses: [192.0.2.1/24]",
            "CIDR without host bits",
        ),
    ] {
        let err = env
            .apply(&format!("apiVersion: juneau.loutres.me/v1alpha1\nkind: AddressPool\nmetadata: {{name: rejected}}\nspec:\n  {bad}\n"))
            .expect_err("apiserver must reject an invalid AddressPool")
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
    const PEER: &str = "peerAddress: 192.0.2.9\n  peerASN: 65000\n  localASN: 65001";
    for (spec, needle) in [
        (format!("{PEER}\n  holdTimeSeconds: 2"), "at least 3"),
        (
            format!("{PEER}\n  holdTimeSeconds: 9\n  keepaliveTimeSeconds: 9"),
            "keepaliveTimeSeconds must be below",
        ),
        (
            "peerASN: 65000\n  localASN: 65001".to_string(),
            "peerAddress",
        ),
        (
            "peerAddress: 192.0.2.999\n  peerASN: 65000\n  localASN: 65001".to_string(),
            "peerAddress",
        ),
        (
            "peerAddress: 192.0.2.9\n  peerASN: 0\n  localASN: 65001".to_string(),
            "peerASN",
        ),
        (
            format!("{PEER}\n  bfd: {{authentication: {{type: md5, keyID: 1, secretRef: {{name: k}}}}}}"),
            "meticulousKeyedSHA1",
        ),
        (
            format!("{PEER}\n  bfd: {{authentication: {{type: keyedSHA1, keyID: 256, secretRef: {{name: k}}}}}}"),
            "keyID",
        ),
    ] {
        let yaml = format!(
            "apiVersion: juneau.loutres.me/v1alpha1\nkind: BGPPeer\nmetadata: {{name: rejected}}\nspec:\n  {spec}\n"
        );
        let err = env
            .apply(&yaml)
            .expect_err("apiserver must reject an invalid BGPPeer")
            .to_string();
        assert!(err.contains(needle), "{spec}: {err}");
    }
    let err = env
        .apply(
            "apiVersion: juneau.loutres.me/v1alpha1\nkind: BGPAdvertisement\nmetadata: {name: rejected}\nspec:\n  communities: [\"70000:1\"]\n",
        )
        .expect_err("apiserver must reject a community out of range")
        .to_string();
    assert!(err.contains("a community is ASN:VALUE"), "{err}");
    let err = env
        .apply(&service(
            "bad-v6",
            &[],
            "  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n",
        ))
        .expect_err("an IPv4-only cluster refuses IPv6 Services")
        .to_string();
    assert!(err.contains("IPv6"), "{err}");
    Ok(())
}

/// The foreign Service was never touched.
fn the_foreign_service_was_never_touched(g: &mut Guide) -> Result<()> {
    let Guide { env, .. } = g;
    // The foreign Service was never touched.
    let foreign = env.get("service", "foreign", Some("default"))?.unwrap();
    assert!(foreign["metadata"]["finalizers"].is_null(), "{foreign}");
    assert!(
        foreign["status"]["loadBalancer"]["ingress"].is_null(),
        "{foreign}"
    );
    assert!(env
        .get("serviceloadbalancer", "foreign", Some("default"))?
        .is_none());
    assert!(env.events("default", "foreign")?.is_empty());

    Ok(())
}

/// Backends change: unready, terminating, moving — status and shared memory follow.
fn backends_change_and_the_tables_follow(g: &mut Guide) -> Result<()> {
    let Guide {
        env, shm_a, shm_c, ..
    } = g;
    let vip = g.vip;
    // Backends change: unready, terminating, moving — status and shared memory follow.
    env.apply(&endpoint_slice(
        "nginx",
        "nginx-abc",
        &[
            ("10.244.1.10", "node-a", true, false),
            ("10.244.1.11", "node-a", true, false),
            ("10.244.3.10", "node-c", false, false),
        ],
        80,
    ))?;
    eventually("node-c withdrawn", || {
        Ok(slb_status(env, "nginx")?.filter(|s| {
            strs(&s["advertisingNodes"]) == ["node-a"] && s["backendSummary"]["totalReady"] == 2
        }))
    })?;
    eventually("node-c shared memory: no backend, not advertised", || {
        Ok(shm_state(shm_c)?.filter(|s| {
            s.advertised.iter().all(|a| a.vip != vip)
                && s.services
                    .iter()
                    .filter(|x| x.frontend.vip == vip)
                    .all(|x| x.backends.is_empty())
        }))
    })?;
    env.apply(&endpoint_slice(
        "nginx",
        "nginx-abc",
        &[
            ("10.244.1.10", "node-a", true, true),
            ("10.244.1.11", "node-a", false, true),
            ("10.244.3.10", "node-c", false, false),
        ],
        80,
    ))?;
    let st = eventually("nobody advertises", || {
        Ok(slb_status(env, "nginx")?.filter(|s| strs(&s["advertisingNodes"]).is_empty()))
    })?;
    assert_eq!(st["phase"], "Pending");
    assert_eq!(
        st["vip"],
        vip.to_string(),
        "the VIP is kept while backends are away"
    );
    eventually("node-a shared memory drained", || {
        Ok(shm_state(shm_a)?.filter(|s| s.advertised.iter().all(|a| a.vip != vip)))
    })?;
    env.apply(&endpoint_slice(
        "nginx",
        "nginx-abc",
        &[
            ("10.244.3.11", "node-c", true, false),
            ("10.244.3.12", "node-c", true, false),
        ],
        8080,
    ))?;
    eventually("moved to node-c", || {
        Ok(slb_status(env, "nginx")?
            .filter(|s| strs(&s["advertisingNodes"]) == ["node-c"] && s["phase"] == "Ready"))
    })?;
    let c = eventually("node-c shared memory has the moved backends", || {
        Ok(shm_state(shm_c)?.filter(|s| s.advertised.iter().any(|a| a.vip == vip)))
    })?;
    let svc_c = c.services.iter().find(|x| x.frontend.vip == vip).unwrap();
    assert_eq!(svc_c.backends.len(), 2);
    assert!(
        svc_c.backends.iter().all(|b| b.port == 8080),
        "named targetPort resolved from the slice: {svc_c:?}"
    );
    Ok(())
}

/// Excluding node-c from external load balancers withdraws it.
fn an_excluded_node_withdraws(g: &mut Guide) -> Result<()> {
    let Guide { env, shm_c, .. } = g;
    // Excluding node-c from external load balancers withdraws it too: the controller at
    // once; the node through graceful maintenance (the label is a default trigger:
    // every peer drains, and the speaker withdraws after the wait, docs/bgp.md).
    env.kubectl(&[
        "label",
        "node",
        "node-c",
        "node.kubernetes.io/exclude-from-external-load-balancers=",
    ])?;
    eventually("excluded node withdrawn", || {
        Ok(slb_status(env, "nginx")?.filter(|s| strs(&s["advertisingNodes"]).is_empty()))
    })?;
    eventually(
        "excluded node's peers draining in its shared memory",
        || {
            Ok(shm_state(shm_c)?
                .filter(|s| !s.peers.is_empty() && s.peers.iter().all(|p| p.drain.is_some())))
        },
    )?;
    env.kubectl(&[
        "label",
        "node",
        "node-c",
        "node.kubernetes.io/exclude-from-external-load-balancers-",
    ])?;

    Ok(())
}

/// Service deleted: record gone, VIP released and reusable.
fn deleting_the_service_releases_its_vip(g: &mut Guide) -> Result<()> {
    let Guide { env, shm_c, .. } = g;
    let vip = g.vip;
    // The finalizer earlier releases put on Services goes at the next reconcile.
    env.kubectl(&[
        "patch",
        "service",
        "nginx",
        "-n",
        "default",
        "--type=json",
        "-p",
        r#"[{"op":"add","path":"/metadata/finalizers","value":["juneau.loutres.me/load-balancer"]}]"#,
    ])?;
    eventually("the earlier releases' finalizer removed", || {
        let svc = env
            .get("service", "nginx", Some("default"))?
            .unwrap_or_default();
        Ok(strs(&svc["metadata"]["finalizers"])
            .is_empty()
            .then_some(()))
    })?;
    // Service deleted: SLB gone, VIP released and reusable.
    env.kubectl(&[
        "delete",
        "service",
        "nginx",
        "-n",
        "default",
        "--wait=true",
        "--timeout=60s",
    ])?;
    eventually("nginx ServiceLoadBalancer gone", || {
        Ok(env
            .get("serviceloadbalancer", "nginx", Some("default"))?
            .is_none()
            .then_some(()))
    })?;
    env.apply(&service(
        "reuse",
        &[(
            "juneau.loutres.me/load-balancer-requested-ip",
            &vip.to_string(),
        )],
        "",
    ))?;
    eventually("reuse got the released VIP", || {
        Ok(slb_status(env, "reuse")?.filter(|s| s["vip"] == vip.to_string()))
    })?;
    eventually("agents forget nginx", || {
        Ok(shm_state(shm_c)?.filter(|s| {
            s.services
                .iter()
                .all(|x| x.frontend.vip != vip || x.backends.is_empty())
        }))
    })?;

    Ok(())
}

/// Leaving the class releases the VIP and removes Juneau's marks.
fn leaving_the_class_releases_the_vip(g: &mut Guide) -> Result<()> {
    let Guide { env, .. } = g;
    // Leaving the class releases the VIP and removes Juneau's marks.
    env.kubectl(&[
        "delete",
        "service",
        "dup-1",
        "dup-2",
        "--ignore-not-found",
        "-n",
        "default",
        "--wait=true",
        "--timeout=60s",
    ])?;
    env.kubectl(&[
        "patch",
        "service",
        "req",
        "-n",
        "default",
        "--type=merge",
        "-p",
        r#"{"spec":{"loadBalancerClass":null,"type":"ClusterIP","externalTrafficPolicy":null}}"#,
    ])?;
    eventually("req released", || {
        Ok(env
            .get("serviceloadbalancer", "req", Some("default"))?
            .is_none()
            .then_some(()))
    })?;
    env.apply(&service(
        "after-req",
        &[(
            "juneau.loutres.me/load-balancer-requested-ip",
            "203.0.113.77",
        )],
        "",
    ))?;
    eventually("203.0.113.77 reusable", || {
        Ok(slb_status(env, "after-req")?.filter(|s| s["vip"] == "203.0.113.77"))
    })?;

    Ok(())
}

/// The processes still run, and no RBAC denial is in their logs.
fn the_processes_ran_unrefused(g: &mut Guide) -> Result<()> {
    let Guide {
        controller,
        agent_a,
        agent_c,
        ..
    } = g;
    controller.check_running()?;
    agent_a.check_running()?;
    agent_c.check_running()?;
    // The processes ran as ServiceAccounts: no RBAC denials in their logs.
    for d in [&controller, &agent_a, &agent_c] {
        let log = d.log_text();
        assert!(
            !log.contains("forbidden"),
            "{} hit RBAC denials:\n{}",
            d.name,
            tail(&log, 40)
        );
    }
    Ok(())
}
