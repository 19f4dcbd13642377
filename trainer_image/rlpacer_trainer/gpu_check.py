"""The learner-side GPU check: ``python -m rlpacer_trainer.gpu_check`` (scripts/gpu_check.sh).

Runs where a GPU machine has torch and transformers but neither vLLM nor Ray: every check
here uses the trainer's own code paths (the learner a learner pod runs, its checkpoint, the
weight publication the engines load). One JSON line per check, then ``GPU CHECK OK``.

* ``learner_bf16``: one update of the warm-started tiny policy on the device in bfloat16
  (autocast, float32 master weights: what a learner pod runs) against the CPU float32 path
  on the same batch: loss and per-parameter gradients within tolerance.
* ``checkpoint``: the learner's checkpoint written on the device and loaded back (weights
  fingerprint and the next update equal).
* ``sharded_learner``: the FSDP learner on every GPU the machine has (1 GPU: world 1, FSDP
  for its mixed precision; more: all of them, NCCL), a Qwen2-layout model of
  ``--sharded-params`` (default ~0.5 B): the first update's loss in bfloat16 against the
  unsharded float32 learner's on the same batch, the gathered weights' fingerprint equal on
  every rank, and each rank's peak CUDA memory (``max_memory_allocated``) against the fit
  estimate (:mod:`rlpacer.control.memory`, without its fixed overhead). The CPU dry run uses
  2 gloo ranks and float32.
* ``stream_training``: the learner (bfloat16 autocast on the device, as a learner pod) takes
  two steps streamed in parts of a few groups (``trainer.streamTraining``) and two whole,
  from the same weights: the weights after them against each other (relative L2 to the
  update), and the seconds the streamed step left for after the rollout (its finish) against
  the whole step's.
* ``weight_publish``: publish throughput (device -> CPU copy, serialization, fingerprint) for
  a larger Qwen2 (``--publish-params``, default ~0.5 B), with bytes per update.

``--device cpu`` dry-runs the same checks on the CPU (bfloat16 autocast on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlpacer_trainer import sharding, tiny, weights
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


def check_stream_training(device: str) -> None:
    src = str(tiny.resolve_source("builtin://tiny-chain"))
    cfg = LearnerConfig(learning_rate=1e-3, mini_batches=2, micro_batch_tokens=4096,
                        autocast="bfloat16")

    def learner(c: LearnerConfig = cfg) -> Learner:
        return Learner(tiny.load_model(Path(src)).to(device), c)

    whole, streamed = learner(), learner()
    fp32 = learner(dataclasses.replace(cfg, autocast="float32"))  # bfloat16's own error
    start = {k: v.detach().float().cpu().clone() for k, v in whole.model.state_dict().items()}
    whole_s, finish_s, stream_s = [], [], []
    for step in range(2):
        batch = _batch(128, 10 + step)
        t0 = time.perf_counter()
        whole.train_step(batch)
        _sync(device)
        whole_s.append(time.perf_counter() - t0)
        fp32.train_step(batch)
        streamed.stream_begin()
        for i in range(0, len(batch), 16):  # groups of 16, as they would finish
            streamed.stream_add(batch[i:i + 16], list(range(i, min(len(batch), i + 16))))
        _sync(device)
        t0 = time.perf_counter()
        stats = streamed.stream_finish(batch)
        _sync(device)
        finish_s.append(time.perf_counter() - t0)
        stream_s.append(stats["stream_s"])
        assert stats["streamed"] == len(batch), stats
    def weights(x: Learner) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu() for k, v in x.model.state_dict().items()}

    def dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return float(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5)

    a, b, f = weights(whole), weights(streamed), weights(fp32)
    update, off, noise = dist(a, start), dist(a, b), dist(a, f)
    _emit(check="stream_training", device=device, rel_diff_to_update=round(off / update, 5),
          bf16_vs_fp32_rel=round(noise / update, 5),
          whole_step_s=[round(x, 3) for x in whole_s], finish_s=[round(x, 3) for x in finish_s],
          streamed_passes_s=[round(x, 3) for x in stream_s])
    # streaming reorders bfloat16 sums: no further from the whole step than bfloat16 itself is
    # from float32 (twice that, with a floor)
    assert update > 1e-3 and off <= 2 * noise + 0.01 * update, (off, noise, update)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _sharded_rank(rank: int, world: int, port: int, model: str, device: str, tokens: int,
                  seq: int, out: str) -> None:
    import os

    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # before CUDA starts: one GPU a rank

    from rlpacer_trainer import bench_memory

    cfg = LearnerConfig(learning_rate=1e-5, mini_batches=1, sharding="FSDP",
                        micro_batch_tokens=tokens, activation_checkpointing=True)
    w = LearnerWorker(model, cfg, rank=rank, world=world, threads=1)
    w.join(f"tcp://127.0.0.1:{port}")
    n = 8 * world
    losses = []
    for step in range(2):
        batch = bench_memory._batch(n, seq, 4096, seed=step)
        pos = [i for i in range(n) if i % world == rank]
        losses.append(w.train_step([batch[i] for i in pos], pos, n)["loss"])
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else 0
    version = w.fingerprint()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"loss": losses[0], "peak": peak, "version": version}))
    w.leave()


def check_sharded_learner(device: str, params: float) -> None:
    import socket

    import torch.multiprocessing as mp

    from rlpacer.control import memory
    from rlpacer_trainer import bench_memory

    world = torch.cuda.device_count() if device == "cuda" else 2
    hidden = 1024 if params < 1e9 else 2048
    layers = max(1, int(params / (12 * hidden * hidden)))
    tokens = 4096
    seq = 512 if device == "cuda" else 48  # sequence length (the dry run: seconds)
    with tempfile.TemporaryDirectory() as d:
        model = bench_memory.make_model(Path(d) / "m", vocab=4096, hidden=hidden,
                                        intermediate=4 * hidden, layers=layers,
                                        heads=hidden // 64, kv_heads=hidden // 256)
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        ctx = mp.get_context("spawn")
        t0 = time.perf_counter()
        procs = [ctx.Process(target=sharding.spawned_rank,
                             args=(_sharded_rank, r, world, port, str(model), device, tokens,
                                   seq, d))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=1200)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        seconds = time.perf_counter() - t0
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
        # the unsharded float32 learner on the same first batch (this process, the CPU)
        ref = Learner(bench_memory.load_for_check(model), LearnerConfig(
            learning_rate=1e-5, mini_batches=1, micro_batch_tokens=tokens))
        loss_fp32 = ref.train_step(bench_memory._batch(8 * world, seq, 4096, seed=0))["loss"]
        shape = memory.ModelShape.from_config(json.loads((model / "config.json").read_text()))
    est = memory.estimate(shape, memory.LearnerLayout(
        world=world, sharded=True,
        precision=memory.Precision.BF16_MIXED if device == "cuda" else memory.Precision.FP32,
        micro_batch_tokens=tokens, activation_checkpointing=True))
    loss = sum(r["loss"] for r in ranks)  # each rank's share of the batch's loss
    peak = max(r["peak"] for r in ranks)
    estimate = est.total - est.overhead
    _emit(check="sharded_learner", device=device, world=world, params=shape.params,
          loss=round(loss, 5), loss_fp32_unsharded=round(loss_fp32, 5),
          fingerprints_equal=len({r["version"] for r in ranks}) == 1,
          peak_bytes_per_rank=[r["peak"] for r in ranks], estimate_bytes=estimate,
          peak_over_estimate=round(peak / estimate, 3) if peak else None,
          seconds=round(seconds, 1))
    assert len({r["version"] for r in ranks}) == 1
    assert abs(loss - loss_fp32) <= 0.02 * max(1.0, abs(loss_fp32)), (loss, loss_fp32)


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
    ap.add_argument("--sharded-params", type=float, default=5e8)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        _emit(check="device", name=torch.cuda.get_device_name(0), torch=torch.__version__)
    check_learner_bf16(args.device)
    check_checkpoint(args.device)
    check_stream_training(args.device)
    check_sharded_learner(args.device, args.sharded_params)
    check_weight_publish(args.device, args.publish_params)
    print("GPU CHECK OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
