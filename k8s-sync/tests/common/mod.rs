//! Shared helpers of the k8s-sync tests against a real kube-apiserver
//! (`juneau_tests::kube::KubeCluster`): install Juneau's CRDs and RBAC from `deploy/`,
//! run the real `juneau-k8s-sync` binaries with ServiceAccount tokens, poll for results.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use juneau_tests::kube::KubeCluster;
use serde_json::Value;

/// Generous bound for "eventually" checks on a busy 2-core machine.
pub const EVENTUALLY: Duration = Duration::from_secs(90);

/// The repository: the package's parent as cargo runs the test (`CARGO_MANIFEST_DIR` at
/// run time), else as it was compiled: a binary reused from another checkout sharing
/// `CARGO_TARGET_DIR` has a baked-in path that may be gone (tests/src/lib.rs, `repo_root`).
pub fn repo_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A cluster with Juneau's CRDs, namespace and RBAC installed (as an operator would).
pub struct Env {
    pub k: KubeCluster,
    pub controller_kubeconfig: PathBuf,
    pub node_kubeconfig: PathBuf,
}

impl Env {
    pub fn start() -> Result<Env> {
        let k = KubeCluster::start()?;
        let root = repo_root();
        let deploy = root.join("deploy");
        k.kubectl(&[
            "apply",
            "-f",
            deploy.join("crds/juneau.loutres.me.yaml").to_str().unwrap(),
        ])?;
        k.kubectl(&[
            "apply",
            "-f",
            deploy.join("namespace.yaml").to_str().unwrap(),
        ])?;
        k.kubectl(&["apply", "-f", deploy.join("rbac.yaml").to_str().unwrap()])?;
        k.wait_crds_established(juneau_tests::kube::JUNEAU_CRDS)?;
        let controller_kubeconfig =
            k.service_account_kubeconfig("juneau-system", "juneau-controller")?;
        let node_kubeconfig = k.service_account_kubeconfig("juneau-system", "juneau-node")?;
        Ok(Env {
            k,
            controller_kubeconfig,
            node_kubeconfig,
        })
    }

