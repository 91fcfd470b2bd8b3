//! Container images built on this machine, without a registry (images cannot be pulled
//! here): the Pod sandbox ("pause") image and the user guide's nginx, made from Debian's
//! nginx. Each is a docker-archive tar (`manifest.json` + image config + one layer),
//! which `ctr -n k8s.io images import` loads into a node's containerd.
//!
//! - [`PAUSE_IMAGE`]: a tiny static C program (compiled with `gcc -static`) that sleeps
//!   until SIGTERM/SIGINT and reaps children — what the sandbox image does.
//! - [`NGINX_IMAGE`] (`nginx:1.27`, the guide's name): `/usr/sbin/nginx` with the shared
//!   libraries it links, `/bin/sleep` (for a `preStop` hook), Debian's welcome page and
//!   `mime.types`, and a config that logs every request to stdout (so `kubectl logs`
//!   shows it), serves `/healthz` without logging it (the readiness probe; also alone on
//!   port 8080), and adds
//!   `X-Served-By: <pod name>`. Stop signal SIGQUIT: nginx finishes its requests and
//!   then exits (SIGTERM would drop them), like the official image.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The sandbox image every node's containerd uses (`sandbox_image`).
pub const PAUSE_IMAGE: &str = "localhost/juneau-pause:1";
/// Files the nginx image serves under `/files/` (name, length), each
/// [`crate::http::pattern`] of its length: a page's size up to a large download.
pub const LARGE_FILES: [(&str, usize); 4] = [
    ("615", 615),
    ("64k", 64 << 10),
    ("4m", 4 << 20),
    ("64m", 64 << 20),
];

/// The guide's nginx image name (stored as `docker.io/library/nginx:1.27`).
pub const NGINX_IMAGE: &str = "nginx:1.27";

const PAUSE_C: &str = r#"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
static void quit(int s) { (void)s; _exit(0); }
int main(void) {
    signal(SIGINT, quit);
    signal(SIGTERM, quit);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"#;

const NGINX_CONF: &str = r#"user www-data;
worker_processes 1;
daemon off;
pid /run/nginx.pid;
error_log /dev/stderr warn;
events { worker_connections 1024; }
http {
  include /etc/nginx/mime.types;
  default_type application/octet-stream;
  access_log /dev/stdout;
  keepalive_timeout 65;
  keepalive_requests 100000;
  client_max_body_size 128m;
  client_body_temp_path /tmp/body;
  server {
    listen 80;
    root /var/www/html;
    # Uploads (WebDAV PUT), read back with GET on the same connection: real bodies in
    # both directions (see `LARGE_FILES`).
    location /uploads/ {
      root /tmp;
      dav_methods PUT DELETE;
      create_full_put_path on;
    }
    index index.html index.nginx-debian.html;
    add_header X-Served-By $hostname always;
    location = /healthz {
      access_log off;
      default_type text/plain;
      return 200 "ok\n";
    }
  }
  # /healthz only, on a port of its own (not the serving port): for probes that must not
  # share the serving port's path (see docs/operations.md).
  server {
    listen 8080;
    access_log off;
    location = /healthz {
      default_type text/plain;
      return 200 "ok\n";
    }
    location / { return 404; }
  }
}
"#;

/// Both images' docker-archive tars, built into `dir` (`pause.tar`, `nginx.tar`).
#[derive(Debug, Clone)]
pub struct Images {
    /// The pause image's archive.
    pub pause: PathBuf,
    /// The nginx image's archive.
    pub nginx: PathBuf,
}

impl Images {
    /// Builds both images into `dir` (a few seconds; needs gcc, libc6-dev and nginx).
    pub fn build(dir: &Path) -> Result<Images> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Images {
            pause: build_pause(dir)?,
            nginx: build_nginx(dir)?,
        })
    }

    /// The archives, for [`import`].
    pub fn archives(&self) -> [&Path; 2] {
        [&self.pause, &self.nginx]
    }
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn build_pause(dir: &Path) -> Result<PathBuf> {
    let work = dir.join("pause");
    let _ = fs::remove_dir_all(&work);
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&rootfs)?;
    let src = work.join("pause.c");
    fs::write(&src, PAUSE_C)?;
    run(Command::new("gcc")
        .args(["-static", "-Os", "-s", "-o"])
        .arg(rootfs.join("pause"))
        .arg(&src))
    .context("compiling the pause program (Debian packages gcc, libc6-dev)")?;
    let tar = dir.join("pause.tar");
    docker_archive(
        &work,
        &rootfs,
        PAUSE_IMAGE,
        serde_json::json!({ "Entrypoint": ["/pause"] }),
        &tar,
    )?;
    Ok(tar)
}

/// Copies `file` (and, for binaries, every library `ldd` names) into `rootfs`, keeping
/// its path.
fn copy_with_libs(rootfs: &Path, file: &str) -> Result<()> {
    let mut files = vec![file.to_string()];
    let ldd = run(Command::new("ldd").arg(file)).unwrap_or_default();
    for line in ldd.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = line
            .split("=>")
            .last()
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .unwrap_or_default();
        if path.starts_with('/') {
            files.push(path.to_string());
        }
    }
    for f in files {
        let dst = rootfs.join(f.trim_start_matches('/'));
        if let Some(p) = dst.parent() {
            fs::create_dir_all(p)?;
        }
        // Follow symlinks: the image gets the real file under the linked name.
        fs::copy(&f, &dst).with_context(|| format!("copying {f} into the image"))?;
    }
    Ok(())
}

