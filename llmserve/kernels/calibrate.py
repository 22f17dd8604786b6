"""The kernel choices of one model on this machine (kernels/choice.py has the selection logic and the cache).

Ops with equivalent paths, and their candidates where each can run at all (the CPU-flag gates):

- `bf16_linear:NxK` (a bf16 weight [N, K]: every decoder projection and the LM head):
  fma     kernels/cpu/packed_gemm.cpp, fp32 FMAs on weights widened in registers (AVX-512, the extension built);
  dot     the same packed weights, vdpbf16ps on bf16 x (AVX512-BF16);
  onednn  oneDNN's bf16 matmul on its blocked weights (AMX where the CPU has it);
  fp32    both widened to fp32 per call, oneDNN's fp32 matmul.
  fma and dot share one copy of the weight; onednn and fp32 add their own where they win a bucket.

Each op is timed on random weights of its shape, so calibration needs no checkpoint and runs before the real weights
are packed. The embedded SmolLM2-135M's five shapes take ~3 s here (2-core Zen 5); later starts read the cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmserve.errors import InvalidRequestError
from llmserve.kernels import native
from llmserve.kernels.choice import (
    Candidate,
    ChoiceTable,
    OpChoice,
    Timer,
    choose,
    load_or_measure,
    parse_pins,
    pinned,
    wall_clock,
)

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

BF16_LINEAR = "bf16_linear"
KINDS: dict[str, tuple[str, ...]] = {BF16_LINEAR: ("fma", "dot", "onednn", "fp32")}
ENV = "LLMSERVE_KERNEL_CHOICE"


def op_name(weight: torch.Tensor) -> str:
    return f"{BF16_LINEAR}:{weight.shape[0]}x{weight.shape[1]}"


def bf16_weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """The bf16 CPU weights of the model's linears and LM head (the matmuls a bf16_linear choice applies to)."""
    from llmserve.layers.embedding import VocabEmbedding
    from llmserve.layers.linear import Linear

    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, (Linear, VocabEmbedding)) else None
        if w is not None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2:
            yield w


def available(kind: str) -> tuple[str, ...]:
    """The candidates of an op kind that can run on this machine (flags only gate; they never choose)."""
    assert kind == BF16_LINEAR
    names = []
    if native.packed_gemm_usable():
        names.append("fma")
        if native.bf16_dot_usable():
            names.append("dot")
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        names.append("onednn")
    names.append("fp32")
    return tuple(names)


def bf16_linear_candidates(n: int, k: int, names: tuple[str, ...]) -> list[Candidate]:
    """Each named path over a random bf16 [n, k] weight, as Bf16Matmul runs it; inputs made once per row count."""
    from llmserve.layers.linear import fp32_linear, onednn_linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()

    @functools.cache
    def x(rows: int) -> torch.Tensor:
        return torch.randn(rows, k, generator=gen).bfloat16()

    out = []
    packed = native.bf16_pack(w) if {"fma", "dot"} & set(names) else None
    for name in names:
        if name in ("fma", "dot"):
            out.append(Candidate(name, lambda r, d=name == "dot": native.bf16_gemm(x(r), packed, n, None, dot=d)))
        elif name == "onednn":
            blocked = pack_weight(w)
            out.append(Candidate(name, lambda r, b=blocked: onednn_linear(x(r), b, None)))
        else:
            out.append(Candidate(name, lambda r: fp32_linear(x(r), w, None)))
    return out


def cpu_model() -> str:
    """The CPU's model name with its family / model / stepping (a VM may show only "AMD EPYC")."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
            if not line.strip():
                break
    except OSError:
        return platform.processor() or platform.machine()
    return " ".join(fields.get(f, "?") for f in ("model name", "cpu family", "model", "stepping"))


@functools.cache
def kernels_hash() -> str:
    """Of the native kernels' sources: a rebuilt kernel is measured again."""
    h = hashlib.sha256()
    for path in sorted((Path(__file__).parent / "cpu").iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def key(ops: list[str], threads: int) -> dict[str, object]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "kernels": kernels_hash(), "ops": sorted(ops)}


def plan(model: nn.Module, threads: int, kernel_choice: str | None = None, timer: Timer = wall_clock,
         remeasure: bool = False) -> ChoiceTable | None:
    """The choice table for the model's bf16 matmuls on this machine (None when it has none): pinned by kernel_choice
    (else LLMSERVE_KERNEL_CHOICE, else "auto"), read from the cache, or measured now."""
    shapes = {op_name(w): (w.shape[0], w.shape[1]) for w in bf16_weights(model)}
    if not shapes:
        return None
    spec = kernel_choice if kernel_choice not in (None, "auto") else os.environ.get(ENV, kernel_choice)
    pins = parse_pins(spec, KINDS)
    names = available(BF16_LINEAR)
    if BF16_LINEAR in pins and pins[BF16_LINEAR] not in names:
        raise InvalidRequestError(f"kernel_choice: {BF16_LINEAR}={pins[BF16_LINEAR]} cannot run on this machine; "
                                  f"it runs {', '.join(names)}", param="kernel_choice")
    measure = {op: functools.partial(_measure, n, k, names, timer) for op, (n, k) in shapes.items()}
    pinned_ops = {op: pinned(pins[BF16_LINEAR]) for op in shapes} if BF16_LINEAR in pins else {}
    return load_or_measure(key(list(shapes), threads), measure, pinned_ops, remeasure)


def _measure(n: int, k: int, names: tuple[str, ...], timer: Timer) -> OpChoice:
    with torch.inference_mode():
        return choose(bf16_linear_candidates(n, k, names), timer)


def report(table: ChoiceTable) -> str:
    """The table of what was measured: per op and row bucket, each candidate's time and the winner."""
    lines = []
    for op, c in sorted(table.ops.items()):
        lines.append(f"{op}: {c.describe()}")
        if not c.seconds:
            continue
        names = list(c.seconds)
        lines.append("  rows  " + "".join(f"{n:>11}" for n in names) + "  chosen")
        for i, rows in enumerate(c.rows):
            cells = "".join(f"{c.seconds[n][i] * 1e3:>9.3f}ms" for n in names)
            lines.append(f"  {rows:>4}  {cells}  {c.winners[i]}")
    return "\n".join(lines)
