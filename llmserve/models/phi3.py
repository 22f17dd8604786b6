"""Phi-3 (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini): Llama's decoder (models/llama.py) whose checkpoint stores q/k/v
and gate/up already fused (`qkv_proj`, `gate_up_proj`; split here into our shards), with longrope scaling (short and
long factors, layers/rotary.py), partial rotary where configured (Phi-4-mini rotates 3/4 of each head), and one
optional sliding window (config.sliding_window) on every layer. No biases."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from llmserve.errors import ModelLoadError
from llmserve.models.llama import DecoderSpec, LlamaForCausalLM, head_dim_of
from llmserve.models.mistral import one_window_spec


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        return one_window_spec(cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's fused tensors as the per-projection ones LlamaForCausalLM.load_weights reads."""
        cfg = self.config
        d = head_dim_of(cfg)
        q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
        fused = {".qkv_proj.": ((".q_proj.", ".k_proj.", ".v_proj."), [q, kv, kv]),
                 ".gate_up_proj.": ((".gate_proj.", ".up_proj."), [i, i])}
        for name, tensor in weights:
            key = next((k for k in fused if k in name), None)
            if key is None:
                yield name, tensor
                continue
            parts, sizes = fused[key]
            if tensor.shape[0] != sum(sizes):
                raise ModelLoadError(f"tensor {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                                     f"({' + '.join(map(str, sizes))}); config.json does not match the weights")
            for part, rows in zip(parts, tensor.split(sizes)):
                yield name.replace(key, part), rows
