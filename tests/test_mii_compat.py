"""DeepSpeed-MII's non-persistent pipeline (seed 004): the seed's examples run with only the import (`import mii` ->
`import llmserve as mii`) and the model changed (the embedded SmolLM2-135M-Instruct for Mistral-7B-v0.1).

`max_length` is MII's: prompt plus output tokens, so each prompt's max_new_tokens is max_length minus its own token
count, counted after the chat template. The launcher example, run with python as the seed allows for one device,
asks for max_length=16 where "DeepSpeed is" is 33 tokens in the chat template: it raises the error that says so, and
runs with do_preprocess=False (the raw text, as MII sends it). Not run (docs/compat.md, "Seed examples"): tensor
parallelism through the deepspeed launcher; `all_rank_output`, which only the launcher's ranks use, is refused by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import pytest

from llmserve import GenerationConfig, InvalidRequestError, Pipeline

MODEL = None  # the embedded SmolLM2-135M-Instruct, for "mistralai/Mistral-7B-v0.1"
# "DeepSpeed is" and "Seattle is" in SmolLM2's chat template (with its default system prompt): a string prompt goes
# through the template here, as in LMDeploy's pipeline; MII sends it raw (do_preprocess=False does that here).
TEMPLATED_PROMPT_TOKENS = 33


@pytest.mark.slow
def test_seed_004_four_line_example(capsys: pytest.CaptureFixture[str]) -> None:
    import llmserve as mii

    pipe = mii.pipeline(MODEL)
    response = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=128)
    print(response)

    assert capsys.readouterr().out == repr(response) + "\n"
    assert [r.index for r in response] == [0, 1]
    for r in response:
        assert r.text and r.generate_token_len == len(r.token_ids)
        assert r.input_token_len == TEMPLATED_PROMPT_TOKENS
        if r.finish_reason == "length":
            assert r.generate_token_len == 128
        else:
            assert r.finish_reason == "stop" and r.generate_token_len < 128
    pipe.close()


def test_seed_004_all_rank_output_is_refused() -> None:
    import llmserve as mii

    with pytest.raises(InvalidRequestError, match=r"^unknown engine option\(s\): all_rank_output$"):
        mii.pipeline(MODEL, all_rank_output=True)


# "DeepSpeed is" sent as raw text (do_preprocess=False, or {"input_ids": ...}): 3 tokens.
RAW_PROMPT_TOKENS = 3
TOO_LONG = ("max_length: 16 counts the prompt's tokens too (the output gets max_length minus them), and the prompt is "
            "already 33 tokens long (the chat template's tokens included; do_preprocess=False sends the raw text): "
            "send a max_length above 33, or max_new_tokens to bound the output alone")


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    import llmserve as mii

    with mii.pipeline(MODEL) as p:
        yield p


def _exact(pattern: str) -> str:
    """A pytest.raises match for exactly this message."""
    return "^" + re.escape(pattern) + "$"


@pytest.mark.slow
def test_seed_004_per_prompt_max_length_examples(pipe: Pipeline) -> None:
    pipeline, prompt = pipe, "DeepSpeed is"  # the seed's names for a pipeline and a prompt it does not define

    response_long = pipeline(prompt, max_length=1024)
    response_short = pipeline(prompt, max_length=128)

    for response, max_length in ((response_long, 1024), (response_short, 128)):
        assert response.input_token_len == TEMPLATED_PROMPT_TOKENS
        total = response.input_token_len + response.generate_token_len
        assert total == max_length if response.finish_reason == "length" else total < max_length


@pytest.mark.slow
def test_seed_004_launcher_example_run_with_python(capsys: pytest.CaptureFixture[str]) -> None:
    """The seed's example.py under `python example.py` (one process). As the seed writes it, the templated prompt
    (33 tokens) is longer than max_length=16, which is refused; with do_preprocess=False it answers in 13 tokens."""
    import llmserve as mii

    local_rank = int(os.getenv("LOCAL_RANK", 0))
    pipe = mii.pipeline(MODEL)
    with pytest.raises(InvalidRequestError, match=_exact(TOO_LONG)):
        response = pipe("DeepSpeed is", max_length=16)

    response = pipe("DeepSpeed is", max_length=16, do_preprocess=False)
    print(f"rank {local_rank} response: {response}")

    assert capsys.readouterr().out == f"rank 0 response: {response.text}\n"
    assert response.input_token_len == RAW_PROMPT_TOKENS
    total = RAW_PROMPT_TOKENS + response.generate_token_len
    assert total == 16 if response.finish_reason == "length" else total < 16
    pipe.close()


# Greedy and past EOS, so every sequence runs to its budget.
EXACT = GenerationConfig(temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_max_length_is_each_prompts_tokens_plus_output(pipe: Pipeline) -> None:
    raw_ids = pipe.tokenizer.encode("DeepSpeed is")
    prompts = ["DeepSpeed is", "Seattle is a city in the state of Washington", {"input_ids": raw_ids},
               [{"role": "user", "content": "Hi"}]]
    responses = pipe(prompts, gen_config=EXACT, max_length=50)

    lengths = [r.input_token_len for r in responses]
    assert lengths[0] == TEMPLATED_PROMPT_TOKENS and lengths[2] == RAW_PROMPT_TOKENS == len(raw_ids)
    assert len(set(lengths)) == 4  # four budgets in one call
    for prompt, r in zip(prompts, responses):
        assert (r.generate_token_len, len(r.token_ids), r.finish_reason) == (50 - r.input_token_len,) * 2 + ("length",)
        # the same tokens as the output budget given directly
        assert r.token_ids == pipe(prompt, gen_config=EXACT.replace(max_new_tokens=50 - r.input_token_len)).token_ids


@pytest.mark.slow
def test_stream_infer_and_chat_count_the_prompt(pipe: Pipeline) -> None:
    prompts = ["DeepSpeed is", "Seattle is a city in the state of Washington"]
    whole = pipe(prompts, gen_config=EXACT, max_length=45)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    last = {}
    for r in pipe.stream_infer(prompts, gen_config=EXACT, max_length=45):
        streamed[r.index] += r.token_ids
        last[r.index] = r
    for i, r in enumerate(whole):
        assert streamed[i] == r.token_ids and len(r.token_ids) == 45 - r.input_token_len
        assert (last[i].generate_token_len, last[i].finish_reason) == (45 - r.input_token_len, "length")

    # chat: the whole conversation so far is the prompt max_length counts
    session = pipe.chat("Hi", gen_config=EXACT, max_length=50)
    first = session.response
    assert first is not None and first.input_token_len + first.generate_token_len == 50
    session = pipe.chat("And then?", session=session, gen_config=EXACT, max_length=120)
    second = session.response
    assert second is not None and second.input_token_len > 50
    assert second.input_token_len + second.generate_token_len == 120
    with pytest.raises(InvalidRequestError, match=r"^max_length: 60 counts the prompt's tokens too .* the "
                                                  r"conversation is already \d+ tokens long \(every turn so far"):
        pipe.chat("More?", session=session, gen_config=EXACT, max_length=60)
    pipe.end_session(session)


def _both_message(other: str) -> str:
    return (f"max_length and {other}: give one of the two. max_length bounds the prompt plus the output "
            f"(DeepSpeed-MII's meaning), {other} the output alone, and MII's documentation does not say which wins "
            "when both are given")


@pytest.mark.slow
@pytest.mark.parametrize(("call", "message"), [
    (lambda p: p("DeepSpeed is", max_length=16), TOO_LONG),
    (lambda p: p("DeepSpeed is", max_length=33), TOO_LONG.replace("16", "33")),
    (lambda p: p(["DeepSpeed is", [{"role": "user", "content": "Seattle is a city in the state of Washington"}]],
                 max_length=40),  # the first prompt (33 tokens) fits, the second (40) does not
     "max_length: 40 counts the prompt's tokens too (the output gets max_length minus them), and prompt 1 (of 2) is "
     "already 40 tokens long (the chat template's tokens included): send a max_length above 40, or max_new_tokens "
     "to bound the output alone"),
    (lambda p: p({"input_ids": [1, 2, 3]}, max_length=3),
     "max_length: 3 counts the prompt's tokens too (the output gets max_length minus them), and the prompt is already "
     "3 tokens long: send a max_length above 3, or max_new_tokens to bound the output alone"),
    (lambda p: p("DeepSpeed is", max_length=40, max_new_tokens=5), _both_message("max_new_tokens")),
    (lambda p: p("DeepSpeed is", max_length=40, max_tokens=5), _both_message("max_tokens")),
    (lambda p: p("DeepSpeed is", GenerationConfig(max_new_tokens=5), max_length=40),
     _both_message("gen_config's max_new_tokens=5")),
    (lambda p: list(p.stream_infer("DeepSpeed is", max_length=40, max_new_tokens=5)), _both_message("max_new_tokens")),
    (lambda p: p("DeepSpeed is", max_length=40, min_new_tokens=8),
     "min_new_tokens: 8 is more than the 7 tokens max_length=40 leaves after the 33 of the prompt"),
    (lambda p: p("DeepSpeed is", max_length=8193),
     "max_length: 8193 is over the session length of 8192 tokens, which holds the prompt and the output; lower "
     "max_length"),
    (lambda p: p("DeepSpeed is", max_length="40"), "max_length: expected int, got str '40'"),
])
def test_max_length_refusals_say_what_to_change(pipe: Pipeline, call: Callable[[Pipeline], object],
                                                message: str) -> None:
    with pytest.raises(InvalidRequestError, match=_exact(message)) as e:
        call(pipe)
    assert e.value.param in ("max_length", "min_new_tokens")
    assert pipe.engine is not None and pipe.engine.kv.usage().in_use == 0  # nothing of the batch was queued
    # max_length alone, with a gen_config that leaves max_new_tokens at its default, still answers
    r = pipe("DeepSpeed is", GenerationConfig(temperature=0.0, ignore_eos=True), max_length=36)
    assert (r.generate_token_len, r.finish_reason) == (3, "length")
