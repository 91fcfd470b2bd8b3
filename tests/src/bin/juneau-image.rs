//! `juneau-image`: builds the `juneau:<tag>` container image that deploy/ and the Helm
//! chart run, as a docker-archive tar `juneau-<tag>.tar` (`deploy/image/build.sh` runs
//! it). By default it first runs `cargo build --release --locked` for the image's
//! programs; `--bin-dir` takes already built ones instead. The image itself is made by
//! `juneau_tests::images::build_juneau` (what it holds, and why it is reproducible, is
//! documented there and in docs/decisions.md).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use juneau_tests::images::{self, JUNEAU_REPOSITORY};

/// Build the `juneau` container image (docker-archive tar).
#[derive(Parser, Debug)]
#[command(name = "juneau-image")]
struct Cli {
    /// The image tag: the archive is `juneau-<TAG>.tar` and holds `juneau:<TAG>`.
    #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
    tag: String,
    /// Where to write the archive (created if missing).
    #[arg(long, default_value = ".")]
    out_dir: PathBuf,
    /// Take the programs from this directory instead of building them in release mode.
    #[arg(long)]
    bin_dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let start = Instant::now();
    let bin_dir = match cli.bin_dir {
        Some(d) => d,
        None => {
            let cargo = PathBuf::from(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
            let manifest = juneau_tests::repo_root().join("Cargo.toml");
            eprintln!("juneau-image: cargo build --release of the image's programs");
            images::build_release_binaries(&cargo, &manifest)
                .context("building the release binaries")?
        }
    };
    let built = start.elapsed();
    let image = images::build_juneau(&cli.out_dir, &cli.tag, &bin_dir).with_context(|| {
        format!(
            "building the {JUNEAU_REPOSITORY}:{} image from {}",
            cli.tag,
            bin_dir.display()
        )
    })?;
    let bytes = std::fs::metadata(&image.path)?.len();
    println!("image    {JUNEAU_REPOSITORY}:{}", cli.tag);
    println!("archive  {}", image.path.display());
    println!("size     {:.1} MiB", bytes as f64 / (1024.0 * 1024.0));
    println!("id       {} (config)", image.config_digest);
    println!("layer    {}", image.layer_digest);
    println!("programs {}", bin_dir.display());
    println!(
        "time     {:.0} s (binaries {:.0} s, image {:.0} s)",
        start.elapsed().as_secs_f64(),
        built.as_secs_f64(),
        (start.elapsed() - built).as_secs_f64()
    );
    println!(
        "import   ctr -n k8s.io images import {}   (on each node, or push it: README.md)",
        image.path.display()
    );
    Ok(())
}
