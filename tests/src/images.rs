//! Container images built on this machine, without a registry (images cannot be pulled
//! here): the Pod sandbox ("pause") image, the user guide's nginx, made from Debian's
//! nginx, and Juneau's own image. Each is a docker-archive tar (`manifest.json` + image
//! config + one layer), which `ctr -n k8s.io images import` loads into a node's
//! containerd (and `docker load` / `podman load` into theirs). One writer makes them all
//! ([`docker_archive`], reproducible: same files, same bytes), one copier puts a program
//! and the libraries it links into an image ([`copy_with_libs`]).
//!
//! - [`PAUSE_IMAGE`]: a tiny static C program (compiled with `gcc -static`) that sleeps
//!   until SIGTERM/SIGINT and reaps children — what the sandbox image does.
//! - [`NGINX_IMAGE`] (`nginx:1.27`, the guide's name): `/usr/sbin/nginx` with the shared
//!   libraries it links, Debian's welcome page and
//!   `mime.types`, and a config that logs every request to stdout (so `kubectl logs`
//!   shows it), serves `/healthz` without logging it (the readiness probe; also alone on
//!   port 8080), and adds
//!   `X-Served-By: <pod name>`; `/bin/drain`, the preStop hook of a graceful stop (every
//!   kept-alive connection ends after its next answer, with `Connection: close`). Stop signal SIGQUIT: nginx finishes its requests and
//!   then exits (SIGTERM would drop them), like the official image. `/bin/udp-echo PORT`,
//!   the lab's UDP application (the same image, another command).
//! - `juneau:<tag>` ([`build_juneau`]): the image deploy/ and the Helm chart run — the
//!   programs of [`JUNEAU_BINARIES`], their libraries, a passwd with the non-root user
//!   `juneau` ([`JUNEAU_UID`]), nothing else. `deploy/image/build.sh` (the `juneau-image`
//!   binary) builds it from release binaries; the tests from any build.

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

/// The nginx image's `/bin/drain SECONDS`, its preStop hook: creates /tmp/draining
/// (nginx then ends each kept-alive connection after its next answer, see
/// [`NGINX_CONF`]) and sleeps SECONDS, while the load balancer stops sending the Pod new
/// connections; then the kubelet sends SIGQUIT. Static, like the pause program: the
/// image needs no shell.
const DRAIN_C: &str = r#"
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int fd = open("/tmp/draining", O_CREAT | O_WRONLY, 0644);
    if (fd < 0) return 1;
    close(fd);
    sleep(argc > 1 ? (unsigned)atoi(argv[1]) : 5);
    return 0;
}
"#;

/// The nginx image's `/bin/udp-echo PORT`: a UDP application for the lab's UDP
/// Services, answering each datagram with `<hostname> saw <client address>:<port> `
/// followed by the datagram (so the client sees which Pod served it and that the Pod saw
/// its real address); exits at SIGTERM. Static, like the pause program.
const UDP_ECHO_C: &str = r#"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
int main(int argc, char **argv) {
    signal(SIGTERM, quit);
    signal(SIGINT, quit);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(argc > 1 ? atoi(argv[1]) : 5353);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0) { perror("bind"); return 1; }
    char host[64] = "?";
    gethostname(host, sizeof host - 1);
    static char in[65536], out[65536 + 128];
    for (;;) {
        struct sockaddr_in peer;
        socklen_t len = sizeof peer;
        ssize_t n = recvfrom(fd, in, sizeof in, 0, (struct sockaddr *)&peer, &len);
        if (n < 0) continue;
        int h = snprintf(out, 128, "%s saw %s:%u ", host, inet_ntoa(peer.sin_addr),
                         ntohs(peer.sin_port));
        memcpy(out + h, in, (size_t)n);
        sendto(fd, out, (size_t)h + (size_t)n, 0, (struct sockaddr *)&peer, len);
    }
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
    listen [::]:80;
    root /var/www/html;
    # Graceful stop: the preStop hook (`/bin/drain`) creates /tmp/draining; from then on
    # every answer says `Connection: close` and ends its connection (keepalive_timeout 0
    # in the /.draining/ locations), so a kept-alive client moves to another Pod between
    # two of its requests. Without it nginx closes kept-alive connections at SIGQUIT
    # while their next request may be on its way: a read error for a client that does
    # not retry, like wrk (docs/operations.md).
    if (-f /tmp/draining) {
      rewrite ^ /.draining$uri last;
    }
    location ^~ /.draining/uploads/ {
      internal;
      keepalive_timeout 0;
      rewrite ^/\.draining(/.*)$ $1 break;
      root /tmp;
      dav_methods PUT DELETE;
      create_full_put_path on;
    }
    location ^~ /.draining/ {
      internal;
      keepalive_timeout 0;
      rewrite ^/\.draining(/.*)$ $1 break;
    }
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
    listen [::]:8080;
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

