"""Which thread computes a kernel's unit of work must not change what it computes: every kernel gives the same bits on 1,
2 or 3 threads (3 on a 2-core machine: more threads than cores, as when another process holds one), so a step's tokens
do not depend on torch's thread count. The kernels hand their units out from a shared queue (kernels/cpu/work_queue.h),
so which thread takes which unit also changes from call to call: each case runs several times, and in equal contiguous
shares (LLMSERVE_WORK_QUEUE=0) in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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
    w8a8: tuple[torch.Tensor, ...] = ()
    if native.w8a8_usable():
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        w8a8 = (native.w8a8_pack(qweight), torch.rand(n, generator=gen) * 0.01, qweight.int().sum(dim=1, dtype=torch.int32))
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
            if native.qblock_amx_dot_usable() and rows < 40:
                cases[f"qblock_linear_amx_dot x{rows}"] = lambda x=x, b=blocks: native.qblock_linear_amx_dot(
                    x, b.native, None)
        if native.w8a8_usable():
            for amx_rows in (0, 16) if native.w8a8_amx_usable() else (0,):  # VNNI alone; the tiles from 16 rows
                cases[f"w8a8_linear x{rows} amx_rows={amx_rows}"] = (
                    lambda x=x, a=amx_rows: native.w8a8_linear(x, *w8a8, None, a))
            if native.int8w_a16_usable():  # weight-only int8, 16-bit x: vpdpwssd alone; the tiles from 16 rows
                for amx_rows in (0, 16) if native.w8a8_amx_usable() else (0,):
                    cases[f"int8w_gemm x{rows} amx_rows={amx_rows}"] = (
                        lambda x=x, a=amx_rows: native.int8w_gemm(x, w8a8[0], w8a8[1], None, amx_rows=a))
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
    dots = (False, True) if native.bf16_dot_usable() else (False,)
    for splits in (1, 2):  # pinned: the automatic count follows the threads (test_paged_decode.py)
        for dot in dots:
            cases[f"paged_decode in {splits} dot={dot}"] = (
                lambda s=splits, d=dot: native.paged_decode(q, cache, tables, lens, 0.125, None, None, s, d))
    # 24 requests: enough that a request's kv heads are one run of the queue
    lens24 = torch.randint(1, 700, (24,), generator=gen, dtype=torch.int64)
    cache24 = torch.randn(2, 24 * per, 16, 3, 64, generator=gen).bfloat16()
    tables24 = torch.randperm(24 * per, generator=gen).view(24, per)
    q24 = torch.randn(24, 9, 64, generator=gen).bfloat16()
    for dot in dots:
        cases[f"paged_decode x24 dot={dot}"] = (
            lambda d=dot: native.paged_decode(q24, cache24, tables24, lens24, 0.125, None, None, 1, d))
    return cases


@pytest.mark.parametrize("threads", [1, 3])
def test_every_kernel_gives_the_same_bits_on_any_number_of_threads(threads: int) -> None:
    cases = _cases()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = {name: run() for name, run in cases.items()}
        torch.set_num_threads(threads)
        different = sorted({name for _ in range(3) for name, run in cases.items()
                            if not torch.equal(expected[name], run())})
    finally:
        torch.set_num_threads(before)
    assert not different, f"on {threads} threads these changed: {different}"


def test_equal_shares_give_the_queues_bits(tmp_path: Path) -> None:
    """LLMSERVE_WORK_QUEUE=0 (every thread one contiguous share, the split before the queue) computes the same bits."""
    assert native.work_queue_enabled()
    out = tmp_path / "shares.pt"
    script = ("import sys, torch; from llmserve.kernels import native; native.load(); "
              "from tests.kernels.test_thread_count import _cases; torch.set_num_threads(2); "
              "assert not native.work_queue_enabled(); "
              "torch.save({n: r() for n, r in _cases().items()}, sys.argv[1])")
    env = {**os.environ, "LLMSERVE_WORK_QUEUE": "0"}
    subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True, timeout=300,
                   cwd=Path(__file__).resolve().parents[2])
    shares = torch.load(out)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        different = [name for name, run in _cases().items() if not torch.equal(shares[name], run())]
    finally:
        torch.set_num_threads(before)
    assert not different, f"equal shares changed: {different}"


@pytest.mark.parametrize(("total", "run", "threads"), [(1, 1, 2), (7, 1, 2), (50, 3, 2), (12, 12, 2), (40, 4, 3),
                                                        (9, 2, 1)])
def test_the_queue_hands_out_every_unit_once_in_runs_and_names_the_next(total: int, run: int, threads: int) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        trace = native.work_queue_trace(total, run, 50).tolist()
    finally:
        torch.set_num_threads(before)
    assert all(t >= 0 for t, _, _ in trace), "a unit never ran"
    order: dict[int, list[int]] = {}
    for unit, (thread, place, _) in enumerate(trace):
        order.setdefault(thread, []).append((place, unit))
    for thread, placed in order.items():
        units = [u for _, u in sorted(placed)]
        assert [p for p, _ in sorted(placed)] == list(range(len(units)))  # each place once: no unit ran twice here
        for u, nxt in zip(units, units[1:] + [-1]):  # what the cursor called upcoming is what the thread ran next
            assert trace[u][2] == nxt, (thread, u, trace[u][2], nxt)
        for u, nxt in zip(units, units[1:]):  # within a run, one unit after the other on one thread
            if nxt // run == u // run:
                assert nxt == u + 1
        runs = [u // run for u in units]
        assert all(runs.count(r) == min(run, total - r * run) for r in set(runs)), "a run was split"
