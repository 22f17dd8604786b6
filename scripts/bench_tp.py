"""Tensor-parallel figures for BENCHMARKS.md: tp=2 against tp=1 in one run, on a Llama-3.2-1B-shaped model with random
weights (load_format=dummy; scripts/make_shape_model.py writes its config under ~/.cache/llmserve/bench).

    .venv/bin/python scripts/bench_tp.py [--tp 1 2] [--num-prompts 16] [--output-len 64]

Prints, per tp: output tok/s of --num-prompts synthetic chat requests (36-390 prompt tokens), single-request decode
tok/s and TTFT (36-token prompt), and the share of rank 0's forward time spent in all-reduces (waiting for the other
ranks included). On a CPU the ranks split the cores, so a 2-core machine gives each rank one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from llmserve import EngineConfig, GenerationConfig
from llmserve.api import pipeline
from llmserve.bench.datasets import synthetic_chat
from llmserve.bench.throughput import run_engine_throughput

SHAPE = "llama-3.2-1b"


def model_dir() -> str:
    d = os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "bench", SHAPE)
    if not os.path.isfile(os.path.join(d, "config.json")):
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "make_shape_model.py"), SHAPE, d],
                       check=True)
    return d


class ReduceTimer:
    """Time spent in the all-reduces of rank 0's layers."""

    def __init__(self) -> None:
        import llmserve.layers.embedding as embedding
        import llmserve.layers.linear as linear

        self.seconds = 0.0
        self.modules = (linear, embedding)
        self.original = linear.all_reduce_

        def timed(x: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            out = self.original(x)
            self.seconds += time.perf_counter() - t
            return out

        for m in self.modules:
            m.all_reduce_ = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    d = model_dir()
    timer = ReduceTimer()
    for tp in args.tp:
        with pipeline(d, backend_config=EngineConfig(load_format="dummy", tp=tp, dtype="bfloat16")) as pipe:
            requests = synthetic_chat(pipe.tokenizer, pipe.chat_template, args.num_prompts, (36, 390), args.output_len)
            run_engine_throughput(pipe.engine, requests[:2], ignore_eos=True)  # warm-up
            timer.seconds = 0.0
            r = run_engine_throughput(pipe.engine, requests, ignore_eos=True)
            share = timer.seconds / r.elapsed_s
            gen = GenerationConfig(temperature=0.0, max_new_tokens=64, ignore_eos=True)
            prompt = {"input_ids": requests[0].prompt_token_ids[:36]}
            t0 = time.perf_counter()
            first = None
            n = 0
            for out in pipe.stream_infer(prompt, gen, do_preprocess=False):
                first = first or time.perf_counter()
                n += len(out.token_ids)
            t1 = time.perf_counter()
            print(f"tp={tp}: {r.output_tokens_per_s:7.1f} output tok/s ({args.num_prompts} requests), all-reduce "
                  f"{100 * share:4.1f}% of the run; single request: decode {(n - 1) / (t1 - first):6.1f} tok/s, "
                  f"TTFT {1000 * (first - t0):6.1f} ms; peak RSS (rank 0) {r.peak_rss_mb:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
