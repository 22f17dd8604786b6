"""Top-N logprobs of one step, taken from the raw model logits.

The distribution is log_softmax of the logits as the model produced them, before logit bias,
bans, penalties, temperature and truncation (vLLM's default, and what OpenAI's API returns):
it answers "how likely did the model find this token", and it does not change with the
request's sampling knobs. Greedy and sampled rows are treated alike.

On AVX-512 CPUs `logprobs_of_logits` takes them from the native kernel (kernels/cpu/sampling.cpp):
a max, an exp-sum and a counting pass per row and the candidates near the max, instead of a [R, V]
log_softmax, comparison and topk (64 rows of 49,152 with top-5 on 2 cores: 27 -> ~2 ms per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from llmserve.kernels import native


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float
    rank: int  # 1 + number of tokens strictly more likely; 1 for the argmax
    top: list[tuple[int, float]]  # top-N (id, logprob), most likely first; order among ties unspecified


def logprob_parts(logits: Tensor, token_ids: Tensor, top_n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What `token_logprobs` reads, from log_softmax of the logits, computed where they are without reading anything
    back (async scheduling copies them to the host after the step): each row's token logprob [R], rank [R], and
    top_n ids and values [R, top_n], most likely first."""
    logprobs = logits.log_softmax(dim=-1)
    lp = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > lp.unsqueeze(1)).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(top_n, dim=-1)
    return lp, ranks, top_ids, top_values


def logprobs_of_logits(logits: Tensor, token_ids: Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logits [R, V] float32: the rows' raw logits (not processed); token_ids [R] int64, num_top R values >= 0."""
    top_n = min(max(num_top), logits.shape[-1])
    if native.sampling_enabled(logits):
        token_lp, ranks, top_values, top_ids = native.logprob_rows(logits, token_ids, top_n)
        if not bool((ranks < 0).any()):  # else a row holding a NaN or no finite logit: log_softmax's answer
            return token_logprobs(token_ids, token_lp, ranks, top_ids, top_values, num_top)
    return token_logprobs(token_ids, *logprob_parts(logits, token_ids, top_n), num_top)


def token_logprobs(token_ids: Tensor, logprobs: Tensor, ranks: Tensor, top_ids: Tensor, top_values: Tensor,
                   num_top: list[int]) -> list[TokenLogprobs]:
    # One device-to-host copy per tensor; the rest is O(R * N) Python.
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ids[:n], values[:n], strict=True)))
        for t, lp, r, ids, values, n in zip(
            token_ids.tolist(), logprobs.tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(), num_top,
            strict=True,
        )
    ]
