"""Predicted Outputs (GenerationConfig.prediction, OpenAI's `prediction`): the prediction's tokens are drafted and
verified, so greedy outputs are the ones without it, through the whole engine (batched, chunked, preempted,
prefix-cached, with an engine proposer beside it, under a grammar), whether the prediction is exact, edited or
unrelated; the proposer's alignment after edits; the refusals."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.engine.request import Prediction
from llmserve.engine.speculative import PredictionProposer
from llmserve.errors import InvalidRequestError
from tests.engine.test_speculative import MODES, NEW_TOKENS, prompts

GREEDY = dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def generate(engine, gens: list[GenerationConfig]) -> list[list[int]]:
    """prompts() in one batch, prompt i with gens[i], through the engine's steps: each one's output tokens."""
    for i, (ids, gen) in enumerate(zip(prompts(), gens, strict=True)):
        engine.add_request(str(i), ids, gen)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(gens))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(gens))]


def run(model_dir: str, predictions: list, **engine) -> tuple[list[list[int]], object]:
    """Greedy outputs of prompts(), batched, with each prompt's prediction (None: none), and the engine."""
    config = EngineConfig(dtype="float32", **{"block_size": 8, **engine})
    with pipeline(model_dir, backend_config=config) as pipe:
        gens = [GenerationConfig(**GREEDY, prediction=p) for p in predictions]
        out = generate(pipe.engine, gens)
        if engine.get("enable_prefix_caching"):
            assert generate(pipe.engine, gens) == out
        pipe.engine.kv.check_invariants()
        assert pipe.engine.kv.usage().in_use == 0
        return out, pipe.engine


def edited(tokens: list[int]) -> list[int]:
    """An edit of the output: a token changed, two inserted, three deleted, the end cut."""
    t = list(tokens)
    t[3] = (t[3] + 1) % 300
    t[8:8] = [17, 18]
    del t[14:17]
    return t[:-2]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    return run(tiny_model_dir("llama"), [None] * len(prompts()))[0]


@pytest.mark.parametrize("mode", MODES)
def test_exact_prediction_gives_the_same_tokens_and_accepts_every_draft(mode, tiny_model_dir, reference):
    out, engine = run(tiny_model_dir("llama"), reference, **MODES[mode])
    assert out == reference
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
    if mode != "chunked":  # (a small budget leaves little room for drafts)
        assert stats.mean_tokens_per_step > 4
    if mode == "preempted":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", MODES)
