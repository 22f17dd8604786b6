"""`llmserve serve --tp 2` on the tiny llama, run as a user runs it: the `openai` client's greedy answers equal
tp=1's, concurrent streams with a disconnect leave no block behind; a killed worker rank fails the requests, turns
/health to 503 and ends the server with a non-zero exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.web.test_chat_page import _free_port

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Paged attention keeps", "Hello world, this is a tiny tokenizer."]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """(tp=1 URL, tp=2 URL, the tp=2 server's process)."""
    model = tiny_model_dir("llama")
    procs, urls = [], []
    for tp in (1, 2):
        port = _free_port()
        log = open(tmp_path_factory.mktemp(f"tp{tp}") / "serve.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "llmserve.cli", "serve", model, "--server-name",
                                       "127.0.0.1", "--server-port", str(port), "--dtype", "float32", "--tp", str(tp),
                                       "--enable-debug-routes"], stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    for url, proc in zip(urls, procs):
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.2)
    yield urls[0], urls[1], procs[1]
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _answer(url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    return r.choices[0].text


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def test_tp2_server_answers_as_tp1(servers) -> None:
    tp1, tp2, _ = servers
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _answer(tp2, PROMPTS[i % 3]))) for i in range(6)]
    for t in threads:
        t.start()
    # a stream the client leaves mid-answer, meanwhile
    client = openai.OpenAI(base_url=tp2 + "/v1", api_key="x")
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=40,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(6)] == [_answer(tp1, PROMPTS[i % 3]) for i in range(6)]
    deadline = time.monotonic() + 30
    while httpx.get(tp2 + "/debug/kv").json()["unfinished_requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    kv = httpx.get(tp2 + "/debug/kv").json()
    assert kv["invariants_ok"] and kv["in_use"] == 0


def test_a_killed_worker_ends_the_server(servers) -> None:
    _, tp2, proc = servers
    workers = [c for c in _children(proc.pid) if "llmserve" in open(f"/proc/{c}/cmdline").read()
               or "multiprocessing" in open(f"/proc/{c}/cmdline").read()]
    assert workers, "no worker process found"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    r = httpx.post(tp2 + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code in (500, 503) and "rank 1" in r.text
    assert proc.wait(30) == 1  # a bound on waiting: the server notices and exits
