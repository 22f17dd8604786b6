"""Engine behaviour on a tiny model: seeds, n, stops across token boundaries, abort, bookkeeping."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, PromptTooLongError, pipeline
from llmserve.engine.output import IncrementalDetokenizer
from tests.tiny_models import tiny_tokenizer


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", block_size=4,
                                                                       num_blocks=128)) as p:
        yield p


def ids(n: int, seed: int) -> dict:
    return {"input_ids": torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()}


SAMPLED = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=10, ignore_eos=True)


def run_engine(engine, requests: dict[str, tuple[dict, GenerationConfig]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, gen) in requests.items():
        engine.add_request(rid, prompt["input_ids"], gen)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_same_seed_same_output_whatever_the_batch(pipe):
    seeded = SAMPLED.replace(random_seed=7)
    alone = pipe(ids(6, 0), gen_config=seeded).token_ids
    among_unseeded = run_engine(pipe.engine, {"u1": (ids(9, 1), SAMPLED), "s": (ids(6, 0), seeded),
                                              "u2": (ids(20, 2), SAMPLED)})
    among_seeded = run_engine(pipe.engine, {"s": (ids(6, 0), seeded),
                                            "o": (ids(3, 3), SAMPLED.replace(random_seed=99))})
    assert among_unseeded["s"] == alone
    assert among_seeded["s"] == alone
    assert among_unseeded["u1"] != among_unseeded["u2"]
    assert pipe(ids(6, 0), gen_config=SAMPLED.replace(random_seed=8)).token_ids != alone


def test_typical_p_row_keeps_its_seed_whatever_the_batch(pipe):
    """A typical_p row takes the sampler's torch path with every row of its batch (the kernel has no typical filter):
    its tokens still depend on its seed only, and the others' on theirs; typical_p changes what it draws."""
    typical = SAMPLED.replace(random_seed=3, typical_p=0.3)
    alone = pipe(ids(6, 0), gen_config=typical).token_ids
    plain_alone = pipe(ids(9, 1), gen_config=SAMPLED.replace(random_seed=4)).token_ids
    mixed = run_engine(pipe.engine, {"t": (ids(6, 0), typical), "p": (ids(9, 1), SAMPLED.replace(random_seed=4)),
                                     "g": (ids(4, 2), SAMPLED.replace(temperature=0.0))})
    assert mixed["t"] == alone and mixed["p"] == plain_alone
    assert pipe(ids(6, 0), gen_config=SAMPLED.replace(random_seed=3)).token_ids != alone


def test_n_returns_distinct_samples_in_order(pipe):
    out = pipe(ids(5, 0), gen_config=SAMPLED.replace(n=3, random_seed=1))
    assert len(out) == 3 and all(r.index == 0 for r in out)
    assert len({tuple(r.token_ids) for r in out}) == 3  # seeds seed+0, seed+1, seed+2
    again = pipe(ids(5, 0), gen_config=SAMPLED.replace(n=3, random_seed=1))
    assert [r.token_ids for r in again] == [r.token_ids for r in out]
    assert pipe.engine.kv.usage().in_use == 0


def test_greedy_equals_top_k_1(pipe):
    greedy = pipe(ids(8, 5), gen_config=SAMPLED.replace(temperature=0.0)).token_ids
    assert pipe(ids(8, 5), gen_config=SAMPLED.replace(top_k=1)).token_ids == greedy


def test_stop_token_ids_end_generation_and_are_not_returned(pipe):
    greedy = GenerationConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    full = pipe(ids(8, 5), gen_config=greedy).token_ids
    stop_at = full[3]
    first = full.index(stop_at)
    r = pipe(ids(8, 5), gen_config=greedy.replace(stop_token_ids=[stop_at]))
    assert r.token_ids == full[:first] and r.finish_reason == "stop" and r.generate_token_len == first
    late = pipe(ids(8, 5), gen_config=greedy.replace(stop_token_ids=[stop_at], min_new_tokens=first + 1))
    assert stop_at not in late.token_ids[:first + 1]


def test_stop_string_split_across_tokens_is_found_and_held_back():
    tok = tiny_tokenizer()
    text = "The capital of France is Paris."
    toks = tok.encode(text)
    stop = "France is"
    assert not any(stop in tok.decode([t]) for t in toks)  # the stop string spans several tokens
    detok = IncrementalDetokenizer(tok, [1], True, [stop], include_stop=False)
    emitted = []
    for t in toks:
        emitted.append(detok.add(t))
        if detok.stop_hit:
            break
    assert detok.stop_hit == stop
    assert "".join(emitted) == "The capital of "
    # Nothing that could still become the stop string was handed out early.
    assert all(not ("".join(emitted[:i + 1])).endswith("Fr") for i in range(len(emitted) - 1))


def test_prompt_over_session_len_is_refused_and_nothing_is_held(tiny_model_dir):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", session_len=32)) as p:
        with pytest.raises(PromptTooLongError, match="30 tokens and max_new_tokens is 8.*session length of 32"):
            p(ids(30, 0), max_new_tokens=8)
        assert p.engine.kv.usage().in_use == 0 and not p.engine.has_unfinished_requests()
        assert p(ids(20, 0), max_new_tokens=8, temperature=0).generate_token_len <= 8


def test_prompt_needing_more_blocks_than_the_pool_is_refused(tiny_model_dir):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", block_size=4,
                                                                       num_blocks=4)) as p:
        with pytest.raises(PromptTooLongError, match="needs 5 KV blocks but the pool has 4"):
            p(ids(12, 0), max_new_tokens=8)
        assert p(ids(8, 0), max_new_tokens=8, temperature=0, ignore_eos=True).generate_token_len == 8


