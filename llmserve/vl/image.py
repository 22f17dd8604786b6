"""Images in: `load_image` (a path, an http(s) URL, a data: URL, a file:// URL, bytes or a PIL image) with the limits
a server needs (download size and time, pixels, which local files), and the content hash images are known by.

Every failure a client can cause is an InvalidRequestError (a 400 on the server) that says what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from llmserve.errors import InvalidRequestError

# Defaults, each a keyword of load_image and a server option.
MAX_IMAGE_PIXELS = 40_000_000  # width x height; above it an image is refused before it is decoded (a bomb)
MAX_DOWNLOAD_BYTES = 32 * 1024 * 1024  # an http(s) image, a data: URL's payload or a file
FETCH_TIMEOUT_S = 10.0  # an http(s) download, connect to last byte


@dataclass(frozen=True)
class ImageLimits:
    """What load_image accepts. allow_paths: plain paths and file:// URLs anywhere (the offline API: it is the
    user's own machine); else only file:// URLs under allowed_local_media_path (the server's
    --allowed-local-media-path, vLLM's name), and none when that is None."""

    max_pixels: int = MAX_IMAGE_PIXELS
    max_bytes: int = MAX_DOWNLOAD_BYTES
    timeout: float = FETCH_TIMEOUT_S
    allow_paths: bool = True
    allowed_local_media_path: str | None = None


OFFLINE = ImageLimits()
SERVER = ImageLimits(allow_paths=False)


def load_image(source: Any, limits: ImageLimits = OFFLINE, param: str = "image") -> Any:
    """An RGB PIL image from `source`: a PIL image, bytes, a data: URL, an http(s) URL, a file:// URL or a path."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits, param)
        return source if source.mode == "RGB" else source.convert("RGB")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits, param)
    if not isinstance(source, str):
        raise InvalidRequestError(f"{param}: an image must be a URL, a path, bytes or a PIL image, got "
                                  f"{type(source).__name__}", param=param)
    if source.startswith("data:"):
        return decode_image(_data_url_bytes(source, limits, param), limits, param)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_download(source, limits, param), limits, param)
    if scheme == "file":
        return decode_image(_read_file(_file_url_path(source, param), limits, param, via_url=True), limits, param)
    if scheme and len(scheme) > 1:  # (one letter: a Windows drive)
        raise InvalidRequestError(f"{param}: unsupported image URL scheme {scheme!r}; use http(s)://, data:image/..."
                                  ";base64, or file:// (where the server allows local files)", param=param)
    if not limits.allow_paths:
        raise InvalidRequestError(f"{param}: {_short(source)!r} is not an http(s), data: or file:// URL", param=param)
    return decode_image(_read_file(source, limits, param, via_url=False), limits, param)


def decode_image(data: bytes, limits: ImageLimits = OFFLINE, param: str = "image") -> Any:
    """Decode image bytes (any format PIL reads), checking the pixel count before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidRequestError(f"{param}: the image is empty (0 bytes)", param=param)
    try:
        img = Image.open(io.BytesIO(data))
        _check_pixels(img.size, limits, param)
        img.load()  # decodes now: a truncated or corrupt file fails here, not in a worker thread later
        return img if img.mode == "RGB" else img.convert("RGB")
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"{param}: {e}", param=param) from None
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{param}: not an image PIL can read ({len(data)} bytes; PNG, JPEG, WebP, GIF, "
                                  "BMP and TIFF are)", param=param) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise InvalidRequestError(f"{param}: the image is truncated or corrupt ({e})", param=param) from None


def image_hash(img: Any) -> str:
    """A hash of the decoded pixels (mode, size and bytes): the same picture in another file format is the same
    image. Keys the encoder cache and the prefix cache."""
    h = hashlib.sha256(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()[:32]


def _check_pixels(size: tuple[int, int], limits: ImageLimits, param: str) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise InvalidRequestError(f"{param}: the image has no pixels ({w}x{h})", param=param)
    if w * h > limits.max_pixels:
        raise InvalidRequestError(f"{param}: the image is {w}x{h} = {w * h:,} pixels, over the limit of "
                                  f"{limits.max_pixels:,}", param=param)


def _data_url_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError(f"{param}: a data URL must be data:image/<type>;base64,<data>", param=param)
    media = header[len("data:"):-len(";base64")].lower()
    if media and not media.startswith("image/"):
        raise InvalidRequestError(f"{param}: the data URL's media type {media!r} is not an image type", param=param)
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise InvalidRequestError(f"{param}: the image data is over the limit of {limits.max_bytes:,} bytes",
                                  param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{param}: the data URL's payload is not valid base64", param=param) from None


def _download(url: str, limits: ImageLimits, param: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=limits.timeout, follow_redirects=True) as r:
            if r.status_code != 200:
                raise InvalidRequestError(f"{param}: fetching {_short(url)} answered HTTP {r.status_code}",
                                          param=param)
            declared = r.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise InvalidRequestError(f"{param}: {_short(url)} is {int(declared):,} bytes, over the limit of "
                                          f"{limits.max_bytes:,}", param=param)
            chunks, total = [], 0
            for chunk in r.iter_bytes():
                total += len(chunk)
                if total > limits.max_bytes:
                    raise InvalidRequestError(f"{param}: {_short(url)} is over the limit of {limits.max_bytes:,} "
                                              "bytes", param=param)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.TimeoutException:
        raise InvalidRequestError(f"{param}: fetching {_short(url)} took over {limits.timeout:g} s",
                                  param=param) from None
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"{param}: could not fetch {_short(url)}: {type(e).__name__}: {e}",
                                  param=param) from None


def _file_url_path(url: str, param: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"{param}: a file:// URL must name a local file (file:///path)", param=param)
    return urllib.parse.unquote(parts.path)


def _read_file(path: str, limits: ImageLimits, param: str, via_url: bool) -> bytes:
    path = os.path.expanduser(path)
    if not limits.allow_paths:
        root = limits.allowed_local_media_path
        if root is None:
            raise InvalidRequestError(f"{param}: file:// URLs are refused: the server was started without "
                                      "--allowed-local-media-path", param=param)
        real, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            raise InvalidRequestError(f"{param}: {_short(path)!r} is outside the allowed local media directory",
                                      param=param)
    try:
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise InvalidRequestError(f"{param}: {_short(path)!r} is {size:,} bytes, over the limit of "
                                      f"{limits.max_bytes:,}", param=param)
        with open(path, "rb") as f:
            return f.read()
    except InvalidRequestError:
        raise
    except OSError as e:
        what = "file URL" if via_url else "path"
        raise InvalidRequestError(f"{param}: cannot read the image {what} {_short(path)!r}: {e.strerror}",
                                  param=param) from None


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
