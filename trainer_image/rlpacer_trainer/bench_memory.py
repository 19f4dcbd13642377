"""The learner's per-rank memory, measured against the fit estimate.

``python -m rlpacer_trainer.bench_memory [--worlds 1 2 4] [--hidden 512 --layers 6 ...]``
builds a Qwen2-architecture model of the given size (random weights, seeded), trains it for
``--steps`` steps on ``--worlds`` CPU ranks each (gloo; one rank unsharded, two or more
FSDP-sharded, as a job with ``cpuRanksPerReplica`` runs them), and prints, per world size, each
rank's peak memory during the training steps against :func:`rlpacer.control.memory.estimate`
for the same layout (without its fixed framework overhead, which this measures away).

What is measured: a rank's resident set size sampled every few milliseconds during the steps,
minus the same process's resident size after its imports and process group (the baseline: the
interpreter, torch and its libraries). The ranks run with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_=65536``) so that freed tensors leave the resident set at once (rank 0's
full copy of the weights it broadcast at load time, say). CPU ranks are float32 throughout,
the estimate's ``fp32`` precision.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_model(out: Path, *, vocab: int, hidden: int, intermediate: int, layers: int,
               heads: int, kv_heads: int, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def load_for_check(model: Path) -> Any:
    """The model of :func:`make_model` in float32 (the learner's master weights)."""
    from rlpacer_trainer import models

    return models.load_causal_lm(model)


def _batch(n: int, tokens: int, vocab: int, seed: int) -> list[Any]:
    from rlpacer_trainer.learner import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(8, 32)
        r = rng.randint(tokens // 2, tokens) - p
        out.append(Sample([rng.randrange(3, vocab) for _ in range(p)],
                          [rng.randrange(3, vocab) for _ in range(max(1, r))],
                          rng.uniform(-1.0, 1.0)))
    return out


def _rank(rank: int, world: int, port: int, model: str, args: dict[str, Any], out: str) -> None:
    import torch

    from rlpacer_trainer import learners, sharding
    from rlpacer_trainer.learner import LearnerConfig

    torch.set_num_threads(1)
    cfg = LearnerConfig(learning_rate=1e-4, mini_batches=1, sharding="FSDP",
                        micro_batch_tokens=args["micro_batch_tokens"],
                        activation_checkpointing=args["activation_checkpointing"])
    # what the learner imports, before the baseline: only its tensors count above it
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: F401

    base = rss()
    w = learners.LearnerWorker(model, cfg, rank=rank, world=world, threads=1)
    if world > 1:
        w.join(f"tcp://127.0.0.1:{port}")  # the group, then this rank's shards
    peak = [rss()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    n = args["samples"] * world  # each rank's micro-batches full, as the estimate assumes
    for step in range(args["steps"]):
        batch = _batch(n, args["tokens"], args["vocab"], seed=step)
        pos = learners.shard_positions(n, world)[rank]
        if world > 1:
            w.train_step([batch[i] for i in pos], pos, n)
        else:
            w.train_step(batch)
    stop.set()
    t.join()
    held = sharding.local_bytes(w.learner.model, w.learner.opt)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "peak": peak[0] - base, "held": held}))
    w.leave()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(model: Path, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's peak bytes above its baseline for ``world`` ranks."""
    import torch.multiprocessing as mp

    from rlpacer_trainer import sharding

    old = {k: os.environ.get(k) for k in MMAP_ENV}
    os.environ.update(MMAP_ENV)  # the spawned ranks inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="rlpacer-mem-") as out:
            ctx = mp.get_context("spawn")
            port = _free_port()
            procs = [ctx.Process(target=sharding.spawned_rank,
                                 args=(_rank, r, world, port, str(model), args, out))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=900)
            if any(p.exitcode != 0 for p in procs):
                raise RuntimeError(f"world {world}: ranks exited {[p.exitcode for p in procs]}")
            return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rlpacer.control import memory

    opts = {"micro_batch_tokens": args.micro_batch_tokens, "steps": args.steps,
            "samples": args.samples, "tokens": args.tokens, "vocab": args.vocab,
            "activation_checkpointing": args.activation_checkpointing}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpacer-mem-model-") as d:
        model = make_model(Path(d), vocab=args.vocab, hidden=args.hidden,
                           intermediate=args.intermediate, layers=args.layers,
                           heads=args.heads, kv_heads=args.kv_heads)
        shape = memory.ModelShape.from_config(json.loads((model / "config.json").read_text()))
        for world in args.worlds:
            est = memory.estimate(shape, memory.LearnerLayout(
                world=world, sharded=world > 1, precision=memory.Precision.FP32,
                micro_batch_tokens=args.micro_batch_tokens,
                activation_checkpointing=args.activation_checkpointing))
            ranks = measure(model, world, opts)
            measured = max(r["peak"] for r in ranks)
            expected = est.total - est.overhead
            rows.append({"world": world, "params": shape.params, "measured": measured,
                         "per_rank": [r["peak"] for r in ranks], "estimate": expected,
                         "ratio": measured / expected, "parts": est.parts()})
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rlpacer_trainer.bench_memory",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--samples", type=int, default=12,
                    help="samples per step and rank (enough to fill micro-batches)")
    ap.add_argument("--tokens", type=int, default=256, help="longest sequence, in tokens")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = run(args)
    mib = 1 << 20
    print(f"model: {rows[0]['params'] / 1e6:.1f}M parameters (Qwen2 layout, float32 CPU ranks),"
          f" microBatchTokens {args.micro_batch_tokens}, activation checkpointing"
          f" {'on' if args.activation_checkpointing else 'off'}")
    print("world  measured peak per rank (MiB, max; each rank)   estimate (MiB, no overhead)"
          "   measured/estimate")
    for r in rows:
        each = ", ".join(f"{p / mib:.0f}" for p in r["per_rank"])
        print(f"{r['world']:>5}  {r['measured'] / mib:>10.1f} ({each})"
              f"   {r['estimate'] / mib:>10.1f}   {r['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
