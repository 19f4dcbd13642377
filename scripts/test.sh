#!/usr/bin/env bash
# Sets up everything the tests need (scripts/setup.sh: cached, seconds when warm), then runs
# every check and every test tier this machine can run:
#   bash scripts/test.sh                 ruff, mypy, import-linter, then pytest over every tier
#   bash scripts/test.sh -m unit         one tier (or integration, e2e), no lint; any pytest args
# RLPACER_NO_SETUP=1 skips the set-up step (for repeated runs in one shell).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ "${RLPACER_NO_SETUP:-0}" != 1 ]]; then
  bash scripts/setup.sh
fi
PYBIN="$ROOT/.venv/bin"
[[ -x "$PYBIN/python" ]] || { echo "error: $ROOT/.venv missing: run bash scripts/setup.sh" >&2; exit 1; }
if [[ $# -eq 0 ]]; then
  echo "==> ruff";          "$PYBIN/ruff" check operator trainer_image tests
  echo "==> mypy";          "$PYBIN/mypy"
  echo "==> import-linter"; "$PYBIN/lint-imports"
fi
echo "==> pytest (every tier: ~47-75 minutes on 2 cores)"
exec "$PYBIN/python" -m pytest "$@"
