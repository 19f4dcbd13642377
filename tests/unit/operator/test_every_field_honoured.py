"""Every field honoured (issue 14): for each leaf field of the generated CRD's spec, changing
only that field in a valid job changes something the job does.

What counts as "something", compared between a base job and the job with one field changed:

* the child objects (``builders.build_children``), less the ConfigMap's verbatim copy of the
  spec (with it, every field would "differ" without being read);
* the trainer's resolved configuration (``RunConfig``: steps, seeds, sampling, engine, learner,
  planner and controller configs, the loaded prompts and the chat-formatted first prompt, the
  reward pool's arguments and the reward function's scores on fixed probes, the checkpoint
  interval, the rollout engines' vLLM arguments);
* the operator's controller configuration and its short/long-round replica counts;
* the reconcile decision (``decide.decide``) in fixed lifecycle scenarios: admission, a failed
  driver, a job that finished long ago, one running past an hour, a long round's pending
  scale-up;
* the Kueue Workloads a job that names a queue asks for (``rlpacer.operator.queue``);
* or a rejection whose message names the field (counted only when nothing else differs; no
  entry relies on one).

The table below covers every leaf: a leaf the CRD gains without a table entry fails
:func:`test_the_table_covers_every_leaf_of_the_crd`, and so does an entry whose path the CRD
no longer has. A field that changes nothing fails its case: remove it or make it read.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.api import contract
from rlpacer.api.job import ManifestError, parse_job, parse_spec
from rlpacer.api.protocol import RoundKind
from rlpacer.api.status import RLTrainingJobStatus
from rlpacer.operator import builders, hosting, queue, scaler
from rlpacer.operator.decide import Observed, decide
from rlpacer_trainer import hfrecipe, reward_fns, runtime, wordproblems
from rlpacer_trainer.config import ConfigError, RunConfig
from rlpacer_trainer.rewards import RewardPool

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
CRD = ROOT / "crds" / "rlpacer.io_rltrainingjobs.yaml"
T0 = datetime(2026, 1, 1, tzinfo=UTC)

# Placeholders replaced by the files of :func:`_files` (a Hugging Face-format model with a chat
# template, a JSON Lines training file and a held-out one): file data needs a text tokenizer.
MODEL, TRAIN, HELD = "@model", "@train", "@held"

#: The base job: valid, small, GRPO on the builtin task, GPUs on both roles.
BASE: dict[str, Any] = {
    "model": {"source": "builtin://tiny-chain"},
    "data": {"source": "builtin://chain", "numPrompts": 64},
    "rollout": {"replicas": 1, "gpusPerReplica": 1, "maxResponseTokens": 64},
    "trainer": {"replicas": 1, "gpusPerReplica": 1},
    "steps": 10,
    "promptsPerStep": 8,
    "tailBatching": {"longRound": {"rolloutReplicas": 2}},
}

# Contexts: patches applied to the base and to the changed job alike, where a field matters
# only with another one set.
FILE_DATA = {"model": {"source": MODEL},
             "data": {"source": TRAIN, "promptField": "question", "answerField": "answer",
                      "numPrompts": None}}
OVERLONG_ON = {"algorithm": {"overlongPenalty": {"enabled": True}}}
ENV = {"name": "FOO", "value": "1"}
SECRET = {"name": "regcred"}
TOLERATION = {"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute",
              "tolerationSeconds": 60}


def _role(role: str) -> dict[str, tuple[Any, dict[str, Any] | None]]:
    """The PodSettings leaves of ``role`` (rollout, trainer, driver, head)."""
    return {
        f"{role}.resources.requests": ({"cpu": "2"}, None),
        f"{role}.resources.limits": ({"memory": "8Gi"}, None),
        f"{role}.env[].name": ("BAR", {role: {"env": [ENV]}}),
        f"{role}.env[].value": ("2", {role: {"env": [ENV]}}),
        f"{role}.imagePullSecrets[].name": ("other", {role: {"imagePullSecrets": [SECRET]}}),
    }


#: CRD leaf path -> (the new value, a context patch or None). ``[]``: the list's first item.
TABLE: dict[str, tuple[Any, dict[str, Any] | None]] = {
    # the claim's volume in the pods; here the trainer refuses it (no claim mounted), naming it
    "model.source": ("pvc://models/qwen", None),
    "model.dtype": ("float16", None),
    # file data with a text model; the record fields are set (and ignored) while builtin
    "data.source": (TRAIN, {"model": {"source": MODEL},
                            "data": {"promptField": "question", "answerField": "answer",
                                     "numPrompts": None}}),
    "data.promptField": ("solution", FILE_DATA),
    "data.answerField": ("solution", FILE_DATA),
    "data.systemPrompt": ("Answer with a number.", FILE_DATA),
    "data.evalSource": (HELD, FILE_DATA),
    "data.evalFraction": ("0.1", FILE_DATA),
    "data.numPrompts": (32, None),
    "data.seed": (1, None),
    "algorithm.name": ("DAPO", None),
    "algorithm.clipRatioLow": ("0.1", None),
    "algorithm.clipRatioHigh": ("0.3", None),
    "algorithm.dynamicSampling": (True, None),
    "algorithm.lossAggregation": ("TokenMean", None),
    "algorithm.overlongPenalty.enabled": (False, OVERLONG_ON),
    "algorithm.overlongPenalty.bufferTokens": (8, OVERLONG_ON),
    "algorithm.overlongPenalty.penalty": ("0.5", OVERLONG_ON),
    "algorithm.learningRate": ("1e-5", None),
    "algorithm.klCoef": ("0.01", None),
    "reward.type": ("MathAnswer", None),
    "reward.timeoutSeconds": (5, None),
    "reward.workers": (4, None),
    "reward.failureScore": ("-1", None),
    "reward.pattern": ("[a-z]+", {"reward": {"type": "Regex", "pattern": "\\d+"}}),
    **_role("rollout"),
    "rollout.image": ("example.com/trainer:2", None),
    "rollout.replicas": (2, None),
    "rollout.gpusPerReplica": (0, None),  # (tensorParallelSize must follow it up)
    # must equal gpusPerReplica: a different value is refused, naming the field
    "rollout.tensorParallelSize": (1, {"rollout": {"gpusPerReplica": 2,
                                                   "tensorParallelSize": 2}}),
    "rollout.maxResponseTokens": (128, None),
    "rollout.maxPromptTokens": (100, None),
    "rollout.temperature": ("0.5", None),
    "rollout.topP": ("0.9", None),
    **_role("trainer"),
    "trainer.image": ("example.com/trainer:2", None),
    "trainer.replicas": (2, None),
    "trainer.gpusPerReplica": (2, None),
    "trainer.cpuRanksPerReplica": (2, {"trainer": {"gpusPerReplica": 0}}),
    "trainer.sharding": ("Replicated", None),
    "trainer.microBatchTokens": (4096, None),
    "trainer.activationCheckpointing": (False, None),
    "trainer.streamTraining": (True, None),
    "steps": (20, None),
    "promptsPerStep": (16, None),
    "groupControl.mode": ("Fixed", None),
    "groupControl.candidates": ([4, 8, 32], None),
    "groupControl.initial": (4, None),
    "groupControl.targetStragglerRate": ("0.1", None),
    "groupControl.stragglerRatio": ("6", None),
    "groupControl.forgetting": ("0.9", None),
    "groupControl.dualStepSize": ("0.1", None),
    "groupControl.lambdaMax": ("5", None),
    "groupControl.localSearchRadius": (2, None),
    "groupControl.windowSteps": (20, None),
    "groupControl.seed": (1, None),
    "groupControl.objective": ("PerSecond", None),
    "tailBatching.enabled": (False, None),
    "tailBatching.activation": ("Always", None),
    "tailBatching.promptOverprovision": ("1.5", None),
    "tailBatching.extraResponsesPerPrompt": (2, None),
    "tailBatching.keepNearCap": ("0.1", None),  # the planner's keep_near_cap
    "tailBatching.longRound.rolloutReplicas": (3, None),
    "tailBatching.longRound.scaleUpTimeoutSeconds": (30, None),  # the scenario waits 61 s
    "tailBatching.longRound.minYieldRatio": ("0", None),
    "tailBatching.longRound.scaleUpLeadSeconds": (90, None),
    "tailBatching.longRound.maxDeferredRounds": (2, None),
    "tailBatching.longRound.joinMidRound": (True, None),
    "tailBatching.longRound.releaseWhenFits": (True, None),
    "tailBatching.longRound.prompts": (16, None),  # promptsPerStep 8: long rounds of 16
    "tailBatching.longRound.fillPrompts": (8, None),  # the planner's long_round_fill
    # a long round's extra replica: a 4-GPU engine in a StatefulSet of its own, not a 2-GPU one
    "tailBatching.longRound.tensorParallelSize": (4, {
        "rollout": {"gpusPerReplica": 2, "tensorParallelSize": 2},
        "tailBatching": {"longRound": {"rolloutReplicas": 2}}}),
    "tailBatching.lengthPrior.route": (True, None),
    "tailBatching.lengthPrior.routeQuantile": ("0.9", {"tailBatching": {
        "longRound": {"rolloutReplicas": 2}, "lengthPrior": {"route": True}}}),
    "tailBatching.lengthPrior.dispatch": (True, None),
    "tailBatching.lengthPrior.context": (True, None),
    "tailBatching.lengthPrior.halfLifeGroups": (512, None),
    "checkpoint.volumeClaim": ("checkpoints", None),
    "checkpoint.everySteps": (5, None),
    # the scenario: evicted by Kueue while the driver runs (pods kept for its checkpoint, or not)
    "checkpoint.evictionGraceSeconds": (0, {"checkpoint": {"volumeClaim": "ckpt"},
                                            "scheduling": {"queueName": "q"}}),
    **_role("driver"),
    **_role("head"),
    "scheduling.priorityClassName": ("high", None),
    "scheduling.nodeSelector": ({"pool": "gpu"}, None),
    "scheduling.tolerations[].key": ("k2", {"scheduling": {"tolerations": [TOLERATION]}}),
    "scheduling.tolerations[].operator": (
        "Equal", {"scheduling": {"tolerations": [{"key": "k", "operator": "Exists"}]}}),
    "scheduling.tolerations[].value": ("v2", {"scheduling": {"tolerations": [TOLERATION]}}),
    "scheduling.tolerations[].effect": (
        "PreferNoSchedule",
        {"scheduling": {"tolerations": [{"key": "k", "operator": "Exists",
                                         "effect": "NoSchedule"}]}}),
    "scheduling.tolerations[].tolerationSeconds": (
        120, {"scheduling": {"tolerations": [TOLERATION]}}),
    "scheduling.queueName": ("gpu-queue", None),
    "tailBatching.longRound.queueName": ("burst", {"scheduling": {"queueName": "gpu-queue"}}),
    "suspend": (True, None),
    "backoffLimit": (0, None),
    "activeDeadlineSeconds": (100, None),  # the scenario runs for an hour
    "ttlSecondsAfterFinished": (60, None),  # the scenario finished a day ago
}

#: Fields known to change nothing: path -> why (xfail, strict, so a fix is noticed).
INERT: dict[str, str] = {}


# --- the CRD's leaves -------------------------------------------------------------------------
def crd_leaves() -> list[str]:
    """Leaf paths of the storage version's spec: objects with properties and arrays of such
    objects (``[]``) are walked; scalars, arrays of scalars and free-form maps are leaves."""
    doc = yaml.safe_load(CRD.read_text())
    version = next(v for v in doc["spec"]["versions"] if v.get("storage"))
    out: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        items = node.get("items") or {}
        if node.get("type") == "object" and "properties" in node:
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}" if path else key)
        elif node.get("type") == "array" and "properties" in items:
            walk(items, path + "[]")
        else:
            out.append(path)

    walk(version["schema"]["openAPIV3Schema"]["properties"]["spec"], "")
    return out


def test_the_table_covers_every_leaf_of_the_crd() -> None:
    leaves = crd_leaves()
    missing = [p for p in leaves if p not in TABLE]
    gone = [p for p in TABLE if p not in leaves]
    assert not missing, (f"CRD leaves without an entry in TABLE: {missing}; add each with a"
                         " value that must change the job (and a context where it needs one)")
    assert not gone, f"TABLE entries the CRD no longer has: {gone}; remove them"
    assert len(leaves) >= 80  # the walk found the spec, not an empty shell


# --- building the jobs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fields")
    return {
        MODEL: str(hfrecipe.make(root / "user-model")),
        TRAIN: str(wordproblems.write(root / "train.jsonl", 40, seed=3)),
        HELD: str(wordproblems.write(root / "held.jsonl", 10, seed=4)),
    }


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """Deep merge; a None value removes the key."""
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    node: Any = doc
    parts = path.split(".")
    for part in parts[:-1]:
        # a list's first item: the context put one there
        node = node[part[:-2]][0] if part.endswith("[]") else node.setdefault(part, {})
    node[parts[-1]] = copy.deepcopy(value)


def _resolve(v: Any, files: dict[str, str]) -> Any:
    if isinstance(v, str):
        return files.get(v, v)
    if isinstance(v, dict):
        return {k: _resolve(x, files) for k, x in v.items()}
    if isinstance(v, list):
        return [_resolve(x, files) for x in v]
    return v


def _jobs(path: str, files: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    value, context = TABLE[path]
    base = copy.deepcopy(BASE)
    _merge(base, context or {})
    base = _resolve(base, files)
    changed = copy.deepcopy(base)
    _set(changed, path, _resolve(value, files))
    return base, changed


# --- observables ------------------------------------------------------------------------------
def _plain(x: Any) -> Any:
    """JSON-able data of ``x`` (dataclasses and pydantic models by their fields)."""
    if hasattr(x, "model_dump"):
        return x.model_dump(mode="json")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, Path):
        return str(x)
    if x is None or isinstance(x, str | int | float | bool):
        return x
    return repr(x)


class _PoolArgs:
    """Stands in for :class:`RewardPool` in ``RewardPool.from_spec``: records the arguments
    instead of starting worker processes."""

    def __init__(self, type_: str, **kw: Any) -> None:
        self.args = {"type": type_, **kw}


#: (response, answer) probes scored by the resolved reward function
REWARD_PROBES = [("12", "12"), ("x 12", "12"), ("\\boxed{12}", "12"), ("abc", "12"),
                 ("12.0", "12"), ("7", "12")]


def _children(spec: Any) -> list[Any]:
    inputs = builders.BuildInputs(name="demo", namespace="team", uid="u-1", spec=spec,
                                  attempt=1, rollout_replicas=scaler.short_replicas(spec),
                                  report_url="http://op.sys.svc:8080")
    out = []
    for child in builders.build_children(inputs):
        if child["kind"] == "ConfigMap":
            # the spec verbatim, for the trainer (which the trainer observables read)
            assert contract.CONFIG_KEY in child["data"]
            child = copy.deepcopy(child)
            del child["data"][contract.CONFIG_KEY]
        out.append(child)
    return out


def _workloads(spec: Any) -> Any:
    """The Kueue Workloads a job that names a queue asks for: its own, and a long round's
    extra replicas' (rlpacer.operator.queue)."""
    if queue.queue_of(spec) is None:
        return None
    inputs = builders.BuildInputs(name="demo", namespace="team", uid="u-1", spec=spec,
                                  attempt=1, rollout_replicas=scaler.short_replicas(spec),
                                  report_url="http://op.sys.svc:8080")
    pods = {r: builders.pod_template_spec(inputs, r) for r in contract.Role}
    extra = max(1, scaler.long_replicas(spec) - scaler.short_replicas(spec))
    return [queue.job_workload("demo", "team", "u-1", spec, pods, 100, "v", "K"),
            queue.long_round_workload(
                "demo", "team", "u-1", spec,
                builders.pod_template_spec(inputs, contract.Role.ROLLOUT, extra=True), extra,
                100, None, "v", "K")]


