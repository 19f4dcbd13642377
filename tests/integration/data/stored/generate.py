"""Write ``jobs-<commit>.json``: RLTrainingJobs (spec and status) as the operator of an older
commit wrote them, for tests/integration/test_stored_objects_apiserver.py.

The status comes from that commit's own pure code (admission, step reports, suspend,
completion), so it is byte for byte what its operator stored, controllerState included:

    git archive <commit> operator | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/operator .venv/bin/python tests/integration/data/stored/generate.py \\
        <commit> > tests/integration/data/stored/jobs-<commit>.json

(The CRD of that commit sits beside it: ``git show <commit>:crds/rlpacer.io_rltrainingjobs.yaml``.)
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import StepReport
from rlpacer.api.status import RLTrainingJobStatus
from rlpacer.operator.decide import Observed, decide
from rlpacer.operator.reports import accept_report

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def spec(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"source": "builtin://tiny-adder"},
        "data": {"source": "builtin://adder"},
        "steps": 1000,
        "promptsPerStep": 8,
        "rollout": {"replicas": 1, "gpusPerReplica": 0, "maxResponseTokens": 1024},
        "trainer": {"replicas": 1, "gpusPerReplica": 0},
        "groupControl": {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 3},
        "tailBatching": {"longRound": {"rolloutReplicas": 2, "scaleUpTimeoutSeconds": 600}},
        "backoffLimit": 1,
    }
    base.update(kw)
    return base


def report(step: int, g: int, mx: float, nxt: str = "Short") -> StepReport:
    return StepReport.model_validate({
        "attempt": 0, "step": step, "groupSize": g, "roundKind": "Short",
        "lengths": {"max": mx, "median": 100.0, "p90": min(mx, 150.0), "count": 8 * g},
        "seconds": {"rollout": 30.0, "train": 10.0}, "longQueue": 0, "nextRoundKind": nxt})


def job(name: str, raw: dict[str, Any], steps: int, then: str = "") -> dict[str, Any]:
    sp = parse_spec(raw)
    st = decide(sp, RLTrainingJobStatus(), Observed(rollout_ready=1), T0, 1).status
    st = decide(sp, st, Observed(driver_phase="Running", rollout_ready=1), T0, 1).status
    for i in range(steps):
        g = st.group_size or 8
        now = T0 + timedelta(seconds=40 * (i + 1))
        st, _ = accept_report(sp, st, report(i, g, 800.0 if i % 3 == 0 else 150.0), now, 1)
    if then == "suspend":
        raw = {**raw, "suspend": True}
        st = decide(parse_spec(raw), st, Observed(rollout_ready=1), T0 + timedelta(hours=1),
                    1).status  # stored as created (generation 1), suspended from the start
    elif then == "succeed":
        st = decide(sp, st, Observed(driver_phase="Succeeded", rollout_ready=1),
                    T0 + timedelta(hours=1), 1).status
    return {"name": name, "spec": raw, "status": st.to_wire()}


def main() -> None:
    out = {
        "commit": sys.argv[1],
        "jobs": [
            job("running", spec(), 12),
            job("suspended", spec(), 4, then="suspend"),
            job("done", spec(steps=5), 5, then="succeed"),
        ],
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
