"""SAGC's objective per second (``SAGCConfig.objective="second"``): log2(G) per second of a
step's measured wall clock, under the same straggler SLO."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import pytest
from tests.unit.control.test_plan import report

from rlpacer.control.errors import ConfigError, ObservationError
from rlpacer.control.plan import JobController, JobControllerConfig, StepSecondsData
from rlpacer.control.sagc import SAGCConfig, SAGCController

pytestmark = pytest.mark.unit


def run(objective: str, seconds: Callable[[int], float], steps: int = 30,
        straggles: Callable[[int], bool] = lambda g: False, **kw: float) -> list[int]:
    """The sizes SAGC picks over ``steps`` steps whose seconds and stragglers depend on G."""
    ctl = SAGCController(SAGCConfig(objective=objective, tau=4.0, **kw))  # type: ignore[arg-type]
    out = []
    for _ in range(steps):
        g = ctl.decide()
        out.append(g)
        ctl.observe(g, 500.0 if straggles(g) else 200.0, 100.0, seconds=seconds(g))
    return out


@pytest.mark.parametrize(("per_response", "best"), [(1.0, 4), (0.1, 8), (0.01, 16)])
def test_per_second_settles_on_the_size_whose_log2_g_costs_least(
        per_response: float, best: int) -> None:
    """Steps cost 1 + k * G seconds. Per second SAGC ends on argmax log2(G) / (1 + k G):
    G=4 when the per-response part dominates, 16 when the fixed part does, 8 between (it
    must try the others to know); per step it keeps 16 whatever a step costs."""
    def cost(g: int) -> float:
        return 1.0 + per_response * g

    want = max((4, 8, 16), key=lambda g: math.log2(g) / cost(g))
    assert want == best
    picked = run("second", cost)
    assert picked[0] == 8  # step 0 runs `initial`
    assert picked[-10:] == [best] * 10
    assert run("step", cost)[-10:] == [16] * 10


def test_per_second_still_keeps_the_slo() -> None:
    """Where G=16 is the cheapest per unit of log2(G) but straggles every step, the
    multiplier prices it out as it does per step."""
    picked = run("second", lambda g: 1.0 + 0.01 * g, steps=200,
                 straggles=lambda g: g == 16, delta=0.1, dual_step=0.2)
    assert picked[-50:].count(16) <= 10
    assert 8 in picked[-50:]


def test_unmeasured_steps_leave_the_objective_per_step() -> None:
    """No seconds reported (an older trainer's report, 0): per second decides as per step,
    draw for draw."""
    assert run("second", lambda g: 0.0) == run("step", lambda g: 0.0)


def test_the_objective_is_checked_and_bad_seconds_change_nothing() -> None:
    with pytest.raises(ConfigError, match="objective"):
        SAGCConfig(objective="minute")
    ctl = SAGCController(SAGCConfig(objective="second"))
    g = ctl.decide()
    before = json.dumps(ctl.state_dict())
    for bad in (-1.0, math.nan, math.inf, "3"):
        with pytest.raises(ObservationError, match="seconds"):
            ctl.observe(g, 200.0, 100.0, seconds=bad)  # type: ignore[arg-type]
    assert json.dumps(ctl.state_dict()) == before


def test_state_keeps_the_measured_seconds_and_an_older_state_restores() -> None:
    ctl = SAGCController(SAGCConfig(objective="second"))
    for _ in range(6):
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=1.0 + 0.5 * g)
    assert set(ctl.step_seconds()) >= {4, 8}
    again = SAGCController.from_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert again.step_seconds() == ctl.step_seconds()
    for _ in range(20):  # continues decision for decision
        g = ctl.decide()
        assert again.decide() == g
        ctl.observe(g, 200.0, 100.0, seconds=1.0 + 0.5 * g)
        again.observe(g, 200.0, 100.0, seconds=1.0 + 0.5 * g)
    old = ctl.state_dict()
    del old["step_seconds"], old["step_tokens"]  # written before the objective existed
    old["config"].pop("objective")
    restored = SAGCController.from_state_dict(old)
    assert restored.step_seconds() == {} and restored.config.objective == "step"


def test_a_per_step_state_is_what_older_releases_wrote() -> None:
    """Per step (the default) neither the config's objective nor any seconds are written, so
    an operator or trainer of an older release restores the state; seconds are not kept."""
    ctl = SAGCController(SAGCConfig())
    for _ in range(4):
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=3.0, tokens=300.0)
    state = ctl.state_dict()
    assert "step_seconds" not in state and "step_tokens" not in state
    assert "objective" not in state["config"]
    assert ctl.step_seconds() == {}
    assert "objective" in SAGCController(SAGCConfig(objective="second")).state_dict()["config"]


def test_the_job_controller_prices_sizes_from_the_reports_seconds() -> None:
    """Through the step-report path: each report's rollout + reward + train + sync is what
    SAGC's size is priced at; steps whose seconds grow with G move a per-second job to G=4
    while a per-step job stays at 16."""
    finals = {}
    for objective in ("step", "second"):
        jc = JobController(JobControllerConfig(sagc=SAGCConfig(objective=objective)))
        for _ in range(20):
            r = report(jc, max_len=200.0, median=100.0)
            g = r.group_size
            r = dataclasses.replace(r, seconds=StepSecondsData(
                rollout=0.5 * g, reward=0.1, train=0.5 * g, sync=0.1))
            jc.observe(r)
        finals[objective] = jc.plan().group_size
        if objective == "second":  # the reports' seconds reached it: G=8's step is 8.2 s
            assert jc.step_seconds()[8] == pytest.approx(8.2)
    assert finals == {"step": 16, "second": 4}


def test_a_policy_that_changes_the_candidates_keeps_the_kept_sizes_seconds() -> None:
    """A run-time policy's clamp (``reconfigure``) re-indexes the candidates: the measured
    seconds follow their sizes, a new size has none."""
    ctl = SAGCController(SAGCConfig(objective="second", candidates=(4, 8, 16)))
    for _ in range(6):
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=float(g), tokens=100.0 * g)
    seen = ctl.step_seconds()
    ctl.reconfigure(SAGCConfig(objective="second", candidates=(2, 4, 8), initial=8))
    assert ctl.step_seconds() == {g: s for g, s in seen.items() if g in (2, 4, 8)}
    assert 2 not in ctl.step_seconds()
    # the steps' tokens are kept: a new size is priced from them at once (a second a G here)
    assert ctl.step_prices() == pytest.approx({2: 2.0, 4: 4.0, 8: 8.0})


def test_a_price_follows_the_steps_tokens_not_the_lengths_it_was_measured_at() -> None:
    """A size measured while responses ran long is priced at today's lengths when the report
    carries its tokens (``lengths.mean``): seconds = k * tokens ** beta, fitted to the steps
    of every size, so G=4, measured dear early, is not left dear. Steps here cost
    1 ms * tokens ** 0.8 (a larger step costs less per token), and that is what is fitted."""
    def secs(g: int, mean: float) -> float:
        return 1e-3 * (32 * g * mean) ** 0.8

    ctl = SAGCController(SAGCConfig(objective="second"))
    g = ctl.decide()  # 8
    ctl.observe(g, 200.0, 100.0, seconds=secs(g, 60), tokens=32 * g * 60)
    # one size run: seconds in proportion to tokens, so the smaller size looks cheaper
    assert ctl.step_prices() == pytest.approx({x: secs(8, 60) * x / 8 for x in (4, 8, 16)})
    g = ctl.decide()
    assert g == 4
    ctl.observe(g, 200.0, 100.0, seconds=secs(g, 60), tokens=32 * g * 60)
    assert ctl.step_prices() == pytest.approx({x: secs(x, 60) for x in (4, 8, 16)})
    for _ in range(10):  # responses shorten to 20 tokens: every size's price follows
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=secs(g, 20), tokens=32 * g * 20)
    assert ctl.step_prices() == pytest.approx({x: secs(x, 20) for x in (4, 8, 16)})
    # a state written with tokens restores them and continues draw for draw
    again = SAGCController.from_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert again.step_prices() == ctl.step_prices()
    assert again.decide() == ctl.decide()


def test_a_step_priced_in_g_apart_from_its_lengths() -> None:
    """As measured on the ramble task: a step's seconds grow about in proportion to G but
    much less than in proportion to its responses' lengths (a batch decodes its responses side
    by side), and the lengths fall as the model stops rambling. Fitted on tokens alone, the
    falling lengths make tokens look nearly free (seconds ~ tokens ** 0.5 over these steps),
    so G=8 looks as cheap per log2(G) as G=4; fitted in G and in tokens per response apart,
    every size is priced as it costs, and G=4, the better size per second, is kept."""
    def secs(g: int, mean: float) -> float:
        return 0.02 * g * mean ** 0.3

    ctl = SAGCController(SAGCConfig(objective="second", seed=1))
    picks = []
    for t in range(30):
        mean = max(20.0, 60.0 - 5 * t)  # rambling, then cured by step 8
        g = ctl.decide()
        picks.append(g)
        ctl.observe(g, 2 * mean, mean, seconds=secs(g, mean), tokens=32 * g * mean)
    assert len(set(picks)) > 1  # more than one size was run
    assert ctl.step_prices() == pytest.approx({x: secs(x, 20.0) for x in (4, 8, 16)})
    assert picks[-20:] == [4] * 20, picks


#: Measured: the ramble example's steps at G=4 and G=16, seed 2, 20 steps each (``rlpacer
#: bench-train examples/wordproblems-ramble-local.yaml --arms fixed16 fixed4 --seeds 2 --steps
#: 20``, rows' ``by_step``), run twice on the quiet 2-core machine: per step the seconds of
#: each run (A, B), then the longest, median and mean response length and the responses
#: (the same in both runs: the seed fixes the samples). The model rambles for the first
#: steps, then stops; a step's seconds halve.
FIXED4: list[tuple[float, float, float, float, float, int]] = [
    (3.01, 2.54, 128, 18.0, 39.7, 128), (3.29, 2.61, 128, 30.0, 51.4, 128),
    (3.00, 2.46, 128, 26.5, 42.2, 128), (2.95, 2.37, 128, 27.0, 40.5, 128),
    (2.85, 2.25, 128, 27.0, 31.8, 128), (2.27, 1.81, 97, 26.0, 25.8, 128),
    (2.17, 1.73, 97, 20.5, 24.1, 128), (2.12, 1.67, 97, 18.0, 23.0, 128),
    (1.58, 1.29, 45, 18.0, 22.1, 128), (1.73, 1.39, 60, 18.0, 21.1, 128),
    (1.59, 1.29, 46, 18.0, 20.7, 128), (1.55, 1.28, 38, 18.0, 20.3, 128),
    (1.49, 1.18, 36, 17.0, 18.6, 128), (1.52, 1.23, 33, 17.0, 19.8, 128),
    (1.58, 1.25, 45, 17.0, 19.2, 128), (1.50, 1.21, 39, 17.0, 19.3, 128),
    (1.49, 1.19, 35, 18.0, 19.6, 128), (1.50, 1.20, 33, 17.0, 19.2, 128),
    (1.47, 1.22, 34, 17.0, 19.9, 128), (1.51, 1.22, 38, 18.0, 19.9, 128),
]
FIXED16: list[tuple[float, float, float, float, float, int]] = [
    (8.43, 7.26, 128, 18.0, 39.6, 512), (9.10, 7.82, 128, 28.0, 51.3, 512),
    (8.15, 6.97, 128, 26.5, 40.1, 512), (7.61, 6.51, 128, 26.0, 33.3, 512),
    (7.01, 6.03, 128, 26.0, 29.1, 512), (6.78, 5.51, 128, 18.0, 24.5, 512),
    (5.95, 5.11, 84, 23.0, 24.2, 512), (6.14, 5.30, 97, 18.0, 22.7, 512),
    (5.33, 4.65, 56, 18.0, 20.8, 512), (5.18, 4.43, 47, 18.0, 20.2, 512),
    (5.33, 4.40, 34, 18.0, 19.7, 512), (5.71, 4.63, 128, 18.0, 20.0, 512),
    (5.41, 4.36, 43, 17.0, 18.2, 512), (5.54, 4.39, 35, 17.0, 19.6, 512),
    (5.85, 4.57, 128, 17.0, 19.0, 512), (5.30, 4.11, 36, 17.0, 18.2, 512),
    (5.39, 4.23, 39, 18.0, 18.8, 512), (5.13, 4.21, 34, 16.5, 18.1, 512),
    (5.26, 4.22, 36, 17.0, 18.4, 512), (5.25, 4.26, 41, 18.0, 19.5, 512),
]


def _replay(run: int, tokens: bool, seed: int) -> list[int]:
    """SAGC per second over the measured steps of ``run`` (0: A, 1: B): a step at G=4 or 16
    is that arm's step, one at G=8 is priced between them (seconds linear in G, the two
    arms' mean length) with the stragglers of either arm in turn; ``tokens``: the reports
    carry the responses' mean length (else SAGC prices per size)."""
    ctl = SAGCController(SAGCConfig(objective="second", delta=0.25, seed=seed))
    out = []
    for t, (a, b) in enumerate(zip(FIXED4, FIXED16, strict=True)):
        g = ctl.decide()
        if g == 8:
            secs = a[run] + (b[run] - a[run]) / 3
            mx, med = (a if t % 2 else b)[2:4]
            toks = 32 * 8 * (a[4] + b[4]) / 2
        else:
            step = a if g == 4 else b
            secs, (mx, med, mean, n) = step[run], step[2:]
            toks = mean * n
        ctl.observe(g, mx, med, seconds=secs, tokens=toks if tokens else None)
        out.append(g)
    return out


