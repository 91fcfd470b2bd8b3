#!/usr/bin/env bash
# Build the real Kubernetes control-plane binaries the tests and the lab run against:
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet (k8s.io/kubernetes) and etcd
# (go.etcd.io/etcd/server/v3), at the versions pinned in tests/k8s/go.mod, fetched
# through the Go module proxy.
#
# Output: a cache OUTSIDE the checkout, keyed by the Kubernetes version:
#   ${JUNEAU_K8S_CACHE:-/var/cache/juneau/k8s}/<k8s-version>/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,etcd,helm}
# Idempotent: does nothing when every binary is already there (a `.complete` stamp is
# written last, so an interrupted build is redone). `--print-dir` prints the directory.
#
# Cost (2 vCPU, cold Go build cache): see docs/decisions.md ("A real control plane, built
# from the Go module proxy").
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

k8s_version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' go.mod)"
etcd_version="$(awk '$1 == "require" && $2 == "go.etcd.io/etcd/server/v3" {print $3}' go.mod)"
if [[ -z "$k8s_version" || -z "$etcd_version" ]]; then
    echo "build.sh: cannot read the k8s.io/kubernetes / etcd versions from $here/go.mod" >&2
    exit 1
fi
cache_root="${JUNEAU_K8S_CACHE:-/var/cache/juneau/k8s}"
out="$cache_root/$k8s_version"

if [[ "${1:-}" == "--print-dir" ]]; then
    echo "$out"
    exit 0
fi

# helm (the chart tests: lint, template) is built from its own Go module, not from this
# go.mod: `go install helm.sh/helm/v3/cmd/helm@<version>` through the same module proxy.
helm_version="v3.19.5"

# Each binary: output name, Go package, ldflags flavour. Built in this order; one that is
# already there (from an earlier, interrupted or older run) is kept.
binaries=(
    "etcd go.etcd.io/etcd/server/v3 plain"
    "kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver k8s"
    "kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager k8s"
    "kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler k8s"
    "kubelet k8s.io/kubernetes/cmd/kubelet k8s"
)
all_there() {
    local b
    for b in "${binaries[@]}"; do [[ -x "$out/${b%% *}" ]] || return 1; done
    [[ -x "$out/helm" ]]
}

if [[ -f "$out/.complete" ]] && all_there; then
    echo "k8s binaries $k8s_version (etcd $etcd_version) already built in $out"
    exit 0
fi

if ! command -v go >/dev/null; then
    echo "build.sh: 'go' is not on PATH (expected /usr/local/go/bin/go)" >&2
    exit 1
fi

mkdir -p "$out"
rm -f "$out/.complete"
start=$(date +%s)
echo "==> building Kubernetes $k8s_version (apiserver, controller-manager, scheduler, kubelet) + etcd $etcd_version into $out"
echo "    go: $(go version | awk '{print $3}'), GOPROXY=$(go env GOPROXY), GOFLAGS=$(go env GOFLAGS)"

major="${k8s_version#v}"; major="${major%%.*}"
minor="${k8s_version#v*.}"; minor="${minor%%.*}"
ver_pkg="k8s.io/component-base/version"
k8s_ldflags="-s -w -X $ver_pkg.gitVersion=$k8s_version -X $ver_pkg.gitMajor=$major -X $ver_pkg.gitMinor=$minor -X $ver_pkg.gitTreeState=clean -X $ver_pkg.buildDate=1970-01-01T00:00:00Z"

n=$(( ${#binaries[@]} + 1 ))
echo "==> [1/$n] downloading modules (go mod download)"
go mod download

i=1
for b in "${binaries[@]}"; do
    read -r name pkg flavour <<<"$b"
    i=$((i + 1))
    if [[ -x "$out/$name" ]]; then
        echo "==> [$i/$n] $name already built"
        continue
    fi
    echo "==> [$i/$n] $name (several minutes on 2 cores for the Kubernetes ones)"
    flags="-s -w"
    [[ "$flavour" == k8s ]] && flags="$k8s_ldflags"
    CGO_ENABLED=0 go build -trimpath -ldflags "$flags" -o "$out/$name.tmp" "$pkg"
    mv "$out/$name.tmp" "$out/$name"
    echo "    done after $(( $(date +%s) - start ))s"
done

if [[ -x "$out/helm" ]]; then
    echo "==> helm already built"
else
    echo "==> helm $helm_version (go install from its own module)"
    rm -rf "$out/.helm-bin"
    (cd / && GOBIN="$out/.helm-bin" CGO_ENABLED=0 go install -trimpath \
        -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version" \
        "helm.sh/helm/v3/cmd/helm@$helm_version")
    mv "$out/.helm-bin/helm" "$out/helm"
    rm -rf "$out/.helm-bin"
    echo "    done after $(( $(date +%s) - start ))s"
fi

"$out/kube-apiserver" --version
"$out/helm" version --short
"$out/etcd" --version | sed -n 1p   # not head: it closes the pipe early (SIGPIPE under pipefail)
date -u +%FT%TZ > "$out/.complete"
echo "==> built in $(( $(date +%s) - start ))s: $out"
