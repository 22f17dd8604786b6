"""Figure (c) of the KV-reuse issue: summarising a ~1,500-token document with n-gram speculation
on vs off, same run, embedded SmolLM2, fp32, greedy unless the sampling flags say otherwise.

    .venv/bin/python scripts/bench_spec.py [--num-requests 1] [--output-len 128] [--temperature 0.7 --top-p 0.9]
"""

from __future__ import annotations

import argparse
import pathlib

from llmserve import EngineConfig, pipeline
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.sampling import add_sampling_flags, knobs_from_args
from llmserve.bench.throughput import run_engine_throughput


def document(tokenizer, num_tokens: int) -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text() for p in [root / "README.md", root / "BENCHMARKS.md"])
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    add_sampling_flags(ap)
    args = ap.parse_args()
    sampling = knobs_from_args(args)
    for method in (None, "ngram"):
        config = EngineConfig(dtype="float32", speculative_method=method)
        with pipeline(backend_config=config) as pipe:
            doc = document(pipe.tokenizer, args.doc_tokens)
            msgs = [{"role": "user", "content": "Summarise this document, quoting its key sentences.\n\n" + doc}]
            ids = pipe.tokenizer.encode(pipe.chat_template.messages_to_prompt(msgs), add_special_tokens=False)
            run_engine_throughput(pipe.engine, [BenchRequest(ids[:32], 4)], ignore_eos=True)  # warm-up
            reqs = [BenchRequest(ids, args.output_len) for _ in range(args.num_requests)]
            r = run_engine_throughput(pipe.engine, reqs, ignore_eos=False, sampling=sampling)
            acc = "" if r.spec_acceptance_rate is None else (
                f", acceptance {100 * r.spec_acceptance_rate:.0f}%, {r.spec_tokens_per_step:.2f} tokens/verify step")
            print(f"speculation={method}, {sampling.describe()}: prompt {len(ids)} tokens x {args.num_requests}, {r.output_tokens} output "
                  f"tokens in {r.elapsed_s:.2f} s: {r.output_tokens_per_s:.1f} output tok/s{acc}")


if __name__ == "__main__":
    main()
