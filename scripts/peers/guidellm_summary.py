"""Summarize a guidellm 0.8.1 benchmarks.json: output tokens/s, TTFT mean and median, ITL median, and the rest of
what BENCHMARKS.md compares. Standard library only (any python runs it).

`python guidellm_summary.py benchmarks.json [--json]`

Every figure is guidellm's own, read from `benchmarks[i].metrics.<metric>.successful` (successful requests): the
throughputs are its `mean` over the run (what its console table prints; equal to the successful requests' tokens
over the measured duration), the latencies its per-request mean and median (ITL: over every token gap).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _stat(metrics: dict[str, Any], name: str, key: str) -> float | None:
    successful = (metrics.get(name) or {}).get("successful") or {}
    if key.startswith("p") and key[1:].isdigit():
        return (successful.get("percentiles") or {}).get(key)
    return successful.get(key)


def summarize(benchmark: dict[str, Any]) -> dict[str, Any]:
    m = benchmark["metrics"]
    strategy = benchmark["config"]["strategy"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    return {
        "strategy": strategy.get("type_"),
        "streams": strategy.get("streams"),
        "requests_successful": made.get("successful"),
        "requests_errored": made.get("errored"),
        "requests_incomplete": made.get("incomplete"),
        "duration_s": benchmark.get("duration"),
        "prompt_tokens_mean": _stat(m, "prompt_token_count", "mean"),
        "output_tokens_total": _stat(m, "output_token_count", "total_sum"),
        "output_tokens_per_s": _stat(m, "output_tokens_per_second", "mean"),
        "total_tokens_per_s": _stat(m, "tokens_per_second", "mean"),
        "requests_per_s": _stat(m, "requests_per_second", "mean"),
        "ttft_ms_mean": _stat(m, "time_to_first_token_ms", "mean"),
        "ttft_ms_median": _stat(m, "time_to_first_token_ms", "median"),
        "ttft_ms_p99": _stat(m, "time_to_first_token_ms", "p99"),
        "itl_ms_mean": _stat(m, "inter_token_latency_ms", "mean"),
        "itl_ms_median": _stat(m, "inter_token_latency_ms", "median"),
        "tpot_ms_median": _stat(m, "time_per_output_token_ms", "median"),
        "request_latency_s_median": _stat(m, "request_latency", "median"),
        "concurrency_median": _stat(m, "request_concurrency", "median"),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_summary(s: dict[str, Any]) -> str:
    return "\n".join([
        f"guidellm {s['strategy']}, {s['streams']} streams: {s['requests_successful']} requests ok, "
        f"{s['requests_errored']} errored, {s['requests_incomplete']} incomplete in {_fmt(s['duration_s'], '.2f')} s; "
        f"prompt {_fmt(s['prompt_tokens_mean'], '.0f')} tokens (server's count), "
        f"{_fmt(s['output_tokens_total'], '.0f')} output tokens in all",
        f"output tok/s {_fmt(s['output_tokens_per_s'], '.1f')}; total tok/s {_fmt(s['total_tokens_per_s'], '.1f')}; "
        f"req/s {_fmt(s['requests_per_s'], '.2f')}",
        f"TTFT mean {_fmt(s['ttft_ms_mean'], '.1f')} ms, median {_fmt(s['ttft_ms_median'], '.1f')} ms, "
        f"p99 {_fmt(s['ttft_ms_p99'], '.1f')} ms; ITL median {_fmt(s['itl_ms_median'], '.2f')} ms "
        f"(mean {_fmt(s['itl_ms_mean'], '.2f')}); TPOT median {_fmt(s['tpot_ms_median'], '.2f')} ms; "
        f"request latency median {_fmt(s['request_latency_s_median'], '.2f')} s",
    ])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmarks", help="guidellm's benchmarks.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list if several benchmarks)")
    args = parser.parse_args(argv)
    with open(args.benchmarks) as f:
        report = json.load(f)
    summaries = [summarize(b) for b in report["benchmarks"]]
    if args.json:
        json.dump(summaries[0] if len(summaries) == 1 else summaries, sys.stdout, indent=2)
        print()
    else:
        print("\n".join(format_summary(s) for s in summaries))
    failed = any(not s["requests_successful"] or s["requests_errored"] for s in summaries)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
