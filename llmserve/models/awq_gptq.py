"""AWQ and GPTQ checkpoints (safetensors with `qweight` / `qzeros` / `scales`, config.json's `quantization_config`) read
into layers/quant_blocks.py's BlockTensor, repacked at load, never dequantized.

AWQ, GEMM version ("version": "gemm", AutoAWQ's WQLinear_GEMM): qweight int32 [in, out / 8], each int32 holding 8
output columns of one input row, nibble i holding column AWQ_ORDER[i] of its 8; qzeros int32 [in / group, out / 8]
packed alike; scales fp16 [in / group, out]; w[o, k] = (q[k, o] - z[k // group, o]) * s[k // group, o].
GPTQ (AutoGPTQ / GPTQModel, "quant_method": "gptq"): qweight int32 [in * bits / 32, out], each int32 holding 32 / bits
consecutive input rows of one column, lowest bits first; qzeros int32 [groups, out * bits / 32] packed along the
columns alike; scales [groups, out]; g_idx [in]: each input row's group. w[o, k] = s[g, o] * (q[k, o] - z[g, o])
with g = g_idx[k] and, in the v1 format ("checkpoint_format" "gptq" or absent), z the stored zero + 1 (v2: as stored).
As BlockTensor: codes q, scales s, mins -z * s in fp32 (exact).

Act-order (desc_act): g_idx is not k // group, each group's columns are spread over the row. Sorting the columns by
g_idx (a stable argsort, `perm`) makes group g the stored columns g * group .. (g + 1) * group - 1, so the codes are
kept in that order with the scales and zeros as stored, and the BlockTensor carries perm: a product gathers x's
columns by it (layers/quant_blocks.py). That needs every group to hold exactly `group` columns, as GPTQ's quantizer
writes them (g_idx = the inverse of its column order // group); a g_idx of another length, with groups out of range,
or with groups of other sizes is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.errors import ModelLoadError
from llmserve.layers.quant_blocks import BlockTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8
PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


@dataclass(frozen=True)
class QuantConfig:
    method: str  # awq | gptq
    bits: int
    group: int  # -1: one group per row
    v1_zeros: bool  # GPTQ v1: stored zeros are z - 1


def read_quant_config(raw: dict[str, Any], where: str) -> QuantConfig | None:
    """config.json's quantization_config, checked; None when there is none."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in PARTS:
        raise ModelLoadError(f"{where}: quantization_config quant_method {method!r} is not supported; supported: "
                             "awq (GEMM), gptq")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size", -1))
    supported_bits = (4,) if method == "awq" else (4, 8)
    if bits not in supported_bits:
        raise ModelLoadError(f"{where}: {method} with {bits}-bit weights is not supported; supported: "
                             f"{', '.join(map(str, supported_bits))}")
    if not isinstance(group, int) or (group != -1 and group <= 0):
        raise ModelLoadError(f"{where}: quantization_config group_size {group!r} must be a positive integer or -1")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is not True:
            raise ModelLoadError(f"{where}: AWQ version {version!r} (zero_point {qc.get('zero_point', True)}) is not "
                                 "supported; only the GEMM layout with zero points (version 'gemm')")
        return QuantConfig("awq", bits, group, False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    return QuantConfig("gptq", bits, group, fmt == "gptq")


def quantized_layers(names: Iterable[str]) -> set[str]:
    """Prefixes (`model.layers.0.self_attn.q_proj`) of the checkpoint's quantized linears: those with a qweight."""
    return {n[: -len(".qweight")] for n in names if n.endswith(".qweight")}


def group_tensors(weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig,
                  layers: set[str]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of a checkpoint -> the same, with each quantized layer's parts gathered into one
    (`prefix.weight`, BlockTensor) once all have arrived."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, part = name.rpartition(".")
        if prefix not in layers or part == "bias":
            yield name, t
            continue
        if part not in PARTS[qc.method]:
            raise ModelLoadError(f"tensor {name!r}: a {qc.method} layer has {', '.join(PARTS[qc.method])}, not {part}")
        parts = pending.setdefault(prefix, {})
        parts[part] = t
        if len(parts) == len(PARTS[qc.method]):
            del pending[prefix]
            yield f"{prefix}.weight", to_blocks(prefix, parts, qc)
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = sorted(set(PARTS[qc.method]) - set(parts))
        raise ModelLoadError(f"checkpoint is missing tensor(s) {', '.join(f'{prefix}.{p}' for p in missing)}")


def to_blocks(prefix: str, parts: dict[str, torch.Tensor], qc: QuantConfig) -> BlockTensor:
    try:
        return (_awq if qc.method == "awq" else _gptq)(parts, qc)
    except ValueError as e:
        raise ModelLoadError(f"{prefix}: {e}; config.json's quantization_config does not match the weights") from None


def _unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [r, c] -> [r, c * 32 / bits] codes: each int32's fields, lowest bits first, field i at column i (or at
    column order[i])."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [r, c, per]
    if order is not None:
        fields = fields[..., torch.tensor(order).argsort()]  # column j comes from field order.index(j)
    return fields.reshape(packed.shape[0], packed.shape[1] * per)


def _check(t: torch.Tensor, shape: tuple[int, ...], what: str, dtype: torch.dtype | None = torch.int32) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{what} is {tuple(t.shape)} {t.dtype}, expected {shape}"
                         + (f" {dtype}" if dtype is not None else ""))


