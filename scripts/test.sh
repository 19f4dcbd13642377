#!/usr/bin/env bash
# Runs every check and every test tier this machine can run. Select one tier with
#   bash scripts/test.sh -m unit        (or integration, e2e)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYBIN="$ROOT/.venv/bin"
[[ -x "$PYBIN/python" ]] || { echo "error: .venv missing: run bash scripts/setup.sh first" >&2; exit 1; }
if [[ $# -eq 0 ]]; then
  echo "==> ruff";         "$PYBIN/ruff" check operator trainer_image tests
  echo "==> mypy";         "$PYBIN/mypy"
  echo "==> import-linter"; "$PYBIN/lint-imports"
fi
echo "==> pytest"
exec "$PYBIN/python" -m pytest "$@"
