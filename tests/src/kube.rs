//! A real Kubernetes control plane for tests: etcd + kube-apiserver (+ optionally
//! kube-controller-manager), built from `k8s.io/kubernetes` by `tests/k8s/build.sh`.
//!
//! [`KubeCluster::start`] picks free loopback ports, makes a temporary directory with a
//! CA, a serving certificate, a service-account signing key and a static admin token,
//! starts etcd and kube-apiserver, waits for `/readyz` and writes an admin kubeconfig.
//! Everything is stopped and the directory removed when the cluster is dropped, also
//! when the test panics (the logs are then copied to a directory printed on stderr).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let mut k = juneau_tests::kube::KubeCluster::start()?;
//! k.kubectl(&["create", "namespace", "demo"])?;
//! k.start_controller_manager()?; // real EndpointSlice / Deployment controllers
//! k.kubectl(&["apply", "-f", "deploy/rbac.yaml"])?;
//! let sa = k.service_account_kubeconfig("juneau-system", "juneau-controller")?;
//! k.kubectl_as(&sa, &["get", "services", "-A"])?; // runs with that SA's RBAC
//! # Ok(()) }
//! ```
//!
//! [`KubeCluster::start_with`] takes [`ClusterOptions`]: another listen address (nodes in
//! network namespaces reach it through a bridge), a fixed directory (the lab's), the
//! node-lifecycle controller on (real kubelets send heartbeats). With real kubelets
//! ([`crate::node`]) a [`KubeCluster::start_scheduler`] places the Pods.
//!
//! The apiserver runs with RBAC authorization, the ServiceAccount admission plugin off
//! unless [`ClusterOptions::service_account_tokens`] (without kubelets nothing consumes
//! Pod tokens, and Pods can then be created before the controller-manager has made the
//! namespace's `default` ServiceAccount), and no nodes: tests create Node objects
//! themselves.

use std::fs;
use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// `tests/k8s/go.mod`: the Kubernetes version the binaries are built at.
const GO_MOD: &str = include_str!("../k8s/go.mod");
/// The bearer token of the `admin` user (group `system:masters`) in every cluster.
pub const ADMIN_TOKEN: &str = "juneau-test-admin-token";
/// How long to wait for the apiserver to become ready (2 busy cores: be generous).
const READY_TIMEOUT: Duration = Duration::from_secs(180);

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// The Kubernetes release pinned in `tests/k8s/go.mod` (e.g. `v1.34.4`).
pub fn kubernetes_version() -> &'static str {
    GO_MOD
        .lines()
        .find_map(|l| l.strip_prefix("require k8s.io/kubernetes "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("tests/k8s/go.mod has a `require k8s.io/kubernetes vX.Y.Z` line")
}

/// How to start a [`KubeCluster`].
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Where the apiserver listens (default 127.0.0.1).
    pub bind_address: Ipv4Addr,
    /// The apiserver's port (default: a free one).
    pub api_port: Option<u16>,
    /// A fixed directory for certificates, logs and etcd data (default: a new temporary
    /// one). Removed on drop like the temporary one, unless the cluster is detached.
    pub dir: Option<PathBuf>,
    /// Run the controller-manager's node-lifecycle controller (only with real kubelets:
    /// without heartbeats it would mark every Node NotReady).
    pub node_lifecycle: bool,
    /// The ServiceAccount admission plugin on: Pods get their ServiceAccount's token
    /// mounted (projected), as in-cluster clients need (only with real kubelets, after
    /// the controller-manager made each namespace's `default` ServiceAccount).
    pub service_account_tokens: bool,
    /// A dual-stack cluster: the apiserver's Service ClusterIP range has an IPv6 range
    /// after the IPv4 one (`--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112`),
    /// so Services can ask for both families (default: IPv4 only).
    pub dual_stack: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            bind_address: Ipv4Addr::LOCALHOST,
            api_port: None,
            dir: None,
            node_lifecycle: false,
            service_account_tokens: false,
            dual_stack: false,
        }
    }
}

#[derive(Debug)]
enum ClusterDir {
    Temp(tempfile::TempDir),
    Fixed(PathBuf),
}

impl ClusterDir {
    fn path(&self) -> &Path {
        match self {
            ClusterDir::Temp(t) => t.path(),
            ClusterDir::Fixed(p) => p,
        }
    }
}

