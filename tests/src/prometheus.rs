//! A real Prometheus (Debian's `prometheus` package) scraping Juneau's processes, and a
//! client of its HTTP API. One implementation for every test environment: the lab
//! (every process of every node, kept running by `./lab/lab up`) and the monitoring test
//! of `k8s-sync` (a controller and an agent).
//!
//! The server is a [`Daemon`] (stopped on drop, or detached for the lab); its
//! configuration, TSDB and log live in the directory the caller gives. [`PromApi`]
//! talks to any Prometheus by address, so a test can query the lab's without owning it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::daemon::{tail, wait_for, Daemon, DaemonSpec};

/// Debian's Prometheus server.
pub const PROMETHEUS: &str = "/usr/bin/prometheus";

/// One scrape target.
#[derive(Debug, Clone)]
pub struct Target {
    /// Job name (`juneau-controller`, `juneau-agent`, `juneau-dataplane`, `juneau-bgp`).
    pub job: String,
    /// `host:port`.
    pub addr: String,
    /// Labels added to every series of the target (e.g. `node`).
    pub labels: BTreeMap<String, String>,
}

impl Target {
    /// A target of `job` at `addr`.
    pub fn new(job: &str, addr: impl Into<String>) -> Self {
        Target {
            job: job.to_string(),
            addr: addr.into(),
            labels: BTreeMap::new(),
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }
}

/// How to run a [`Prometheus`].
#[derive(Debug, Clone)]
pub struct PrometheusSpec {
    /// Configuration, TSDB and log go here.
    pub dir: PathBuf,
    /// `--web.listen-address`.
    pub listen: SocketAddr,
    /// Rule files loaded (`rule_files:`).
    pub rule_files: Vec<PathBuf>,
    /// What it scrapes.
    pub targets: Vec<Target>,
    /// Scrape and rule-evaluation interval, seconds (the scrape timeout is at most 1 s).
    pub interval_s: u32,
}

impl PrometheusSpec {
    /// The `prometheus.yml` for this spec: scrape and evaluation every
    /// [`interval_s`](Self::interval_s), one `scrape_configs` entry per job, targets with
    /// their labels.
    pub fn config(&self) -> String {
        let mut jobs: BTreeMap<&str, Vec<&Target>> = BTreeMap::new();
        for t in &self.targets {
            jobs.entry(&t.job).or_default().push(t);
        }
        let i = self.interval_s.max(1);
        let mut s = format!(
            "global: {{scrape_interval: {i}s, scrape_timeout: 1s, evaluation_interval: {i}s}}\n"
        );
        s += "rule_files:\n";
        for r in &self.rule_files {
            s += &format!("  - '{}'\n", r.display());
        }
        if self.rule_files.is_empty() {
            s = s.replace("rule_files:\n", "rule_files: []\n");
        }
        s += "scrape_configs:\n";
        for (job, targets) in jobs {
            s += &format!("  - job_name: {job}\n    static_configs:\n");
            for t in targets {
                let labels: Vec<String> = t
                    .labels
                    .iter()
                    .map(|(k, v)| format!("{k}: '{v}'"))
                    .collect();
                s += &format!(
                    "      - {{targets: ['{}'], labels: {{{}}}}}\n",
                    t.addr,
                    labels.join(", ")
                );
            }
        }
        s
    }
}

/// A running Prometheus, stopped on drop unless detached.
#[derive(Debug)]
pub struct Prometheus {
    daemon: Daemon,
    api: PromApi,
}

impl Prometheus {
    /// Writes the configuration, starts the server and waits until it is ready.
    pub fn start(spec: &PrometheusSpec) -> Result<Prometheus> {
        ensure!(
            Path::new(PROMETHEUS).is_file(),
            "{PROMETHEUS} not found: install Debian's `prometheus` package (tests/setup/apt-packages.txt)"
        );
        std::fs::create_dir_all(&spec.dir)?;
        let cfg = spec.dir.join("prometheus.yml");
        std::fs::write(&cfg, spec.config())?;
        let daemon = Daemon::spawn(DaemonSpec::new(
            "prometheus",
            &[
                PROMETHEUS,
                &format!("--config.file={}", cfg.display()),
                &format!("--storage.tsdb.path={}", spec.dir.join("tsdb").display()),
                &format!("--web.listen-address={}", spec.listen),
            ],
            spec.dir.join("prometheus.log"),
        ))?;
        let mut p = Prometheus {
            daemon,
            api: PromApi::new(spec.listen),
        };
        wait_for(
            "Prometheus ready",
            Duration::from_secs(60),
            Duration::from_millis(200),
            || {
                p.daemon.check_running()?;
                Ok(p.api.ready().then_some(()))
            },
        )
        .with_context(|| tail(p.daemon.log(), 30))?;
        Ok(p)
    }

