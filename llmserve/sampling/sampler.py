"""Turns one step's logits into one token per sequence (plus logprobs where asked).

Steps, all vectorised over the batch with per-row parameters:
  raw logprobs (rows that ask) -> logits processors (bias, bans, penalties) -> grammar masks (structured
  output rows: forbidden tokens to -inf, sampling/grammar.py) -> greedy rows: argmax
  -> sampled rows: temperature, top-k, top-p, min-p, typical-p -> inverse CDF.
An all-greedy batch without processors is one argmax (the benchmark hot path).

Sampling draws by inverse CDF: one uniform u per row, then the first token, in token-id order, whose
cumulative probability exceeds u times the total. Rows whose filters keep few tokens (top-k, a top-p
nucleus, min-p) are filtered and drawn over their most likely candidates only
(logits_processors.truncated_candidates); the others over the whole vocabulary. Both lay the kept
tokens out in id order, so a row draws the same token from the same u either way. A seeded row draws
its u from its own generator, so its tokens do not depend on its companions; unseeded rows share one
batch-wide draw from the sampler's generator. Why not the exponential race (argmax(p_i / E_i)) over
the whole vocabulary: its [B, V] exponential draws took 70 ms per step at 64 rows of 49,152 on a
2-core CPU, and top-p's full sort 150 ms; the default top-k 50 now takes ~5 ms. The torch path's
speculative verification (`verify`) still uses the race for its residual distribution.

On AVX-512 CPUs the token choice (argmax, or the filters and the draw) runs in the native kernel
(kernels/cpu/sampling.cpp), row-parallel and without [B, V] intermediates, from the same u, so it
picks the reference's token except where float rounding of a sum decides. At 64 rows of 49,152 on 2
cores, with the batch's build: top_p 0.9 32 -> 3.1 ms per step, top_k 50 6.2 -> 1.8, greedy 2.4 -> 0.7
(BENCHMARKS.md). Speculative verification too: the kernel accepts a draft d when u < p(d) and replaces a
rejected one by an inverse-CDF draw (a second u) over p without d, the same distribution as the race.
LLMSERVE_SAMPLER=torch keeps the torch path (the reference; A/B runs). A batch with a typical_p row takes the torch
path too (the kernel has no typical filter; its set is not a prefix of the likeliest tokens either, so such a row
draws over the whole vocabulary).

`logits` is overwritten in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmserve.kernels import native
from llmserve.sampling.batch import SamplingBatch, SequenceState
from llmserve.sampling.grammar import apply_grammar_masks, rows_before_processors
from llmserve.sampling.logits_processors import (
    apply_logits_processors,
    apply_sampling_filters,
    select_filters,
    truncated_candidates,
)
from llmserve.sampling.logprobs import TokenLogprobs, logprobs_of_logits

# Exponential draws are clamped away from 0: p / 0 would be inf (or NaN for p == 0, which
# argmax would pick, i.e. a banned token).
_MIN_NOISE = torch.finfo(torch.float32).tiny

# Everything one sampling step needs, importable from here (the model runner does) or from the package.
__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SequenceState", "TokenLogprobs"]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sequence
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None
    # Speculative decoding (`Sampler.verify`): per row, whether its draft token was accepted.
    accepted: list[bool] | None = None
    # Beam search: row -> [V] log-probabilities of the next token after logit bias, bans and penalties.
    beam_logprobs: dict[int, Tensor] | None = None


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # The generator of unseeded rows is made on the logits' device at first use; seed None
        # means torch's default generator for that device.
        self._seed = seed
        self._generator: torch.Generator | None = None

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] float32, one row per sequence of `batch`."""
        raw_rows = None
        if batch.logprob_rows is not None:  # a copy before processing, which works in place
            raw_rows = logits.index_select(0, batch.logprob_rows)  # [R, V]
        _process(logits, batch)
        beams = None
        if batch.beam_rows is not None:  # beams are greedy rows: filters never touch them
            rows = torch.tensor(batch.beam_rows, device=logits.device)
            beams = dict(zip(batch.beam_rows, logits.index_select(0, rows).log_softmax(dim=-1).cpu()))
        token_ids = self._choose(logits, batch)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=self._logprobs(raw_rows, token_ids, batch),
                             beam_logprobs=beams)

    def choose(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """The batch's tokens [B] on the logits' device, not read back (async scheduling: the next step takes them
        as its inputs there). For batches without beams; logprobs are the caller's (from the logits before this,
        which processes them in place)."""
        assert batch.beam_rows is None
        _process(logits, batch)
        return self._choose(logits, batch)

    def verify(self, logits: Tensor, batch: SamplingBatch, drafts: list[int]) -> SamplerOutput:
        """Speculative decoding: row i scores the position of draft token drafts[i] (-1: no draft,
        the row after a sequence's last draft). Returns, per row, whether the draft is accepted and
        the token to emit there: the draft itself when accepted, otherwise a token drawn so that the
        emitted sequence follows the target distribution exactly.

        Drafts are deterministic proposals (n-gram lookup, a draft model's argmax), i.e. the proposal
        distribution q is a point mass on the draft d. Rejection sampling (Leviathan et al.) then
        reads: accept d with probability min(1, p(d) / q(d)) = p(d); on rejection draw from the
        residual max(p - q, 0), which is p with d removed, renormalised. Greedy rows accept when d is
        the argmax and emit the argmax. Rows without a draft sample as usual. The caller emits the
        tokens of a sequence's rows up to its first rejected row, inclusive.
        """
        raw_rows = None
        if batch.logprob_rows is not None:
            raw_rows = logits.index_select(0, batch.logprob_rows)
        draft = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        has_draft = draft >= 0
        _process(logits, batch)
        if not batch.all_greedy and native.sampling_enabled(logits) and batch.filters.typical_p is None:
            u, u2 = self._uniform(batch, logits.device), self._uniform(batch, logits.device)
            token_ids, accepted = native.verify_rows(logits, *_native_filters(logits, batch), u, draft, u2)
            if not bool((token_ids < 0).any()):  # else: the torch path below for the batch
                return SamplerOutput(token_ids=token_ids.tolist(),
                                     logprobs=self._logprobs(raw_rows, token_ids, batch),
                                     accepted=accepted.tolist())
        token_ids = self._argmax(logits)
        accepted = has_draft & (token_ids == draft)
        if not batch.all_greedy:
            probs = apply_sampling_filters(logits, batch.filters).softmax(dim=-1)  # [B, V]
            safe = draft.clamp_min(0).unsqueeze(1)
            p_draft = probs.gather(1, safe).squeeze(1)
            uniform = self._uniform(batch, logits.device)
            sampled_accept = has_draft & (uniform < p_draft)
            residual = probs.scatter(1, safe, torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
            residual_ids = residual.div_(self._exponential_noise(batch, residual)).argmax(dim=-1)
            sampled_ids = torch.where(sampled_accept, draft, residual_ids)
            if batch.greedy is None:
                token_ids, accepted = sampled_ids, sampled_accept
            else:
                token_ids = torch.where(batch.greedy, token_ids, sampled_ids)
                accepted = torch.where(batch.greedy, accepted, sampled_accept)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=self._logprobs(raw_rows, token_ids, batch),
                             accepted=accepted.tolist())

    def _uniform(self, batch: SamplingBatch, device: torch.device) -> Tensor:
        u = torch.empty(batch.size, device=device)
        if len(batch.generators) < batch.size:
            u.uniform_(generator=self._batch_generator(device))
        for row, generator in batch.generators.items():
            u[row : row + 1].uniform_(generator=generator)
        return u

    @staticmethod
    def _argmax(logits: Tensor) -> Tensor:
        if native.sampling_enabled(logits):
            ids = native.argmax_rows(logits)
            if not bool((ids < 0).any()):  # a row holding a NaN: torch's choice (the NaN's index)
                return ids
        # max(dim).indices: the same first-maximum (and NaN) semantics as argmax, and measured 1.8 ms against
        # 3.2 for argmax over [64, 49152] fp32 logits on 2 CPU cores.
        return logits.max(dim=-1).indices

    def _choose(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.all_greedy:
            return self._argmax(logits)
        u = self._uniform(batch, logits.device)  # one draw per row, whichever path takes it
        if native.sampling_enabled(logits) and batch.filters.typical_p is None:  # (the kernel has no typical_p)
            ids = _native_choice(logits, batch, u)
            if ids is not None:
                return ids
        greedy_ids = logits.argmax(dim=-1) if batch.greedy is not None else None  # before filtering
        full_rows = None  # rows left for the whole-vocabulary path; None: all
        found = truncated_candidates(logits, batch.filters)
        if found is not None:
            probs, ids, covered = found
            sampled_ids = ids.gather(1, _inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
            if batch.greedy is not None:
                covered = covered | batch.greedy  # their argmax replaces the draw below
            full_rows = (~covered).nonzero().squeeze(1)
        if full_rows is None:
            sampled_ids = _inverse_cdf(apply_sampling_filters(logits, batch.filters).softmax(dim=-1), u)
        elif full_rows.numel():
            rows = logits.index_select(0, full_rows)
            probs = apply_sampling_filters(rows, select_filters(batch.filters, full_rows)).softmax(dim=-1)
            sampled_ids.index_copy_(0, full_rows, _inverse_cdf(probs, u.index_select(0, full_rows)))
        if greedy_ids is None:
            return sampled_ids
        return torch.where(batch.greedy, greedy_ids, sampled_ids)

    def _exponential_noise(self, batch: SamplingBatch, like: Tensor) -> Tensor:
        noise = torch.empty_like(like)  # [B, V]
        if len(batch.generators) < batch.size:
            noise.exponential_(generator=self._batch_generator(like.device))
        for row, generator in batch.generators.items():
            noise[row].exponential_(generator=generator)
        return noise.clamp_min_(_MIN_NOISE)

    def _batch_generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self._seed)
        return self._generator

    def _logprobs(
        self, raw_rows: Tensor | None, token_ids: Tensor, batch: SamplingBatch
    ) -> list[TokenLogprobs | None]:
        """raw_rows: the raw logits of the rows that ask for logprobs (batch.logprob_rows)."""
        result: list[TokenLogprobs | None] = [None] * batch.size
        if raw_rows is None:
            return result
        num_top = [n for n in batch.num_logprobs if n is not None]
        rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
        per_row = logprobs_of_logits(raw_rows, token_ids.index_select(0, batch.logprob_rows), num_top)
        for row, value in zip(rows, per_row, strict=True):
            result[row] = value
        return result


def _process(logits: Tensor, batch: SamplingBatch) -> None:
    """Logits processors (bias, bans, penalties), then the grammar masks, in place."""
    before = rows_before_processors(logits, batch)
    if batch.has_processors:
        apply_logits_processors(logits, batch)
    if batch.grammar is not None:
        apply_grammar_masks(logits, batch.grammar, before)


def _native_filters(logits: Tensor, batch: SamplingBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernel's per-row (temperature, top_k, top_p, min_p): neutral where a filter is unused, temperature 0 on
    greedy rows."""
    filters, (rows, vocab) = batch.filters, logits.shape
    assert filters is not None
    temperature = (torch.ones(rows) if filters.temperature is None else filters.temperature.squeeze(1))
    if batch.greedy is not None:
        temperature = temperature.masked_fill(batch.greedy, 0.0)
    top_k = torch.full((rows,), vocab) if filters.top_k is None else filters.top_k
    top_p = torch.full((rows,), float("inf")) if filters.top_p is None else filters.top_p
    min_p = torch.zeros(rows) if filters.min_p is None else filters.min_p
    return temperature, top_k, top_p, min_p


def _native_choice(logits: Tensor, batch: SamplingBatch, u: Tensor) -> Tensor | None:
    """Every row's token from the native kernel (greedy rows: their argmax), or None when it left a row to the
    torch path (a NaN, or no finite logit)."""
    ids = native.sample_rows(logits, *_native_filters(logits, batch), u)
    return None if bool((ids < 0).any()) else ids


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [R, N] (not necessarily normalised), u [R] in [0, 1) -> per row the first position whose cumulative
    probability exceeds u times the row's total: position i with probability probs[i] / total, never a zero one."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))  # strictly below it
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
