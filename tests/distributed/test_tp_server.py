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
    procs, urls, logs = [], [], []
    for tp in (1, 2):
        port = _free_port()
        logs.append(tmp_path_factory.mktemp(f"tp{tp}") / "serve.log")
        procs.append(_start([sys.executable, "-m", "llmserve.cli", "serve", model, "--server-name", "127.0.0.1",
                             "--server-port", str(port), "--dtype", "float32", "--tp", str(tp),
                             "--enable-debug-routes"], logs[-1]))
        urls.append(f"http://127.0.0.1:{port}")
    for url, proc, log in zip(urls, procs, logs):
        _wait_healthy(url, [proc], log)
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


def _start(args: list[str], log_path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _wait_healthy(url: str, procs: list[subprocess.Popen], log_path) -> None:
    deadline = time.monotonic() + 120
    while True:
        for p in procs:
            assert p.poll() is None, f"a process exited with {p.returncode}:\n{open(log_path).read()}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, open(log_path).read()
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen]) -> list[int]:
    procs[0].send_signal(signal.SIGINT)  # node 0: its engine stops the other ranks
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(30))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def test_two_nodes_on_localhost(servers, tiny_model_dir, tmp_path) -> None:
    """tp=2 across two `llmserve serve` processes acting as two machines over TCP (--nnodes 2, --node-rank,
    --master-addr, --master-port): node 0 serves HTTP and answers as tp=1; stopping it stops node 1 cleanly."""
    tp1 = servers[0]
    model, master, port = tiny_model_dir("llama"), _free_port(), _free_port()
    common = [sys.executable, "-m", "llmserve.cli", "serve", model, "--dtype", "float32", "--tp", "2", "--nnodes",
              "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    node1 = _start(common + ["--node-rank", "1"], tmp_path / "node1.log")
    node0 = _start(common + ["--node-rank", "0", "--server-name", "127.0.0.1", "--server-port", str(port)],
                   tmp_path / "node0.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, [node0, node1], tmp_path / "node0.log")
        assert [_answer(url, p) for p in PROMPTS] == [_answer(tp1, p) for p in PROMPTS]
    finally:
        codes = _stop([node0, node1])
    assert codes == [0, 0], (open(tmp_path / "node0.log").read(), open(tmp_path / "node1.log").read())


def test_under_torchrun(servers, tiny_model_dir, tmp_path) -> None:
    """Started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): rank 0 serves, rank 1 follows."""
    tp1 = servers[0]
    port = _free_port()
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(_free_port()), "-m", "llmserve.cli", "serve", tiny_model_dir("llama"), "--dtype", "float32",
                   "--tp", "2", "--server-name", "127.0.0.1", "--server-port", str(port)], tmp_path / "torchrun.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, [proc], tmp_path / "torchrun.log")
        assert [_answer(url, p) for p in PROMPTS] == [_answer(tp1, p) for p in PROMPTS]
    finally:
        _stop([proc])  # (torchrun itself exits 1 on the SIGINT it forwards: its own convention)
    assert "engine stopped" in open(tmp_path / "torchrun.log").read()
