"""``rlpacer bench-accuracy``: RL on a user's model and data raises held-out accuracy.

For each seed it runs ``rlpacer run`` (a subprocess, as a user runs it) on a manifest that names
a Hugging Face-format model and JSON Lines data with a held-out file
(``examples/wordproblems-local.yaml``: the shipped warm-started Qwen2 and generated arithmetic
word problems, MathAnswer reward, SAGC and tail batching on). Each run evaluates the same
held-out problems greedily before and after training. Then it loads the last checkpoint's
Hugging Face directory as it is, with transformers and with a vLLM engine, and checks that
both score the trained policy: vLLM's greedy accuracy on the whole held-out set must equal
the run's own end accuracy, and transformers' greedy answers must match vLLM's on a sample.
It prints one row per seed and the means and spread; it fails (exit 1) when the mean gain is
under ``--min-gain`` or any seed's checkpoint does not load and score the same.

The data are written by the bench (``--train-count`` problems from ``--data-seed``; held-out
``--eval-count`` problems from another seed, minus any whose question is in the training file
or the warm start's data), so every seed is scored on the same held-out problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "wordproblems-local.yaml"
HELDOUT_SEED = 99


def register(subparsers: Any) -> None:
    b = subparsers.add_parser(
        "bench-accuracy", help="RL on a user's HF model and data: held-out accuracy, seeds",
        description=__doc__.split("\n")[0])
    b.add_argument("manifest", type=Path, nargs="?", default=EXAMPLE)
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    b.add_argument("--steps", type=int, default=None, help="override spec.steps")
    b.add_argument("--train-count", type=int, default=8192)
    b.add_argument("--eval-count", type=int, default=1024,
                   help="held-out problems (after removing any seen in training)")
    b.add_argument("--data-seed", type=int, default=0)
    b.add_argument("--min-gain", type=float, default=0.05,
                   help="the mean greedy held-out gain required (absolute)")
    b.add_argument("--check-sample", type=int, default=64,
                   help="held-out prompts transformers answers, compared with vLLM")
    b.add_argument("--out", type=Path, default=Path("runs/bench-accuracy"))
    b.set_defaults(func=cmd_bench_accuracy)


def write_data(out: Path, train_count: int, eval_count: int, data_seed: int,
               warm_starts: list[dict[str, Any]]) -> tuple[Path, Path, int]:
    """The training file and a held-out file of ``eval_count`` problems none of which is in
    the training file or in the warm starts' data (the model's and those it was fine-tuned
    from); returns both and how many were dropped."""
    from rlpacer_trainer import wordproblems

    train = wordproblems.make(train_count, data_seed)
    seen = {r["question"] for r in train}
    for ws in warm_starts:
        seen |= {r["question"] for r in
                 wordproblems.make(int(ws["examples"]), int(ws["data_seed"]))}
    held: list[dict[str, Any]] = []
    dropped, start = 0, 0
    while len(held) < eval_count:
        batch = wordproblems.make(start + 4 * eval_count, HELDOUT_SEED)[start:]
        start += len(batch)
        for r in batch:
            if r["question"] in seen:
                dropped += 1
            elif len(held) < eval_count:
                seen.add(r["question"])
                held.append(r)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "heldout.jsonl"
    for p, recs in zip(paths, (train, held), strict=True):
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return paths[0], paths[1], dropped


def check_checkpoint(model_dir: Path, cfg: Any, n_sample: int) -> dict[str, Any]:
    """Loads ``model_dir`` (a checkpoint's ``model/``) with vLLM and transformers, as they are,
    and scores the held-out set greedily with the job's reward."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlpacer_trainer import models, runtime
    from rlpacer_trainer.engine import GenRequest, VLLMEngine
    from rlpacer_trainer.rewards import RewardCall, RewardPool

    evalset = cfg.eval_problems()
    tok = models.HFTokenizer(model_dir, cfg.spec.data.system_prompt)
    ecfg = dataclasses.replace(runtime.engine_config(cfg), model_path=str(model_dir))
    t0 = time.perf_counter()
    engine = VLLMEngine(ecfg)
    load_s = time.perf_counter() - t0
    reqs = [GenRequest(f"h{j}", tuple(tok.prompt_ids(p.prompt)), cfg.max_tokens, 0.0)
            for j, p in enumerate(evalset)]
    done = engine.generate(reqs)
    del engine  # its engine core process ends with it
    vllm_ids = [list(done[f"h{j}"].token_ids) for j in range(len(evalset))]
    with RewardPool.from_spec(cfg.spec.reward) as pool:  # the job's own reward, as the run's
        for j, (ids, p) in enumerate(zip(vllm_ids, evalset, strict=True)):
            if done[f"h{j}"].finish_reason == "stop":
                pool.submit(j, RewardCall.of(tok.decode(ids), p))
        scores, _ = pool.collect()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                              dtype=torch.float32)
    same = 0
    for j in range(min(n_sample, len(evalset))):
        prompt = torch.tensor([tok.prompt_ids(evalset[j].prompt)])
        gen = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                          max_new_tokens=cfg.max_tokens, do_sample=False,
                          eos_token_id=sorted(tok.eos_ids), pad_token_id=sorted(tok.eos_ids)[0])
        hf_text = tok.decode(gen[0, prompt.shape[1]:].tolist())
        same += int(hf_text == tok.decode(vllm_ids[j]))
    return {"vllm_accuracy": sum(s >= 1.0 for s in scores.values()) / len(evalset),
            "vllm_load_s": round(load_s, 1),
            "transformers_same_answers": f"{same}/{min(n_sample, len(evalset))}"}


