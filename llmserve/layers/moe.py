"""Mixture-of-experts layers: top-k routing and experts run grouped by expert.

Shapes: T tokens, H hidden size, E experts, K experts per token (top-k), I an expert's intermediate size.

Routing is transformers' (5.24, Mixtral/Qwen2-MoE/Qwen3-MoE TopKRouter): a softmax over the router logits in fp32,
the top K, renormalised to sum 1 where the config says (Mixtral always; Qwen `norm_topk_prob`).

The experts run grouped: the T*K (token, expert) pairs are sorted by expert, each expert that received tokens runs one
SiLU-gated MLP over all of its tokens (two matmuls), and the weighted results are scatter-added back per token. An
expert with no tokens costs nothing. Per token, contributions add in ascending expert order, as transformers adds them.
The per-expert token counts go to the host once per layer (a device sync on CUDA: MoE models never run in CUDA
graphs, `graph_capturable`).

Weights are stacked per layer as transformers 5 holds them: gate_up_proj [E, 2I, H] (gate rows, then up rows) and
down_proj [E, H, I]. They are plain parameters, not `Linear`s: CPU packing, kernel calibration and quantization
(which act on `Linear`s) leave them in the model dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed.state import all_reduce_, shard, tp_state
from llmserve.layers.activation import SiluAndMul
from llmserve.layers.linear import ShapeMismatch, default_weight_loader, tp_columns


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, K] each token's weight per chosen expert (fp32, or the model dtype: see route)
    experts: torch.Tensor  # [T, K] int64 expert ids, distinct per token, by descending probability


def route(logits: torch.Tensor, top_k: int, renormalize: bool, model_dtype_weights: bool) -> Routing:
    """Router logits [T, E] -> the top_k experts of each token and their weights. model_dtype_weights: the weights
    rounded to the logits' dtype (Qwen MoE does; Mixtral keeps them fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(logits.dtype) if model_dtype_weights else weights, experts)


def grouped_experts(x: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor,
                    act: nn.Module) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I] -> sum over each token's experts of weight * expert(x): [T, H]."""
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)  # [T*K], pair p = (token p // K, expert flat[p])
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, each group in token order
    tokens = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, tokens)  # [T*K, H]: each expert's tokens, contiguous
    outputs, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            h = act(F.linear(rows[start:start + n], gate_up[expert]))  # [n, 2I] -> [n, I]
            outputs.append(F.linear(h, down[expert]))  # [n, H]
            start += n
    if not outputs:  # no tokens
        return torch.zeros_like(x)
    y = torch.cat(outputs) * routing.weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def expert_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    """One expert's part (shard "gate.3": expert 3's gate rows) of a stacked [E, rows, cols] parameter."""
    if shard not in param.shards:
        raise ShapeMismatch(f"unknown shard {shard!r} of a parameter of {param.shape[0]} experts")
    expert, start, end = param.shards[shard]
    rows = getattr(param, "tp_expert_rows", None)  # tensor parallelism: this rank's share of each expert's features
    if rows is not None and not shard.startswith("down"):
        first, full = rows
        if loaded.shape[0] != full:
            raise ShapeMismatch(f"expected {full} rows for expert shard {shard}, got {tuple(loaded.shape)}")
        loaded = loaded.narrow(0, first, end - start)
    loaded = tp_columns(param, loaded)
    target = param.data[expert, start:end]
    if tuple(loaded.shape) != tuple(target.shape):
        raise ShapeMismatch(f"expected shape {tuple(target.shape)} for expert shard {shard}, got {tuple(loaded.shape)}")
    target.copy_(loaded)


def _stacked(num_experts: int, parts: dict[str, int], cols: int) -> nn.Parameter:
    """An uninitialised [E, sum(parts), cols] parameter whose shards are each expert's parts ("gate.0", "up.0", ...)."""
    p = nn.Parameter(torch.empty(num_experts, sum(parts.values()), cols), requires_grad=False)
    p.weight_loader = expert_weight_loader
    p.shards = {}
    for e in range(num_experts):
        start = 0
        for part, rows in parts.items():
            p.shards[f"{part}.{e}"] = (e, start, start + rows)
            start += rows
    return p


class StackedExperts(nn.Module):
    """E SiLU-gated MLPs (H -> I -> H) in two stacked parameters, run grouped by expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        i = full = intermediate_size
        self.reduce = tp_state().size > 1  # tensor parallelism: every expert's features split, the output summed
        if self.reduce:
            start, i = shard(full, "expert intermediate size")
        self.gate_up_proj = _stacked(num_experts, {"gate": i, "up": i}, hidden_size)  # [E, 2I, H]
        self.down_proj = _stacked(num_experts, {"down": hidden_size}, i)  # [E, H, I]
        if self.reduce:
            self.gate_up_proj.tp_expert_rows = (start, full)
            self.down_proj.tp_cols = (start, i, full)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        y = grouped_experts(x, routing, self.gate_up_proj, self.down_proj, self.act)
        return all_reduce_(y) if self.reduce else y


class TopKRouter(nn.Module):
    """weight [E, H]: router logits x @ weight.T, then route(). A plain parameter (not a `Linear`), so quantization
    never moves a token's choice of experts."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool,
                 model_dtype_weights: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shards = {None: (0, num_experts)}
        self.top_k, self.renormalize, self.model_dtype_weights = top_k, renormalize, model_dtype_weights

    def forward(self, x: torch.Tensor) -> Routing:
        return route(F.linear(x, self.weight), self.top_k, self.renormalize, self.model_dtype_weights)
