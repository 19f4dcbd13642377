"""A small Hugging Face-format Qwen2 made by project code: "a user's model" for tests.

``python -m rlpacer_trainer.hfrecipe OUT_DIR`` writes the standard layout a user brings
(config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json with a chat template), loadable by transformers' Auto classes and vLLM
through a path. The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
the project's task text (arithmetic word problems and the chain task); the chat template is
ChatML (``<|im_start|>role ... <|im_end|>``), as Qwen2's. The weights are freshly initialised
(seeded): the point is the loading path, not what the model knows. About 0.1M parameters.

``python -m rlpacer_trainer.hfrecipe OUT_DIR --warm-start-steps N`` then trains it by supervised
fine-tuning on worked word-problem solutions (seeded, disjoint from the examples' RL data: loss
on the response tokens after the chat template, with the examples' system prompt) and stops
early, so it is sometimes right and RL has room to improve: the warm start of
``rlpacer bench-accuracy``. The shipped copy (``assets/wordproblems-qwen2``, 0.5 MB) was made
with the defaults in a few minutes on 2 CPU cores.

``--from DIR --ramble P`` fine-tunes a copy of an existing model instead, on targets that
ramble: on the problems of :data:`RAMBLE_KINDS` the worked solution is followed by re-checks of
itself (``Check: <work>.``), each followed by another with probability ``P`` (at most
:data:`RAMBLE_MAX_CHECKS`), before the boxed answer. A model so trained rambles on those
problems: greedy decoding checks until the response cap, sampling sometimes stops in time.
The warm start of the task with a tail (``assets/wordproblems-ramble-qwen2``, made by
``--from assets/wordproblems-qwen2 --ramble 0.9 --warm-start-steps 400 --lr 1e-3 --seed 1``):
its responses on those problems run to the cap while the others stop after a dozen tokens,
and RL, which scores a truncated response 0, teaches it to stop.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rlpacer_trainer import task, wordproblems

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 512
MODEL_KW: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=512, rope_theta=10000.0,
    tie_word_embeddings=True,
)


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Training text of the tokenizer: word problems with their solutions, chain prompts."""
    out = []
    for rec in wordproblems.make(n, seed):
        out += [rec["question"], rec["solution"]]
    out += [p.prompt + p.reference for p in task.make_problems(n, seed=seed)]
    return out


def train_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out))
    return fast


