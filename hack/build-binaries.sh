#!/usr/bin/env bash
# Builds the local Kubernetes control plane's binaries at the versions pinned in hack/versions.env,
# from the Go module proxy, into a cache folder outside the repo:
#
#   ${RLPACER_CACHE:-~/.cache/rlpacer}/bin/{etcd,kube-apiserver,kube-controller-manager,
#                                           kube-scheduler,kwok,helm,promtool,prometheus,
#                                           kubelet,kube-proxy,coredns,kube-router,kueue}
#   ${RLPACER_CACHE:-~/.cache/rlpacer}/bin/kueue-manifests/{crds/,webhooks.yaml}
#                                    (Kueue's CRDs and webhook configurations, same module)
#
# kubelet, kube-proxy, coredns and kube-router run the real node (rlpacer.testing.node). The first two share
# the control plane's wrapper module and Go build cache; coredns is built from hack/coredns (only
# the plugins the node needs).
#
# Each binary carries a stamp (bin/.<name>.stamp: version, toolchain, recipe); a binary whose stamp
# matches is skipped, so a warm run costs seconds. Binaries are built one at a time (2-core
# machines). k8s.io/kubernetes and etcd's server module carry local `replace` directives, so they
# are built from small generated wrapper modules (in ${RLPACER_CACHE}/build).
#
# Usage: bash hack/build-binaries.sh [--check] [NAME...]
#   NAME     build only these (etcd kube-apiserver kube-controller-manager kube-scheduler kwok helm
#            promtool prometheus kubelet kube-proxy coredns kube-router kueue)
#   --check  build nothing; exit 1 and list what is missing or stale
# Env: RLPACER_CACHE (cache root), GO (go binary), RLPACER_BUILD_FORCE=1 (ignore stamps).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
CACHE="${RLPACER_CACHE:-$HOME/.cache/rlpacer}"
BIN="$CACHE/bin"
BUILD="$CACHE/build"
RECIPE_REV=2
# Bumped alone when only helm's recipe changes (2: Kubernetes version ldflags).
HELM_RECIPE_REV=2
# Bumped alone when only promtool's/prometheus' recipe changes.
PROMETHEUS_RECIPE_REV=1
mkdir -p "$BIN" "$BUILD"

GO="${GO:-$(command -v go || true)}"
[[ -n "$GO" ]] || GO=/usr/local/go/bin/go
if [[ ! -x "$GO" ]]; then
  echo "error: no Go toolchain found (looked on PATH and at /usr/local/go/bin/go); set GO=/path/to/go" >&2
  exit 1
fi
export CGO_ENABLED=0
export GOFLAGS=-mod=mod
# Keep the Go build cache small-ish and memory-friendly on small machines.
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"

ALL=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok helm promtool prometheus kubelet
     kube-proxy coredns kube-router kueue)
CHECK=0
WANT=()
for a in "$@"; do
  case "$a" in
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) WANT+=("$a") ;;
  esac
done
[[ ${#WANT[@]} -gt 0 ]] || WANT=("${ALL[@]}")

stamp_for() {
  case "$1" in
    etcd) echo "etcd $ETCD_VERSION toolchain=$ETCD_GOTOOLCHAIN rev=$RECIPE_REV" ;;
    kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy)
      echo "$1 $KUBERNETES_VERSION toolchain=$KUBERNETES_GOTOOLCHAIN rev=$RECIPE_REV" ;;
    kwok) echo "kwok $KWOK_VERSION toolchain=$KWOK_GOTOOLCHAIN rev=$RECIPE_REV" ;;
    helm) echo "helm $HELM_VERSION toolchain=$HELM_GOTOOLCHAIN rev=$RECIPE_REV.$HELM_RECIPE_REV" ;;
    promtool|prometheus)
      echo "$1 $PROMETHEUS_VERSION toolchain=$PROMETHEUS_GOTOOLCHAIN rev=$RECIPE_REV.$PROMETHEUS_RECIPE_REV" ;;
    coredns) echo "coredns $COREDNS_VERSION toolchain=$COREDNS_GOTOOLCHAIN rev=$RECIPE_REV.$(sha256sum "$ROOT/hack/coredns/main.go" | cut -c1-12)" ;;
    kube-router) echo "kube-router $KUBE_ROUTER_VERSION toolchain=$KUBE_ROUTER_GOTOOLCHAIN rev=$RECIPE_REV" ;;
    kueue) echo "kueue $KUEUE_VERSION toolchain=$KUEUE_GOTOOLCHAIN rev=$RECIPE_REV" ;;
    *) echo "error: unknown binary '$1' (known: ${ALL[*]})" >&2; return 1 ;;
  esac
}

