"""The learner's memory estimate (rlpacer.control.memory), against figures checked by hand."""

from __future__ import annotations

import pytest

from rlpacer.control.errors import ConfigError
from rlpacer.control.memory import (
    GIB,
    LOGITS_COPIES,
    OVERHEAD_BYTES,
    QWEN25,
    LearnerLayout,
    ModelShape,
    Precision,
    estimate,
)
from rlpacer.sim.plan import MODELS

pytestmark = pytest.mark.unit

# vocab 10, hidden 4, intermediate 8, 1 layer, 2 heads (head_dim 2), 1 KV head, tied:
# layer: q 4x4+4, k 4x2+2, v 4x2+2, o 4x4, MLP 3x4x8, norms 2x4 = 20+10+10+16+96+8 = 160
# root: embeddings 10x4, final norm 4 = 44; total 204
TINY = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def test_parameters_by_hand() -> None:
    assert (TINY.layer_params, TINY.root_params, TINY.params) == (160, 44, 204)
    no_bias = ModelShape(10, 4, 8, 1, 2, 1, tie_word_embeddings=False, attention_bias=False)
    assert no_bias.params == 204 - 8 + 40  # no q/k/v biases, an untied lm_head


def test_qwen25_sizes_match_the_published_parameter_counts() -> None:
    # Qwen2.5-7B: 28 x 233,057,792 per layer + 2 x 152064 x 3584 + 3584
    assert QWEN25["qwen2.5-7b"].params == 7_615_616_512
    assert QWEN25["qwen2.5-7b"].params == pytest.approx(7.62e9, rel=0.01)
    for name, published in [("qwen2.5-0.5b", 0.49e9), ("qwen2.5-1.5b", 1.54e9),
                            ("qwen2.5-3b", 3.09e9), ("qwen2.5-14b", 14.7e9),
                            ("qwen2.5-32b", 32.8e9), ("qwen2.5-72b", 72.7e9)]:
        assert QWEN25[name].params == pytest.approx(published, rel=0.01), name


def test_the_shapes_agree_with_the_planners() -> None:
    for name, m in MODELS.items():
        s = QWEN25[name]
        assert (s.num_hidden_layers, s.num_key_value_heads, s.dim_per_head) == (
            m.layers, m.kv_heads, m.head_dim)
        assert s.params / 1e9 == pytest.approx(m.params_b, rel=0.01)


def test_fp32_one_rank_by_hand() -> None:
    lay = LearnerLayout(world=1, precision=Precision.FP32, micro_batch_tokens=2)
    e = estimate(TINY, lay)
    assert (e.weights, e.gradients, e.optimizer, e.reference) == (816, 816, 1632, 0)
    # per token and layer: 4 x (5x4 + 3x4 + 3x2 + 4x8) + 2 x 4 x 4 = 312
    assert e.activations == 2 * 312
    assert e.logits == 2 * 10 * 4 * LOGITS_COPIES
    assert e.overhead == OVERHEAD_BYTES[Precision.FP32]
    assert e.total == 816 + 816 + 1632 + 624 + 240 + GIB
    ck = estimate(TINY, LearnerLayout(world=1, precision=Precision.FP32, micro_batch_tokens=2,
                                      activation_checkpointing=True))
    assert ck.activations == 2 * (4 * 4 + 312)  # each layer's input, one layer rebuilt
    kl = estimate(TINY, LearnerLayout(world=1, precision=Precision.FP32, kl=True))
    assert kl.reference == 816


def test_bf16_mixed_sharded_by_hand() -> None:
    e = estimate(TINY, LearnerLayout(world=2, micro_batch_tokens=2))
    # float32 shards of 102 parameters; bfloat16 root + two layers gathered; one unit's grad
    assert e.weights == 4 * 102 + 2 * (44 + 2 * 160)
    assert e.gradients == 4 * 102 + 2 * 160
    assert e.optimizer == 8 * 102
    assert e.activations == 2 * (2 * (5 * 4 + 3 * 4 + 3 * 2 + 4 * 8) + 2 * 4 * 4)
    replicated = estimate(TINY, LearnerLayout(world=2, sharded=False, micro_batch_tokens=2))
    assert replicated.weights == 4 * 204 + 2 * 204  # autocast's bfloat16 copies
    assert replicated.optimizer == 8 * 204


def test_sharded_state_scales_as_one_over_ranks() -> None:
    model = QWEN25["qwen2.5-7b"]
    one = estimate(model, LearnerLayout(world=1))
    assert one.optimizer == 8 * model.params
    for w in (2, 4, 8, 16):
        e = estimate(model, LearnerLayout(world=w))
        assert e.optimizer == pytest.approx(one.optimizer / w, abs=8)
        assert e.activations == one.activations and e.logits == one.logits
    # the logits of 16384 tokens over Qwen2.5's 152064-token vocabulary: 29.9 GB
    assert one.logits == 16384 * 152064 * 4 * 3


def test_describe_names_the_total_and_the_parts() -> None:
    e = estimate(QWEN25["qwen2.5-7b"], LearnerLayout(world=8, activation_checkpointing=True))
    text = e.describe()
    assert text.startswith(f"{e.total / GIB:.1f} GiB per rank")
    for part in ("weights", "gradients", "optimizer", "activations", "logits", "overhead",
                 "7.62B parameters", "8 ranks sharded (FSDP)", "activationCheckpointing on"):
        assert part in text
    unbounded = estimate(TINY, LearnerLayout(micro_batch_tokens=0))
    assert unbounded.activations == unbounded.logits == 0
    assert "unbounded" in unbounded.describe()


def test_from_config_reads_a_hugging_face_config() -> None:
    conf = {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "tie_word_embeddings": True, "model_type": "qwen2"}
    assert ModelShape.from_config(conf) == TINY
    llama = ModelShape.from_config({**conf, "model_type": "llama"})
    assert not llama.attention_bias
    with pytest.raises(ConfigError, match=r"config\.json: hidden_size"):
        ModelShape.from_config({**conf, "hidden_size": 0})
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelShape.from_config({k: v for k, v in conf.items() if k != "vocab_size"})