/// Runs `cmd`; its stdout, or an error with its status and output.
pub fn run(cmd: &mut Command) -> Result<String> {
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

/// Compiles the C program `source` statically to `out` (its name says which in errors).
fn compile_static(work: &Path, name: &str, source: &str, out: &Path) -> Result<()> {
    let src = work.join(format!("{name}.c"));
    fs::write(&src, source)?;
    run(Command::new("gcc")
        .args(["-static", "-Os", "-s", "-o"])
        .arg(out)
        .arg(&src))
    .with_context(|| format!("compiling the {name} program (Debian packages gcc, libc6-dev)"))?;
    Ok(())
}

fn build_pause(dir: &Path) -> Result<PathBuf> {
    let work = dir.join("pause");
    let _ = fs::remove_dir_all(&work);
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&rootfs)?;
    compile_static(&work, "pause", PAUSE_C, &rootfs.join("pause"))?;
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

fn build_nginx(dir: &Path) -> Result<PathBuf> {
    for need in ["/usr/sbin/nginx", "/etc/nginx/mime.types"] {
        if !Path::new(need).exists() {
            bail!("{need} is missing: run tests/setup.sh (Debian package nginx-light)");
        }
    }
    let work = dir.join("nginx");
    let _ = fs::remove_dir_all(&work);
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&rootfs)?;
    copy_with_libs(&rootfs, Path::new("/usr/sbin/nginx"), "/usr/sbin/nginx")?;
    fs::create_dir_all(rootfs.join("bin"))?;
    compile_static(&work, "drain", DRAIN_C, &rootfs.join("bin/drain"))?;
    compile_static(&work, "udp-echo", UDP_ECHO_C, &rootfs.join("bin/udp-echo"))?;
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

/// Copies the program `src` to `dst` (an absolute path inside the image) under `rootfs`,
/// with every shared library `ldd` names at its own path (the dynamic loader too), so it
/// runs in an image that has nothing else. Symlinks are followed: the image gets the real
/// file under the linked name. A library `ldd` cannot find is an error; a static program
/// (`ldd`: "not a dynamic executable") needs none.
pub fn copy_with_libs(rootfs: &Path, src: &Path, dst: &str) -> Result<()> {
    let mut files = vec![(src.to_path_buf(), dst.to_string())];
    let ldd = Command::new("ldd")
        .arg(src)
        .output()
        .with_context(|| format!("running ldd {}", src.display()))?;
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        if line.contains("=> not found") {
            bail!("{}: a library is missing: {}", src.display(), line.trim());
        }
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = line
            .split("=>")
            .last()
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .unwrap_or_default();
        if path.starts_with('/') {
            files.push((PathBuf::from(path), path.to_string()));
        }
    }
    for (from, to) in files {
        let dst = rootfs.join(to.trim_start_matches('/'));
        if let Some(p) = dst.parent() {
            fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        }
        fs::copy(&from, &dst)
            .with_context(|| format!("copying {} into the image", from.display()))?;
    }
    Ok(())
}

