"""The mixture-of-experts decoder (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's decoder (models/llama.py) whose MLP is, on
the layers the config makes sparse, a SparseMoeBlock: a router picks K of E experts per token and the experts run
grouped by expert (layers/moe.py); Qwen2-MoE adds a shared expert that every token runs, scaled by
sigmoid(shared_expert_gate(x)). The other layers (Qwen's `mlp_only_layers`, `decoder_sparse_step`) keep Llama's MLP.

Checkpoints hold the experts either one by one, as the hub stores them (Mixtral `block_sparse_moe.experts.N.w1/w3/w2`
for gate/up/down, Qwen `mlp.experts.N.gate_proj/up_proj/down_proj`), or stacked, as transformers 5 holds them
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]; transformers/conversion_mapping.py). Both
fill the same stacked parameters: a stacked tensor is split per expert on its way in, so every expert's part is
checked and counted alike.

The native decoder stack never runs these layers (decoder_stack.computes wants Llama's MLP on every layer), and
quantization leaves the experts and the router in the model dtype (they are not `Linear`s).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.layers.linear import default_weight_loader
from llmserve.layers.moe import StackedExperts, TopKRouter
from llmserve.models.llama import DecoderSpec, LlamaForCausalLM, LlamaMLP, LlamaModel

# one expert's tensor as the hub names it: (prefix up to `.experts`, expert, projection)
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_STACKED_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")  # transformers 5's names, no `.weight`


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    renormalize: bool  # the top-k weights rescaled to sum 1 (Mixtral; Qwen's norm_topk_prob)
    model_dtype_weights: bool  # routing weights rounded to the model dtype (Qwen) or kept fp32 (Mixtral)
    shared_expert_size: int  # intermediate size of Qwen2-MoE's shared expert; 0: none
    sparse_layers: frozenset[int]  # the layers whose MLP is a SparseMoeBlock


@dataclass(frozen=True)
class MoeDecoderSpec(DecoderSpec):
    moe: MoeSpec


def qwen_sparse_layers(cfg: Any) -> frozenset[int]:
    """Qwen MoE's sparse layers, as transformers picks them: not in mlp_only_layers, every decoder_sparse_step-th."""
    only = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = cfg.decoder_sparse_step
    return frozenset(i for i in range(cfg.num_hidden_layers)
                     if i not in only and cfg.num_experts > 0 and (i + 1) % step == 0)


class SharedExpertGate(nn.Module):
    """weight [1, H]: sigmoid(x @ weight.T), [T, 1], the share of the shared expert in each token's output."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shards = {None: (0, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, moe: MoeSpec) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ModelLoadError(f"config.json hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
        self.gate = TopKRouter(moe.num_experts, cfg.hidden_size, moe.top_k, moe.renormalize, moe.model_dtype_weights)
        self.experts = StackedExperts(moe.num_experts, cfg.hidden_size, moe.expert_size)
        shared = moe.shared_expert_size > 0
        self.shared_expert = LlamaMLP(cfg, spec, moe.shared_expert_size) if shared else None
        self.shared_expert_gate = SharedExpertGate(cfg.hidden_size) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(x) * self.shared_expert(x)
        return out


class MoeModel(LlamaModel):
    def make_mlp(self, cfg: Any, spec: DecoderSpec, layer: int) -> nn.Module:
        assert isinstance(spec, MoeDecoderSpec)
        return SparseMoeBlock(cfg, spec, spec.moe) if layer in spec.moe.sparse_layers else LlamaMLP(cfg, spec)


class MoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE families: each says its MoeDecoderSpec (decoder_spec)."""

    model_class = MoeModel
    # Grouping by expert reads each expert's token count on the host: no CUDA graphs (worker/model_runner.py).
    graph_capturable = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    def fused_name(self, name: str) -> tuple[str, str | None]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's hub name of the MoE block
        m = _EXPERT.fullmatch(name)
        if m is None:
            return super().fused_name(name)
        prefix, expert, part = m.group(1), m.group(2), _PART[m.group(3)]
        return f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}", f"{part}.{expert}"

    def checkpoint_name(self, param: str, shard: str | None) -> str:
        if shard is not None and param.endswith(_STACKED_SUFFIXES):
            part, expert = shard.split(".")
            return f"{param.rsplit('.', 1)[0]}.{expert}.{part}_proj.weight"
        return super().checkpoint_name(param, shard)

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """transformers 5's stacked expert tensors as the per-expert ones of the hub (views, no copies)."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if not name.endswith(_STACKED_SUFFIXES):
                yield name, tensor
                continue
            param = params.get(name)
            if param is None or tuple(tensor.shape) != tuple(param.shape):
                expected = "no such parameter" if param is None else f"expected shape {tuple(param.shape)}"
                raise ModelLoadError(f"tensor {name!r} of shape {tuple(tensor.shape)}: {expected}; config.json "
                                     "does not match the weights")
            prefix = name.rsplit(".", 1)[0]
            for e, expert in enumerate(tensor):
                if name.endswith("down_proj"):
                    yield f"{prefix}.{e}.down_proj.weight", expert
                else:
                    gate, up = expert.chunk(2)  # [2I, H]: gate rows, then up rows
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
