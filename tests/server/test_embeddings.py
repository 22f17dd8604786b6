"""/v1/embeddings through the official `openai` client on the tiny llama model: the vectors are transformers' (the
decoder's last hidden state at the last token, normalized) to the served dtype's rounding, in both encodings, for
text and token ids; vLLM's extras; refusals in OpenAI's shape; a client that leaves frees what its inputs held."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.engine.test_embeddings import reference
from tests.server.harness import EngineHandle, RunningServer, parked_engine, wait_until

TEXTS = ["Models run over flat tokens.", "The capital of France is Paris.", "A"]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def close_to(got: list[float], want: torch.Tensor) -> None:
    """Within the served dtype's rounding (bf16 on CPUs that have it): cosine and norm."""
    v = torch.tensor(got)
    assert v.shape == want.shape
    assert torch.nn.functional.cosine_similarity(v, want, dim=0) > 0.999
    assert abs(v.norm() - want.norm()) < 1e-2


def test_texts_in_both_encodings_match_transformers(client: openai.OpenAI, tiny: EngineHandle,
                                                    tiny_model_dir) -> None:
    ids = [tiny.tokenizer.encode(t) for t in TEXTS]
    r = client.embeddings.create(model="tiny-llama", input=TEXTS)  # the client asks for base64 and decodes it
    assert r.object == "list" and r.model == "tiny-llama" and [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(x) for x in ids)
    as_floats = client.embeddings.create(model="tiny-llama", input=TEXTS, encoding_format="float")
    for x, d, f in zip(ids, r.data, as_floats.data, strict=True):
        want = reference(tiny_model_dir("llama"), x, "LAST")
        close_to(d.embedding, want)
        close_to(f.embedding, want)