/// A docker-archive tar that [`docker_archive`] wrote, with the digests that name the
/// image: the same digests, the same image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageArchive {
    /// The archive (`manifest.json`, `config.json`, `layer.tar`).
    pub path: PathBuf,
    /// `sha256:` of the image config: the image ID (`docker images`, `crictl images`).
    pub config_digest: String,
    /// `sha256:` of the one (uncompressed) layer: its diff ID.
    pub layer_digest: String,
}

/// `sha256:<hex>` of a file (`sha256sum`).
pub fn sha256_file(path: &Path) -> Result<String> {
    let sum = run(Command::new("sha256sum").arg(path))?;
    let hex = sum.split_whitespace().next().unwrap_or_default();
    if hex.len() != 64 {
        bail!("sha256sum {}: unexpected output {sum:?}", path.display());
    }
    Ok(format!("sha256:{hex}"))
}

/// The image config's `architecture` for the machine these programs are built for.
fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// `tar` options that make an archive depend only on its files' names, contents and
/// modes: entries sorted by name, owned by 0:0, mtime 0, GNU format (not the build
/// machine's default).
const REPRODUCIBLE_TAR: [&str; 6] = [
    "--format=gnu",
    "--sort=name",
    "--mtime=@0",
    "--owner=0",
    "--group=0",
    "--numeric-owner",
];

/// Writes a docker-archive tar of `rootfs` named `tag` to `out` (through `work`) — the
/// one writer of images in the repository. `config` is the image config's `config`
/// (Entrypoint, Env, User, ...). The archive is reproducible: the same files with the
/// same modes give the same bytes (see [`REPRODUCIBLE_TAR`]; `created` is the epoch). It
/// is written beside and renamed to `out`, so a failed build leaves no half archive.
pub fn docker_archive(
    work: &Path,
    rootfs: &Path,
    tag: &str,
    config: serde_json::Value,
    out: &Path,
) -> Result<ImageArchive> {
    let arch = work.join("archive");
    fs::create_dir_all(&arch).with_context(|| format!("creating {}", arch.display()))?;
    run(Command::new("tar")
        .args(REPRODUCIBLE_TAR)
        .arg("-C")
        .arg(rootfs)
        .arg("-cf")
        .arg(arch.join("layer.tar"))
        .arg("."))
    .context("writing the image layer")?;
    let layer_digest = sha256_file(&arch.join("layer.tar"))?;
    let image_config = serde_json::json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
        "history": [{ "created": "1970-01-01T00:00:00Z", "created_by": "juneau-tests images.rs" }],
    });
    fs::write(arch.join("config.json"), serde_json::to_vec(&image_config)?)?;
    let config_digest = sha256_file(&arch.join("config.json"))?;
    let manifest = serde_json::json!([{
        "Config": "config.json",
        "RepoTags": [tag],
        "Layers": ["layer.tar"],
    }]);
    fs::write(arch.join("manifest.json"), serde_json::to_vec(&manifest)?)?;
    let partial = work.join("archive.tar");
    run(Command::new("tar")
        .args(REPRODUCIBLE_TAR)
        .arg("--mode=a=r,u+w")
        .arg("-C")
        .arg(&arch)
        .arg("-cf")
        .arg(&partial)
        .args(["manifest.json", "config.json", "layer.tar"]))
    .context("writing the docker archive")?;
    fs::rename(&partial, out)
        .with_context(|| format!("moving {} to {}", partial.display(), out.display()))?;
    Ok(ImageArchive {
        path: out.to_path_buf(),
        config_digest,
        layer_digest,
    })
}

