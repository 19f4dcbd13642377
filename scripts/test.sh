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
if [[ $# -gt 0 ]]; then
  echo "==> pytest"
  exec "$PYBIN/python" -m pytest "$@"
fi

# The whole suite, in two pytest processes side by side (each with its own control plane): the
# integration tier spends most of its time waiting on its control plane and the operator (the
# CPU ~75% idle while it runs alone on 2 cores), so it runs beside lint and the other tiers,
# and takes two e2e modules with it (test_trainer_vllm: one engine on one core, seeded, no
# timing asserted; test_dev_cluster: its own control plane and played hosts, mostly waiting)
# so that both end at about the same time. The side's output is printed
# when it ends (and can be followed live in the file named below).
SIDE=(tests/integration tests/e2e/test_trainer_vllm.py tests/e2e/test_dev_cluster.py)
suite0=$(date +%s)
SLOG="$(mktemp -t rlpacer-side-XXXXXX.log)"
echo "==> pytest ${SIDE[*]} (beside the rest; its log: $SLOG)"
env -u RLPACER_TIME_SETUP "$PYBIN/python" -m pytest "${SIDE[@]}" --durations=15 > "$SLOG" 2>&1 &
spid=$!
trap 'kill "$spid" 2>/dev/null || true' INT TERM
t0=$(date +%s)
lrc=0
echo "==> ruff";          "$PYBIN/ruff" check operator trainer_image tests || lrc=1
echo "==> mypy";          "$PYBIN/mypy" || lrc=1
echo "==> import-linter"; "$PYBIN/lint-imports" || lrc=1
rc=$lrc
export RLPACER_TIME_LINT=$(( $(date +%s) - t0 ))
echo "==> pytest (the rest)"
# --durations=30: the 30 slowest steps, for the budget
rrc=0
"$PYBIN/python" -m pytest "${SIDE[@]/#/--ignore=}" --durations=30 || rrc=$?
[[ $rrc -eq 0 ]] || rc=1
src=0
wait "$spid" || src=$?
echo "==> pytest ${SIDE[*]} (ran beside the rest)"
cat "$SLOG"
[[ $src -eq 0 ]] || rc=1
s=$(( $(date +%s) - suite0 ))
echo "==> the whole suite (lint and every tier): $((s / 60)) min $((s % 60)) s of wall clock;" \
     "lint $([[ $lrc -eq 0 ]] && echo passed || echo FAILED)," \
     "the side process $([[ $src -eq 0 ]] && echo passed || echo "FAILED (rc $src)")," \
     "the rest $([[ $rrc -eq 0 ]] && echo passed || echo "FAILED (rc $rrc)")"
exit "$rc"
