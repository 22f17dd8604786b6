"""LoRA adapters over HTTP: a real uvicorn server on the tiny llama with three PEFT adapters, the official `openai`
client naming adapters as its model, TGI's `adapter_id`, /v1/models, and vLLM's run-time load/unload routes."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.lora.adapters import peft_greedy
from tests.server.harness import engine_for, running_server

NEW_TOKENS = 8
TEXTS = ["The capital of France is", "Paged attention keeps the KV cache in blocks, and"]


@pytest.fixture(scope="module")
def prompts(base_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(base_dir, adapter_dirs, prompts) -> dict[str | None, list[list[int]]]:
    out = {name: [peft_greedy(base_dir, d, p, NEW_TOKENS) for p in prompts] for name, d in adapter_dirs.items()}
    out[None] = [peft_greedy(base_dir, None, p, NEW_TOKENS) for p in prompts]
    return out


@pytest.fixture(scope="module")
def server(base_dir, adapter_dirs):
    started = {name: adapter_dirs[name] for name in ("qv", "all")}  # "mlp" is loaded at run time
    with engine_for(base_dir, name="tiny-llama", adapters=started, num_blocks=128, block_size=8) as handle:
        with running_server(handle, enable_debug_routes=True) as s:
            yield s


def _text(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model and r.usage.completion_tokens == NEW_TOKENS
    return r.choices[0].text.rstrip("\ufffd")


def _tokens(server, model: str, i: int) -> list[int]:
    """TGI's /generate with `adapter_id` (text_generation 0.7's client predates it: the body TGI documents)."""
    r = httpx.post(server.url + "/generate", json={"inputs": TEXTS[i], "parameters": {
        "adapter_id": model, "max_new_tokens": NEW_TOKENS, "details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


@pytest.fixture(scope="module")
def expected_text(server, expected) -> dict[str | None, list[str]]:
    # (the server holds back an incomplete UTF-8 character at the end of the text, which decode shows as U+FFFD)
    tok = server.state.model.tokenizer
    return {name: [tok.decode(ids).rstrip("\ufffd") for ids in outs] for name, outs in expected.items()}


def test_models_lists_the_base_model_and_its_adapters(server, adapter_dirs) -> None:
    cards = {c.id: c for c in openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list().data}
    assert set(cards) == {"tiny-llama", "qv", "all"}
    assert cards["qv"].parent == "tiny-llama" and cards["qv"].root == adapter_dirs["qv"]
    assert cards["tiny-llama"].parent is None


def test_each_model_name_answers_with_its_adapter(server, prompts, expected_text) -> None:
    """Concurrent clients, each naming the base model or an adapter: each answer is transformers + PEFT's."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    jobs = [(m, i) for m in ("tiny-llama", "qv", "all") for i in range(len(prompts))] * 2
    got: dict[int, str] = {}

    def run(k: int, model: str, i: int) -> None:
        got[k] = _text(client, model, prompts[i])

    threads = [threading.Thread(target=run, args=(k, m, i)) for k, (m, i) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for k, (m, i) in enumerate(jobs):
        assert got[k] == expected_text[None if m == "tiny-llama" else m][i], (m, i)
    kv = server.kv()
    assert kv["invariants_ok"] and kv["unfinished_requests"] == 0


def test_chat_streams_under_an_adapter_and_a_disconnect_frees_its_blocks(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.chat.completions.create(model="all", messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=30, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.model == "all"
    stream.close()  # the client leaves mid-stream
    from tests.server.harness import wait_until

    wait_until(lambda: server.kv()["unfinished_requests"] == 0, what="the aborted request to be freed")
    assert server.kv()["invariants_ok"]


def test_unknown_model_is_a_404(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "`qv`" in e.value.body["message"]


def test_tgi_adapter_id(server, expected) -> None:
    assert _tokens(server, "qv", 0) == expected["qv"][0]
    assert _tokens(server, "tiny-llama", 0) == expected[None][0]
    r = httpx.post(server.url + "/generate", json={"inputs": "hi", "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 400 and "adapter_id" in r.json()["error"]


def test_load_and_unload_at_run_time(server, adapter_dirs, expected, tmp_path) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    url = server.url + "/v1/"
    r = httpx.post(url + "load_lora_adapter", json={"lora_name": "mlp", "lora_path": adapter_dirs["mlp"]})
    assert r.status_code == 200 and "added successfully" in r.text
    assert "mlp" in {c.id for c in client.models.list().data}
    assert _tokens(server, "mlp", 1) == expected["mlp"][1]
    again = httpx.post(url + "load_lora_adapter", json={"lora_name": "mlp", "lora_path": adapter_dirs["mlp"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # replaced in place by another adapter: its answers change, nothing cached under the first is served
    r = httpx.post(url + "load_lora_adapter", json={"lora_name": "mlp", "lora_path": adapter_dirs["qv"],
                                                    "load_inplace": True})
    assert r.status_code == 200
    assert _tokens(server, "mlp", 1) == expected["qv"][1]
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt="hi", max_tokens=2)
    r = httpx.post(url + "unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 404
    bad = httpx.post(url + "load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    bad = httpx.post(url + "load_lora_adapter", json={"lora_name": 3, "lora_path": "/x"})
    assert bad.status_code == 400
    assert _tokens(server, "qv", 0) == expected["qv"][0]  # still serving


def test_routes_without_lora_say_how_to_enable_it(base_dir) -> None:
    with engine_for(base_dir, name="tiny-llama", num_blocks=32) as handle, running_server(handle) as s:
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_metrics_report_adapters(server) -> None:
    from tests.server.harness import wait_until

    wait_until(lambda: "llmserve:lora_requests_info{" in httpx.get(server.url + "/metrics").text,
               what="the engine's stats snapshot")
    text = httpx.get(server.url + "/metrics").text
    info = next(line for line in text.splitlines() if line.startswith("llmserve:lora_requests_info{"))
    assert 'max_lora="4"' in info and 'running_lora_adapters=""' in info
