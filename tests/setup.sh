#!/usr/bin/env bash
# Installs everything Juneau's tests and lab need on a fresh Debian machine, idempotently:
#   1. the Debian packages listed in tests/setup/apt-packages.txt (BIRD 2, FRR, GoBGP,
#      clang/libbpf for the XDP programs, nginx, nftables, etcd, ...);
#   2. kube-apiserver, kube-controller-manager and etcd built from the k8s.io/kubernetes
#      Go module (tests/k8s/build.sh; cached outside the checkout, built once per machine);
#   3. a bpffs mount at /sys/fs/bpf (pinned maps) when missing;
#   4. cargo-deny, the dependency policy's checker (deny.toml, tests/deny.sh), built
#      from crates.io at a pinned version (cargo install --locked; once per machine).
# Safe to run again: each step skips what is already there.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

step() { printf '\n==> %s\n' "$*"; }

step "[setup 1/4] Debian packages"
mapfile -t want < <(grep -v '^\s*#' "$here/setup/apt-packages.txt" | awk 'NF {print $1}')
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "all ${#want[@]} packages present"
fi
# Debian starts some daemons on install; the tests run their own copies in namespaces.
for svc in bird frr gobgpd nginx; do
    if systemctl is-active --quiet "$svc" 2>/dev/null; then
        systemctl stop "$svc" >/dev/null 2>&1 || true
        systemctl disable "$svc" >/dev/null 2>&1 || true
    fi
done

step "[setup 2/4] Kubernetes control plane binaries (built from source once per machine)"
"$here/k8s/build.sh"

step "[setup 3/4] bpffs"
if ! mountpoint -q /sys/fs/bpf 2>/dev/null; then
    mkdir -p /sys/fs/bpf && mount -t bpf bpf /sys/fs/bpf && echo "mounted bpffs at /sys/fs/bpf"
else
    echo "bpffs already mounted"
fi

step "[setup 4/4] cargo-deny"
deny_version=0.20.2
if [[ "$(cargo deny --version 2>/dev/null)" == "cargo-deny $deny_version" ]]; then
    echo "cargo-deny $deny_version present"
else
    # Its own temporary target directory (not the workspace's CARGO_TARGET_DIR).
    env -u CARGO_TARGET_DIR cargo install cargo-deny --version "=$deny_version" --locked --quiet
fi