def summarize(rows: list[dict[str, Any]], min_gain: float) -> dict[str, Any]:
    """Means and spread over the seeds' rows; ``met`` when the mean gain reaches ``min_gain``
    and every seed's checkpoint loaded and scored what its run scored."""

    def spread(key: str) -> dict[str, float]:
        xs = [float(r[key]) for r in rows]
        return {"mean": statistics.mean(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                "min": min(xs), "max": max(xs)}

    result: dict[str, Any] = {
        "seeds": [r["seed"] for r in rows], "start": spread("start"), "end": spread("end"),
        "gain": spread("gain"), "min_gain": min_gain,
        "checkpoints_load_and_score_the_same": all(r["checkpoint_scores_the_same"] for r in rows)}
    result["met"] = result["gain"]["mean"] >= min_gain and result[
        "checkpoints_load_and_score_the_same"]
    return result


def warm_starts(recipe: Path) -> list[dict[str, Any]]:
    """The warm starts a model's ``rlpacer_recipe.json`` names: its own, then its base's (a
    model fine-tuned ``--from`` another), and so on."""
    meta = json.loads(recipe.read_text()) if recipe.is_file() else {}
    out = []
    while meta.get("warm_start"):
        out.append(meta["warm_start"])
        meta = meta.get("base") or {}
    return out


def cmd_bench_accuracy(args: argparse.Namespace) -> int:
    import yaml

    from rlpacer_trainer.config import RunConfig

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    doc = yaml.safe_load(args.manifest.read_text())
    spec = doc["spec"]
    model = Path(spec["model"]["source"].removeprefix("file://"))
    if not model.is_absolute():
        model = (Path.cwd() / model) if (Path.cwd() / model).exists() else ROOT / model
    recipe = model / "rlpacer_recipe.json"
    train, held, dropped = write_data(out / "data", args.train_count, args.eval_count,
                                      args.data_seed, warm_starts(recipe))
    spec["model"]["source"] = str(model)
    spec["data"].update(source=str(train.resolve()), evalSource=str(held.resolve()))
    spec["data"].pop("evalFraction", None)
    if args.steps is not None:
        spec["steps"] = args.steps
    manifest = out / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    print(f"bench-accuracy: {model.name}, {args.train_count} training problems, "
          f"{args.eval_count} held-out ({dropped} seen in training dropped), seeds {args.seeds}",
          flush=True)
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        run_out = out / f"seed-{seed}"
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "rlpacer.cli", "run", str(manifest), "--seed", str(seed),
               "--out", str(run_out)]
        print(f"seed {seed}: rlpacer run {manifest} --seed {seed} (metrics: "
              f"{run_out / 'metrics.jsonl'}, log: {out / f'seed-{seed}.log'})", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"seed-{seed}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-3000:])
            print(f"error: rlpacer run (seed {seed}) exited {proc.returncode}; log in {out}")
            return 1
        summary = json.loads((run_out / "summary.json").read_text())
        first = json.loads((run_out / "metrics.jsonl").read_text().splitlines()[0])
        cfg = RunConfig.load(manifest, seed=seed)
        ckpt = run_out / "checkpoints"
        last = ckpt / (ckpt / "latest").read_text().strip() / "model"
        row = {"seed": seed, "start": summary["eval_accuracy_start"],
               "end": summary["eval_accuracy_end"],
               "gain": summary["eval_accuracy_end"] - summary["eval_accuracy_start"],
               "steps": summary["steps"], "group_sizes": summary["group_sizes"],
               "long_rounds": summary["long_rounds"],
               "train_wall_s": round(summary["wall_seconds"], 1),
               "engine_start_s": summary.get("seconds_engine_start"),
               "learner_start_s": summary.get("seconds_learner_start"),
               "first_step_s": round(first["seconds_rollout"] + first["seconds_train"], 2),
               "run_wall_s": round(time.perf_counter() - t0, 1),
               "checkpoint": str(last.relative_to(out))}
        row |= check_checkpoint(last, cfg, args.check_sample)
        row["checkpoint_scores_the_same"] = abs(row["vllm_accuracy"] - row["end"]) < 0.5 / len(
            cfg.eval_problems()) + 1e-9
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = {"heldout": args.eval_count, **summarize(rows, args.min_gain)}
    (out / "bench-accuracy.json").write_text(json.dumps({"rows": rows, **result}, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    g = {k: 100 * v for k, v in result["gain"].items()}
    print(f"held-out greedy accuracy {result['start']['mean']:.1%} -> {result['end']['mean']:.1%}"
          f": {g['mean']:+.1f} points (stdev {g['stdev']:.1f}, min {g['min']:+.1f}; required "
          f"{100 * args.min_gain:+.1f}), checkpoints load and score the same: "
          f"{result['checkpoints_load_and_score_the_same']}: "
          + ("met" if result["met"] else "NOT met"))
    return 0 if result["met"] else 1
