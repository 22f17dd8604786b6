"""Vision-language figures for BENCHMARKS.md: llmserve against transformers in the same run, on SmolVLM-256M's shape.

No hub here, so the model is SmolVLM-256M-Instruct's shape (Idefics3: SigLIP-B/16 at 512 px, 64 tokens per 512-px
tile, the processor set to one tile per image, a 30-layer 576-wide SmolLM2 language model, 49,280-token vocabulary) with random weights: llmserve with
load_format="dummy", transformers with its own random init, both in the same dtype. The tokenizer is the embedded
SmolLM2's with SmolVLM's image tokens added. Random weights give garbage text, so every request runs a fixed
number of output tokens (ignore_eos), the same work on both sides.

    .venv/bin/python scripts/bench_vlm.py [--requests 64] [--output-tokens 64] [--image-size 512]

Prints: vision encode time per image (a batch of one, and per image within a batch of 8), time to first token for
one image and a question (from the PIL image to the first token, processing included, on both sides), and output
tokens/s of N image requests, each with its own image: llmserve's pipeline, and transformers.generate over the same
N requests in batches of --hf-batch (left padding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

QUESTION = "Describe this image in detail."
TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
            "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
            "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
            "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def model_dir() -> str:
    """config.json and processor files of SmolVLM-256M's shape, made once under ~/.cache/llmserve/bench."""
    from transformers import (
        Idefics3Config,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    from llmserve.config import EngineConfig
    from llmserve.models.loader import embedded_model_path, locate_model

    root = os.path.join(os.path.expanduser(os.environ.get("LLMSERVE_CACHE_DIR", "~/.cache/llmserve")), "bench",
                        "smolvlm-256m-shape-1tile")
    if os.path.isfile(os.path.join(root, "processor_config.json")):
        return root
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(locate_model(embedded_model_path(), EngineConfig()).model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                          "<end_of_utterance>", "<global-img>"]})
    vocab = 49280
    text = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       vocab_size=vocab, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    vision = Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                  num_attention_heads=12, image_size=512, patch_size=16)
    cfg = Idefics3Config(vision_config=vision, text_config=text, scale_factor=4,
                         image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    # One 512-px tile per image (64 tokens): the hub's size of 2048 px upscales every image to 4x4 tiles plus the
    # whole (1,088 tokens, ~8 s of SigLIP per image on 2 cores), which would make this a benchmark of SigLIP alone.
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 512}, max_image_size={"longest_edge": 512},
                                   do_image_splitting=True)
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=64, chat_template=TEMPLATE)
    os.makedirs(root, exist_ok=True)
    cfg.save_pretrained(root)
    proc.save_pretrained(root)
    with open(os.path.join(root, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return root


def images(n: int, size: int, seed: int = 0) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8), "RGB") for _ in range(n)]


def messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def bench_llmserve(d: str, args: argparse.Namespace) -> dict:
    from llmserve import GenerationConfig, pipeline

    out: dict = {}
    start = time.perf_counter()
    pipe = pipeline(d, load_format="dummy", vision_max_batch_size=8, log_level="WARNING")
    out["start_s"] = time.perf_counter() - start
    model = pipe.engine.loaded.model
    warm = images(2, args.image_size, seed=99)
    pipe((QUESTION, warm[0]), max_new_tokens=2, ignore_eos=True)  # first-call costs (kernel choice cache, threads)
    # encode: one image alone, then 8 at once, straight through the vision encoder (cache cleared)
    text = pipe.chat_template.messages_to_prompt(messages())
    one = [pipe.processor.prepare(text, [img])[1].images[0] for img in images(9, args.image_size, seed=5)]
    model.encoder_cache.clear()
    model._cached_bytes = 0
    t0 = time.perf_counter()
    model.embed_images(one[:1])
    out["encode_1_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.embed_images(one[1:])
    out["encode_per_image_in_8_s"] = (time.perf_counter() - t0) / 8
    out["tokens_per_image"] = len(one[0].positions)
    # time to first token: a fresh image each time (no cache can help), processing included
    ttfts = []
    for img in images(3, args.image_size, seed=7):
        t0 = time.perf_counter()
        for _ in pipe.stream_infer((QUESTION, img), max_new_tokens=1, ignore_eos=True):
            ttfts.append(time.perf_counter() - t0)
            break
    out["ttft_s"] = statistics.median(ttfts)
    # throughput: N requests, each its own image
    batch = [(QUESTION, img) for img in images(args.requests, args.image_size, seed=11)]
    gen = GenerationConfig(max_new_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    res = pipe(batch, gen_config=gen)
    elapsed = time.perf_counter() - t0
    out["throughput_tok_s"] = sum(r.generate_token_len for r in res) / elapsed
    out["throughput_elapsed_s"] = elapsed
    out["prompt_tokens"] = res[0].input_token_len
    out["encoder_seconds_in_run"] = model.encoder_stats.encode_seconds
    pipe.close()
    return out


def bench_transformers(d: str, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    from transformers import AutoProcessor, Idefics3Config, Idefics3ForConditionalGeneration

    out: dict = {}
    proc = AutoProcessor.from_pretrained(d)
    proc.tokenizer.padding_side = "left"
    cfg = Idefics3Config.from_pretrained(d)
    model = Idefics3ForConditionalGeneration(cfg).to(dtype).eval()
    text = proc.apply_chat_template(messages(), add_generation_prompt=True)

    def run(imgs: list, new_tokens: int) -> int:
        inputs = proc(text=[text] * len(imgs), images=[[i] for i in imgs], return_tensors="pt", padding=True,
                      add_special_tokens=False)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.no_grad():
            g = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return (g.shape[1] - inputs["input_ids"].shape[1]) * len(imgs)

    run(images(1, args.image_size, seed=99), 2)
    one = images(9, args.image_size, seed=5)
    with torch.no_grad():
        pv = proc(text=["<image>"], images=[[one[0]]], return_tensors="pt")["pixel_values"].to(dtype)
        t0 = time.perf_counter()
        model.model.get_image_features(pixel_values=pv)
        out["encode_1_s"] = time.perf_counter() - t0
        pv8 = torch.cat([proc(text=["<image>"], images=[[img]], return_tensors="pt")["pixel_values"]
                         for img in one[1:]]).to(dtype)
        t0 = time.perf_counter()
        model.model.get_image_features(pixel_values=pv8)
        out["encode_per_image_in_8_s"] = (time.perf_counter() - t0) / 8
    ttfts = []
    for img in images(3, args.image_size, seed=7):
        t0 = time.perf_counter()
        run([img], 1)
        ttfts.append(time.perf_counter() - t0)
    out["ttft_s"] = statistics.median(ttfts)
    batch = images(args.requests, args.image_size, seed=11)
    t0 = time.perf_counter()
    produced = sum(run(batch[k:k + args.hf_batch], args.output_tokens) for k in range(0, len(batch), args.hf_batch))
    elapsed = time.perf_counter() - t0
    out["throughput_tok_s"] = produced / elapsed
    out["throughput_elapsed_s"] = elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    d = model_dir()
    ours = bench_llmserve(d, args)
    from llmserve.models.loader import resolve_dtype

    dtype = resolve_dtype("auto", None, torch.device("cpu"))
    theirs = {} if args.skip_transformers else bench_transformers(d, args, dtype)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "dtype": str(dtype), "args": vars(args),
                      "llmserve": ours, "transformers": theirs}, indent=2))
    for key in ("encode_1_s", "encode_per_image_in_8_s", "ttft_s", "throughput_tok_s"):
        if key in theirs:
            print(f"{key:>24}: llmserve {ours[key]:.3f}  transformers {theirs[key]:.3f}  "
                  f"ratio {ours[key] / theirs[key]:.2f}")


if __name__ == "__main__":
    main()
