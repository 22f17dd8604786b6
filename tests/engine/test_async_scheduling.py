"""Async scheduling (engine/llm_engine.py: the next decode step launched before this one's tokens are read): the same
tokens, stops, aborts and bookkeeping as synchronous steps, on the CPU where it can be forced on.

Each test counts the steps launched ahead (with the previous step's tokens still unread), so none passes by
running synchronously throughout.
"""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pipes(tiny_model_dir):
    """(synchronous, async) pipelines of the same tiny model."""
    base = dict(dtype="float32", device="cpu", block_size=4, num_blocks=96, max_batch_size=8)
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(**base, async_scheduling=False)) as sync, \
            pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(**base, async_scheduling=True)) as fast:
        yield sync, fast


class Ahead:
    """Counts the steps launched with the previous step's tokens still on the device."""

    def __init__(self, engine) -> None:
        self.count = 0
        self.beams = 0  # launches with a beam search's request among them
        self.started = 0  # requests that started (their prompt computed) in a step launched ahead
        launch = engine.runner.launch

        def counted(requests, positions, tables, prev=None, known=None, prompts=()):
            self.count += prev is not None
            self.started += len(prompts) if prev is not None else 0
            self.beams += any(r.sampling.beam_width for r in [*requests, *(p[0] for p in prompts)])
            return launch(requests, positions, tables, prev, known, prompts)

        engine.runner.launch = counted


def run(engine, requests: dict[str, tuple[list[int], GenerationConfig]], arrivals: dict[int, list[str]] | None = None,
        aborts: dict[int, list[str]] | None = None) -> dict[str, tuple[list[int], str | None]]:
    """Add `requests` (those in arrivals[k] only before step k), step to the end (aborting aborts[k] before step k):
    per request its tokens and finish reason."""
    arrivals = arrivals or {0: list(requests)}
    out: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid in requests}
    k = 0
    while k <= max(arrivals) or engine.has_unfinished_requests():
        for rid in arrivals.get(k, []):
            engine.add_request(rid, *requests[rid])
        for rid in (aborts or {}).get(k, []):
            for o in engine.abort(rid):
                out[rid] = (out[rid][0], o.finish_reason)
        for o in engine.step():
            out[o.request_id] = (out[o.request_id][0] + o.new_token_ids, o.finish_reason)
        k += 1
    assert engine.kv.usage().in_use == 0 and not engine.scheduler.running
    engine.kv.check_invariants()
    return out


def both(pipes, requests, **kw) -> tuple[dict, dict, int]:
    sync, fast = pipes
    ahead = Ahead(fast.engine)
    assert not sync.engine.async_scheduling and fast.engine.async_scheduling
    return run(sync.engine, requests, **kw), run(fast.engine, requests, **kw), ahead.count


def test_default_is_off_on_cpus(tiny_model_dir):
    config = EngineConfig(dtype="float32", device="cpu", num_blocks=16)
    with pipeline(tiny_model_dir("llama"), backend_config=config) as p:
        assert not p.engine.async_scheduling


def test_same_tokens_and_stops_as_synchronous_steps(pipes):
    sync, _ = pipes
    plain = {f"r{i}": (ids(3 + 5 * i, i), GREEDY.replace(max_new_tokens=1 + 3 * i)) for i in range(6)}
    # stop tokens that end requests mid-run, at steps the engine cannot know ahead
    first = run(sync.engine, plain)
    requests = dict(plain)
    for i, rid in enumerate(["r3", "r4", "r5"]):
        tokens = first[rid][0]
        requests[rid] = (plain[rid][0], plain[rid][1].replace(stop_token_ids=[tokens[2 + i]]))
    want, got, ahead = both(pipes, requests)
    assert got == want
    assert {want[r][1] for r in ("r3", "r4", "r5")} == {"stop"} and want["r0"][1] == "length"
    assert ahead >= 5


def test_stop_strings_and_seeded_sampling(pipes):
    sync, _ = pipes
    seeded = GenerationConfig(temperature=0.9, top_p=0.95, max_new_tokens=10, ignore_eos=True)
    requests = {f"s{i}": (ids(6 + i, 10 + i), seeded.replace(random_seed=i)) for i in range(4)}
    text = sync.engine.tokenizer.decode(run(sync.engine, requests)["s1"][0])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    requests["s1"] = (requests["s1"][0], requests["s1"][1].replace(stop_words=[stop]))
    want, got, ahead = both(pipes, requests)
    assert got == want and want["s1"][1] == "stop"
    assert ahead >= 5