def test_token_ids_and_vllm_extras(client: openai.OpenAI, tiny: EngineHandle, tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    ids = [tiny.tokenizer.encode(t) for t in TEXTS]
    one = client.embeddings.create(model="tiny-llama", input=ids[1], encoding_format="float")
    close_to(one.data[0].embedding, reference(model_dir, ids[1], "LAST"))
    many = client.embeddings.create(model="tiny-llama", input=ids[:2], encoding_format="float")
    assert len(many.data) == 2 and many.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    raw = client.embeddings.create(model="tiny-llama", input=ids[0], encoding_format="float",
                                   extra_body={"normalize": False})
    close_to(raw.data[0].embedding, reference(model_dir, ids[0], "LAST", normalize=False))
    cut = client.embeddings.create(model="tiny-llama", input=ids[1], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    close_to(cut.data[0].embedding, reference(model_dir, ids[1][-3:], "LAST"))
    plain = client.embeddings.create(model="tiny-llama", input=TEXTS[0], encoding_format="float",
                                     extra_body={"add_special_tokens": False})
    assert plain.usage.prompt_tokens == len(tiny.tokenizer.encode(TEXTS[0], add_special_tokens=False))


@pytest.mark.parametrize("kwargs, param, status", [
    (dict(input=TEXTS[0], dimensions=8), "dimensions", 400),  # the tiny model is not a Matryoshka one
    (dict(input=[]), "input", 400),
    (dict(input=""), "input", 400),
    (dict(input=[5, 1000]), "input", 400),
    (dict(input=[5] * 300), "input", 400),  # over the context
    (dict(input=TEXTS[0], extra_body={"pooling": "mean"}), "pooling", 400),  # unknown: refused, not ignored
    (dict(input=TEXTS[0], extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens", 400),
    (dict(input=TEXTS[0], model="gpt-4"), None, 404),
])
def test_refusals_in_openai_shape(client: openai.OpenAI, server: RunningServer, kwargs, param, status) -> None:
    kwargs = {"model": "tiny-llama", **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(**kwargs)
    assert e.value.status_code == status
    if param is not None:
        assert e.value.body["param"] == param
    assert server.kv()["in_use"] == 0


def test_a_client_that_leaves_has_its_inputs_aborted(server: RunningServer, tiny: EngineHandle) -> None:
    aborts = server.metric("llmserve:request_success_total", finished_reason="abort")
    with parked_engine(tiny):
        try:  # the answer cannot come while the engine is parked: the client gives up
            httpx.post(server.url + "/v1/embeddings", json={"model": "tiny-llama", "input": TEXTS}, timeout=0.5)
        except httpx.ReadTimeout:
            pass
        wait_until(lambda: not server.state.in_flight, what="the server to notice the disconnect")
    report = server.kv()
    assert (report["in_use"], report["invariants_ok"], report["unfinished_requests"]) == (0, True, False)
    assert server.metric("llmserve:request_success_total", finished_reason="abort") == aborts + len(TEXTS)
    assert server.state.num_active == 0


def test_inputs_are_tokenized_as_asked() -> None:
    """add_special_tokens reaches the tokenizer (the tiny one adds none, so it is checked on one that adds a BOS); token
    ids pass as they are."""
    from types import SimpleNamespace

    from llmserve.serve.embedding_routes import input_ids

    class Bos:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1] * add_special_tokens + [ord(c) for c in text]

    model = SimpleNamespace(tokenizer=Bos(), session_len=64)
    assert input_ids(model, ["ab", "c"], True, None) == [[1, 97, 98], [1, 99]]
    assert input_ids(model, "ab", False, None) == [[97, 98]]
    assert input_ids(model, [[5, 6], [7]], True, None) == [[5, 6], [7]]


def test_truncation_keeps_the_special_tokens_the_tokenizer_adds(tiny_model_dir) -> None:
    """As vLLM and TEI truncate (through the tokenizer): an embedder's closing EOS, which LAST pooling reads, stays."""
    from types import SimpleNamespace

    from tokenizers.processors import TemplateProcessing

    from llmserve.serve.embedding_routes import input_ids
    from tests.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="$A <|im_end|>", special_tokens=[("<|im_end|>", 2)])
    text = "Models run over flat tokens with a paged KV cache."
    full = tok.encode(text)
    assert full[-1] == 2 and len(full) > 6
    model = SimpleNamespace(tokenizer=tok, session_len=256)
    assert input_ids(model, text, True, 5) == [full[-5:]]  # the last tokens, the EOS among them
    assert input_ids(model, text, True, 5, keep_first=True) == [full[:4] + [2]]  # the first, then the EOS
    assert tok.truncation_side == "right"  # put back


def test_an_input_over_the_kv_pool_names_input(tiny_model_dir) -> None:
    from llmserve import EngineConfig, pipeline
    from llmserve.errors import PromptTooLongError

    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(num_blocks=4, block_size=16)) as pipe:
        with pytest.raises(PromptTooLongError, match="KV cache") as e:
            pipe.embed({"input_ids": [5] * 100})
        assert e.value.param == "input"


def test_tei_embed(server: RunningServer, tiny: EngineHandle, tiny_model_dir) -> None:
    """Text Embeddings Inference's /embed: a list of vectors; normalize, truncate (either end), dimensions refused for
    a model not trained for them, prompt_name checked against the model's prompts (it has none)."""
    model_dir = tiny_model_dir("llama")
    post = lambda body: httpx.post(server.url + "/embed", json=body, timeout=60)  # noqa: E731
    r = post({"inputs": TEXTS[:2]})
    assert r.status_code == 200, r.text
    for text, v in zip(TEXTS[:2], r.json(), strict=True):
        close_to(v, reference(model_dir, tiny.tokenizer.encode(text), "LAST"))
    one = post({"inputs": TEXTS[1], "normalize": False}).json()
    assert len(one) == 1
    close_to(one[0], reference(model_dir, tiny.tokenizer.encode(TEXTS[1]), "LAST", normalize=False))
    long = tiny.tokenizer.encode("tokens " * 200)
    assert len(long) > 256  # over the tiny model's context
    assert post({"inputs": "tokens " * 200}).status_code == 400
    for direction, kept in (("Right", long[:256]), ("left", long[-256:])):
        got = post({"inputs": "tokens " * 200, "truncate": True, "truncation_direction": direction}).json()
        close_to(got[0], reference(model_dir, kept, "LAST"))
    r = post({"inputs": "tokens " * 200})
    assert "set truncate." in r.json()["error"]
    for body, word in (({"inputs": "a", "dimensions": 8}, "Matryoshka"), ({"inputs": "a", "prompt_name": "query"},
                                                                           "prompt_name"),
                       ({"inputs": "a", "pooling": "mean"}, "pooling"), ({"inputs": []}, "inputs")):
        r = post(body)
        assert r.status_code == 400 and word in r.json()["error"], r.text


def test_tei_prompt_name_prepends_the_models_prompt(tiny_model_dir, tmp_path) -> None:
    import json
    import shutil

    from tests.server.harness import engine_for, running_server

    model_dir = str(tmp_path / "prompts")
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    with open(f"{model_dir}/config_sentence_transformers.json", "w") as f:
        json.dump({"prompts": {"query": "Instruct: find it\nQuery: ", "document": ""}, "default_prompt_name": None}, f)
    with engine_for(model_dir, name="tiny-prompts", num_blocks=64) as handle, running_server(handle) as server:
        assert dict(handle.engine.engine.pooler.prompts)["query"] == "Instruct: find it\nQuery: "
        got = httpx.post(server.url + "/embed", json={"inputs": "Paris", "prompt_name": "query"}, timeout=60).json()
        plain = httpx.post(server.url + "/embed", json={"inputs": "Instruct: find it\nQuery: Paris"}, timeout=60).json()
    assert got == plain