    pub fn apply(&self, yaml: &str) -> Result<String> {
        self.k.apply_yaml(yaml)
    }

    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.k.kubectl(args)
    }

    pub fn json(&self, args: &[&str]) -> Result<Value> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        let out = self.k.kubectl(&a)?;
        serde_json::from_str(&out).context("parsing kubectl JSON")
    }

    /// The object, or None when it does not exist.
    pub fn get(&self, kind: &str, name: &str, ns: Option<&str>) -> Result<Option<Value>> {
        let mut args = vec!["get", kind, name, "-o", "json", "--ignore-not-found"];
        if let Some(ns) = ns {
            args.extend(["-n", ns]);
        }
        let out = self.k.kubectl(&args)?;
        if out.trim().is_empty() {
            return Ok(None);
        }
        Ok(Some(serde_json::from_str(&out)?))
    }

    /// Starts a controller replica as ServiceAccount juneau-system/juneau-controller.
    pub fn controller(&self, identity: &str) -> Result<Daemon> {
        let port = free_port()?;
        let addr = format!("127.0.0.1:{port}");
        let mut d = Daemon::spawn(
            &format!("controller-{identity}"),
            env!("CARGO_BIN_EXE_juneau-k8s-sync"),
            &[
                "controller",
                "--namespace",
                "juneau-system",
                "--identity",
                identity,
                "--lease-duration",
                "6",
                "--metrics-addr",
                &addr,
            ],
            &self.controller_kubeconfig,
            self.k.dir(),
        )?;
        d.metrics_port = port;
        Ok(d)
    }

    /// Starts the agent of `node` as ServiceAccount juneau-system/juneau-node. It reads
    /// the speaker's status from `state_file` with extension `bgp-status.json` (never the
    /// machine's /run/juneau).
    pub fn agent(&self, node: &str, state_file: &Path) -> Result<Daemon> {
        let port = free_port()?;
        let addr = format!("127.0.0.1:{port}");
        let bgp_status = state_file.with_extension("bgp-status.json");
        let mut d = Daemon::spawn(
            &format!("agent-{node}"),
            env!("CARGO_BIN_EXE_juneau-k8s-sync"),
            &[
                "agent",
                "--node",
                node,
                "--state-file",
                state_file.to_str().unwrap(),
                "--namespace",
                "juneau-system",
                "--metrics-addr",
                &addr,
                "--bgp-status-file",
                bgp_status.to_str().unwrap(),
            ],
            &self.node_kubeconfig,
            self.k.dir(),
        )?;
        d.metrics_port = port;
        Ok(d)
    }

    /// Node objects (no kubelet: created as an operator's tooling would), with an
    /// InternalIP each.
    pub fn nodes(&self, nodes: &[(&str, &str)]) -> Result<()> {
        for (name, ip) in nodes {
            self.k.create_node(name, ip)?;
        }
        Ok(())
    }

    /// Events of a Service: (type, reason, message).
    pub fn events(&self, ns: &str, name: &str) -> Result<Vec<(String, String, String)>> {
        let v = self.json(&[
            "get",
            "events.events.k8s.io",
            "-n",
            ns,
            "--field-selector",
            &format!("regarding.name={name},regarding.kind=Service"),
        ])?;
        Ok(v["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|e| {
                (
                    e["type"].as_str().unwrap_or_default().to_string(),
                    e["reason"].as_str().unwrap_or_default().to_string(),
                    e["note"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect())
    }
}

/// A Juneau process, killed (SIGKILL) and reaped on drop; its log is kept in the
/// cluster directory and printed when a test fails.
pub struct Daemon {
    pub name: String,
    process: juneau_tests::daemon::Daemon,
    pub log: PathBuf,
    /// Port of /metrics, /healthz and /readyz on 127.0.0.1.
    pub metrics_port: u16,
}

pub use juneau_tests::kube::free_port;

/// `GET http://127.0.0.1:{port}{path}`: (status code, body), with curl.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            "-w",
            "\n%{http_code}",
            &format!("http://127.0.0.1:{port}{path}"),
        ])
        .output()
        .context("running curl")?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    Ok((code.trim().parse().unwrap_or(0), body.to_string()))
}

