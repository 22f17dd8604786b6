"""What this CPU computes fast, for choices made once per process."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def fp32_compute_for_bf16() -> bool:
    """Whether large bf16 matmuls and prefill attention should run in fp32 here: on a CPU without AMX
    tiles. There oneDNN's bf16 GEMM (AVX512-BF16 dot products) tops out at ~165 GFLOP/s while fp32
    FMAs reach ~300 (2-core Xeon, measured), and torch's bf16 SDPA runs at half its fp32 speed; with
    AMX, bf16 is several times faster than fp32. LLMSERVE_BF16_FP32_COMPUTE=0 turns it off (A/B)."""
    if os.environ.get("LLMSERVE_BF16_FP32_COMPUTE") == "0":
        return False
    return not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
