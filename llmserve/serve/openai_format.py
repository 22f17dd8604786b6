"""OpenAI response pieces as plain dicts: usage, logprobs in the chat and the legacy completions
shapes, and the accumulated state of one choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.output import SequenceOutput
from llmserve.sampling.logprobs import TokenLogprobs
from llmserve.serve.token_text import TokenText


def usage(prompt_tokens: int, completion_tokens: int, prediction: tuple[int, int] | None = None,
          cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage. cached_tokens: prompt tokens taken from the prefix cache or a session rather than computed
    (prompt_tokens_details, as OpenAI reports it on every answer). prediction: a Predicted Outputs request's
    (accepted, rejected) prediction tokens, as OpenAI's completion_tokens_details reports them: drafts from the
    prediction verified and kept, and refused."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if prediction is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                            "rejected_prediction_tokens": prediction[1]}
    return out


@dataclass
class Choice:
    """One sequence's output, accumulated from its SequenceOutputs."""

    index: int
    prefix: str = ""  # echoed prompt (completions)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prediction: tuple[int, int] | None = None  # (accepted, rejected) prediction tokens so far
    cached: int = 0  # prompt tokens taken from the prefix cache or a session

    def add(self, out: SequenceOutput) -> None:
        self.text += out.new_text
        self.logprobs.extend(out.new_logprobs)
        self.num_tokens = out.num_output_tokens
        self.prediction = out.prediction_tokens
        self.cached = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def chat_logprobs(tt: TokenText, lps: list[TokenLogprobs]) -> dict[str, Any]:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    return {"content": [
        {"token": tt.text(lp.token_id), "logprob": lp.logprob, "bytes": tt.bytes(lp.token_id),
         "top_logprobs": [{"token": tt.text(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in lp.top]}
        for lp in lps
    ]}


class CompletionLogprobs:
    """The legacy completions shape: parallel lists tokens, token_logprobs, top_logprobs, text_offset.
    Offsets count characters of the choice's whole text (echoed prompt included); each token's top
    entries also hold the sampled token (OpenAI: "up to logprobs+1 elements")."""

    def __init__(self, tt: TokenText, offset: int = 0) -> None:
        self.tt = tt
        self.offset = offset

    def prompt(self, token_ids: list[int], lps: list[TokenLogprobs | None]) -> dict[str, Any]:
        """The echoed prompt's tokens: the first has no logprob (nothing precedes it), as in vLLM."""
        return self._shape([(t, None, None) if lp is None else self._row(lp) for t, lp in zip(token_ids, lps)])

    def generated(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        return self._shape([self._row(lp) for lp in lps])

    def _row(self, lp: TokenLogprobs) -> tuple[int, float, dict[str, float]]:
        top = {self.tt.text(t): v for t, v in lp.top}
        top.setdefault(self.tt.text(lp.token_id), lp.logprob)
        return lp.token_id, lp.logprob, top

    def _shape(self, rows: list[tuple[int, float | None, dict[str, float] | None]]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, top in rows:
            text = self.tt.text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def vllm_prompt_logprobs(tt: TokenText, lps: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt token and the top-N."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": tt.text(t)} for i, (t, v) in enumerate(lp.top)}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": tt.text(lp.token_id)}
        out.append(entry)
    return out


def merge_completion_logprobs(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
