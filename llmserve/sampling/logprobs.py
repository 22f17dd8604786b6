"""Top-N logprobs of one step, taken from the raw model logits.

The distribution is log_softmax of the logits as the model produced them, before logit bias,
bans, penalties, temperature and truncation (vLLM's default, and what OpenAI's API returns):
it answers "how likely did the model find this token", and it does not change with the
request's sampling knobs. Greedy and sampled rows are treated alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float
    rank: int  # 1 + number of tokens strictly more likely; 1 for the argmax
    top: list[tuple[int, float]]  # top-N (id, logprob), most likely first; order among ties unspecified


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs [R, V] float32 (log_softmax of raw logits), token_ids [R] int64, num_top R values >= 0."""
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [R]
    top_n = min(max(num_top), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(top_n, dim=-1)  # [R, top_n], most likely first
    # One device-to-host copy per tensor; the rest is O(R * N) Python.
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ids[:n], values[:n], strict=True)))
        for t, lp, r, ids, values, n in zip(
            token_ids.tolist(), token_logprobs.squeeze(1).tolist(), ranks.tolist(),
            top_ids.tolist(), top_values.tolist(), num_top, strict=True,
        )
    ]
