"""`llmserve serve` as a real process: it starts, logs what it serves, answers, and on SIGTERM ends
its streams (finished or aborted, each closed with [DONE]) and exits 0. Plus the model argument
that serve and generate share."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from llmserve.cli import build_parser, main, resolve_model
from tests.server.harness import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_stream(url: str, body: dict, first_chunk: threading.Event, out: list[dict]) -> None:
    result = {"chunks": 0, "done": False, "finish_reason": None, "text": ""}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                result["chunks"] += 1
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
                first_chunk.set()
    out.append(result)


def test_serve_process_answers_and_exits_0_on_sigterm(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    port, url = _free_port(), None
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", tiny_model_dir("llama"), "--server-port",
           str(port), "--model-name", "tiny", "--dtype", "float32", "--num-blocks", "64", "--cache-block-seq-len", "16",
           "--shutdown-timeout", "0"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=120, what="the server to be ready")
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                       "content": "Hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        started, results = [threading.Event() for _ in range(4)], []
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        readers = [threading.Thread(target=_read_stream, args=(url, body, e, results)) for e in started]
        for t in readers:
            t.start()
        assert all(e.wait(60) for e in started)  # all four are streaming (later ones would get a 503)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a bound against hanging, not a timing check
        for t in readers:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert len(results) == 4
    for res in results:  # every stream ended properly, whether it finished or was cut by the shutdown
        assert res["done"] and res["finish_reason"] in ("length", "abort")
        assert (res["finish_reason"] == "length") == (res["chunks"] == 200)
    aborted = sum(res["finish_reason"] == "abort" for res in results)
    assert f"listening on http://127.0.0.1:{port}" in log
    assert f"serving tiny ({tiny_model_dir('llama')}, float32 on cpu) at http://127.0.0.1:{port}" in log
    assert "KV cache: 64 blocks of 16 tokens = 1024 tokens; up to 256 tokens per sequence" in log
    assert "SIGTERM: shutting down" in log and "engine stopped" in log
    assert (f"aborted {aborted} request(s)" in log) == (aborted > 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


def test_model_is_positional_or_a_flag_in_serve_and_generate() -> None:
    parser = build_parser()
    for argv, model in ((["serve", "m1"], "m1"), (["serve", "--model", "m2"], "m2"), (["serve"], None),
                        (["serve", "m3", "--model", "m3"], "m3")):
        args = parser.parse_args(argv)
        resolve_model(args)
        assert args.model == model
    args = parser.parse_args(["generate", "m4", "Hello there"])
    assert (args.model, args.prompt) == ("m4", "Hello there")
    args = parser.parse_args(["generate", "Hello there", "--model", "m5"])
    resolve_model(args)
    assert (args.model, args.prompt) == ("m5", "Hello there")


def test_two_different_models_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two models given: 'a' and --model 'b'" in capsys.readouterr().err


def test_serve_flags_carry_lmdeploy_names_and_defaults() -> None:
    args = build_parser().parse_args(["serve", "--session-len", "512", "--cache-block-seq-len", "16",
                                      "--max-batch-size", "8", "--enable-prefix-caching", "--api-keys", "k1", "k2",
                                      "--allow-origins", "http://localhost:3000", "--chat-template", "chatml"])
    assert (args.session_len, args.block_size, args.max_batch_size, args.enable_prefix_caching) == (512, 16, 8, True)
    assert args.api_keys == ["k1", "k2"] and args.allow_origins == ["http://localhost:3000"]
    defaults = build_parser().parse_args(["serve"])
    from llmserve.cli import dataclass_from_args
    from llmserve.serve.config import ServerConfig

    config = dataclass_from_args(ServerConfig, defaults)
    assert (config.server_name, config.server_port, config.api_keys, config.allow_origins) == \
        ("127.0.0.1", 23333, None, None)
    assert defaults.log_level == "INFO"


def test_vllm_host_and_port_are_aliases() -> None:
    from llmserve.cli import dataclass_from_args
    from llmserve.serve.config import ServerConfig

    for argv in (["--host", "0.0.0.0", "--port", "8000"], ["--server-name", "0.0.0.0", "--server-port", "8000"]):
        config = dataclass_from_args(ServerConfig, build_parser().parse_args(["serve", *argv]))
        assert (config.server_name, config.server_port) == ("0.0.0.0", 8000)
