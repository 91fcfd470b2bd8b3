//! Installing and watching Juneau the way operators do, with the real tools:
//!
//! * the alert rules pass `promtool check rules` and their unit tests
//!   (`promtool test rules`), and the PrometheusRule and the chart carry the same rules;
//! * the Helm chart (real `helm`, built by `tests/k8s/build.sh`) lints, renders exactly the
//!   objects of `kubectl kustomize deploy/`, and the apiserver accepts its output
//!   (`kubectl apply --dry-run=server`), also with pools, peers and advertisements set;
//! * a real Prometheus (Debian's) scrapes a real controller and agent: the key series
//!   match what the test did, every Grafana dashboard panel's query returns data, the
//!   rules load, and the VIP-not-announced alert goes pending for a VIP no agent
//!   announces (and only for it).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{ensure, Context, Result};
use common::*;
use juneau_tests::prometheus::{PromApi, Prometheus, PrometheusSpec, Target};
use serde_json::Value;

fn monitoring() -> PathBuf {
    repo_root().join("deploy/monitoring")
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn promtool() -> Result<PathBuf> {
    let p = PathBuf::from("/usr/bin/promtool");
    ensure!(
        p.is_file(),
        "promtool not found: install Debian's `prometheus` package (tests/setup/apt-packages.txt)"
    );
    Ok(p)
}

fn yaml_file(p: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    Ok(serde_saphyr::from_str(&text)?)
}

/// Alerting rules in the shipped rules file.
fn rule_count() -> Result<usize> {
    let rules = yaml_file(&monitoring().join("juneau-alerts.rules.yaml"))?;
    Ok(rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| g["rules"].as_array())
        .map(|r| r.len())
        .sum())
}

#[test]
fn alert_rules_pass_promtool_and_ship_identically() -> Result<()> {
    let m = monitoring();
    let rules = m.join("juneau-alerts.rules.yaml");
    let out = run(Command::new(promtool()?)
        .arg("check")
        .arg("rules")
        .arg(&rules))?;
    let found = format!("SUCCESS: {} rules found", rule_count()?);
    ensure!(out.contains(&found), "{out}");
    let out =
        run(Command::new(promtool()?)
            .current_dir(&m)
            .args(["test", "rules", "alerts.test.yaml"]))?;
    ensure!(out.contains("SUCCESS"), "{out}");
    // One set of rules, three places.
    let groups = yaml_file(&rules)?["groups"].clone();
    let pr = yaml_file(&m.join("prometheus-rule.yaml"))?;
    assert_eq!(pr["kind"], "PrometheusRule");
    assert_eq!(
        pr["spec"]["groups"], groups,
        "prometheus-rule.yaml differs from the rules file"
    );
    let chart = repo_root().join("deploy/helm/juneau/files");
    for f in ["juneau-alerts.rules.yaml", "grafana-dashboard.json"] {
        assert_eq!(
            std::fs::read(m.join(f))?,
            std::fs::read(chart.join(f))?,
            "deploy/helm/juneau/files/{f} must be a copy of deploy/monitoring/{f}"
        );
    }
    assert_eq!(
        std::fs::read(repo_root().join("deploy/crds/juneau.loutres.me.yaml"))?,
        std::fs::read(repo_root().join("deploy/helm/juneau/crds/juneau.loutres.me.yaml"))?,
        "the chart's CRDs must be a copy of deploy/crds (cp after crdgen)"
    );
    Ok(())
}

fn helm() -> Result<PathBuf> {
    let p = juneau_tests::kube::binaries_dir()?.join("helm");
    ensure!(
        p.is_file(),
        "{} not found: run `tests/k8s/build.sh` (it builds helm from its Go module)",
        p.display()
    );
    Ok(p)
}

/// Integral floats as integers (helm re-serializes `0` of a schema as `0.0`).
fn normalize(v: Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 1e15 => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(a) => Value::Array(a.into_iter().map(normalize).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, normalize(v))).collect()),
        other => other,
    }
}

