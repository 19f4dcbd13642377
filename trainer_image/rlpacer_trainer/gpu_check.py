"""The learner-side GPU check: ``python -m rlpacer_trainer.gpu_check`` (scripts/gpu_check.sh).

Runs where a GPU machine has torch and transformers but neither vLLM nor Ray: every check
here uses the trainer's own code paths (the learner a learner pod runs, its checkpoint, the
weight publication the engines load). One JSON line per check, then ``GPU CHECK OK``.

* ``learner_bf16``: one update of the warm-started tiny policy on the device in bfloat16
  (autocast, float32 master weights: what a learner pod runs) against the CPU float32 path
  on the same batch: loss and per-parameter gradients within tolerance.
* ``checkpoint``: the learner's checkpoint written on the device and loaded back (weights
  fingerprint and the next update equal).
* ``weight_publish``: publish throughput (device -> CPU copy, serialization, fingerprint) for
  a larger Qwen2 (``--publish-params``, default ~0.5 B), with bytes per update.

``--device cpu`` dry-runs the same checks on the CPU (bfloat16 autocast on the CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlpacer_trainer import tiny, weights
from rlpacer_trainer.learner import Learner, LearnerConfig, Sample
from rlpacer_trainer.learners import LearnerWorker


def _emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _batch(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(tiny.prompt_ids(f"{rng.randint(10, 99)}-{rng.randint(1, 9)}:"),
                   tiny.encode("".join(rng.choice("0123456789,") for _ in range(
                       rng.randint(4, 40)))), rng.uniform(-1.5, 1.5)) for _ in range(n)]


def _grads_after_one_step(device: str, autocast: str | None) -> tuple[float, dict[str, Any]]:
    """Loss and gradients of one mini-batch update (the optimizer step not taken)."""
    model = tiny.load_model(tiny.resolve_source("builtin://tiny-chain")).to(device)
    cfg = LearnerConfig(learning_rate=0.0, mini_batches=1, autocast=autocast, max_grad_norm=1e9)
    learner = Learner(model, cfg)
    stats = learner.train_step(_batch(32))
    grads = {k: p.grad.detach().float().cpu() for k, p in model.named_parameters()
             if p.grad is not None}
    return stats["loss"], grads


def check_learner_bf16(device: str) -> None:
    t0 = time.perf_counter()
    loss_dev, g_dev = _grads_after_one_step(device, "bfloat16")
    seconds = time.perf_counter() - t0
    loss_cpu, g_cpu = _grads_after_one_step("cpu", None)
    rel = max(float((g_dev[k] - g_cpu[k]).norm() / g_cpu[k].norm().clamp_min(1e-12))
              for k in g_cpu)
    cos = min(float(torch.nn.functional.cosine_similarity(g_dev[k].reshape(1, -1),
                                                         g_cpu[k].reshape(1, -1)))
              for k in g_cpu if g_cpu[k].norm() > 1e-8)
    _emit(check="learner_bf16", device=device, loss=loss_dev, loss_cpu_fp32=loss_cpu,
          grad_max_rel_err=round(rel, 4), grad_min_cosine=round(cos, 4),
          seconds=round(seconds, 2))
    assert abs(loss_dev - loss_cpu) <= 0.02 * max(1.0, abs(loss_cpu)), (loss_dev, loss_cpu)
    assert cos > 0.98, cos


def check_checkpoint(device: str) -> None:
    src = str(tiny.resolve_source("builtin://tiny-chain"))
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2)
    a = LearnerWorker(src, cfg)
    b = LearnerWorker(src, cfg)
    assert a.device == device or device == "cpu", (a.device, device)
    a.train_step(_batch(16, 1))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "learner.pt")
        a.save(path)
        b.load(path)
    assert b.fingerprint() == a.fingerprint()
    batch = _batch(16, 2)
    a.train_step(batch)
    b.train_step(batch)
    _emit(check="checkpoint", device=a.device, equal_after_next_update=a.fingerprint() ==
          b.fingerprint())
    assert a.fingerprint() == b.fingerprint()


def check_weight_publish(device: str, params: float) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden = 1024 if params < 1e9 else 2048
    layers = max(1, int(params / (12 * hidden * hidden)))
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    sd = weights.cpu_state(model)
    t1 = time.perf_counter()
    blob = weights.to_bytes(sd)
    t2 = time.perf_counter()
    version = weights.fingerprint(sd.items())
    t3 = time.perf_counter()
    back = weights.from_bytes(blob)
    assert weights.fingerprint(back.items()) == version
    _emit(check="weight_publish", device=device, params=n, bytes=len(blob),
          copy_to_cpu_s=round(t1 - t0, 3), serialize_s=round(t2 - t1, 3),
          fingerprint_s=round(t3 - t2, 3),
          gb_per_s=round(len(blob) / 1e9 / max(1e-9, t2 - t0), 2),
          bytes_per_update_7b=int(len(blob) / n * 7e9))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlpacer_trainer.gpu_check")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--publish-params", type=float, default=5e8)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        _emit(check="device", name=torch.cuda.get_device_name(0), torch=torch.__version__)
    check_learner_bf16(args.device)
    check_checkpoint(args.device)
    check_weight_publish(args.device, args.publish_params)
    print("GPU CHECK OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
