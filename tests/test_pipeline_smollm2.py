"""The offline API on the embedded SmolLM2-135M-Instruct (Q4_1 GGUF, converted and cached on first use)."""

from __future__ import annotations

import pytest

from llmserve import (
    EngineConfig,
    GenerationConfig,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    pipeline,
)

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def pipe():
    with pipeline(backend_config=EngineConfig(dtype="float32", session_len=512, num_blocks=64)) as p:
        yield p


def test_greedy_answer_names_paris(pipe):
    r = pipe(QUESTION, gen_config=GREEDY)
    assert "Paris" in r.text
    assert r.finish_reason == "stop"
    assert r.generate_token_len == len(r.token_ids)
    assert pipe.tokenizer.decode(r.token_ids, skip_special_tokens=True) == r.text
    assert r.input_token_len == len(pipe.tokenizer.encode(
        pipe.chat_template.messages_to_prompt([{"role": "user", "content": QUESTION}])))


def test_stream_joined_equals_non_streamed(pipe):
    prompts = [QUESTION, "Name three colours."]
    full = pipe(prompts, gen_config=GREEDY)
    texts = {0: "", 1: ""}
    ids: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for r in pipe.stream_infer(prompts, gen_config=GREEDY):
        texts[r.index] += r.text
        ids[r.index] += r.token_ids
        if r.finish_reason is not None:
            finals[r.index] = r
    assert [texts[0], texts[1]] == [full[0].text, full[1].text]
    assert [ids[0], ids[1]] == [full[0].token_ids, full[1].token_ids]
    assert {i: f.generate_token_len for i, f in finals.items()} == {0: full[0].generate_token_len,
                                                                    1: full[1].generate_token_len}


def test_prompt_forms_agree(pipe):
    messages = [{"role": "user", "content": QUESTION}]
    as_text = pipe(QUESTION, gen_config=GREEDY)
    as_messages = pipe(messages, gen_config=GREEDY)
    as_batch_of_messages = pipe([messages], gen_config=GREEDY)[0]
    ids = pipe.tokenizer.encode(pipe.chat_template.messages_to_prompt(messages))
    as_ids = pipe({"input_ids": ids}, gen_config=GREEDY)
    mii_style = pipe(QUESTION, max_new_tokens=24, temperature=0)
    assert as_text.text == as_messages.text == as_batch_of_messages.text == as_ids.text == mii_style.text


def test_chat_session_second_turn_sees_the_first(pipe):
    s = pipe.chat("My name is Ada. Remember it.", gen_config=GREEDY)
    first_answer = s.response.text
    s = pipe.chat("What is my name?", session=s, gen_config=GREEDY)
    assert [m["role"] for m in s.history] == ["user", "assistant", "user", "assistant"]
    assert s.history[1]["content"] == first_answer
    prompt = pipe.chat_template.messages_to_prompt(s.history[:3])
    assert "My name is Ada" in prompt and first_answer in prompt
    assert s.response.input_token_len == len(pipe.tokenizer.encode(prompt))
    # The engine kept the conversation's KV (its session) for a third turn; ending it frees it.
    assert pipe.engine.kv.usage().in_use > 0
    assert pipe.end_session(s) and pipe.engine.kv.usage().in_use == 0


def test_stop_words_cut_the_text(pipe):
    r = pipe(QUESTION, gen_config=GREEDY.replace(stop_words=["Paris"]))
    assert r.finish_reason == "stop" and not r.text.endswith("Paris") and "Paris" not in r.text
    kept = pipe(QUESTION, gen_config=GREEDY.replace(stop_words=["Paris"], include_stop_str_in_output=True))
    assert kept.text.endswith("Paris") and kept.text == r.text + "Paris"


def test_bad_words_are_never_produced(pipe):
    r = pipe(QUESTION, gen_config=GREEDY.replace(bad_words=["Paris"]))
    assert "Paris" not in r.text


@pytest.mark.parametrize("call, error, message", [
    (lambda p: p([]), InvalidRequestError, "non-empty"),
    (lambda p: p("hi " * 600), PromptTooLongError, "session length of 512"),
    (lambda p: p("hi", temperature=-1), InvalidRequestError, "temperature: must be >= 0"),
    (lambda p: p("hi", top_p=1.5), InvalidRequestError, "top_p: must be in (0, 1]"),
    (lambda p: p("hi", n=0), InvalidRequestError, "n: must be >= 1"),
    (lambda p: p("hi", max_new_tokens="ten"), InvalidRequestError, "max_new_tokens: expected int"),
    (lambda p: p("hi", no_such_option=1), InvalidRequestError, "unknown generation parameter"),
    (lambda p: p({"input_ids": [1, 10**9]}), InvalidRequestError, "not in the vocabulary"),
    (lambda p: p(42), InvalidRequestError, "prompts must be"),
])
def test_bad_input_raises_clear_error_and_pipeline_still_answers(pipe, call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        call(pipe)
    assert pipe.engine.kv.usage().in_use == 0
    assert "Paris" in pipe(QUESTION, gen_config=GREEDY).text


def test_unknown_model_path_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no_such_model"):
        pipeline(str(tmp_path / "no_such_model"))
