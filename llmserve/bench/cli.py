"""`llmserve bench throughput` (offline, through the engine; optional transformers baseline),
`llmserve bench latency` (one request at a time through the engine) and `llmserve bench serving`
(streaming clients against any OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from llmserve.bench.sampling import SamplingKnobs, add_sampling_flags, knobs_from_args
from llmserve.errors import InvalidRequestError

# The bench modules import torch and transformers (~2-3 s): every `llmserve` command builds this parser, so they are
# imported by the commands that run them, not here.
if TYPE_CHECKING:
    import torch

    from llmserve.bench.datasets import BenchRequest
    from llmserve.bench.throughput import ThroughputResult
    from llmserve.kernels.choice import ChoiceTable


def add_bench_parser(sub: argparse._SubParsersAction, add_engine_flags) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serving")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    tp = kinds.add_parser("throughput", help="offline throughput through the engine")
    tp.add_argument("model", nargs="?", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    tp.add_argument("--dataset", help="ShareGPT-format JSON file")
    tp.add_argument("--synthetic", action="store_true", help="synthetic chat prompts (default if no --dataset)")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", default="36:390", help="prompt tokens, N or MIN:MAX (synthetic)")
    tp.add_argument("--output-len", type=int, default=None, help="output tokens per request (synthetic default 128)")
    tp.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    tp.add_argument("--baseline", choices=["transformers", "unconstrained"],
                    help="run the same workload through this, same run: transformers' generate, or (with "
                         "--structured) this engine without the constraint, right after the constrained run")
    tp.add_argument("--baseline-batch-size", type=int, default=32)
    tp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    tp.add_argument("--profile-steps", action="store_true",
                    help="time each part of the engine's steps (schedule, inputs, linear, attention, LM head, "
                         "sampling, outputs) and print the split; the steps run synchronously (no "
                         "--async-scheduling unless given), since each timed part waits for the device")
    add_sampling_flags(tp)
    add_structured_flag(tp)
    add_engine_flags(tp)
    tp.set_defaults(func=_cmd_throughput)
    _add_latency_parser(kinds, add_engine_flags)
    _add_serving_parser(kinds)


def add_structured_flag(parser: argparse.ArgumentParser) -> None:
    from llmserve.bench.structured import KINDS

    parser.add_argument("--structured", choices=KINDS,
                        help="every request constrains its output: a JSON schema, a regex or a choice "
                             "(llmserve/bench/structured.py)")


def _add_latency_parser(kinds: argparse._SubParsersAction, add_engine_flags) -> None:
    lat = kinds.add_parser("latency", help="one request at a time through the engine: TTFT and decode tokens/s")
    lat.add_argument("model", nargs="?", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    lat.add_argument("--input-len", type=int, default=36, help="prompt tokens (random token ids, new each iteration)")
    lat.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    lat.add_argument("--num-iters", type=int, default=5, help="measured requests")
    lat.add_argument("--warmup", type=int, default=1, help="requests run first and not measured")
    lat.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                     help="always generate --output-len tokens (default: yes, so decode rates compare)")
    lat.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_sampling_flags(lat)
    add_engine_flags(lat)
    lat.set_defaults(func=_cmd_latency)


def _add_serving_parser(kinds: argparse._SubParsersAction) -> None:
    sv = kinds.add_parser("serving", help="streaming clients against an OpenAI-compatible server: TTFT, TPOT, "
                                          "ITL, end-to-end latency and throughput")
    sv.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    sv.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    sv.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                    help="/v1/chat/completions (default) or /v1/completions")
    sv.add_argument("--tokenizer", help="tokenizer that sizes the prompts: a model directory, .gguf file or hub "
                                        "id; only its tokenizer is loaded (default: the embedded SmolLM2's)")
    sv.add_argument("--dataset", help="ShareGPT-format JSON file")
    sv.add_argument("--synthetic", action="store_true", help="synthetic chat prompts (default if no --dataset)")
    sv.add_argument("--num-prompts", type=int, default=64)
    sv.add_argument("--input-len", default="36:390", help="prompt tokens, N or MIN:MAX (synthetic)")
    sv.add_argument("--output-len", type=int, default=None,
                    help="max_tokens of each request (synthetic default 128; dataset default: the reply's length)")
    sv.add_argument("--max-len", type=int, default=None,
                    help="skip dataset conversations longer than this (default: the server's max_model_len)")
    load = sv.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight at most (default: all at once)")
    load.add_argument("--request-rate", type=float, help="requests/s, Poisson arrivals (seeded by --seed)")
    sv.add_argument("--seed", type=int, default=0, help="of the workload and the arrival times")
    sv.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's and our extra field)")
    add_structured_flag(sv)
    sv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as a bearer token (default: $OPENAI_API_KEY)")
    sv.add_argument("--timeout", type=float, default=600.0, help="seconds to wait on a connect or read")
    sv.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_sampling_flags(sv)
    sv.set_defaults(func=_cmd_serving)


def _input_range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def _cmd_throughput(args: argparse.Namespace) -> int:
    from llmserve.api import pipeline
    from llmserve.bench.datasets import BenchRequest
    from llmserve.bench.throughput import matmul_peak_gflops, run_engine_throughput
    from llmserve.cli import dataclass_from_args
    from llmserve.config import EngineConfig

    sampling = knobs_from_args(args)
    if args.structured and args.baseline == "transformers":
        raise InvalidRequestError("--structured has no transformers baseline (its generate takes no grammar): "
                                  "--baseline unconstrained runs the same workload without the constraint")
    if args.baseline == "unconstrained" and not args.structured:
        raise InvalidRequestError("--baseline unconstrained is the same workload without --structured's constraint: "
                                  "give --structured json-schema|regex|choice")
    config = dataclass_from_args(EngineConfig, args)
    if args.profile_steps and config.async_scheduling is None:  # the timers wait for the device at each part
        config = dataclasses.replace(config, async_scheduling=False)
    with pipeline(args.model, backend_config=config, log_level=args.log_level) as pipe:
        engine = pipe.engine
        requests = _workload(args, pipe)
        run_engine_throughput(engine, [BenchRequest(r.prompt_token_ids[:16], 4) for r in requests[:4]],
                              ignore_eos=True)  # warm-up: first-call allocations and lazy init
        profile = None
        if args.profile_steps:
            from llmserve.bench.step_profile import instrument

            profile = instrument(engine)
        try:
            results = [run_engine_throughput(engine, requests, args.ignore_eos, sampling, args.structured)]
        finally:
            if profile is not None:
                profile.restore()
        grammar = None
        if args.structured:
            results[0] = dataclasses.replace(results[0], engine=f"llmserve, {args.structured}")
            grammar = _grammar_compile_figures(engine, args.structured)
        if args.baseline == "unconstrained":
            engine.kv.reset_prefix_cache()  # the same prompts again: no request may reuse the first run's KV
            results.append(dataclasses.replace(run_engine_throughput(engine, requests, args.ignore_eos, sampling),
                                               engine="llmserve, unconstrained"))
        quantization = engine.config.quantization
        peak_dtype, peak_kind = peak_matmul_kind(engine.loaded.dtype, engine.loaded.device, quantization)
        cfg, model_dir, dtype, device = (engine.loaded.hf_config, engine.loaded.model_dir, engine.loaded.dtype,
                                         engine.loaded.device)
        # a model-shaped matmul (the MLP's up projection): 256 rows on CPU, 4096 on a GPU, which needs that many to fill
        peak = matmul_peak_gflops(peak_dtype, device, m=4096 if device.type == "cuda" else 256, k=cfg.hidden_size,
                                  n=cfg.intermediate_size, kind=peak_kind)
        pad = pipe.tokenizer.pad_token_id if pipe.tokenizer.pad_token_id is not None else 0
        dummy = engine.config.load_format == "dummy"
        choices = engine.runner.kernel_choices
        overlapped = engine.async_scheduling
        del engine  # the pipeline's close drops the last other reference: weights and KV pool are freed
    if args.baseline == "transformers":
        from llmserve.bench.baseline import run_transformers_throughput

        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        results.append(run_transformers_throughput(model_dir, dtype, device, requests, args.baseline_batch_size,
                                                   pad, dummy=dummy, sampling=sampling))
    precision = str(dtype).removeprefix("torch.") + (f", {quantization}" if quantization else "")
    _report(results, peak, precision, args.json, profile, peak_kind, sampling, choices, grammar, overlapped)
    return 0


def _grammar_compile_figures(engine, kind: str) -> dict[str, float]:
    """The constraint's compile time: cold (what the run's first request paid) and a cached lookup (what every later
    request pays), in ms."""
    from llmserve.bench.structured import response_format

    stats = engine.grammars.stats
    start = time.perf_counter()
    engine.grammars.compile(response_format(kind))
    return {"compiled": stats.compiled, "cold_ms": 1e3 * stats.last_seconds,
            "cached_ms": 1e3 * (time.perf_counter() - start), "cache_hits": stats.cache_hits}


def peak_matmul_kind(dtype: torch.dtype, device: torch.device,
                     quantization: str | None = None) -> tuple[torch.dtype, str]:
    """Which matmul the run's FLOPs are read against: the one its large matmuls run.
    - w8a8: the int8 matmul.
    - Weight-only int8 on a CPU where int8w_gemm rounds x to int16 (VNNI): that GEMM itself (INT16_INT8_MATMUL),
      whose products run at up to twice the fp32 FMA rate (read against the fp32 peak the fraction passed 100%).
    - bf16 on CPU: the fastest bf16 matmul this machine runs (BF16_MATMUL: the best of torch's and the packed
      kernels' paths; on a Xeon without AMX torch's bf16 matmul ran at half the packed FMA path's speed, and read
      against it the fraction passed 100%).
    - fp32 on CPU: the fastest fp32 matmul this machine runs (FP32_MATMUL: torch's, oneDNN's blocked and the packed
      fp32_gemm; on an AVX2 Zen 3 torch's measured 113 GFLOP/s where the packed kernel reached 140-160)."""
    import torch

    from llmserve.bench.throughput import BF16_MATMUL, FP32_MATMUL, INT8_MATMUL, INT16_INT8_MATMUL

    if quantization == "w8a8":
        return dtype, INT8_MATMUL
    if quantization == "int8" and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        from llmserve.kernels import native

        if native.int8w_default_a16():  # x quantized to int16 (VNNI, or vpmaddwd on AVX2)
            return dtype, INT16_INT8_MATMUL
    if dtype == torch.bfloat16 and device.type == "cpu":
        return dtype, BF16_MATMUL
    if dtype == torch.float32 and device.type == "cpu":
        return dtype, FP32_MATMUL
    return dtype, "matmul"


def _workload(args: argparse.Namespace, pipe) -> list[BenchRequest]:
    from llmserve.bench.datasets import sharegpt, synthetic_chat

    if args.dataset:
        return sharegpt(args.dataset, pipe.tokenizer, pipe.chat_template, args.num_prompts, args.output_len,
                        pipe.engine.session_len)
    return synthetic_chat(pipe.tokenizer, pipe.chat_template, args.num_prompts, _input_range(args.input_len),
                          args.output_len or 128)


def _report(results: list[ThroughputResult], peak_gflops: float, dtype: str, as_json: bool, profile=None,
            peak_kind: str = "matmul", sampling: SamplingKnobs = SamplingKnobs(),
            choices: ChoiceTable | None = None, grammar: dict[str, float] | None = None,
            async_scheduling: bool = False) -> None:
    """`peak_kind`: what the peak was measured on (the int8 matmul for w8a8, whose figure is in GOP/s). `choices`: the
    kernels the run's bf16 matmuls took (kernels/choice.py). `async_scheduling`: whether the engine ran it."""
    if as_json:
        out = {"dtype": dtype, "sampling": sampling.describe(), "matmul_peak_gflops": peak_gflops,
               "matmul_peak_kind": peak_kind, "kernel_choice": None if choices is None else choices.as_dict(),
               "async_scheduling": async_scheduling,
               "grammar_compile": grammar,
               "results": [r.as_dict() for r in results], "ratio_vs_baseline": _ratio(results)}
        if profile is not None:
            out["step_profile"] = profile.as_dict()
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    r0 = results[0]
    print(f"workload: {r0.num_requests} requests, {r0.prompt_tokens} prompt tokens, {r0.output_tokens} output "
          f"tokens, {r0.gflop:.0f} GFLOP; dtype {dtype}; {sampling.describe()}; {peak_kind} peak here "
          f"{peak_gflops:.0f} GFLOP/s")
    print(f"{'engine':<26}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'elapsed s':>11}{'% peak':>8}"
          f"{'hit rate':>10}{'peak RSS MB':>13}")
    for r in results:
        print(f"{r.engine:<26}{r.requests_per_s:>8.2f}{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>13.1f}"
              f"{r.elapsed_s:>11.2f}{100 * r.achieved_gflops / peak_gflops:>7.0f}%"
              f"{100 * r.prefix_cache_hit_rate:>9.0f}%{r.peak_rss_mb:>13.0f}"
              + (f"  (GPU peak {r.peak_device_mb:.0f} MB)" if r.peak_device_mb is not None else ""))
    if choices is not None:
        print(f"kernel choice: {choices.describe()}")
    if async_scheduling:
        print("async scheduling: on")
    if grammar is not None:
        print(f"grammar compile: {grammar['cold_ms']:.1f} ms cold, {grammar['cached_ms']:.3f} ms cached "
              f"({grammar['compiled']:.0f} compiled, {grammar['cache_hits']:.0f} cache hits in the run)")
    if r0.spec_acceptance_rate is not None:
        print(f"speculative decoding: {100 * r0.spec_acceptance_rate:.0f}% of draft tokens accepted, "
              f"{r0.spec_tokens_per_step:.2f} tokens per verify step")
    if _ratio(results):
        print(f"llmserve / {results[1].engine}: {_ratio(results):.2f}x output tokens/s")
    if profile is not None:
        from llmserve.bench.step_profile import format_profile

        print(format_profile(profile))


def _ratio(results: list[ThroughputResult]) -> float | None:
    return results[0].output_tokens_per_s / results[1].output_tokens_per_s if len(results) > 1 else None


def _cmd_latency(args: argparse.Namespace) -> int:
    from llmserve.api import pipeline
    from llmserve.bench.latency import LatencyPlan, format_latency, run_latency
    from llmserve.cli import dataclass_from_args
    from llmserve.config import EngineConfig

    plan = LatencyPlan(input_len=args.input_len, output_len=args.output_len, num_iters=args.num_iters,
                       warmup=args.warmup, ignore_eos=args.ignore_eos, sampling=knobs_from_args(args))
    start = time.perf_counter()
    with pipeline(args.model, backend_config=dataclass_from_args(EngineConfig, args), log_level=args.log_level) as pipe:
        result = run_latency(pipe.engine, plan, load_s=time.perf_counter() - start)
    if args.json:
        json.dump(result.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(format_latency(result))
    return 0


def _cmd_serving(args: argparse.Namespace) -> int:
    from llmserve.bench import serving
    from llmserve.bench.datasets import sharegpt, synthetic_chat
    from llmserve.chat_template import ChatTemplate

    if args.num_prompts < 1 or (args.concurrency is not None and args.concurrency < 1) or (
            args.request_rate is not None and args.request_rate <= 0):
        raise InvalidRequestError("--num-prompts and --concurrency must be >= 1, --request-rate > 0")
    try:
        import httpx  # noqa: F401  (a dev extra of the package; the client of this command)
    except ImportError:
        raise InvalidRequestError("bench serving needs httpx: pip install httpx") from None
    model = args.model
    max_len = args.max_len
    if model is None:
        served = serving.first_served_model(args.base_url, args.api_key)
        model, max_len = served.name, max_len or served.max_model_len
    tokenizer = serving.load_bench_tokenizer(args.tokenizer)
    template = ChatTemplate(tokenizer)
    if args.dataset:
        bench = sharegpt(args.dataset, tokenizer, template, args.num_prompts, args.output_len, max_len or sys.maxsize,
                         seed=args.seed)
    else:
        bench = synthetic_chat(tokenizer, template, args.num_prompts, _input_range(args.input_len),
                               args.output_len or 128, seed=args.seed)
    plan = serving.ServingPlan(base_url=args.base_url, model=model, endpoint=args.endpoint,
                               concurrency=args.concurrency, request_rate=args.request_rate,
                               ignore_eos=args.ignore_eos, api_key=args.api_key, seed=args.seed,
                               timeout_s=args.timeout, sampling=knobs_from_args(args), structured=args.structured)
    result = asyncio.run(serving.run_serving(plan, serving.serving_requests(bench, tokenizer, args.endpoint)))
    if args.json:
        json.dump(result.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(serving.format_serving(result))
    return 0 if result.completed else 1
