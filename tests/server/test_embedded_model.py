"""The server on the embedded SmolLM2-135M-Instruct: real text, so answers and counts can be checked
against the tokenizer itself (re-tokenized answers, UTF-8 bytes of logprob tokens, EOS handling)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import EngineHandle, RunningServer, engine_for, running_server

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")]
text_generation = pytest.importorskip("text_generation", reason="TGI's client is missing: run scripts/setup.sh")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[EngineHandle, RunningServer]]:
    # First use on a machine converts the GGUF (~15 s); later loads come from the cache.
    with engine_for(None, num_blocks=64) as handle, running_server(handle) as server:
        yield handle, server


@pytest.fixture(scope="module")
def client(smol: tuple[EngineHandle, RunningServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol[1].url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris_and_counts_match_the_tokenizer(client: openai.OpenAI,
                                                           smol: tuple[EngineHandle, RunningServer]) -> None:
    tok = smol[0].tokenizer
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    assert choice.model_extra["stop_reason"] == 2  # <|im_end|>, not counted as a completion token
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
    assert r.usage.completion_tokens == len(tok.encode(ANSWER, add_special_tokens=False)) == \
        len(choice.logprobs.content)
    assert b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode() == ANSWER
    assert "".join(t.token for t in choice.logprobs.content) == ANSWER


def test_streamed_chat_equals_the_answer(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_inside_the_answer(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, temperature=0,
                                       stop=["Paris"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The capital of France is ", "stop")
    kept = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, temperature=0,
                                          stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The capital of France is Paris"


def test_tgi_generate_ends_with_the_eos_token(smol: tuple[EngineHandle, RunningServer]) -> None:
    handle, server = smol
    prompt = handle.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    r = text_generation.Client(server.url, timeout=60).generate(prompt, max_new_tokens=30)
    assert r.generated_text == ANSWER
    d = r.details
    assert d.finish_reason == "eos_token"
    assert d.tokens[-1].id == 2 and d.tokens[-1].special and d.tokens[-1].logprob is None
    assert d.generated_tokens == len(d.tokens) == len(handle.tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
    events = list(text_generation.Client(server.url, timeout=60).generate_stream(prompt, max_new_tokens=30))
    assert "".join(e.token.text for e in events if not e.token.special) == ANSWER
    assert events[-1].token.special and events[-1].details.finish_reason == "eos_token"


def test_completions_on_raw_text(smol: tuple[EngineHandle, RunningServer]) -> None:
    handle, server = smol
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == "The capital of France is Paris."
    assert r["usage"] == {"prompt_tokens": len(handle.tokenizer.encode("The capital of France is")),
                          "prompt_tokens_details": {"cached_tokens": 0},
                          "completion_tokens": 2, "total_tokens": r["usage"]["prompt_tokens"] + 2}


EDIT = [{"role": "user", "content": "Rewrite this code with the function renamed to add_numbers. Reply with the code "
                                    "only.\n\ndef add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"}]


def test_predicted_outputs_keep_the_answer_and_count_the_drafts(client: openai.OpenAI) -> None:
    """OpenAI's Predicted Outputs: the answer is the one without a prediction; the usage counts the prediction's
    tokens accepted and rejected (here the model's own answer, and an edit of it)."""
    ask = dict(model="SmolLM2-135M-Instruct.Q4_1", messages=EDIT, temperature=0, max_tokens=80)
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # (no prediction, no details)
    exact = client.chat.completions.create(**ask, prediction={"type": "content", "content": text})
    assert exact.choices[0].message.content == text
    details = exact.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0.8 * exact.usage.completion_tokens
    assert details.rejected_prediction_tokens <= 0.1 * exact.usage.completion_tokens
    before = "# the old version\n" + text.replace("(2, 3)", "(4, 5)")  # an edit of it
    parts = [{"type": "text", "text": before[:10]}, {"type": "text", "text": before[10:]}]
    edited = client.chat.completions.create(**ask, prediction={"type": "content", "content": parts})
    assert edited.choices[0].message.content == text
    assert edited.usage.completion_tokens_details.accepted_prediction_tokens > 0
    chunks = list(client.chat.completions.create(**ask, prediction={"type": "content", "content": text}, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage == exact.usage


@pytest.mark.parametrize("prediction", [{"type": "text", "content": "x"}, {"type": "content"},
                                        {"type": "content", "content": 5},
                                        {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}])
def test_malformed_predictions_are_refused(client: openai.OpenAI, prediction: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=EDIT, max_tokens=4,
                                       prediction=prediction)
    assert e.value.body["param"] == "prediction"


def test_vllm_tokenize_and_detokenize(smol: tuple[EngineHandle, RunningServer], client: openai.OpenAI) -> None:
    """vLLM's /tokenize: a prompt as the tokenizer encodes it; a chat as /v1/chat/completions renders it (its count
    is that route's usage.prompt_tokens); /detokenize gives the text back; both under /v1/ too."""
    handle, server = smol
    tok = handle.tokenizer
    text = "Tokenizers split text into pieces."
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == handle.model.session_len
    assert httpx.post(server.url + "/v1/tokenize", json={"prompt": text}).json()["tokens"] == body["tokens"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = httpx.post(server.url + "/tokenize", json={"messages": QUESTION, "model": "SmolLM2-135M-Instruct.Q4_1"})
    used = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, max_tokens=1).usage
    assert chat.json()["count"] == used.prompt_tokens
    assert tok.decode(chat.json()["tokens"]).endswith("<|im_start|>assistant\n")  # the assistant's turn opened
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    left_open = httpx.post(server.url + "/tokenize", json={"messages": prefill, "continue_final_message": True})
    assert tok.decode(left_open.json()["tokens"]).endswith("<|im_start|>assistant\nThe capital is")
    used = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=prefill, max_tokens=1,
                                          extra_body={"continue_final_message": True}).usage
    assert left_open.json()["count"] == used.prompt_tokens


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "a", "messages": QUESTION}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "a", "model": "another-model"}, 404, None),
    ({"messages": QUESTION, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ({"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message"),
    ({"prompt": "a", "chat_template_kwargs": {"x": 1}}, 400, "chat_template_kwargs"),
    ({"prompt": "a", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"inputs": "a", "prompt": "b"}, 400, "prompt"),
    ({"inputs": "a", "model": "another-model"}, 404, None),
    ({"inputs": "a", "parameters": {"truncate": 0}}, 400, "truncate"),
])
def test_bad_tokenize_bodies_are_refused(smol: tuple[EngineHandle, RunningServer], body: dict, status: int,
                                         param: str | None) -> None:
    r = httpx.post(smol[1].url + "/v1/tokenize", json=body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    bad = httpx.post(smol[1].url + "/v1/detokenize", json={"tokens": [1, 10 ** 7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tgi_tokenize(smol: tuple[EngineHandle, RunningServer]) -> None:
    """TGI's /tokenize: each token with its characters in the inputs; truncate keeps the last ones."""
    text = "Hello world, hello tokens."
    r = httpx.post(smol[1].url + "/tokenize", json={"inputs": text, "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 200
    tokens = r.json()
    assert [t["id"] for t in tokens] == smol[0].tokenizer.encode(text)
    assert "".join(t["text"] for t in tokens) == text
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens)
    last = httpx.post(smol[1].url + "/tokenize", json={"inputs": text, "parameters": {"truncate": 3}}).json()
    assert last == tokens[-3:]
    assert httpx.get(smol[1].url + "/version").json() == {"version": llmserve_version()}


def llmserve_version() -> str:
    import llmserve

    return llmserve.__version__


def test_embeddings_match_transformers_on_smollm2(client: openai.OpenAI,
                                                  smol: tuple[EngineHandle, RunningServer]) -> None:
    """/v1/embeddings on the real model (bf16 where the CPU has it, from the GGUF's blocks) against transformers in
    fp32 over the same converted checkpoint: the last token's final hidden state, normalized."""
    import torch

    from tests.engine.test_embeddings import reference

    texts = ["The capital of France is Paris.", "Paged attention keeps the KV cache in blocks of tokens, " * 8]
    r = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
    model_dir = smol[0].engine.engine.loaded.model_dir
    assert r.usage.prompt_tokens == sum(len(smol[0].tokenizer.encode(t)) for t in texts)
    for text, d in zip(texts, r.data, strict=True):
        want = reference(model_dir, smol[0].tokenizer.encode(text), "LAST")
        assert len(d.embedding) == 576
        assert torch.nn.functional.cosine_similarity(torch.tensor(d.embedding), want, dim=0) > 0.995
