#!/usr/bin/env bash
# Sets up everything the tests need (scripts/setup.sh: cached, seconds when warm), then runs
# every check and every test tier this machine can run:
#   bash scripts/test.sh                 ruff, mypy, import-linter, then pytest over every tier
#   bash scripts/test.sh -m unit         one tier (or integration, e2e), no lint; any pytest args
# RLPACER_NO_SETUP=1 skips the set-up step (for repeated runs in one shell).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The wall clock of set-up and lint goes to pytest, which prints it with each tier's before its
# closing line (tests/conftest.py), so every CI log shows where the budget went.
t0=$(date +%s)
if [[ "${RLPACER_NO_SETUP:-0}" != 1 ]]; then
  bash scripts/setup.sh
  export RLPACER_TIME_SETUP=$(( $(date +%s) - t0 ))
fi
PYBIN="$ROOT/.venv/bin"
[[ -x "$PYBIN/python" ]] || { echo "error: $ROOT/.venv missing: run bash scripts/setup.sh" >&2; exit 1; }
ARGS=("$@")
if [[ $# -eq 0 ]]; then
  t0=$(date +%s)
  echo "==> ruff";          "$PYBIN/ruff" check operator trainer_image tests
  echo "==> mypy";          "$PYBIN/mypy"
  echo "==> import-linter"; "$PYBIN/lint-imports"
  export RLPACER_TIME_LINT=$(( $(date +%s) - t0 ))
  ARGS=(--durations=30)  # the whole suite: its 30 slowest steps, for the budget
fi
echo "==> pytest"
exec "$PYBIN/python" -m pytest "${ARGS[@]}"
