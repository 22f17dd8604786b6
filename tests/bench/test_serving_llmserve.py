"""Smoke test: `llmserve bench serving` against a real `llmserve serve` process on a tiny model, over
both endpoints. Both sides share the tiny tokenizer and chat template, so the server's usage must
count exactly the prompt tokens the benchmark sized, and ignore_eos must give every requested token."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from llmserve.bench.datasets import synthetic_chat
from llmserve.chat_template import ChatTemplate
from llmserve.cli import main
from tests.tiny_models import tiny_tokenizer

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Callable[[str], str]) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", tiny_model_dir("llama"), "--server-name", "127.0.0.1",
           "--server-port", str(port), "--dtype", "float32", "--num-blocks", "64", "--cache-block-seq-len", "16",
           "--log-level", "WARNING", "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a bound on waiting for start-up, not a timing check
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llmserve serve exited: {proc.stderr.read()}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llmserve serve did not start in 120 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_serving_against_llmserve(served: str, tiny_model_dir: Callable[[str], str], endpoint: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serving", "--base-url", served, "--tokenizer", tiny_model_dir("llama"), "--endpoint",
               endpoint, "--num-prompts", "4", "--input-len", "20:30", "--output-len", "8", "--concurrency", "2",
               "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    tok = tiny_tokenizer()
    expected = synthetic_chat(tok, ChatTemplate(tok), 4, (20, 30), 8)
    assert rc == 0
    assert (out["completed"], out["failed"], out["first_error"]) == (4, 0, None)
    assert (out["output_tokens"], out["output_tokens_source"]) == (32, "usage")
    assert out["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    assert out["ttft_ms"]["mean"] > 0 and out["tpot_ms"]["mean"] > 0 and out["itl_ms"]["mean"] > 0


@pytest.mark.parametrize("structured", ["json-schema", "regex", "choice"])
def test_bench_serving_structured(served: str, tiny_model_dir: Callable[[str], str], structured: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serving", "--base-url", served, "--tokenizer", tiny_model_dir("llama"), "--num-prompts", "3",
               "--input-len", "20:30", "--output-len", "8", "--structured", structured, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["structured"] == structured
    assert (out["completed"], out["failed"]) == (3, 0)
    assert 3 <= out["output_tokens"] <= 24  # a choice ends early; the others may run to max_tokens
