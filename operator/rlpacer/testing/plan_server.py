"""A played operator for played-host jobs (:mod:`rlpacer.testing.played_job`): the
step-report protocol's two routes over the real plan logic (the in-process controller), with
the rollout capacity of an operator that scales a StatefulSet from 1 to 2 replicas for each
long round.

``python -m rlpacer.testing.plan_server JOB_YAML ADDRESS PORT STATE_DIR [MODE]``. It talks to
the test through files in STATE_DIR. MODE ``elastic`` (default): it writes ``scale-up`` when a
report asks for a long round, next or forecast (``prepareLongRound``; the test then starts the
rollout-1 pod) and waits for
``rollout-1-ready`` (the test writes it) before the plan says Ready with ``usableReplicas``
[0, 1]; after the long round it writes ``scale-down`` (the test then deletes the pod). MODE
``single``: one replica throughout, long rounds included (the fixed small pool: the baseline
of ``bench-long-round``); it writes ``scale-down`` after a long round too. MODE ``restart``:
two replicas throughout; after step 0's report it writes ``paused`` and says ScalingUp (the
driver waits) until ``go`` exists (the test meanwhile replaces rollout-1's pod). MODE
``timeout-gap``: a long round asks for 3 replicas and writes ``scale-up`` (the test starts
only rollout-2's pod, rollout-1 stays pending, then writes ``rollout-2-ready``); the plan then
says TimedOut with 3 replicas desired and ``usableReplicas`` [0, 2], as the operator does when
a higher ordinal is ready and a lower one pending (scaling back to 2 would remove the ready
ordinal 2, since a StatefulSet removes its highest ordinal first).
``POST release`` (``releaseWhenFits``) during a long round writes ``scale-down`` then, as the
operator's scaler scales back at once. ``requests.log`` lists what it answered.
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rlpacer.api.protocol import (
    PLAN_FIELDS_HEADER,
    Plan,
    ReleaseRequest,
    RolloutCapacity,
    RolloutState,
    RoundKind,
    StepReport,
    plan_for_client,
)
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.controller_client import InProcessController


class Elastic:
    def __init__(self, cfg: RunConfig, state: Path, mode: str = "elastic") -> None:
        self.ctl = InProcessController(cfg.controller_config(), cfg.total_steps, replicas=1)
        self.state = state
        self.mode = mode
        self.plan = self.ctl.plan()
        self.long = False
        self.paused = False

    def capacity(self) -> RolloutCapacity:
        if self.mode == "restart":
            if self.paused and not (self.state / "go").exists():
                return RolloutCapacity(desired_replicas=2, ready_replicas=1,
                                       state=RolloutState.SCALING_UP, usable_replicas=[0])
            return RolloutCapacity(desired_replicas=2, ready_replicas=2,
                                   state=RolloutState.READY, usable_replicas=[0, 1])
        if not self.long or self.mode == "single":
            return RolloutCapacity(desired_replicas=1, ready_replicas=1,
                                   state=RolloutState.READY, usable_replicas=[0])
        if self.mode == "timeout-gap":
            if not (self.state / "rollout-2-ready").exists():
                return RolloutCapacity(desired_replicas=3, ready_replicas=1,
                                       state=RolloutState.SCALING_UP, usable_replicas=[0])
            # what the operator's scaler answers (scaler.timed_out_replicas): every ready
            # replica kept, so 3 stay desired; the pending 1 is not usable
            return RolloutCapacity(desired_replicas=3, ready_replicas=2,
                                   state=RolloutState.TIMED_OUT, usable_replicas=[0, 2])
        ready = (self.state / "rollout-1-ready").exists()
        return RolloutCapacity(
            desired_replicas=2, ready_replicas=2 if ready else 1,
            state=RolloutState.READY if ready else RolloutState.SCALING_UP,
            usable_replicas=[0, 1] if ready else [0])

    def current(self) -> Plan:
        return self.plan.model_copy(update={"rollout": self.capacity()})

    def report(self, r: StepReport) -> Plan:
        self.plan = self.ctl.report(r)
        if self.mode == "restart" and r.step == 0:
            self.paused = True
            (self.state / "paused").write_text("0")
        was = self.long
        # a long round next, or one forecast within its replica's join time (asked early:
        # the operator's scaler scales up for either)
        self.long = (r.next_round_kind is RoundKind.LONG
                     or (r.prepare_long_round and self.mode == "elastic"))
        if self.long and not was and self.mode in ("elastic", "timeout-gap"):
            (self.state / "scale-up").write_text(str(r.step))
        if was and not self.long:
            (self.state / "scale-down").write_text(str(r.step))
        return self.current()

    def release(self, step: int) -> Plan:
        """``POST release``: the long round's added replica given back before its report,
        as the operator's scaler does (``scale-down`` now, ``released`` in it)."""
        if self.long:
            self.long = False
            (self.state / "scale-down").write_text(f"{step} released")
        return self.current()


def main() -> None:
    job, address, port, state = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "elastic"
    elastic = Elastic(RunConfig.load(Path(job)), state, mode)
    log = open(state / "requests.log", "a", buffering=1)  # noqa: SIM115

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, plan: Plan) -> None:
            body = plan_for_client(plan, self.headers.get(PLAN_FIELDS_HEADER))
            log.write(json.dumps({"t": time.time(), "method": self.command,
                                  "rollout": body["rollout"]}) + "\n")
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(elastic.current())

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = json.loads(self.rfile.read(n))
            if self.path.endswith("/release"):
                req = ReleaseRequest.model_validate(raw)
                log.write(json.dumps({"t": time.time(), "release": req.step}) + "\n")
                return self._answer(elastic.release(req.step))
            report = StepReport.model_validate(raw)
            log.write(json.dumps({"t": time.time(), "report": report.step,
                                  "kind": report.round_kind.value}) + "\n")
            self._answer(elastic.report(report))

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer((address, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
