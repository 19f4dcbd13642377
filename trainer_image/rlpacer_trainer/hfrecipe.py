"""A small Hugging Face-format Qwen2 made by project code: "a user's model" for tests.

``python -m rlpacer_trainer.hfrecipe OUT_DIR`` writes the standard layout a user brings
(config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json with a chat template), loadable by transformers' Auto classes and vLLM
through a path. The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
the project's task text (arithmetic word problems and the chain task); the chat template is
ChatML (``<|im_start|>role ... <|im_end|>``), as Qwen2's. The weights are freshly initialised
(seeded): the point is the loading path, not what the model knows. About 0.3M parameters.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    make(a.out, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
