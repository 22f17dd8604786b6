"""Images through the server, on a tiny LLaVA: OpenAI's image_url parts (data:, http(s) from a local server,
file:// under --allowed-local-media-path), TGI's markdown images, what /v1/models and /info say, and every bad image
a client can send: each a 400 in the API's own format naming the problem, while a request already generating is
unaffected.

Greedy answers of a random model are a function of the prompt's tokens and images, so a served answer is compared
with the offline pipeline's for the same image and text (the same engine code, without HTTP); and the answer with
another image differs, so a server that dropped or swapped the image could not pass.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmserve.api import pipeline
from tests.server.harness import (
    EngineHandle,
    RunningServer,
    engine_for,
    parked_after_tokens,
    running_server,
    wait_until,
)
from tests.tiny_vlms import test_image as make_image

pytestmark = pytest.mark.slow

ENGINE = {"num_blocks": 128, "block_size": 16, "limit_mm_per_prompt": 2, "max_image_pixels": 5_000}
MAX_IMAGE_BYTES = 20_000
FETCH_TIMEOUT = 0.5
QUESTION = "What is in the picture?"
MAX_TOKENS = 8


def png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


IMAGE = make_image(0, (40, 50))
OTHER = make_image(1, (40, 50))
IMAGE_PNG = png(IMAGE)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def messages(*urls: str, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*(image_part(u) for u in urls), {"type": "text", "text": text}]}]


# --- a local media server: what a client's image URLs point at ----------------------------------------------------

class Media:
    """GET /image.png (IMAGE), /slow.png (answers after FETCH_TIMEOUT * 6), /big.png (over MAX_IMAGE_BYTES, with its
    Content-Length) and /big-chunked.png (the same, without one: counted as it streams in); `hits` counts requests."""

    def __init__(self) -> None:
        self.hits = 0
        media = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                media.hits += 1
                try:
                    if self.path == "/slow.png":
                        time.sleep(FETCH_TIMEOUT * 6)
                    body = {"/image.png": IMAGE_PNG, "/slow.png": IMAGE_PNG}.get(self.path)
                    if self.path.startswith("/big"):
                        body = IMAGE_PNG + bytes(MAX_IMAGE_BYTES)
                    if body is None:
                        self.send_error(404)
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    if self.path == "/big-chunked.png":
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        for k in range(0, len(body), 4096):
                            piece = body[k:k + 4096]
                            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server under test gave up on it (the slow one)

            def log_message(self, *args: Any) -> None:
                pass

        Handler.protocol_version = "HTTP/1.1"
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- fixtures -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm_dir: Callable[[str], str]) -> str:
    return tiny_vlm_dir("llava")


@pytest.fixture(scope="module")
def vlm(vlm_dir: str) -> Iterator[EngineHandle]:
    with engine_for(vlm_dir, name="tiny-vlm", **ENGINE) as handle:
        yield handle


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "image.png").write_bytes(IMAGE_PNG)
    return d


@pytest.fixture(scope="module")
def media() -> Iterator[Media]:
    m = Media()
    yield m
    m.httpd.shutdown()
    m.httpd.server_close()


@pytest.fixture(scope="module")
def vlm_server(vlm: EngineHandle, media_dir: Path) -> Iterator[RunningServer]:
    with running_server(vlm, allowed_local_media_path=str(media_dir), image_fetch_timeout=FETCH_TIMEOUT,
                        max_image_bytes=MAX_IMAGE_BYTES, enable_debug_routes=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(vlm_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(vlm_dir: str) -> dict[str, Any]:
    """The offline pipeline's greedy answers (text, prompt tokens) for QUESTION with IMAGE, with OTHER, and
    IMAGE twice."""
    with pipeline(vlm_dir, dtype="float32", **ENGINE) as pipe:
        def answer(*images: Any) -> tuple[str, int]:
            r = pipe([{"role": "user", "content": [*({"type": "image_data", "image_data": {"data": i}} for i in images),
                                                   {"type": "text", "text": QUESTION}]}],
                     temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
            return r.text, r.input_token_len

        answers = {"image": answer(IMAGE), "other": answer(OTHER), "twice": answer(IMAGE, IMAGE)}
    assert answers["image"][0] != answers["other"][0]  # the image decides the answer: the checks below can fail
    return answers


def chat(client: openai.OpenAI, msgs: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny-vlm", messages=msgs, temperature=0,
                                          extra_body={"ignore_eos": True}, **{"max_tokens": MAX_TOKENS, **kw})


# --- good requests ------------------------------------------------------------------------------------------------

def test_base64_image_answers_as_the_offline_pipeline(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    r = chat(client, messages(data_url(IMAGE_PNG)))
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == offline["image"]
    assert chat(client, messages(data_url(png(OTHER)))).choices[0].message.content == offline["other"][0]
    # the same pixels in another lossless format are the same image: the same answer
    bmp = io.BytesIO()
    IMAGE.save(bmp, format="BMP")
    assert chat(client, messages(data_url(bmp.getvalue(), "image/bmp"))).choices[0].message.content == offline["image"][0]


def test_streamed_answer_with_two_images(client: openai.OpenAI, offline: dict[str, Any]) -> None:
    url = data_url(IMAGE_PNG)
    stream = chat(client, messages(url, url), stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (text, chunks[-1].usage.prompt_tokens) == offline["twice"]


def test_http_and_allowed_file_urls(client: openai.OpenAI, offline: dict[str, Any], media: Media,
                                    media_dir: Path) -> None:
    assert chat(client, messages(f"{media.url}/image.png")).choices[0].message.content == offline["image"][0]
    file_url = (media_dir / "image.png").as_uri()
    assert chat(client, messages(file_url)).choices[0].message.content == offline["image"][0]


def test_models_and_info_say_the_model_takes_images(vlm_server: RunningServer, server: RunningServer) -> None:
    card = httpx.get(vlm_server.url + "/v1/models").json()["data"][0]
    assert (card["id"], card["input_modalities"]) == ("tiny-vlm", ["text", "image"])
    info = httpx.get(vlm_server.url + "/info").json()
    assert (info["model_pipeline_tag"], info["input_modalities"]) == ("image-text-to-text", ["text", "image"])
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["input_modalities"] == ["text"]
    info = httpx.get(server.url + "/info").json()
    assert (info["model_pipeline_tag"], info["input_modalities"]) == ("text-generation", ["text"])


def test_tgi_markdown_images(vlm_server: RunningServer, vlm: EngineHandle, vlm_dir: str, media: Media,
                             server: RunningServer) -> None:
    from text_generation import Client

    inputs = f"![]({media.url}/image.png)Describe it."
    r = Client(vlm_server.url, timeout=60).generate(inputs, max_new_tokens=MAX_TOKENS,
                                                    decoder_input_details=True)
    # What the text with the processor's image token where the markdown stood makes, offline (no chat template).
    with pipeline(vlm_dir, dtype="float32", **ENGINE) as pipe:
        expected = pipe(("<IMAGE_TOKEN>Describe it.", IMAGE), do_preprocess=False, temperature=0.0,
                        max_new_tokens=MAX_TOKENS)
    assert r.generated_text == expected.text
    assert len(r.details.prefill) == expected.input_token_len
    streamed = Client(vlm_server.url, timeout=60).generate_stream(inputs, max_new_tokens=MAX_TOKENS)
    assert "".join(t.token.text for t in streamed) == expected.text
    cut = httpx.post(vlm_server.url + "/generate", json={"inputs": inputs, "parameters": {"truncate": 5}})
    assert (cut.status_code, cut.json()["error"]) == (400, (
        f"`truncate`: the inputs have {expected.input_token_len} tokens with their images' placeholders, and cutting "
        "them to 5 would cut the images off; raise `truncate` or leave it out"))
    other = Client(vlm_server.url, timeout=60).generate(f"![]({data_url(png(OTHER))})Describe it.",
                                                        max_new_tokens=MAX_TOKENS)
    assert other.generated_text != r.generated_text
    # A text-only model reads the markdown as text: the prompt is its tokens, nothing is fetched.
    hits = media.hits
    plain = httpx.post(server.url + "/generate", json={"inputs": inputs, "parameters": {
        "max_new_tokens": 2, "details": True, "decoder_input_details": True}}).json()
    assert [t["id"] for t in plain["details"]["prefill"]] == server.state.model.tokenizer.encode(inputs)
    assert media.hits == hits
    # TGI's errors carry no param; the message names the image
    refused = httpx.post(vlm_server.url + "/generate", json={"inputs": f"![]({media.url}/missing.png)x"})
    assert refused.status_code == 400
    assert refused.json() == {"error": f"inputs: image 0 (of 1): fetching {media.url}/missing.png answered HTTP 404",
                              "error_type": "validation"}


# --- bad requests ----------------------------------------------------------------------------------------------------

def truncated_png() -> bytes:
    return IMAGE_PNG[:len(IMAGE_PNG) // 2]


def bomb_png() -> bytes:
    """3,000 x 3,000 black pixels: a 1 kB PNG, 9 million pixels (27 MB as RGB) once decoded."""
    from PIL import Image

    return png(Image.new("1", (3000, 3000)))


def bad_requests(media: Media, outside: Path) -> dict[str, tuple[list[dict[str, Any]], str, str]]:
    """name -> (messages, the error's param, a fragment of its message)."""
    unreachable = f"http://127.0.0.1:{closed_port()}/image.png"
    where = "messages[0].content[0]"
    return {
        "not an image": (messages(data_url(b"hello, I am text")), where, "not an image PIL can read (16 bytes"),
        "truncated": (messages(data_url(truncated_png())), where, "the image is truncated or corrupt"),
        "bomb": (messages(data_url(bomb_png())), where, "the image is 3000x3000 = 9,000,000 pixels, over the limit "
                                                        "of 5,000"),
        "unreachable": (messages(unreachable), where, f"could not fetch {unreachable}: ConnectError"),
        "slow": (messages(f"{media.url}/slow.png"), where, f"fetching {media.url}/slow.png took over 0.5 s"),
        "oversized": (messages(f"{media.url}/big.png"), where, f"{media.url}/big.png is "
                      f"{len(IMAGE_PNG) + MAX_IMAGE_BYTES:,} bytes, over the limit of {MAX_IMAGE_BYTES:,}"),
        "oversized, chunked": (messages(f"{media.url}/big-chunked.png"), where,
                               f"{media.url}/big-chunked.png is over the limit of {MAX_IMAGE_BYTES:,} bytes"),
        "too many": (messages(*[f"{media.url}/image.png"] * 3), "messages",
                     "the prompt has 3 images, over the limit of 2 per prompt"),
        "file outside": (messages(outside.as_uri()), where, "is outside the allowed local media directory"),
        "not a file URL": (messages(str(outside)), where, "is not an http(s), data: or file:// URL"),
        "bad data URL": (messages("data:image/png;base64,@@@"), where, "the data URL's payload is not valid base64"),
        "no url": ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages",
                   'an image_url part is {"type": "image_url", "image_url": {"url": "..."}}'),
        "unknown part": ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
                         "messages", "messages[0].content[0]: a content part is of type text or image_url; got a "
                                     "'input_audio' part"),
        "text part without text": ([{"role": "user", "content": [{"type": "text"}]}], "messages",
                                   "a text part needs a string `text`"),
    }


