"""Which thread computes a kernel's unit of work must not change what it computes: every kernel gives the same bits on 1,
2 or 3 threads (3 on a 2-core machine: more threads than cores, as when another process holds one), so a step's tokens
do not depend on torch's thread count."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from llmserve.kernels import native
from llmserve.layers import quant_blocks as qb

pytestmark = pytest.mark.skipif(not native.packed_gemm_usable(), reason="needs the extension and AVX-512")


def _cases() -> dict[str, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 576  # 13 blocks of 16 outputs (the last partial), 18 tiles of depth
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    packed = native.bf16_pack(w)
    cases: dict[str, Callable[[], torch.Tensor]] = {}
    paths = ["fma"] + (["dot"] if native.bf16_dot_usable() else []) + (["amx"] if native.amx_usable() else [])
    for rows in (1, 37, 300, 777):  # a decode row; a few; more than one chunk of rows; more than two (amx: by chunk)
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for path in paths:
            cases[f"bf16_gemm {path} x{rows}"] = lambda x=x, p=path: native.bf16_gemm(x, packed, n, None, p)
        if native.qblock_usable():
            t = qb.BlockTensor(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                               (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.002).half(),
                               (torch.randn(n, k // 32, generator=gen) * 0.05).half(), 4, 32, 0)
            blocks = qb.BlockWeight(t)
            cases[f"qblock_linear x{rows}"] = lambda x=x, b=blocks: native.qblock_linear(x, b.native, None)
            if native.qblock_amx_usable():
                cases[f"qblock_linear_amx x{rows}"] = lambda x=x, b=blocks: native.qblock_linear_amx(x, b.native, None)
    tokens, e = 300, 576
    xs = torch.randn(tokens, e, generator=gen).bfloat16()
    res = torch.randn(tokens, e, generator=gen).bfloat16()
    norm_w = torch.rand(e, generator=gen).bfloat16()

    def norm() -> torch.Tensor:
        x, r = xs.clone(), res.clone()
        native.add_rms_norm_(x, r, norm_w, 1e-5)
        return torch.cat([x, r])

    cases["add_rms_norm_"] = norm
    gate_up = torch.randn(tokens, 2 * 1536, generator=gen).bfloat16()
    cases["silu_mul"] = lambda: native.silu_mul(gate_up)
    qk = torch.randn(tokens, 12, 64, generator=gen).bfloat16()
    cos, sin = torch.randn(tokens, 32, generator=gen).bfloat16(), torch.randn(tokens, 32, generator=gen).bfloat16()

    def rotary() -> torch.Tensor:
        x = qk.clone()
        native.rotary_(x, cos, sin)
        return x

    cases["rotary_"] = rotary
    # decode attention: 5 requests of 40-700 tokens over a bf16 cache of 16-token blocks in shuffled order
    lens = torch.tensor([40, 700, 129, 333, 1], dtype=torch.int64)
    per = 44
    cache = torch.randn(2, 5 * per, 16, 3, 64, generator=gen).bfloat16()
    tables = torch.randperm(5 * per, generator=gen).view(5, per)
    q = torch.randn(5, 9, 64, generator=gen).bfloat16()
    for splits in (1, 2):  # pinned: the automatic count follows the threads (test_paged_decode.py)
        cases[f"paged_decode in {splits}"] = lambda s=splits: native.paged_decode(q, cache, tables, lens, 0.125, None,
                                                                                  None, s)
    return cases


@pytest.mark.parametrize("threads", [1, 3])
def test_every_kernel_gives_the_same_bits_on_any_number_of_threads(threads: int) -> None:
    cases = _cases()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = {name: run() for name, run in cases.items()}
        torch.set_num_threads(threads)
        got = {name: run() for name, run in cases.items()}
    finally:
        torch.set_num_threads(before)
    different = [name for name in cases if not torch.equal(expected[name], got[name])]
    assert not different, f"on {threads} threads these changed: {different}"