/// The `juneau` image's repository: deploy/ and the chart's default `image.repository`
/// (`juneau:TAG` is stored as `docker.io/library/juneau:TAG`, the name the kubelet asks
/// for).
pub const JUNEAU_REPOSITORY: &str = "juneau";
/// The programs the `juneau` image carries in [`JUNEAU_BIN_DIR`]: (binary, the package
/// that builds it) — what deploy/ runs (`command:`). Not `kubectl-juneau`: it runs where
/// kubectl does, and would add a third to the image.
pub const JUNEAU_BINARIES: [(&str, &str); 4] = [
    ("juneau-k8s-sync", "juneau-k8s-sync"),
    ("juneau-dataplane", "juneau-dataplane"),
    ("juneau-bgp", "juneau-bgp"),
    ("juneau-bfd", "juneau-bgp"),
];
/// Where the programs are in the image (the image's only `PATH` entry).
pub const JUNEAU_BIN_DIR: &str = "/usr/local/bin";
/// nftables' `nft` on the building machine, copied into the image with its libraries.
pub const NFT: &str = "/usr/sbin/nft";
/// The image's non-root user and group `juneau` (the controller runs as it; deploy/
/// sets `runAsUser`).
pub const JUNEAU_UID: u32 = 65532;

/// The archive's file name for `tag`: `juneau-<tag>.tar`.
pub fn juneau_archive_name(tag: &str) -> String {
    format!("{JUNEAU_REPOSITORY}-{tag}.tar")
}

/// Directories `0755`, programs (any execute bit) `0755`, other files `0644`: the layer
/// then does not depend on the umask or on the modes of the copied files.
fn normalize_modes(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = fs::symlink_metadata(path).with_context(|| format!("{}", path.display()))?;
    let mode = if meta.is_dir() {
        for e in fs::read_dir(path)? {
            normalize_modes(&e?.path())?;
        }
        0o755
    } else if meta.is_file() {
        if meta.permissions().mode() & 0o111 != 0 {
            0o755
        } else {
            0o644
        }
    } else {
        bail!("{}: neither a file nor a directory", path.display());
    };
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}

/// Builds the `juneau:<tag>` image from the binaries in `bin_dir` (see
/// [`JUNEAU_BINARIES`]) into `out_dir/juneau-<tag>.tar` (a docker-archive, for
/// `ctr images import`, `docker load`, `podman load`, `skopeo copy docker-archive:`).
///
/// The image holds the programs in [`JUNEAU_BIN_DIR`] (without their debug info:
/// `objcopy --strip-debug`; symbols stay) and nftables' `nft` ([`NFT`], for the
/// dataplane's DNAT to host-network backends), the shared libraries they link
/// (from this machine, as `ldd` resolves them), `/etc/passwd` and `/etc/group` with root
/// and `juneau` ([`JUNEAU_UID`]) — no shell, no package manager, nothing else. The config
/// sets only `PATH`: no entrypoint (each container names its program, as deploy/ does)
/// and no `User` (the node components need root; the controller's non-root user is set
/// in deploy/). The same binaries and libraries give the same bytes, whatever the tag's
/// directory, umask or the files' mtimes (the tag is only in `manifest.json`, so the
/// image ID does not depend on it).
pub fn build_juneau(out_dir: &Path, tag: &str, bin_dir: &Path) -> Result<ImageArchive> {
    fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    // Inside out_dir, so the finished archive is renamed into place, and removed on drop.
    let work = tempfile::Builder::new()
        .prefix(".juneau-image-")
        .tempdir_in(out_dir)
        .with_context(|| format!("creating a work directory in {}", out_dir.display()))?;
    let rootfs = work.path().join("rootfs");
    fs::create_dir_all(&rootfs)?;
    for (bin, package) in JUNEAU_BINARIES {
        let src = bin_dir.join(bin);
        if !src.is_file() {
            bail!(
                "{} is missing: build it with `cargo build --release -p {package} --bin {bin}`",
                src.display()
            );
        }
        let dst = format!("{JUNEAU_BIN_DIR}/{bin}");
        copy_with_libs(&rootfs, &src, &dst)?;
        // The release profile keeps line tables (`debug = 1`, for profiling): 86% of the
        // bytes. The image keeps the symbols (backtraces name functions), not those.
        run(Command::new("objcopy")
            .arg("--strip-debug")
            .arg(rootfs.join(dst.trim_start_matches('/'))))
        .with_context(|| format!("stripping the debug info of {bin} (objcopy, binutils)"))?;
    }
    // nftables' `nft`: the dataplane programs the kernel's DNAT to host-network backends
    // with it (dataplane/src/host_network.rs); on PATH beside the programs.
    let nft = Path::new(NFT);
    if !nft.is_file() {
        bail!("{NFT} is missing: install nftables (tests/setup/apt-packages.txt)");
    }
    copy_with_libs(&rootfs, nft, &format!("{JUNEAU_BIN_DIR}/nft"))?;
    fs::create_dir_all(rootfs.join("etc"))?;
    fs::write(
        rootfs.join("etc/passwd"),
        format!(
            "root:x:0:0:root:/root:/sbin/nologin\n\
             juneau:x:{JUNEAU_UID}:{JUNEAU_UID}:juneau:/nonexistent:/sbin/nologin\n"
        ),
    )?;
    fs::write(
        rootfs.join("etc/group"),
        format!("root:x:0:\njuneau:x:{JUNEAU_UID}:\n"),
    )?;
    normalize_modes(&rootfs)?;
    docker_archive(
        work.path(),
        &rootfs,
        &format!("{JUNEAU_REPOSITORY}:{tag}"),
        serde_json::json!({ "Env": [format!("PATH={JUNEAU_BIN_DIR}")] }),
        &out_dir.join(juneau_archive_name(tag)),
    )
}

