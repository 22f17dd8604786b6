"""The chat page against `llmserve serve --adapters ...` in headless Chromium: a picker lists the base model and its
adapters, and the chosen one goes out as the request's `model`; the answer is what the API gives for that model."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.lora.adapters import ADAPTERS, make_adapter
from tests.web.test_chat_page import _ask, _configure, _free_port, browser, serving  # noqa: F401  (browser: fixture)

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("page-adapters")
    qv = make_adapter(base, str(root / "qv"), seed=21, **ADAPTERS["qv"])
    port = _free_port()
    command = [sys.executable, "-m", "llmserve.cli", "serve", base, "--server-name", "127.0.0.1", "--server-port",
               str(port), "--model-name", "tiny", "--adapters", f"qv={qv}"]
    with serving(command, port, root / "serve.log") as url:
        yield url


def _api_answer(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": MAX_TOKENS}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_the_page_picks_an_adapter(browser: Any, server: str) -> None:  # noqa: F811  (the imported fixture)
    page = browser.new_page()
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r) if r.url == f"{server}/v1/chat/completions" else None)
    page.goto(f"{server}/")
    page.wait_for_selector("#model-select:not([hidden])")
    options = page.eval_on_selector_all("#model-select option", "os => os.map(o => [o.value, o.textContent])")
    assert options == [["tiny", "tiny"], ["qv", "qv (LoRA)"]]
    _configure(page, MAX_TOKENS)
    page.select_option("#model-select", "qv")
    answer = _ask(page, QUESTION, 0)
    assert sent[-1].post_data_json["model"] == "qv"
    expected = _api_answer(server, "qv")
    assert expected != _api_answer(server, "tiny")  # the adapter changes the answer
    assert answer.locator(".body").inner_text().strip() == expected.strip()
    page.close()
