"""Write the prompts of `llmserve bench throughput` and `llmserve bench latency` as token ids (JSON), so a peer
engine (scripts/peers/vllm_offline.py) runs exactly the same workload on the same model directory.

Run with the project's venv: `.venv/bin/python scripts/peers/dump_workload.py --out FILE [FLAGS]`. The prompts
come from llmserve's own builders, called as the bench commands call them: `synthetic_chat` with the model's
tokenizer and chat template (llmserve/bench/cli.py `_workload`), and `random_prompts` (llmserve/bench/latency.py
`run_latency`). The model directory is located (and the embedded GGUF converted, on first use) by
`llmserve.models.loader.locate_model`, as every load does; only the tokenizer is loaded, not the weights.

`--print-model-dir` prints only the model directory (for scripts/peers/guidellm.sh's tokenizer).

Flags this script does not know (the peer driver's own, e.g. --enforce-eager) are ignored, so a wrapper can pass
one flag list to both.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from llmserve.bench.cli import _input_range
from llmserve.bench.datasets import synthetic_chat
from llmserve.bench.latency import random_prompts
from llmserve.chat_template import ChatTemplate
from llmserve.config import EngineConfig
from llmserve.models.loader import load_tokenizer, locate_model, read_hf_config


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The workload flags, with `llmserve bench throughput`'s and `bench latency`'s defaults."""
    parser.add_argument("--num-prompts", type=int, default=64, help="batch requests (bench throughput)")
    parser.add_argument("--input-len", default="36:390", help="batch prompt tokens, N or MIN:MAX (synthetic chat)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per batch request")
    parser.add_argument("--single-input-len", default="36",
                        help="single-request prompt tokens, a comma-separated list (bench latency's --input-len)")
    parser.add_argument("--single-output-len", type=int, default=128,
                        help="single-request output tokens (bench latency's --output-len)")
    parser.add_argument("--num-iters", type=int, default=5, help="measured single requests per prompt length")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured single requests first")


def single_lengths(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def build_workload(args: argparse.Namespace) -> dict[str, Any]:
    loc = locate_model(args.model, EngineConfig())
    hf_config = read_hf_config(loc.model_dir)
    tokenizer = load_tokenizer(loc.model_dir, False, hf_config)
    template = ChatTemplate(tokenizer)
    batch = synthetic_chat(tokenizer, template, args.num_prompts, _input_range(args.input_len), args.output_len)
    # bench latency's prompts: warmup + num_iters random token ids (seed 0), each starting with a different token
    # so no prefix cache serves any of them.
    single = {str(n): random_prompts(tokenizer, args.warmup + args.num_iters, n)
              for n in single_lengths(args.single_input_len)}
    return {
        "model_dir": loc.model_dir,
        "served_name": loc.served_name,
        "batch": {
            "input_len": args.input_len,
            "prompt_token_ids": [r.prompt_token_ids for r in batch],
            "output_len": [r.output_len for r in batch],
        },
        "single": {
            "output_len": args.single_output_len,
            "num_iters": args.num_iters,
            "warmup": args.warmup,
            "prompt_token_ids": single,
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--model", default=None,
                        help="model directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--print-model-dir", action="store_true",
                        help="only print the model directory (converting the GGUF first if needed) and exit")
    add_workload_flags(parser)
    args, _ = parser.parse_known_args(argv)
    if args.print_model_dir:
        print(locate_model(args.model, EngineConfig()).model_dir)
        return 0
    if not args.out:
        parser.error("--out is required (or --print-model-dir)")
    workload = build_workload(args)
    with open(args.out, "w") as f:
        json.dump(workload, f)
    batch_tokens = sum(len(p) for p in workload["batch"]["prompt_token_ids"])
    print(f"dump_workload: {len(workload['batch']['prompt_token_ids'])} batch prompts ({batch_tokens} prompt "
          f"tokens), single-request lengths {', '.join(workload['single']['prompt_token_ids'])}; model dir "
          f"{workload['model_dir']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