/// Objects of a multi-document YAML stream by (kind, namespace, name).
fn objects(yaml: &str) -> Result<BTreeMap<(String, String, String), Value>> {
    let mut out = BTreeMap::new();
    for v in serde_saphyr::from_multiple::<Value>(yaml)? {
        if v.is_null() {
            continue;
        }
        let key = (
            v["kind"].as_str().unwrap_or_default().to_string(),
            v["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            v["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
        ensure!(
            out.insert(key.clone(), normalize(v)).is_none(),
            "{key:?} twice"
        );
    }
    Ok(out)
}

const CHART_CONFIG: &str = "addressPools:
  - name: chart-v4
    spec: {advertiseMode: bgp, addresses: [198.51.100.0/28]}
externalNetworks:
  - name: chart
    spec: {type: bgp, addressPools: [chart-v4]}
bgp:
  peers:
    - name: chart-tor
      labels: {juneau.loutres.me/peer: tor}
      spec: {peerAddress: 192.0.2.1, peerASN: 64512, localASN: 64513}
  advertisements:
    - name: chart-v4
      spec: {addressPools: [chart-v4], communities: ['64512:100']}
node:
  nodeSelector: {node-role.kubernetes.io/edge: ''}
metrics:
  dashboard: {enabled: true}
";

fn helm_checks(env: &Env) -> Result<()> {
    let chart = repo_root().join("deploy/helm/juneau");
    let helm = helm()?;
    let out = run(Command::new(&helm).arg("lint").arg(&chart))?;
    ensure!(out.contains("0 chart(s) failed"), "{out}");
    // Without the uninstall hook (deploy/ has no helm uninstall; docs/operations.md says
    // what to run there instead); the hook is checked below.
    let rendered = run(Command::new(&helm)
        .args(["template", "juneau"])
        .arg(&chart)
        .args([
            "--namespace",
            "juneau-system",
            "--include-crds",
            "--no-hooks",
            "--set",
            "createNamespace=true",
        ]))?;
    let kustomized = env.kubectl(&["kustomize", repo_root().join("deploy").to_str().unwrap()])?;
    let (a, b) = (objects(&rendered)?, objects(&kustomized)?);
    let ka: Vec<_> = a.keys().collect();
    let kb: Vec<_> = b.keys().collect();
    assert_eq!(ka, kb, "helm and kustomize render different objects");
    for (k, v) in &a {
        assert_eq!(v, &b[k], "{k:?} differs between the chart and deploy/");
    }
    ensure!(a.len() >= 12, "{} objects", a.len());
    // An upgrade's new node Pod starts beside the old one (each process waits for its
    // predecessor): the DaemonSet surges, and no declared port (a host port on the host
    // network) may keep the new Pod off the node.
    let key = (
        "DaemonSet".to_string(),
        "juneau-system".to_string(),
        "juneau-node".to_string(),
    );
    let ds = a.get(&key).context("no node DaemonSet rendered")?;
    assert_eq!(
        ds["spec"]["updateStrategy"],
        serde_json::json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    );
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("node Pod containers")?;
    ensure!(containers.len() == 4, "{containers:?}");
    for c in containers {
        ensure!(c.get("ports").is_none(), "{} declares ports", c["name"]);
    }
    // The apiserver accepts the chart's output, with defaults and with config values.
    let out = env
        .k
        .kubectl_stdin(&["apply", "--dry-run=server", "-f", "-"], &rendered)?;
    ensure!(out.contains("deployment.apps/juneau-controller"), "{out}");
    let values = env.k.dir().join("chart-values.yaml");
    std::fs::write(&values, CHART_CONFIG)?;
    let configured = run(Command::new(&helm)
        .args(["template", "juneau"])
        .arg(&chart)
        .args(["--namespace", "juneau-system", "-f"])
        .arg(&values))?;
    let objs = objects(&configured)?;
    // The pre-delete hook: its Job and the RBAC it needs, all hook resources.
    let hook = |kind: &str, ns: &str| -> Result<serde_json::Value> {
        let key = (
            kind.to_string(),
            ns.to_string(),
            "juneau-decommission".to_string(),
        );
        objs.get(&key)
            .cloned()
            .with_context(|| format!("no {kind} juneau-decommission rendered"))
    };
    for (kind, ns) in [
        ("Job", "juneau-system"),
        ("ServiceAccount", "juneau-system"),
        ("Role", "juneau-system"),
        ("RoleBinding", "juneau-system"),
        ("ClusterRole", ""),
        ("ClusterRoleBinding", ""),
    ] {
        let o = hook(kind, ns)?;
        assert_eq!(
            o["metadata"]["annotations"]["helm.sh/hook"], "pre-delete",
            "{kind}"
        );
        assert_eq!(
            o["metadata"]["annotations"]["helm.sh/hook-delete-policy"],
            "before-hook-creation,hook-succeeded",
            "{kind}"
        );
    }
    let job = hook("Job", "juneau-system")?;
    assert_eq!(
        job["spec"]["template"]["spec"]["containers"][0]["command"],
        serde_json::json!([
            "juneau-k8s-sync",
            "decommission",
            "--daemonset=juneau-node",
            "--timeout=120"
        ])
    );
    for kind in [
        "AddressPool",
        "ExternalNetwork",
        "BGPPeer",
        "BGPAdvertisement",
        "ConfigMap",
    ] {
        ensure!(objs.keys().any(|k| k.0 == kind), "no {kind} rendered");
    }
    let ds = &objs[&(
        "DaemonSet".into(),
        "juneau-system".into(),
        "juneau-node".into(),
    )];
    assert_eq!(
        ds["spec"]["template"]["spec"]["nodeSelector"]["node-role.kubernetes.io/edge"],
        ""
    );
    let out = env
        .k
        .kubectl_stdin(&["apply", "--dry-run=server", "-f", "-"], &configured)?;
    ensure!(
        out.contains("bgppeer.juneau.loutres.me/chart-tor created (server dry run)"),
        "{out}"
    );
    // A bad value is refused by the apiserver's schema, not silently installed.
    let bad = configured.replace("198.51.100.0/28", "198.51.100.1/28");
    let refused = Command::new("kubectl")
        .args(["apply", "--dry-run=server", "-f", "-"])
        .env("KUBECONFIG", env.k.kubeconfig())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(bad.as_bytes())?;
            c.wait_with_output()
        })?;
    ensure!(!refused.status.success(), "host bits accepted");
    ensure!(
        String::from_utf8_lossy(&refused.stderr).contains("CIDR without host bits"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    Ok(())
}

#[test]
fn helm_chart_and_a_real_prometheus() -> Result<()> {
    let env = Env::start()?;
    helm_checks(&env)?;

    env.nodes(&[("node-a", "192.168.62.1"), ("node-b", "192.168.62.2")])?;
    env.apply(SEED_NETWORK)?;
    let mut ctl = env.controller("c1")?;
    let state = tempfile::tempdir()?;
    let mut agent = env.agent("node-a", &state.path().join("node-a.state"))?;
    // "web" has two Ready backends on node-a (whose agent runs); "lonely" has one on
    // node-b, where no agent runs: no node announces its VIP.
    env.apply(&service("web", &[], ""))?;
    env.apply(&endpoint_slice(
        "web",
        "web-1",
        &[
            ("10.244.2.1", "node-a", true, false),
            ("10.244.2.2", "node-a", true, false),
        ],
        8080,
    ))?;
    env.apply(&service("lonely", &[], ""))?;
    env.apply(&endpoint_slice(
        "lonely",
        "lonely-1",
        &[("10.244.3.1", "node-b", true, false)],
        8080,
    ))?;
    let web_vip = eventually("web is Ready", || {
        Ok(slb_status(&env, "web")?
            .filter(|s| s["phase"] == "Ready")
            .and_then(|s| s["vip"].as_str().map(String::from)))
    })?;
    let lonely_vip = eventually("lonely is Ready (from node-b)", || {
        Ok(slb_status(&env, "lonely")?
            .filter(|s| s["phase"] == "Ready")
            .and_then(|s| s["vip"].as_str().map(String::from)))
    })?;

    let server = Prometheus::start(&PrometheusSpec {
        dir: env.k.dir().join("prometheus"),
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], free_port()?)),
        rule_files: vec![monitoring().join("juneau-alerts.rules.yaml")],
        targets: vec![
            Target::new(
                "juneau-controller",
                format!("127.0.0.1:{}", ctl.metrics_port),
            ),
            Target::new("juneau-agent", format!("127.0.0.1:{}", agent.metrics_port))
                .label("node", "node-a"),
        ],
        interval_s: 1,
    })?;
    let prom = server.api();
    eventually("Prometheus scrapes both targets", || {
        let up = prom.query("up == 1").unwrap_or_default();
        Ok((up.len() == 2).then_some(()))
    })?;
    // Key series against what the test did.
    eventually("pool usage = VIPs handed out (2)", || {
        Ok(
            (prom.value("juneau_address_pool_addresses_in_use{pool=\"public-v4\"}")? == Some(2.0))
                .then_some(()),
        )
    })?;
    assert_eq!(
        prom.value("juneau_address_pool_addresses{pool=\"public-v4\"}")?,
        Some(254.0)
    );
    assert_eq!(prom.value("sum(juneau_controller_is_leader)")?, Some(1.0));
    assert_eq!(
        prom.value(&format!(
            "juneau_service_ready_backends{{service=\"web\",vip=\"{web_vip}\"}}"
        ))?,
        Some(2.0)
    );
    eventually("agent series: 2 backends on node-a", || {
        Ok((prom.value("juneau_agent_backends{node=\"node-a\"}")? == Some(2.0)).then_some(()))
    })?;
    assert_eq!(
        prom.value(&format!("juneau_agent_vip_advertised{{vip=\"{web_vip}\"}}"))?,
        Some(1.0)
    );

    // Every dashboard panel of the controller and the agent returns data (the node
    // components' panels are checked in the lab, tests/tests/lab_e2e.rs, where they run).
    let exprs: Vec<String> =
        PromApi::dashboard_queries(&monitoring().join("grafana-dashboard.json"))?
            .into_iter()
            .filter(|e| !e.contains("juneau_dataplane_") && !e.contains("juneau_bgp_"))
            .collect();
    ensure!(exprs.len() >= 10, "{} panel queries", exprs.len());
    for e in &exprs {
        eventually(&format!("data for panel query {e}"), || {
            Ok((!prom.query(e)?.is_empty()).then_some(()))
        })?;
    }

    // The rules load and evaluate; the not-announced alert is pending for lonely only.
    let loaded = prom.rules()?;
    assert_eq!(loaded.len(), rule_count()?, "{loaded:?}");
    let firing = eventually("JuneauVIPNotAnnounced pending for lonely", || {
        let a = prom.query("ALERTS{alertname=\"JuneauVIPNotAnnounced\"}")?;
        Ok((!a.is_empty()).then_some(a))
    })?;
    let vips: Vec<&str> = firing
        .iter()
        .filter_map(|a| a["metric"]["vip"].as_str())
        .collect();
    assert_eq!(vips, vec![lonely_vip.as_str()], "{firing:?}");
    for r in &loaded {
        assert_eq!(r["health"], "ok", "{r}");
    }
    ctl.check_running()?;
    agent.check_running()?;
    Ok(())
}
