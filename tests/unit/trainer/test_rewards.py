"""The reward pool: worker processes, a hard timeout per call, failures scored and counted.

The rewards that misbehave are a user module written to a temporary folder on ``sys.path``
(the workers import it themselves): one that sleeps forever, one that spins forever, one that
``os._exit``s, one that SIGKILLs itself, one that segfaults, one that raises, one that returns
NaN. Wall-clock bounds show that the other calls, submitted before and after, are not held up.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from rlpacer_trainer.errors import ConfigError
from rlpacer_trainer.rewards import RewardCall, RewardPool

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]  # a pool that hangs fails

BAD = textwrap.dedent('''
    import ctypes, os, signal, time

    def score(response, answer, prompt, **meta):
        if response == "hang":
            time.sleep(1e9)
        if response == "spin":
            while True:
                pass
        if response == "exit":
            os._exit(3)
        if response == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if response == "segv":
            ctypes.string_at(0)
        if response == "raise":
            raise RuntimeError("boom")
        if response == "nan":
            return float("nan")
        if response == "pid":
            return os.getpid()
        return 1.0 if response == answer else 0.5
''')


@pytest.fixture
def bad_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "rlpacer_test_badrewards.py").write_text(BAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rlpacer_test_badrewards:score"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_scores_builtin_and_user_rewards(bad_module: str) -> None:
    with RewardPool("ExactMatch", timeout_s=5, workers=2) as pool:
        pool.submit("a", RewardCall("38,29,", "38,29,"))
        pool.submit("b", RewardCall("38,28,", "38,29,"))
        out, waited = pool.collect()
        assert out == {"a": 1.0, "b": 0.0} and waited < 5
    with RewardPool(bad_module, timeout_s=5, workers=1) as pool:
        pool.submit(1, RewardCall("x", "x", "p"))
        pool.submit(2, RewardCall("y", "x", "p"))
        assert pool.collect()[0] == {1: 1.0, 2: 0.5}
        assert pool.stats.calls == 2 and pool.stats.busy_s > 0


def test_a_hung_call_is_killed_at_its_timeout_and_starves_nothing(bad_module: str) -> None:
    timeout = 3.0
    with RewardPool(bad_module, timeout_s=timeout, workers=2, failure_score=-1.0) as pool:
        before = pool.worker_pids
        t0 = time.monotonic()
        for i in range(5):
            pool.submit(("before", i), RewardCall("x", "x"))
        pool.submit("hang", RewardCall("hang", "x"))
        for i in range(20):
            pool.submit(("after", i), RewardCall("y", "x"))
        # the other 25 calls finish on the other worker long before the hung one's deadline
        while pool.stats.calls < 25 and time.monotonic() - t0 < timeout:
            time.sleep(0.01)
        assert pool.stats.calls == 25, pool.stats
        assert time.monotonic() - t0 < timeout / 2
        out, _ = pool.collect()
        wall = time.monotonic() - t0
        assert timeout <= wall < timeout + 1.5  # cut at the timeout, not left running
        assert out["hang"] == -1.0
        assert sum(v == 1.0 for v in out.values()) == 5
        assert sum(v == 0.5 for v in out.values()) == 20
        s = pool.stats
        assert (s.calls, s.timeouts, s.crashes, s.errors) == (26, 1, 0, 0)
        assert s.busy_s >= timeout
        hung = [p for p in before if not _alive(p)]
        assert len(hung) == 1  # the hung call's worker was killed ...
        t1 = time.monotonic()
        for i in range(4):  # ... and replaced: later calls run on two workers again
            pool.submit(("later", i), RewardCall("pid", "x"))
        out, _ = pool.collect()
        assert time.monotonic() - t1 < 1.0
        assert set(out.values()) <= set(map(float, pool.worker_pids))
        assert hung[0] not in pool.worker_pids and len(pool.worker_pids) == 2
        assert pool.stats.restarts == 1


def test_a_spinning_call_is_killed_too(bad_module: str) -> None:
    with RewardPool(bad_module, timeout_s=1.0, workers=1, failure_score=0.25) as pool:
        t0 = time.monotonic()
        pool.submit("spin", RewardCall("spin", "x"))
        pool.submit("next", RewardCall("x", "x"))
        out, _ = pool.collect()
        assert out == {"spin": 0.25, "next": 1.0}
        assert time.monotonic() - t0 < 2.5
        assert pool.stats.timeouts == 1


def test_calls_that_kill_their_worker_are_crashes(bad_module: str) -> None:
    with RewardPool(bad_module, timeout_s=10, workers=2, failure_score=-1.0) as pool:
        t0 = time.monotonic()
        for i in range(3):
            pool.submit(("before", i), RewardCall("x", "x"))
        for how in ("exit", "kill", "segv"):
            pool.submit(how, RewardCall(how, "x"))
        for i in range(3):
            pool.submit(("after", i), RewardCall("y", "x"))
        out, _ = pool.collect()
        # no timeout is waited out: each death is seen at once and its worker replaced
        assert time.monotonic() - t0 < 3.0
        assert {k: out[k] for k in ("exit", "kill", "segv")} == dict.fromkeys(
            ("exit", "kill", "segv"), -1.0)
        assert [out[("before", i)] for i in range(3)] == [1.0] * 3
        assert [out[("after", i)] for i in range(3)] == [0.5] * 3
        s = pool.stats
        assert (s.calls, s.timeouts, s.crashes, s.errors, s.restarts) == (9, 0, 3, 0, 3)
        assert any("exit code 3" in e for e in pool.last_errors)
        assert any("exit code -9" in e for e in pool.last_errors)
        assert any("exit code -11" in e for e in pool.last_errors)


def test_raising_or_non_finite_rewards_are_errors_and_keep_their_worker(bad_module: str) -> None:
    with RewardPool(bad_module, timeout_s=10, workers=1, failure_score=-2.0) as pool:
        pids = pool.worker_pids
        pool.submit("raise", RewardCall("raise", "x"))
        pool.submit("nan", RewardCall("nan", "x"))
        pool.submit("ok", RewardCall("x", "x"))
        out, _ = pool.collect()
        assert out == {"raise": -2.0, "nan": -2.0, "ok": 1.0}
        s = pool.stats
        assert (s.errors, s.crashes, s.timeouts, s.restarts) == (2, 0, 0, 0)
        assert pool.worker_pids == pids
        assert any("RuntimeError: boom" in e for e in pool.last_errors)


def test_workers_start_once_and_are_reused(bad_module: str) -> None:
    with RewardPool(bad_module, timeout_s=10, workers=2) as pool:
        pids = sorted(pool.worker_pids)
        for rnd in range(3):
            for i in range(8):
                pool.submit((rnd, i), RewardCall("pid", "x"))
            out, _ = pool.collect()
            assert set(out.values()) <= set(map(float, pids))
        assert sorted(pool.worker_pids) == pids and pool.stats.restarts == 0


def test_close_kills_a_worker_stuck_in_a_call(bad_module: str) -> None:
    pool = RewardPool(bad_module, timeout_s=600, workers=1)
    pid = pool.worker_pids[0]
    pool.submit("hang", RewardCall("hang", "x"))
    time.sleep(0.2)
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 3.0
    assert not _alive(pid)


def test_a_reward_the_workers_cannot_import_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"spec\.reward\.type: 'rlpacer_no_such_mod:f'"):
        RewardPool("rlpacer_no_such_mod:f", timeout_s=1)
    (tmp_path / "rlpacer_test_broken.py").write_text("raise ImportError('needs numpyy')\n")
    (tmp_path / "rlpacer_test_ok.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"spec\.reward\.type: .*needs numpyy"):
        RewardPool("rlpacer_test_broken:f", timeout_s=1)
    with pytest.raises(ConfigError, match=r"spec\.reward\.type: .*no callable 'f'"):
        RewardPool("rlpacer_test_ok:f", timeout_s=1)


def test_reward_bench_runs_and_the_hung_arm_is_cut_at_the_timeout() -> None:
    from rlpacer_trainer import reward_bench

    row = reward_bench.run(100, 2, hung=True, timeout_s=1.0)
    assert row["timeouts"] == 1 and row["calls_per_s"] > 0
    assert 1.0 <= row["wall_s"] < 2.5


def test_a_call_that_cannot_be_sent_is_an_error_not_a_dead_pool() -> None:
    with RewardPool("ExactMatch", timeout_s=5, workers=1) as pool:
        pool.submit("bad", RewardCall("x", "x", meta={"f": lambda: 0}))  # does not pickle
        pool.submit("ok", RewardCall("x", "x"))
        out, _ = pool.collect()
        assert out == {"bad": 0.0, "ok": 1.0} and pool.stats.errors == 1


def test_collect_hands_over_scores_as_they_finish_while_it_waits(bad_module: str) -> None:
    """``collect(each)``: the scores that finish while the driver waits for a slow one go to
    ``each`` then (stream training trains their groups meanwhile), each once; the rest is
    returned; ``take_ready`` before it takes what is already in without waiting."""
    with RewardPool(bad_module, timeout_s=2.0, workers=2, failure_score=-1.0) as pool:
        pool.submit("early", RewardCall("x", "x"))
        t0 = time.monotonic()
        while pool.stats.calls < 1 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert pool.take_ready() == {"early": 1.0}
        assert pool.take_ready() == {}
        pool.submit("hang", RewardCall("hang", "x"))  # cut at 2 s
        for i in range(6):
            pool.submit(("y", i), RewardCall("y", "x"))
        seen: list[tuple[float, dict[object, float]]] = []
        out, waited = pool.collect(lambda got: seen.append((time.monotonic(), dict(got))))
        given = [(t, k, v) for t, got in seen for k, v in got.items()]
        assert sorted(k for _, k, _ in given if k != "hang") == [("y", i) for i in range(6)]
        assert len(given) == 7  # each once: the six, then the hung one cut at its timeout
        t_hang = next(t for t, k, v in given if k == "hang" and v == -1.0)
        assert all(t < t_hang - 1.0 for t, k, _ in given if k != "hang")
        assert out == {}  # everything was handed over as it finished
        assert waited >= 1.5
        pool.submit("late", RewardCall("x", "x"))
        assert pool.collect() == ({"late": 1.0}, pytest.approx(0.0, abs=2.0))  # as before