/// Runs `cargo build --release --locked` for the programs of [`JUNEAU_BINARIES`] in the
/// workspace of `manifest` (its `Cargo.toml`) and returns the directory they are in
/// (the cargo target directory's `release/`, wherever `CARGO_TARGET_DIR` puts it).
/// Cargo's progress and diagnostics go to stderr.
pub fn build_release_binaries(cargo: &Path, manifest: &Path) -> Result<PathBuf> {
    let mut cmd = Command::new(cargo);
    cmd.arg("build").arg("--manifest-path").arg(manifest).args([
        "--release",
        "--locked",
        "--message-format=json-render-diagnostics",
    ]);
    let mut packages: Vec<&str> = JUNEAU_BINARIES.iter().map(|(_, p)| *p).collect();
    packages.dedup();
    for p in packages {
        cmd.args(["-p", p]);
    }
    for (bin, _) in JUNEAU_BINARIES {
        cmd.args(["--bin", bin]);
    }
    // `cargo run` gives its program the variables of the package it runs; some build
    // scripts (ring's) rebuild when one of them changes, so drop them: the build then
    // reuses what a plain `cargo build --release` built, and the other way round.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&k.as_ref())
        {
            cmd.env_remove(k.as_ref());
        }
    }
    cmd.stderr(std::process::Stdio::inherit());
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({})", out.status);
    }
    let mut dirs = std::collections::BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        if let Some(exe) = msg["executable"].as_str() {
            let exe = Path::new(exe);
            if let (Some(name), Some(dir)) = (exe.file_name(), exe.parent()) {
                dirs.insert(name.to_string_lossy().into_owned(), dir.to_path_buf());
            }
        }
    }
    let mut dir: Option<PathBuf> = None;
    for (bin, _) in JUNEAU_BINARIES {
        let d = dirs
            .get(bin)
            .with_context(|| format!("cargo built no executable {bin}"))?;
        match &dir {
            None => dir = Some(d.clone()),
            Some(first) if first != d => {
                bail!(
                    "cargo put {bin} in {} and not in {}",
                    d.display(),
                    first.display()
                )
            }
            Some(_) => {}
        }
    }
    dir.context("no binaries")
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
            "./bin/drain",
            "./bin/udp-echo",
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
