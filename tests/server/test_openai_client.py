"""The official `openai` client against the server on the tiny llama model.

The tiny model's text is noise (random weights, byte-level tokens), so checks compare the server
with itself (streamed == not streamed, same seed == same text) and with the tokenizer (usage and
logprob counts), and stop strings are taken from a greedy answer.
"""

from __future__ import annotations

import math

import openai
import pytest

from tests.server.harness import EngineHandle, RunningServer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_len(tiny: EngineHandle, messages: list[dict[str, str]]) -> int:
    return len(tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))


def test_models_lists_the_served_model(client: openai.OpenAI, tiny: EngineHandle) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny.model.name] == ["tiny-llama"]
    assert models[0].owned_by == "llmserve"


def test_chat_greedy_usage_counts_equal_the_tokenizer(client: openai.OpenAI, tiny: EngineHandle) -> None:
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0,
                                       logprobs=True, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == _prompt_len(tiny, MESSAGES)
    assert r.usage.completion_tokens == 12 == len(choice.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_equals_the_whole_answer_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_put_the_count_so_far_in_every_chunk(client: openai.OpenAI, tiny: EngineHandle,
                                                                    route: str) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it with every request): each chunk carries the
    usage so far, the last one the whole answer's."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=9,
                                                     temperature=0, stream=True, stream_options=opts,
                                                     extra_body={"ignore_eos": True}))
        prompt = _prompt_len(tiny, MESSAGES)
    else:
        chunks = list(client.completions.create(prompt="The capital of France is", model="tiny-llama", max_tokens=9,
                                                temperature=0, stream=True, stream_options=opts,
                                                extra_body={"ignore_eos": True}))
        prompt = len(tiny.tokenizer("The capital of France is")["input_ids"])
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 9 and chunks[-1].choices == []
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    # without include_usage it asks for nothing (as vLLM): no usage anywhere
    plain = list(client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=3, temperature=0,
                                                stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_chat_n2_with_seed_is_reproducible_and_samples_differ(client: openai.OpenAI) -> None:
    def ask(seed: int) -> list[str]:
        r = client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=16, temperature=1.0,
                                           n=2, seed=seed, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage.completion_tokens == 32
        return [c.message.content for c in r.choices]

    first = ask(1234)
    assert ask(1234) == first
    assert first[0] != first[1]  # sample i is seeded with seed + i
    assert ask(99) != first


def test_chat_logprobs_top_entries_for_greedy_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_chat_stop_string_cuts_the_answer(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=30, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next(greedy[i:i + 2] for i in range(3, len(greedy) - 2) if "\ufffd" not in greedy[i:i + 2])
    r = client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=30, temperature=0,
                                       stop=[stop, "never-produced"], extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == greedy[:greedy.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's extra field: which stop string


def test_completions_prompts_as_strings_and_token_ids(client: openai.OpenAI, tiny: EngineHandle) -> None:
    prompts = ["The capital of France", "Hello world"]
    r = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy: n equal
    assert r.usage.prompt_tokens == sum(len(tiny.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 5
    ids = tiny.tokenizer.encode(prompts[0])
    by_ids = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == r.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completions_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny-llama", prompt="Hello", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completions_echo_and_logprobs(client: openai.OpenAI, tiny: EngineHandle) -> None:
    prompt = "The quick brown fox"
    plain = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                  logprobs=2, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    n_prompt = len(tiny.tokenizer.encode(prompt))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])  # the prompt's (tests/server/test_prompt_logprobs.py)
    # Top entries hold the 2 most likely tokens plus the sampled one (here the same: greedy).
    assert all(len(top) == 2 for top in lp.top_logprobs[n_prompt:])
    offsets = [len(prompt)] + [len(prompt) + sum(len(t) for t in lp.tokens[n_prompt:n_prompt + i]) for i in (1, 2, 3)]
    assert lp.text_offset[n_prompt:] == offsets
    assert lp.text_offset[0] == 0


def test_completions_stream_with_several_prompts(client: openai.OpenAI) -> None:
    prompts = ["The capital of France", "Hello world"]
    whole = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=8, temperature=0)
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=8, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(messages=MESSAGES, model="tiny-llama", max_tokens=20, max_completion_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_logit_bias_forces_a_token(client: openai.OpenAI, tiny: EngineHandle) -> None:
    forced = tiny.tokenizer.encode(" capital")[0]
    r = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tiny.tokenizer.decode([forced] * 3)


def test_beam_search_and_best_of_through_the_client(client: openai.OpenAI, tiny_model_dir) -> None:
    """use_beam_search (width = best_of) and best_of > n return what the offline engine returns,
    streamed or not; the stream carries each beam's whole text in its final chunk."""
    from llmserve import EngineConfig, GenerationConfig, pipeline

    prompt = [5, 6, 7, 8, 9, 10]
    beam = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "ignore_eos": True}
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, n=2, extra_body=beam)
    gen = GenerationConfig(use_beam_search=True, beam_width=3, n=2, max_new_tokens=8, length_penalty=0.5,
                           ignore_eos=True)
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32")) as pipe:
        offline = pipe([{"input_ids": prompt}], gen_config=gen)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in offline]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in offline)
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, n=2, stream=True,
                                            extra_body=beam))
    streamed = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[0], streamed[1]] == [o.text for o in offline]
    best = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, n=2, seed=3, temperature=1.0,
                                     extra_body={"best_of": 4, "ignore_eos": True})
    assert len(best.choices) == 2 and best.usage.completion_tokens == 12
    assert all(c.logprobs is None for c in best.choices)


def test_usage_counts_the_prompt_tokens_taken_from_the_prefix_cache(client: openai.OpenAI, tiny: EngineHandle) -> None:
    """usage.prompt_tokens_details.cached_tokens: none the first time a prompt is seen; its full blocks (16 tokens
    here) the next time, on both routes, streamed or not."""
    messages = [{"role": "system", "content": "A prompt of several cache blocks that no other test sends: " * 2},
                {"role": "user", "content": "Hi"}]
    ask = dict(model="tiny-llama", messages=messages, max_tokens=2, temperature=0)
    first = client.chat.completions.create(**ask)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(**ask)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    prompt = "Another prompt of several blocks for the completions route, sent twice. " * 2
    more = {"max_tokens": 2, "n": 2, "temperature": 1, "extra_body": {"ignore_eos": True}}  # (both siblings go on)
    first = client.completions.create(model="tiny-llama", prompt=[prompt, "Hi"], **more)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny-llama", prompt=[prompt, "Hi"], **more)
    # the long prompt's full blocks before its last token (computed again to give the first token's logits); "Hi"
    # fills none; each prompt counted once for its two choices
    assert again.usage.prompt_tokens_details.cached_tokens == (len(tiny.tokenizer.encode(prompt)) - 1) // 16 * 16
