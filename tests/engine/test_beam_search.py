"""Beam search through the whole engine against transformers' beam search (fp32, tiny random models),
batched with other requests, chunked, preempted and prefix-cached; an exhaustive case; best_of."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from tests.engine.test_engine_vs_transformers import _hf_model

PROMPT_LENS = (4, 9, 17, 30)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_beams(model_dir: str, prompt: list[int], width: int, n: int, max_new: int, stop_ids: list[int],
             length_penalty: float, early_stopping: bool | str) -> list[list[int]]:
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_new,
                             eos_token_id=stop_ids, pad_token_id=-1, length_penalty=length_penalty,
                             early_stopping=early_stopping)
    result = []
    for row in out[:, len(prompt):].tolist():
        ids = [t for t in row if t != -1]
        if ids and ids[-1] in stop_ids:  # the engine reports the stop token as stop_reason, not as output
            ids = ids[:-1]
        result.append(ids)
    return result


CASES = {  # width, n, max_new_tokens, length_penalty, early_stopping
    "w1-greedy": (1, 1, 10, 1.0, False),
    "w2": (2, 2, 10, 1.0, False),
    "w4-n3-lp0": (4, 3, 12, 0.0, False),
    "w3-lp2-early": (3, 2, 12, 2.0, True),
    "w4-never": (4, 4, 8, 1.5, "never"),
}


def _stop_ids(model_dir: str) -> list[int]:
    # A frequent token as an extra stop id, so that beams do finish before the length limit.
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32")) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()], temperature=0.0, max_new_tokens=12, ignore_eos=True)
    counts: dict[int, int] = {}
    for r in out:
        for t in r.token_ids:
            counts[t] = counts.get(t, 0) + 1
    return [max(counts, key=counts.get)]


@pytest.fixture(scope="module")
def stop_ids(tiny_model_dir) -> dict[str, list[int]]:
    return {arch: _stop_ids(tiny_model_dir(arch)) for arch in ("llama", "qwen2")}


MODES = {
    "plain": dict(),
    "chunked": dict(max_prefill_token_num=7),
    "preempted": dict(num_blocks=14, block_size=4),
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_beam_search_matches_transformers(arch, case, tiny_model_dir, stop_ids):
    width, n, max_new, lp, early = CASES[case]
    model_dir = tiny_model_dir(arch)
    gen = GenerationConfig(use_beam_search=True, beam_width=width, n=n, max_new_tokens=max_new, length_penalty=lp,
                           early_stopping=early, ignore_eos=True, stop_token_ids=stop_ids[arch])
    expected = [hf_beams(model_dir, p, width, n, max_new, stop_ids[arch], lp, early) for p in prompts()]
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", block_size=8)) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()], gen_config=gen)
        got = [[r.token_ids for r in out if r.index == i] for i in range(len(PROMPT_LENS))]
        assert got == expected
        assert pipe.engine.kv.usage().in_use == 0
        pipe.engine.kv.check_invariants()
    if case == "w1-greedy":  # width 1 is greedy search
        with pipeline(model_dir, backend_config=EngineConfig(dtype="float32")) as pipe:
            greedy = pipe([{"input_ids": p} for p in prompts()], temperature=0.0, max_new_tokens=max_new,
                          ignore_eos=True, stop_token_ids=stop_ids[arch])
        assert [[r.token_ids] for r in greedy] == got


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_batched_with_sampling_under_every_mode(mode, tiny_model_dir, stop_ids):
    """Beam searches share steps with plain requests, under chunking, preemption (beams lose their
    blocks, are recomputed, forks fall back) and prefix caching; results do not change."""
    model_dir = tiny_model_dir("llama")
    width, n, max_new = 3, 2, 10
    stop = stop_ids["llama"]
    expected = [hf_beams(model_dir, p, width, n, max_new, stop, 1.0, False) for p in prompts()]
    beam = GenerationConfig(use_beam_search=True, beam_width=width, n=n, max_new_tokens=max_new, ignore_eos=True,
                            stop_token_ids=stop)
    greedy = GenerationConfig(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", block_size=8)) as pipe:
        greedy_ref = [r.token_ids for r in pipe([{"input_ids": p} for p in prompts()], gen_config=greedy)]
    config = EngineConfig(dtype="float32", **{"block_size": 8, **MODES[mode]})
    with pipeline(model_dir, backend_config=config) as pipe:
        engine = pipe.engine
        for i, p in enumerate(prompts()):
            engine.add_request(f"b{i}", p, beam)
            engine.add_request(f"g{i}", p, greedy)
        got: dict[str, dict[int, list[int]]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got.setdefault(o.request_id, {}).setdefault(o.index, []).extend(o.new_token_ids)
        assert [[got[f"b{i}"][j] for j in range(n)] for i in range(len(PROMPT_LENS))] == expected
        assert [got[f"g{i}"][0] for i in range(len(PROMPT_LENS))] == greedy_ref
        if mode == "preempted":
            assert engine.scheduler.num_preemptions > 0
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0


def test_beam_search_exhaustive_two_tokens(tiny_model_dir):
    """With as many beams as the vocabulary, two steps of beam search are exhaustive: the returned
    sequences are the best pairs of all V^2, in order."""
    model_dir = tiny_model_dir("llama")
    prompt = prompts()[1]
    model = _hf_model(model_dir)
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)  # [V]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.log_softmax(model(batch).logits[:, -1], -1)  # [V, V]
    total = first[:, None] + second
    best = total.view(-1).topk(5).indices.tolist()
    expected = [[i // vocab, i % vocab] for i in best]
    gen = GenerationConfig(use_beam_search=True, beam_width=vocab, n=5, max_new_tokens=2, ignore_eos=True)
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", block_size=4, num_blocks=4096)) as pipe:
        out = pipe([{"input_ids": prompt}], gen_config=gen)
        assert [r.token_ids for r in out] == expected
        assert pipe.engine.kv.usage().in_use == 0


def test_beam_search_stream_abort_and_text(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    gen = GenerationConfig(use_beam_search=True, beam_width=3, n=2, max_new_tokens=6, ignore_eos=True)
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", block_size=4)) as pipe:
        full = pipe([{"input_ids": prompts()[0]}], gen_config=gen)
        streamed = list(pipe.stream_infer([{"input_ids": prompts()[0]}], gen_config=gen))
        # Beam results come at the end, one chunk per returned beam, with the whole text.
        assert [(r.token_ids, r.text, r.finish_reason) for r in streamed] == \
               [(r.token_ids, r.text, r.finish_reason) for r in full]
        assert all(r.text == pipe.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in full)
        engine = pipe.engine
        engine.add_request("x", prompts()[2], gen.replace(max_new_tokens=20))
        for _ in range(4):
            engine.step()
        assert engine.kv.usage().in_use > 0
        aborted = engine.abort("x")
        assert [(o.index, o.finish_reason) for o in aborted] == [(0, "abort"), (1, "abort")]
        assert engine.kv.usage().in_use == 0 and not engine.has_unfinished_requests()
        engine.kv.check_invariants()


def test_best_of_returns_the_most_likely_samples(tiny_model_dir):
    """best_of=4, n=2 returns the two samples of the four (seeds s..s+3) with the highest
    cumulative logprob; without logprobs asked, none are returned."""
    model_dir = tiny_model_dir("llama")
    base = GenerationConfig(temperature=1.0, top_k=0, max_new_tokens=8, ignore_eos=True, random_seed=5)
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32")) as pipe:
        all4 = pipe([{"input_ids": prompts()[0]}], gen_config=base.replace(n=4, logprobs=0))
        scores = [sum(lp[t] for lp, t in zip(r.logprobs, r.token_ids)) for r in all4]
        order = sorted(range(4), key=lambda i: -scores[i])
        best = pipe([{"input_ids": prompts()[0]}], gen_config=base.replace(n=2, best_of=4))
        assert [r.token_ids for r in best] == [all4[i].token_ids for i in order[:2]]
        assert len(best) == 2 and all(r.logprobs is None for r in best)
        assert len({tuple(r.token_ids) for r in all4}) > 1  # the samples really differ
        assert pipe.engine.kv.usage().in_use == 0


def test_beam_config_validation():
    from llmserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="beam_width"):
        GenerationConfig(use_beam_search=True, n=3, beam_width=2)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        GenerationConfig(use_beam_search=True, logprobs=2)
    with pytest.raises(InvalidRequestError, match="early_stopping"):
        GenerationConfig(use_beam_search=True, early_stopping="maybe")
    with pytest.raises(InvalidRequestError, match="best_of"):
        GenerationConfig(n=3, best_of=2)
    assert GenerationConfig(use_beam_search=True, n=2).num_beams == 2
    assert GenerationConfig(use_beam_search=True, n=2, best_of=5).num_beams == 5