/// The directory holding `etcd`, `kube-apiserver` and `kube-controller-manager`:
/// `$JUNEAU_K8S_BIN_DIR` if set, else `${JUNEAU_K8S_CACHE:-/var/cache/juneau/k8s}/<version>`
/// (where `tests/k8s/build.sh` puts them). Fails, naming the build script, when a
/// binary is missing.
pub fn binaries_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("JUNEAU_K8S_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let root = std::env::var_os("JUNEAU_K8S_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/var/cache/juneau/k8s"));
            root.join(kubernetes_version())
        }
    };
    for bin in ["etcd", "kube-apiserver", "kube-controller-manager"] {
        if !dir.join(bin).is_file() {
            bail!(
                "{bin} not found in {}: run `tests/k8s/build.sh` first (builds etcd, \
                 kube-apiserver and kube-controller-manager {} from the Go module proxy \
                 into that cache; ~10-15 min once per machine)",
                dir.display(),
                kubernetes_version()
            );
        }
    }
    Ok(dir)
}

/// Juneau's CustomResourceDefinitions (deploy/crds), for [`KubeCluster::wait_crds_established`].
pub const JUNEAU_CRDS: &[&str] = &[
    "addresspools.juneau.loutres.me",
    "externalnetworks.juneau.loutres.me",
    "serviceloadbalancers.juneau.loutres.me",
    "bgppeers.juneau.loutres.me",
    "bgpadvertisements.juneau.loutres.me",
    "nodebgpstatuses.juneau.loutres.me",
];