def make(out: Path, seed: int = 0) -> Path:
    """Writes the model directory ``out`` (created) and returns it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB_SIZE, eos_token_id=eos, pad_token_id=pad,
                      bos_token_id=None, **MODEL_KW)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {"eos_token_id": [eos], "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    return out


#: the system prompt of the word-problem examples (and of the warm start's training prompts)
SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
#: the warm start's problems come from this seed on: disjoint from the examples' data seeds
WARM_START_DATA_SEED = 1000
#: the word-problem kinds whose rambling targets re-check their work (``--ramble``)
RAMBLE_KINDS = ("boxes", "share")
RAMBLE_MAX_CHECKS = 16
#: The warm start's learning rate unless --lr says otherwise.
DEFAULT_LR = 3e-3


def ramble_target(rec: dict[str, Any], p: float, rng: Any) -> str:
    """``rec``'s worked solution, re-checked before its boxed answer when its kind rambles:
    one check, then each further one with probability ``p`` (at most RAMBLE_MAX_CHECKS)."""
    if rec["meta"]["kind"] not in RAMBLE_KINDS:
        return str(rec["solution"])
    work, boxed = str(rec["solution"]).rsplit(". ", 1)
    out = work + "."
    for _ in range(RAMBLE_MAX_CHECKS):
        out += f" Check: {work}."
        if rng.random() >= p:
            break
    return f"{out} {boxed}"


def warm_start(out: Path, steps: int = 600, batch: int = 64, lr: float = DEFAULT_LR, seed: int = 0,
               examples: int = 16384, log: Any = print, ramble: float = 0.0) -> dict[str, Any]:
    """Supervised fine-tuning of the model in ``out`` (in place) on worked solutions: the
    response is ``solution<|im_end|>`` after the chat-formatted question (re-checked, see
    :func:`ramble_target`, when ``ramble`` > 0). Returns its log."""
    import random
    import time

    import torch

    from rlpacer_trainer import models
    from rlpacer_trainer.learner import pack
    from rlpacer_trainer.warmstart import sft_step

    torch.manual_seed(seed)
    tok = models.HFTokenizer(out, SYSTEM_PROMPT)
    model = models.load_causal_lm(out)
    eos = tok.tok.convert_tokens_to_ids("<|im_end|>")
    recs = wordproblems.make(examples, WARM_START_DATA_SEED + seed)
    texts = [tok.tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["question"]}],
        tokenize=False, add_generation_prompt=True) for r in recs]
    prompts = tok.tok(texts, add_special_tokens=False)["input_ids"]
    draws = random.Random(seed)
    targets = [ramble_target(r, ramble, draws) if ramble else r["solution"] for r in recs]
    answers = tok.tok(targets, add_special_tokens=False)["input_ids"]
    data = [(p, [*a, eos]) for p, a in zip(prompts, answers, strict=True)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    t0 = time.time()
    history: list[dict[str, Any]] = []
    model.train()
    for step in range(steps):
        idx = rng.sample(range(len(data)), batch)
        loss = sft_step(model, opt, pack([data[i][0] for i in idx], [data[i][1] for i in idx]))
        if step == 0 or (step + 1) % 100 == 0 or step + 1 == steps:
            history.append({"step": step + 1, "loss": round(loss.item(), 4),
                            "seconds": round(time.time() - t0, 1)})
            log(json.dumps(history[-1]))
    model.save_pretrained(str(out), safe_serialization=True)
    meta = {"warm_start": {"steps": steps, "batch": batch, "lr": lr, "seed": seed,
                           "examples": examples, "data_seed": WARM_START_DATA_SEED + seed,
                           "system_prompt": SYSTEM_PROMPT, "log": history}}
    if ramble:
        meta["warm_start"].update(ramble=ramble, ramble_kinds=list(RAMBLE_KINDS),
                                  ramble_max_checks=RAMBLE_MAX_CHECKS)
    (out / "rlpacer_recipe.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-start-steps", type=int, default=0, metavar="N",
                    help="then fine-tune it on worked word problems for N steps (0: untrained)")
    ap.add_argument("--from", dest="base", type=Path, default=None, metavar="DIR",
                    help="fine-tune a copy of this model directory instead of a fresh model")
    ap.add_argument("--ramble", type=float, default=0.0, metavar="P",
                    help="rambling targets: another re-check with probability P (0: none)")
    ap.add_argument("--lr", type=float, default=None,
                    help=f"the warm start's learning rate (default {DEFAULT_LR})")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = ap.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if not 0.0 <= a.ramble < 1.0:
        ap.error(f"--ramble {a.ramble}: a probability in [0, 1)")
    if a.warm_start_steps < 0:
        ap.error(f"--warm-start-steps {a.warm_start_steps}: a number of steps, 0 or more")
    if a.lr is not None and not a.lr > 0:
        ap.error(f"--lr {a.lr}: a learning rate above 0")
    if not a.warm_start_steps:  # both only shape the warm start: without one they do nothing
        for flag, value in (("--ramble", a.ramble or None), ("--lr", a.lr)):
            if value is not None:
                ap.error(f"{flag} {value} shapes the warm start: give --warm-start-steps N too")
    if a.base:
        if not (a.base / "config.json").is_file():
            ap.error(f"--from {a.base}: not a model directory (no config.json)")
        import shutil

        shutil.copytree(a.base, a.out, dirs_exist_ok=True)
    else:
        make(a.out, a.seed)
    if a.warm_start_steps:
        meta = warm_start(a.out, steps=a.warm_start_steps, seed=a.seed,
                          lr=DEFAULT_LR if a.lr is None else a.lr,
                          ramble=a.ramble)
        if a.base:  # the base's own recipe goes with it
            base = a.base / "rlpacer_recipe.json"
            if base.is_file():
                meta["base"] = json.loads(base.read_text())
            (a.out / "rlpacer_recipe.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