def check_400(e: pytest.ExceptionInfo, param: str, fragment: str) -> None:
    assert e.value.status_code == 400
    body = e.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert (body["type"], body["param"]) == ("invalid_request_error", param)
    assert fragment in body["message"], body["message"]


def test_bad_images_are_400s_and_a_running_request_is_unaffected(
        client: openai.OpenAI, vlm: EngineHandle, vlm_server: RunningServer, media: Media, tmp_path: Path) -> None:
    outside = tmp_path / "outside.png"
    outside.write_bytes(IMAGE_PNG)
    good = messages(data_url(IMAGE_PNG), text="Tell me a long story about it.")
    alone = chat(client, good, max_tokens=24).choices[0].message.content
    answer: list[str] = []

    def run_good() -> None:
        answer.append(chat(client, good, max_tokens=24).choices[0].message.content)

    # The good request is mid-generation (the engine parked after its third token) while every bad one is refused.
    with parked_after_tokens(vlm, 3) as parked:
        thread = threading.Thread(target=run_good)
        thread.start()
        assert parked.wait(60)
        for name, (msgs, param, fragment) in bad_requests(media, outside).items():
            hits = media.hits
            with pytest.raises(openai.BadRequestError) as e:
                chat(client, msgs)
            check_400(e, param, fragment)
            if name == "too many":
                assert media.hits == hits, "the images were fetched before their count was checked"
    thread.join(60)
    assert answer == [alone]
    assert httpx.get(vlm_server.url + "/health").status_code == 200
    assert chat(client, good, max_tokens=24).choices[0].message.content == alone
    wait_until(lambda: vlm_server.kv()["in_use"] == 0, what="every request's blocks freed")


