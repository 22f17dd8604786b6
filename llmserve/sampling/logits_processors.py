"""Logits processors and sampling filters, vectorised over the batch with per-row parameters.

All functions work in place on `logits` [B, V] float32 and return it. Order (the sampler's):
  1. `apply_logits_processors`: logit_bias, bans (bad words, stop ids before min_tokens), penalties.
     Greedy rows take their argmax after this step.
  2. `apply_sampling_filters` (sampled rows): temperature, top-k, top-p, min-p, each on the output
     of the previous one, like transformers' warpers. Removed tokens become -inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmserve.sampling.batch import Penalties, SamplingBatch, SamplingFilters

_NEG_INF = float("-inf")


def apply_logits_processors(logits: Tensor, batch: SamplingBatch) -> Tensor:
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        logits.index_put_((bias.rows, bias.cols), bias.values, accumulate=True)
    if batch.banned is not None:
        logits[batch.banned.rows, batch.banned.cols] = _NEG_INF
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties)
    return logits


def apply_penalties(logits: Tensor, penalties: Penalties) -> Tensor:
    # Repetition (transformers): a seen token's logit is divided by the penalty when positive and
    # multiplied when negative, so a penalty > 1 always makes it less likely. -inf stays -inf.
    if penalties.seen is not None:
        scaled = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
        logits.copy_(torch.where(penalties.seen, scaled, logits))
    # Presence / frequency (OpenAI): logit -= frequency * count + presence * (count > 0).
    if penalties.output_counts is not None:
        counts = penalties.output_counts
        logits -= penalties.frequency * counts
        logits -= penalties.presence * (counts > 0)
    return logits


def apply_sampling_filters(logits: Tensor, filters: SamplingFilters) -> Tensor:
    if filters.temperature is not None:
        logits.div_(filters.temperature)
    if filters.top_p is not None:
        apply_top_k_top_p(logits, filters.top_k, filters.top_p)
    elif filters.top_k is not None:
        apply_top_k(logits, filters.top_k, filters.max_top_k)
    if filters.min_p is not None:
        apply_min_p(logits, filters.min_p)
    return logits


def apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    # Keeps the tokens whose logit is >= the k-th largest, so ties with the k-th are all kept
    # (transformers' semantics: the filter does not depend on token order). top_k == V disables.
    vocab_size = logits.shape[-1]
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor) -> Tensor:
    # One stable descending sort serves both: ties keep vocabulary order, so the top-p boundary
    # among equally likely tokens is deterministic (lower ids first).
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [B, 1]; top_k == V keeps all
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Top-p keeps the smallest prefix whose mass reaches top_p: token i stays iff the mass of the
    # tokens before it is still < top_p. The first token always stays.
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits.masked_fill_(remove, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    # Drops tokens less likely than min_p times the most likely one (min_p == 0 keeps all).
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)
