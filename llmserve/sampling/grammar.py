"""Structured output in the sampler: the logits of tokens a row's grammar forbids become -inf.

Applied after the logits processors, before greedy argmax or the sampling filters, so every path
(native or torch, greedy or sampled, speculative verification) only ever sees allowed tokens. Where
bad words or min_tokens ban every token the grammar allows, the grammar wins: the row is restored to
its logits before the processors and masked again (a grammar that cannot proceed would otherwise
produce a token it refuses).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from llmserve.kernels import native
from llmserve.sampling.batch import GrammarMasks, SamplingBatch


def rows_before_processors(logits: Tensor, batch: SamplingBatch) -> Tensor | None:
    """A copy of the grammar rows' logits, kept only when a ban could leave one of them empty."""
    if batch.grammar is None or batch.banned is None:
        return None
    return logits.index_select(0, _rows(batch.grammar, logits.device))


def apply_grammar_masks(logits: Tensor, masks: GrammarMasks, before: Tensor | None = None) -> Tensor:
    """logits [B, V] in place; `before`: rows_before_processors' copy, or None."""
    bitmask = masks.bitmask.to(logits.device, non_blocking=True)
    rows = _rows(masks, logits.device)
    _mask(logits, bitmask, rows)
    if before is None:
        return logits
    empty = ~logits.index_select(0, rows).isfinite().any(dim=-1)
    if bool(empty.any()):
        stuck = rows[empty]
        logits.index_copy_(0, stuck, before[empty])
        _mask(logits, bitmask, stuck)
    return logits


def _mask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    """The native kernel on CPU (fp32 logits; 0.2 against xgrammar's 11.6 ms for 64 rows of 49,152 whose masks allow
    few tokens), xgrammar's kernel elsewhere (CUDA, other dtypes, no compiler)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and native.load() is not None and os.environ.get("LLMSERVE_SAMPLER") != "torch"):
        native.apply_token_bitmask_(logits, bitmask, rows)
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows.tolist())


def _rows(masks: GrammarMasks, device: torch.device) -> Tensor:
    return torch.tensor(masks.rows, device=device)