def test_abort_frees_blocks_at_once(pipe):
    engine = pipe.engine
    engine.add_request("a", ids(30, 0)["input_ids"], SAMPLED.replace(max_new_tokens=50))
    engine.add_request("b", ids(10, 1)["input_ids"], SAMPLED.replace(max_new_tokens=50))
    engine.step()
    engine.step()
    held_by_a = len(engine.kv.block_table("a#0"))
    assert held_by_a == 8  # 31 tokens in blocks of 4
    in_use = engine.kv.usage().in_use
    out = engine.abort("a")
    assert [(o.request_id, o.finish_reason) for o in out] == [("a", "abort")]
    assert engine.kv.usage().in_use == in_use - held_by_a
    engine.kv.check_invariants()
    engine.abort("b")
    assert engine.kv.usage().in_use == 0 and not engine.has_unfinished_requests()


def test_streaming_consumer_that_stops_early_leaves_nothing_behind(pipe):
    stream = pipe.stream_infer([ids(10, 0), ids(12, 1)], gen_config=SAMPLED.replace(max_new_tokens=30))
    next(stream)
    stream.close()
    assert pipe.engine.kv.usage().in_use == 0 and not pipe.engine.has_unfinished_requests()


def test_generation_config_defaults_come_from_the_model(pipe):
    # tests/tiny_models.py writes temperature 0.6 and top_p 0.9 into generation_config.json
    assert pipe.default_gen_config.temperature == 0.6 and pipe.default_gen_config.top_p == 0.9
    assert set(pipe.engine.loaded.eos_token_ids) == {0, 2}


def test_tensor_parallel_degree_is_checked():
    from llmserve import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="tp: must be >= 1"):
        EngineConfig(tp=0)
    with pytest.raises(InvalidRequestError, match="do not split evenly over 2 nodes"):
        EngineConfig(tp=3, nnodes=2, master_port=29500)


def _green_z(prompt: list[int], out: list[int], vocab: int) -> float:
    """Kirchenbauer et al.'s detector: z of the count of tokens in the green list of the token before them."""
    from llmserve.sampling.batch import WATERMARK_GAMMA, watermark_greenlist

    seq = prompt + out
    green = sum(int(seq[i] in set(watermark_greenlist(seq[i - 1], vocab).tolist())) for i in range(len(prompt), len(seq)))
    t, g = len(out), WATERMARK_GAMMA
    return (green - g * t) / (t * g * (1 - g)) ** 0.5


def test_watermark_is_detectable_and_keeps_the_seed(pipe):
    """TGI's watermark: a detector counting green tokens finds it in sampled text (z > 4 over 64 tokens) and not in
    the same request without it; greedy requests are biased too (the tiny model's greedy text repeats one token, too
    little to detect on); a seeded watermarked request gives the same tokens alone and batched."""
    vocab = pipe.engine.runner.vocab_size
    prompt = ids(6, 0)
    for seed in (5, 6):
        gen = SAMPLED.replace(random_seed=seed, max_new_tokens=64)
        marked = pipe(prompt, gen_config=gen.replace(watermark=True)).token_ids
        plain = pipe(prompt, gen_config=gen).token_ids
        assert _green_z(prompt["input_ids"], marked, vocab) > 4
        assert abs(_green_z(prompt["input_ids"], plain, vocab)) < 4
    greedy = SAMPLED.replace(temperature=0.0, max_new_tokens=16)
    assert pipe(prompt, gen_config=greedy.replace(watermark=True)).token_ids != pipe(prompt, gen_config=greedy).token_ids
    seeded = SAMPLED.replace(random_seed=9, watermark=True)
    alone = pipe(ids(6, 0), gen_config=seeded).token_ids
    batched = run_engine(pipe.engine, {"w": (ids(6, 0), seeded), "o": (ids(5, 4), SAMPLED)})
    assert batched["w"] == alone


def test_a_gen_config_per_prompt(pipe):
    """LMDeploy's `pipe(prompts, gen_config=[...])`: each prompt with its own config, in one batch, each answer as
    that prompt alone gets it (n and logprobs per prompt too); streamed alike; a list of another length refused."""
    prompts = [ids(6, 0), ids(9, 1), ids(4, 2)]
    gens = [SAMPLED.replace(random_seed=7), GenerationConfig(temperature=0.0, max_new_tokens=5, logprobs=2),
            SAMPLED.replace(random_seed=1, n=2, max_new_tokens=3)]
    alone = [pipe(p, gen_config=g) for p, g in zip(prompts, gens)]
    together = pipe(prompts, gen_config=gens)
    assert [r.index for r in together] == [0, 1, 2, 2]
    assert [r.token_ids for r in together] == [alone[0].token_ids, alone[1].token_ids,
                                               *[r.token_ids for r in alone[2]]]
    assert [len(r.token_ids) for r in together] == [10, 5, 3, 3]
    assert together[0].logprobs is None and len(together[1].logprobs) == 5
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for r in pipe.stream_infer(prompts[:2], gen_config=gens[:2]):
        streamed[r.index] += r.token_ids
    assert streamed == {0: alone[0].token_ids, 1: alone[1].token_ids}
    with pytest.raises(Exception, match="gen_config: a list of 2 configs for 3 prompts"):
        pipe(prompts, gen_config=gens[:2])
    assert pipe.engine.kv.usage().in_use == 0