def test_an_image_to_a_text_only_model(server: RunningServer, media: Media) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    hits = media.hits
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=messages(f"{media.url}/image.png"), max_tokens=2)
    check_400(e, "messages", "messages[0].content[0]: this model takes text only, got a 'image_url' part")
    assert media.hits == hits
    # ignore_eos: the tiny random model samples (no temperature given) and may draw its EOS within two tokens
    ok = client.chat.completions.create(model="tiny-llama", max_tokens=2, extra_body={"ignore_eos": True}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}])
    assert ok.choices[0].finish_reason == "length"


def test_file_urls_are_refused_without_allowed_local_media_path(vlm: EngineHandle, media_dir: Path) -> None:
    with running_server(vlm) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, messages((media_dir / "image.png").as_uri()))
    check_400(e, "messages[0].content[0]", "file:// URLs are refused: the server was started without "
                                           "--allowed-local-media-path")


def test_tools_beside_an_image_with_a_template_that_shows_no_tools(client: openai.OpenAI, vlm: EngineHandle) -> None:
    """The tiny LLaVA's template never reads `tools`: the conversation is written in Hermes' format (the tools in
    the system message, appended as a text part to its parts), the image where its part stands."""
    import json

    from llmserve.chat_template import HERMES_TOOLS_PREAMBLE

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    msgs = [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]}, *messages(data_url(IMAGE_PNG))]
    r = chat(client, msgs, tools=[weather])
    preamble = HERMES_TOOLS_PREAMBLE.format(tools=json.dumps(weather))
    rendered = vlm.model.chat_template.tokenizer.apply_chat_template([
        {"role": "system", "content": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "\n\n" + preamble}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        chat_template=vlm.model.chat_template.template, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(vlm.model.processor.prepare(rendered, [IMAGE])[0])
