"""Rotary cos/sin tables vs transformers' rope functions, and reading rope settings from configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmserve.errors import ModelLoadError
from llmserve.layers.rotary import (
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    model_max_positions,
    rope_config,
    rope_max_positions,
)

HEAD_DIM, MAX_POS = 32, 256


def _hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                       rope_parameters={"rope_theta": 10000.0, **rope})


def _hf_cos_sin(cfg: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]  # HF repeats the half twice


ROPES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "attention_factor": 1.3,
     "truncate": False},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
def test_cos_sin_match_transformers_below_max_positions(rope: dict) -> None:
    cfg = _hf_config(rope)
    ours = RotaryEmbedding(HEAD_DIM, rope_config(cfg))
    positions = torch.arange(MAX_POS)
    cos, sin = ours(positions, torch.float32)
    hf_cos, hf_sin = _hf_cos_sin(cfg, positions)
    torch.testing.assert_close(cos[:, 0], hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin, atol=1e-6, rtol=0)


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    cfg = _hf_config(ROPES[4])
    _, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    cos, sin = RotaryEmbedding(HEAD_DIM, rope_config(cfg))(torch.tensor([0]), torch.float32)
    torch.testing.assert_close(cos.flatten(), torch.full((HEAD_DIM // 2,), factor), atol=1e-6, rtol=0)


def test_dynamic_beyond_max_positions_uses_one_fixed_ntk_base() -> None:
    cfg = _hf_config({"rope_type": "dynamic", "factor": 2.0})
    rc = rope_config(cfg)
    assert rope_max_positions(rc) == 2 * MAX_POS
    cos, sin = RotaryEmbedding(HEAD_DIM, rc)(torch.arange(2 * MAX_POS), torch.float32)
    # HF's base for a sequence of the full stretched length, held fixed for every position past MAX_POS.
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=2 * MAX_POS)
    freqs = torch.outer(torch.arange(MAX_POS, 2 * MAX_POS).float(), inv_freq)
    torch.testing.assert_close(cos[MAX_POS:, 0], freqs.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[MAX_POS:, 0], freqs.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_short_factors_below_the_original_length_long_ones_from_it(partial: float) -> None:
    """Phi-3's longrope: HF's short set for a sequence within original_max_position_embeddings, its long set (and the
    same attention factor) for one past it; here per position (rotary.py says why)."""
    from transformers import Phi3Config

    dim, orig = int(HEAD_DIM * partial), 64
    gen = torch.Generator().manual_seed(0)
    short, long = (1 + torch.rand(dim // 2, generator=gen) * 3 for _ in range(2))
    cfg = Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=MAX_POS,
                     original_max_position_embeddings=orig, rope_parameters={
                         "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                         "short_factor": short.tolist(), "long_factor": long.tolist()})
    rc = rope_config(cfg)
    assert rc.partial_rotary_factor == partial and rope_max_positions(rc) == MAX_POS
    cos, sin = RotaryEmbedding(dim, rc)(torch.arange(MAX_POS), torch.float32)
    for seq_len, rows in ((orig, slice(0, orig)), (orig + 1, slice(orig, MAX_POS))):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
        assert factor == pytest.approx((1 + torch.log(torch.tensor(MAX_POS / orig)).item() / torch.log(
            torch.tensor(float(orig))).item()) ** 0.5)
        freqs = torch.outer(torch.arange(MAX_POS).float()[rows], inv_freq)
        torch.testing.assert_close(cos[rows, 0], freqs.cos() * factor, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[rows, 0], freqs.sin() * factor, atol=1e-6, rtol=0)


def test_per_layer_type_rope_parameters_need_the_layer_type() -> None:
    cfg = SimpleNamespace(max_position_embeddings=128, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    assert rope_config(cfg, "sliding_attention") == RopeConfig("default", 10000.0, 128, cfg.rope_parameters[
        "sliding_attention"])
    assert rope_config(cfg, "full_attention").theta == 1e6
    with pytest.raises(ModelLoadError, match="per-layer-type"):
        rope_config(cfg)
    assert model_max_positions(cfg) == 128  # the least over the types: linear's 8 x 128 is the full layers' only


def test_apply_rotary_matches_rotate_half() -> None:
    x = torch.randn(5, 3, HEAD_DIM)
    angle = torch.randn(5, 1, HEAD_DIM // 2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.chunk(2, -1)
    expected = x * torch.cat((cos, cos), -1) + torch.cat((-x2, x1), -1) * torch.cat((sin, sin), -1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=1e-6, rtol=0)


def test_reads_older_rope_scaling_and_rope_theta() -> None:
    old = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=500000.0,
                          max_position_embeddings=4096)
    assert rope_config(old) == RopeConfig("linear", 500000.0, 4096, {"type": "linear", "factor": 2.0})
    plain = SimpleNamespace(rope_scaling=None, max_position_embeddings=2048)
    assert rope_config(plain) == RopeConfig("default", 10000.0, 2048, {})


def test_max_positions_per_rope_type() -> None:
    def max_pos(rope: dict) -> int:
        return rope_max_positions(rope_config(_hf_config(rope)))

    assert max_pos({"rope_type": "default"}) == 256
    assert max_pos({"rope_type": "linear", "factor": 3.0}) == 768
    assert max_pos(ROPES[3]) == 256  # llama3: max_position_embeddings is already the extended length
    assert max_pos(ROPES[4]) == 256  # yarn: 64 * 4
    assert max_pos(ROPES[6]) == 256  # yarn: 32 * 8


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "rope_type 'ntk-by-parts' is not supported"),
    ({"rope_type": "longrope", "factor": 2.0}, "needs 'short_factor' and 'long_factor'"),
    ({"rope_type": "linear"}, "needs a 'factor'"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
])
def test_unsupported_rope_is_refused(scaling: dict, message: str) -> None:
    cfg = SimpleNamespace(rope_parameters=scaling, max_position_embeddings=128)
    with pytest.raises(ModelLoadError, match=message):
        rope_config(cfg)
