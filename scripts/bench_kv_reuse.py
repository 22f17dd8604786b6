"""Figures (a) and (b) of the KV-reuse issue, reuse on vs off in the same run, embedded SmolLM2, greedy.

(a) 64 requests sharing a ~1,000-token system prompt, each with its own question: prompt tokens the
    engine computed, and throughput, with prefix caching off and on.
(b) an 8-turn chat through `pipe.chat`: time to first token of every turn, with sessions off
    (max_sessions=0, prefix caching off: every turn recomputes the whole conversation), with engine
    sessions (the default), and with prefix caching only.

    .venv/bin/python scripts/bench_kv_reuse.py [--dtype float32] [--output-len 32]
"""

from __future__ import annotations

import argparse
import pathlib
import time

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.throughput import run_engine_throughput

QUESTIONS = ["What does the scheduler do?", "How is the KV cache sized?", "Which models are supported?",
             "How do I stream tokens?", "What is chunked prefill?", "How are stop strings matched?",
             "What does /metrics report?", "How is a prompt that is too long refused?"]


def system_prompt(tokenizer, num_tokens: int) -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    ids = tokenizer.encode((root / "README.md").read_text(), add_special_tokens=False)[:num_tokens]
    return "You answer questions about this project.\n\n" + tokenizer.decode(ids)


def shared_prefix(args: argparse.Namespace) -> None:
    for caching in (False, True):
        config = EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=caching)
        with pipeline(backend_config=config) as pipe:
            system = system_prompt(pipe.tokenizer, args.system_tokens)
            reqs = []
            for i in range(args.num_requests):
                msgs = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}]
                text = pipe.chat_template.messages_to_prompt(msgs)
                reqs.append(BenchRequest(pipe.tokenizer.encode(text, add_special_tokens=False), args.output_len))
            run_engine_throughput(pipe.engine, [BenchRequest(reqs[0].prompt_token_ids[:16], 2)], ignore_eos=True)
            r = run_engine_throughput(pipe.engine, reqs, ignore_eos=True)
            print(f"(a) prefix caching {'on ' if caching else 'off'}: {r.num_requests} requests, {r.prompt_tokens} "
                  f"prompt tokens, {r.prefill_tokens_computed} computed (hit rate {100 * r.prefix_cache_hit_rate:.1f}%)"
                  f", {r.output_tokens_per_s:.1f} output tok/s, {r.total_tokens_per_s:.1f} total tok/s, "
                  f"{r.elapsed_s:.2f} s, mean TTFT {r.mean_ttft_ms:.0f} ms", flush=True)


def multi_turn(args: argparse.Namespace) -> None:
    modes = {"no reuse": dict(max_sessions=0, enable_prefix_caching=False),
             "sessions": dict(enable_prefix_caching=False),
             "prefix cache only": dict(max_sessions=0, enable_prefix_caching=True)}
    gen = GenerationConfig(temperature=0.0, max_new_tokens=args.output_len)
    for name, extra in modes.items():
        config = EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, **extra)
        with pipeline(backend_config=config) as pipe:
            pipe("warm-up", gen_config=gen.replace(max_new_tokens=2))
            session, ttfts, prefill = None, [], []
            first: list[float] = []
            step = pipe.engine.step

            def timed_step(step=step, first=first):  # records when the turn's first token comes out
                outs = step()
                if not first and any(o.new_token_ids for o in outs):
                    first.append(time.perf_counter())
                return outs

            pipe.engine.step = timed_step
            for turn in range(8):
                before = pipe.engine.scheduler.num_prefill_tokens
                first.clear()
                start = time.perf_counter()
                session = pipe.chat(QUESTIONS[turn], session=session, gen_config=gen)
                ttfts.append(1000 * (first[0] - start))
                prefill.append(pipe.engine.scheduler.num_prefill_tokens - before)
            print(f"(b) {name:>17}: TTFT per turn (ms) {', '.join(f'{t:.0f}' for t in ttfts)}; "
                  f"prompt tokens computed per turn {', '.join(map(str, prefill))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--only", choices=["a", "b"])
    args = ap.parse_args()
    if args.only != "b":
        shared_prefix(args)
    if args.only != "a":
        multi_turn(args)


if __name__ == "__main__":
    main()