def test_priced_from_tokens_a_size_measured_while_the_model_rambled_is_not_left_dear() -> None:
    """The drift measured on the ramble task, replayed over 100 controller seeds. A step at
    G=16 costs about three of G=4's whether the model rambles or not, so per second G=4 is
    the size to run throughout. Priced per size, on run A G=4 is measured once while the
    model rambles and that price stays while G=8 and G=16, measured once it has stopped, look
    as cheap: SAGC spends most steps above 4, a quarter at 16 (on run B, whose first G=4 step
    came out a little cheaper, it never leaves 4). Priced from tokens, every size's price
    follows the lengths: no step goes to 16 and most stay at 4 on both runs."""
    for run in (0, 1):
        for a, b in zip(FIXED4, FIXED16, strict=True):
            assert math.log2(4) / a[run] > math.log2(16) / b[run]

    def share(run: int, tokens: bool, g: int) -> float:
        picks = [x for seed in range(100) for x in _replay(run, tokens, seed)[5:]]
        return picks.count(g) / len(picks)

    assert share(0, tokens=False, g=16) >= 0.15 and share(0, tokens=False, g=4) <= 0.2
    assert share(0, tokens=True, g=16) == share(1, tokens=True, g=16) == 0.0
    assert share(0, tokens=True, g=4) >= 0.9 and share(1, tokens=True, g=4) >= 0.9


def test_bad_tokens_change_nothing() -> None:
    ctl = SAGCController(SAGCConfig(objective="second"))
    g = ctl.decide()
    before = json.dumps(ctl.state_dict())
    for bad in (-1.0, math.nan, "3"):
        with pytest.raises(ObservationError, match="tokens"):
            ctl.observe(g, 200.0, 100.0, seconds=1.0, tokens=bad)  # type: ignore[arg-type]
    assert json.dumps(ctl.state_dict()) == before
