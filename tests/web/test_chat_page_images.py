"""The chat page with a model that takes images (a tiny LLaVA behind a real `llmserve serve`), in headless Chromium:
an image attached from a file and one pasted go with their messages as image_url parts holding data: URLs, show in
the conversation, and stay in the history; an attachment can be removed before sending; a refused image gives the
question and the image back. Greedy answers are compared with what the same request returns through the HTTP API.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.tiny_vlms import test_image as make_image
from tests.web.test_chat_page import _ask, _free_port, browser, serving  # noqa: F401  (browser: a fixture)

pytestmark = pytest.mark.slow

Q1 = "What is in the picture?"
Q2 = "And in this one?"
MAX_TOKENS = 8


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(seed, (40, 50)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import sys

    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve-vlm") / "serve.log"
    command = [sys.executable, "-m", "llmserve.cli", "serve", tiny_vlm_dir("llava"), "--server-name", "127.0.0.1",
               "--server-port", str(port)]
    with serving(command, port, log_path) as url:
        yield url


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:  # noqa: F811  (the imported fixture)
    page = browser.new_page()
    page.sent = []
    page.on("request", lambda r: page.sent.append(r) if r.url == f"{server}/v1/chat/completions" else None)
    page.goto(f"{server}/")
    model = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"]
    page.wait_for_function("m => document.getElementById('model-name').textContent === m", arg=model)
    page.fill("#system-prompt", "")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    yield page
    page.close()


def api_answer(server: str, messages: list[dict[str, Any]]) -> str:
    body = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    resp = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


# Paste a PNG (base64) into the message box as a browser's clipboard hands over a copied image.
PASTE = """b64 => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
  document.getElementById("prompt").dispatchEvent(
    new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }));
}"""


def user(text: str, *images: bytes) -> dict[str, Any]:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_url(i)}} for i in images),
                                        {"type": "text", "text": text}]}


def test_attached_and_pasted_images_go_with_their_messages(page: Any, server: str, tmp_path: Path) -> None:
    a, b, c = png(0), png(1), png(2)
    (tmp_path / "a.png").write_bytes(a)
    (tmp_path / "c.png").write_bytes(c)
    assert page.is_visible("#attach") and page.is_hidden("#attachments")

    page.set_input_files("#image-input", str(tmp_path / "a.png"))
    page.wait_for_selector("#attachments:not([hidden]) img")
    answer1 = _ask(page, Q1, 0)
    turn1 = [user(Q1, a)]
    assert page.sent[0].post_data_json["messages"] == turn1  # the file's bytes, as a data: URL, before the text
    text1 = api_answer(server, turn1)
    assert answer1.locator(".body").text_content() == text1
    assert text1 != api_answer(server, [user(Q1, b)])  # the image decides the answer: the check above can fail
    shown = page.locator("article.user").nth(0)
    assert shown.locator(".images img").get_attribute("src") == data_url(a)
    assert shown.locator(".body").text_content() == Q1
    assert page.is_hidden("#attachments")  # sent: nothing waits for the next message

    # A pasted image and an attached one; the attached one is removed again before sending.
    page.evaluate(PASTE, base64.b64encode(b).decode())
    page.set_input_files("#image-input", str(tmp_path / "c.png"))
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 2")
    page.click("#attachments .attachment:nth-child(2) button")
    assert page.locator("#attachments img").count() == 1
    answer2 = _ask(page, Q2, 1)
    turn2 = [*turn1, {"role": "assistant", "content": text1}, user(Q2, b)]
    assert page.sent[1].post_data_json["messages"] == turn2  # the history keeps turn 1's image
    assert answer2.locator(".body").text_content() == api_answer(server, turn2)
    assert page.locator("article.user .images img").count() == 2
    assert page.locator("#error").is_hidden()
    shot = tmp_path / "chat_page_images.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")


def test_a_refused_image_comes_back_with_the_question(page: Any, server: str) -> None:
    page.set_input_files("#image-input", files=[{"name": "fake.png", "mimeType": "image/png",
                                                 "buffer": b"not an image at all"}])
    page.wait_for_selector("#attachments:not([hidden]) img")
    page.fill("#prompt", Q1)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error-text") == (
        "400: messages[0].content[0]: not an image PIL can read (19 bytes; PNG, JPEG, WebP, GIF, BMP and TIFF are)")
    assert page.input_value("#prompt") == Q1
    assert page.locator("#attachments img").get_attribute("src") == data_url(b"not an image at all")
    assert page.locator("article.msg").count() == 0
