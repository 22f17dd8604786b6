"""Token-level sampling parameters of one sequence, derived from a GenerationConfig by the engine.

Strings (stop words, bad words) are already tokenized here; the sampler sees only ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 => disabled
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0  # 1.0 => disabled
    watermark: bool = False  # TGI's watermark (sampling/batch.py's _watermark): a bias on a green list per step
    repetition_penalty: float = 1.0  # over prompt + output tokens (HF semantics)
    presence_penalty: float = 0.0  # over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0  # over output tokens, times the count
    logit_bias: dict[int, float] | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)  # each a token sequence never to complete
    min_tokens: int = 0  # stop_token_ids are banned until this many tokens were generated
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids (unless ignore_eos) + user stop ids
    seed: int | None = None  # per-sequence generator seed
    logprobs: int | None = None  # top-N logprobs to return (0 => only the sampled token's)
    prompt_logprobs: int | None = None  # top-N logprobs at each prompt position (0 => only the prompt token's)
    beam_width: int = 0  # > 0: a beam of a beam search; the engine chooses its tokens from `beam_logprobs`

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
