"""Where a CUDA engine step's time goes: torch.profiler over decode steps of a batch, kernels and host ops.

    python scripts/cuda_profile.py MODEL_DIR [--num-requests 64] [--load-format dummy] [--steps 8]

Adds the requests, runs them past prefill, profiles --steps decode steps, prints the top CUDA kernels and the
top host-side ops, and the mean wall time of an unprofiled decode step.
"""

from __future__ import annotations

import argparse
import time

import torch

from llmserve import EngineConfig, GenerationConfig, pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    config = EngineConfig(dtype="bfloat16", device="cuda", load_format=args.load_format)
    with pipeline(args.model, backend_config=config) as pipe:
        engine = pipe.engine
        gen = GenerationConfig(temperature=0.0, max_new_tokens=1024, ignore_eos=True)
        for i in range(args.num_requests):
            ids = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
            engine.add_request(f"r{i}", ids, gen)
        while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        n = 20
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        print(f"decode step, {args.num_requests} requests: {1000 * (time.perf_counter() - start) / n:.2f} ms "
              f"(unprofiled mean of {n})")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
