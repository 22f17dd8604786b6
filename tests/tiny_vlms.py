"""Tiny random vision-language models with their processors, saved as HF checkpoints, for tests.

`make_tiny_vlm(arch, dir)` builds the transformers model from a small config (random weights, as tiny_models), a
processor made of the tiny tokenizer (plus the model's image tokens) and the PIL image processor of the family, and
saves both with `save_pretrained`: the directory loads with transformers' AutoProcessor and with llmserve.
`test_image(seed, size)` is a deterministic random RGB image.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from llmserve.vl.hf_compat import save_processor, without_video_processor
from tests.tiny_models import _BASE, CHAT_TEMPLATE, GENERATION_CONFIG, randomize_, tiny_tokenizer

# A chat template that takes content lists ({"type": "image"} and {"type": "text"} parts), in the shape of the
# processors' own: each image part becomes the processor's image token.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ IMAGE }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_TEXT = {**_BASE, "max_position_embeddings": 4096}  # room for the default 512 new tokens, twice

VL_ARCHS = ("llava", "llava_next", "internvl", "idefics3", "smolvlm")
QWEN_VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")  # M-RoPE (tests/vl/test_qwen2_vl.py)

# Qwen2-VL: each image between <|vision_start|> and <|vision_end|> (as the family's chat template writes it), so that
# adjacent images stay apart in the rope index; video tokens exist for the processor, never used.
_QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# head_dim 16: 8 rotary frequencies in temporal/height/width sections (2, 3, 3), as Qwen2-VL's (16, 24, 24) of 64
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def _tokenizer(extra: list[str], named: dict[str, str] | None = None) -> Any:
    """The tiny tokenizer plus special tokens: `extra`, and `named` ones that become attributes (InternVL's
    tokenizer has start_image_token and its _id, and so on)."""
    base = tiny_tokenizer()
    tok = base.__class__(tokenizer_object=base.backend_tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                         unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                         extra_special_tokens=named or {})
    if extra:
        tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _template(image: str) -> str:
    return VL_CHAT_TEMPLATE.replace("{{ IMAGE }}", image.replace("'", "\\'").join(["{{ '", "' }}"]))


def build(arch: str, seed: int = 0) -> tuple[Any, Any]:
    """(transformers model, processor) of a tiny `arch`, fp32, eval, eager attention."""
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "llava":
        tok = _tokenizer(["<image>"])
        cfg = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**_VISION, image_size=32, patch_size=8),
                             text_config=tf.LlamaConfig(**_TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"),
                             vision_feature_layer=-2, projector_hidden_act="gelu")
        ip = tf.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        proc = tf.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                                 vision_feature_select_strategy="default", chat_template=_template("<image>"))
        model = tf.LlavaForConditionalGeneration(cfg)
    elif arch == "llava_next":
        tok = _tokenizer(["<image>"])
        pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
        cfg = tf.LlavaNextConfig(vision_config=tf.CLIPVisionConfig(**_VISION, image_size=32, patch_size=8),
                                 text_config=tf.LlamaConfig(**_TEXT), image_grid_pinpoints=pinpoints,
                                 image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2)
        ip = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                           image_grid_pinpoints=pinpoints)
        proc = tf.LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                                     vision_feature_select_strategy="default", chat_template=_template("<image>"))
        model = tf.LlavaNextForConditionalGeneration(cfg)
    elif arch == "internvl":
        tok = _tokenizer([], {"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
        vision = tf.InternVLVisionConfig(**_VISION, image_size=[32, 32], patch_size=[8, 8])
        cfg = tf.InternVLConfig(vision_config=vision, text_config=tf.Qwen2Config(**_TEXT),
                                image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), downsample_ratio=0.5,
                                vision_feature_layer=-1, vision_feature_select_strategy="default")
        ip = tf.GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1,
                                         max_patches=4)
        with without_video_processor():
            proc = tf.InternVLProcessor(image_processor=ip, tokenizer=tok, video_processor=None, image_seq_length=4,
                                        chat_template=_template("<IMG_CONTEXT>"))
        model = tf.InternVLForConditionalGeneration(cfg)
    elif arch in ("idefics3", "smolvlm"):
        extra = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
        tok = _tokenizer(extra)
        vision_cls = tf.Idefics3VisionConfig if arch == "idefics3" else tf.SmolVLMVisionConfig
        cfg_cls = tf.Idefics3Config if arch == "idefics3" else tf.SmolVLMConfig
        cfg = cfg_cls(vision_config=vision_cls(**_VISION, image_size=32, patch_size=8),
                      text_config=tf.LlamaConfig(**_TEXT), scale_factor=2,
                      image_token_id=tok.convert_tokens_to_ids("<image>"))
        ip_cls = tf.Idefics3ImageProcessorPil if arch == "idefics3" else tf.SmolVLMImageProcessorPil
        ip = ip_cls(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
        proc_cls = tf.Idefics3Processor if arch == "idefics3" else tf.SmolVLMProcessor
        video = {} if arch == "idefics3" else {"video_processor": None}
        with without_video_processor():
            proc = proc_cls(image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=_template("<image>"),
                            **video)
        model = (tf.Idefics3ForConditionalGeneration if arch == "idefics3" else tf.SmolVLMForConditionalGeneration)(cfg)
    elif arch in ("qwen2_vl", "qwen2_5_vl"):
        model, proc = _qwen_vl(arch)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "eager"
    return randomize_(model, seed).float().eval(), proc


def _qwen_vl(arch: str) -> tuple[Any, Any]:
    """Patches of 4 pixels merged 2x2: an image of tens of pixels is a few dozen placeholders, on a grid of its own
    aspect (dynamic resolution), placed by 3-D rotary positions (M-RoPE)."""
    import transformers as tf

    tok = _tokenizer(_QWEN_VL_TOKENS)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), _QWEN_VL_TOKENS)}
    text = {**_TEXT, "rope_parameters": _MROPE}
    vision = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=_TEXT["hidden_size"], mlp_ratio=2)
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        proc_cls, model_cls = tf.Qwen2VLProcessor, tf.Qwen2VLForConditionalGeneration
    else:  # window attention over 2x2 merged units in the first block, full attention in the second
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=_TEXT["hidden_size"], window_size=16,
                      fullatt_block_indexes=[1])
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        proc_cls, model_cls = tf.Qwen2_5_VLProcessor, tf.Qwen2_5_VLForConditionalGeneration
    ip = tf.Qwen2VLImageProcessorPil(size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64}, patch_size=4,
                                     merge_size=2, temporal_patch_size=2)
    with without_video_processor():
        proc = proc_cls(image_processor=ip, tokenizer=tok, video_processor=None,
                        chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>"))
    return model_cls(cfg), proc


def make_tiny_vlm(arch: str, directory: str | os.PathLike, seed: int = 0) -> str:
    directory = os.fspath(directory)
    model, proc = build(arch, seed)
    model.save_pretrained(directory)
    save_processor(proc, directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({**GENERATION_CONFIG, "eos_token_id": [2]}, f)
    return directory


def user_messages(text: str, n_images: int) -> list[dict]:
    """One user message: n image parts, then the text (the shape `(text, images)` prompts become)."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


_REFERENCES: dict[str, tuple] = {}


def hf_reference(model_dir: str) -> tuple[Any, Any]:
    """(transformers model in fp32, its processor) of a saved tiny VLM, loaded once per directory."""
    if model_dir not in _REFERENCES:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        with without_video_processor():
            proc = AutoProcessor.from_pretrained(model_dir)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        _REFERENCES[model_dir] = (model, proc)
    return _REFERENCES[model_dir]


def test_image(seed: int = 0, size: tuple[int, int] = (40, 50)) -> Any:
    """A deterministic random RGB PIL image of size (width, height)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


test_image.__test__ = False  # a helper, not a test, where a test module imports it
