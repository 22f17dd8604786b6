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
    # Only the listed (row, token) logits change, each pair once (the pairs are distinct).
    # Repetition (transformers): a seen token's logit is divided by the penalty when positive and
    # multiplied when negative, so a penalty > 1 always makes it less likely. -inf stays -inf.
    if penalties.seen is not None:
        rows, cols = penalties.seen.rows, penalties.seen.cols
        values, factor = logits[rows, cols], penalties.repetition[rows]
        logits[rows, cols] = torch.where(values > 0, values / factor, values * factor)
    # Presence / frequency (OpenAI): logit -= frequency * count + presence * (count > 0).
    if penalties.output_counts is not None:
        rows, cols, counts = penalties.output_counts.rows, penalties.output_counts.cols, penalties.output_counts.values
        values = logits[rows, cols] - penalties.frequency[rows] * counts
        logits[rows, cols] = values - penalties.presence[rows]
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
    if filters.typical_p is not None:
        apply_typical_p(logits, filters.typical_p)
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


def apply_typical_p(logits: Tensor, typical_p: Tensor) -> Tensor:
    # Locally typical sampling (Meister et al. 2022; transformers' TypicalLogitsWarper, TGI's): rank the tokens by how
    # far their surprisal -log p is from the distribution's entropy, and keep the closest ones until their probability
    # reaches typical_p (the token that reaches it included, and every token as close as it: ties kept); at least
    # one. inf keeps all. Tokens already at -inf stay there (p log p taken as 0).
    logp = logits.log_softmax(dim=-1)
    probs = logp.exp()
    entropy = -(logp * probs).nansum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    sorted_distance, order = distance.sort(dim=-1, stable=True)
    mass = probs.gather(1, order).cumsum(dim=-1)
    last = (mass < typical_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
    remove = sorted_distance > sorted_distance.gather(1, last)
    remove[:, 0] = False
    return logits.masked_fill_(remove.scatter(1, order, remove), _NEG_INF)


# Most candidates the truncated path takes per row without a top-k of its own (rows with one: their largest k).
MAX_CANDIDATES = 1024


def select_filters(filters: SamplingFilters, rows: Tensor) -> SamplingFilters:
    """The filters of `rows` (int64 [R]) only."""
    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(0, rows)
    return SamplingFilters(temperature=pick(filters.temperature), top_k=pick(filters.top_k),
                           max_top_k=filters.max_top_k, top_p=pick(filters.top_p), min_p=pick(filters.min_p),
                           typical_p=pick(filters.typical_p))


def truncated_candidates(logits: Tensor, filters: SamplingFilters) -> tuple[Tensor, Tensor, Tensor] | None:
    """The filtered distribution of each row over its C most likely tokens: (probs [B, C], token ids [B, C], both in
    token-id order, and covered [B] bool). Where covered, those C tokens hold every token the filters keep, with the
    probabilities apply_sampling_filters(...).softmax() gives them (up to float rounding); elsewhere (no filter
    truncates the row, or e.g. its top-p nucleus is wider than the candidates) the caller takes the full path for
    that row. None when no row can be covered. `logits` is not changed.

    Why: the full path sorts the whole vocabulary for top-p (150 ms per step at 64 rows of 49,152 on a 2-core CPU)
    and masks it for top-k (10 ms); topk(50) takes 4 ms, topk(1024) 15."""
    batch, vocab = logits.shape
    if filters.top_k is None and filters.top_p is None and filters.min_p is None:
        return None
    every_row_top_k = filters.top_k is not None and bool((filters.top_k < vocab).all())
    # One candidate past the largest k: a row cut at its k-th token is covered when the next one is strictly smaller
    # (a tie with the k-th would be kept too, and could lie outside).
    c = min(vocab, filters.max_top_k + 1 if every_row_top_k else max(MAX_CANDIDATES, filters.max_top_k + 1))
    if c > 4 * MAX_CANDIDATES:
        return None
    values, ids = logits.topk(c, dim=-1)  # descending; ties in no set order
    if filters.temperature is not None:  # as the full path divides the logits (the order stays)
        values = values / filters.temperature
    # (value descending, id ascending): the order of the full path's stable sort, so ties break the same way
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    keep = torch.ones_like(values, dtype=torch.bool)
    if filters.top_k is not None:
        kth = values.gather(1, (filters.top_k.clamp(max=c) - 1).unsqueeze(1))
        keep &= values >= kth
    masked = values.masked_fill(~keep, _NEG_INF)
    if filters.top_p is not None:
        probs = masked.softmax(dim=-1)  # over the row's top-k set, as the full path
        no_top_k = (torch.ones(batch, dtype=torch.bool, device=logits.device) if filters.top_k is None
                    else filters.top_k >= vocab)
        if bool(no_top_k.any()):  # those rows' top-p reads probabilities over the whole vocabulary
            scaled = logits if filters.temperature is None else logits / filters.temperature
            probs = torch.where(no_top_k.unsqueeze(1), scaled.softmax(dim=-1).gather(1, ids), probs)
        remove = probs.cumsum(dim=-1) - probs >= filters.top_p.unsqueeze(1)
        remove[:, 0] = False
        keep &= ~remove
        masked.masked_fill_(remove, _NEG_INF)
    if filters.min_p is not None:
        probs = masked.softmax(dim=-1)
        keep &= ~(probs < probs[:, :1] * filters.min_p.unsqueeze(1))
        masked.masked_fill_(~keep, _NEG_INF)
    # Each filter keeps a prefix of the sorted candidates. Covered: the last kept one is above every token left out
    # (they are <= the last candidate; an equal one would tie with it), or nothing is left out.
    last_kept = values.gather(1, (keep.sum(dim=-1, keepdim=True) - 1).clamp_(min=0))
    covered = ((last_kept > values[:, -1:]).squeeze(1) if c < vocab
               else torch.ones(batch, dtype=torch.bool, device=logits.device))
    if filters.typical_p is not None:  # a typical set is no prefix of the likeliest tokens: the full path
        covered &= torch.isinf(filters.typical_p)
    if not bool(covered.any()):
        return None
    probs = masked.softmax(dim=-1)
    back = ids.argsort(dim=-1)  # token-id order, as the full path's probabilities are laid out
    return probs.gather(1, back), ids.gather(1, back), covered
