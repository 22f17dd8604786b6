"""One sequence the engine generates: its tokens, how many are in the KV cache, and its state."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from llmserve.engine.pooling import Pooling
    from llmserve.lora import LoRAAdapter
    from llmserve.sampling.logprobs import TokenLogprobs
    from llmserve.structured.matcher import GrammarState
    from llmserve.vl.inputs import MultiModalInputs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted (then num_computed_tokens == 0)
    RUNNING = "running"  # owns KV blocks; prefilling in chunks or decoding
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_new_tokens or session_len reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Prediction:
    """A request's predicted output (OpenAI's Predicted Outputs, GenerationConfig.prediction) as tokens, where its
    output stands in them (engine/speculative.py's PredictionProposer moves the cursor), and its drafts' counts."""

    token_ids: list[int]
    cursor: int = 0  # the predicted token expected next (len(token_ids): past the end)
    seen: int = 0  # output tokens the cursor accounts for
    accepted: int = 0  # drafts verified and kept
    rejected: int = 0  # drafts verified and refused
    length: int = 0  # drafts to propose next (0: as many as the step allows)
    proposed: int = 0  # drafts verified in the step whose tokens align() has not seen yet
    aligned: bool = True  # whether the output's end was found in the prediction (at the cursor) after its last step

    @functools.cached_property
    def array(self) -> np.ndarray:
        """token_ids as int64, made once: realignment searches it every step the output is off the prediction."""
        return np.asarray(self.token_ids, dtype=np.int64)


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Request:
    """A single sequence. `n > 1` is expanded by the engine into n Requests sharing a parent id.

    Invariant: 0 <= num_computed_tokens <= num_tokens; the first num_computed_tokens of
    token_ids have their K/V in the blocks the KV-cache manager holds for this request.
    """

    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens; appended in place
    num_prompt_tokens: int
    sampling: SamplingParams
    max_new_tokens: int
    max_total_tokens: int  # session_len: prompt + output never exceed it
    parent_id: str = ""
    index: int = 0  # which of the parent's n samples this is
    # n > 1: the first sibling, whose computed full prompt blocks this one shares instead of prefilling
    # the prompt again. Cleared when the request starts, so a preempted request recomputes on its own.
    prompt_source: Request | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Its finished KV is kept for the next request with this id (engine/sessions.py); n == 1 only.
    session_id: str | None = None
    generator: torch.Generator | None = None  # per-request sampling stream when seeded
    # Structured output: where the output stands in its grammar; it has accepted exactly output_token_ids.
    grammar: GrammarState | None = None
    # sampling.prompt_logprobs set: entry p is prompt token p's logprob given tokens < p (entry 0 stays None),
    # written by the runner as the prefill computes position p - 1. Shared by the n sequences of a request, which
    # share the prompt; a recompute (preemption) writes the same values again.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    # A vision-language model's images: where their features go in the prompt, and the encoder's inputs.
    mm: MultiModalInputs | None = None
    # A LoRA adapter the request runs with (None: the base model). Its KV is its own: see cache_salt.
    lora: LoRAAdapter | None = None
    # Predicted Outputs (GenerationConfig.prediction): the predicted tokens, drafted by engine/speculative.py's
    # PredictionProposer instead of the engine's proposer; where the output stands in them; the drafts verified.
    prediction: Prediction | None = None
    # Prompt tokens its first start took from the prefix cache or a session instead of computing (OpenAI's usage
    # prompt_tokens_details.cached_tokens)
    num_cached_prompt_tokens: int = 0
    # An embedding request (engine/pooling.py): its prompt's hidden states pooled as they are computed; it samples
    # nothing and ends when its prompt is computed
    pooling: Pooling | None = None

    @property
    def cache_salt(self) -> int:
        """What the prefix cache and sessions key the request's KV by besides its tokens: 0 for the base model, the
        adapter's load id otherwise (KV computed under one adapter is never served to another)."""
        return 0 if self.lora is None else self.lora.uid

    def key_ids(self, lo: int = 0, hi: int | None = None) -> list[int]:
        """token_ids[lo:hi] as the prefix cache and sessions compare them: each image placeholder replaced by a key
        of its image's content (vl/inputs.py), so KV computed over one image is never served for another."""
        hi = len(self.token_ids) if hi is None else hi
        if self.mm is None or lo >= self.num_prompt_tokens:
            return self.token_ids[lo:hi]
        return self.mm.key_ids(self.token_ids, lo, hi)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether it must compute every prompt position itself (no prefix-cache or session reuse): still in its
        first prefill with prompt logprobs to compute (a position's logprob comes from computing the one before it),
        or an embedding pooled over positions a cache hit would skip (MEAN, CLS)."""
        return ((self.prompt_logprobs is not None and self.num_output_tokens == 0)
                or (self.pooling is not None and self.pooling.pooling_type != "LAST"))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