def test_arrivals_and_aborts_mid_run(pipes):
    requests = {f"a{i}": (ids(4 + 3 * i, 20 + i), GREEDY.replace(max_new_tokens=9 + i)) for i in range(6)}
    want, got, ahead = both(pipes, requests, arrivals={0: ["a0", "a1", "a2"], 4: ["a3"], 7: ["a4", "a5"]},
                            aborts={3: ["a1"], 9: ["a4"]})
    # an aborted request's output so far depends on when the step ran that it was aborted before: a request that
    # arrives while a step is in flight starts one step later (that step is read first)
    for rid in ("a1", "a4"):
        (a, reason_a), (b, reason_b) = want.pop(rid), got.pop(rid)
        shorter, longer = sorted((a, b), key=len)
        assert reason_a == reason_b == "abort" and longer[:len(shorter)] == shorter
    assert got == want
    assert ahead >= 5


def test_a_full_batch_goes_on_ahead_while_requests_wait(pipes):
    # max_batch_size 8: ten requests, two wait for a place; steps go on ahead while the batch is full
    requests = {f"w{i}": (ids(5, 40 + i), GREEDY.replace(max_new_tokens=6 + 2 * (i % 3))) for i in range(10)}
    want, got, ahead = both(pipes, requests)
    assert got == want
    assert ahead >= 3


def test_penalties_bans_and_bias_see_the_token_in_flight(pipes):
    # their sampling reads the output: the next step waits for the token in flight, counted as generated
    sync, _ = pipes
    tok = sync.engine.tokenizer
    plain = GREEDY.replace(max_new_tokens=14)
    first = run(sync.engine, {"m": (ids(6, 84), plain), "b": (ids(7, 85), plain)})
    requests = {"rep": (ids(7, 80), plain.replace(repetition_penalty=1.5)),
                "freq": (ids(8, 81), plain.replace(frequency_penalty=0.9, presence_penalty=0.4)),
                "bias": (ids(9, 82), plain.replace(logit_bias={7: 3.0, 11: -2.0})),
                # a stop token that the sampler must ban until min_tokens, then may emit
                "min": (ids(6, 84), plain.replace(stop_token_ids=[first["m"][0][3]], min_new_tokens=6)),
                "bad": (ids(7, 85), plain.replace(bad_words=[tok.decode(first["b"][0][2:4])])),
                "plain": (ids(7, 86), plain)}
    want, got, ahead = both(pipes, requests)
    assert got == want
    assert want["bad"][0] != first["b"][0]  # the bans changed the output
    assert ahead >= 10


def test_structured_output_masks_follow_the_token_in_flight(pipes):
    from tests.structured.test_engine_structured import FORMATS, matches

    sampled = GenerationConfig(temperature=1.0, max_new_tokens=24, random_seed=5)
    requests = {f"{kind}{j}": (ids(8 + 5 * j, 90 + j), (GREEDY.replace(max_new_tokens=24) if j else sampled).replace(
        response_format=fmt)) for kind, fmt in FORMATS.items() for j in range(2)}
    requests["plain"] = (ids(9, 99), GREEDY.replace(max_new_tokens=20))
    want, got, ahead = both(pipes, requests)
    assert got == want
    tok = pipes[0].engine.tokenizer
    for rid, (tokens, reason) in want.items():
        if rid != "plain":
            assert reason == "stop" and matches(rid[:-1], tok.decode(tokens, skip_special_tokens=True)), rid
    assert ahead >= 10


def test_beams_run_synchronously_beside_it(pipes):
    requests = {"plain": (ids(7, 50), GREEDY), "beam": (ids(7, 51), GREEDY.replace(use_beam_search=True, beam_width=2,
                                                                                    max_new_tokens=6))}
    counter = Ahead(pipes[1].engine)
    want, got, ahead = both(pipes, requests, arrivals={0: ["plain"], 6: ["beam"]})
    assert got == want
    assert ahead >= 3  # the plain request alone, before the beams arrive
    assert counter.beams == 0 and counter.count == ahead  # no step with a beam was launched ahead


