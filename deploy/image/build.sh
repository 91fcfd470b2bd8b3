#!/usr/bin/env bash
# Builds the `juneau` container image that deploy/ and the Helm chart run:
#
#   deploy/image/build.sh [TAG] [OUT_DIR]      # TAG: the workspace version (0.1.0),
#                                              # OUT_DIR: the current directory
#
# writes OUT_DIR/juneau-TAG.tar, a docker-archive of `juneau:TAG` (for
# `ctr -n k8s.io images import`, `docker load`, `podman load`,
# `skopeo copy docker-archive:...`), from release builds (cargo build --release --locked)
# of the programs deploy/ runs: juneau-k8s-sync, juneau-dataplane, juneau-bgp,
# juneau-bfd. The same commit built in the same checkout gives the same bytes; see
# README.md "Install on a cluster" and docs/decisions.md. Needs cargo, clang (the XDP
# program), tar, ldd, objcopy and sha256sum; not root.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
args=()
if (($# >= 1)); then args+=(--tag "$1"); fi
out="${2:-$PWD}"
mkdir -p "$out"
args+=(--out-dir "$(cd "$out" && pwd)")
cd "$root"
exec cargo run --quiet --locked -p juneau-tests --bin juneau-image -- "${args[@]}"
