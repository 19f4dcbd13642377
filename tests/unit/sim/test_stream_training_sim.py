"""Stream training in the simulator: a step's streamable training (STREAMABLE of its
per-token work) is done group by group as the groups complete, so only what is still queued
at the round's end, the rest of the work and the fixed cost follow the rollout."""

from __future__ import annotations

import dataclasses

import pytest

from rlpacer.sim.bench import STREAMABLE, policies, run_policy, stream_train_s
from rlpacer.sim.rollout import RoundOutcome
from rlpacer.sim.workload import Workload, scenario

pytestmark = pytest.mark.unit

SCN = scenario("default")


def _oc(rollout_s: float, groups: list[tuple[float, int, int]]) -> RoundOutcome:
    kept = [resp // count for _, resp, count in groups for _ in range(count)]
    # lengths whose sums match each group's (every response the group's mean, here exact)
    return RoundOutcome(rollout_s, 1.0, kept, 0, 0, group_done=tuple(groups))


def _plain(oc: RoundOutcome) -> float:
    toks = sum(oc.kept_lengths) + SCN.prompt_len * len(oc.kept_lengths)
    return SCN.train_fixed_s + SCN.train_s_per_ktok * toks / 1000.0


def test_groups_done_early_leave_only_the_unstreamable_work() -> None:
    oc = _oc(10_000.0, [(1.0, 8000, 8), (2.0, 4000, 8)])
    toks = 12000 + SCN.prompt_len * 16
    want = SCN.train_fixed_s + (1 - STREAMABLE) * SCN.train_s_per_ktok * toks / 1000.0
    assert stream_train_s(SCN, oc) == pytest.approx(want)
    assert stream_train_s(SCN, oc) < _plain(oc)


def test_groups_done_at_the_rounds_end_save_nothing() -> None:
    oc = _oc(50.0, [(50.0, 8000, 8), (50.0, 4000, 8)])
    assert stream_train_s(SCN, oc) == pytest.approx(_plain(oc))


def test_the_learner_takes_one_group_at_a_time() -> None:
    """Two groups done at once, 1 s before the end: the learner works through them one after
    the other, so what it has not reached by the end follows the rollout."""
    per_group = STREAMABLE * SCN.train_s_per_ktok * (80000 + SCN.prompt_len * 8) / 1000.0
    oc = _oc(100.0, [(99.0, 80000, 8), (99.0, 80000, 8)])
    left = 2 * per_group - 1.0
    assert left > 0
    unstreamable = (1 - STREAMABLE) * SCN.train_s_per_ktok * 2 * (
        80000 + SCN.prompt_len * 8) / 1000.0
    assert stream_train_s(SCN, oc) == pytest.approx(SCN.train_fixed_s + unstreamable + left)


def test_a_run_with_stream_training_is_shorter_on_the_same_schedule() -> None:
    scn = dataclasses.replace(SCN.with_steps(40))
    pols = {p.name: p for p in policies()}
    for name in ("fixed16", "sagc_tail"):
        run = run_policy(scn, pols[name], 0, Workload(scn, scn.steps * scn.prompts_per_step, 0))
        assert len(run.train_s) == len(run.train_s_stream) == len(run.step_s)
        floor = [scn.train_fixed_s + (1 - STREAMABLE) * (t - scn.train_fixed_s)
                 for t in run.train_s]
        for t, ts, lo in zip(run.train_s, run.train_s_stream, floor, strict=True):
            assert lo - 1e-9 <= ts <= t + 1e-9
        st = run.stream_summary()
        assert 0.0 < st["train_cut"] < STREAMABLE
        assert st["wall_clock_s"] == pytest.approx(
            sum(run.step_s) - (sum(run.train_s) - sum(run.train_s_stream)))
        assert st["wall_ratio"] < 1.0
