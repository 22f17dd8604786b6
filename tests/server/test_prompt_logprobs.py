"""Prompt-token logprobs (issue 21, section 10): computed in the same prefill and equal to transformers' scoring of
the prompt, through the pipeline (plain, chunked, preempted, n > 1, a prefix already cached) and the server
(completions echo + logprobs with max_tokens 1 and 0, as lm-evaluation-harness sends them; vLLM's prompt_logprobs
field on chat and completions; TGI's decoder_input_details)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from tests.server.harness import EngineHandle, RunningServer
from tests.tiny_models import make_hf_model

TOLERANCE = 1e-4  # fp32 on both sides; the engine's attention and matmuls sum in another order


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("llama")  # the same seed and config as tiny_model_dir("llama")


def reference(hf_model, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    with torch.no_grad():
        lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("engine", [{}, {"max_prefill_token_num": 7}, {"num_blocks": 14}],
                         ids=["plain", "chunked", "preempted"])
def test_pipeline_prompt_logprobs_match_transformers(tiny_model_dir: Callable[[str], str], hf_model, engine):
    config = EngineConfig(dtype="float32", block_size=4, **{"num_blocks": 128, **engine})
    prompts = [ids(30, 1), ids(17, 2), ids(40, 3)]
    with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
        out = pipe([{"input_ids": p} for p in prompts],
                   gen_config=GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2))
        if "num_blocks" in engine:
            assert pipe.engine.scheduler.num_preemptions > 0
        for p, r in zip(prompts, out):
            assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)
            got = [r.prompt_logprobs[i][p[i]] for i in range(1, len(p))]
            assert max(abs(a - b) for a, b in zip(got, reference(hf_model, p))) < TOLERANCE
            assert all(len(d) <= 3 for d in r.prompt_logprobs[1:])  # the token and the top 2


def test_a_cached_prefix_is_computed_again_for_its_logprobs(tiny_model_dir: Callable[[str], str], hf_model):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", block_size=4,
                                                                       num_blocks=128)) as pipe:
        p = ids(33, 4)
        pipe({"input_ids": p}, gen_config=GenerationConfig(max_new_tokens=2, temperature=0))  # caches the prefix
        stats = pipe.engine.kv.prefix_stats
        hits = stats.hit_tokens
        r = pipe({"input_ids": p}, gen_config=GenerationConfig(max_new_tokens=2, temperature=0, prompt_logprobs=0))
        assert stats.hit_tokens == hits  # not taken from the cache
        got = [r.prompt_logprobs[i][p[i]] for i in range(1, len(p))]
        assert max(abs(a - b) for a, b in zip(got, reference(hf_model, p))) < TOLERANCE
        samples = pipe({"input_ids": p}, gen_config=GenerationConfig(n=3, max_new_tokens=2, temperature=1.0,
                                                                     prompt_logprobs=0))
        assert all(s.prompt_logprobs == r.prompt_logprobs for s in samples)  # computed once, shared


def test_lm_eval_request_shapes(server: RunningServer, tiny: EngineHandle, hf_model) -> None:
    """What lm-evaluation-harness's local-completions sends for loglikelihood: echo, logprobs 1, max_tokens 1 (and
    0), several prompts as text; it reads token_logprobs of the prompt tokens and top_logprobs to check greedy."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["The capital of France is Paris.", "The quick brown fox jumps"]
    for max_tokens in (1, 0):
        r = client.completions.create(model="tiny-llama", prompt=texts, echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0)
        for text, choice in zip(texts, r.choices):
            p = tiny.tokenizer.encode(text)
            lp = choice.logprobs
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            got = lp.token_logprobs[1:len(p)]
            assert max(abs(a - b) for a, b in zip(got, reference(hf_model, p))) < TOLERANCE
            assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:len(p)])  # the top token and the prompt's
            if max_tokens == 0:
                assert choice.text == text and len(lp.tokens) == len(p) and choice.finish_reason == "length"
        if max_tokens == 0:
            assert r.usage.completion_tokens == 0
    streamed = list(client.completions.create(model="tiny-llama", prompt=texts[0], echo=True, logprobs=1,
                                              max_tokens=0, temperature=0, stream=True))
    first = streamed[0].choices[0]
    assert first.text == texts[0] and first.logprobs.token_logprobs[1:] == r.choices[0].logprobs.token_logprobs[1:]


def test_vllm_prompt_logprobs_field(server: RunningServer, tiny: EngineHandle, hf_model) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    p = tiny.tokenizer.encode(body["prompt"])
    lps = choice["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(p)
    got = [lps[i][str(p[i])]["logprob"] for i in range(1, len(p))]
    assert max(abs(a - b) for a, b in zip(got, reference(hf_model, p))) < TOLERANCE
    assert all(1 <= len(e) <= 3 and all({"logprob", "rank", "decoded_token"} <= v.keys() for v in e.values())
               for e in lps[1:])
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    refused = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    bad = httpx.post(server.url + "/v1/completions", json={**body, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_tgi_decoder_input_details(server: RunningServer, tiny: EngineHandle, hf_model) -> None:
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 2, "details": True,
                                                                 "decoder_input_details": True}}
    prefill = httpx.post(server.url + "/generate", json=body, timeout=60).json()["details"]["prefill"]
    p = tiny.tokenizer.encode(body["inputs"])
    assert [t["id"] for t in prefill] == p and prefill[0]["logprob"] is None
    got = [t["logprob"] for t in prefill[1:]]
    assert max(abs(a - b) for a, b in zip(got, reference(hf_model, p))) < TOLERANCE