def _decisions(spec: Any) -> dict[str, Any]:
    def run(st: RLTrainingJobStatus, obs: Observed, t: datetime) -> Any:
        d = decide(spec, st, obs, t, 1)
        return {"status": _plain(d.status), "events": _plain(d.events),
                "workloads": d.workloads, "keep_children": d.keep_children,
                "delete_job": d.delete_job, "requeue_after": d.requeue_after}

    out: dict[str, Any] = {}
    admitted = decide(spec, RLTrainingJobStatus(), Observed(driver_phase="Running",
                                                            rollout_ready=1), T0, 1).status
    out["admit"] = run(RLTrainingJobStatus(), Observed(), T0)
    out["driver failed"] = run(admitted, Observed(driver_phase="Failed"), T0)
    done = decide(spec, admitted, Observed(driver_phase="Succeeded"), T0, 1).status
    out["finished a day ago"] = run(done, Observed(), T0 + timedelta(days=1))
    out["running an hour"] = run(admitted, Observed(driver_phase="Running", rollout_ready=1),
                                 T0 + timedelta(hours=1))
    ro, _, _ = scaler.plan_round(admitted.rollout, spec, RoundKind.LONG, 0, T0)
    pending = admitted.model_copy(update={"rollout": ro})
    out["scale-up pending 61 s"] = run(pending, Observed(driver_phase="Running",
                                                         rollout_ready=1),
                                       T0 + timedelta(seconds=61))
    if spec.scheduling.queue_name is not None:
        # admitted by Kueue, running, then evicted while its driver runs
        wl = {"metadata": {"name": "w", "generation": 1}, "spec": {"podSets": []},
              "status": {"admission": {"clusterQueue": "cq", "podSetAssignments": []},
                         "conditions": [
                             {"type": t, "status": "True", "reason": r, "message": r}
                             for t, r in (("QuotaReserved", "QuotaReserved"),
                                          ("Admitted", "Admitted"))]}}
        evicted = copy.deepcopy(wl)
        evicted["status"]["conditions"].append(
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "p"})
        run_q = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.parse(wl)), T0,
                       1).status
        run_q = decide(spec, run_q, Observed(driver_phase="Running", queue=queue.parse(wl)),
                       T0, 1).status
        out["evicted while running"] = run(
            run_q, Observed(driver_phase="Running", queue=queue.parse(evicted)), T0)
    return out