    /// Its API.
    pub fn api(&self) -> &PromApi {
        &self.api
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// Its log's last lines.
    pub fn log_tail(&self, n: usize) -> String {
        tail(self.daemon.log(), n)
    }

    /// Leaves it running; returns the pid (for whoever stops it later).
    pub fn detach(self) -> u32 {
        self.daemon.detach()
    }
}

/// A client of a Prometheus server's HTTP API (through `curl`).
#[derive(Debug, Clone)]
pub struct PromApi {
    addr: SocketAddr,
}

impl PromApi {
    /// The server at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        PromApi { addr }
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn get(&self, path: &str, query: Option<&str>) -> Result<String> {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--max-time", "5", "--get"]);
        if let Some(q) = query {
            cmd.args(["--data-urlencode", &format!("query={q}")]);
        }
        cmd.arg(format!("{}{path}", self.url()));
        let out = cmd.output().context("running curl")?;
        ensure!(
            out.status.success(),
            "GET {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether `/-/ready` answers.
    pub fn ready(&self) -> bool {
        self.get("/-/ready", None)
            .is_ok_and(|b| b.contains("Ready"))
    }

    /// `GET path` of the JSON API: the `data` of a `success` answer.
    pub fn api(&self, path: &str, query: Option<&str>) -> Result<Value> {
        let out = self.get(path, query)?;
        let v: Value = serde_json::from_str(&out).with_context(|| format!("{path}: {out}"))?;
        if v["status"] != "success" {
            bail!("{path} {query:?}: {v}");
        }
        Ok(v["data"].clone())
    }

    /// An instant query's result vector.
    pub fn query(&self, q: &str) -> Result<Vec<Value>> {
        Ok(self.api("/api/v1/query", Some(q))?["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// The first sample's value of an instant query, if any.
    pub fn value(&self, q: &str) -> Result<Option<f64>> {
        Ok(self
            .query(q)?
            .first()
            .and_then(|r| r["value"][1].as_str().and_then(|v| v.parse().ok())))
    }

    /// Every sample of an instant query by the value of `label`.
    pub fn values_by(&self, q: &str, label: &str) -> Result<BTreeMap<String, f64>> {
        Ok(self
            .query(q)?
            .iter()
            .filter_map(|r| {
                let k = r["metric"][label].as_str()?.to_string();
                let v = r["value"][1].as_str()?.parse().ok()?;
                Some((k, v))
            })
            .collect())
    }

    /// Every loaded alerting and recording rule, across all groups (`/api/v1/rules`).
    pub fn rules(&self) -> Result<Vec<Value>> {
        let d = self.api("/api/v1/rules", None)?;
        Ok(d["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .cloned()
            .collect())
    }

    /// The active scrape targets: `(job, instance, health, last error)`.
    pub fn targets(&self) -> Result<Vec<(String, String, String, String)>> {
        let d = self.api("/api/v1/targets", None)?;
        Ok(d["activeTargets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
                (
                    s(&t["labels"]["job"]),
                    s(&t["labels"]["instance"]),
                    s(&t["health"]),
                    s(&t["lastError"]),
                )
            })
            .collect())
    }

    /// The PromQL expressions of every panel target of a Grafana dashboard.
    pub fn dashboard_queries(dashboard: &Path) -> Result<Vec<String>> {
        let dash: Value = serde_json::from_str(
            &std::fs::read_to_string(dashboard)
                .with_context(|| format!("reading {}", dashboard.display()))?,
        )?;
        Ok(dash["panels"]
            .as_array()
            .context("dashboard without panels")?
            .iter()
            .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
            .filter_map(|t| t["expr"].as_str().map(String::from))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_groups_targets_by_job_with_labels() {
        let spec = PrometheusSpec {
            dir: PathBuf::from("/tmp/x"),
            listen: "127.0.0.1:9090".parse().unwrap(),
            rule_files: vec![PathBuf::from("/r.yaml")],
            targets: vec![
                Target::new("juneau-agent", "10.0.0.1:9742").label("node", "a"),
                Target::new("juneau-agent", "10.0.0.2:9742").label("node", "b"),
                Target::new("juneau-controller", "127.0.0.1:1"),
            ],
            interval_s: 2,
        };
        let c = spec.config();
        assert!(
            c.starts_with(
                "global: {scrape_interval: 2s, scrape_timeout: 1s, evaluation_interval: 2s}\n"
            ),
            "{c}"
        );
        assert!(c.contains("rule_files:\n  - '/r.yaml'\n"), "{c}");
        assert!(c.contains("  - job_name: juneau-agent\n    static_configs:\n      - {targets: ['10.0.0.1:9742'], labels: {node: 'a'}}\n      - {targets: ['10.0.0.2:9742'], labels: {node: 'b'}}\n"), "{c}");
        assert!(
            c.contains("      - {targets: ['127.0.0.1:1'], labels: {}}\n"),
            "{c}"
        );
    }
}
