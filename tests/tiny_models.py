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
from typing import TYPE_CHECKING, Any

import pytest
import torch

from llmserve.attention import SeqSpec, build_attention_metadata

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# transformers and tokenizers are imported inside the functions: conftest imports this module for
# every test session, and most tests never build a model.

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
    # caps small enough to bite (scores and logits reach them), a scale other than head_dim^-0.5, windows of 4
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                          "final_logit_softcapping": 3.0, "sliding_window": 4, "num_hidden_layers": 3,
                          "tie_word_embeddings": True}),
    # q/k norms; the local rope on sliding layers, the global one (linear-scaled) on the full layer
    "gemma3": ("gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
                               "num_hidden_layers": 3, "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
    # longrope over half of each head; the test prompts (<= 40 tokens) fit the original length, their outputs run past
    # it, so both factor sets rotate (rotary.py: per position, HF's generate for such prompts)
    "phi3": ("phi3", {"original_max_position_embeddings": 40, "sliding_window": 6, "pad_token_id": 0, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [1.5, 3.0, 6.0, 12.0]}}),
    # transformers runs it as LlamaForCausalLM; the checkpoint names InternLM3ForCausalLM (ARCHITECTURES)
    "internlm3": ("internlm3", {"qkv_bias": True, "bias": True, "head_dim": 32}),
    # mixture of experts: 4 experts, top 2. Mixtral: every layer sparse, renormalised, a window of 6
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
                            "sliding_window": 6}),
    # a shared expert; layer 1 dense (mlp_only_layers, intermediate_size); top-k weights not renormalised
    "qwen2-moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "mlp_only_layers": [1], "num_hidden_layers": 3,
                                "norm_topk_prob": False}),
    # q/k norms; renormalised; decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense
    "qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "norm_topk_prob": True, "decoder_sparse_step": 2, "num_hidden_layers": 4,
                                "head_dim": 32}),
}
# config.json `architectures` where the real checkpoints name a class transformers' model is not
ARCHITECTURES = {"internlm3": ["InternLM3ForCausalLM"]}
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9, "do_sample": True}


@cache
def _trained_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A new tokenizer object each call (trained once): a caller may add special tokens to its own (the tool-calling
    tests' engine adds two), which on a shared object grew every later caller's vocabulary (seen once tests ran in
    parallel workers, in another order: a GGUF writer then found 302 tokens for the 300 embedding rows)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_tokenizer_json())
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

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
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    return randomize_(model, seed).eval()


def make_tiny_model(arch: str, directory: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random `arch` checkpoint with tokenizer and generation_config.json; returns the dir."""
    directory = os.fspath(directory)
    model = make_hf_model(arch, seed, **overrides)
    model.save_pretrained(directory)
    if arch in ARCHITECTURES:
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({**config, "architectures": ARCHITECTURES[arch]}, f, indent=2)
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


# HF name fragment -> llama.cpp name, for writing test GGUF files (the reverse of gguf_loader's map).
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[base]}.{suffix}"


def _llama_cpp_permute(w: Any, n_head: int) -> Any:
    # convert_hf_to_gguf.py LlamaModel.permute: interleave the two rotary halves of each head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_model: Any, path: str | os.PathLike, qtype: Any = None,
                    rope_freqs: Any = None, orig_ctx: int | None = None, qtypes: dict[str, Any] | None = None) -> str:
    """A GGUF of `hf_model` (llama, qwen2 or qwen3; vocab must equal the tiny tokenizer's 300) with
    the tiny tokenizer and chat template as metadata, written as llama.cpp's converter would (Q/K
    permuted for llama). 2-D weights are stored as `qtype` (default F32), or as qtypes[suffix] for the HF names ending
    in a suffix it lists (a "_M" mix: {"v_proj.weight": Q6_K}), 1-D ones as F32. K-quants (Q4_K, Q5_K, Q6_K;
    tests/gguf_k_quants.py encodes them) need 2-D weights of whole 256-column rows."""
    import gguf

    cfg, tok = hf_model.config, tiny_tokenizer()
    assert cfg.vocab_size == len(tok), "GGUF token list and embedding rows must agree"
    qtype = qtype or gguf.GGMLQuantizationType.F32
    arch = cfg.model_type
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if orig_ctx:
        w.add_rope_scaling_orig_ctx_len(orig_ctx)
    _add_tokenizer(w, tok)
    for name, t in hf_model.state_dict().items():
        arr = t.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        t_type = next((q for suffix, q in (qtypes or {}).items() if name.endswith(suffix)), qtype)
        if arr.ndim == 2 and t_type != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), _quantize(arr, t_type), raw_dtype=t_type)
        else:
            w.add_tensor(_gguf_name(name), arr)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _quantize(arr: Any, qtype: Any) -> Any:
    import gguf

    if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):  # gguf cannot quantize these
        from tests import gguf_k_quants

        return gguf_k_quants.quantize(arr, qtype.name)
    return gguf.quants.quantize(arr, qtype)


def _add_tokenizer(w: Any, tok: PreTrainedTokenizerFast) -> None:
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in vocab])  # 3: control
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
