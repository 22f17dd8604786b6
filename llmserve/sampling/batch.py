"""Per-step sampling tensors, built once from the sequences of one decoding step.

Only what some row uses is built: an all-greedy batch without logits processors carries no
tensors at all, so the sampler's hot path is one argmax. Python work per step is O(batch) with
small constants, except that rows using penalties pay O(their prompt + output length) to list
their (row, token) pairs, and rows with bad words pay O(total bad-word length).

Row conventions: every per-row tensor has one entry per sequence, in `seqs` order. Rows that do
not use a filter hold its neutral value (temperature 1, top_k = V, top_p = inf, min_p 0, typical_p inf), so
the sampler applies each filter to the whole batch without indexing.
"""

from __future__ import annotations

import array
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from llmserve.sampling.params import SamplingParams

_NEUTRAL = SamplingParams()  # temperature 1, no truncation: what a greedy row holds in the filter tensors


@dataclass
class SequenceState:
    """What the sampler needs from one sequence this step; the engine fills it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Seeded from params.seed by the engine (see `seeded_generator`) and kept across steps, so a
    # seeded sequence draws the same noise whatever else is in the batch. None when unseeded.
    generator: torch.Generator | None = None
    # Structured output: the tokens the grammar allows next, a bitmask row ([ceil(V / 32)] int32, bit t of
    # word t // 32 = token t); None for an unconstrained row.
    token_mask: Tensor | None = None


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SparseEntries:
    """(row, token) entries of a [B, V] tensor: logit biases, or banned tokens (values None)."""

    rows: Tensor  # [N] int64
    cols: Tensor  # [N] int64
    values: Tensor | None  # [N] float32


@dataclass
class Penalties:
    """Inputs of the repetition / presence / frequency penalties; a part is None when no row uses it. The tokens
    are listed as distinct (row, token) pairs, not as [B, V] masks: applying them touches only those logits
    (measured 20 ms against ~0.5 for 64 rows of 49,152 with 400 tokens each on a 2-core CPU)."""

    repetition: Tensor | None  # [B] float32, 1.0 where unused
    seen: SparseEntries | None  # tokens in the prompt or output (repetition rows only); values None
    presence: Tensor | None  # [B] float32, 0.0 where unused
    frequency: Tensor | None  # [B] float32, 0.0 where unused
    output_counts: SparseEntries | None  # tokens in the output, values their occurrences (presence/frequency rows)


@dataclass
class SamplingFilters:
    """Per-row temperature and truncation of the sampled rows; a field is None when no row uses it."""

    temperature: Tensor | None  # [B, 1] float32
    top_k: Tensor | None  # [B] int64 in [1, V]; V means disabled
    max_top_k: int  # largest enabled top_k (0 when top_k is None): bounds a topk() instead of a sort
    top_p: Tensor | None  # [B] float32; inf means disabled
    min_p: Tensor | None  # [B] float32
    typical_p: Tensor | None = None  # [B] float32; inf means disabled


@dataclass
class GrammarMasks:
    """The rows under a grammar and what each may produce next."""

    rows: list[int]  # ascending
    bitmask: Tensor  # [B, ceil(V / 32)] int32 on the CPU; rows not listed are all ones (everything allowed)


@dataclass
class SamplingBatch:
    size: int
    vocab_size: int
    all_greedy: bool
    greedy: Tensor | None  # [B] bool; None when all rows or no row is greedy
    logit_bias: SparseEntries | None
    banned: SparseEntries | None  # bad words and stop ids before min_tokens; set to -inf
    penalties: Penalties | None
    filters: SamplingFilters | None  # None when all rows are greedy
    generators: dict[int, torch.Generator]  # row -> its own generator, sampled seeded rows only
    num_logprobs: list[int | None]  # per row: top-N logprobs to return, None = none
    logprob_rows: Tensor | None  # [R] int64: rows whose num_logprobs is not None
    beam_rows: list[int] | None = None  # rows of beam-search beams: the sampler returns their log-probabilities
    grammar: GrammarMasks | None = None  # structured-output rows and their allowed tokens

    @property
    def has_processors(self) -> bool:
        return self.logit_bias is not None or self.banned is not None or self.penalties is not None

    @classmethod
    def build(cls, seqs: list[SequenceState], vocab_size: int, device: torch.device) -> SamplingBatch:
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            size=len(seqs),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy=None if all_greedy or not any(greedy) else torch.tensor(greedy, device=device),
            logit_bias=_joined(_watermark(seqs, vocab_size, device), _logit_bias(params, vocab_size, device)),
            banned=_banned(seqs, vocab_size, device),
            penalties=_penalties(seqs, vocab_size, device),
            filters=None if all_greedy else _filters(params, greedy, vocab_size, device),
            generators=_generators(seqs, greedy),
            num_logprobs=[p.logprobs for p in params],
            logprob_rows=torch.tensor(logprob_rows, device=device) if logprob_rows else None,
            beam_rows=[i for i, p in enumerate(params) if p.beam_width] or None,
            grammar=_grammar_masks(seqs),
        )


# TGI's watermark (Kirchenbauer et al. 2023, "A Watermark for Large Language Models", its simple_1 scheme, as
# text-generation-inference applies it): at each step a pseudo-random green list of WATERMARK_GAMMA of the vocabulary,
# drawn by torch.randperm from a CPU generator seeded with WATERMARK_HASH_KEY times the sequence's previous token, gets
# WATERMARK_DELTA added to its logits: a logit bias of the step (joined to logit_bias's entries), so before the bans,
# the penalties and the sampling filters, greedy rows too. A
# detector that knows the key counts the green tokens of a text. TGI's environment variables set gamma and delta.
WATERMARK_GAMMA = float(os.environ.get("WATERMARK_GAMMA", 0.5))
WATERMARK_DELTA = float(os.environ.get("WATERMARK_DELTA", 2.0))
WATERMARK_HASH_KEY = 15485863


def watermark_greenlist(prev_token: int, vocab_size: int, gamma: float = WATERMARK_GAMMA) -> Tensor:
    """The green list of the step after `prev_token` (int64 token ids)."""
    generator = torch.Generator().manual_seed(WATERMARK_HASH_KEY * prev_token)
    return torch.randperm(vocab_size, generator=generator)[:int(vocab_size * gamma)]


def _watermark(seqs: list[SequenceState], vocab_size: int, device: torch.device) -> SparseEntries | None:
    rows = [i for i, s in enumerate(seqs) if s.params.watermark]
    if not rows:
        return None
    lists = []
    for i in rows:
        s = seqs[i]
        prev = s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1]
        lists.append(watermark_greenlist(prev, vocab_size))
    cols = torch.cat(lists)
    row_ids = torch.tensor(rows).repeat_interleave(torch.tensor([len(g) for g in lists]))
    return SparseEntries(rows=row_ids.to(device), cols=cols.to(device),
                         values=torch.full((len(cols),), WATERMARK_DELTA, device=device))


def _joined(a: SparseEntries | None, b: SparseEntries | None) -> SparseEntries | None:
    """Two sets of logit-bias entries as one (a (row, token) in both gets both: the bias is added with accumulate)."""
    if a is None or b is None:
        return a if b is None else b
    return SparseEntries(torch.cat((a.rows, b.rows)), torch.cat((a.cols, b.cols)), torch.cat((a.values, b.values)))


def _logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device) -> SparseEntries | None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            # Ids outside the logits cannot be produced: skipped here (the engine should refuse them with a 400).
            if 0 <= token < vocab_size:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if not rows:
        return None
    return SparseEntries(
        rows=torch.tensor(rows, device=device),
        cols=torch.tensor(cols, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _banned(seqs: list[SequenceState], vocab_size: int, device: torch.device) -> SparseEntries | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(seqs):
        tokens = _bad_word_bans(s.params.bad_words_ids, s.output_token_ids)
        if len(s.output_token_ids) < s.params.min_tokens:
            tokens.extend(s.params.stop_token_ids)
        tokens = [t for t in tokens if 0 <= t < vocab_size]
        rows.extend([i] * len(tokens))
        cols.extend(tokens)
    if not rows:
        return None
    return SparseEntries(rows=torch.tensor(rows, device=device), cols=torch.tensor(cols, device=device), values=None)


def _bad_word_bans(bad_words_ids: list[list[int]], output: list[int]) -> list[int]:
    # A bad word is matched against the generated tokens only, not the prompt: the guarantee is that
    # the output never contains the sequence (as in vLLM), and a prompt that happens to end with a
    # prefix does not constrain the first generated token. A one-token word is always banned.
    bans = []
    for word in bad_words_ids:
        prefix_len = len(word) - 1
        if prefix_len < 0 or prefix_len > len(output):
            continue
        if prefix_len == 0 or output[-prefix_len:] == word[:-1]:
            bans.append(word[-1])
    return bans


def _penalties(seqs: list[SequenceState], vocab_size: int, device: torch.device) -> Penalties | None:
    rep_rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    count_rows = [
        i for i, s in enumerate(seqs) if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
    ]
    if not rep_rows and not count_rows:
        return None
    seen = counts = None
    if rep_rows:
        pairs = _distinct_tokens(seqs, rep_rows, with_prompt=True, vocab_size=vocab_size, device=device)
        seen = SparseEntries(rows=pairs.rows, cols=pairs.cols, values=None)
    if count_rows:
        counts = _distinct_tokens(seqs, count_rows, with_prompt=False, vocab_size=vocab_size, device=device)

    def column(name: str, used: bool) -> Tensor | None:
        values = [getattr(s.params, name) for s in seqs]
        return torch.tensor(values, dtype=torch.float32, device=device) if used else None

    return Penalties(
        repetition=column("repetition_penalty", bool(rep_rows)),
        seen=seen,
        presence=column("presence_penalty", bool(count_rows)),
        frequency=column("frequency_penalty", bool(count_rows)),
        output_counts=counts,
    )


def _distinct_tokens(
    seqs: list[SequenceState], rows: list[int], with_prompt: bool, vocab_size: int, device: torch.device
) -> SparseEntries:
    # The distinct (row, token id) pairs of the given rows, values their occurrences (float32). Prompt ids are < V
    # (the engine embedded them) and output ids came from this sampler, so no range check is needed.
    ids: list[int] = []
    lengths: list[int] = []
    for i in rows:
        s = seqs[i]
        tokens = s.prompt_token_ids + s.output_token_ids if with_prompt else s.output_token_ids
        ids.extend(tokens)
        lengths.append(len(tokens))
    row_ids = torch.tensor(rows, device=device).repeat_interleave(torch.tensor(lengths, device=device))
    # Through array: torch.tensor(list) took 2.4 ms for 64 rows of 400 ids, array + frombuffer 0.7.
    token_ids = torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.zeros(0, dtype=torch.int64)
    keys, occurrences = (row_ids * vocab_size + token_ids.to(device)).unique(return_counts=True)
    return SparseEntries(rows=keys // vocab_size, cols=keys % vocab_size, values=occurrences.to(torch.float32))


def _filters(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> SamplingFilters:
    # Greedy rows took their argmax before filtering: they hold neutral values here.
    rows = [_NEUTRAL if g else p for p, g in zip(params, greedy, strict=True)]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in rows]
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in rows]
    temperature = [p.temperature for p in rows]
    min_p = [p.min_p for p in rows]
    typical_p = [p.typical_p if p.typical_p < 1.0 else float("inf") for p in rows]

    def column(values: list[float], used: bool) -> Tensor | None:
        return torch.tensor(values, dtype=torch.float32, device=device) if used else None

    enabled_ks = [k for k in top_k if k < vocab_size]
    temperature_column = column(temperature, any(t != 1.0 for t in temperature))
    return SamplingFilters(
        temperature=None if temperature_column is None else temperature_column.unsqueeze(1),
        top_k=torch.tensor(top_k, device=device) if enabled_ks else None,
        max_top_k=max(enabled_ks, default=0),
        top_p=column(top_p, any(p < 1.0 for p in top_p)),
        min_p=column(min_p, any(p > 0.0 for p in min_p)),
        typical_p=column(typical_p, any(p < 1.0 for p in typical_p)),
    )


def _grammar_masks(seqs: list[SequenceState]) -> GrammarMasks | None:
    rows = [i for i, s in enumerate(seqs) if s.token_mask is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), seqs[rows[0]].token_mask.shape[-1]), -1, dtype=torch.int32)
    for i in rows:
        bitmask[i] = seqs[i].token_mask
    return GrammarMasks(rows, bitmask)


def _generators(seqs: list[SequenceState], greedy: list[bool]) -> dict[int, torch.Generator]:
    generators = {}
    for i, (s, g) in enumerate(zip(seqs, greedy, strict=True)):
        if s.params.seed is not None and s.generator is None:
            raise ValueError(f"sequence {i} has seed {s.params.seed} but no generator: set "
                             "SequenceState.generator = seeded_generator(seed, device) once and keep it")
        if s.generator is not None and not g:
            generators[i] = s.generator
    return generators
