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
                          "completion_tokens": 2, "total_tokens": r["usage"]["prompt_tokens"] + 2}
