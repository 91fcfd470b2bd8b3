//! The `juneau` image (`juneau_tests::images::build_juneau`, what `deploy/image/build.sh`
//! builds from release binaries), here from the debug binaries of the target directory:
//! two builds are byte-identical, the archive holds every program (and nftables' `nft`)
//! and nothing but their libraries and the passwd files (no shell), and a real containerd
//! imports it and runs each program's `--help` (and `nft --version`) in it.

use std::collections::BTreeSet;
use std::fs;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use juneau_tests::images::{
    build_juneau, run, sha256_file, JUNEAU_BINARIES, JUNEAU_BIN_DIR, JUNEAU_UID,
};
use juneau_tests::lab::JuneauBins;
use juneau_tests::netns::{unique_prefix, Netns};
use juneau_tests::node::{check_gone, KubeletNode, NodeSpec};

/// A copy of the programs with other mtimes, modes (0700) and directory: the image must
/// not depend on them.
fn copy_bins(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for (bin, _) in JUNEAU_BINARIES {
        fs::copy(from.join(bin), to.join(bin))?;
        fs::set_permissions(to.join(bin), fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

#[test]
fn juneau_image_is_reproducible_minimal_and_runs_in_containerd() -> Result<()> {
    let bins = JuneauBins::build_and_locate()?;
    let tmp = tempfile::tempdir()?;
    let t = Instant::now();
    let a = build_juneau(&tmp.path().join("a"), "test", &bins.dir)?;
    eprintln!("image built in {:.1} s", t.elapsed().as_secs_f64());
    copy_bins(&bins.dir, &tmp.path().join("bins"))?;
    let t = Instant::now();
    let b = build_juneau(&tmp.path().join("b"), "test", &tmp.path().join("bins"))?;
    eprintln!("again in {:.1} s", t.elapsed().as_secs_f64());
    assert_eq!(a.path, tmp.path().join("a/juneau-test.tar"));
    assert_eq!(a.config_digest, b.config_digest, "image IDs differ");
    assert_eq!(a.layer_digest, b.layer_digest, "layers differ");
    assert_eq!(
        sha256_file(&a.path)?,
        sha256_file(&b.path)?,
        "archives differ"
    );
    // Nothing but the archive is left in the output directory.
    let left: Vec<_> = fs::read_dir(tmp.path().join("a"))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    assert_eq!(left, vec![std::ffi::OsString::from("juneau-test.tar")]);

    // The archive: a docker-archive of juneau:test whose layer holds the programs, their
    // libraries and the passwd files, nothing else.
    let x = tmp.path().join("x");
    fs::create_dir_all(&x)?;
    run(Command::new("tar")
        .arg("-xf")
        .arg(&a.path)
        .arg("-C")
        .arg(&x))?;
    let manifest: serde_json::Value = serde_json::from_slice(&fs::read(x.join("manifest.json"))?)?;
    assert_eq!(manifest[0]["RepoTags"], serde_json::json!(["juneau:test"]));
    assert_eq!(sha256_file(&x.join("config.json"))?, a.config_digest);
    assert_eq!(sha256_file(&x.join("layer.tar"))?, a.layer_digest);
    let config: serde_json::Value = serde_json::from_slice(&fs::read(x.join("config.json"))?)?;
    assert_eq!(config["created"], "1970-01-01T00:00:00Z");
    assert_eq!(
        config["config"],
        serde_json::json!({ "Env": [format!("PATH={JUNEAU_BIN_DIR}")] }),
        "the config sets PATH only (no User: the node components run as root)"
    );
    let listing = run(Command::new("tar")
        .args(["--numeric-owner", "-tvf"])
        .arg(x.join("layer.tar")))?;
    let mut files = BTreeSet::new();
    for line in listing.lines() {
        // "-rwxr-xr-x 0/0 123 1970-01-01 00:00 ./usr/local/bin/juneau-bgp"
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(
            f.len() == 6 && f[1] == "0/0" && f[3] == "1970-01-01" && f[4] == "00:00",
            "an entry not owned by 0:0 at mtime 0, or a link: {line}"
        );
        assert!(
            ["drwxr-xr-x", "-rwxr-xr-x", "-rw-r--r--"].contains(&f[0]),
            "unexpected mode: {line}"
        );
        if !f[0].starts_with('d') {
            files.insert(f[5].trim_start_matches('.').to_string());
        }
    }
    for (bin, _) in JUNEAU_BINARIES {
        assert!(
            files.remove(&format!("{JUNEAU_BIN_DIR}/{bin}")),
            "{bin} missing from the image: {files:?}"
        );
    }
    // nftables' `nft`: the dataplane programs the DNAT to host-network backends with it.
    assert!(
        files.remove(&format!("{JUNEAU_BIN_DIR}/nft")),
        "nft missing from the image: {files:?}"
    );
    for f in ["/etc/passwd", "/etc/group"] {
        assert!(files.remove(f), "{f} missing from the image");
    }
    assert!(
        files.contains("/lib64/ld-linux-x86-64.so.2") || std::env::consts::ARCH != "x86_64",
        "no dynamic loader: {files:?}"
    );
    for f in &files {
        assert!(
            f.contains(".so"),
            "{f} is in the image but is neither a program nor a library"
        );
    }
    for sh in ["/bin/sh", "/usr/bin/sh", "/bin/bash", "/bin/busybox"] {
        assert!(!files.contains(sh), "{sh} in the image");
    }
    let passwd = run(Command::new("tar")
        .arg("-xOf")
        .arg(x.join("layer.tar"))
        .arg("./etc/passwd"))?;
    assert!(
        passwd.contains(&format!(
            "juneau:x:{JUNEAU_UID}:{JUNEAU_UID}:juneau:/nonexistent:/sbin/nologin\n"
        )),
        "{passwd}"
    );

    // A real containerd imports it and runs each program in it.
    let p = unique_prefix("img");
    let netns = Netns::new(format!("{p}n"))?;
    let dir = tmp.path().join("node");
    let cgroup_root = format!("/{p}");
    let spec = NodeSpec {
        name: format!("{p}-node"),
        netns: netns.name().to_string(),
        node_ip: Ipv4Addr::new(10, 252, 0, 2),
        node_ip6: None,
        pod_subnet: Ipv4Addr::new(10, 252, 1, 0),
        pod_subnet6: None,
        dir: dir.clone(),
        cgroup_root: cgroup_root.clone(),
        kubeconfig: tmp.path().join("none"),
        labels: vec![],
    };
    let t = Instant::now();
    let node = KubeletNode::start_runtime_importing(spec, &[&a.path])?;
    eprintln!(
        "containerd up, image imported in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let sock = node.containerd_socket();
    let ctr = |args: &[&str]| -> Result<String> {
        run(Command::new("ctr")
            .arg("-a")
            .arg(&sock)
            .args(["-n", "k8s.io"])
            .args(args))
    };
    let image = "docker.io/library/juneau:test";
    let list = ctr(&["images", "ls", "-q"])?;
    assert!(list.lines().any(|l| l == image), "{list}");
    let runc_root = dir.join("runc-ctr").display().to_string();
    let run_in_image = |id: &str, argv: &[&str]| -> Result<String> {
        let cgroup = format!("{cgroup_root}/{id}");
        let mut args = vec![
            "run",
            "--rm",
            "--read-only",
            "--runc-root",
            &runc_root,
            "--cgroup",
            &cgroup,
            image,
            id,
        ];
        args.extend_from_slice(argv);
        ctr(&args)
    };
    for (i, (bin, _)) in JUNEAU_BINARIES.iter().enumerate() {
        let help = run_in_image(&format!("{p}-{i}"), &[bin, "--help"])
            .with_context(|| format!("{bin} --help in the image"))?;
        assert!(help.contains("Usage:"), "{bin} --help:\n{help}");
        let expect: &[&str] = match *bin {
            "juneau-k8s-sync" => &["controller", "agent"],
            "juneau-dataplane" => &["--uplink", "--state-file"],
            "juneau-bgp" | "juneau-bfd" => &["--state-file"],
            _ => &[],
        };
        for e in expect {
            assert!(help.contains(e), "{bin} --help lacks {e}:\n{help}");
        }
    }
    let nft = run_in_image(&format!("{p}-nft"), &["nft", "--version"])
        .context("nft --version in the image")?;
    assert!(nft.contains("nftables"), "nft --version:\n{nft}");
    eprintln!("programs ran in {:.1} s", t.elapsed().as_secs_f64());
    // No shell to run.
    let sh = run_in_image(&format!("{p}-sh"), &["sh", "-c", "true"]);
    assert!(sh.is_err(), "a shell ran in the image: {sh:?}");
    drop(node);
    check_gone(&dir, &cgroup_root)?;
    Ok(())
}