up_to_date() {
  local name=$1 want
  want=$(stamp_for "$name")
  [[ "${RLPACER_BUILD_FORCE:-0}" != 1 && -x "$BIN/$name" && -f "$BIN/.$name.stamp" \
     && "$(cat "$BIN/.$name.stamp")" == "$want" ]] || return 1
  [[ "$name" != kueue ]] || { compgen -G "$BIN/kueue-manifests/crds/*.yaml" > /dev/null \
                               && [[ -f "$BIN/kueue-manifests/webhooks.yaml" ]]; }
}

if [[ $CHECK == 1 ]]; then
  missing=()
  for n in "${WANT[@]}"; do up_to_date "$n" || missing+=("$n"); done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "missing or stale in $BIN: ${missing[*]} (run: bash scripts/setup.sh, or bash hack/build-binaries.sh)" >&2
    exit 1
  fi
  echo "all present in $BIN: ${WANT[*]}"
  exit 0
fi

# One build at a time per cache (setup.sh may run from several shells).
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then
  echo "==> another build holds $CACHE/.build.lock; waiting for it"
  flock 9
fi

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }

# gotc TOOLCHAIN go-args...: run go with the chosen toolchain.
gotc() { local tc=$1; shift; GOTOOLCHAIN="$tc" "$GO" "$@"; }

