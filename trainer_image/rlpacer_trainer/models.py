"""The policy model a job names (``spec.model``): where it is, its tokenizer, its dtype.

Two kinds of model, one interface:

* ``builtin://tiny-chain``: the project's tiny Qwen2 with the task's character vocabulary
  (:mod:`rlpacer_trainer.tiny`); prompts are ``<s>`` + the prompt's characters.
* a Hugging Face-format directory (``pvc://CLAIM/PATH`` on a cluster, ``file:///PATH`` or a
  plain path for ``rlpacer run``): loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``
  by the learner and by vLLM from the same directory, with the hub switched off
  (``HF_HUB_OFFLINE=1``, ``local_files_only``). Prompts go through the tokenizer's chat
  template when it has one (``add_generation_prompt``), else they are plain text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rlpacer.api import sources
from rlpacer_trainer import tiny

#: Never reach a hub at run time: set here (the trainer's processes) and in Ray's runtime env.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
for _k, _v in OFFLINE_ENV.items():
    os.environ.setdefault(_k, _v)

FIELD = "spec.model.source"


class ModelSourceError(ValueError):
    """A model source that cannot be used; the message names spec.model.source."""


def resolve(source: str) -> Path:
    """The directory ``source`` names in this process, checked to hold a Hugging Face model."""
    if source.startswith("builtin://"):
        try:
            return tiny.resolve_source(source)
        except (ValueError, FileNotFoundError) as e:
            raise ModelSourceError(f"{FIELD}: {e}") from e
    try:
        local = sources.local_path(source, FIELD)
    except ValueError as e:
        raise ModelSourceError(str(e)) from e
    assert local is not None
    path = Path(local)
    where = f"{FIELD}: {source!r} ({path})"
    if not path.is_dir():
        hint = (" (the claim is mounted read-only at"
                f" {sources.claim_mount('<claim>')}; check the claim and the path in it)"
                if source.startswith("pvc://") else "")
        raise ModelSourceError(f"{where} is not a directory{hint}; give a Hugging Face-format"
                               " model directory (config.json, *.safetensors, tokenizer files)")
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{where} has no config.json: not a Hugging Face-format model"
                               " directory (save one with model.save_pretrained(DIR))")
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"{where} has no *.safetensors weights (save with"
                               " model.save_pretrained(DIR, safe_serialization=True))")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise ModelSourceError(f"{where} has no tokenizer files (tokenizer.json or"
                               " tokenizer_config.json: save with tokenizer.save_pretrained(DIR))")
    return path


def is_builtin(source: str) -> bool:
    return source.startswith("builtin://")


def max_positions(path: Path) -> int | None:
    """The model's context length (``max_position_embeddings`` of config.json), if it says."""
    cfg = json.loads((path / "config.json").read_text())
    n = cfg.get("max_position_embeddings")
    return int(n) if isinstance(n, int) else None


def resolve_dtype(spec_dtype: str | None, gpu: bool) -> str:
    """``spec.model.dtype``, else bfloat16 on a GPU and float32 on a CPU."""
    if spec_dtype is not None:
        return str(spec_dtype)
    return "bfloat16" if gpu else "float32"


def load_causal_lm(path: Path) -> Any:
    """The policy in float32 (the learner's master weights), from ``path`` only."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                local_files_only=True)


#: what a model directory holds besides the weights and config that ``save_pretrained``
#: writes: copied from the source into a checkpoint's HF directory (tokenizer, chat template)
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json",
                 "config.json", "rlpacer_meta.json")


def save_hf(model: Any, source: Path, out: Path) -> Path:
    """The policy as a Hugging Face-format directory ``out`` (config.json, model.safetensors
    in the learner's float32, the source's tokenizer files, chat template and generation
    config): transformers' Auto classes and vLLM load it as they load the source."""
    import shutil

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES) and \
                not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    if (source / "generation_config.json").is_file():  # the source's stop tokens, as is
        shutil.copy2(source / "generation_config.json", tmp / "generation_config.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def save_hf_state(state: dict[str, Any], source: Path, out: Path) -> Path:
    """:func:`save_hf` from a gathered state dict (a sharded learner's rank 0): the weights as
    safetensors (in shards of at most 5 GB, with their index, as ``save_pretrained`` writes
    them; a tied head is stored once), the source's config and tokenizer files."""
    import shutil

    from huggingface_hub import save_torch_state_dict

    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in state:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_torch_state_dict(state, str(tmp), max_shard_size="5GB")
    for f in sorted(source.iterdir()):
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES[:4]) and \
                not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class PromptTokenizer(Protocol):
    eos_ids: frozenset[int]

    def prompt_ids(self, prompt: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """The builtin tiny model's: ``<s>`` + characters; decoding stops at ``</s>``."""

    eos_ids = frozenset({tiny.EOS_ID})

    def prompt_ids(self, prompt: str) -> list[int]:
        bad = sorted({ch for ch in prompt if ch not in tiny.TOKEN_ID or ch in "<>"})
        if bad:
            raise ValueError(f"characters {''.join(bad)!r} are not in the builtin model's"
                             f" vocabulary ({''.join(tiny.SYMBOLS)}); name a Hugging Face-format"
                             " model in spec.model.source for text prompts")
        return tiny.prompt_ids(prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return tiny.decode(list(ids))


class HFTokenizer:
    """A model directory's own tokenizer (``AutoTokenizer``), its chat template applied."""

    def __init__(self, path: Path, system_prompt: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.system_prompt = system_prompt
        self.chat = bool(getattr(self.tok, "chat_template", None))
        eos: set[int] = set()
        if self.tok.eos_token_id is not None:
            eos.add(int(self.tok.eos_token_id))
        gen = path / "generation_config.json"
        if gen.is_file():  # vLLM stops at these too
            g = json.loads(gen.read_text()).get("eos_token_id")
            eos.update(int(x) for x in (g if isinstance(g, list) else [g]) if x is not None)
        self.eos_ids = frozenset(eos)

    def prompt_ids(self, prompt: str) -> list[int]:
        if self.chat:
            msgs = [{"role": "user", "content": prompt}]
            if self.system_prompt is not None:
                msgs.insert(0, {"role": "system", "content": self.system_prompt})
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        if self.system_prompt is not None:
            prompt = f"{self.system_prompt}\n\n{prompt}"
        return list(self.tok(prompt)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            if i in self.eos_ids:
                break
            out.append(int(i))
        return str(self.tok.decode(out, skip_special_tokens=True))


def tokenizer(source: str, path: Path, system_prompt: str | None = None) -> PromptTokenizer:
    if is_builtin(source):
        return CharTokenizer()
    return HFTokenizer(path, system_prompt)