fn build_nginx(dir: &Path) -> Result<PathBuf> {
    for need in ["/usr/sbin/nginx", "/etc/nginx/mime.types", "/bin/sleep"] {
        if !Path::new(need).exists() {
            bail!("{need} is missing: run tests/setup.sh (Debian package nginx-light)");
        }
    }
    let work = dir.join("nginx");
    let _ = fs::remove_dir_all(&work);
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&rootfs)?;
    copy_with_libs(&rootfs, "/usr/sbin/nginx")?;
    copy_with_libs(&rootfs, "/bin/sleep")?;
    for d in [
        "etc/nginx",
        "var/www/html",
        "var/log/nginx",
        "var/lib/nginx",
        "run",
        "tmp",
    ] {
        fs::create_dir_all(rootfs.join(d))?;
    }
    fs::copy("/etc/nginx/mime.types", rootfs.join("etc/nginx/mime.types"))?;
    let welcome = Path::new("/var/www/html/index.nginx-debian.html");
    let page = if welcome.exists() {
        fs::read_to_string(welcome)?
    } else {
        "<!DOCTYPE html>\n<html><head><title>Welcome to nginx!</title></head>\n\
         <body><h1>Welcome to nginx!</h1></body></html>\n"
            .to_string()
    };
    fs::write(rootfs.join("var/www/html/index.nginx-debian.html"), page)?;
    fs::write(rootfs.join("etc/nginx/nginx.conf"), NGINX_CONF)?;
    fs::create_dir_all(rootfs.join("var/www/html/files"))?;
    for (name, len) in LARGE_FILES {
        fs::write(
            rootfs.join("var/www/html/files").join(name),
            crate::http::pattern(len),
        )?;
    }
    // Workers run as www-data: uploads and request bodies go to a world-writable /tmp.
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(rootfs.join("tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nwww-data:x:33:33:www-data:/var/www:/usr/sbin/nologin\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    )?;
    fs::write(
        rootfs.join("etc/group"),
        "root:x:0:\nwww-data:x:33:\nnogroup:x:65534:\n",
    )?;
    let tar = dir.join("nginx.tar");
    docker_archive(
        &work,
        &rootfs,
        NGINX_IMAGE,
        serde_json::json!({
            "Entrypoint": ["/usr/sbin/nginx"],
            "Cmd": ["-c", "/etc/nginx/nginx.conf"],
            "ExposedPorts": { "80/tcp": {} },
            "StopSignal": "SIGQUIT",
        }),
        &tar,
    )?;
    Ok(tar)
}

/// Writes a docker-archive tar of `rootfs` named `tag` to `out` (through `work`).
fn docker_archive(
    work: &Path,
    rootfs: &Path,
    tag: &str,
    config: serde_json::Value,
    out: &Path,
) -> Result<()> {
    let arch = work.join("archive");
    fs::create_dir_all(&arch)?;
    run(Command::new("tar")
        .args([
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "--sort=name",
            "--mtime=@0",
            "-C",
        ])
        .arg(rootfs)
        .arg("-cf")
        .arg(arch.join("layer.tar"))
        .arg("."))?;
    let sum = run(Command::new("sha256sum").arg(arch.join("layer.tar")))?;
    let digest = sum
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    let image_config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{digest}")] },
        "history": [{ "created": "1970-01-01T00:00:00Z", "created_by": "juneau-tests images.rs" }],
    });
    fs::write(arch.join("config.json"), serde_json::to_vec(&image_config)?)?;
    let manifest = serde_json::json!([{
        "Config": "config.json",
        "RepoTags": [tag],
        "Layers": ["layer.tar"],
    }]);
    fs::write(arch.join("manifest.json"), serde_json::to_vec(&manifest)?)?;
    run(Command::new("tar")
        .arg("-C")
        .arg(&arch)
        .arg("-cf")
        .arg(out)
        .args(["manifest.json", "config.json", "layer.tar"]))?;
    Ok(())
}

/// `ctr -a SOCKET -n k8s.io images import ARCHIVE` for each archive.
pub fn import(containerd_socket: &Path, archives: &[&Path]) -> Result<()> {
    for a in archives {
        run(Command::new("ctr")
            .arg("-a")
            .arg(containerd_socket)
            .args(["-n", "k8s.io", "images", "import"])
            .arg(a))
        .with_context(|| format!("importing {} into containerd", a.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_docker_archives_with_their_programs() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let images = Images::build(dir.path())?;
        let list = run(Command::new("tar").arg("-tf").arg(&images.nginx))?;
        assert!(
            list.contains("manifest.json") && list.contains("layer.tar"),
            "{list}"
        );
        let layer = dir.path().join("nginx/archive/layer.tar");
        let files = run(Command::new("tar").arg("-tf").arg(&layer))?;
        for f in [
            "./usr/sbin/nginx",
            "./etc/nginx/nginx.conf",
            "./bin/sleep",
            "./lib64/ld-linux-x86-64.so.2",
        ] {
            assert!(
                files.lines().any(|l| l == f),
                "{f} missing from the nginx image"
            );
        }
        let cfg: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.path().join("nginx/archive/config.json"))?)?;
        assert_eq!(cfg["config"]["StopSignal"], "SIGQUIT");
        // The pause program is static: it runs with no libraries at all.
        let pause = dir.path().join("pause/rootfs/pause");
        let file = run(Command::new("ldd").arg(&pause)).unwrap_or_else(|e| format!("{e:#}"));
        assert!(file.contains("not a dynamic executable"), "{file}");
        Ok(())
    }
}