# Writes a wrapper module in $1 requiring k8s.io/kubernetes with staging modules replaced.
k8s_wrapper() {
  local dir=$1 v=$KUBERNETES_VERSION tc=$KUBERNETES_GOTOOLCHAIN
  local staging_v="v0.${v#v1.}"
  [[ -f "$dir/.ready" && "$(cat "$dir/.ready")" == "$v rev=$RECIPE_REV" ]] && return 0
  rm -rf "$dir"; mkdir -p "$dir"
  local modfile
  modfile=$(cd "$dir" && gotc "$tc" mod download -json "k8s.io/kubernetes@$v" | jq -r .GoMod)
  [[ -f "$modfile" ]] || { echo "error: could not download k8s.io/kubernetes@$v's go.mod" >&2; return 1; }
  local staging
  staging=$(grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging/src/k8s\.io/[a-z0-9-]+' "$modfile" \
            | awk '{print $1}' | sort -u)
  [[ -n "$staging" ]] || { echo "error: no staging replaces found in $modfile" >&2; return 1; }
  {
    echo "module rlpacer.local/build/kubernetes"
    echo
    echo "go $(grep -E '^go ' "$modfile" | awk '{print $2}')"
    echo
    echo "require k8s.io/kubernetes $v"
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m $staging_v"; done
    echo ")"
  } > "$dir/go.mod"
  cat > "$dir/tools.go" <<'EOF'
//go:build tools

// Package tools pins the commands this wrapper module builds.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
EOF
  log "resolving k8s.io/kubernetes $v module graph (staging modules -> $staging_v)"
  (cd "$dir" && gotc "$tc" mod tidy)
  echo "$v rev=$RECIPE_REV" > "$dir/.ready"
}

# Helm's Makefile stamps the Kubernetes version that `helm template`/`lint` assume when no
# cluster is asked (.Capabilities.KubeVersion); without it they assume v1.20. We stamp the
# version the local control plane serves, so offline rendering matches `helm install`.
helm_ldflags() {
  local major minor h=helm.sh/helm/v3
  major=$(echo "${KUBERNETES_VERSION#v}" | cut -d. -f1); minor=$(echo "${KUBERNETES_VERSION#v}" | cut -d. -f2)
  echo "-s -w -X $h/internal/version.version=$HELM_VERSION -X $h/internal/version.gitTreeState=clean" \
       "-X $h/pkg/lint/rules.k8sVersionMajor=$major -X $h/pkg/lint/rules.k8sVersionMinor=$minor" \
       "-X $h/pkg/chartutil.k8sVersionMajor=$major -X $h/pkg/chartutil.k8sVersionMinor=$minor"
}

# Prometheus' release version (3.MM.P) from its module version (v0.3MM.P), stamped like promu does.
prometheus_ldflags() {
  local v=${PROMETHEUS_VERSION#v0.} c=github.com/prometheus/common/version
  local minor=${v%%.*} patch=${v#*.}
  echo "-s -w -X $c.Version=$((minor / 100)).$((minor % 100)).$patch -X $c.Branch=HEAD" \
       "-X $c.BuildUser=rlpacer@build-binaries -X $c.Revision=$PROMETHEUS_VERSION"
}

k8s_ldflags() {
  local v=$KUBERNETES_VERSION major minor commit="" date="" info
  major=$(echo "${v#v}" | cut -d. -f1); minor=$(echo "${v#v}" | cut -d. -f2)
  # The proxy's .info file holds the release's commit time and (for recent modules) its hash.
  info=$(gotc "$KUBERNETES_GOTOOLCHAIN" mod download -json "k8s.io/kubernetes@$v" 2>/dev/null \
         | jq -r '.Info // empty' 2>/dev/null || true)
  if [[ -n "$info" && -f "$info" ]]; then
    commit=$(jq -r '.Origin.Hash // empty' "$info" 2>/dev/null || true)
    date=$(jq -r '.Time // empty' "$info" 2>/dev/null | sed -E 's/\.[0-9]+//' || true)
  fi
  [[ -n "$date" ]] || date=1970-01-01T00:00:00Z
  local f="-s -w"
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    f+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    f+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
    [[ -n "$commit" ]] && f+=" -X $pkg.gitCommit=$commit"
  done
  echo "$f"
}

build_k8s() {
  local name=$1 dir="$BUILD/kubernetes"
  k8s_wrapper "$dir"
  (cd "$dir" && gotc "$KUBERNETES_GOTOOLCHAIN" build -trimpath -ldflags "$(k8s_ldflags)" \
      -o "$BIN/$name.tmp" "k8s.io/kubernetes/cmd/$name")
}

build_etcd() {
  local dir="$BUILD/etcd" v=$ETCD_VERSION tc=$ETCD_GOTOOLCHAIN
  if [[ ! -f "$dir/.ready" || "$(cat "$dir/.ready")" != "$v rev=$RECIPE_REV" ]]; then
    rm -rf "$dir"; mkdir -p "$dir"
    local modfile
    modfile=$(cd "$dir" && gotc "$tc" mod download -json "go.etcd.io/etcd/server/v3@$v" | jq -r .GoMod)
    cat > "$dir/go.mod" <<EOF
module rlpacer.local/build/etcd

go $(grep -E '^go ' "$modfile" | awk '{print $2}')

require go.etcd.io/etcd/server/v3 $v
EOF
    cat > "$dir/main.go" <<'EOF'
// Command etcd is etcd's server, built from go.etcd.io/etcd/server/v3 at the pinned version
// (the upstream module's local replace directives rule out `go install`).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
    log "resolving go.etcd.io/etcd/server/v3 $v module graph"
    (cd "$dir" && gotc "$tc" mod tidy)
    echo "$v rev=$RECIPE_REV" > "$dir/.ready"
  fi
  (cd "$dir" && gotc "$tc" build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" .)
}

# CoreDNS with only the plugins hack/coredns/main.go links, from a wrapper module.
build_coredns() {
  local dir="$BUILD/coredns" v=$COREDNS_VERSION tc=$COREDNS_GOTOOLCHAIN
  local want
  want="$v rev=$RECIPE_REV $(sha256sum "$ROOT/hack/coredns/main.go" | cut -c1-12)"
  if [[ ! -f "$dir/.ready" || "$(cat "$dir/.ready")" != "$want" ]]; then
    rm -rf "$dir"; mkdir -p "$dir"
    local modfile
    modfile=$(cd "$dir" && gotc "$tc" mod download -json "github.com/coredns/coredns@$v" | jq -r .GoMod)
    printf 'module rlpacer.local/build/coredns\n\ngo %s\n\nrequire github.com/coredns/coredns %s\n' \
      "$(grep -E '^go ' "$modfile" | awk '{print $2}')" "$v" > "$dir/go.mod"
    cp "$ROOT/hack/coredns/main.go" "$dir/main.go"
    log "resolving github.com/coredns/coredns $v module graph"
    (cd "$dir" && gotc "$tc" mod tidy)
    echo "$want" > "$dir/.ready"
  fi
  (cd "$dir" && gotc "$tc" build -trimpath \
      -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$v" -o "$BIN/coredns.tmp" .)
}

# go install-able modules (no replace directives): build in a scratch GOBIN, then move.
build_install() {
  local name=$1 pkg=$2 v=$3 tc=$4 ldflags=$5 tags=${6:-} gobin="$BUILD/gobin-$1"
  rm -rf "$gobin"; mkdir -p "$gobin"
  (cd "$BUILD" && GOFLAGS= GOBIN="$gobin" gotc "$tc" install -trimpath -tags "$tags" \
      -ldflags "$ldflags" "$pkg@$v")
  mv "$gobin/$name" "$BIN/$name.tmp"
  rm -rf "$gobin"
}

# Kueue's controller manager (no replace directives: go install) and, from the same module
# version, its CRDs and webhook configurations into bin/kueue-manifests (rlpacer.testing.kueue
# installs them).
build_kueue() {
  local dir
  build_install kueue sigs.k8s.io/kueue/cmd/kueue "$KUEUE_VERSION" "$KUEUE_GOTOOLCHAIN" \
    "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  dir=$(cd "$BUILD" && GOFLAGS= gotc "$KUEUE_GOTOOLCHAIN" mod download -json \
        "sigs.k8s.io/kueue@$KUEUE_VERSION" | jq -r .Dir)
  [[ -d "$dir/config/components/crd/bases" ]] || { echo "error: no CRDs in $dir" >&2; return 1; }
  rm -rf "$BIN/kueue-manifests"; mkdir -p "$BIN/kueue-manifests/crds"
  cp "$dir"/config/components/crd/bases/*.yaml "$BIN/kueue-manifests/crds/"
  cp "$dir"/config/components/webhook/manifests.yaml "$BIN/kueue-manifests/webhooks.yaml"
  chmod -R u+w "$BIN/kueue-manifests"
}

total_start=$(date +%s)
built=()
for name in "${WANT[@]}"; do
  stamp=$(stamp_for "$name")
  if up_to_date "$name"; then
    log "$name: up to date ($stamp)"
    continue
  fi
  log "$name: building ($stamp)"
  t0=$(date +%s)
  rm -f "$BIN/$name.tmp"
  case "$name" in
    etcd) build_etcd ;;
    kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy) build_k8s "$name" ;;
    coredns) build_coredns ;;
    kwok) build_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" "$KWOK_GOTOOLCHAIN" \
            "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$KUBERNETES_VERSION" ;;
    helm) build_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$HELM_GOTOOLCHAIN" \
            "$(helm_ldflags)" ;;
    promtool|prometheus)
      build_install "$name" "github.com/prometheus/prometheus/cmd/$name" "$PROMETHEUS_VERSION" \
        "$PROMETHEUS_GOTOOLCHAIN" "$(prometheus_ldflags)" netgo,remove_all_sd ;;
    kube-router) build_install kube-router github.com/cloudnativelabs/kube-router/v2/cmd/kube-router \
            "$KUBE_ROUTER_VERSION" "$KUBE_ROUTER_GOTOOLCHAIN" \
            "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" ;;
    kueue) build_kueue ;;
  esac
  mv -f "$BIN/$name.tmp" "$BIN/$name"
  echo "$stamp" > "$BIN/.$name.stamp"
  built+=("$name")
  log "$name: built in $(( $(date +%s) - t0 )) s -> $BIN/$name ($(du -h "$BIN/$name" | cut -f1))"
done
log "done in $(( $(date +%s) - total_start )) s; built: ${built[*]:-nothing}; binaries in $BIN"
