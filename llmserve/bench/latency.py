"""Single-request latency through the engine: time to first token and decode speed, one request at a
time (nothing else in the batch), as vLLM's benchmark_latency.py does, plus start-to-ready time.

Each iteration gets a fresh prompt of random token ids whose first token differs from every other
iteration's, so the prefix cache (when enabled) cannot serve any of it: TTFT is a full prefill.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass

from transformers import PreTrainedTokenizerBase

from llmserve.bench.sampling import SamplingKnobs
from llmserve.bench.stats import Summary, summarize
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class LatencySample:
    """One request, in seconds from add_request; output_tokens counts every sampled token (a final
    EOS included), since each took a decode step."""

    ttft_s: float
    e2e_s: float
    output_tokens: int

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first; None with fewer than two tokens."""
        if self.output_tokens < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (self.output_tokens - 1) / (self.e2e_s - self.ttft_s)


@dataclass(frozen=True)
class LatencyPlan:
    input_len: int = 36  # prompt tokens
    output_len: int = 128
    num_iters: int = 5  # measured
    warmup: int = 1  # run first, not measured (first-call allocations, lazy init)
    ignore_eos: bool = True  # a decode rate needs a fixed length; vLLM's benchmark_latency ignores EOS too
    sampling: SamplingKnobs = SamplingKnobs()  # greedy


@dataclass
class LatencyResult:
    prompt_tokens: int
    output_len: int  # requested
    num_iters: int
    dtype: str
    device: str
    load_s: float  # pipeline() construction: locate/convert, build, load weights, size the KV cache
    start_to_ready_s: float | None  # process start (imports included) to the engine taking its first request
    start_to_first_token_s: float | None  # ... to that request's first token (its prompt's prefill included)
    ttft_ms: Summary
    decode_tokens_per_s: Summary | None
    e2e_ms: Summary
    output_tokens: list[int]  # per measured iteration
    sampling: str = "greedy"

    def as_dict(self) -> dict:
        return asdict(self)


def run_latency(engine: LLMEngine, plan: LatencyPlan, load_s: float) -> LatencyResult:
    """Warm-up then measured requests, one at a time, on an idle engine."""
    if plan.num_iters < 1 or plan.warmup < 0 or plan.output_len < 1:
        raise InvalidRequestError(f"need --num-iters >= 1, --warmup >= 0 and --output-len >= 1, got "
                                  f"{plan.num_iters}, {plan.warmup} and {plan.output_len}")
    prompts = random_prompts(engine.tokenizer, plan.warmup + plan.num_iters, plan.input_len)
    samples: list[LatencySample] = []
    # Ready is when the engine takes a request (loaded, calibrated, warmed), as a server's /health would say: not
    # when the first request finishes, which would add its own prefill and decode (1.7 + 1.6 s at 2,000 tokens).
    ready = process_age_s()
    first_token: float | None = None
    for i, prompt in enumerate(prompts):
        sample = time_request(engine, f"latency-{i}", prompt, plan.output_len, plan.ignore_eos, plan.sampling)
        if i == 0 and ready is not None:
            first_token = ready + sample.ttft_s
        if i >= plan.warmup:
            samples.append(sample)
    ttft, decode, e2e = summarize_latency(samples)
    return LatencyResult(
        prompt_tokens=plan.input_len, output_len=plan.output_len, num_iters=plan.num_iters,
        dtype=str(engine.loaded.dtype).removeprefix("torch."), device=str(engine.loaded.device), load_s=load_s,
        start_to_ready_s=ready, start_to_first_token_s=first_token, ttft_ms=ttft, decode_tokens_per_s=decode, e2e_ms=e2e,
        output_tokens=[s.output_tokens for s in samples], sampling=plan.sampling.describe())


def random_prompts(tokenizer: PreTrainedTokenizerBase, num: int, length: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `length` ordinary (non-special) token ids, each with a different first token."""
    if length < 1:
        raise InvalidRequestError(f"--input-len must be >= 1, got {length}")
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    if num > len(vocab):
        raise InvalidRequestError(f"at most {len(vocab)} iterations with this tokenizer, got {num}")
    rng = random.Random(seed)
    firsts = rng.sample(vocab, num)
    return [[first, *rng.choices(vocab, k=length - 1)] for first in firsts]


def time_request(engine: LLMEngine, request_id: str, prompt: list[int], output_len: int,
                 ignore_eos: bool, sampling: SamplingKnobs = SamplingKnobs()) -> LatencySample:
    """Run one request alone through `engine` (which must be idle) and time it from the caller's side."""
    gen = sampling.generation_config(max_new_tokens=output_len, ignore_eos=ignore_eos)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, gen)
    first: float | None = None
    tokens = 0
    now = start
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        tokens += len(outputs)  # the request is alone: one output per step that sampled a token
        if outputs and first is None:
            first = now
    return LatencySample(ttft_s=(first or now) - start, e2e_s=now - start, output_tokens=tokens)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), so 'start to ready' counts the interpreter
    start and imports as a user waiting for a server would; None where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22 (starttime); fields after "(comm)" start at 3
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def summarize_latency(samples: list[LatencySample]) -> tuple[Summary, Summary | None, Summary]:
    """(TTFT ms, decode tokens/s, end-to-end ms) over the measured iterations."""
    rates = [s.decode_tokens_per_s for s in samples]
    return (summarize([s.ttft_s for s in samples], 1000.0),
            summarize([r for r in rates if r is not None]),
            summarize([s.e2e_s for s in samples], 1000.0))


def format_latency(r: LatencyResult) -> str:
    decode = r.decode_tokens_per_s
    lines = [
        f"single request: {r.prompt_tokens} prompt tokens, {r.output_len} output tokens requested, "
        f"{r.num_iters} iterations; {r.dtype} on {r.device}; {r.sampling}",
        f"{'':<24}{'mean':>10}{'p50':>10}",
        f"{'TTFT (ms)':<24}{r.ttft_ms.mean:>10.1f}{r.ttft_ms.p50:>10.1f}",
        f"{'decode (tokens/s)':<24}" + (f"{decode.mean:>10.1f}{decode.p50:>10.1f}" if decode else f"{'-':>10}{'-':>10}"),
        f"{'end to end (ms)':<24}{r.e2e_ms.mean:>10.1f}{r.e2e_ms.p50:>10.1f}",
        f"output tokens per iteration: {', '.join(map(str, r.output_tokens))}",
        f"load (pipeline built): {r.load_s:.2f} s; process start to ready (taking requests): "
        + (f"{r.start_to_ready_s:.2f} s" if r.start_to_ready_s is not None else "unknown")
        + "; to the first request's first token: "
        + (f"{r.start_to_first_token_s:.2f} s" if r.start_to_first_token_s is not None else "unknown"),
    ]
    return "\n".join(lines)