/// A free TCP port on 127.0.0.1 (bound then released; good enough for tests).
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Last `n` lines of a log file, for error messages.
fn tail(path: &Path, n: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .context("running openssl (Debian package `openssl`)")?;
    if !out.status.success() {
        bail!(
            "openssl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A control-plane process, stopped (SIGTERM, then SIGKILL) on drop.
#[derive(Debug)]
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
    bin: PathBuf,
    args: Vec<String>,
    detached: bool,
}

impl Proc {
    fn spawn(name: &'static str, bin: &Path, args: &[String], log: PathBuf) -> Result<Self> {
        let f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Proc {
            name,
            child,
            log,
            bin: bin.to_path_buf(),
            args: args.to_vec(),
            detached: false,
        })
    }

    /// The same command again, as a new process.
    fn respawn(&self) -> Result<Self> {
        Proc::spawn(self.name, &self.bin, &self.args, self.log.clone())
    }

    /// Fails with the log tail if the process has exited.
    fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); last log lines from {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 30)
            );
        }
        Ok(())
    }

    fn stop(&mut self) {
        if self.detached {
            return;
        }
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .output();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A running etcd + kube-apiserver (+ kube-controller-manager), torn down on drop.
#[derive(Debug)]
pub struct KubeCluster {
    // Field order is drop order: processes first (controller-manager, apiserver, etcd),
    // the temporary directory last.
    scheduler: Option<Proc>,
    controller_manager: Option<Proc>,
    apiserver: Proc,
    etcd: Proc,
    bin_dir: PathBuf,
    server: String,
    kubeconfig: PathBuf,
    options: ClusterOptions,
    detached: bool,
    dir: ClusterDir,
}

impl KubeCluster {
    /// Starts etcd and kube-apiserver on free loopback ports and waits until the
    /// apiserver answers `/readyz`. (A port taken between choosing and binding it —
    /// tests run in parallel — is retried with new ports, up to three times.)
    pub fn start() -> Result<Self> {
        Self::start_with(ClusterOptions::default())
    }

    /// [`start`](Self::start) with options.
    pub fn start_with(options: ClusterOptions) -> Result<Self> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(&options) {
                Err(e) if attempt < 3 && format!("{e:#}").contains("address already in use") => {
                    eprintln!("kube cluster: a port was taken meanwhile, retrying: {e:#}");
                }
                r => return r,
            }
        }
    }

    fn start_once(options: &ClusterOptions) -> Result<Self> {
        let bin_dir = binaries_dir()?;
        let n = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let dir = match &options.dir {
            Some(d) => {
                let _ = fs::remove_dir_all(d);
                fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                ClusterDir::Fixed(d.clone())
            }
            None => ClusterDir::Temp(
                tempfile::Builder::new()
                    .prefix(&format!("juneau-kube-{}-{n}-", std::process::id()))
                    .tempdir()
                    .context("creating the cluster's temporary directory")?,
            ),
        };
        let d = dir.path().to_path_buf();
        Self::make_credentials(&d, options.bind_address)?;

        let (etcd_client, etcd_peer) = (free_port()?, free_port()?);
        let api_port = match options.api_port {
            Some(p) => p,
            None => free_port()?,
        };
        let bind = options.bind_address;
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let etcd_args: Vec<String> = vec![
            "--name=juneau-test".into(),
            format!("--data-dir={}", d.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=juneau-test={peer_url}"),
            // Test data is thrown away: do not pay for fsync on a shared disk.
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        let mut etcd = Proc::spawn(
            "etcd",
            &bin_dir.join("etcd"),
            &etcd_args,
            d.join("etcd.log"),
        )?;

        let p = |f: &str| d.join(f).display().to_string();
        let mut api_args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={bind}"),
            format!("--advertise-address={bind}"),
            format!("--secure-port={api_port}"),
            // Kubelets report their InternalIP and a Hostname nothing resolves.
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            format!("--token-auth-file={}", p("tokens.csv")),
            "--authorization-mode=RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            if options.dual_stack {
                "--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112".into()
            } else {
                "--service-cluster-ip-range=10.96.0.0/16".into()
            },
            // Room for 10 000 `externalTrafficPolicy: Local` LoadBalancer Services (the
            // perf scale run): each gets a health-check NodePort even with
            // `allocateLoadBalancerNodePorts: false`, and the default range has 2 768.
            "--service-node-port-range=30000-44999".into(),
            "--allow-privileged=true".into(),
            "--enable-priority-and-fairness=false".into(),
            "--profiling=false".into(),
        ];
        if !options.service_account_tokens {
            api_args.push("--disable-admission-plugins=ServiceAccount".into());
        }
        let apiserver = Proc::spawn(
            "kube-apiserver",
            &bin_dir.join("kube-apiserver"),
            &api_args,
            d.join("kube-apiserver.log"),
        )?;

        let server = format!("https://{bind}:{api_port}");
        let kubeconfig = d.join("admin.kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            &server,
            &d.join("ca.crt"),
            "admin",
            ADMIN_TOKEN,
        )?;
        etcd.check_running()?;

        let mut cluster = KubeCluster {
            scheduler: None,
            controller_manager: None,
            apiserver,
            etcd,
            bin_dir,
            server,
            kubeconfig,
            options: options.clone(),
            detached: false,
            dir,
        };
        cluster.wait_ready()?;
        Ok(cluster)
    }

    fn make_credentials(d: &Path, bind: Ipv4Addr) -> Result<()> {
        // A CA, a serving certificate for the loopback address and the in-cluster names,
        // and an RSA key that signs ServiceAccount tokens.
        openssl(
            d,
            &[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                "ca.key",
            ],
        )?;
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                "ca.key",
                "-days",
                "3650",
                "-subj",
                "/CN=juneau-test-ca",
                "-out",
                "ca.crt",
            ],
        )?;
        openssl(
            d,
            &[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                "apiserver.key",
            ],
        )?;
        openssl(
            d,
            &[
                "req",
                "-new",
                "-key",
                "apiserver.key",
                "-subj",
                "/CN=kube-apiserver",
                "-out",
                "apiserver.csr",
            ],
        )?;
        fs::write(
            d.join("apiserver.ext"),
            format!(
                "subjectAltName=IP:127.0.0.1,IP:{bind},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,\
                 DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n\
                 extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n\
                 basicConstraints=CA:FALSE\n"
            ),
        )?;
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "apiserver.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "3650",
                "-extfile",
                "apiserver.ext",
                "-out",
                "apiserver.crt",
            ],
        )?;
        openssl(d, &["genrsa", "-out", "sa.key", "2048"])?;
        openssl(d, &["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        fs::write(
            d.join("tokens.csv"),
            format!("{ADMIN_TOKEN},admin,admin,system:masters\n"),
        )?;
        Ok(())
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.etcd.check_running()?;
            self.apiserver.check_running()?;
            let out = self.kubectl_output(&["get", "--raw", "/readyz"])?;
            if out.status.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready after {READY_TIMEOUT:?}: {}\nlast log lines:\n{}",
                    String::from_utf8_lossy(&out.stderr).trim(),
                    tail(&self.apiserver.log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Starts kube-controller-manager (EndpointSlice, Deployment/ReplicaSet, namespace,
    /// garbage-collector, ServiceAccount controllers, ...) and waits until it works (the
    /// `default` ServiceAccount appears). The node-lifecycle controller is off: there
    /// are no kubelets, so it would mark every test Node NotReady and its Pods unready.
    pub fn start_controller_manager(&mut self) -> Result<()> {
        if self.controller_manager.is_some() {
            return Ok(());
        }
        let d = self.dir.path();
        let args: Vec<String> = vec![
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--authentication-kubeconfig={}", self.kubeconfig.display()),
            format!("--authorization-kubeconfig={}", self.kubeconfig.display()),
            format!(
                "--service-account-private-key-file={}",
                d.join("sa.key").display()
            ),
            format!("--root-ca-file={}", d.join("ca.crt").display()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            "--cert-dir".into(),
            d.join("kcm-certs").display().to_string(),
            "--leader-elect=false".into(),
            if self.options.node_lifecycle {
                "--controllers=*".into()
            } else {
                "--controllers=*,-node-lifecycle-controller".into()
            },
            "--profiling=false".into(),
        ];
        self.controller_manager = Some(Proc::spawn(
            "kube-controller-manager",
            &self.bin_dir.join("kube-controller-manager"),
            &args,
            d.join("kube-controller-manager.log"),
        )?);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(kcm) = self.controller_manager.as_mut() {
                kcm.check_running()?;
            }
            if self
                .kubectl_output(&["get", "serviceaccount", "default", "-n", "default"])?
                .status
                .success()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kube-controller-manager did not create the default ServiceAccount within {READY_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Starts kube-scheduler (the default profile), which places Pods on the Nodes that
    /// real kubelets registered, and waits until it answers its health check.
    pub fn start_scheduler(&mut self) -> Result<()> {
        if self.scheduler.is_some() {
            return Ok(());
        }
        let d = self.dir.path().to_path_buf();
        let port = free_port()?;
        let args: Vec<String> = vec![
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--authentication-kubeconfig={}", self.kubeconfig.display()),
            format!("--authorization-kubeconfig={}", self.kubeconfig.display()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            "--leader-elect=false".into(),
            "--profiling=false".into(),
        ];
        self.scheduler = Some(Proc::spawn(
            "kube-scheduler",
            &self.bin_dir.join("kube-scheduler"),
            &args,
            d.join("kube-scheduler.log"),
        )?);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(s) = self.scheduler.as_mut() {
                s.check_running()?;
            }
            let ok = Command::new("curl")
                .args([
                    "-skf",
                    "-m",
                    "2",
                    &format!("https://127.0.0.1:{port}/healthz"),
                ])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kube-scheduler not healthy within {READY_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Restarts kube-apiserver (SIGTERM, then the same command line) and waits until it
    /// is ready again; returns how long it was away.
    pub fn restart_apiserver(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        self.apiserver.stop();
        self.apiserver = self.apiserver.respawn()?;
        self.wait_ready()?;
        Ok(t0.elapsed())
    }

    /// Leaves every process running and the directory in place when this handle
    /// drops (the lab's `up`); returns (name, pid) of each process.
    pub fn detach(mut self) -> Vec<(String, u32)> {
        self.detached = true;
        let mut v = Vec::new();
        for p in [
            Some(&mut self.etcd),
            Some(&mut self.apiserver),
            self.controller_manager.as_mut(),
            self.scheduler.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            p.detached = true;
            v.push((p.name.to_string(), p.child.id()));
        }
        v
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The admin kubeconfig (user `admin`, group `system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The CA certificate that signed the apiserver's serving certificate.
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// The cluster's temporary directory (certificates, logs, etcd data).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Process ids of the running control-plane processes.
    pub fn pids(&self) -> Vec<u32> {
        let mut v = vec![self.etcd.child.id(), self.apiserver.child.id()];
        v.extend(self.controller_manager.as_ref().map(|p| p.child.id()));
        v.extend(self.scheduler.as_ref().map(|p| p.child.id()));
        v
    }

    /// Runs the installed `kubectl` as admin; returns stdout, fails with stderr.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_as(&self.kubeconfig, args)
    }

    /// Runs `kubectl` as admin and returns its output whatever its exit status.
    pub fn kubectl_output(&self, args: &[&str]) -> Result<Output> {
        kubectl_output(&self.kubeconfig, args, None)
    }

    /// Runs `kubectl` as admin with `stdin` (e.g. `kubectl_stdin(&["apply", "-f", "-"], yaml)`).
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> Result<String> {
        kubectl_with(&self.kubeconfig, args, Some(stdin))
    }

    /// Waits (at most 60 s) until these CustomResourceDefinitions are Established,
    /// e.g. [`JUNEAU_CRDS`].
    pub fn wait_crds_established(&self, crds: &[&str]) -> Result<()> {
        let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        let names: Vec<String> = crds.iter().map(|c| format!("crd/{c}")).collect();
        args.extend(names.iter().map(String::as_str));
        self.kubectl(&args)?;
        Ok(())
    }

    /// `kubectl apply -f -` of a YAML document (as admin).
    pub fn apply_yaml(&self, yaml: &str) -> Result<String> {
        self.kubectl_stdin(&["apply", "-f", "-"], yaml)
    }

    /// A Node object named `name` with `address` as its InternalIP and the usual
    /// `kubernetes.io/hostname` label, as an operator's tooling (not a kubelet) creates
    /// it: the object, then its status.
    pub fn create_node(&self, name: &str, address: &str) -> Result<()> {
        self.apply_yaml(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {{kubernetes.io/hostname: {name}}}\n"
        ))?;
        self.kubectl(&[
            "patch",
            "node",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &format!(
                r#"{{"status":{{"addresses":[{{"type":"InternalIP","address":"{address}"}}]}}}}"#
            ),
        ])?;
        Ok(())
    }

    /// Runs `kubectl` with another kubeconfig (e.g. one from
    /// [`service_account_kubeconfig`](Self::service_account_kubeconfig)).
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> Result<String> {
        kubectl_with(kubeconfig, args, None)
    }

    /// Writes a kubeconfig that authenticates as ServiceAccount `namespace/name` with a
    /// bound token (TokenRequest, valid 24 h), so code runs with exactly the RBAC bound
    /// to that ServiceAccount. The ServiceAccount must exist (apply `deploy/` RBAC first).
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let token = self
            .kubectl(&["create", "token", name, "-n", namespace, "--duration=24h"])
            .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?;
        let path = self
            .dir
            .path()
            .join(format!("sa-{namespace}-{name}.kubeconfig"));
        let user = format!("system:serviceaccount:{namespace}:{name}");
        write_kubeconfig(&path, &self.server, &self.ca_cert(), &user, token.trim())?;
        Ok(path)
    }

    /// Stops everything now (same as dropping).
    pub fn stop(self) {}
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        if let Some(mut s) = self.scheduler.take() {
            s.stop();
        }
        if let Some(mut kcm) = self.controller_manager.take() {
            kcm.stop();
        }
        self.apiserver.stop();
        self.etcd.stop();
        if std::thread::panicking() {
            // Keep the logs of a failed test; the directory itself is removed.
            let keep = std::env::temp_dir().join(format!(
                "juneau-kube-logs-{}",
                self.dir
                    .path()
                    .file_name()
                    .and_then(|s| s.to_str())
                    .unwrap_or("x")
            ));
            if fs::create_dir_all(&keep).is_ok() {
                for log in [
                    "etcd.log",
                    "kube-apiserver.log",
                    "kube-controller-manager.log",
                    "kube-scheduler.log",
                ] {
                    let _ = fs::copy(self.dir.path().join(log), keep.join(log));
                }
                eprintln!("kube cluster logs kept in {}", keep.display());
            }
        }
        if let ClusterDir::Fixed(d) = &self.dir {
            let _ = fs::remove_dir_all(d);
        }
    }
}

/// `kubectl --kubeconfig KUBECONFIG ARGS...` (with `stdin` if given): its stdout, or an
/// error with its status and stderr.
pub fn kubectl_with(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Result<String> {
    checked(kubeconfig, args, kubectl_output(kubeconfig, args, stdin)?)
}

/// `kubectl --kubeconfig KUBECONFIG ARGS...` (with `stdin` if given), whatever its exit
/// status.
pub fn kubectl_output(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Result<Output> {
    let mut cmd = Command::new("kubectl");
    cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .context("running `kubectl` (is it installed?)")?;
    if let Some(input) = stdin {
        if let Some(mut w) = child.stdin.take() {
            w.write_all(input.as_bytes())
                .context("writing kubectl's stdin")?;
        }
    }
    child.wait_with_output().context("waiting for kubectl")
}

fn checked(kubeconfig: &Path, args: &[&str], out: Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "`kubectl --kubeconfig {} {}` failed ({}): {}",
            kubeconfig.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes a kubeconfig for `server` trusting `ca`, authenticating with a bearer token.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    token: &str,
) -> Result<()> {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: juneau-test\n  cluster:\n    \
         server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {user:?}\n  user:\n    \
         token: {token}\ncontexts:\n- name: juneau-test\n  context:\n    cluster: juneau-test\n    \
         user: {user:?}\n    namespace: default\ncurrent-context: juneau-test\n",
        ca = ca.display(),
    );
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
