"""Turning sampled tokens into text: incremental detokenization, stop strings, per-step outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from llmserve.sampling.sampler import TokenLogprobs

# Tokens of prompt context fed to the stream decoder so the first generated token decodes with
# the right leading space (sentencepiece/byte-level merges depend on the previous token).
_CONTEXT_TOKENS = 4


@dataclass(frozen=True)
class RequestTimes:
    """Monotonic seconds; set on a sequence's final output (for metrics and the request log)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float


@dataclass
class SequenceOutput:
    """What one step produced for one sequence; consumers accumulate these."""

    request_id: str  # the caller's id (the parent id when n > 1)
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int  # so far, excluding a final stop token
    finished: bool = False
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    times: RequestTimes | None = None
    # With the sequence's first output, when asked (GenerationConfig.prompt_logprobs): one entry per prompt token,
    # the first None (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With a prediction (GenerationConfig.prediction): its drafts verified so far, (accepted, rejected)
    prediction_tokens: tuple[int, int] | None = None
    # Prompt tokens taken from the prefix cache or a session rather than computed, when the sequence first started
    num_cached_tokens: int = 0
    # An embedding request's one output (LLMEngine.add_embedding_request): the pooled vector
    embedding: list[float] | None = None


class IncrementalDetokenizer:
    """Decodes one sequence token by token and finds stop strings across token boundaries.

    While stop strings are set, the last (longest stop string - 1) characters are searched again
    when the next token arrives, since they may start a stop string that it completes. Unless the
    stop string is kept in the output (include_stop), they are also held back from the emitted
    text: a match would cut them. With include_stop a match only cuts text after the stop string,
    which is always in the newest chunk, so nothing needs holding back (TGI streams this way).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool,
                 stop_words: list[str] | None, include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_words = stop_words or []
        self.include_stop = include_stop
        self.search_back = max((len(s) for s in self.stop_words), default=1) - 1
        self.holdback = 0 if include_stop else self.search_back
        self.text = ""
        self.emitted = 0  # characters of text already handed out
        self.stop_hit: str | None = None
        self._stream = None
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(ids=prompt_ids[-_CONTEXT_TOKENS:], skip_special_tokens=skip_special_tokens)
        else:  # slow tokenizer: re-decode a short window (prefix/read offsets, as TGI does)
            self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
            self._prefix_offset = 0
            self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that may now be emitted ('' if none)."""
        chunk = self._decode(token_id)
        if chunk:
            start = max(0, len(self.text) - self.search_back)
            self.text += chunk
            self._find_stop(start)
        return self.flush(final=self.stop_hit is not None)

    def flush(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _find_stop(self, start: int) -> None:
        best = None
        for stop in self.stop_words:
            i = self.text.find(stop, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            self.text = self.text[: i + len(stop)] if self.include_stop else self.text[:i]
            self.stop_hit = stop

    def _decode(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        kw = {"skip_special_tokens": self.skip_special_tokens}
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], **kw)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:], **kw)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""
