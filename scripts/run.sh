#!/usr/bin/env bash
# Runs the main job on its embedded default: the tiny local RL job (examples/tiny-local.yaml)
# with SAGC and tail batching, on the CPU, with a progress bar and a report in runs/tiny-local/;
# then the same steps again at a fixed G=16 without tail batching (`--baseline 16`), and the
# report compares training wall clock and held-out accuracy. Sets up only what that needs first
# (the Python environment; cached, seconds when warm).
#
#   bash scripts/run.sh                                   # examples/tiny-local.yaml --baseline 16
#   bash scripts/run.sh my-job.yaml --steps 5             # another manifest; `rlpacer run` flags
#   bash scripts/run.sh --fixed-group-size 16 --no-tail-batching   # the default, other flags
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh --python
MANIFEST=examples/tiny-local.yaml
if [[ $# -gt 0 && "$1" != -* ]]; then MANIFEST=$1; shift; fi
if [[ $# -eq 0 ]]; then set -- --baseline 16; fi  # the default run shows its time against G=16
printf '\n==> rlpacer run %s %s (the tiny job and its baseline: ~4 minutes on 2 cores)\n' \
  "$MANIFEST" "$*"
exec "$ROOT/.venv/bin/rlpacer" run "$MANIFEST" "$@"
