"""Time one sampling step of 64 rows over SmolLM2's 49,152-token vocabulary for the common parameter sets.

    .venv/bin/python scripts/bench_sampler.py
"""

from __future__ import annotations

import time

import torch

from llmserve.sampling import Sampler, SamplingBatch, SamplingParams, SequenceState

CASES = (
    ("top_k 50, temperature 0.8 (GenerationConfig's default)", SamplingParams(temperature=0.8, top_k=50)),
    ("top_p 0.9", SamplingParams(top_p=0.9)),
    ("temperature 1 only (OpenAI's default)", SamplingParams()),
    ("greedy", SamplingParams(temperature=0.0)),
)


def main(rows: int = 64, vocab: int = 49152, iters: int = 10) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    for name, params in CASES:
        batch = SamplingBatch.build([SequenceState(params, [1], []) for _ in range(rows)], vocab, torch.device("cpu"))
        sampler = Sampler(seed=0)
        copies = [logits.clone() for _ in range(iters + 3)]  # the sampler works in place
        for c in copies[:3]:
            sampler(c, batch)
        start = time.perf_counter()
        for c in copies[3:]:
            sampler(c, batch)
        print(f"{name}: {(time.perf_counter() - start) / iters * 1e3:.1f} ms per step, {rows} rows x {vocab}")


if __name__ == "__main__":
    main()
