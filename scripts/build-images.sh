#!/usr/bin/env bash
# Builds the operator image and the CPU trainer image on this machine, with no image registry:
#
#   bash scripts/build-images.sh          both images (cold: ~10 minutes on 2 cores; warm: seconds)
#   bash scripts/build-images.sh --check  exit 0 when both are built from the current inputs
#
#   1. a Debian bookworm root file system from `debootstrap` (Debian's packages, from this
#      machine's apt mirror), imported as localhost/rlpacer/debian:bookworm (built once);
#   2. images/constraints.txt: every package of the shared test environment with its version
#      (`pip freeze`), so the images hold what the tests run with;
#   3. operator/Dockerfile        -> ghcr.io/rlpacer/operator:0.1.0 (the chart's default image)
#      trainer_image/Dockerfile   -> ghcr.io/rlpacer/trainer:0.1.0 (the spec's default image),
#      FLAVOUR=cpu                   also tagged ghcr.io/rlpacer/trainer:0.1.0-cpu
#      built with podman; each carries a label with the hash of its inputs (Dockerfile, sources,
#      constraints, base image), and an image whose label matches is not rebuilt;
#   4. hack/pause -> localhost/rlpacer/pause:3.10, the real node's pod sandbox image (no registry
#      is reachable to pull one; rlpacer.testing.node), labelled likewise.
#
# Env: RLPACER_CACHE (cache root), RLPACER_SHARED (folder holding wheels/), DEBIAN_MIRROR (the
#      mirror debootstrap uses; default: this machine's apt source), RLPACER_IMAGE_VERSION,
#      PIP_CERT (a CA bundle pip must trust, e.g. a proxy's: mounted into the builds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${RLPACER_CACHE:-$HOME/.cache/rlpacer}"
SHARED="${RLPACER_SHARED:-$ROOT/../shared}"
VERSION="${RLPACER_IMAGE_VERSION:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/rlpacer/Chart.yaml)}"
BASE=localhost/rlpacer/debian:bookworm
OPERATOR_IMAGE="ghcr.io/rlpacer/operator:$VERSION"
TRAINER_IMAGE="ghcr.io/rlpacer/trainer:$VERSION"
LABEL=io.rlpacer.inputs
# podman's default rlimits ask for more than many machines' hard limits allow.
ULIMITS=(--ulimit nofile=1024:4096 --ulimit nproc=4096:4096)
# crun refuses cgroup v1/hybrid hosts ("cgroups in hybrid mode not supported"): runc there.
PODMAN=(podman)
if [[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ]] && command -v runc >/dev/null 2>&1; then
  PODMAN=(podman --runtime runc)
fi

CHECK=0
for a in "$@"; do
  case "$a" in
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$a' (use --check, or nothing)" >&2; exit 2 ;;
  esac
done
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
step_t0=0
step() { step_t0=$(date +%s); printf '\n==> %s\n' "$*"; }
done_step() { printf '    done in %s s\n' "$(( $(date +%s) - step_t0 ))"; }
T0=$(date +%s)

command -v podman >/dev/null 2>&1 \
  || die "podman not found: apt-get install -y podman buildah debootstrap runc fuse-overlayfs uidmap (or run set-up with --no-images)"
[[ -f .venv/.shared-env ]] || die "run bash scripts/setup.sh --python first (the images pin the test environment's versions)"
VENV=$(cat .venv/.shared-env)
[[ -x "$VENV/bin/pip" ]] || die "$VENV (the shared test environment) is missing: run bash scripts/setup.sh --python"

image_label() { "${PODMAN[@]}" image inspect --format "{{ index .Labels \"$LABEL\" }}" "$1" 2>/dev/null || true; }
image_id() { "${PODMAN[@]}" image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# --- 1. the Debian base ---------------------------------------------------------------------
mirror() {
  [[ -n "${DEBIAN_MIRROR:-}" ]] && { echo "$DEBIAN_MIRROR"; return; }
  local m
  m=$(grep -hsE '^URIs:|^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
        /etc/apt/sources.list.d/*.list | grep -E '/debian/?( |$)' | grep -v security | head -n 1 \
        | sed -E 's/^URIs: *//; s/^deb (\[[^]]*\] )?//; s/ .*//')
  echo "${m:-http://deb.debian.org/debian}"
}
if [[ -z "$(image_id "$BASE")" ]]; then
  (( CHECK )) && exit 1
  command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found: apt-get install -y debootstrap"
  MIRROR=$(mirror)
  step "Debian bookworm base from $MIRROR -> $BASE (cold: ~1 minute)"
  rootfs="$CACHE/images/rootfs.tmp"
  rm -rf "$rootfs"; mkdir -p "$CACHE/images"
  debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$CACHE/images/debootstrap.log" 2>&1 \
    || { tail -n 20 "$CACHE/images/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/images/debootstrap.log): check access to $MIRROR"; }
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$MIRROR" "$MIRROR" > "$rootfs/etc/apt/sources.list"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -c . \
    | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
  done_step
