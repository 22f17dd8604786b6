"""Reasoning parsers (vLLM's `--reasoning-parser qwen3 | deepseek_r1`): a response's `<think>...</think>` part
becomes `reasoning_content`, the rest `content`, whole or streamed.

    qwen3        the model writes both tags: "<think>\\nsteps\\n</think>\\n\\nanswer". A response that does not
                 open with <think> has no reasoning (Qwen3 told not to think: its template puts an empty
                 "<think>\\n\\n</think>" in the prompt and the model writes only the answer).
    deepseek_r1  DeepSeek-R1's template ends the prompt with "<think>\\n": the response starts inside the
                 reasoning and only "</think>" appears (a leading "<think>" is skipped, for older templates).

Either way the prompt decides where the response starts when it says so (`prompt_thinking`): a prompt ending in
"<think>" (Qwen3-Thinking-2507 does this too) starts inside the reasoning, one ending in "</think>" has none.
A response that never closes its reasoning (cut off by max_tokens) is all reasoning. Whitespace around the
reasoning and before the answer is the tags' layout, not text: reasoning is stripped, content left-stripped
after "</think>" (as Qwen's template does when it writes a past answer back).
"""

from __future__ import annotations

from llmserve.errors import InvalidRequestError
from llmserve.tools.calls import ContentDelta, Delta, ParsedOutput, ReasoningDelta, assemble
from llmserve.tools.parser import partial_suffix, skip_ws

THINK, END_THINK = "<think>", "</think>"

# name -> whether the response starts inside the reasoning when the prompt does not say
REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}


class ReasoningParser:
    def __init__(self, name: str, starts_in_reasoning: bool) -> None:
        self.name = name
        self.starts_in_reasoning = starts_in_reasoning

    def parse(self, text: str, thinking: bool | None = None) -> ParsedOutput:
        stream = self.stream(thinking)
        return assemble(stream.feed(text) + stream.finish())

    def stream(self, thinking: bool | None = None) -> ReasoningStream:
        """thinking: True, the response starts inside the reasoning; False, it has none; None, as the family
        does (see `prompt_thinking`)."""
        if thinking is False:
            return ReasoningStream("content", "content")
        inside = self.starts_in_reasoning if thinking is None else True
        return ReasoningStream("start", "reasoning" if inside else "content")


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise InvalidRequestError(f"reasoning_parser: unknown parser {name!r}; choose one of "
                                  f"{', '.join(REASONING_PARSERS)}", param="reasoning_parser")
    return ReasoningParser(name, REASONING_PARSERS[name])


def prompt_thinking(prompt: str) -> bool | None:
    """What the rendered prompt says: True if it opens the reasoning for the model, False if it closed it (thinking
    disabled), None if it says nothing."""
    tail = prompt.rstrip()
    if tail.endswith(THINK):
        return True
    if tail.endswith(END_THINK):
        return False
    return None


class ReasoningStream:
    """States: "start" (a <think> may open the response, after whitespace; otherwise `fallback`), "reasoning",
    "after" (the whitespace after </think>), "content"."""

    def __init__(self, state: str, fallback: str) -> None:
        self._state, self._fallback = state, fallback
        self._buf = ""
        self._leading = True  # reasoning's leading whitespace is still being dropped
        self._held = ""  # reasoning's trailing whitespace, emitted only if more reasoning follows

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._buf:
            if self._state == "start":
                rest = self._buf[skip_ws(self._buf, 0):]
                if rest.startswith(THINK):
                    self._buf, self._state = rest[len(THINK):], "reasoning"
                elif (not rest or THINK.startswith(rest)) and not final:
                    break
                else:
                    self._state = self._fallback
            elif self._state == "reasoning":
                end = self._buf.find(END_THINK)
                if end >= 0:
                    out += self._reasoning(self._buf[:end])
                    self._buf, self._state = self._buf[end + len(END_THINK):], "after"
                    continue
                n = len(self._buf) - (0 if final else partial_suffix(self._buf, END_THINK))
                if not n:
                    break
                out += self._reasoning(self._buf[:n])
                self._buf = self._buf[n:]
            elif self._state == "after":
                self._buf = self._buf[skip_ws(self._buf, 0):]
                if self._buf:
                    self._state = "content"
            else:
                out.append(ContentDelta(self._buf))
                self._buf = ""
        return out

    def _reasoning(self, text: str) -> list[Delta]:
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return [ReasoningDelta(body)] if body else []
