"""Rotary position embedding (neox / HF "rotate_half" layout) over a precomputed cos/sin cache.

Supported `rope_type`s and how they relate to transformers (the reference):

- default, linear, llama3, yarn: identical inverse frequencies (and yarn's attention factor, which
  scales cos and sin) for every position.
- longrope (Phi-3's "su"): HF picks the short or the long factors for a whole forward call by its longest
  position, so a cached key keeps the set it was rotated with. Here each position has one set: short below
  `original_max_position_embeddings`, long from there on (a pure function of the position, as prefix caching and
  recompute after preemption need). That is HF's model run token by token over its own cache, for prompts up to
  that length. HF's Phi-3 generate() instead drops its cache when a sequence first passes that length and rotates
  every position again with the long set (as does a prompt longer than it), which a paged, prefix-cached KV cache
  cannot do without a recompute: past that point outputs may differ from HF's generate().
- dynamic (dynamic NTK): HF recomputes the base from the *current* sequence length once a sequence
  grows past `max_position_embeddings`, re-rotating keys it has already seen; a KV cache cannot do
  that. As vLLM does, positions below `max_position_embeddings` use the unscaled base (identical to
  HF there) and positions at or beyond it use one fixed NTK-scaled base, computed for the longest
  sequence we serve (`max_position_embeddings * factor`).

The cache covers `rope_max_positions(config)` positions; the engine never runs past that.

M-RoPE (Qwen2-VL, `MRotaryEmbedding`): a token has three positions (temporal, height, width); the rotary frequencies
are cut into three sections (`mrope_section`), each rotated by one of them. Text has all three equal, which is plain
rotary at that position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.kernels import native
from llmserve.kernels.triton import fused_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)  # the scaling keys (factor, beta_fast, ...)
    partial_rotary_factor: float = 1.0  # the fraction of head_dim rotated (its first dims; Phi-3 / Phi-4-mini)

    @property
    def factor(self) -> float:
        return float(self.params.get("factor") or 1.0)

    @property
    def original_max_positions(self) -> int:
        return int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)


def rope_config(hf_config: Any, layer_type: str | None = None) -> RopeConfig:
    """Read rope settings from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older).
    Per-layer-type parameters (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}) need `layer_type`."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            raise ModelLoadError(f"per-layer-type rope parameters ({sorted(params)}) are not supported here")
        params = dict(params[layer_type])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's older name
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    if not 0 < partial <= 1:
        raise ModelLoadError(f"partial_rotary_factor={partial} must be in (0, 1]")
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    max_pos = int(hf_config.max_position_embeddings)
    # HF gives a top-level original_max_position_embeddings (Phi-3 style) priority over the dict's.
    if rope_type in ("llama3", "yarn", "longrope") and getattr(hf_config, "original_max_position_embeddings", None):
        params["original_max_position_embeddings"] = hf_config.original_max_position_embeddings
    if rope_type not in ("default", "yarn", "longrope") and params.get("factor") is None:
        raise ModelLoadError(f"rope_type {rope_type!r} needs a 'factor' in rope_parameters/rope_scaling")
    if rope_type == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise ModelLoadError("rope_type 'longrope' needs 'short_factor' and 'long_factor' in rope_parameters")
    return RopeConfig(rope_type, float(theta), max_pos, params, partial)


def model_max_positions(hf_config: Any) -> int:
    """How many positions the model serves: the least over its layer types' rope settings."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return min(rope_max_positions(rope_config(hf_config, t)) for t in params)
    return rope_max_positions(rope_config(hf_config))


def rope_max_positions(rc: RopeConfig) -> int:
    """How many positions the model can serve: linear/dynamic/yarn stretch the trained context."""
    if rc.rope_type in ("linear", "dynamic"):
        return int(rc.max_position_embeddings * rc.factor)
    if rc.rope_type == "yarn":
        return max(rc.max_position_embeddings, int(rc.original_max_positions * _yarn_factor(rc)))
    return rc.max_position_embeddings


def base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_factor(rc: RopeConfig) -> float:
    factor = rc.params.get("factor")
    return float(factor) if factor is not None else rc.max_position_embeddings / rc.original_max_positions


def llama3_inv_freq(rc: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = base_inv_freq(rc.theta, dim)
    factor, low, high = rc.factor, rc.params["low_freq_factor"], rc.params["high_freq_factor"]
    old_len = rc.original_max_positions
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rc: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    p, factor, base = rc.params, _yarn_factor(rc), rc.theta
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    orig = rc.original_max_positions

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _longrope_inv_freqs(rc: RopeConfig, dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short, long) inverse frequencies and the attention factor that scales cos and sin (HF's
    _compute_longrope_parameters)."""
    p, orig = rc.params, rc.original_max_positions
    factor = p.get("factor") or rc.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(p[k], dtype=torch.float32) * rc.theta**shape)
                   for k in ("short_factor", "long_factor"))
    if short.numel() != dim // 2 or long.numel() != dim // 2:
        raise ModelLoadError(f"longrope short_factor/long_factor need {dim // 2} entries (rotary dim {dim}), got "
                             f"{short.numel()} and {long.numel()}")
    return short, long, float(attention_factor)