def test_edited_and_unrelated_predictions_give_the_same_tokens(mode, tiny_model_dir, reference):
    unrelated = torch.randint(3, 300, (NEW_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    predictions = [edited(t) if i % 2 else unrelated for i, t in enumerate(reference)]
    out, engine = run(tiny_model_dir("llama"), predictions, **MODES[mode])
    assert out == reference
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_batched_with_and_without_predictions_and_an_engine_proposer(tiny_model_dir, reference):
    # half the batch predicted (the other half has none), with and without the engine's n-gram proposer beside it
    predictions = [t if i % 2 else None for i, t in enumerate(reference)]
    assert run(tiny_model_dir("llama"), predictions)[0] == reference
    out, engine = run(tiny_model_dir("llama"), predictions, speculative_method="ngram", prompt_lookup_min=1)
    assert out == reference and engine.spec_stats.num_draft_tokens > 0


def test_prediction_as_text(tiny_model_dir):
    # the text is tokenized as the output would be: the output's own text drafts its tokens
    model = tiny_model_dir("llama")
    with pipeline(model, backend_config=EngineConfig(dtype="float32")) as pipe:
        ids = prompts()[0]
        plain = pipe([{"input_ids": ids}], gen_config=GenerationConfig(**GREEDY))[0]
        gen = GenerationConfig(**GREEDY, prediction=plain.text)
        again = pipe([{"input_ids": ids}], gen_config=gen)[0]
        assert again.token_ids == plain.token_ids
        assert pipe.engine.spec_stats.num_accepted_tokens > 0


def test_no_prediction_tokens_leaves_predictions_unused(tiny_model_dir, reference):
    out, engine = run(tiny_model_dir("llama"), reference, num_prediction_tokens=0)
    assert out == reference and engine.spec_stats.num_draft_tokens == 0


def test_prediction_under_a_grammar(tiny_model_dir):
    # drafts the grammar refuses are cut before verification: the output is the grammar's, as without them
    regex = {"type": "regex_schema", "regex_schema": "(ab|cd)[0-9]{3}x"}
    model = tiny_model_dir("llama")
    with pipeline(model, backend_config=EngineConfig(dtype="float32")) as pipe:
        ids = prompts()[1]
        plain = pipe([{"input_ids": ids}], gen_config=GenerationConfig(**GREEDY, response_format=regex))[0]
        for prediction in (plain.text, "cd999x and more", "zzzz"):
            gen = GenerationConfig(**GREEDY, response_format=regex, prediction=prediction)
            assert pipe([{"input_ids": ids}], gen_config=gen)[0].token_ids == plain.token_ids


def test_sampled_with_a_prediction_finishes_and_frees(tiny_model_dir, reference):
    model = tiny_model_dir("llama")
    with pipeline(model, backend_config=EngineConfig(dtype="float32", block_size=8)) as pipe:
        gens = [GenerationConfig(temperature=1.0, top_p=0.9, max_new_tokens=NEW_TOKENS, ignore_eos=True, n=2,
                                 random_seed=i, prediction=t) for i, t in enumerate(reference)]
        out = generate(pipe.engine, gens)
        assert all(len(tokens) == 2 * NEW_TOKENS for tokens in out)  # (both samples' tokens)
        assert pipe.engine.spec_stats.num_draft_tokens > 0
        assert pipe.engine.kv.usage().in_use == 0


# --- the proposer's alignment ------------------------------------------------------------------


def test_drafts_follow_the_prediction_while_the_output_copies_it():
    p = Prediction(list(range(100, 140)))
    proposer = PredictionProposer()
    assert proposer.align(p, []) and p.cursor == 0  # nothing out yet: from the start
    assert proposer.align(p, [100, 101, 102]) and p.cursor == 3
    assert proposer.align(p, [100, 101, 102, 103]) and p.cursor == 4


def test_alignment_after_edits():
    pred = list(range(100, 140))
    proposer = PredictionProposer()
    p = Prediction(pred)
    # an insertion: the output copies five tokens, adds two of its own, then resumes copying
    out = pred[:5] + [7, 8]
    assert not proposer.align(p, out)  # 8 is nowhere in the prediction: no drafts this step
    assert p.cursor == 5  # (past the five copied)
    assert proposer.align(p, out + [105]) and p.cursor == 6
    # a deletion: the output skips ten tokens
    out = out + [105] + pred[16:18]
    assert proposer.align(p, out) and p.cursor == 18
    # the longest run wins over a nearer single token; the first occurrence from the cursor on
    p = Prediction([1, 2, 3, 9, 5, 2, 3, 4, 2, 3, 4], cursor=0)
    assert proposer.align(p, [7, 2, 3, 4]) and p.cursor == 8
    p = Prediction([1, 2, 3, 9, 5, 2, 3, 4, 2, 3, 4], cursor=9)
    assert proposer.align(p, [7, 2, 3, 4]) and p.cursor == 11
    # before the cursor only where nothing follows it: the last occurrence before
    p = Prediction([1, 2, 3, 9, 1, 2, 3, 8, 5], cursor=8)
    assert proposer.align(p, [0, 1, 2, 3]) and p.cursor == 7


def test_short_runs_are_looked_for_only_near_the_cursor():
    proposer = PredictionProposer(reach=16)  # runs of two within 16 tokens after the cursor, one token within 4
    pred = [5] + list(range(100, 120)) + [6]
    assert not proposer.align(Prediction(pred, cursor=2), [0, 6])  # 6 is 20 tokens on
    assert not proposer.align(Prediction(pred, cursor=2), [1, 5])  # 5 only before the cursor
    p = Prediction(pred, cursor=2)
    assert proposer.align(p, [2, 104]) and p.cursor == 6
    assert not proposer.align(Prediction(pred, cursor=2), [2, 118, 119])  # a run of two 19 tokens on
    p = Prediction(pred, cursor=2)
    assert proposer.align(p, [2, 117, 118, 119]) and p.cursor == 21  # a run of three anywhere


def test_drafts_shrink_after_a_rejection_and_grow_after_full_acceptance():
    proposer = PredictionProposer()
    pred = list(range(100, 160))
    p = Prediction(pred, length=4)
    assert proposer.align(p, []) and p.cursor == 0
    p.proposed = 4  # drafts 100-103 proposed; all kept, and the step's own token follows on
    assert proposer.align(p, pred[:5]) and p.length == 8
    p.proposed = 8  # drafts 105-112; two kept, then the output leaves the prediction
    assert not proposer.align(p, pred[:7] + [7]) and p.length == 3 and p.cursor == 7


# --- refusals ----------------------------------------------------------------------------------


def test_bad_predictions_are_refused(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="prediction"):
        GenerationConfig(prediction=5)
    with pytest.raises(InvalidRequestError, match="prediction"):
        GenerationConfig(prediction=[1, "a"])
    with pytest.raises(InvalidRequestError, match="prediction"):
        GenerationConfig(prediction=[1, -2])
    with pytest.raises(InvalidRequestError, match="beam search"):
        GenerationConfig(prediction="x", use_beam_search=True, n=2)
    with pytest.raises(InvalidRequestError, match="num_prediction_tokens"):
        EngineConfig(num_prediction_tokens=-1)
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32")) as pipe:
        with pytest.raises(InvalidRequestError, match="out of range"):
            pipe([{"input_ids": [1, 2]}], gen_config=GenerationConfig(max_new_tokens=4, prediction=[1, 10 ** 6]))
        assert pipe.engine.kv.usage().in_use == 0


def test_a_prediction_whose_end_is_passed_reserves_no_more_drafts(tiny_model_dir, reference):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", block_size=8)) as pipe:
        engine, lookaheads = pipe.engine, []
        schedule = engine.scheduler.schedule

        def recording():
            plan = schedule()
            lookaheads.extend(s.lookahead for s in plan.scheduled)
            return plan

        engine.scheduler.schedule = recording
        out = generate(engine, [GenerationConfig(**GREEDY, prediction=t[:3] if i == 0 else None)
                                for i, t in enumerate(reference)])
        assert out == reference
        # the prefill gave the first token: the first decode step reserves and drafts the other two; none after it
        assert engine.spec_stats.num_draft_tokens == engine.spec_stats.num_accepted_tokens == 2
        assert [n for n in lookaheads if n] == [2]


def finals(engine, gens: list[GenerationConfig]) -> list:
    """Each request's last SequenceOutput (n = 1), prompts() batched."""
    for i, (ids, gen) in enumerate(zip(prompts(), gens, strict=True)):
        engine.add_request(str(i), ids, gen)
    last = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            last[o.request_id] = o
    return [last[str(i)] for i in range(len(gens))]


def test_each_request_counts_its_accepted_and_rejected_prediction_tokens(tiny_model_dir, reference):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", block_size=8)) as pipe:
        out = finals(pipe.engine, [GenerationConfig(**GREEDY, prediction=t if i == 2 else edited(t))
                                   for i, t in enumerate(reference)])
        stats = pipe.engine.spec_stats
        # every token but the prefill's and two verify steps' own (15 drafts, then the 6 that max_new_tokens leaves)
        assert out[2].prediction_tokens == (NEW_TOKENS - 3, 0)
        assert sum(o.prediction_tokens[0] for o in out) == stats.num_accepted_tokens
        assert sum(sum(o.prediction_tokens) for o in out) == stats.num_draft_tokens
        assert all(o.prediction_tokens[1] > 0 for i, o in enumerate(out) if i != 2)  # the edits refused some


def test_drafts_past_a_stop_count_as_rejected(tiny_model_dir, reference):
    # a prompt whose output has a token first given mid-way, to stop at
    j, k = next((j, k) for j, t in enumerate(reference) for k in range(8, len(t)) if t.index(t[k]) == k)
    ref, stop = reference[j], reference[j][k]
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32")) as pipe:
        gen = GenerationConfig(**GREEDY, stop_token_ids=[stop], prediction=ref)
        engine = pipe.engine
        engine.add_request("r", prompts()[j], gen)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        assert [t for o in outs for t in o.new_token_ids] == ref[:ref.index(stop)]
        accepted, rejected = outs[-1].prediction_tokens
        assert engine.spec_stats.num_accepted_tokens > accepted  # drafts past the stop were verified ...
        assert accepted <= ref.index(stop) and accepted + rejected == engine.spec_stats.num_draft_tokens  # ... not kept


def test_best_of_keeps_the_counts(tiny_model_dir, reference):
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32")) as pipe:
        gen = GenerationConfig(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, best_of=2, random_seed=3,
                               prediction=reference[0])
        out = finals(pipe.engine, [gen] + [GenerationConfig(**GREEDY)] * (len(prompts()) - 1))[0]
        assert out.prediction_tokens is not None and sum(out.prediction_tokens) > 0


def test_drafts_leave_a_token_for_every_running_request(tiny_model_dir, reference):
    # a small budget: each step schedules every running request before giving any drafts
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", block_size=8,
                                                                       max_prefill_token_num=12)) as pipe:
        engine, starved = pipe.engine, []
        schedule = engine.scheduler.schedule

        def recording():
            running = [r for r in engine.scheduler.running if r.num_output_tokens > 0]
            plan = schedule()
            starved.extend(set(running) - {s.request for s in plan.scheduled})
            return plan

        engine.scheduler.schedule = recording
        assert generate(engine, [GenerationConfig(**GREEDY, prediction=t) for t in reference]) == reference
        assert engine.spec_stats.num_draft_tokens > 0 and not starved
