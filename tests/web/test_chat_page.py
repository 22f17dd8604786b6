"""The web chat page (llmserve/serve/static) in headless Chromium against a real `llmserve serve`
on a tiny random model.

Greedy answers are a function of the messages, so what the page shows is compared with what the
same request returns through the HTTP API, and the requests the page sends are read off the wire.
The server runs with a ChatML template that also shows tools (and renders plain conversations exactly
as the tiny model's own) and --reasoning-parser qwen3, so the page's reasoning and tool-call blocks
show what a real stream carries.
Chromium is Debian's package (scripts/setup.sh installs it when it can); Playwright drives it
through `executable_path`, so nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing: pip install -e '.[dev]'")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip("no Chromium at /usr/bin/chromium: `apt-get install chromium` as root (scripts/setup.sh does "
                "it when run as root)", allow_module_level=True)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SYSTEM = "You are terse."
Q1 = "What is the capital of France?"
Q2 = "The quick brown fox"
MAX_TOKENS = 16
STOP_MAX_TOKENS = 150  # long enough that the page stops it well before the end
Messages = list[dict[str, str]]

# The page's text node writes, recorded as they happen: each `.body.textContent = text` adds one.
RECORD_STATES = """() => {
  window.bodyStates = [];
  new MutationObserver((records) => {
    for (const r of records) {
      if (!r.target.matches || !r.target.matches("article.assistant .body")) continue;
      for (const n of r.addedNodes) window.bodyStates.push(n.data);
    }
  }).observe(document.getElementById("conversation"), { childList: true, subtree: true });
}"""
# Click Stop as soon as the first text chunk is on the page (inside the page: no race with the test).
STOP_AFTER_FIRST_CHUNK = """() => {
  new MutationObserver((records, observer) => {
    const a = document.querySelector("article.assistant[data-state=streaming]");
    if (a && Number(a.dataset.chunks) >= 1) { observer.disconnect(); document.getElementById("stop").click(); }
  }).observe(document.getElementById("conversation"), { attributes: true, subtree: true });
}"""


# The tiny model's ChatML, and a short tools section when there are tools (the Hermes preamble a template without
# tools gets does not fit the tiny model's 256 positions); `<tool_call>` makes the server pick the hermes parser.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' }}{% for t in tools %}{{ t.function.name + ' ' }}{% endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}{{ '<tool_call>' + c.function | tojson + '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _serve_command(model: str, port: int, template: Path) -> list[str]:
    return [sys.executable, "-m", "llmserve.cli", "serve", model, "--server-name", "127.0.0.1",
            "--server-port", str(port), "--chat-template", str(template), "--reasoning-parser", "qwen3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    template = log_path.with_name("template.jinja")
    template.write_text(TOOLS_TEMPLATE)
    with serving(_serve_command(tiny_model_dir("llama"), port, template), port, log_path) as url:
        yield url


@contextmanager
def serving(command: list[str], port: int, log_path: Path) -> Iterator[str]:
    """`llmserve serve` run as `command` (listening on `port`), its URL once healthy; SIGINT at the end."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llmserve serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llmserve serve not healthy after 120 s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        # A persistent context is how Playwright takes a --user-data-dir: a fresh one per run.
        context = p.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 720})
        yield context
        context.close()


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    page = browser.new_page()
    page.sent = []  # the chat requests the page makes, in order
    page.on("request", lambda r: page.sent.append(r) if r.url == f"{server}/v1/chat/completions" else None)
    page.goto(f"{server}/")
    page.evaluate(RECORD_STATES)
    yield page
    page.close()


# --- the same requests through the HTTP API ----------------------------------------------------

