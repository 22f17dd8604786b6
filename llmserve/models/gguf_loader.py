"""Turn a llama.cpp GGUF file into a cached HF directory the regular loader reads.

Config and tokenizer (with its chat template) come from transformers' GGUF support (~15 s for a
real tokenizer, hence the cache); weights are read and dequantized with the `gguf` package and
renamed from llama.cpp's names to HF's. The result (config.json, model.safetensors, tokenizer
files, generation_config.json) lives under `$LLMSERVE_CACHE_DIR/gguf/<stem>-<key>` (default
`~/.cache/llmserve`), key = hash of the file's absolute path, size and mtime, so an edited or
replaced file converts again. It is written to a temporary directory and renamed into place:
a crash never leaves a half-written cache that a later start would trust.

Quantized tensors are stored dequantized in fp32 (exactly `gguf.quants.dequantize`'s values), so the directory stays
a checkpoint transformers and other engines read; F16/BF16/F32 tensors keep their dtype. Quantized matrices are also
kept as their raw GGUF blocks (uint8 [rows, bytes per row], Q/K rows un-permuted like the others) in
llmserve_gguf_blocks.data (a safetensors file), listed with their type and width in llmserve_gguf_blocks.json: the
model loader runs them on their blocks, never touching their fp32 copy, or loads that copy (models/quantized_weights.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from llmserve.errors import ModelLoadError
from llmserve.layers.rotary import RopeConfig, base_inv_freq, llama3_inv_freq
from llmserve.models.quantized_weights import GGUF_BLOCKS, GGUF_MANIFEST
from llmserve.models.registry import MODEL_TYPES

log = logging.getLogger(__name__)

_FORMAT_VERSION = 3  # part of the cache key: bump when the conversion changes (3: raw quantized blocks beside)
_SHARD_BYTES = 2 << 30  # bounds the memory held while writing; one file for small models

# llama.cpp tensor names -> HF names (suffix .weight / .bias kept).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def cache_root() -> str:
    return os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llmserve")


def gguf_cache_dir(path: str) -> str:
    """Where the conversion of `path` lives (whether or not it exists yet)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{_FORMAT_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{key}")


def gguf_to_hf_dir(path: str, trust_remote_code: bool = False) -> tuple[str, bool]:
    """Returns (HF directory, converted_now). A warm start only checks that the cache is complete."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    final = gguf_cache_dir(path)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final, False
    os.makedirs(os.path.dirname(final), exist_ok=True)
    _remove_stale_temporaries(final)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=os.path.dirname(final))
    try:
        start = time.perf_counter()
        _convert(path, tmp, trust_remote_code)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same conversion first; use theirs
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted GGUF %s to %s in %.1f s", path, final, time.perf_counter() - start)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, True


def _remove_stale_temporaries(final: str, max_age_s: float = 3600.0) -> None:
    """Temp dirs left by a killed conversion; a younger one may belong to a conversion still running."""
    prefix = f".{os.path.basename(final)}.tmp-"
    parent = os.path.dirname(final)
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(prefix) and time.time() - os.path.getmtime(path) > max_age_s:
            shutil.rmtree(path, ignore_errors=True)


def _convert(path: str, out_dir: str, trust_remote_code: bool) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    directory, name = os.path.split(os.path.abspath(path))
    try:
        cfg = AutoConfig.from_pretrained(directory, gguf_file=name, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"{path}: transformers cannot read its config/tokenizer ({e})") from None
    _complete_config(cfg, reader, path)
    blocks: dict[str, torch.Tensor] = {}
    manifest: dict[str, dict[str, Any]] = {}
    _save_weights(_hf_tensors(reader, cfg, path, blocks, manifest), out_dir)
    save_file(blocks, os.path.join(out_dir, GGUF_BLOCKS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, GGUF_MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    cfg.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(_generation_config(reader, cfg), f, indent=2)
    with open(os.path.join(out_dir, "llmserve_gguf_source.json"), "w") as f:
        st = os.stat(path)
        json.dump({"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}, f)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _complete_config(cfg: Any, reader: Any, path: str) -> None:
    """What transformers' GGUF config mapping leaves out: architectures, head_dim, biases, rope scaling."""
    if cfg.model_type not in MODEL_TYPES:
        raise ModelLoadError(f"{path}: GGUF architecture {cfg.model_type!r} is not supported; supported: "
                             f"{', '.join(sorted(MODEL_TYPES))}")
    cfg.architectures = [MODEL_TYPES[cfg.model_type]]
    arch = _field(reader, "general.architecture")
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length:
        cfg.head_dim = int(key_length)
    if cfg.model_type in ("llama", "qwen3"):  # a config flag there; GGUF only shows it by the tensors
        cfg.attention_bias = any(t.name.endswith(".attn_q.bias") for t in reader.tensors)
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window and cfg.model_type == "mistral":
        cfg.sliding_window = int(window)
    rope = dict(cfg.rope_parameters or {})
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig:
            rope["original_max_position_embeddings"] = int(orig)
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling type {scaling!r} in the GGUF is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        rope = _llama3_rope_from_freqs(np.asarray(freqs.data, dtype=np.float32), rope, cfg, reader, path)
    cfg.rope_parameters = rope
    cfg.dtype = "float32"  # what the stored tensors mostly are (dequantized)


def _llama3_rope_from_freqs(freqs: np.ndarray, rope: dict, cfg: Any, reader: Any, path: str) -> dict:
    """llama.cpp stores Llama-3.1-style rope scaling as per-frequency divisors (`rope_freqs`).

    Recover the llama3 parameters: factor = the largest divisor; low/high frequency factors 1 and 4
    and the original context (GGUF metadata, else 8192) are Meta's values; accept them only if they
    reproduce every divisor.
    """
    arch = _field(reader, "general.architecture")
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length") or 8192
    params = {**rope, "rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": int(orig)}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rc = RopeConfig("llama3", float(rope.get("rope_theta", 10000.0)), cfg.max_position_embeddings, params)
    divisors = (base_inv_freq(rc.theta, head_dim) / llama3_inv_freq(rc, head_dim)).numpy()
    if divisors.shape != freqs.shape or not np.allclose(divisors, freqs, rtol=1e-3):
        raise ModelLoadError(f"{path}: tensor rope_freqs.weight does not match llama3 rope scaling "
                             "(factor, 1, 4, original context); this rope scaling is not supported")
    return params


def hf_tensor_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _LAYER_TENSORS.get(part)
        return f"model.layers.{layer}.{hf}.{suffix}" if hf else None
    hf = _GLOBAL_TENSORS.get(base)
    return f"{hf}.{suffix}" if hf else None


def gguf_tensor_to_torch(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in HF layout ([out, in] for matrices)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    if tensor.tensor_type in (Q.F32, Q.F16):
        data = np.array(tensor.data)  # copy out of the read-only mmap
    elif tensor.tensor_type == Q.BF16:
        return torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    else:
        try:
            data = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"tensor {tensor.name!r}: GGUF type {tensor.tensor_type.name} cannot be "
                                 "dequantized by the installed gguf package") from None
    return torch.from_numpy(data).reshape(shape)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it interleaves the two rotary halves of each head)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_raw_blocks(tensor: Any) -> torch.Tensor | None:
    """A quantized GGUF matrix's blocks as uint8 [rows, bytes per row] (rows: the HF layout's output rows), or None
    for a float tensor or one whose type the installed gguf package cannot dequantize (gguf_tensor_to_torch says
    which)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if tensor.tensor_type in (Q.F32, Q.F16, Q.BF16) or len(tensor.shape) != 2:
        return None
    raw = np.array(tensor.data)  # copy out of the read-only mmap
    try:
        dequantize(raw[:1], tensor.tensor_type)
    except NotImplementedError:
        return None
    return torch.from_numpy(raw).reshape(int(tensor.shape[1]), -1)


def _hf_tensors(reader: Any, cfg: Any, path: str, blocks: dict[str, torch.Tensor],
                manifest: dict[str, dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors (quantized ones dequantized); the quantized matrices' raw blocks also go into `blocks`, each
    listed in `manifest` (name -> type, columns)."""
    # llama.cpp permutes Q/K only for the llama architecture (Mistral included), as transformers undoes.
    permute = _field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into the config's rope parameters
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: GGUF tensor {tensor.name!r} has no HF equivalent we know")
        raw = gguf_raw_blocks(tensor)
        if raw is not None:
            blocks[name] = _unpermute(raw, name, cfg, permute).contiguous()
            manifest[name] = {"type": tensor.tensor_type.name, "cols": int(tensor.shape[0])}
        yield name, _unpermute(gguf_tensor_to_torch(tensor), name, cfg, permute).contiguous()