fi
BASE_ID=$(image_id "$BASE")

# --- 2. the pinned dependency list ----------------------------------------------------------
mkdir -p images
"$VENV/bin/pip" freeze --exclude-editable --disable-pip-version-check 2>/dev/null \
  | grep -viE '^(rlpacer|-e )' > images/constraints.txt.new
mv -f images/constraints.txt.new images/constraints.txt

# --- 3. the images ----------------------------------------------------------------------------
inputs_hash() {  # DOCKERFILE ARGS...: the hash of everything the build reads
  local dockerfile=$1; shift
  {
    printf '%s\n' "$BASE_ID" "$@"
    cat "$dockerfile" images/constraints.txt images/requirements-trainer.txt .dockerignore pyproject.toml
    find operator/rlpacer trainer_image/rlpacer_trainer -type f \
         ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
}
build() {  # NAME DOCKERFILE TAG [EXTRA TAGS AND BUILD ARGS...]
  local name=$1 dockerfile=$2 tag=$3; shift 3
  local extra=("$@") args=() h
  for a in "${extra[@]}"; do [[ $a == --build-arg=* ]] && args+=("${a#--build-arg=}"); done
  h=$(inputs_hash "$dockerfile" "${args[@]}")
  if [[ "$(image_label "$tag")" == "$h" ]]; then
    printf '\n==> %s: %s is up to date (inputs %s)\n' "$name" "$tag" "$h"
    return 0
  fi
  (( CHECK )) && { echo "$tag is missing or out of date" >&2; exit 1; }
  step "$name: $tag (inputs $h)"
  local mounts=()
  [[ -d "$SHARED/wheels" ]] && mounts+=(--volume "$SHARED/wheels:/opt/wheels:ro")
  # A TLS-inspecting proxy's CA that this machine's pip trusts (PIP_CERT): pip in the build
  # trusts it too (mounted for the build only, never in a layer).
  if [[ -n "${PIP_CERT:-}" && -f "$PIP_CERT" ]]; then
    mounts+=(--volume "$PIP_CERT:/run/rlpacer-build/ca.crt:ro" --build-arg PIP_CERT=/run/rlpacer-build/ca.crt)
  fi
  "${PODMAN[@]}" build --layers --network host "${ULIMITS[@]}" "${mounts[@]}" \
      --file "$dockerfile" --build-arg "BASE_IMAGE=$BASE" "${extra[@]}" \
      --label "$LABEL=$h" --tag "$tag" . \
    || die "building $tag failed (see above): it needs the Debian mirror and the Python package index"
  done_step
}
build operator operator/Dockerfile "$OPERATOR_IMAGE"
build "trainer (cpu)" trainer_image/Dockerfile "$TRAINER_IMAGE" \
  --build-arg=FLAVOUR=cpu --build-arg=TORCH_INDEX_URL= --tag "$TRAINER_IMAGE-cpu"
# --- 4. the real node's pod sandbox ("pause") image (rlpacer.testing.node; no registry) -----
PAUSE_IMAGE=localhost/rlpacer/pause:3.10
pause_hash=$(cat hack/pause/main.go hack/pause/go.mod hack/pause/Dockerfile | sha256sum | cut -c1-16)
if [[ "$(image_label "$PAUSE_IMAGE")" == "$pause_hash" ]]; then
  printf '\n==> pause: %s is up to date (inputs %s)\n' "$PAUSE_IMAGE" "$pause_hash"
else
  (( CHECK )) && { echo "$PAUSE_IMAGE is missing or out of date" >&2; exit 1; }
  step "pause: $PAUSE_IMAGE (inputs $pause_hash)"
  GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
  [[ -x "$GO" ]] || die "Go is needed to build the pause image (hack/pause): install Go, or set GO=/path/to/go"
  ctx=$(mktemp -d)
  (cd hack/pause && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS= "$GO" build -trimpath -ldflags "-s -w" -o "$ctx/pause" .) \
    || die "building hack/pause failed (see above)"
  "${PODMAN[@]}" build --file hack/pause/Dockerfile --label "$LABEL=$pause_hash" --tag "$PAUSE_IMAGE" "$ctx" \
    || die "building $PAUSE_IMAGE failed (see above)"
  rm -rf "$ctx"
  done_step
fi
(( CHECK )) && exit 0
# Images left untagged by earlier builds (a few GB each for the trainer); the layers of the
# current ones stay, so the next build reuses them.
"${PODMAN[@]}" image prune -f >/dev/null 2>&1 || true
printf '\n==> images built in %s s\n' "$(( $(date +%s) - T0 ))"
"${PODMAN[@]}" images --format '    {{.Repository}}:{{.Tag}}  {{.Size}}' \
  | grep -E "rlpacer/(operator|trainer):$VERSION" || true