def _trainer(spec: Any) -> dict[str, Any]:
    job = parse_job({"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
                     "metadata": {"name": "demo"}, "spec": spec.to_wire()})
    try:
        cfg = RunConfig(job=job)
        tok = cfg.tokenizer()
        problems, held = cfg.problems(), cfg.eval_problems()

        def show(ps: list[Any]) -> Any:
            return [len(ps), [(getattr(p, "prompt", None), getattr(p, "reference", None),
                               repr(p)) for p in ps[:5]]]

        pool = RewardPool.from_spec.__func__(_PoolArgs, spec.reward)  # type: ignore[attr-defined]
        fn = reward_fns.load(str(spec.reward.type), spec.reward.pattern)
        return {
            "total_steps": cfg.total_steps, "data_seed": cfg.data_seed,
            "num_prompts": cfg.num_prompts, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature, "top_p": cfg.top_p,
            "engine_dtype": cfg.engine_dtype, "max_prompt_tokens": cfg.max_prompt_tokens,
            "max_model_len": cfg.max_model_len,
            "tail_batching_enabled": cfg.tail_batching_enabled,
            "algorithm": _plain(cfg.algorithm), "learner": _plain(cfg.learner_config()),
            "learner_ranks_per_pod": cfg.learner_ranks_per_pod,
            "dynamic_sampling": cfg.dynamic_sampling, "overlong_buffer": cfg.overlong_buffer,
            "overlong_scale": cfg.overlong_scale, "planner": _plain(cfg.planner_config()),
            "planner_epochs": cfg.planner_epochs(),
            "route_quantile": cfg.route_quantile, "length_dispatch": cfg.length_dispatch,
            "length_context": cfg.length_context, "length_half_life": cfg.length_half_life,
            "stream_training": cfg.stream_training, "join_mid_round": cfg.join_mid_round,
            "release_when_fits": cfg.release_when_fits,
            "scale_up_lead_s": cfg.scale_up_lead_s,
            "max_deferred_rounds": cfg.max_deferred_rounds,
            "controller": _plain(cfg.controller_config()),
            "checkpoint_every": cfg.checkpoint_every,
            "model_path": str(cfg.model_path),
            "problems": show(problems), "eval_problems": show(held),
            "first_prompt_ids": tok.prompt_ids(problems[0].prompt) if problems else None,
            "reward_pool": _plain(pool.args),
            "reward_scores": [fn(r, a, "") for r, a in REWARD_PROBES],
            "engine": _plain(runtime.replica_engine_config(cfg, 0)),
            # a long round's first extra replica's (a wide engine's, when asked)
            "engine_extra": _plain(runtime.replica_engine_config(
                cfg, int(spec.rollout.replicas))),
            "engine_extra_gpus": runtime.replica_tp_gpus(cfg, int(spec.rollout.replicas)),
        }
    except (ConfigError, ValueError) as e:  # a rejection, with its message
        return {"rejected": str(e)}


