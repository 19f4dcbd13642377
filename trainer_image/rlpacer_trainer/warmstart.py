"""Supervised warm start of the tiny model on the task: makes the shipped checkpoint.

RL needs a policy that is sometimes right. This trains the freshly initialised tiny Qwen2 on
reference traces (loss on response tokens only) for a fixed, seeded number of steps and saves
it. It is deliberately stopped early (accuracy well below 100%) so RL has room to improve.

Reproduce the shipped checkpoint (a few minutes on 2 CPU cores)::

    python -m rlpacer_trainer.warmstart --out trainer_image/rlpacer_trainer/assets/tiny-chain

Accuracy printed here is teacher-forced exact match on the held-out set (every argmax along
the reference trace correct), which equals greedy exact-trace accuracy.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from rlpacer_trainer import task, tiny
from rlpacer_trainer.learner import pack
from rlpacer_trainer.tiny import EOS_ID


def bucketed(problems: list[task.Problem], batch: int, seed: int) -> list[task.Problem]:
    """Reorders so each batch holds similar lengths (heavy tails make padding costly); batch
    order is shuffled within windows of 16 batches."""
    rng = random.Random(seed)
    out: list[task.Problem] = []
    win = 16 * batch
    for i in range(0, len(problems), win):
        pool = sorted(problems[i : i + win], key=lambda p: len(p.reference))
        chunks = [pool[j : j + batch] for j in range(0, len(pool), batch)]
        rng.shuffle(chunks)
        for c in chunks:
            out.extend(c)
    return out


def batch_for(problems: list[task.Problem]) -> tuple[torch.Tensor, ...]:
    prompts = [tiny.prompt_ids(p.prompt) for p in problems]
    responses = [[*tiny.encode(p.reference), EOS_ID] for p in problems]
    return pack(prompts, responses)


def sft_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
             packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One supervised step on a :func:`rlpacer_trainer.learner.pack` batch: mean next-token
    loss on the response tokens, gradients clipped at norm 1. Returns the loss."""
    ids, attn, pos, tgt, mask = packed
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
    ).view_as(mask)
    loss = (nll * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


@torch.no_grad()
def exact_match(model: torch.nn.Module, problems: list[task.Problem], bs: int = 256) -> float:
    model.eval()
    hits = 0
    for i in range(0, len(problems), bs):
        ids, attn, pos, tgt, mask = batch_for(problems[i : i + bs])
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1]
        ok = ((logits.argmax(-1) == tgt) | (mask == 0)).all(dim=1)
        hits += int(ok.sum())
    model.train()
    return hits / len(problems)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=tiny.BUILTIN["tiny-chain"])
    ap.add_argument("--steps", type=int, default=900, help="the shipped checkpoint used 900")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=150)
    a = ap.parse_args(argv)
    tiny.set_threads(a.threads)
    model = tiny.new_model(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / a.steps)
    )
    # training data: seeded, disjoint from the RL training seed and the eval seed; a third
    # of it uniform in length so long operands are not unseen
    train = bucketed(task.make_problems(a.steps * a.batch, seed=a.seed + 17, uniform_frac=0.25),
                     a.batch, seed=a.seed)
    evalset = task.make_problems(512, seed=task.EVAL_SEED)
    t0 = time.time()
    log = []
    for step in range(a.steps):
        loss = sft_step(model, opt, batch_for(train[step * a.batch : (step + 1) * a.batch]))
        sched.step()
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            acc = exact_match(model, evalset)
            log.append({"step": step + 1, "loss": float(loss), "eval_exact": acc,
                        "seconds": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
    meta = {"recipe": vars(a) | {"out": str(a.out)}, "log": log,
            "params": sum(p.numel() for p in model.parameters())}
    tiny.save_model(model, a.out, extra=meta)
    print(f"saved {a.out} ({meta['params']} parameters) in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
