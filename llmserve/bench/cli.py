"""`llmserve bench throughput` (offline, through the engine; optional transformers baseline)."""

from __future__ import annotations

import argparse
import json
import sys

from llmserve.bench.datasets import BenchRequest, sharegpt, synthetic_chat
from llmserve.bench.throughput import ThroughputResult, matmul_peak_gflops, run_engine_throughput


def add_bench_parser(sub: argparse._SubParsersAction, add_engine_flags) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    tp = kinds.add_parser("throughput", help="offline throughput through the engine")
    tp.add_argument("model", nargs="?", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    tp.add_argument("--dataset", help="ShareGPT-format JSON file")
    tp.add_argument("--synthetic", action="store_true", help="synthetic chat prompts (default if no --dataset)")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", default="36:390", help="prompt tokens, N or MIN:MAX (synthetic)")
    tp.add_argument("--output-len", type=int, default=None, help="output tokens per request (synthetic default 128)")
    tp.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    tp.add_argument("--baseline", choices=["transformers"], help="run the same workload through this, same run")
    tp.add_argument("--baseline-batch-size", type=int, default=32)
    tp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_engine_flags(tp)
    tp.set_defaults(func=_cmd_throughput)


def _input_range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def _cmd_throughput(args: argparse.Namespace) -> int:
    from llmserve.api import pipeline
    from llmserve.cli import dataclass_from_args
    from llmserve.config import EngineConfig

    with pipeline(args.model, backend_config=dataclass_from_args(EngineConfig, args), log_level=args.log_level) as pipe:
        engine = pipe.engine
        requests = _workload(args, pipe)
        run_engine_throughput(engine, [BenchRequest(r.prompt_token_ids[:16], 4) for r in requests[:4]],
                              ignore_eos=True)  # warm-up: first-call allocations and lazy init
        results = [run_engine_throughput(engine, requests, args.ignore_eos)]
        peak = matmul_peak_gflops(engine.loaded.dtype, engine.loaded.device)
        model_dir, dtype, device = engine.loaded.model_dir, engine.loaded.dtype, engine.loaded.device
        pad = pipe.tokenizer.pad_token_id if pipe.tokenizer.pad_token_id is not None else 0
    if args.baseline == "transformers":
        from llmserve.bench.baseline import run_transformers_throughput

        results.append(run_transformers_throughput(model_dir, dtype, device, requests, args.baseline_batch_size,
                                                   pad))
    _report(results, peak, str(dtype).removeprefix("torch."), args.json)
    return 0


def _workload(args: argparse.Namespace, pipe) -> list[BenchRequest]:
    if args.dataset:
        return sharegpt(args.dataset, pipe.tokenizer, pipe.chat_template, args.num_prompts, args.output_len,
                        pipe.engine.session_len)
    return synthetic_chat(pipe.tokenizer, pipe.chat_template, args.num_prompts, _input_range(args.input_len),
                          args.output_len or 128)


def _report(results: list[ThroughputResult], peak_gflops: float, dtype: str, as_json: bool) -> None:
    if as_json:
        json.dump({"dtype": dtype, "matmul_peak_gflops": peak_gflops, "results": [r.as_dict() for r in results],
                   "ratio_vs_baseline": _ratio(results)}, sys.stdout, indent=2)
        print()
        return
    r0 = results[0]
    print(f"workload: {r0.num_requests} requests, {r0.prompt_tokens} prompt tokens, {r0.output_tokens} output "
          f"tokens, {r0.gflop:.0f} GFLOP; dtype {dtype}; matmul peak here {peak_gflops:.0f} GFLOP/s")
    print(f"{'engine':<26}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'elapsed s':>11}{'% peak':>8}"
          f"{'hit rate':>10}{'peak RSS MB':>13}")
    for r in results:
        print(f"{r.engine:<26}{r.requests_per_s:>8.2f}{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>13.1f}"
              f"{r.elapsed_s:>11.2f}{100 * r.achieved_gflops / peak_gflops:>7.0f}%"
              f"{100 * r.prefix_cache_hit_rate:>9.0f}%{r.peak_rss_mb:>13.0f}")
    if _ratio(results):
        print(f"llmserve / {results[1].engine}: {_ratio(results):.2f}x output tokens/s")


def _ratio(results: list[ThroughputResult]) -> float | None:
    return results[0].output_tokens_per_s / results[1].output_tokens_per_s if len(results) > 1 else None