def test_logprobs_come_back_with_the_tokens(pipes):
    sync, fast = pipes
    ahead = Ahead(fast.engine)
    requests = {f"l{i}": (ids(5 + 4 * i, 70 + i), GREEDY.replace(max_new_tokens=8, logprobs=[None, 0, 3][i % 3]))
                for i in range(5)}
    results = []
    for engine in (sync.engine, fast.engine):
        out = {rid: [] for rid in requests}
        for rid, (prompt, gen) in requests.items():
            engine.add_request(rid, prompt, gen)
        while engine.has_unfinished_requests():
            for o in engine.step():
                lps = o.new_logprobs or [None] * len(o.new_token_ids)
                out[o.request_id] += [(t, None) if lp is None else
                                      (t, lp.token_id, lp.rank, [i for i, _ in lp.top],
                                       [lp.logprob, *(v for _, v in lp.top)])
                                      for t, lp in zip(o.new_token_ids, lps, strict=True)]
        results.append(out)
    # (the synchronous step takes the CPU's native logprob kernel, the async one log_softmax: the same to fp32 rounding)
    for rid in requests:
        for want, got in zip(results[0][rid], results[1][rid], strict=True):
            assert got[:4] == want[:4]
            if want[1] is not None:
                assert got[4] == pytest.approx(want[4], abs=1e-4)
    assert all(len(results[0][f"l{i}"]) == 8 for i in range(5))
    assert len(results[0]["l2"][0][3]) == 3 and results[0]["l1"][0][3] == []  # top-3, and the token's own only
    assert results[0]["l0"][0][1] is None and results[0]["l1"][0][1] == results[0]["l1"][0][0]
    assert ahead.count >= 5


def test_a_pool_too_small_to_run_ahead_preempts_as_before(tiny_model_dir):
    # 20 blocks of 4 tokens for 4 requests reaching 30 tokens: preemptions, and steps that cannot allocate ahead
    requests = {f"p{i}": (ids(10, 60 + i), GREEDY.replace(max_new_tokens=20)) for i in range(4)}
    results = []
    counts = []
    for flag in (False, True):
        config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=20, async_scheduling=flag)
        with pipeline(tiny_model_dir("llama"), backend_config=config) as p:
            ahead = Ahead(p.engine)
            results.append(run(p.engine, requests))
            counts.append((ahead.count, p.engine.scheduler.num_preemptions))
    assert results[1] == results[0]
    assert counts[1][0] >= 3 and counts[0][1] > 0


def test_a_session_turn_that_stops_early_keeps_only_its_computed_kv(tiny_model_dir):
    # turn 1 stops at a stop token, so the step launched after it wrote one more token's K/V into its blocks: the
    # session keeps only the computed ones, and turn 2 (reusing them) answers as an engine without sessions does
    p1, new = ids(13, 0), ids(5, 1)
    gen = GREEDY.replace(max_new_tokens=10)
    outs = []
    for flag, sessions in ((False, 0), (True, 4)):
        config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=32, async_scheduling=flag,
                              max_sessions=sessions)
        with pipeline(tiny_model_dir("llama"), backend_config=config) as p:
            e, ahead = p.engine, Ahead(p.engine)
            sid = "s" if sessions else None
            full = run(e, {"0": (p1, gen)})["0"][0]
            stop = gen.replace(stop_token_ids=[full[5]])
            o1 = _turn(e, "1", p1, stop, sid)
            hits = e.sessions.hit_tokens
            o2 = _turn(e, "2", p1 + o1 + new, gen, sid)
            outs.append((full, o1, o2))
            if sessions:
                assert e.sessions.hit_tokens - hits == len(p1) + len(o1) and ahead.count >= 5
                assert e.end_session("s")
            assert e.kv.usage().in_use == 0
            e.kv.check_invariants()
    assert outs[1] == outs[0] and len(outs[0][1]) == outs[0][0].index(outs[0][0][5])


def _turn(engine, rid: str, prompt: list[int], gen: GenerationConfig, session: str | None) -> list[int]:
    engine.add_request(rid, prompt, gen, session_id=session)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out


def run_with_logprobs(engine, requests, arrivals, aborts=None) -> dict[str, list[tuple[int, float | None]]]:
    """As `run`, keeping each token's logprob (None where not asked)."""
    out: dict[str, list[tuple[int, float | None]]] = {rid: [] for rid in requests}
    k = 0
    while k <= max(arrivals) or engine.has_unfinished_requests():
        for rid in arrivals.get(k, []):
            engine.add_request(rid, *requests[rid])
        for rid in (aborts or {}).get(k, []):
            engine.abort(rid)
        for o in engine.step():
            lps = o.new_logprobs or [None] * len(o.new_token_ids)
            out[o.request_id] += [(t, None if lp is None else lp.logprob) for t, lp in zip(o.new_token_ids, lps)]
        k += 1
    assert engine.kv.usage().in_use == 0 and not engine.scheduler.running
    engine.kv.check_invariants()
    return out