def observe(doc: dict[str, Any]) -> dict[str, Any]:
    """Every observable of the job with spec ``doc``, as JSON-able data."""
    try:
        spec = parse_spec(doc)
    except ManifestError as e:
        return {"rejected": str(e)}
    return {
        "children": _children(spec),
        "controller": _plain(hosting.controller_config(spec)),
        "replicas": [scaler.short_replicas(spec), scaler.long_replicas(spec)],
        "decide": _decisions(spec),
        "workloads": _workloads(spec),
        "trainer": _trainer(spec),
    }


_CACHE: dict[str, dict[str, Any]] = {}


def _observe_cached(doc: dict[str, Any]) -> dict[str, Any]:
    """Bases repeat across cases (one per context): computed once each."""
    key = json.dumps(doc, sort_keys=True)
    if key not in _CACHE:
        _CACHE[key] = json.loads(json.dumps(observe(doc), sort_keys=True))
    return _CACHE[key]


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{where}.{k}" if where else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def _cases() -> list[Any]:
    return [pytest.param(p, id=p, marks=pytest.mark.xfail(strict=True, reason=INERT[p]))
            if p in INERT else pytest.param(p, id=p) for p in TABLE]


def test_the_base_jobs_are_valid(files: dict[str, str]) -> None:
    """Every case starts from a job the operator and the trainer accept."""
    for path in TABLE:
        base, _ = _jobs(path, files)
        got = _observe_cached(base)
        assert "rejected" not in got, f"{path}: base rejected: {got['rejected']}"
        assert "rejected" not in got["trainer"], (
            f"{path}: the trainer rejects the base: {got['trainer']['rejected']}")


