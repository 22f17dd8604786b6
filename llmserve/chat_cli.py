"""`llmserve chat [MODEL]`: a multi-turn terminal chat that runs the model in this process through
the offline pipeline.

One input line is one user message. Answers stream to stdout as they are generated, each ended by
a newline; everything else (banner, stats, errors) goes to stderr. So a piped session's stdout is
exactly the answers, and the `>>> ` prompt marker and banner appear only when stdin is a terminal.
With a vision-language model, `/image PATH_OR_URL` attaches an image to the next message.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, TextIO

from llmserve.api import Pipeline, Session, engine_session_id, pipeline
from llmserve.config import EngineConfig, GenerationConfig
from llmserve.errors import InvalidRequestError, LLMServeError, PromptTooLongError
from llmserve.vl.image import load_image
from llmserve.vl.messages import has_images

HELP = """commands:
  /image PATH_OR_URL   attach an image to the next message (a vision-language model; repeat for several)
  /reset   start a new conversation (forget every earlier turn)
  /exit    quit (also /quit or Ctrl-D)
  /help    show this help
Ctrl-C stops the answer being generated; at the prompt it quits."""

PROMPT_MARKER = ">>> "


@dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # 'stop' | 'length' | 'interrupted'
    ttft_s: float | None  # None when no token came
    tokens_per_s: float | None  # decode rate after the first token; None under two tokens

    def line(self) -> str:
        parts = [f"prompt {self.prompt_tokens} tokens", f"answer {self.output_tokens} tokens ({self.finish_reason})"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s:.2f} s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tokens/s")
        return "[" + " · ".join(parts) + "]"


@dataclass
class ChatSession:
    pipe: Pipeline
    gen: GenerationConfig
    out: TextIO
    # The conversation, kept as Pipeline.chat keeps it: its turns run under an engine session that holds
    # their KV, and each prompt is the ids the engine already has plus the new turn's tokens, so a
    # turn prefills only what it adds. /reset frees it and starts a new one.
    session: Session = field(init=False)
    # /image: decoded images for the next message, which shows them before its text. Later turns see them in the
    # history (the whole conversation goes through the model's processor; its cache knows each image by content).
    attached: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.session = self.pipe.new_session()

    def reset(self) -> None:
        self.pipe.end_session(self.session)
        self.session = self.pipe.new_session()
        self.attached = []

    def attach(self, source: str) -> Any:
        """Load an image (path or URL) for the next message; raises LLMServeError for a text-only model or an image
        that cannot be read (nothing attached)."""
        if self.pipe.processor is None:
            raise InvalidRequestError(f"{self.pipe.model_name} takes text only: /image needs a vision-language model")
        image = load_image(source, self.pipe.image_limits, param="/image")
        self.attached.append(image)
        return image

    def ask(self, text: str) -> TurnStats:
        """Stream the answer to `text` given every earlier turn. The turn joins the history only
        when the engine accepted it; an interrupted answer is kept as far as it got (the user saw it).
        Raises LLMServeError (history unchanged) for a turn the engine refuses."""
        images, self.attached = self.attached, []  # a refused turn drops them too: /image them again
        content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}] if images else text
        messages = [*self.session.history, {"role": "user", "content": content}]
        mm = None
        if has_images(messages):
            rendered, prompt_ids, mm = self.pipe.prompt_with_images(messages)
        else:
            rendered = self.pipe.chat_template.messages_to_prompt(messages)
            prompt_ids = self.pipe.session_prompt_ids(self.session, rendered)
        gen = self._fit_to_context(len(prompt_ids))
        answer: list[str] = []
        answer_ids: list[int] = []
        clock = _Clock()
        output_tokens, finish = 0, "interrupted"
        try:
            with closing(self.pipe.stream_infer({"input_ids": prompt_ids, "_mm": mm}, gen_config=gen,
                                                session_id=engine_session_id(self.session, gen))) as stream:
                for r in stream:
                    if r.token_ids:
                        clock.token()
                    self.out.write(r.text)
                    self.out.flush()
                    answer.append(r.text)
                    answer_ids.extend(r.token_ids)
                    output_tokens = r.generate_token_len
                    finish = r.finish_reason or finish
        except KeyboardInterrupt:
            pass  # closing() aborted the request; what was streamed stays in the conversation
        finally:
            if answer:
                self.out.write("\n")
                self.out.flush()
        if finish != "interrupted" or any(answer):  # a turn stopped before its first word is forgotten
            self.pipe.record_turn(self.session, messages, rendered, prompt_ids, "".join(answer), answer_ids)
        return TurnStats(len(prompt_ids), output_tokens, finish, clock.ttft(), clock.rate(output_tokens))

    def _fit_to_context(self, prompt_len: int) -> GenerationConfig:
        # A conversation grows towards the session length; rather than refusing the turn that
        # would overrun it, give the answer whatever room is left (as servers do for max_tokens).
        assert self.pipe.engine is not None, "the pipeline is open for the whole chat"
        session_len = self.pipe.engine.session_len
        if prompt_len >= session_len:
            raise PromptTooLongError(f"the conversation has {prompt_len} tokens, which leaves no room for an answer "
                                     f"in the session length of {session_len}; /reset starts a new one")
        room = session_len - prompt_len
        return self.gen.replace(max_new_tokens=min(self.gen.max_new_tokens, room))


class _Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None

    def token(self) -> None:
        self.last = time.monotonic()
        self.first = self.first or self.last

    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def rate(self, tokens: int) -> float | None:
        if self.first is None or self.last is None or tokens < 2 or self.last <= self.first:
            return None
        return (tokens - 1) / (self.last - self.first)


def run(args: argparse.Namespace) -> int:
    from llmserve.cli import chat_template_config_from_args, dataclass_from_args  # cli.py imports us lazily

    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'}...", file=sys.stderr)
    with pipeline(args.model, backend_config=dataclass_from_args(EngineConfig, args),
                  chat_template_config=chat_template_config_from_args(args), log_level=args.log_level) as pipe:
        gen = dataclass_from_args(GenerationConfig, args, base=pipe.default_gen_config)
        session = ChatSession(pipe, gen, sys.stdout)
        if interactive:
            print(f"llmserve chat · {pipe.model_name} · /help for commands, /exit to quit", file=sys.stderr)
        return _loop(session, PROMPT_MARKER if interactive else "", args.stats)


def _loop(session: ChatSession, marker: str, show_stats: bool) -> int:
    while True:
        try:
            line = input(marker)
        except (EOFError, KeyboardInterrupt):
            if marker:
                print(file=sys.stderr)  # leave the terminal's cursor on a fresh line
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if _command(session, text):
                continue
            return 0
        try:
            stats = session.ask(line)
        except LLMServeError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        if stats.finish_reason == "interrupted":
            print("[stopped]", file=sys.stderr)
        if show_stats:
            print(stats.line(), file=sys.stderr)


def _command(session: ChatSession, text: str) -> bool:
    """Run a /command; False means quit."""
    name, _, arg = text.partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/image":
        _attach(session, arg)
    elif name == "/reset":
        session.reset()
        print("[new conversation]", file=sys.stderr)
    elif name == "/help":
        print(HELP, file=sys.stderr)
    else:
        print(f"unknown command {name}; /help lists the commands", file=sys.stderr)
    return True


def _attach(session: ChatSession, source: str) -> None:
    if not source:
        print("usage: /image PATH_OR_URL", file=sys.stderr)
        return
    try:
        image = session.attach(source)
    except LLMServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return
    count = len(session.attached)
    print(f"[image {count} attached: {source} ({image.width}x{image.height}); it goes with the next message]",
          file=sys.stderr)
