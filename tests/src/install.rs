//! Juneau installed as users install it: the `juneau` image built from release binaries
//! ([`build_image`]) and the Helm chart `deploy/helm/juneau` installed, upgraded and
//! rolled back with the real `helm` ([`Release`]); and the node components'
//! processes found inside their Pods ([`pod_process`]), for the operations that kill
//! or signal one of them as a crash or an operator would.
//!
//! The lab ([`crate::lab`]) and the tests that run on it use this; nothing here knows
//! the lab's topology beyond the values it is given.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::images::{self, ImageArchive};
use crate::repo_root;

/// The Helm release name.
pub const RELEASE: &str = "juneau";
/// The release namespace (deploy/namespace.yaml, labelled for privileged Pods).
pub const NAMESPACE: &str = "juneau-system";

/// Builds the four programs the image holds (`cargo build --release --locked`, into the
/// target directory of `CARGO_TARGET_DIR`, else the workspace's) and the `juneau:TAG`
/// image from them into `out_dir`; the same commit gives the same image whatever the tag.
pub fn build_image(out_dir: &Path, tag: &str) -> Result<ImageArchive> {
    let cargo = PathBuf::from(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    let manifest = repo_root().join("Cargo.toml");
    let bins = images::build_release_binaries(&cargo, &manifest)
        .context("building the image's release binaries")?;
    images::build_juneau(out_dir, tag, &bins)
        .with_context(|| format!("building the juneau:{tag} image"))
}

/// A release of the chart in a cluster, driven with `helm` (built by tests/setup.sh).
#[derive(Debug, Clone)]
pub struct Release {
    /// The cluster's admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// The values file every install and upgrade takes (`-f`).
    pub values: PathBuf,
}

impl Release {
    /// `helm install` of deploy/helm/juneau with [`Self::values`] and `--set` pairs;
    /// waits until every Pod of the release is Ready (at most `timeout`).
    pub fn install(&self, set: &[(&str, &str)], timeout: Duration) -> Result<String> {
        self.helm_changing("install", set, timeout)
    }

    /// `helm upgrade` with [`Self::values`] and `--set` pairs; waits for the rollout.
    pub fn upgrade(&self, set: &[(&str, &str)], timeout: Duration) -> Result<String> {
        self.helm_changing("upgrade", set, timeout)
    }

    /// `helm rollback` to `revision`; waits for the rollout.
    pub fn rollback(&self, revision: u32, timeout: Duration) -> Result<String> {
        let t = format!("{}s", timeout.as_secs());
        let out = self.helm(&[
            "rollback",
            RELEASE,
            &revision.to_string(),
            "--wait",
            "--timeout",
            &t,
        ])?;
        self.wait_rolled_out(timeout)?;
        Ok(out)
    }

    /// `helm uninstall` (its hooks included, as an operator runs it), waiting until the
    /// release's objects are deleted (at most `timeout`).
    pub fn uninstall(&self, timeout: Duration) -> Result<String> {
        let t = format!("{}s", timeout.as_secs());
        self.helm(&["uninstall", RELEASE, "--wait", "--timeout", &t])
    }

    /// The release's current revision (`helm history`).
    pub fn revision(&self) -> Result<u32> {
        let out = self.helm(&["history", RELEASE, "--max", "1", "-o", "json"])?;
        let v: serde_json::Value = serde_json::from_str(&out).context("helm history")?;
        v.as_array()
            .and_then(|a| a.last())
            .and_then(|r| r["revision"].as_u64())
            .map(|r| r as u32)
            .context("no revision in helm history")
    }

    fn helm_changing(&self, verb: &str, set: &[(&str, &str)], timeout: Duration) -> Result<String> {
        let chart = repo_root().join("deploy/helm/juneau").display().to_string();
        let values = self.values.display().to_string();
        let t = format!("{}s", timeout.as_secs());
        let mut args = vec![
            verb,
            RELEASE,
            &chart,
            "-f",
            &values,
            "--wait",
            "--timeout",
            &t,
        ];
        let pairs: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
        for p in &pairs {
            args.extend(["--set", p.as_str()]);
        }
        let out = self.helm(&args)?;
        // helm's --wait is content with a Deployment's minimum available Pods; the
        // rollout is over only when every replica runs the new template.
        self.wait_rolled_out(timeout)?;
        Ok(out)
    }

    /// Waits until the controller Deployment and the node DaemonSet have rolled out
    /// their current template (`kubectl rollout status`).
    pub fn wait_rolled_out(&self, timeout: Duration) -> Result<()> {
        let t = format!("--timeout={}s", timeout.as_secs());
        for what in ["deployment/juneau-controller", "daemonset/juneau-node"] {
            self.kubectl(&["-n", NAMESPACE, "rollout", "status", what, &t])
                .with_context(|| format!("{what} did not roll out"))?;
        }
        Ok(())
    }

    fn helm(&self, args: &[&str]) -> Result<String> {
        let helm = crate::kube::binaries_dir()?.join("helm");
        let out = Command::new(&helm)
            .args(args)
            .args(["--namespace", NAMESPACE])
            .env("KUBECONFIG", &self.kubeconfig)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {}", helm.display()))?;
        if !out.status.success() {
            bail!(
                "`helm {}` failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn kubectl(&self, args: &[&str]) -> Result<String> {
        crate::kube::kubectl_with(&self.kubeconfig, args, None)
    }
}

/// The pid of the process running `program` (its `argv[0]`'s file name, as the chart's
/// `command` starts it) in the network namespace `/run/netns/<netns>`, and whose
/// environment holds `env` (`NAME=value`) when given. A container's process in a
/// hostNetwork Pod shares its node's network namespace; a Pod on the Pod network has
/// its own, so `netns` is `None` there and only `program` and `env` select.
pub fn pod_process(program: &str, netns: Option<&str>, env: Option<&str>) -> Option<u32> {
    let want_ns = match netns {
        Some(n) => Some(fs::metadata(format!("/run/netns/{n}")).ok()?.ino()),
        None => None,
    };
    let mut found: Vec<u32> = fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let argv0 = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let argv0 = argv0.split(|&b| b == 0).next().unwrap_or_default();
            Path::new(&*String::from_utf8_lossy(argv0)).file_name()
                == Some(std::ffi::OsStr::new(program))
        })
        .filter(|pid| {
            want_ns.is_none_or(|ino| {
                fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == ino)
            })
        })
        .filter(|pid| {
            env.is_none_or(|kv| {
                fs::read(format!("/proc/{pid}/environ"))
                    .unwrap_or_default()
                    .split(|&b| b == 0)
                    .any(|e| e == kv.as_bytes())
            })
        })
        .collect();
    found.sort_unstable();
    // One process per container; the oldest (lowest pid) if a restart overlaps.
    found.first().copied()
}
