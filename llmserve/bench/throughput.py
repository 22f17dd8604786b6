"""Offline throughput: the whole workload through the engine at once, as vLLM's and LMDeploy's
throughput benchmarks do. Counts the matrix FLOPs so the result can be read as a fraction of peak."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from llmserve.bench.datasets import BenchRequest
from llmserve.bench.sampling import SamplingKnobs
from llmserve.engine.llm_engine import LLMEngine


@dataclass
class ThroughputResult:
    engine: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    prefix_cache_hit_rate: float
    peak_rss_mb: float
    gflop: float
    achieved_gflops: float
    mean_ttft_ms: float | None = None
    prefill_tokens_computed: int | None = None  # prompt tokens the engine computed (after cache hits)
    spec_acceptance_rate: float | None = None  # speculative decoding: accepted / proposed drafts
    spec_tokens_per_step: float | None = None  # tokens a request gained per verify step
    peak_device_mb: float | None = None  # CUDA: the most memory torch held allocated during the run

    def as_dict(self) -> dict:
        return asdict(self)


def run_engine_throughput(engine: LLMEngine, requests: list[BenchRequest], ignore_eos: bool,
                          sampling: SamplingKnobs = SamplingKnobs(), structured: str | None = None,
                          adapters: list[str | None] | None = None) -> ThroughputResult:
    """`structured`: a bench/structured.py kind every request is constrained by. `adapters`: LoRA adapter names
    (None: the base model) given to the requests in turn."""
    gen = sampling.generation_config(max_new_tokens=1, ignore_eos=ignore_eos)
    if structured is not None:
        from llmserve.bench.structured import response_format

        gen = gen.replace(response_format=response_format(structured))
    for i, r in enumerate(requests):
        engine.add_request(f"bench-{i}", r.prompt_token_ids, gen.replace(max_new_tokens=r.output_len),
                           adapter_name=adapters[i % len(adapters)] if adapters else None)
    hits_before = engine.kv.prefix_stats.hit_tokens, engine.kv.prefix_stats.queried_tokens
    prefill_before = engine.scheduler.num_prefill_tokens
    spec = engine.spec_stats
    spec_before = spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_emitted_tokens
    output_tokens, ttfts = 0, []
    device = engine.loaded.device
    reset_peak_device_memory(device)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_tokens += len(out.new_token_ids) + (out.finish_reason == "stop")
            if out.times is not None and out.times.first_token is not None:
                ttfts.append(out.times.first_token - out.times.arrival)
    synchronize(device)
    elapsed = time.perf_counter() - start
    hit = engine.kv.prefix_stats.hit_tokens - hits_before[0]
    queried = engine.kv.prefix_stats.queried_tokens - hits_before[1]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    flop = workload_flop(engine.loaded.hf_config, requests)
    drafts, draft_tokens, accepted, emitted = (now - before for now, before in zip(
        (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_emitted_tokens), spec_before))
    return ThroughputResult(
        engine="llmserve", num_requests=len(requests), prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        elapsed_s=elapsed, requests_per_s=len(requests) / elapsed, output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        prefix_cache_hit_rate=hit / queried if queried else 0.0, peak_rss_mb=peak_rss_mb(),
        gflop=flop / 1e9, achieved_gflops=flop / elapsed / 1e9,
        mean_ttft_ms=1000 * sum(ttfts) / len(ttfts) if ttfts else None,
        prefill_tokens_computed=engine.scheduler.num_prefill_tokens - prefill_before,
        spec_acceptance_rate=accepted / draft_tokens if engine.proposer and draft_tokens else None,
        spec_tokens_per_step=emitted / drafts if engine.proposer and drafts else None,
        peak_device_mb=peak_device_mb(device))


def workload_flop(cfg: object, requests: list[BenchRequest]) -> float:
    """Matrix FLOPs of the workload: 2 x linear params per computed token, the LM head once per
    generated token, and attention (QK^T and PV: 4 x heads x head_dim per context position)."""
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_heads = getattr(cfg, "num_key_value_heads", heads)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * cfg.intermediate_size
    total = 0.0
    for r in requests:
        p, o = len(r.prompt_token_ids), r.output_len
        tokens = p + o - 1  # the last generated token is never fed back
        ctx_sum = tokens * (tokens + 1) / 2  # each token attends to every earlier one and itself
        total += 2 * per_layer * layers * tokens + 2 * hidden * cfg.vocab_size * o
        total += 4 * heads * head_dim * layers * ctx_sum
    return total


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synchronize(device: torch.device) -> None:
    """CUDA: wait for the queued kernels, so a host clock read next includes them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_device_mb(device: torch.device) -> float | None:
    """CUDA: the peak of torch's allocated memory since the last reset (weights and KV pool included)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


# The kinds of matmul a run is read against (bench.cli.peak_matmul_kind picks one; printed, and in --json)
INT8_MATMUL = "int8 matmul"  # s8 x s8 -> s32, what w8a8 linears run
INT16_INT8_MATMUL = "int16 x int8 matmul"  # native.int8w_gemm with x rounded to int16, what weight-only int8 runs
BF16_MATMUL = "bf16 matmul"  # the fastest of the bf16 linear's paths here (kernels/calibrate.py's candidates)
FP32_MATMUL = "fp32 matmul"  # the fastest of torch's and the fp32 linear's paths here (fp32_linear's candidates)


def matmul_peak_gflops(dtype: torch.dtype, device: torch.device, m: int = 256, k: int = 576, n: int = 1536,
                       seconds: float = 1.0, kind: str = "matmul") -> float:
    """What this device does on a model-shaped matmul: the 'peak' the achieved figure is read against. kind (as
    bench.cli.peak_matmul_kind names it): INT8_MATMUL or INT16_INT8_MATMUL (GOP/s), otherwise a matmul in dtype."""
    if kind == BF16_MATMUL:
        return max(_bf16_path_gflops(name, m, k, n, seconds) for name in _bf16_paths())
    if kind == FP32_MATMUL:
        from llmserve.kernels.calibrate import FP32_LINEAR, available, fp32_linear_candidates

        torch_peak = matmul_peak_gflops(torch.float32, device, m, k, n, seconds / 2)
        paths = fp32_linear_candidates(n, k, available(FP32_LINEAR), invariant_only=False)
        return max([torch_peak] + [_gflops(lambda c=c: c.run(m), 2 * m * k * n, device, seconds / 2) for c in paths])
    if kind == INT16_INT8_MATMUL:
        from llmserve.kernels import native

        a = torch.randn(m, k, dtype=dtype, device=device)
        packed = native.w8a8_pack(torch.randint(-127, 128, (n, k), dtype=torch.int8))
        scale = torch.full((n,), 0.01)

        def matmul() -> None:
            native.int8w_gemm(a, packed, scale, None, a16=True)
    elif kind == INT8_MATMUL:
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)

        def matmul() -> None:
            torch._int_mm(a, w.t())
    else:
        a = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)

        def matmul() -> None:
            torch.nn.functional.linear(a, w)
    return _gflops(matmul, 2 * m * k * n, device, seconds)


def _gflops(matmul: Callable[[], object], flop: int, device: torch.device, seconds: float) -> float:
    for _ in range(3):
        matmul()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul()
        iters += 1
    synchronize(device)
    return flop * iters / (time.perf_counter() - start) / 1e9


def _bf16_paths() -> tuple[str, ...]:
    from llmserve.kernels.calibrate import BF16_LINEAR, available

    # fp32: not a bf16 matmul, but where it is the only path (CPUs without AVX-512 or AVX512-BF16: bf16 linears run
    # widened to fp32 there) it is what bf16 runs at (max() of no paths had failed `--dtype bfloat16` on an AVX2 CPU)
    names = available(BF16_LINEAR)
    return tuple(name for name in names if name != "fp32") or names


def _bf16_path_gflops(name: str, m: int, k: int, n: int, seconds: float) -> float:
    from llmserve.kernels.calibrate import bf16_linear_candidates

    (candidate,) = bf16_linear_candidates(n, k, (name,), invariant_only=False)
    return _gflops(lambda: candidate.run(m), 2 * m * k * n, torch.device("cpu"), seconds / 2)
