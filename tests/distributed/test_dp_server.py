"""`llmserve serve --dp 2` on the tiny llama, run as a user runs it: one server, two engine replicas (the server's
own and a process), the `openai` client's greedy answers equal dp=1's, requests spread over both, a session kept on
its replica; a killed replica fails its request with 503 while the other keeps answering, /health says degraded, and
the replica comes back."""

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

from tests.distributed.test_tp_server import _children
from tests.web.test_chat_page import _free_port

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Paged attention keeps", "Hello world, this is a tiny tokenizer.", "Once"]


def _serve(model: str, dp: int, log_path) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "serve", model, "--server-name", "127.0.0.1",
                             "--server-port", str(port), "--dtype", "float32", "--dp", str(dp)],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", proc


def _wait(url: str, proc: subprocess.Popen, log_path, status: int = 200) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, open(log_path).read()
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == status and (status != 200 or not r.content):
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, open(log_path).read()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, str, subprocess.Popen, object]]:
    """(dp=1 URL, dp=2 URL, the dp=2 server's process, its log path)."""
    logs = tmp_path_factory.mktemp("dp")
    one, p1 = _serve(tiny_model_dir("llama"), 1, logs / "dp1.log")
    two, p2 = _serve(tiny_model_dir("llama"), 2, logs / "dp2.log")
    _wait(one, p1, logs / "dp1.log")
    _wait(two, p2, logs / "dp2.log")
    yield one, two, p2, logs / "dp2.log"
    for p in (p1, p2):
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _answer(url: str, prompt: str, max_tokens: int = 12, **extra) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True, **extra})
    return r.choices[0].text


def _metric(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def test_dp2_answers_as_dp1_over_both_replicas(servers) -> None:
    one, two, _, _ = servers
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _answer(two, PROMPTS[i % 4]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(8)] == [_answer(one, PROMPTS[i % 4]) for i in range(8)]
    time.sleep(1.0)  # the replica process reports its figures twice a second
    computed = _metric(two, "llmserve:replica_prompt_tokens_computed")
    assert set(computed) == {"0", "1"} and all(v > 0 for v in computed.values()), computed


def test_dp2_embeds_as_dp1(servers) -> None:
    """Embeddings go to the replicas as generation does (a replica process answers them over its pipe)."""
    one, two, _, _ = servers
    got: dict[int, list[float]] = {}

    def embed(url: str, i: int) -> list[float]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        r = client.embeddings.create(model=client.models.list().data[0].id, input=PROMPTS[i % 4],
                                     encoding_format="float")
        return r.data[0].embedding

    before = _metric(two, "llmserve:replica_prompt_tokens_computed").get("1", 0)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, embed(two, i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert _eventually(lambda: _metric(two, "llmserve:replica_prompt_tokens_computed").get("1", 0) > before)
    for i in range(8):
        want = embed(one, i)
        assert max(abs(a - b) for a, b in zip(got[i], want, strict=True)) < 1e-5


def test_a_session_stays_on_its_replica(servers) -> None:
    """The first turn goes to replica 1 (replica 0 is busy); the second, with replica 0 idle, still goes to replica 1,
    which holds the session's KV: its prefill reuses it."""
    _, two, _, _ = servers
    history = "The capital of France is Paris. The capital of Italy is"
    hits = lambda: sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(two + "/metrics").text.splitlines()  # noqa: E731
                       if line.startswith("llmserve:session_hit_tokens_total "))
    client = openai.OpenAI(base_url=two + "/v1", api_key="x")
    # replica 0 is busy with a stream as long as the tiny model's context allows; on a fast enough step even that can
    # finish before the session's first turn is routed (then both replicas are idle and the turn goes to replica 0,
    # which tests nothing): a fresh session then tries again
    for attempt in range(3):
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=240,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        before = _metric(two, "llmserve:replica_prompt_tokens_computed").get("1", 0)
        assert _metric(two, "llmserve:replica_outstanding_tokens").get("0", 0) > 0
        session = f"dp-session-{attempt}"
        _answer(two, history, session_id=session)
        stream.close()
        # the first turn ran on replica 1 (a replica reports its figures twice a second: a loaded machine may take
        # longer)
        if _eventually(lambda b=before: _metric(two, "llmserve:replica_prompt_tokens_computed").get("1", 0) > b):
            break
    else:
        pytest.fail("the session's first turn never went to the idle replica while the other was busy")
    start = hits()
    _answer(two, history + " Rome. The capital of Spain is", session_id=session)
    assert _eventually(lambda: hits() > start)


def _eventually(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_killed_replica_fails_its_request_and_comes_back(servers) -> None:
    one, two, proc, log = servers
    replica = [c for c in _children(proc.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()
               and "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]
    assert len(replica) == 1, replica
    client = openai.OpenAI(base_url=two + "/v1", api_key="x")
    model = client.models.list().data[0].id
    # a long stream keeps replica 0 busy, so the next request goes to replica 1
    stream = client.completions.create(model=model, prompt="Hello", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    result: dict[str, httpx.Response] = {}
    body = {"prompt": "Once", "max_tokens": 200, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.__setitem__("r", httpx.post(two + "/v1/completions", json=body,
                                                                             timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while _metric(two, "llmserve:replica_outstanding_tokens").get("1", 0) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(replica[0], signal.SIGKILL)
    t.join(60)
    assert result["r"].status_code == 503 and "replica 1 died" in result["r"].text
    assert len("".join(c.choices[0].text for c in stream)) > 0  # replica 0's stream finished
    health = httpx.get(two + "/health").json()
    assert health["status"] == "degraded" and health["replicas"][0] == "ok"
    assert _answer(two, PROMPTS[0]) == _answer(one, PROMPTS[0])  # still serving
    _wait(two, proc, log)  # started again: /health is a plain 200 once more
    assert _metric(two, "llmserve:replica_restarts") == {"0": 0.0, "1": 1.0}
    assert _answer(two, PROMPTS[1]) == _answer(one, PROMPTS[1])
