"""llmserve.vl.load_image: every source it takes, and every bad one refused with a clear InvalidRequestError."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import pytest

from llmserve.errors import InvalidRequestError
from llmserve.vl import load_image
from llmserve.vl.image import SERVER, ImageLimits, image_hash
from tests.tiny_vlms import test_image


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def image_server():
    """An http server on 127.0.0.1: /ok.png, /slow.png (answers after 2 s), /big.png (declares 10 MB),
    /missing.png (404)."""
    payload = png_bytes(test_image(0, (40, 30)))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/slow.png":
                time.sleep(2)
            if self.path == "/missing.png":
                self.send_error(404)
                return
            body = payload if self.path != "/big.png" else b"\0" * 10_000_000
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", payload
    server.shutdown()


def test_sources(tmp_path, image_server):
    base, payload = image_server
    img = test_image(0, (40, 30))
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(img))
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    want = image_hash(img)
    for source in (img, png_bytes(img), str(path), f"file://{path}", data_url, f"{base}/ok.png"):
        got = load_image(source)
        assert got.mode == "RGB" and got.size == (40, 30) and image_hash(got) == want
    # another format, the same pixels: the same image to the caches
    jpeg_free = io.BytesIO()
    img.save(jpeg_free, format="BMP")
    assert image_hash(load_image(jpeg_free.getvalue())) == want
    assert load_image(img.convert("RGBA")).mode == "RGB"


def test_bad_sources(tmp_path, image_server):
    base, payload = image_server
    cases = [
        (b"not an image at all", "not an image PIL can read"),
        (b"", "empty"),
        (payload[: len(payload) // 2], "truncated or corrupt"),
        ("data:image/png;base64,!!!notbase64", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("data:image/png,rawdata", "data:image/<type>;base64"),
        (str(tmp_path / "missing.png"), "cannot read"),
        ("ftp://example.com/a.png", "unsupported image URL scheme"),
        (f"{base}/missing.png", "HTTP 404"),
        ("http://127.0.0.1:9/unreachable.png", "could not fetch"),
        (12, "got int"),
    ]
    for source, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            load_image(source)


def test_limits(tmp_path, image_server):
    base, _ = image_server
    big = test_image(1, (200, 100))
    with pytest.raises(InvalidRequestError, match="20,000 pixels, over the limit of 10,000"):
        load_image(png_bytes(big), ImageLimits(max_pixels=10_000))
    with pytest.raises(InvalidRequestError, match="over the limit"):
        load_image(big, ImageLimits(max_pixels=10_000))
    with pytest.raises(InvalidRequestError, match="took over 0.5 s"):
        load_image(f"{base}/slow.png", ImageLimits(timeout=0.5))
    with pytest.raises(InvalidRequestError, match="10,000,000 bytes, over the limit"):
        load_image(f"{base}/big.png", ImageLimits(max_bytes=1_000_000))
    path = tmp_path / "b.png"
    path.write_bytes(png_bytes(big))
    with pytest.raises(InvalidRequestError, match="over the limit"):
        load_image(str(path), ImageLimits(max_bytes=100))


def test_server_limits_on_local_files(tmp_path):
    """The server's limits: no plain paths, file:// only under allowed_local_media_path (symlinks resolved)."""
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png_bytes(test_image(2, (20, 20))))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(test_image(3, (20, 20))))
    (inside / "link.png").symlink_to(outside)
    with pytest.raises(InvalidRequestError, match="not an http"):
        load_image(str(inside / "a.png"), SERVER)
    with pytest.raises(InvalidRequestError, match="--allowed-local-media-path"):
        load_image(f"file://{inside / 'a.png'}", SERVER)
    allowed = ImageLimits(allow_paths=False, allowed_local_media_path=str(inside))
    assert load_image(f"file://{inside / 'a.png'}", allowed).size == (20, 20)
    for escape in (f"file://{outside}", f"file://{inside}/../secret.png", f"file://{inside / 'link.png'}"):
        with pytest.raises(InvalidRequestError, match="outside the allowed"):
            load_image(escape, allowed)
