"""GGUF files written with the `gguf` package from tiny transformers models: weights (F32 exact,
Q8_0 equal to gguf's own dequantization), Q/K un-permutation, tokenizer and chat template, the
conversion cache (cold, warm, invalidation, no half-written cache) and llama3 rope_freqs."""

from __future__ import annotations

import math
import os

import gguf
import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.errors import ModelLoadError
from llmserve.models import gguf_loader, load_model
from tests.tiny_models import (
    CHAT_TEMPLATE,
    PagedRunner,
    hf_logits,
    make_hf_model,
    tiny_tokenizer,
    write_tiny_gguf,
)

Q = gguf.GGMLQuantizationType
CPU32 = EngineConfig(dtype="float32", device="cpu")
IDS = list(range(3, 30))


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path) -> str:
    path = str(tmp_path / "cache")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", path)
    return path


def _q8_roundtrip(hf) -> None:
    """Replace every matrix of `hf` by its Q8_0 quantize/dequantize, the values a Q8_0 GGUF holds."""
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                q = gguf.quants.quantize(p.numpy(), Q.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, Q.Q8_0)))


def _q_weight(model) -> torch.Tensor:
    qkv = model.model.layers[1].self_attn.qkv_proj
    return qkv.weight[: qkv.shard_sizes["q"]]