def _groups(k: int, group: int) -> tuple[int, int]:
    group = k if group == -1 else group
    if k % group:
        raise ValueError(f"{k} input columns do not split into groups of {group}")
    return group, k // group


def _awq(p: dict[str, torch.Tensor], qc: QuantConfig) -> BlockTensor:
    k, n8 = p["qweight"].shape
    n = n8 * 8
    group, groups = _groups(k, qc.group)
    _check(p["qzeros"], (groups, n8), "qzeros")
    _check(p["scales"], (groups, n), "scales", None)
    q = _unpack_cols(p["qweight"], 4, AWQ_ORDER)  # [k, n]
    z = _unpack_cols(p["qzeros"], 4, AWQ_ORDER)  # [groups, n]
    return _block(q, z, p["scales"], 4, group)


def _gptq(p: dict[str, torch.Tensor], qc: QuantConfig) -> BlockTensor:
    per = 32 // qc.bits
    rows, n = p["qweight"].shape
    k = rows * per
    group, groups = _groups(k, qc.group)
    _check(p["qzeros"], (groups, n // per), "qzeros")
    _check(p["scales"], (groups, n), "scales", None)
    _check(p["g_idx"], (k,), "g_idx", None)
    perm = _act_order(p["g_idx"], group, groups)
    q = _unpack_cols(p["qweight"].T.contiguous(), qc.bits).T  # [k, n]: rows packed along k
    z = _unpack_cols(p["qzeros"], qc.bits) + (1 if qc.v1_zeros else 0)
    return _block(q if perm is None else q[perm], z, p["scales"], qc.bits, group, perm)


def _act_order(g_idx: torch.Tensor, group: int, groups: int) -> torch.Tensor | None:
    """The column order that makes each group a run of `group` columns (int64 [k]), None where g_idx is k // group
    already."""
    g = g_idx.long()
    if torch.equal(g, torch.arange(len(g)) // group):
        return None
    if g.min() < 0 or g.max() >= groups:
        raise ValueError(f"g_idx names groups {g.min().item()} .. {g.max().item()}, the weights have 0 .. {groups - 1}: "
                         "its g_idx and scales disagree; export the checkpoint again")
    sizes = torch.bincount(g, minlength=groups)
    if not (sizes == group).all():
        bad = int((sizes != group).nonzero()[0])
        raise ValueError(f"g_idx puts {sizes[bad].item()} columns in group {bad}, not group_size {group} (act-order "
                         "runs with every group of group_size columns, as GPTQ's quantizer writes them): quantize it "
                         "again, or with desc_act=false")
    return torch.argsort(g, stable=True)


def _block(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int, group: int,
           perm: torch.Tensor | None = None) -> BlockTensor:
    """codes [k, n] (stored order), zeros / scales [groups, n] -> BlockTensor [n, k] with fp32 scales and mins
    -z * s."""
    scales = s.float().T.contiguous()
    return BlockTensor(q.T.to(torch.uint8).contiguous(), scales, -(z.T.float() * scales), bits, group, perm=perm)
