"""Reading a PEFT LoRA adapter and fitting it to a loaded model.

A PEFT checkpoint directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, per-module
`rank_pattern` / `alpha_pattern`, `target_modules`) and `adapter_model.safetensors` (or the older
`adapter_model.bin`), whose tensors are named `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). PEFT's layer computes base(x) + lora_B(lora_A(x)) * scaling, with scaling =
alpha / r (alpha / sqrt(r) under rsLoRA).

Our models fuse q/k/v into one `qkv_proj` and gate/up into `gate_up_proj` (models/llama.py), so each adapted
module maps to (our linear layer, its shard); the adapter's pairs on one of our layers are stacked into one
A [sum of ranks, in] and one B [out, sum of ranks] whose blocks put each shard's update on that shard's rows (zeros
elsewhere), with the scaling folded into B: one x @ A.T @ B.T per layer and adapter (A and B kept transposed). Everything that does not fit
(another base model's shapes, a module the model lacks or we cannot adapt, DoRA, biases, embeddings, a rank over
the limit) is a clear error naming it, before anything is registered.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmserve.errors import InvalidRequestError
from llmserve.layers.linear import Linear

_CONFIG = "adapter_config.json"
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_uids = itertools.count(1)


class AdapterError(InvalidRequestError):
    """An adapter that cannot be loaded: the message names the adapter and what is wrong."""

    def __init__(self, name: str, message: str, param: str = "adapters") -> None:
        super().__init__(f"LoRA adapter {name!r}: {message}", param=param)


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's update on one of our linear layers: y += (x @ at) @ bt (scaling folded into bt). Kept
    transposed, in the layout the matmuls read."""

    at: torch.Tensor  # [in, R], R = the sum of the ranks of the checkpoint modules on this layer
    bt: torch.Tensor  # [R, out]


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter. `uid` is unique per load: the prefix cache and sessions key KV by it, so KV computed under
    one adapter (or an earlier adapter of the same name) is never served to another."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[str, LoRAWeights]  # our linear layer's module name -> its update
    target_modules: list[str]  # the checkpoint's module names it adapts (short forms, e.g. q_proj)
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def nbytes(self) -> int:
        return sum(w.at.nbytes + w.bt.nbytes for w in self.weights.values())

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank, "target_modules": self.target_modules,
                "bytes": self.nbytes}