/// The value of one sample line `name{labels} value` of a Prometheus text page, where
/// `selector` is the part before the value (e.g. `juneau_x{pool="p"}`).
pub fn sample(page: &str, selector: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(selector).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

impl Daemon {
    fn spawn(
        name: &str,
        bin: &str,
        args: &[&str],
        kubeconfig: &Path,
        dir: &Path,
    ) -> Result<Daemon> {
        let log = dir.join(format!("{name}.log"));
        let argv: Vec<&str> = std::iter::once(bin).chain(args.iter().copied()).collect();
        let spec = juneau_tests::daemon::DaemonSpec::new(name, &argv, &log)
            .kube_client(kubeconfig, "info,kube_lease_manager=info");
        Ok(Daemon {
            name: name.into(),
            process: juneau_tests::daemon::Daemon::spawn(spec)?,
            log,
            metrics_port: 0,
        })
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails if the process has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.process.check_running()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        if let Some(dir) = std::env::var_os("JUNEAU_KEEP_LOGS") {
            let dir = PathBuf::from(dir);
            let _ = fs::create_dir_all(&dir);
            let _ = fs::copy(
                &self.log,
                dir.join(format!("{}-{}.log", self.name, std::process::id())),
            );
        }
        if std::thread::panicking() {
            eprintln!(
                "---- {} log (last lines) ----\n{}",
                self.name,
                tail(&self.log_text(), 60)
            );
        }
    }
}

pub fn tail(s: &str, n: usize) -> String {
    let l: Vec<&str> = s.lines().collect();
    l[l.len().saturating_sub(n)..].join("\n")
}

/// Polls `f` until it returns Some, failing after `EVENTUALLY` with `what` and the last
/// observed value.
pub fn eventually<T>(what: &str, f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    juneau_tests::daemon::wait_for(what, EVENTUALLY, Duration::from_millis(250), f)
}

/// The seed guide's ExternalNetwork + AddressPool, plus the BGPAdvertisement and BGPPeer
/// the guide says to configure beforehand.
pub const SEED_NETWORK: &str = "apiVersion: juneau.loutres.me/v1alpha1
kind: AddressPool
metadata:
  name: public-v4
spec:
  advertiseMode: bgp
  addresses:
    - 203.0.113.0/24
---
apiVersion: juneau.loutres.me/v1alpha1
kind: ExternalNetwork
metadata:
  name: public
spec:
  type: bgp
  addressPools:
    - public-v4
---
apiVersion: juneau.loutres.me/v1alpha1
kind: BGPAdvertisement
metadata:
  name: public
spec:
  addressPools: [public-v4]
  communities: [\"64512:100\"]
  localPref: 150
---
apiVersion: v1
kind: Secret
metadata:
  name: tor-password
  namespace: juneau-system
stringData:
  password: s3cret
---
apiVersion: juneau.loutres.me/v1alpha1
kind: BGPPeer
metadata:
  name: tor
spec:
  peerAddress: 192.0.2.1
  peerASN: 65000
  localASN: 65001
  holdTimeSeconds: 9
  passwordSecretRef:
    name: tor-password
";

/// A Juneau Service (the seed's nginx shape) with extra annotations / spec lines.
pub fn service(name: &str, annotations: &[(&str, &str)], extra_spec: &str) -> String {
    let mut ann = String::from("    juneau.loutres.me/load-balancer-external-network: public\n");
    for (k, v) in annotations {
        ann.push_str(&format!("    {k}: \"{v}\"\n"));
    }
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
  annotations:
{ann}spec:
  type: LoadBalancer
  loadBalancerClass: juneau.loutres.me/load-balancer
  externalTrafficPolicy: Local
  selector:
    app: {name}
  ports:
    - name: http
      protocol: TCP
      port: 80
      targetPort: http
{extra_spec}"
    )
}

/// An EndpointSlice of Service `svc` with endpoints (ip, node, ready, terminating) on
/// port `http` = `port`.
pub fn endpoint_slice(
    svc: &str,
    slice: &str,
    eps: &[(&str, &str, bool, bool)],
    port: u16,
) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {slice}
  namespace: default
  labels:
    kubernetes.io/service-name: {svc}
    endpointslice.kubernetes.io/managed-by: juneau-tests
addressType: IPv4
ports:
  - name: http
    protocol: TCP
    port: {port}
endpoints:
"
    );
    for (ip, node, ready, term) in eps {
        s.push_str(&format!(
            "  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    conditions: {{ready: {ready}, serving: {ready}, terminating: {term}}}\n"
        ));
    }
    s
}

/// `.status` of the ServiceLoadBalancer `name`, once it has a phase.
pub fn slb_status(env: &Env, name: &str) -> Result<Option<Value>> {
    Ok(env
        .get("serviceloadbalancer", name, Some("default"))?
        .and_then(|v| v.get("status").cloned())
        .filter(|s| s.get("phase").is_some()))
}

pub fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

pub fn ingress_ip(env: &Env, name: &str) -> Result<Option<String>> {
    Ok(env.get("service", name, Some("default"))?.and_then(|s| {
        s["status"]["loadBalancer"]["ingress"][0]["ip"]
            .as_str()
            .map(String::from)
    }))
}

/// `kubectl juneau ...` through the real kubectl, with the plugin found on PATH.
pub fn kubectl_juneau(env: &Env, args: &[&str]) -> Result<std::process::Output> {
    kubectl_juneau_with(env.k.kubeconfig(), args)
}

/// `kubectl juneau ...` that must succeed: its standard output.
pub fn kubectl_juneau_ok(env: &Env, args: &[&str]) -> Result<String> {
    let out = kubectl_juneau(env, args)?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl juneau {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// `kubectl juneau ...` with a given kubeconfig.
pub fn kubectl_juneau_with(kubeconfig: &Path, args: &[&str]) -> Result<std::process::Output> {
    let plugin = Path::new(env!("CARGO_BIN_EXE_kubectl-juneau"));
    let path = format!(
        "{}:{}",
        plugin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("kubectl")
        .arg("juneau")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .context("running kubectl juneau")
}
