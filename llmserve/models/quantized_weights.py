"""Loading checkpoints whose weights come block-quantized: GGUF (the conversion cache keeps the raw blocks, see
models/gguf_loader.py), AWQ and GPTQ (config.json's quantization_config, see models/awq_gptq.py).

Which layers run on their blocks (layers/quant_blocks.py) and which are dequantized at load:
- AWQ / GPTQ: every quantized linear runs on its blocks, on any device (the native kernel on AVX-512 or AVX2 CPUs, the Triton
  kernel kernels/triton/qblock.py on CUDA, the torch reference elsewhere). There is nothing else to run:
  --quantization int8 / w8a8 are refused; --quantization awq / gptq (vLLM's flag, LMDeploy's model_format) only
  check that the checkpoint is of that method (check_checkpoint_method).
- GGUF: its Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K linears, and the embedding / LM head, run on their blocks by
  default where the native kernel runs (a CPU with AVX-512, or AVX2 and FMA): faster and smaller than dequantized weights. The
  dequantized weights (the cache's fp32 copy, exactly gguf.quants' values, in the model dtype: as before) instead
  where the user asks --quantization int8 / w8a8 (which quantize those), dtype float32 (the exact reference: the
  kernel rounds activations to int8), LLMSERVE_GGUF_NATIVE=0, on CUDA (the Triton kernel could run 4/8-bit blocks,
  but GGUF on CUDA is not switched over to it yet), and for tensors of other types (Q2_K, Q3_K, Q5_0, IQ*, ...). A
  fused layer whose shards differ in bit width or group (a Q4_K q_proj beside a Q6_K v_proj, as Q4_K_M and Q5_K_M
  files have) runs on their common form (quant_blocks.concat: the widest codes in the smallest group, exact).

A linear taking blocks gets a placeholder weight on the meta device before load_weights (expect_blocks), so no
full-precision copy is ever allocated, and its packed BlockWeight after (finish_blocks).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmserve.config import QUANTIZE_AT_LOAD, EngineConfig
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.kernels import native
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear
from llmserve.layers.quant_blocks import BlockTensor, common_kind, expect_blocks, finish_blocks, fits
from llmserve.models import awq_gptq, gguf_blocks

log = logging.getLogger(__name__)

# written by gguf_loader beside the dequantized model.safetensors: the raw blocks (a safetensors file named so that
# no loader takes it for weights) and {hf name: {"type": "Q4_1", "cols": 576}}
GGUF_BLOCKS = "llmserve_gguf_blocks.data"
GGUF_MANIFEST = "llmserve_gguf_blocks.json"


def load_checkpoint(net: nn.Module, model_dir: str, weights: Iterable[tuple[str, Any]], names: list[str],
                    config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
    """net.load_weights over `weights` (every checkpoint tensor; `names`: theirs, known before reading), with the
    quantized ones as blocks or dequantized as the module docstring says."""
    manifest_path = os.path.join(model_dir, GGUF_MANIFEST)
    qc = awq_gptq.read_quant_config(_read_json(os.path.join(model_dir, "config.json")), model_dir)
    if qc is not None:
        if config.quantization in QUANTIZE_AT_LOAD:
            raise ModelLoadError(f"{model_dir}: the checkpoint is already quantized ({qc.method}, {qc.bits}-bit); "
                                 f"drop quantization={config.quantization!r}")
        if config.tp > 1:  # (their blocks are not sliced by rank)
            raise ModelLoadError(f"{model_dir}: {qc.method} checkpoints run with tp=1 so far")
        layers = awq_gptq.quantized_layers(names)
        weights = awq_gptq.group_tensors(weights, qc, layers)
        kinds = {f"{p}.weight": (qc.bits, qc.group) for p in layers}
        native_names = set(kinds)
    elif os.path.isfile(manifest_path) and os.path.isfile(os.path.join(model_dir, GGUF_BLOCKS)):
        manifest = _read_json(manifest_path)
        kinds = {name: gguf_blocks.KINDS[t["type"]] for name, t in manifest.items() if t["type"] in gguf_blocks.KINDS}
        native_names = set(kinds) if gguf_native(config, device) else set()
        weights = _gguf_tensors(weights, manifest, native_names, os.path.join(model_dir, GGUF_BLOCKS))
    else:
        return net.load_weights(weights)
    layers = _block_layers(net, kinds, native_names)
    if layers:
        taken = {n for prefix, layer in layers.items() for n in _checkpoint_names(net, prefix, layer)}
        weights = _dequantize_rest(weights, taken)
        for layer in layers.values():
            expect_blocks(layer)
    net.load_weights(weights)
    for prefix, layer in layers.items():
        try:
            finish_blocks(layer, device)
        except ValueError as e:  # shards that cannot be fused (act-order ones with different g_idx)
            raise ModelLoadError(f"{model_dir}: {prefix}: {e}") from None
        if isinstance(layer, VocabEmbedding):
            layer.dtype = dtype  # of its lookups
    if layers:
        nbytes = sum(layer.qblocks.nbytes for layer in layers.values())
        log.info("%d layers run on their quantized blocks (%.1f MB)", len(layers), nbytes / 2**20)


def check_checkpoint_method(model_dir: str, config: EngineConfig) -> None:
    """quantization="awq" / "gptq" names the checkpoint's own format (vLLM's --quantization awq, LMDeploy's
    model_format="awq"): refused where the checkpoint is not of that method, rather than loaded as whatever it is."""
    want = config.quantization
    if config.load_format == "dummy":
        raise InvalidRequestError(f"quantization={want!r} names the checkpoint's own weights, and load_format='dummy' "
                                  "reads none (its random weights are unquantized): drop one of them",
                                  param="quantization")
    qc = awq_gptq.read_quant_config(_read_json(os.path.join(model_dir, "config.json")), model_dir)
    if qc is None:
        has = ("a GGUF file's blocks" if os.path.isfile(os.path.join(model_dir, GGUF_MANIFEST))
               else "no quantization_config (unquantized weights)")
        raise ModelLoadError(f"{model_dir}: quantization={want!r} names the checkpoint's format, but the checkpoint "
                             f"has {has}; drop quantization")
    if qc.method != want:
        raise ModelLoadError(f"{model_dir}: quantization={want!r}, but the checkpoint is {qc.method} ({qc.bits}-bit); "
                             f"use quantization={qc.method!r} or drop it")


def gguf_native(config: EngineConfig, device: torch.device) -> bool:
    """Whether a GGUF's quantized tensors run on their blocks (see the module docstring) rather than dequantized."""
    return (config.quantization not in QUANTIZE_AT_LOAD and config.dtype != "float32" and device.type == "cpu"
            and config.tp == 1
            and os.environ.get("LLMSERVE_GGUF_NATIVE", "1") != "0" and native.qblock_usable())