def read_adapter(name: str, path: str, model: nn.Module, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """Read and check the PEFT adapter at `path` against `model` (our loaded model). Touches nothing shared: it may
    run on any thread while the engine steps."""
    if not isinstance(path, str) or not path:
        raise AdapterError(name, f"the path must be a non-empty string, got {path!r}")
    if not os.path.isdir(path):
        raise AdapterError(name, f"{path!r} is not a directory (a PEFT adapter directory holds {_CONFIG} and "
                                 f"{_WEIGHTS[0]})")
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    pairs = _pairs(name, tensors)
    layers = _adaptable_layers(model)
    fused_name = getattr(model, "fused_name", None)
    if fused_name is None:
        raise AdapterError(name, f"{type(model).__name__} does not take LoRA adapters (text models only for now)")

    # our layer -> [(row range of its output, A, B scaled)], in checkpoint order
    parts: dict[str, list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for module, (a, b) in pairs.items():
        target, shard = fused_name(module + ".weight")
        ours = target.removesuffix(".weight")
        layer, shards = layers.get(ours, (None, {}))
        if layer is None or not target.endswith(".weight"):
            raise AdapterError(name, f"it adapts {module!r}, which this model lacks or llmserve cannot adapt (LoRA "
                                     "runs on the decoder's linear layers: q/k/v/o and gate/up/down projections)")
        rows = shards.get(shard)
        if rows is None:
            raise AdapterError(name, f"it adapts {module!r}, which this model fuses differently")
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise AdapterError(name, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a "
                                     "rank-r pair ([r, in] and [out, r])")
        if a.shape[1] != layer.in_features or b.shape[0] != rows[1] - rows[0]:
            raise AdapterError(name, f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this "
                                     f"model's layer ({layer.in_features} inputs, {rows[1] - rows[0]} outputs): the "
                                     "adapter was trained for another base model")
        if r > max_rank:
            raise AdapterError(name, f"{module} has rank {r}, over max_lora_rank={max_rank} (raise max_lora_rank to "
                                     "load it)")
        rank = max(rank, r)
        scale = _scaling(config, module, r)
        parts.setdefault(ours, []).append((rows, a, b.float() * scale))

    weights = {}
    for ours, entries in parts.items():
        layer = layers[ours][0]
        total = sum(a.shape[0] for _, a, _ in entries)
        big_a = torch.empty(total, layer.in_features, dtype=dtype, device=device)
        big_b = torch.zeros(layer.out_features, total, dtype=dtype, device=device)
        col = 0
        for (lo, hi), a, b in entries:
            r = a.shape[0]
            big_a[col:col + r] = a
            big_b[lo:hi, col:col + r] = b
            col += r
        weights[ours] = LoRAWeights(big_a.t().contiguous(), big_b.t().contiguous())
    short = sorted({m.rsplit(".", 1)[-1] for m in pairs})
    return LoRAAdapter(name, path, rank, weights, short)


def _read_config(name: str, path: str) -> dict[str, Any]:
    file = os.path.join(path, _CONFIG)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(name, f"{path!r} has no {_CONFIG} (is it a PEFT adapter directory?)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(name, f"{file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(name, f"{file} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(name, f"peft_type {kind!r} is not supported (LoRA adapters only)")
    if config.get("use_dora"):
        raise AdapterError(name, "DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(name, f"bias={config['bias']!r} is not supported (adapters that train biases)")
    if config.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save {config['modules_to_save']} is not supported (adapters that "
                                 "replace whole modules such as the LM head)")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(name, f"{_CONFIG}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(name, f"{_CONFIG}: {key} must be an object")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    for filename in _WEIGHTS:
        file = os.path.join(path, filename)
        if not os.path.isfile(file):
            continue
        try:
            if filename.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file)
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
            raise AdapterError(name, f"{file} could not be read: {type(e).__name__}: {e}") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterError(name, f"{file} does not hold a dictionary of tensors")
        return tensors
    raise AdapterError(name, f"{path!r} has no {_WEIGHTS[0]} (nor {_WEIGHTS[1]})")


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = ("embedding adapters" if "lora_embedding" in key else "DoRA magnitudes" if "magnitude" in key
                    else "LoRA biases" if "lora_" in key else "tensors other than lora_A / lora_B")
            raise AdapterError(name, f"tensor {key!r} is not supported ({what})")
        found.setdefault(m["module"], {})[m["ab"]] = tensor
    if not found:
        raise AdapterError(name, "the checkpoint holds no lora_A / lora_B tensors")
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(name, f"{module} has no lora_{missing} weight")
        if not ab["A"].is_floating_point() or not ab["B"].is_floating_point():
            raise AdapterError(name, f"{module}: lora weights must be floating point")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _adaptable_layers(model: nn.Module) -> dict[str, tuple[Linear, dict[str | None, tuple[int, int]]]]:
    """Our linear layers by module name, each with its shards' output rows (None: all of them)."""
    layers = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Linear):
            shards = getattr(module, "shard_sizes", None)
            if shards:
                offsets, start = {}, 0
                for shard, size in shards.items():
                    offsets[shard] = (start, start + size)
                    start += size
                offsets[None] = (0, module.out_features)
            else:
                offsets = {None: (0, module.out_features)}
            layers[module_name] = (module, offsets)
    return layers


def _pattern(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the module's name or a dotted suffix of it."""
    for key, value in patterns.items():
        try:
            hit = re.fullmatch(rf"(.*\.)?({key})", module)
        except re.error:
            hit = module == key or module.endswith("." + key)
        if hit:
            return value
    return None


def _scaling(config: dict[str, Any], module: str, r: int) -> float:
    alpha = _pattern(config.get("alpha_pattern") or {}, module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)