def _unpermute(w: torch.Tensor, name: str, cfg: Any, permute: bool) -> torch.Tensor:
    """Q/K rows back in HF's order (they are whole rows: dequantized or raw blocks alike)."""
    if permute and name.endswith("q_proj.weight"):
        return unpermute_qk(w, cfg.num_attention_heads)
    if permute and name.endswith("k_proj.weight"):
        return unpermute_qk(w, cfg.num_key_value_heads)
    return w


def _save_weights(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str) -> None:
    """model.safetensors, or shards + model.safetensors.index.json past _SHARD_BYTES."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, paths = 0, []
    for name, t in tensors:
        if size and size + t.nbytes > _SHARD_BYTES:
            paths.append(_write_shard(shards[-1], out_dir, len(paths)))
            shards[-1], size = {}, 0
        shards[-1][name] = t
        size += t.nbytes
    paths.append(_write_shard(shards[-1], out_dir, len(paths)))
    if len(paths) == 1:
        os.rename(paths[0][0], os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, (tmp_path, names) in enumerate(paths):
        final = f"model-{i + 1:05d}-of-{len(paths):05d}.safetensors"
        os.rename(tmp_path, os.path.join(out_dir, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def _write_shard(tensors: dict[str, torch.Tensor], out_dir: str, index: int) -> tuple[str, list[str]]:
    path = os.path.join(out_dir, f"shard-{index}.tmp")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, list(tensors)


def _generation_config(reader: Any, cfg: Any) -> dict[str, Any]:
    gen: dict[str, Any] = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    for key, hf_key in _SAMPLING_KEYS.items():
        value = _field(reader, f"general.sampling.{key}")
        if value is not None:
            gen[hf_key] = value
    return {k: v for k, v in gen.items() if v is not None}