def _body(model: str, messages: Messages, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": stream}


def _api_answer(url: str, model: str, messages: Messages, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/chat/completions", json=_body(model, messages, max_tokens, False), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _api_chunks(url: str, model: str, messages: Messages, max_tokens: int = MAX_TOKENS) -> list[str]:
    """The non-empty content deltas of the streamed answer."""
    chunks = []
    body = _body(model, messages, max_tokens, True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        chunks.append(choice["delta"]["content"])
    return chunks


def _model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


# --- driving the page ---------------------------------------------------------------------------

def _configure(page: Any, max_tokens: int, system: str = "") -> None:
    page.fill("#system-prompt", system)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))


def _ask(page: Any, text: str, answers_before: int) -> Any:
    """Type `text`, press Enter, wait until the new answer has finished; returns its <article>."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "n => [...document.querySelectorAll('article.assistant')].filter(a => a.dataset.state !== 'streaming')"
        ".length > n", arg=answers_before, timeout=60_000)
    return page.locator("article.assistant").nth(answers_before)


def _stats_pattern(answer: dict[str, Any], suffix: str = "") -> re.Pattern[str]:
    n = answer["usage"]["completion_tokens"]
    cut = " · cut at max tokens" if answer["choices"][0]["finish_reason"] == "length" else ""
    return re.compile(rf"^{n} tokens? · \d+\.\d tok/s · TTFT \d+ ms{cut}{suffix}$")


def _request(page: Any, index: int) -> tuple[dict[str, Any], dict[str, str]]:
    r = page.sent[index]
    return r.post_data_json, r.headers


def test_two_turns_stream_and_match_the_api(page: Any, server: str, tmp_path: Path) -> None:
    model = _model_id(server)
    page.wait_for_function("m => document.getElementById('model-name').textContent === m", arg=model)
    assert page.is_hidden("#attach")  # a text-only model: no images offered (tests/web/test_chat_page_images.py)
    _configure(page, MAX_TOKENS, SYSTEM)

    turn1: Messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    expected1 = _api_answer(server, model, turn1)
    text1 = expected1["choices"][0]["message"]["content"]
    first = _ask(page, Q1, 0)
    assert first.get_attribute("data-state") == "done"
    assert first.locator(".body").text_content() == text1
    body, _ = _request(page, 0)
    assert body == {"model": model, "messages": turn1, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0, "max_tokens": MAX_TOKENS}
    # Streamed, not delivered at once: the page counted every SSE text chunk the API sends for this
    # request and showed the answer growing by each of them in turn.
    chunks = _api_chunks(server, model, turn1)
    assert len(chunks) > 1 and "".join(chunks) == text1
    assert first.get_attribute("data-chunks") == str(len(chunks))
    assert page.evaluate("window.bodyStates") == list(itertools.accumulate(chunks))
    assert _stats_pattern(expected1).match(first.locator(".stats").text_content())

    turn2 = [*turn1, {"role": "assistant", "content": text1}, {"role": "user", "content": Q2}]
    expected2 = _api_answer(server, model, turn2)
    text2 = expected2["choices"][0]["message"]["content"]
    # The history matters to the answer, so a page that forgot turn 1 could not pass.
    assert text2 != _api_answer(server, model, [turn1[0], turn2[-1]])["choices"][0]["message"]["content"]
    second = _ask(page, Q2, 1)
    assert _request(page, 1)[0]["messages"] == turn2
    assert second.locator(".body").text_content() == text2
    assert _stats_pattern(expected2).match(second.locator(".stats").text_content())
    assert page.locator("article.user .body").all_text_contents() == [Q1, Q2]
    assert page.locator("#error").is_hidden()
    assert page.input_value("#prompt") == ""

    shot = tmp_path / "chat_page.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")


def test_keyboard_errors_stop_api_key_and_new_chat(page: Any, server: str) -> None:
    model = _model_id(server)
    page.wait_for_function("m => document.getElementById('model-name').textContent === m", arg=model)
    _configure(page, MAX_TOKENS)

    # Shift+Enter is a new line, not a send.
    page.fill("#prompt", "line one")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    assert page.sent == [] and page.locator("article.msg").count() == 0

    # A request the server refuses: its OpenAI error message is shown, the question comes back.
    user1 = [{"role": "user", "content": Q1}]
    refused = httpx.post(f"{server}/v1/chat/completions", json=_body(model, user1, 100_000, True), timeout=30)
    assert refused.status_code == 400
    page.fill("#max-tokens", "100000")
    page.fill("#prompt", Q1)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error-text") == f"400: {refused.json()['error']['message']}"
    assert page.input_value("#prompt") == Q1
    assert page.locator("article.msg").count() == 0

    # Stop after the first chunk: the partial answer stays and is a strict prefix of the full one.
    full = _api_answer(server, model, user1, STOP_MAX_TOKENS)["choices"][0]["message"]["content"]
    page.fill("#max-tokens", str(STOP_MAX_TOKENS))
    page.evaluate(STOP_AFTER_FIRST_CHUNK)
    stopped = _ask(page, Q1, 0)
    partial = stopped.locator(".body").text_content()
    assert stopped.get_attribute("data-state") == "stopped"
    assert partial and full.startswith(partial) and len(partial) < len(full)
    assert stopped.locator(".stats").text_content().endswith(" · stopped")
    assert page.locator("#error").is_hidden() and page.is_visible("#send") and page.is_hidden("#stop")

    # The next turn carries the stopped answer and the API key the user typed.
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#api-key", "sk-test-key")
    page.dispatch_event("#api-key", "change")
    _ask(page, Q2, 1)
    body, headers = _request(page, 2)
    assert body["messages"] == [*user1, {"role": "assistant", "content": partial}, {"role": "user", "content": Q2}]
    assert headers["authorization"] == "Bearer sk-test-key"

    # New chat forgets everything: the next request holds only the new question.
    page.click("#new-chat")
    assert page.locator("article.msg").count() == 0 and page.is_visible("#empty-hint")
    only_q2 = [{"role": "user", "content": Q2}]
    answer = _ask(page, Q2, 0)
    assert _request(page, 3)[0]["messages"] == only_q2
    assert answer.locator(".body").text_content() == _api_answer(server, model, only_q2)["choices"][0]["message"]["content"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# What the model writes, scripted on the wire: the page's request gets a guided_choice added on its way out, so the
# server streams a real reasoning block, text and call through its parsers.
SCRIPT = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>')


def _scripted(route: Any) -> None:
    route.continue_(post_data=json.dumps({**route.request.post_data_json, "guided_choice": [SCRIPT]}))


def test_reasoning_and_tool_calls_are_shown_apart(page: Any, server: str, tmp_path: Path) -> None:
    model = _model_id(server)
    page.wait_for_function("m => document.getElementById('model-name').textContent === m", arg=model)
    _configure(page, MAX_TOKENS)
    page.fill("#max-tokens", "")  # the scripted answer is longer than MAX_TOKENS: what fits

    # Tools that are not a JSON list are refused on the page, before any request.
    page.fill("#tools", "{not json")
    page.fill("#prompt", Q1)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error-text").startswith("Tools: not valid JSON")
    assert page.sent == [] and page.input_value("#prompt") == Q1

    page.fill("#tools", json.dumps([WEATHER]))
    page.route(f"{server}/v1/chat/completions", _scripted)
    answer = _ask(page, Q1, 0)
    page.unroute(f"{server}/v1/chat/completions")
    body, _ = _request(page, 0)
    assert body["tools"] == [WEATHER] and body["messages"] == [{"role": "user", "content": Q1}]

    expected = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": body["messages"], "tools": [WEATHER], "temperature": 0,
        "guided_choice": [SCRIPT]}).json()["choices"][0]
    message = expected["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user wants the weather.", "Let me look.")
    assert expected["finish_reason"] == "tool_calls"
    # the reasoning in its own block, folded once the answer began; the text; the call with its arguments
    thinking = answer.locator("details.thinking")
    assert thinking.locator("summary").text_content() == "Thinking"
    assert thinking.locator(".reasoning").text_content() == message["reasoning_content"]
    assert thinking.get_attribute("open") is None
    assert answer.locator(".body").text_content() == message["content"]
    calls = answer.locator(".tool-call")
    assert calls.count() == 1
    assert calls.locator(".tool-name").text_content() == "Tool call: get_weather"
    arguments = message["tool_calls"][0]["function"]["arguments"]
    assert calls.locator(".tool-args").text_content() == json.dumps(json.loads(arguments), indent=2)
    assert answer.locator(".stats").text_content().endswith(" · 1 tool call")
    assert page.locator("#error").is_hidden()

    # The call goes back in the conversation as OpenAI's tool_calls (with the id the stream gave it), the
    # reasoning does not.
    _ask(page, Q2, 1)
    sent = _request(page, 1)[0]["messages"]
    call = sent[1]["tool_calls"][0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert sent[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    assert sent[2] == {"role": "user", "content": Q2}

    answer.locator("details.thinking summary").click()  # a click opens the reasoning again
    assert thinking.get_attribute("open") is not None
    shot = tmp_path / "chat_page_tools.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")
