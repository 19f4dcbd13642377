"""The incremental policy-version fingerprint and weight buckets (rlpacer_trainer.weights)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from rlpacer_trainer import weights

pytestmark = pytest.mark.unit


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 16, generator=g),
        "model.norm.weight": torch.ones(16),
        "big": torch.randn(300, 300, generator=g),  # > SAMPLE_ELEMENTS: strided sample
        "half": torch.randn(8, 8, generator=g).to(torch.bfloat16),
    }


def test_incremental_equals_one_shot_over_any_bucket_split() -> None:
    sd = _state()
    whole = weights.fingerprint(sd.items())
    assert whole.startswith("w-")
    for max_bytes in (1, 100, 1024, 5000, 1 << 30):
        fp = weights.Fingerprint()
        for bucket in weights.buckets(sd.items(), max_bytes):
            fp.update(bucket.items())
        assert fp.version() == whole and len(fp) == len(sd)


def test_order_independent() -> None:
    sd = _state()
    items = list(sd.items())
    random.Random(1).shuffle(items)
    fp = weights.Fingerprint()
    for name, t in reversed(items):
        fp.add(name, t)
    assert fp.version() == weights.fingerprint(items) == weights.fingerprint(sd.items())


@pytest.mark.parametrize("name", ["model.norm.weight", "big", "half",
                                  "model.layers.0.self_attn.q_proj.bias"])
def test_one_element_changes_the_version(name: str) -> None:
    sd = _state()
    before = weights.fingerprint(sd.items())
    changed = {k: v.clone() for k, v in sd.items()}
    changed[name].view(-1)[0] += 1  # the first element is always sampled
    assert weights.fingerprint(changed.items()) != before


def test_name_dtype_shape_and_the_set_of_tensors_count() -> None:
    sd = _state()
    v = weights.fingerprint(sd.items())
    renamed = dict(sd)
    renamed["model.norm.weight2"] = renamed.pop("model.norm.weight")
    assert weights.fingerprint(renamed.items()) != v
    cast = dict(sd, **{"model.norm.weight": sd["model.norm.weight"].double()})
    assert weights.fingerprint(cast.items()) != v
    reshaped = dict(sd, **{"model.norm.weight": sd["model.norm.weight"].reshape(4, 4)})
    assert weights.fingerprint(reshaped.items()) != v
    fewer = {k: t for k, t in sd.items() if k != "half"}
    assert weights.fingerprint(fewer.items()) != v
    # a tensor's name cannot stand in for part of another's (names are length-prefixed)
    a = weights.fingerprint([("ab", torch.zeros(2)), ("c", torch.zeros(2))])
    assert a != weights.fingerprint([("a", torch.zeros(2)), ("bc", torch.zeros(2))])


def test_a_name_is_added_once() -> None:
    fp = weights.Fingerprint()
    fp.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="'x' added twice"):
        fp.add("x", torch.ones(2))


def test_buckets_group_consecutive_tensors_up_to_max_bytes() -> None:
    sd = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(30), "d": torch.zeros(5),
          "e": torch.zeros(5)}  # float32: 40, 40, 120, 20, 20 bytes
    got = [list(b) for b in weights.buckets(sd.items(), 80)]
    assert got == [["a", "b"], ["c"], ["d", "e"]]  # "c" alone: larger than max_bytes
    for b in weights.buckets(sd.items(), 80):
        assert len(b) == 1 or sum(weights.nbytes(t) for t in b.values()) <= 80
    assert [list(b) for b in weights.buckets(sd.items(), 1)] == [[k] for k in sd]
    assert [list(b) for b in weights.buckets(sd.items(), 10_000)] == [list(sd)]
    assert list(weights.buckets([], 10)) == []
    with pytest.raises(ValueError):
        list(weights.buckets(sd.items(), 0))


def test_buckets_are_lazy_and_round_trip_as_bytes() -> None:
    pulled: list[str] = []

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for k, t in _state().items():
            pulled.append(k)
            yield k, t

    it = weights.buckets(gen(), 1)
    first = next(it)
    assert list(first) == ["model.embed_tokens.weight"] and len(pulled) <= 2
    sd = _state()
    back: dict[str, torch.Tensor] = {}
    for b in weights.buckets(sd.items(), 2048):
        back.update(weights.from_bytes(weights.to_bytes(b)))
    assert weights.fingerprint(back.items()) == weights.fingerprint(sd.items())
