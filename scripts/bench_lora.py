"""LoRA figures for BENCHMARKS.md: the same 64-request workload on the base model and spread over 4 adapters, runs
alternated in one process on one machine.

The model is the embedded SmolLM2-135M-Instruct (or --model). The adapters are random PEFT checkpoints of rank
--rank on all seven projections (q/k/v/o/gate/up/down, PEFT's "all-linear" for a Llama), written under a temporary
directory: their weights do not change the work, only the shapes do. Every request runs --output-len tokens
(ignore_eos), so both sides do the same work.

    .venv/bin/python scripts/bench_lora.py [--num-prompts 64] [--adapters 4] [--rank 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import torch
from safetensors.torch import save_file

from llmserve import EngineConfig
from llmserve.api import pipeline
from llmserve.bench.datasets import synthetic_chat
from llmserve.bench.throughput import run_engine_throughput

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(cfg: object, directory: str, rank: int, seed: int) -> str:
    """A PEFT LoRA checkpoint for a Llama-shaped config: random A and B on every projection."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    shapes = {"q_proj": (hidden, cfg.num_attention_heads * head_dim), "k_proj": (hidden, cfg.num_key_value_heads * head_dim),
              "v_proj": (hidden, cfg.num_key_value_heads * head_dim), "o_proj": (cfg.num_attention_heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for block, names in TARGETS.items():
            for name in names:
                n_in, n_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [n for names in TARGETS.values() for n in names]}, f)
    return directory


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="36:390")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    lo, _, hi = args.input_len.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        base = pipeline(args.model, backend_config=EngineConfig(dtype=args.dtype, enable_lora=True))
        cfg = base.engine.loaded.hf_config
        names = [f"lora{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            base.engine.load_adapter(name, write_adapter(cfg, os.path.join(tmp, name), args.rank, seed=i))
        requests = synthetic_chat(base.tokenizer, base.chat_template, args.num_prompts, (int(lo), int(hi or lo)),
                                  args.output_len)
        run_engine_throughput(base.engine, requests[:4], ignore_eos=True, adapters=names)  # warm-up: kernels, caches
        rows = []
        for _ in range(args.repeats):
            for label, adapters in (("base model", None), (f"{args.adapters} adapters", names)):
                base.engine.kv.reset_prefix_cache()
                r = run_engine_throughput(base.engine, requests, ignore_eos=True, adapters=adapters)
                rows.append((label, r.output_tokens_per_s, r.mean_ttft_ms, r.peak_rss_mb))
                print(f"{label:>12}: {r.output_tokens_per_s:8.1f} output tok/s, mean TTFT {r.mean_ttft_ms:7.0f} ms, "
                      f"peak RSS {r.peak_rss_mb:.0f} MB", flush=True)
        base.close()
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, rank {args.rank}, "
          f"{args.num_prompts} requests x {args.output_len} output tokens")


if __name__ == "__main__":
    main()
