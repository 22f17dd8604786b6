"""Tiny random models, a tiny tokenizer and a minimal paged-KV runner, shared by tests.

`make_tiny_model(arch, dir)` saves an HF checkpoint (config.json, model.safetensors, tokenizer,
generation_config.json) built by transformers from a small config with every parameter random
(norm weights near 1, biases non-zero) so that a wrong bias, norm or rotary shows in the logits.
`tests/conftest.py` registers the session-scoped fixture `tiny_model_dir(arch) -> path`.
`PagedRunner` drives one of our models through a real paged KV cache, the way the engine does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from llmserve.attention import SeqSpec, build_attention_metadata

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (as SmolLM2)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = [
    "The capital of France is Paris.",
    "What is the capital of France?",
    "Hello world, this is a tiny tokenizer for tests.",
    "The quick brown fox jumps over the lazy dog.",
    "Models run over flat tokens with a paged KV cache.",
]
VOCAB_SIZE = 320  # >= the tokenizer's size; the spare rows are never produced by the tokenizer

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# name -> (model_type, config overrides). Windows are smaller than the test prompts so they matter.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {"sliding_window": 5, "head_dim": 16}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                        "num_hidden_layers": 3}),
    "qwen3": ("qwen3", {"head_dim": 32, "attention_bias": True}),
}
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9, "do_sample": True}


@cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str, **overrides: Any) -> Any:
    model_type, arch_overrides = TINY_CONFIGS[arch]
    return AutoConfig.for_model(model_type, **{**_BASE, **arch_overrides, **overrides})


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random and O(1)-scaled logits: norms ~1 +- 0.1, biases and weights ~N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    return randomize_(model, seed).eval()


def make_tiny_model(arch: str, directory: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random `arch` checkpoint with tokenizer and generation_config.json; returns the dir."""
    directory = os.fspath(directory)
    model = make_hf_model(arch, seed, **overrides)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return directory


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    """Reference: transformers over one unpadded sequence, no cache -> [len, vocab] fp32."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@dataclass
class _Seq:
    num_cached: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Runs our model step by step over a paged KV cache, as the engine's model runner would.

    Blocks are handed out from the end of the pool backwards, so a sequence's context is never
    contiguous in the cache: a slot-mapping mistake shows.
    """

    def __init__(self, model: Any, num_blocks: int = 64, block_size: int = 4) -> None:
        self.model, self.block_size = model, block_size
        param = next(model.parameters())
        for attn in model.attention_layers():
            attn.kv_cache = torch.zeros(2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                        dtype=param.dtype, device=param.device)
        self.free = list(range(num_blocks))
        self.seqs: dict[int, _Seq] = {}

    def step(self, batch: list[tuple[int, list[int]]]) -> dict[int, torch.Tensor]:
        """(seq id, new token ids) per request -> seq id -> logits [num_new, vocab] fp32."""
        batch = sorted(batch, key=lambda r: len(r[1]) > 1)  # decodes first (stable)
        specs, ids, positions = [], [], []
        for seq_id, new in batch:
            seq = self.seqs.setdefault(seq_id, _Seq())
            total = seq.num_cached + len(new)
            while len(seq.blocks) * self.block_size < total:
                seq.blocks.append(self.free.pop())
            specs.append(SeqSpec(seq.num_cached, len(new), list(seq.blocks)))
            ids += new
            positions += range(seq.num_cached, total)
        device = next(self.model.parameters()).device
        meta = build_attention_metadata(specs, self.block_size, device)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for seq_id, new in batch:
            out[seq_id] = logits[start:start + len(new)]
            start += len(new)
            self.seqs[seq_id].num_cached += len(new)
        return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_model_dir(arch) -> a saved checkpoint directory of TINY_CONFIGS[arch], made once per session."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return get