@pytest.mark.parametrize("path", _cases())
def test_changing_the_field_changes_the_job(path: str, files: dict[str, str]) -> None:
    base, changed = _jobs(path, files)
    field = path.split(".")[-1].replace("[]", "")
    try:
        changed_wire = parse_spec(changed).to_wire()
    except ManifestError as err:  # refused naming the field: the value is read
        assert field in str(err), f"spec.{path}: refused without naming the field: {err}"
        return
    # the value took effect: the validated specs differ (not a dropped or defaulted value)
    assert changed_wire != parse_spec(base).to_wire(), (
        f"spec.{path}: the table's value {TABLE[path][0]!r} leaves the validated spec as it"
        " was; pick a value other than the base's")
    before, after = _observe_cached(base), _observe_cached(changed)
    diffs = _differences(before, after)
    assert diffs, (
        f"spec.{path} is inert: changing it to {TABLE[path][0]!r} changes no child object,"
        " no resolved trainer, engine, learner, planner or controller configuration and no"
        " reconcile decision; make something read it or remove it from the API")
    if all(d.split(".")[-1] == "rejected" for d in diffs):
        # a rejection alone counts only when its message names the field
        messages = [str(after.get("rejected")), str(after.get("trainer", {}).get("rejected"))]
        assert any(field in m for m in messages), (
            f"spec.{path}: rejected without naming the field: {messages}")


def test_the_children_comparison_is_not_trivial(files: dict[str, str]) -> None:
    """The ConfigMap's verbatim spec is left out: a field only the trainer reads changes no
    child object (else every field would pass through the ConfigMap alone)."""
    base, changed = _jobs("reward.workers", files)
    before, after = _observe_cached(base), _observe_cached(changed)
    assert before["children"] == after["children"]
    assert before["trainer"]["reward_pool"] != after["trainer"]["reward_pool"]
