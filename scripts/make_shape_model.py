"""Write a weightless model directory of a known model's shape, for `--load-format dummy` benchmarks.

    python scripts/make_shape_model.py llama-3-8b OUT_DIR [--tokenizer DIR]

OUT_DIR gets config.json (the shape: layers, widths, heads, vocabulary, rope) and a tokenizer (default: the
embedded SmolLM2's, from the converted cache). No weights: the engine's `load_format=dummy` and the transformers
baseline (`bench throughput --baseline transformers`) both draw random ones. The tokenizer's vocabulary is smaller
than the model's; the prompts it makes are real text, and ids past it that a random model emits decode to nothing,
which costs a benchmark nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

SHAPES = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model")


def embedded_model_dir() -> str:
    from llmserve.config import EngineConfig
    from llmserve.models.loader import locate_model

    return locate_model(None, EngineConfig()).model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", help="a model directory to copy the tokenizer from (default: the embedded "
                                            "model's converted directory)")
    args = parser.parse_args()
    source = args.tokenizer or embedded_model_dir()
    os.makedirs(args.out_dir, exist_ok=True)
    copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(source, f))]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        print(f"{source} holds no tokenizer.json or tokenizer.model", file=sys.stderr)
        return 2
    for f in copied:
        shutil.copy(os.path.join(source, f), os.path.join(args.out_dir, f))
    with open(os.path.join(source, "config.json")) as f:
        special = {k: v for k, v in json.load(f).items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "initializer_range": 0.02, "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16",
              **SHAPES[args.shape], **special}
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{args.out_dir}: {args.shape} shape, tokenizer from {source} ({', '.join(copied)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
