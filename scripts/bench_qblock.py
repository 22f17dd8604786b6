"""qblock_linear (kernels/cpu/qblock_gemm.cpp) over SmolLM2-135M-shaped decoder linears, one form of block-quantized
weights after another, against the bf16 packed GEMM (bf16_gemm's amx kernel where it runs, else dot, else fma) on the same shapes.

Each layer: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 (out x in), 30 layers. The weights are random
codes in each GGUF type's kernel form ((bits, group, scale dtype, mins) as models/gguf_blocks.py reads the type;
K-quants need 256-column rows in a real file, which 576 is not, but the kernel form does not). A round runs every
form's full pass once, forms interleaved, so drift on a shared machine hits them alike; the table keeps each form's
best round.

    .venv/bin/python scripts/bench_qblock.py [--rounds 20] [--layers 30] [--rows 1 64] [--path auto|vnni|fma]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from llmserve.kernels import native
from llmserve.layers.quant_blocks import BlockTensor, BlockWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
# name -> (bits, group, scale dtype, mins, zero): the forms gguf_blocks gives each type
FORMS = {
    "Q4_1": (4, 32, torch.float16, True, 0),
    "Q4_K": (4, 32, torch.float32, True, 0),
    "Q5_K": (5, 32, torch.float32, True, 0),
    "Q6_K": (6, 16, torch.float32, False, 32),
    "Q8_0": (8, 32, torch.float16, False, 128),
}


def block_weight(form: str, n: int, k: int, gen: torch.Generator) -> BlockWeight:
    bits, group, dtype, mins, zero = FORMS[form]
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).to(dtype)
    m = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype) if mins else None
    return BlockWeight(BlockTensor(codes, scales, m, bits, group, zero))


Inputs = dict[int, torch.Tensor]  # columns -> x [M, columns] bf16, contiguous (a slice would be copied per call)
Pass = Callable[[Inputs], None]


def passes(layers: int, vnni: bool | None, kernel: str) -> dict[str, tuple[Pass, int]]:
    """form -> (one pass of every linear, bytes of its weights)."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, tuple[Pass, int]] = {}
    for form in FORMS:
        weights = [block_weight(form, n, k, gen) for _ in range(layers) for n, k in SHAPES]
        out[form] = (_qblock_pass(weights, vnni), sum(w.nbytes for w in weights))
    packed = [(native.bf16_pack(torch.randn(n, k, generator=gen).bfloat16()), n, k)
              for _ in range(layers) for n, k in SHAPES]
    out["bf16"] = (_bf16_pass(packed, kernel), sum(p.nbytes for p, _, _ in packed))
    return out


def _qblock_pass(weights: list[BlockWeight], vnni: bool | None) -> Pass:
    def run(xs: Inputs) -> None:
        for w in weights:
            native.qblock_linear(xs[w.k], w.native, None, vnni)
    return run


def _bf16_pass(packed: list[tuple[torch.Tensor, int, int]], kernel: str) -> Pass:
    def run(xs: Inputs) -> None:
        for p, n, k in packed:
            native.bf16_gemm(xs[k], p, n, None, kernel)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64], help="rows of x (M)")
    ap.add_argument("--path", choices=["auto", "vnni", "fma"], default="auto",
                    help="qblock_linear's int8-activation (VNNI) or fp32-FMA path")
    args = ap.parse_args()
    if not (native.qblock_usable() and native.packed_gemm_usable()):
        raise SystemExit("needs the native kernels on a CPU with AVX-512")
    vnni = {"auto": None, "vnni": True, "fma": False}[args.path]
    kernel = "amx" if native.amx_usable() else "dot" if native.bf16_dot_usable() else "fma"
    runs = passes(args.layers, vnni, kernel)
    x = {m: {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES}} for m in args.rows}
    for run, _ in runs.values():  # warm-up: first-touch pages, thread pool
        for m in args.rows:
            run(x[m])
    best = {(form, m): float("inf") for form in runs for m in args.rows}
    for _ in range(args.rounds):
        for m in args.rows:
            for form, (run, _) in runs.items():
                t0 = time.perf_counter()
                run(x[m])
                best[form, m] = min(best[form, m], time.perf_counter() - t0)
    params = args.layers * sum(n * k for n, k in SHAPES)
    path = "auto (vnni)" if vnni is None and native.qblock_vnni_usable() else args.path
    print(f"{args.layers} layers, {params / 1e6:.1f}M weights, {torch.get_num_threads()} threads, best of "
          f"{args.rounds} rounds; qblock path {path}; bf16 kernel {kernel}")
    header = f"{'form':6} {'bits/w':>7} {'MB':>7}" + "".join(f" {f'M={m} ms':>10} {'x bf16':>7}" for m in args.rows)
    print(header)
    for form, (_, nbytes) in runs.items():
        cells = "".join(f" {best[form, m] * 1e3:10.2f} {best[form, m] / best['bf16', m]:7.2f}" for m in args.rows)
        print(f"{form:6} {8 * nbytes / params:7.2f} {nbytes / 2**20:7.1f}{cells}")


if __name__ == "__main__":
    main()