def checkpoint_names(files: list[str]) -> list[str]:
    """The tensor names of safetensors files, from their headers only."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                names.extend(f.keys())
        except (SafetensorError, OSError) as e:  # as iter_safetensors words it (models/loader.py)
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e}); it may be truncated or "
                                 "corrupt: download or convert it again") from None
    return names


def _checkpoint_names(net: nn.Module, prefix: str, layer: nn.Module) -> list[str]:
    param = f"{prefix}.weight"
    return [net.checkpoint_name(param, s) for s in layer.weight.shards]


def _block_layers(net: nn.Module, kinds: dict[str, tuple[int, int]], native_names: set[str]) -> dict[str, nn.Module]:
    """The linears / embeddings all of whose shards arrive as blocks, of kinds with a common one (shards of a fused
    layer may differ: quant_blocks.concat widens them), in the kernel's columns and groups (quant_blocks.fits)."""
    chosen = {}
    for prefix, m in net.named_modules():
        if not isinstance(m, (Linear, VocabEmbedding)) or getattr(m, "weight", None) is None:
            continue
        names = _checkpoint_names(net, prefix, m)
        if not all(n in native_names for n in names):
            continue
        cols = m.weight.shape[1]
        kind = common_kind({(bits, cols if group == -1 else group) for bits, group in (kinds[n] for n in names)})
        if kind is not None and fits(cols, kind[1]):
            chosen[prefix] = m
    return chosen


def _gguf_tensors(weights: Iterable[tuple[str, torch.Tensor]], manifest: dict[str, dict[str, Any]],
                  native_names: set[str], blocks_path: str) -> Iterator[tuple[str, Any]]:
    """The dequantized checkpoint, with the tensors in native_names replaced by their blocks (BlockTensor); their
    fp32 copies (mmap-backed views) are never read."""
    from safetensors import safe_open

    with safe_open(blocks_path, framework="pt", device="cpu") as blocks:
        for name, t in weights:
            if name in native_names:
                info = manifest[name]
                yield name, gguf_blocks.block_tensor(blocks.get_tensor(name), info["type"], info["cols"])
            else:
                yield name, t


def _dequantize_rest(weights: Iterable[tuple[str, Any]], taken: set[str]) -> Iterator[tuple[str, Any]]:
    """Blocks for a layer that does not take them (a fused layer with other shards plain) as fp32."""
    for name, t in weights:
        yield name, (t.dequantize() if isinstance(t, BlockTensor) and name not in taken else t)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None
