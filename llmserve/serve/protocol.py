"""OpenAI request bodies (/v1/chat/completions, /v1/completions) as pydantic models.

Strict types (a string where a number belongs is a 400, as OpenAI answers; ints are accepted for
floats), unknown fields ignored (as vLLM does: clients send fields we do not know, e.g. `tools`
with an empty list or `parallel_tool_calls`). Value checks (ranges, consistency) happen when the
request is turned into a GenerationConfig (openai_params.py), which names the offending field.
Responses are built as plain dicts (openai_format.py): one per streamed chunk, on the hot path.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    """Fields common to chat and text completions, OpenAI's and ours (the `extra_body` ones)."""

    model: str | None = None  # optional, as in vLLM: None means the served model
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None  # None: the model's generation_config default
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None  # sampled: best of this many; beam search: the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search (vLLM's legacy names)
    early_stopping: bool | Literal["never"] = False
    # ours (extra_body), vLLM's names
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    # ours: keep this conversation's KV for its next request (LMDeploy's session_id). The client still
    # sends the whole history; the session only saves the prefill of what was already computed.
    session_id: str | int | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
