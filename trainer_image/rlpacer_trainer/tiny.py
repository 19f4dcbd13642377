"""The tiny causal LM, its character-level tokenizer, and ``builtin://`` model sources.

The model is a standard Qwen2 architecture (so vLLM loads it unchanged) with a 32-symbol
vocabulary; ~0.17M parameters, under 1 MB in float32. Nothing is downloaded: the tokenizer and the
config are made here, and the shipped warm-started weights come from
``python -m rlpacer_trainer.warmstart`` (see that module).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SYMBOLS = [*"0123456789", "-", ":", ","]
VOCAB = [PAD, BOS, EOS, *SYMBOLS]
VOCAB_SIZE = 32  # padded: vLLM and the embedding matrix like a round number
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}

ASSETS = Path(__file__).resolve().parent / "assets"
BUILTIN = {"tiny-chain": ASSETS / "tiny-chain"}

MODEL_KW: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    torch_dtype="float32",
)


def encode(text: str) -> list[int]:
    """Character-level encoding of task text (no BOS/EOS)."""
    return [TOKEN_ID[c] for c in text]


def decode(ids: list[int]) -> str:
    """Inverse of :func:`encode`; stops at EOS, drops specials."""
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        if i >= len(VOCAB) or i in (PAD_ID, BOS_ID):
            out.append("?")
            continue
        out.append(VOCAB[i])
    return "".join(out)


def prompt_ids(prompt: str) -> list[int]:
    return [BOS_ID, *encode(prompt)]


def resolve_source(source: str) -> Path:
    """``builtin://tiny-chain`` -> the shipped checkpoint; ``file://DIR`` or a plain path -> DIR."""
    if source.startswith("builtin://"):
        name = source.removeprefix("builtin://")
        if name not in BUILTIN:
            raise ValueError(
                f"model.source: unknown builtin model {name!r}; known: {sorted(BUILTIN)}"
            )
        path = BUILTIN[name]
        if not (path / "model.safetensors").exists():
            raise FileNotFoundError(
                f"{path}/model.safetensors missing: run python -m rlpacer_trainer.warmstart"
            )
        return path
    if source.startswith("file://"):
        return Path(source.removeprefix("file://"))
    if "://" in source:
        raise ValueError(f"model.source: scheme of {source!r} is not supported by the trainer")
    return Path(source)


def save_tokenizer(out: Path) -> None:
    """Writes tokenizer.json (+ config) with ``tokenizers`` WordLevel over single characters."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(VOCAB)}
    for i in range(len(VOCAB), VOCAB_SIZE):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD
    )
    fast.save_pretrained(str(out))


def new_model(seed: int = 0) -> Any:
    """A freshly initialised tiny Qwen2 (float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**{k: v for k, v in MODEL_KW.items() if k != "torch_dtype"})
    return Qwen2ForCausalLM(cfg).float()


def load_model(path: Path) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)


def save_model(model: Any, out: Path, extra: dict[str, Any] | None = None) -> None:
    """Saves weights (safetensors), config, generation config and tokenizer into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(out)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    if extra is not None:
        (out / "rlpacer_meta.json").write_text(json.dumps(extra, indent=1, sort_keys=True) + "\n")


def set_threads(n: int) -> None:
    """Caps intra-op threads (2 shared cores: learner and engines must coexist)."""
    import torch

    torch.set_num_threads(max(1, n))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, n)))
