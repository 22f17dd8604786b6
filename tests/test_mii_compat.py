"""DeepSpeed-MII's non-persistent pipeline (seed 004): the seed's example runs with only the import (`import mii` ->
`import llmserve as mii`) and the model changed (the embedded SmolLM2-135M-Instruct for Mistral-7B-v0.1).

Not run, with the reasons in docs/compat.md ("Seed examples"): the `max_length` examples (MII counts the prompt in
max_length; llmserve's pipeline reads it as max_new_tokens) and the deepspeed-launcher ones (tensor parallelism).
`all_rank_output`, which only the launcher's ranks use, is refused by name.
"""

from __future__ import annotations

import pytest

from llmserve import InvalidRequestError

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