def _ntk_inv_freq(rc: RopeConfig, dim: int, seq_len: int) -> torch.Tensor:
    factor, max_pos = rc.factor, rc.max_position_embeddings
    base = rc.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return base_inv_freq(base, dim)


def compute_cos_sin(rc: RopeConfig, dim: int, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables, each [num_positions, dim // 2], on the CPU."""
    scale = 1.0
    if rc.rope_type == "linear":
        inv_freq = base_inv_freq(rc.theta, dim) / rc.factor
    elif rc.rope_type == "llama3":
        inv_freq = llama3_inv_freq(rc, dim)
    elif rc.rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(rc, dim)
    elif rc.rope_type == "longrope":
        inv_freq, long_inv_freq, scale = _longrope_inv_freqs(rc, dim)
    else:  # default, and dynamic below max_position_embeddings
        inv_freq = base_inv_freq(rc.theta, dim)
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # [P, dim/2]
    if rc.rope_type == "dynamic" and num_positions > rc.max_position_embeddings:
        far = positions[rc.max_position_embeddings:]
        freqs[rc.max_position_embeddings:] = torch.outer(far, _ntk_inv_freq(rc, dim, num_positions))
    if rc.rope_type == "longrope":  # the long factors from original_max_position_embeddings on
        far = positions[rc.original_max_positions:]
        freqs[rc.original_max_positions:] = torch.outer(far, long_inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rc: RopeConfig, num_positions: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rc
        device = torch.get_default_device()
        with torch.device("cpu"):  # as HF computes inv_freq: the same values on every device
            cos, sin = compute_cos_sin(rc, head_dim, num_positions or rope_max_positions(rc))
        # fp32 tables [P, head_dim/2]; not in the state dict (derived from the config).
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, head_dim/2] in `dtype` (broadcast over heads)."""
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary over 3-row positions (M-RoPE): frequency f of cos/sin comes from the row of its section, as transformers'
    Qwen2-VL `recomposition_frequencies` assigns them (section i -> row i % 3). The output keeps RotaryEmbedding's
    shape, so the attention layers and the native decoder stack take it unchanged."""

    def __init__(self, head_dim: int, rc: RopeConfig, num_positions: int | None = None) -> None:
        super().__init__(head_dim, rc, num_positions)
        section = [int(n) for n in rc.params.get("mrope_section") or (16, 24, 24)]  # (transformers' default)
        if sum(section) != head_dim // 2:
            raise ModelLoadError(f"rope mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
        rows = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        self.register_buffer("section_rows", rows.to(self.cos.device), persistent=False)  # [head_dim/2] in 0..2

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] int64 (temporal, height, width), or [T] for three equal rows -> (cos, sin), each
        [T, 1, head_dim/2] in `dtype`."""
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        t = positions.shape[1]
        index = self.section_rows.view(1, 1, -1).expand(1, t, -1)
        cos = self.cos[positions].gather(0, index)[0].to(dtype)  # [3, T, D/2] -> [T, D/2]
        sin = self.sin[positions].gather(0, index)[0].to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary in place where the native CPU op can (one pass over q and k together; x may be a
    strided view of the qkv projection's output), else out of place. Returns the rotated tensor."""
    if x.device.type == "cpu" and x.stride(-1) == 1 and native.fused_ops_enabled() and native.load() is not None:
        native.rotary_(x, cos.squeeze(1), sin.squeeze(1))
        return x
    fused = fused_for(x)
    if fused is not None and x.stride(-1) == 1 and cos.dtype == x.dtype and cos.shape[-1] * 2 == x.shape[-1]:
        return fused.rotary_(x, cos, sin)
    return apply_rotary(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates the two halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
