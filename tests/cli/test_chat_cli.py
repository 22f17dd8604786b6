"""`llmserve chat` driven through a pipe, as a user's script would, on a tiny random model.

Greedy decoding makes every answer a function of the prompt, so the expected stdout is computed
in-process with the offline pipeline from the conversation the chat should have sent; the
`--stats` line gives the prompt token count of each turn, which shows exactly what history
each turn saw.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

from llmserve.api import pipeline
from llmserve.chat_cli import HELP, PROMPT_MARKER

pytestmark = pytest.mark.slow

Q1 = "What is the capital of France?"
Q2 = "The quick brown fox"
MAX_NEW = 12
SESSION_LEN = 128
STATS = re.compile(r"^\[prompt (\d+) tokens · answer (\d+) tokens \((\w+)\) · TTFT [\d.]+ s(?: · [\d.]+ tokens/s)?\]$")


def _chat(model: str, text: str | None, *flags: str, **kw: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmserve.cli", "chat", model, *flags]
    return subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=180, **kw)


def test_piped_chat_keeps_history_resets_and_survives_errors(tiny_model_dir: Callable[[str], str]) -> None:
    model = tiny_model_dir("llama")
    too_long = "lazy dog " * 100  # far over --session-len 128
    stdin = "\n".join([too_long, Q1, Q2, "/help", "", "/reset", Q1, "/nope", "/exit", "after exit: never read", ""])
    proc = _chat(model, stdin, "--temperature", "0", "--max-new-tokens", str(MAX_NEW), "--session-len",
                 str(SESSION_LEN), "--stats")
    assert proc.returncode == 0, proc.stderr

    with pipeline(model) as pipe:
        gen = pipe.default_gen_config.replace(temperature=0.0, max_new_tokens=MAX_NEW)

        def turn(messages: list[dict[str, str]]) -> tuple[int, str, int, str]:
            ids = pipe.tokenizer.encode(pipe.chat_template.messages_to_prompt(messages), add_special_tokens=False)
            r = pipe([messages], gen_config=gen)[0]
            assert r.input_token_len == len(ids)
            return len(ids), r.text, r.generate_token_len, r.finish_reason

        first = turn([{"role": "user", "content": Q1}])
        second = turn([{"role": "user", "content": Q1}, {"role": "assistant", "content": first[1]},
                       {"role": "user", "content": Q2}])
        alone = turn([{"role": "user", "content": Q2}])
        too_long_len = len(pipe.tokenizer.encode(pipe.chat_template.messages_to_prompt(
            [{"role": "user", "content": too_long}]), add_special_tokens=False))
    # Preconditions that make the checks below able to fail: the history changes Q2's answer.
    assert second[1] != alone[1] and first[1]

    # stdout is the answers and nothing else: the refused turn printed none, /reset forgot turn 1-2,
    # nothing after /exit was answered.
    assert proc.stdout == f"{first[1]}\n{second[1]}\n{first[1]}\n"

    stats = [STATS.match(line) for line in proc.stderr.splitlines() if line.startswith("[prompt")]
    assert all(stats), proc.stderr
    seen = [(int(m[1]), int(m[2]), m[3]) for m in stats]
    expected = [(n, out, reason) for n, _, out, reason in (first, second, first)]
    assert seen == expected  # turn 2's prompt held turn 1 and not the refused message

    assert (f"error: the conversation has {too_long_len} tokens, which leaves no room for an answer in the "
            f"session length of {SESSION_LEN}; /reset starts a new one") in proc.stderr
    assert HELP in proc.stderr
    assert "[new conversation]" in proc.stderr
    assert "unknown command /nope; /help lists the commands" in proc.stderr
    assert PROMPT_MARKER not in proc.stdout + proc.stderr  # no decoration when stdin is not a terminal


def test_terminal_gets_a_prompt_marker_and_banner_and_ctrl_d_quits(tiny_model_dir: Callable[[str], str]) -> None:
    import pty

    controller, terminal = pty.openpty()
    try:
        os.write(controller, b"/reset\n\x04")  # Ctrl-D at the start of a line: end of input
        proc = _chat(model := tiny_model_dir("llama"), None, stdin=terminal)
    finally:
        os.close(terminal)
        os.close(controller)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == PROMPT_MARKER * 2  # one marker per line read; stdout is not the terminal here
    lines = proc.stderr.splitlines()
    assert lines[0] == f"loading {model}..."
    assert lines[-3:] == [f"llmserve chat · {os.path.basename(model)} · /help for commands, /exit to quit",
                          "[new conversation]",
                          ""]  # Ctrl-D leaves the cursor on a fresh line


def test_chat_turns_run_under_an_engine_session_and_reset_ends_it(tiny_model_dir: Callable[[str], str]) -> None:
    import io

    from llmserve import EngineConfig
    from llmserve.api import engine_session_id
    from llmserve.chat_cli import ChatSession

    config = EngineConfig(dtype="float32", enable_prefix_caching=False, num_blocks=64, block_size=4)
    with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
        gen = pipe.default_gen_config.replace(temperature=0.0, max_new_tokens=MAX_NEW)
        chat = ChatSession(pipe, gen, io.StringIO())
        first = chat.ask(Q1)
        sid = engine_session_id(chat.session)
        kept = pipe.engine.sessions.token_ids(sid)
        assert len(kept) == first.prompt_tokens + first.output_tokens - 1  # the last token has no K/V yet
        before = pipe.engine.scheduler.num_prefill_tokens
        second = chat.ask(Q2)
        reused = second.prompt_tokens - (pipe.engine.scheduler.num_prefill_tokens - before)
        # At least turn 1's prompt came from the session, caching off. (Not every kept token: this random
        # model's answer is not valid UTF-8, so its ids do not decode to its text and the turn falls back
        # to tokenizing the whole chat; tests/test_chat_sessions.py checks the exact reuse of the
        # Pipeline.session_prompt_ids / record_turn bookkeeping the chat shares.)
        assert reused >= first.prompt_tokens
        chat.reset()
        assert sid not in pipe.engine.sessions and len(pipe.engine.sessions) == 0
        assert chat.session.history == [] and chat.session.token_ids == []


def test_chat_with_beam_search_runs_its_turns_without_a_session(tiny_model_dir: Callable[[str], str]) -> None:
    """An engine session continues one sequence: beam-search turns run without one instead of failing."""
    import io

    from llmserve import EngineConfig
    from llmserve.chat_cli import ChatSession

    config = EngineConfig(dtype="float32", num_blocks=64, block_size=4)
    with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
        gen = pipe.default_gen_config.replace(max_new_tokens=4, use_beam_search=True, beam_width=2)
        out = io.StringIO()
        chat = ChatSession(pipe, gen, out)
        for question in (Q1, Q2):
            stats = chat.ask(question)
            assert stats.output_tokens >= 1 and stats.finish_reason in ("stop", "length")
        assert len(chat.session.history) == 4 and len(pipe.engine.sessions) == 0
        assert out.getvalue().count("\n") == 2  # two answers, each ended by a newline
