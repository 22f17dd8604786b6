"""Seed 001 (LMDeploy's VLM guide, /work/shared/seeds/001_*): its offline VLM examples, with `lmdeploy` imports
changed to `llmserve`, InternVL2-8B changed to a tiny random InternVL (tests/tiny_vlms.py), and the GitHub image
URLs changed to the same file names on a local http server (nothing reaches the internet here). The seed prints the
responses; the tests also check they are what the engine gives for the same inputs in another shape."""

from __future__ import annotations

import http.server
import io
import threading

import pytest

from tests.tiny_vlms import make_tiny_vlm, test_image

NAMES = ("tiger.jpeg", "human-pose.jpg", "det.jpg")


@pytest.fixture(scope="module")
def internvl(tmp_path_factory) -> str:
    return make_tiny_vlm("internvl", tmp_path_factory.mktemp("seed001-internvl"))


@pytest.fixture(scope="module")
def urls():
    """name -> http URL of a JPEG of that name on 127.0.0.1."""
    files = {}
    for i, name in enumerate(NAMES):
        buf = io.BytesIO()
        test_image(20 + i, (48 + 8 * i, 40)).save(buf, format="JPEG")
        files["/" + name] = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {name: f"http://127.0.0.1:{server.server_address[1]}/{name}" for name in NAMES}
    server.shutdown()


def test_seed_001_hello_world(internvl, urls):
    from llmserve import pipeline
    from llmserve.vl import load_image

    pipe = pipeline(internvl)
    image = load_image(urls["tiger.jpeg"])
    response = pipe(('describe this image', image))
    print(response)
    assert response.finish_reason in ("stop", "length") and response.input_token_len > 0
    # the same prompt as GPT-4V messages gives the same tokens (greedy, to compare)
    again = pipe([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": urls["tiger.jpeg"]}},
                                               {"type": "text", "text": "describe this image"}]}],
                 temperature=0, max_new_tokens=8)
    assert again.token_ids == pipe(('describe this image', image), temperature=0, max_new_tokens=8).token_ids


def test_seed_001_multi_image_batch_and_image_token(internvl, urls):
    from llmserve import TurbomindEngineConfig, pipeline
    from llmserve.vl import load_image
    from llmserve.vl.constants import IMAGE_TOKEN

    pipe = pipeline(internvl, backend_config=TurbomindEngineConfig(session_len=10000))
    image_urls = [urls["human-pose.jpg"], urls["det.jpg"]]
    images = [load_image(img_url) for img_url in image_urls]
    response = pipe(('describe these images', images))
    print(response)
    assert response.input_token_len > 0

    prompts = [('describe this image', load_image(img_url)) for img_url in image_urls]
    response = pipe(prompts)
    print(response)
    assert len(response) == 2

    image = load_image(urls["tiger.jpeg"])
    response = pipe((f'describe this image{IMAGE_TOKEN}', image))
    print(response)
    assert response.input_token_len > 0


def test_seed_001_multi_turn_with_image(internvl, urls):
    from llmserve import GenerationConfig, TurbomindEngineConfig, pipeline
    from llmserve.vl import load_image

    pipe = pipeline(internvl, backend_config=TurbomindEngineConfig(session_len=8192))
    image = load_image(urls["human-pose.jpg"])
    gen_config = GenerationConfig(top_k=40, top_p=0.8, temperature=0.6)
    sess = pipe.chat(('describe this image', image), gen_config=gen_config)
    print(sess.response.text)
    sess = pipe.chat('What is the woman doing?', session=sess, gen_config=gen_config)
    print(sess.response.text)
    assert len(sess.history) == 4 and sess.response.finish_reason in ("stop", "length")


def test_seed_001_vision_config(internvl, urls):
    from llmserve import (
        VisionConfig,  # noqa: I001  (the seed's `vision_config` keyword, in kwargs)
        pipeline,
    )
    from llmserve.vl import load_image

    pipe = pipeline(internvl, vision_config=VisionConfig(max_batch_size=8))
    assert pipe.engine.config.vision_max_batch_size == 8
    print(pipe(('describe this image', load_image(urls["tiger.jpeg"]))))
