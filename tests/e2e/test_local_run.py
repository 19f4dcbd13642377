"""The embedded default as users run it: ``rlpacer run`` (Ray + a vLLM engine actor), and
the pod entrypoint as a local process (the driver role, reporting over HTTP to a stand-in
of the operator's step-report endpoint that hosts the real JobController)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.api.trace import read_trace
from rlpacer.testing.report_stub import ReportStub
from rlpacer_trainer import contract as c
from rlpacer_trainer.config import RunConfig

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(c.ENV_RAY_ADDRESS, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_rlpacer_run_writes_metrics_and_report(tmp_path: Path) -> None:
    """Two rollout replicas: two engine actors, each bound to its own core, both generating
    at the learner's weights (from their own reports in the metrics). The reward is a user
    module:function on the Python path (ExactMatch under another name), which the reward
    pool's worker processes import. ``--baseline 16`` then trains the same steps at a fixed
    G=16 without tail batching on the same engines, from the same warm start, and the report
    compares the two."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["rollout"]["replicas"] = 2
    doc["spec"]["tailBatching"]["longRound"]["rolloutReplicas"] = 2
    doc["spec"]["reward"] = {"type": "rlpacer_e2e_reward:score", "timeoutSeconds": 10,
                             "workers": 3}
    manifest = tmp_path / "tiny-local-2.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "rlpacer_e2e_reward.py").write_text(
        "from rlpacer_trainer.reward_fns import exact_match as score  # noqa: F401\n")
    env = {**_env(), "PYTHONPATH": str(mods)}
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(BIN / "rlpacer"), "run", str(manifest), "--steps", "4", "--out", str(out),
         "--eval-prompts", "64", "--baseline", "16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert sum(r["accuracy"] for r in recs) > 0  # the user reward scored some chains right
    held = None
    for r in recs:
        # every response that stopped was scored in the pool, none failed
        assert r["reward_calls"] > 0 and r["reward_busy_s"] > 0, r
        assert r["reward_timeouts"] == r["reward_crashes"] == r["reward_errors"] == 0, r
        assert r["group_size"] in (4, 8, 16) and r["len_max"] >= r["len_median"] > 0
        assert r["seconds_rollout"] > 0 and r["seconds_sync"] > 0
        engines = r["engines"]
        assert sorted(e["replica"] for e in engines) == [0, 1], engines
        assert all(e["responses"] > 0 and e["tokens"] > 0 and e["address"] for e in engines)
        assert engines[0]["cores"] != engines[1]["cores"]  # not both on core 0
        versions = {e["policy_version"] for e in engines}
        assert len(versions) == 1 and (held is None or versions == {held}), (held, engines)
        # this step's update made a new version (unless it had nothing to train on: a long
        # round whose groups all had equal rewards)
        assert (r["policy_version"] in versions) == (r["learner_samples"] == 0), r
        held = r["policy_version"]
    topo = json.loads((out / "topology.json").read_text())
    assert [e["replica"] for e in topo["engines"]] == [0, 1]
    assert [x["rank"] for x in topo["learners"]] == [0]
    # one host runs the whole job: the learner trains on all of its cores (the engines wait)
    assert topo["learners"][0]["threads"] == len(os.sched_getaffinity(0))
    pids = {e["pid"] for e in topo["engines"]} | {x["pid"] for x in topo["learners"]}
    # two engine actors and a learner actor, none of them the driver
    assert len(pids) == 3 and topo["driver"]["pid"] not in pids
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["eval_accuracy_start"] <= 1.0 and summary["steps"] == 4
    # start-up: the engines and the learner load the model at once (times from one start), so
    # the learner is up before the two engines are (one after the other, only after them)
    assert 0 < summary["seconds_learner_start"] < summary["seconds_engine_start"] \
        <= summary["seconds_start"], summary
    # the run reports the algorithm it trained with: DAPO's preset, overlong shaping off
    alg = summary["algorithm"]
    assert (alg["name"], alg["clipRatioHigh"], alg["lossAggregation"]) == (
        "DAPO", "0.28", "TokenMean")
    assert alg["dynamicSampling"] and alg["overlongBufferTokens"] == 0
    assert "algorithm: name DAPO" in proc.stdout
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "latest").exists()
    assert "G=" in proc.stderr and "stragglers=" in proc.stderr  # the progress bar
    # the baseline: the same 4 steps at G=16, plain rounds, from the same warm start (the
    # engines were reset to it: the same held-out score before training)
    base = summary["baseline"]
    assert (base["group_size"], base["steps"], base["tail_batching"]) == (16, 4, False)
    assert base["eval_accuracy_start"] == summary["eval_accuracy_start"]
    assert base["wall_seconds"] > 0 and summary["wall_seconds"] > 0 and base["engine_tokens"] > 0
    brecs = [json.loads(x) for x in (out / "baseline" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in brecs] == [0, 1, 2, 3]
    assert all(r["group_size"] == 16 and r["round_kind"] == "Short" and r["aborted"] == 0
               for r in brecs), brecs
    _check_trace(out / "trace.jsonl", recs, replicas={0, 1})
    _check_trace(out / "baseline" / "trace.jsonl", brecs, replicas={0, 1})
    # the job's trace replays in the bench (the kept round of every trained prompt)
    bench = subprocess.run([str(BIN / "rlpacer"), "bench", "--trace", str(out / "trace.jsonl"),
                            "--steps", "8"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "workload: rlpacer trace" in bench.stdout, bench.stdout
    md = (out / "report.md").read_text()
    assert "## Against the baseline (fixed G=16, no tail batching)" in md
    ratio = summary["wall_seconds"] / base["wall_seconds"]
    assert f"This run trained in **{ratio:.2f}x** the baseline's wall clock" in md


def _check_trace(path: Path, recs: list[dict[str, Any]], replicas: set[int]) -> None:
    """The job's response trace agrees with its step records: per step, the kept responses
    (count and longest) and those launched and not kept; every response names its engine."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    head, rows = lines[0], lines[1:]
    assert head["format"] == "rlpacer-response-trace" and head["version"] == 1, head
    for r in recs:
        mine = [x for x in rows if x["step"] == r["step"]]
        kept = [x for x in mine if x["outcome"] == "kept"]
        assert len(kept) == r["kept"], (r, len(kept))
        assert max(x["length"] for x in kept) == r["len_max"], r
        assert len(mine) - len(kept) == r["aborted"], (r, [x["outcome"] for x in mine])
        assert {x["kind"] for x in mine} == {str(r["round_kind"]).lower()}
        assert all(x["engine"] in replicas and x["finish_s"] >= x["start_s"] >= 0 for x in mine)
        assert all((x["length"] is None) == (x["outcome"] in ("aborted", "deferred"))
                   for x in mine)
    trace = read_trace(path.read_text().splitlines(), str(path))
    # one replay group per trained prompt, each with at least its step's G lengths
    assert len(trace.groups) == sum(len(r["prompts"]) for r in recs)
    assert min(len(g.lengths) for g in trace.groups) >= min(r["group_size"] for r in recs)


@pytest.fixture
def operator_stub(tmp_path: Path) -> Iterator[ReportStub]:
    srv = ReportStub(RunConfig.load(EXAMPLE).controller_config(), "s3cret").start()
    yield srv
    srv.shutdown()


def test_pod_entrypoint_driver_reports_over_http(
        tmp_path: Path, operator_stub: ReportStub) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["steps"] = 3
    doc["spec"]["checkpoint"]["everySteps"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "token").write_text("s3cret\n")
    env = _env() | {
        c.ENV_ROLE: "driver", c.ENV_JOB: "tiny-local", c.ENV_NAMESPACE: "default",
        c.ENV_RANK: "0", c.ENV_ATTEMPT: "0", c.ENV_CONFIG: str(tmp_path / "job.yaml"),
        c.ENV_TOKEN_FILE: str(tmp_path / "token"), c.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt"),
        c.ENV_REPORT_URL: f"http://127.0.0.1:{operator_stub.port}",
    }
    proc = subprocess.run([sys.executable, "-m", c.POD_ENTRYPOINT_MODULE], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = operator_stub.reports
    assert [(r["attempt"], r["step"]) for r in reports] == [(0, 0), (0, 1), (0, 2)]
    assert all(r["lengths"]["count"] > 0 and "nextRoundKind" in r for r in reports)
    assert operator_stub.jc.next_step == 3
    assert (tmp_path / "ckpt" / "step-000002" / "state.json").exists()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000003"
    # the cluster driver records its attempt's responses beside its metrics
    metrics = [json.loads(x) for x in
               (tmp_path / "ckpt" / "metrics-attempt0.jsonl").read_text().splitlines()]
    _check_trace(tmp_path / "ckpt" / "trace-attempt0.jsonl", metrics, replicas={0})


def test_pod_entrypoint_rejects_unknown_role() -> None:
    proc = subprocess.run([sys.executable, "-m", c.POD_ENTRYPOINT_MODULE],
                          env=_env() | {c.ENV_ROLE: "bogus"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "RLPACER_ROLE" in proc.stderr


def test_a_local_run_never_joins_a_cluster_left_behind() -> None:
    """A `ray start` that died without cleaning up leaves ray_current_cluster in Ray's temp
    dir: a local run starts its own cluster instead of trying to join that address."""
    tmp = Path(tempfile.mkdtemp(prefix="rlr", dir="/tmp"))  # short: Ray's socket paths
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
        code = ("import ray\nfrom rlpacer_trainer import runtime\n"
                "runtime.init_ray(num_cpus=1)\n"
                "print('answer', ray.get(ray.remote(num_cpus=0.1)(lambda: 7).remote()))\n")
        proc = subprocess.run([sys.executable, "-c", code], env=_env() | {"RAY_TMPDIR": str(tmp)},
                              capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0 and "answer 7" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_length_prior_routes_seen_long_prompts_and_dispatches_by_length(tmp_path: Path) -> None:
    """``tailBatching.lengthPrior``: a dataset of 24 prompts seen over several epochs; from
    the second epoch on, prompts the prior predicts long (rank >= 0.5 here, so some always
    are) skip the short rounds' race and are trained in a long round of their epoch, each once;
    the prior's calibration comes with the report and its state with the checkpoint, which
    forgets at ``halfLifeGroups``; with ``context`` SAGC files the short rounds under the
    prior's predicted risk."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["data"]["numPrompts"] = 24
    spec["promptsPerStep"] = 8
    spec["steps"] = 12
    spec["rollout"]["replicas"] = 2
    spec["rollout"]["maxResponseTokens"] = 96
    spec["tailBatching"]["activation"] = "Always"
    spec["tailBatching"]["longRound"] = {"rolloutReplicas": 2, "minYieldRatio": "0"}
    spec["tailBatching"]["lengthPrior"] = {"route": True, "routeQuantile": "0.5",
                                           "dispatch": True, "context": True,
                                           "halfLifeGroups": 48}  # forgets over two epochs
    manifest = tmp_path / "prior.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(BIN / "rlpacer"), "run", str(manifest), "--out", str(out), "--no-eval"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    routed = sum(r["routed_prompts"] for r in recs)
    assert routed > 0 and summary["routed_prompts"] == routed == recs[-1]["routed_total"]
    rows = [json.loads(x) for x in (out / "trace.jsonl").read_text().splitlines()[1:]]
    # every (epoch, prompt) trained exactly once; a routed prompt was never launched in a
    # short round of its epoch and was trained in a long one
    kept = Counter((x["epoch"], x["prompt"], x["round"]) for x in rows if x["outcome"] == "kept")
    trained = Counter((e, p) for e, p, _ in kept)
    assert set(trained.values()) == {1}
    short = {(x["epoch"], x["prompt"]) for x in rows if x["kind"] == "short"}
    long_only = {(x["epoch"], x["prompt"]) for x in rows if x["kind"] == "long"} - short
    assert len(long_only) == routed  # deferred prompts raced first; routed ones never did
    assert all(e > 0 for e, _ in long_only)  # nothing is predicted before its first epoch
    cal = summary["length_prior"]
    assert cal["seen"]["responses"] > 0 and cal["groups"] == sum(trained.values())
    assert "## Length prior" in (out / "report.md").read_text()
    latest = (out / "checkpoints" / "latest").read_text().strip()
    state = json.loads((out / "checkpoints" / latest / "state.json").read_text())
    assert state["length_prior"]["clock"] == cal["groups"]
    # forgetting: the spec's half-life, and the population's evidence discounted by it
    assert cal["half_life"] == state["length_prior"]["half_life"] == 48
    assert state["length_prior"]["population"][0] < cal["groups"] - 1
    # dispatch by length: both engines served every step
    assert all(len(r["engines"]) == 2 for r in recs)
    # context: every short round after the first two is filed under one half of its risk
    ctx = summary["sagc_context"]
    shorts = sum(r["round_kind"] == "Short" for r in recs)
    filed = ctx["predicted_low"]["steps"] + ctx["predicted_high"]["steps"]
    assert shorts - 2 <= filed <= shorts and filed > 0