def test_arrivals_start_in_steps_launched_ahead(pipes):
    """Requests that arrive while a step is in flight start in the next step, launched before that one is read
    (their prompt computed beside the decodes, the first token sampled on the device): every kind of sampling the
    decodes take, a first token that is the last, a stop token, a prompt whose prefix another request computed, and
    the same tokens and logprobs as synchronous steps."""
    from tests.structured.test_engine_structured import FORMATS

    sync, fast = pipes
    base = {f"b{i}": (ids(6 + i, 200 + i), GREEDY.replace(max_new_tokens=18)) for i in range(2)}
    first = run(sync.engine, {"x": (ids(5, 210), GREEDY)})["x"][0]
    late = {"plain": (ids(9, 201), GREEDY.replace(max_new_tokens=7)),
            "one": (ids(4, 202), GREEDY.replace(max_new_tokens=1)),
            "seeded": (ids(7, 203), GenerationConfig(temperature=0.8, top_p=0.9, max_new_tokens=8, ignore_eos=True,
                                                    random_seed=3)),
            "stop": (ids(5, 210), GREEDY.replace(stop_token_ids=[first[3]])),
            "lp": (ids(6, 204), GREEDY.replace(max_new_tokens=6, logprobs=2)),
            "pen": (ids(8, 205), GREEDY.replace(max_new_tokens=9, repetition_penalty=1.5)),
            "regex": (ids(8, 206), GREEDY.replace(max_new_tokens=24, response_format=FORMATS["regex"])),
            "prefix": (base["b0"][0] + ids(3, 207), GREEDY.replace(max_new_tokens=5))}
    requests = {**base, **late}
    arrivals = {0: list(base), 3: ["plain", "one", "seeded"], 5: ["stop", "lp", "pen"], 8: ["regex", "prefix"]}
    ahead = Ahead(fast.engine)
    want = run_with_logprobs(sync.engine, requests, arrivals)
    got = run_with_logprobs(fast.engine, requests, arrivals)
    assert len(want["stop"]) < len(first) and len(got["one"]) == 1
    for rid in requests:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
        for (_, a), (_, b) in zip(got[rid], want[rid]):
            assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-4)), rid
    assert ahead.started == len(late)  # every late request started in a step launched ahead


def test_an_abort_while_its_prompt_is_in_flight(pipes):
    """A request aborted after it started in a step launched ahead, before that step is read: freed, nothing
    emitted for it, the others unchanged."""
    sync, fast = pipes
    requests = {"a": (ids(7, 220), GREEDY.replace(max_new_tokens=10)),
                "b": (ids(12, 221), GREEDY.replace(max_new_tokens=10)),
                "c": (ids(5, 222), GREEDY.replace(max_new_tokens=6))}
    ahead = Ahead(fast.engine)
    # "b" arrives before step 3 (it starts in the step launched then) and is aborted before step 4 reads that step
    want = run_with_logprobs(sync.engine, requests, {0: ["a"], 3: ["b", "c"]}, aborts={4: ["b"]})
    got = run_with_logprobs(fast.engine, requests, {0: ["a"], 3: ["b", "c"]}, aborts={4: ["b"]})
    assert got["b"] == [] and ahead.started == 2
    assert got["a"] == want["a"] and got["c"] == want["c"]


@pytest.mark.parametrize("case", ["long prompt", "small pool", "siblings", "prompt logprobs"])
def test_what_cannot_start_ahead_starts_in_a_synchronous_step(tiny_model_dir, case):
    """A prompt over the step's budget (chunked), n > 1 siblings after the first (which wait for its prompt's
    blocks) and prompt logprobs start as before: in a synchronous step, with the same tokens. A pool with no room
    for the late request: it waits for room, then starts ahead or not, with the same tokens."""
    budget, blocks = (16, 96) if case == "long prompt" else (2048, 14 if case == "small pool" else 96)
    requests = {"a": (ids(6, 230), GREEDY.replace(max_new_tokens=14)), "b": (ids(5, 231), GREEDY)}
    late = {"long prompt": (ids(30, 232), GREEDY.replace(max_new_tokens=5)),
            "small pool": (ids(30, 232), GREEDY.replace(max_new_tokens=5)),
            "siblings": (ids(9, 232), GenerationConfig(temperature=0.7, n=2, max_new_tokens=5, random_seed=1)),
            "prompt logprobs": (ids(9, 232), GREEDY.replace(max_new_tokens=5, prompt_logprobs=1))}[case]
    requests["late"] = late
    results, started = [], []
    for flag in (False, True):
        config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=blocks,
                              max_prefill_token_num=budget, async_scheduling=flag)
        with pipeline(tiny_model_dir("llama"), backend_config=config) as p:
            ahead = Ahead(p.engine)
            results.append(run(p.engine, requests, arrivals={0: ["a", "b"], 4: ["late"]}))
            started.append((ahead.count, ahead.started))
    assert results[1] == results[0]
    assert started[1][0] >= 3
    if case != "small pool":
        assert started[1][1] == (1 if case == "siblings" else 0)