def test_f32_gguf_weights_are_exact_and_logits_match(tmp_path) -> None:
    hf = make_hf_model("llama", vocab_size=300)
    lm = load_model(write_tiny_gguf(hf, tmp_path / "tiny.F32.gguf"), CPU32)
    # Q/K were permuted by the writer as llama.cpp does; the loader undoes it exactly.
    assert torch.equal(_q_weight(lm.model), hf.model.layers[1].self_attn.q_proj.weight)
    ours = PagedRunner(lm.model).step([(0, IDS)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, overrides", [
    ("qwen2", {"use_sliding_window": False}),  # GGUF carries no Qwen2 window
    ("qwen3", {}),  # head_dim 32 != hidden / heads: read from attention.key_length
], ids=["qwen2", "qwen3"])
def test_qwen_gguf_logits_match(arch: str, overrides: dict, tmp_path) -> None:
    hf = make_hf_model(arch, vocab_size=300, **overrides)
    lm = load_model(write_tiny_gguf(hf, tmp_path / f"{arch}.gguf"), CPU32)
    assert type(lm.model).__name__ == type(hf).__name__
    ours = PagedRunner(lm.model).step([(0, IDS)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_directory_holding_one_gguf(tmp_path) -> None:
    hf = make_hf_model("llama", vocab_size=300)
    write_tiny_gguf(hf, tmp_path / "only.gguf")
    assert load_model(str(tmp_path), CPU32).served_name == "only"
    write_tiny_gguf(hf, tmp_path / "second.gguf")
    with pytest.raises(ModelLoadError, match="several .gguf files; name one of: only.gguf, second.gguf"):
        load_model(str(tmp_path), CPU32)


def test_q8_0_gguf_equals_gguf_dequantization(tmp_path) -> None:
    hf = make_hf_model("llama", vocab_size=300)
    path = write_tiny_gguf(hf, tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    lm = load_model(path, CPU32)
    reader = gguf.GGUFReader(path)
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert down.tensor_type == Q.Q8_0
    expected = torch.from_numpy(gguf.quants.dequantize(down.data, Q.Q8_0))
    assert torch.equal(lm.model.model.layers[0].mlp.down_proj.weight, expected)
    _q8_roundtrip(hf)
    assert torch.equal(_q_weight(lm.model), hf.model.layers[1].self_attn.q_proj.weight)
    ours = PagedRunner(lm.model).step([(0, IDS)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_tokenizer_chat_template_and_metadata(tmp_path) -> None:
    lm = load_model(write_tiny_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "tiny.F32.gguf"), CPU32)
    text = "What is the capital of France?"
    assert lm.tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids
    assert lm.tokenizer.chat_template == CHAT_TEMPLATE
    assert lm.served_name == "tiny.F32"
    assert lm.eos_token_ids == [2]
    assert lm.hf_config.architectures == ["LlamaForCausalLM"]
    assert lm.max_model_len == 256


def test_second_load_uses_the_cache(tmp_path, cache_dir, monkeypatch) -> None:
    path = write_tiny_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "tiny.F32.gguf")
    cold = load_model(path, CPU32)
    assert cold.gguf_converted is True
    assert os.path.dirname(cold.model_dir) == os.path.join(cache_dir, "gguf")
    assert sorted(os.listdir(cold.model_dir)) == [
        "chat_template.jinja", "config.json", "generation_config.json", "llmserve_gguf_blocks.data", "llmserve_gguf_blocks.json",
        "llmserve_gguf_source.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "_convert", no_conversion)
    warm = load_model(path, CPU32)
    assert (warm.gguf_converted, warm.model_dir) == (False, cold.model_dir)
    os.utime(path, ns=(0, 12345))  # a changed file (mtime) gets a new cache entry
    assert gguf_loader.gguf_cache_dir(path) != cold.model_dir


def test_failed_conversion_leaves_no_cache(tmp_path, cache_dir, monkeypatch) -> None:
    path = write_tiny_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "tiny.F32.gguf")

    def crash(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_loader, "_generation_config", crash)  # after the weights were written
    with pytest.raises(RuntimeError, match="disk full"):
        load_model(path, CPU32)
    assert os.listdir(os.path.join(cache_dir, "gguf")) == []


def test_stale_temporary_of_a_killed_conversion_is_removed(tmp_path, cache_dir) -> None:
    path = write_tiny_gguf(make_hf_model("llama", vocab_size=300), tmp_path / "tiny.F32.gguf")
    parent, name = os.path.split(gguf_loader.gguf_cache_dir(path))
    stale, fresh = (os.path.join(parent, f".{name}.tmp-{age}") for age in ("old", "new"))
    for d in (stale, fresh):
        os.makedirs(d)
    os.utime(stale, (0, 0))
    load_model(path, CPU32)
    assert sorted(os.listdir(parent)) == sorted([f".{name}.tmp-new", name])  # a young one may be in use


def test_not_a_gguf_file_is_named(tmp_path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=f"{path}: not a readable GGUF file"):
        load_model(str(path), CPU32)


def test_unknown_gguf_tensor_is_named(tmp_path) -> None:
    hf = make_hf_model("llama", vocab_size=300)
    path = tmp_path / "renamed.gguf"
    write_tiny_gguf(hf, path)
    # rename one tensor in place (same length, so offsets stay valid) to a name with no HF equivalent
    path.write_bytes(path.read_bytes().replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_zz.weight", 1))
    with pytest.raises(ModelLoadError, match="GGUF tensor 'blk.1.ffn_zz.weight' has no HF equivalent"):
        load_model(str(path), CPU32)


def _llama_cpp_rope_freqs(base: float, dim: int, factor: float, low: float, high: float, orig: int) -> torch.Tensor:
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: one divisor per rotary frequency.
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out)


def test_llama3_rope_freqs_become_llama3_rope_parameters(tmp_path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = make_hf_model("llama", vocab_size=300, rope_parameters=rope)
    freqs = _llama_cpp_rope_freqs(10000.0, 16, 8.0, 1.0, 4.0, 64)
    path = write_tiny_gguf(hf, tmp_path / "llama3.gguf", rope_freqs=freqs, orig_ctx=64)
    lm = load_model(path, CPU32)
    assert {k: lm.hf_config.rope_parameters[k] for k in rope} == rope
    ours = PagedRunner(lm.model).step([(0, IDS)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path) -> None:
    hf = make_hf_model("llama", vocab_size=300)
    path = write_tiny_gguf(hf, tmp_path / "odd.gguf", rope_freqs=torch.linspace(1, 3, 8))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight does not match llama3 rope scaling"):
        load_model(path, CPU32)
