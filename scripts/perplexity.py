"""Teacher-forced perplexity of a model through llmserve's own runner, to weigh a quantization.

The text is prefilled in chunks of --chunk tokens, so every chunk attends over the earlier chunks' K/V read back
from the paged cache: the path that kv_cache_dtype (e.g. int8) changes, which a one-shot prefill never reads.

    .venv/bin/python scripts/perplexity.py --file ../shared/seeds/000_1d2b003b0510d011.txt \
        --config dtype=bfloat16 --config dtype=bfloat16,kv_cache_dtype=int8
"""

from __future__ import annotations

import argparse
import math

import torch

from llmserve import EngineConfig, pipeline
from llmserve.worker.model_runner import Span


def perplexity(model: str | None, config: EngineConfig, text: str, max_tokens: int, chunk: int) -> tuple[float, int]:
    with pipeline(model, backend_config=config) as pipe:
        ids = pipe.tokenizer.encode(text)[:max_tokens]
        runner = pipe.engine.runner
        blocks = -(-len(ids) // runner.block_size)
        if blocks > runner.num_blocks:
            raise SystemExit(f"{len(ids)} tokens need {blocks} KV blocks; the pool has {runner.num_blocks}")
        table = list(range(blocks))  # the engine is idle: the runner writes wherever the table says
        nll, n = 0.0, 0
        for start in range(0, len(ids) - 1, chunk):
            span = ids[start:start + chunk]
            logprobs = torch.log_softmax(runner.forward([Span(span, start, table, len(span))]).float(), -1)
            targets = torch.tensor(ids[start + 1:start + 1 + len(span)])
            nll -= logprobs[torch.arange(len(targets)), targets].sum().item()
            n += len(targets)
    return math.exp(nll / n), n


def _config(spec: str) -> EngineConfig:
    """"dtype=bfloat16,kv_cache_dtype=int8" -> EngineConfig (ints converted)."""
    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    return EngineConfig(**{k: int(v) if v.isdigit() else v for k, v in fields.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path or id (default: the embedded SmolLM2)")
    parser.add_argument("--file", required=True, help="a text file")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the file to score")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per prefill chunk")
    parser.add_argument("--config", action="append", required=True,
                        help="engine fields, comma separated (repeat to compare configurations)")
    args = parser.parse_args()
    text = open(args.file, encoding="utf-8").read()
    for spec in args.config:
        ppl, n = perplexity(args.model, _config(spec), text, args.tokens, args.chunk)
        print(f"{spec}: perplexity {ppl:.4f} over {n} tokens (chunks of {args.chunk})", flush=True)


if __name__ == "__main__":
    main()
