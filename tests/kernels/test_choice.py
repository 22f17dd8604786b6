"""Kernel choice by measurement (llmserve/kernels/choice.py), driven by a fake timer: the choice follows the faster
candidate per bucket, a cached table is reused, a stale or foreign one is measured again, pins replace measurement,
and a measurement taken while other processes held the CPUs is not cached. No timing is asserted."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace as dataclass_replace

import pytest

from llmserve.errors import InvalidRequestError
from llmserve.kernels import choice
from llmserve.kernels.choice import Candidate, OpChoice, choose, load_or_measure, parse_pins


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "_measured", {})  # each test starts as a new process would
    return tmp_path / "tuning"


def fake_timer(costs: dict[str, Callable[[int], float]], calls: list[tuple[str, int]] | None = None):
    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        fn()
        if calls is not None:
            calls.append((name, rows))
        return costs[name](rows)
    return timer


def candidates(*names: str, ran: list[tuple[str, int]] | None = None) -> list[Candidate]:
    return [Candidate(n, lambda rows, n=n: ran.append((n, rows)) if ran is not None else None) for n in names]


def test_one_kernel_for_every_batch_size_the_best_across_them() -> None:
    """The candidates sum in different orders, so one op takes one kernel at every row count (a request's tokens must
    not depend on its batch): the lowest total relative time, every bucket counting alike."""
    # fma 2x faster up to 16 rows (5 buckets), dot 2x faster above (5 buckets), slightly better there: dot overall
    costs = {"fma": lambda r: 1.0 * r if r <= 16 else 2.0 * r, "dot": lambda r: 2.0 * r if r <= 16 else 0.9 * r}
    buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    c = choose(candidates("fma", "dot"), fake_timer(costs), buckets=buckets, reps=3)
    assert c.kernel == "dot" and c.rows == buckets and c.describe() == "dot"
    assert c.seconds["fma"][:2] == (1.0, 2.0) and c.seconds["dot"][-1] == pytest.approx(0.9 * 512)
    # the same with fma a little better where it wins: fma everywhere
    costs["fma"] = lambda r: 0.9 * r if r <= 16 else 2.0 * r
    costs["dot"] = lambda r: 2.0 * r if r <= 16 else 1.0 * r
    assert choose(candidates("fma", "dot"), fake_timer(costs), buckets=buckets, reps=2).kernel == "fma"


def test_each_candidate_keeps_its_least_disturbed_round_and_rounds_interleave() -> None:
    calls: list[tuple[str, int]] = []
    noisy = iter([9e-3, 1e-3, 1.5e-3, 3e-3, 3e-3, 3e-3])  # fma: 9, 1.5, 3 ms -> 1.5 (its fastest); dot: 1, 3, 3 -> 1

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        calls.append((name, rows))
        return next(noisy)

    ran: list[tuple[str, int]] = []
    c = choose(candidates("fma", "dot", ran=ran), timer, buckets=(4,), reps=3)
    assert calls == [("fma", 4), ("dot", 4)] * 3  # interleaved, so a slow spell hits both
    assert ran[:2] == [("fma", 4), ("dot", 4)]  # one warm-up call each, untimed
    assert c.seconds == {"fma": (1.5e-3,), "dot": (1e-3,)} and c.kernel == "dot"


def test_a_candidate_far_behind_after_two_rounds_gets_no_more() -> None:
    """fp32 at 5x the fastest after two rounds is not timed a third time (it had lost that bucket); one slow first
    round does not drop dot (its second is in line)."""
    calls: list[tuple[str, int]] = []
    samples = {"fma": iter([1e-3, 1e-3, 1e-3]), "dot": iter([9e-3, 1.1e-3, 1.1e-3]), "fp32": iter([5e-3, 5e-3])}

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        calls.append((name, rows))
        return next(samples[name])

    c = choose(candidates("fma", "dot", "fp32"), timer, buckets=(8,), reps=3)
    assert calls == [("fma", 8), ("dot", 8), ("fp32", 8)] * 2 + [("fma", 8), ("dot", 8)]
    assert c.seconds == {"fma": (1e-3,), "dot": (1.1e-3,), "fp32": (5e-3,)} and c.kernel == "fma"


def test_a_tie_keeps_the_first_listed() -> None:
    c = choose(candidates("fma", "dot"), fake_timer({"fma": lambda r: 1.0, "dot": lambda r: 1.0}), buckets=(1, 2))
    assert c.kernel == "fma"


def measurer(winner: str, counter: list[int]) -> Callable[[], OpChoice]:
    def measure() -> OpChoice:
        counter.append(1)
        return OpChoice(winner, (1, 64), {winner: (1.0, 2.0)})
    return measure


QUIET = lambda: None  # noqa: E731 - a clock that cannot read the machine: the table is cached


def test_a_cached_table_is_reused(cache_dir) -> None:
    key = {"cpu": "X", "threads": 2, "torch": "2.13.0", "ops": ["a"]}
    counter: list[int] = []
    first = load_or_measure(key, {"a": measurer("dot", counter)}, clock=QUIET)
    assert counter == [1] and not first.reused and first.cached
    assert len(list(cache_dir.iterdir())) == 1
    choice._measured.clear()  # a later start: read from the file
    second = load_or_measure(key, {"a": measurer("fma", counter)}, clock=QUIET)
    assert counter == [1] and second.reused  # not measured again: the cached winner stands
    assert second.ops["a"].kernel == "dot" and second.ops["a"].seconds == {"dot": (1.0, 2.0)}
    assert second.describe() == "a: dot (cached)"


def test_another_key_is_another_table(cache_dir) -> None:
    counter: list[int] = []
    for torch_version in ("2.13.0", "2.14.0"):
        key = {"cpu": "X", "threads": 2, "torch": torch_version, "ops": ["a"]}
        load_or_measure(key, {"a": measurer("dot", counter)}, clock=QUIET)
    assert counter == [1, 1] and len(list(cache_dir.iterdir())) == 2


@pytest.mark.parametrize("spoil", ["key", "format", "ops", "garbage", "seconds"])
def test_a_stale_or_broken_table_is_measured_again(cache_dir, spoil: str) -> None:
    key = {"cpu": "X", "threads": 2, "ops": ["a"]}
    counter: list[int] = []
    load_or_measure(key, {"a": measurer("dot", counter)}, clock=QUIET)
    path = choice.cache_path(key)
    d = json.loads(path.read_text())
    if spoil == "key":
        d["key"]["threads"] = 4  # a file whose contents are not what its name's key says
    elif spoil == "format":
        d["format"] = choice.FORMAT + 1
    elif spoil == "ops":
        d["ops"] = {"b": d["ops"]["a"]}  # a table without the op asked for (one with more would serve)
    elif spoil == "seconds":
        d["ops"]["a"]["seconds"]["dot"] = [1.0]  # one time for two timed row counts
    path.write_text("{not json" if spoil == "garbage" else json.dumps(d))
    choice._measured.clear()  # as a new process finds it
    table = load_or_measure(key, {"a": measurer("fma", counter)}, clock=QUIET)
    assert counter == [1, 1] and not table.reused and table.ops["a"].kernel == "fma"
    assert json.loads(path.read_text())["ops"]["a"]["kernel"] == "fma"  # and rewritten


def test_remeasure_ignores_the_cache() -> None:
    key = {"ops": ["a"]}
    counter: list[int] = []
    load_or_measure(key, {"a": measurer("dot", counter)}, clock=QUIET)
    table = load_or_measure(key, {"a": measurer("fma", counter)}, remeasure=True, clock=QUIET)
    assert counter == [1, 1] and table.ops["a"].kernel == "fma"


def test_pins_replace_measurement_and_are_never_cached(cache_dir) -> None:
    counter: list[int] = []
    table = load_or_measure({"ops": ["a"]}, {"a": measurer("dot", counter)}, pins={"a": choice.pinned("fma")},
                            clock=QUIET)
    assert counter == [] and table.ops["a"].kernel == "fma" and table.ops["a"].describe() == "fma (pinned)"
    assert not cache_dir.exists() or not list(cache_dir.iterdir())


def test_a_start_with_pins_reads_the_whole_table_and_leaves_it_whole(cache_dir) -> None:
    """Alternated A/B runs: a pinned start reads the other ops from the cached table and never rewrites it with fewer
    ops (which made every later start without the pin measure everything again)."""
    key = {"ops": ["a", "b"]}
    counter: list[int] = []
    load_or_measure(key, {"a": measurer("dot", counter), "b": measurer("dot", counter)}, clock=QUIET)
    assert counter == [1, 1]
    for _ in range(2):
        choice._measured.clear()  # each start a new process
        pinned_run = load_or_measure(key, {"a": measurer("fma", counter), "b": measurer("fma", counter)},
                                     pins={"a": choice.pinned("fp32")}, clock=QUIET)
        assert counter == [1, 1] and pinned_run.ops["b"].kernel == "dot" and pinned_run.reused
        choice._measured.clear()
        auto = load_or_measure(key, {"a": measurer("fma", counter), "b": measurer("fma", counter)}, clock=QUIET)
        assert counter == [1, 1] and auto.reused and auto.ops["a"].kernel == "dot"
    # with no cached table, a pinned start measures the rest for itself only
    choice._measured.clear()
    other = {"ops": ["c", "d"]}
    load_or_measure(other, {"c": measurer("dot", counter), "d": measurer("dot", counter)},
                    pins={"c": choice.pinned("fp32")}, clock=QUIET)
    assert counter == [1, 1, 1] and not choice.cache_path(other).exists()


def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(cache_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choice.os, "cpu_count", lambda: 2)
    # in 10 s on 2 CPUs: 14 busy CPU seconds, 3 of them ours -> 11 / 20 = 55%
    readings = iter([choice.CpuReading(50.0, 100.0, 5.0), choice.CpuReading(60.0, 114.0, 8.0)])
    counter: list[int] = []
    table = load_or_measure({"ops": ["a"]}, {"a": measurer("dot", counter)}, clock=lambda: next(readings))
    assert counter == [1] and table.ops["a"].kernel == "dot"
    assert table.others_busy == pytest.approx(0.55) and not table.cached
    assert "not cached: other processes used 55% of the CPUs" in table.describe()
    assert not cache_dir.exists() or not list(cache_dir.iterdir())
    again = load_or_measure({"ops": ["a"]}, {"a": measurer("fma", counter)}, clock=QUIET)
    assert counter == [1] and again.ops["a"].kernel == "dot"  # this process keeps what it measured
    monkeypatch.setattr(choice, "_measured", {})  # a new process: measured again, and cached now it is quiet
    fresh = load_or_measure({"ops": ["a"]}, {"a": measurer("fma", counter)}, clock=QUIET)
    assert counter == [1, 1] and fresh.cached and fresh.ops["a"].kernel == "fma"


def test_cpu_seconds_reads_this_machine() -> None:
    reading = choice.cpu_seconds()
    if reading is None:
        pytest.skip("no /proc/stat here")
    assert reading.machine > 0 and reading.own >= 0
    later = choice.cpu_seconds()
    assert later.wall > reading.wall and choice.others_busy(reading, later) is not None


def test_parse_pins() -> None:
    kinds = {"bf16_linear": ("fma", "dot", "onednn", "fp32")}
    assert parse_pins(None, kinds) == {} and parse_pins("auto", kinds) == {} and parse_pins(" ", kinds) == {}
    assert parse_pins("bf16_linear=dot", kinds) == {"bf16_linear": "dot"}
    assert parse_pins(" bf16_linear = fma ", kinds) == {"bf16_linear": "fma"}
    for bad, says in (("bf16_linear=amx", "takes one of fma, dot, onednn, fp32"), ("dot", "KIND=CANDIDATE"),
                      ("attention=fma", "KIND=CANDIDATE")):
        with pytest.raises(InvalidRequestError, match=says) as e:
            parse_pins(bad, kinds)
        assert e.value.param == "kernel_choice"


def test_op_choice_round_trips_through_json() -> None:
    c = OpChoice("dot", (1, 8, 64), {"fma": (1.0, 2.0, 3.0), "dot": (2.0, 1.0, 1.5)})
    assert OpChoice.from_json(json.loads(json.dumps(c.to_json()))) == c
    few = OpChoice("amx", (1, 8), {"amx": (1.0, 2.0)}, few_rows=4,
                   few_timed={"reference": (3.0, 3.0, 3.0, 3.0), choice.FEW_ROWS_KERNEL: (1.0, 2.0, 3.0, 4.0)})
    assert OpChoice.from_json(json.loads(json.dumps(few.to_json()))) == few
    assert few.describe() == f"amx (<= 4 rows: {choice.FEW_ROWS_KERNEL})"
    with pytest.raises(ValueError):
        OpChoice.from_json({**few.to_json(), "few_rows": -1})
    with pytest.raises(ValueError):
        OpChoice.from_json({"kernel": "dot", "rows": [1, 8], "seconds": {"dot": [1.0]}})
    with pytest.raises(ValueError):
        OpChoice.from_json({"kernel": ["dot"], "rows": []})


def test_long_calls_get_two_rounds() -> None:
    """A bucket whose fastest call takes LONG_CALL or more is timed twice, not reps times."""
    calls: list[tuple[str, int]] = []
    costs = {"fma": lambda r: choice.LONG_CALL * (2 if r > 1 else 0.1), "dot": lambda r: choice.LONG_CALL * 3}
    c = choose(candidates("fma", "dot"), fake_timer(costs, calls), buckets=(1, 64), reps=5)
    assert calls.count(("fma", 1)) == 5 and calls.count(("fma", 64)) == 2 and calls.count(("dot", 64)) == 2
    assert c.kernel == "fma"


def test_few_rows_go_up_to_the_first_bucket_the_stand_in_loses() -> None:
    """Per op, the stand-in (the same bits) runs up to the largest bucket before the first it loses; its warm-up pass
    does not count, each op keeps its fastest pass, and the passes stop once every op has lost a bucket."""
    fma, ref = choice.FEW_ROWS_KERNEL, choice.REFERENCE
    cost = {"a": {ref: lambda r: 4.0, fma: lambda r: float(r)},  # even at 4 rows, behind at 8
            "b": {ref: lambda r: 1.0, fma: lambda r: 2.0},  # behind at once
            "c": {ref: lambda r: 10.0 * r, fma: lambda r: 1.0}}  # ahead at every bucket
    passes: list[tuple[str, int]] = []

    def timed_pass(kernel: str, rows: int) -> dict[str, float]:
        first = (kernel, rows) not in passes
        passes.append((kernel, rows))
        # the warm-up pass is slow, and a disturbed one too: neither may count
        slow = 100.0 if first or len(passes) % 5 == 0 else 1.0
        return {op: slow * c[kernel](rows) for op, c in cost.items()}

    found = choice.few_rows(["a", "b", "c"], timed_pass, buckets=(1, 2, 4, 8, 16, 32), reps=3)
    assert {op: rows for op, (rows, _) in found.items()} == {"a": 4, "b": 0, "c": 32}
    assert found["a"][1] == {ref: (4.0, 4.0, 4.0, 4.0), fma: (1.0, 2.0, 4.0, 8.0)}
    assert len(found["b"][1][fma]) == 1 and len(found["c"][1][ref]) == 6
    assert passes.count((fma, 32)) == 4  # c is still ahead: every bucket is timed

    cost["c"] = {ref: lambda r: 1.0, fma: lambda r: 3.0}
    passes.clear()
    found = choice.few_rows(["a", "b", "c"], timed_pass, buckets=(1, 2, 4, 8, 16, 32), reps=3)
    assert found["c"][0] == 0 and max(r for _, r in passes) == 8  # all behind by 8 rows: no pass at 16


def test_the_int8_tiles_run_from_the_smallest_bucket_they_win_at_and_beyond() -> None:
    """from_rows: one threshold, from the smallest bucket from which the faster path (the same bits) never lost; a lone
    win below a loss does not count, a loss at the largest bucket means never (0)."""
    buckets = (1, 2, 4, 8, 16, 32, 64)
    slow = (1.0,) * 7
    assert choice.from_rows(buckets, slow, (2, 2, 2, 2, 1, 1, 1)) == 16
    assert choice.from_rows(buckets, slow, (0.5, 2, 2, 0.5, 2, 1, 1)) == 32  # the wins at 1 and 8 are cut off by 16
    assert choice.from_rows(buckets, slow, (0.5,) * 7) == 1
    assert choice.from_rows(buckets, slow, (0.5,) * 6 + (2,)) == 0


def test_a_lone_slower_bucket_that_sets_the_threshold_is_found_for_a_second_look() -> None:
    """lone_loss: the bucket where from_rows stops, where the faster path won at the bucket below it; not a run of
    losses (a real threshold), not the smallest bucket, nothing where it never lost."""
    slow = (1.0,) * 6
    assert choice.lone_loss(slow, (2, 2, 1, 1, 2, 1)) == 4  # wins at 4-8 and 32, alone slower at 16
    assert choice.lone_loss(slow, (2, 1, 1, 1, 1, 2)) == 5  # at the largest: from_rows alone would say never
    assert choice.lone_loss(slow, (2, 2, 2, 1, 1, 1)) is None  # slower up to 4: the threshold is 8
    assert choice.lone_loss(slow, (2, 1, 1, 1, 1, 1)) is None  # only the smallest
    assert choice.lone_loss(slow, (1,) * 6) is None  # a tie is a win (from_rows: at most slow's time)


def test_amx8_rows_survive_the_cache_and_bad_values_are_refused() -> None:
    for rows in (None, 0, 64):
        c = OpChoice("blocks", (1,), {"blocks": (1.0,)}, amx8_rows=rows,
                     amx8_timed={} if rows is None else {choice.VNNI: (1.0,), choice.AMX8: (2.0,)})
        assert OpChoice.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert "from 64 rows: amx8" in OpChoice("blocks", amx8_rows=64).describe()
    assert "no amx8" in OpChoice("blocks", amx8_rows=0).describe()
    assert OpChoice("blocks").describe() == "blocks"
    for bad in (-1, 1.5, "16"):
        with pytest.raises(ValueError, match="amx8_rows"):
            OpChoice.from_json({"kernel": "blocks", "rows": [], "amx8_rows": bad})


def test_wide_rows_survive_the_cache_and_bad_values_are_refused() -> None:
    for rows in (None, 0, 64):
        c = OpChoice("blocks", (1, 2), {"blocks": (1.0, 2.0)}, wide_rows=rows,
                     wide_timed={} if rows is None else {choice.NARROW: (1.0,), choice.WIDE: (2.0,)})
        assert OpChoice.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert OpChoice("blocks", amx8_rows=32, wide_rows=64).describe() == "blocks (from 32 rows: amx8) (from 64 rows: wide)"
    assert "no wide" in OpChoice("blocks", wide_rows=0).describe()
    for bad in ({"wide_rows": -1}, {"wide_rows": True}, {"wide_rows": "16"},
                {"wide_timed": {choice.WIDE: [1.0, 2.0]}}):  # more times than timed row counts
        with pytest.raises(ValueError, match="wide"):
            OpChoice.from_json({"kernel": "blocks", "rows": [1], **bad})


def test_a_bucket_slower_than_the_next_larger_is_timed_again() -> None:
    """A disturbance that lasts through a candidate's rounds at one bucket (or prunes it after two) cannot decide the
    choice: a time above RECHECK times the same candidate's at the next larger bucket is timed again once every bucket
    was, keeping the fastest round. A bucket that is really slow stays slow, and nothing changes."""
    buckets = (1, 2, 4, 8, 16)
    MS = 1e-3  # calls well under LONG_CALL: reps rounds
    disturbed = {"left": 2}

    def amx(rows: int) -> float:  # 0.8 of blocks' time everywhere, but its first two rounds at 4 rows read 10x
        if rows == 4 and disturbed["left"]:
            disturbed["left"] -= 1
            return 10 * MS * 0.8 * rows
        return MS * 0.8 * rows

    calls: list[tuple[str, int]] = []
    c = choose(candidates("blocks", "amx"), fake_timer({"blocks": lambda r: MS * r, "amx": amx}, calls),
               buckets=buckets, reps=3)
    assert c.kernel == "amx" and c.seconds["amx"][2] == pytest.approx(3.2 * MS)
    assert calls.count(("amx", 4)) == 2 + 3 and calls.count(("blocks", 4)) == 3  # pruned after two, then 3 again
    # without the second look the disturbed bucket (32 against blocks' 4) outweighs amx's lead in the other four
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(choice, "RECHECK", float("inf"))
        disturbed["left"] = 2
        assert choose(candidates("blocks", "amx"), fake_timer({"blocks": lambda r: MS * r, "amx": amx}),
                      buckets=buckets, reps=3).kernel == "blocks"
    # really slow at 4 rows: timed again, still slow, so blocks
    calls.clear()
    slow = {"blocks": lambda r: MS * r, "amx": lambda r: MS * (8.0 * r if r == 4 else 0.8 * r)}
    c = choose(candidates("blocks", "amx"), fake_timer(slow, calls), buckets=buckets, reps=3)
    assert c.kernel == "blocks" and c.seconds["amx"][2] == pytest.approx(32 * MS)
    assert calls.count(("amx", 4)) == 5 and all(calls.count(("amx", r)) == 3 for r in (1, 2, 8, 16))


def test_times_taken_cold_replace_the_hot_ones_and_choose_again() -> None:
    """with_cold_times: the buckets timed with the weights read from memory take those times and the op is chosen
    again by the same rule; a candidate not timed cold there is scaled by the cold/hot ratio of one that reads the
    same bytes (else of the bucket's fastest); the buckets above keep their hot times."""
    hot = OpChoice("dot", (1, 8, 64, 512), {"blocks": (2.0, 2.0, 2.0, 1.0), "dot": (1.0, 1.0, 1.0, 1.1),
                                             "onednn": (4.0, 4.0, 4.0, 1.2)})
    family = {"blocks": "blocks", "dot": "bf16", "onednn": "bf16"}.__getitem__
    cold = {"blocks": {0: 3.0, 1: 3.0, 2: 3.0}, "dot": {0: 6.0, 1: 6.0, 2: 6.0}}
    c = choice.with_cold_times(hot, cold, family)
    assert c.kernel == "blocks" and c.cold_rows == 64 and c.rows == hot.rows
    assert c.seconds["blocks"] == (3.0, 3.0, 3.0, 1.0) and c.seconds["dot"] == (6.0, 6.0, 6.0, 1.1)
    assert c.seconds["onednn"] == (24.0, 24.0, 24.0, 1.2)  # dot's ratio: it reads the same bf16 weight
    # nothing of its family timed: the bucket's fastest timed candidate's ratio
    only_blocks = choice.with_cold_times(hot, {"blocks": {0: 3.0}}, family)
    assert only_blocks.seconds["dot"][0] == 1.5 and only_blocks.seconds["onednn"][0] == 6.0
    assert only_blocks.cold_rows == 1 and only_blocks.kernel == "dot"  # one bucket of four: dot still wins
    assert choice.with_cold_times(hot, {}, family) == hot
    # the rows timed cold survive the cache file; a negative count is refused
    assert OpChoice.from_json(json.loads(json.dumps(c.to_json()))) == c
    with pytest.raises(ValueError):
        OpChoice.from_json({**c.to_json(), "cold_rows": -1})


def test_blocks_and_amx_are_judged_as_their_plans_run() -> None:
    """as_run: where both same-bits refinements were timed, the amx path's buckets up to few_rows take the stand-in's
    time relative to its own, the blocks' buckets from amx8_rows the tiles' relative to VNNI alone (above the tiles'
    largest bucket, the ratio there) where the blocks were timed on VNNI alone there, and the op is chosen again; the
    loser's refinement is dropped, the timed seconds stay. Pinned ops, and ops missing either refinement, are left as
    they were."""
    rows = tuple(2 ** i for i in range(12))  # 1 .. 2,048: six buckets up to 32, six above
    small = [r <= 32 for r in rows]
    few = {choice.REFERENCE: (2.0, 2.0, 2.0, 2.0), choice.FEW_ROWS_KERNEL: (1.0, 1.0, 1.0, 3.0)}  # lost at 8: <= 4
    tiles_even = {choice.VNNI: (1.0,) * 10, choice.AMX8: (1.0,) * 10}
    tie = OpChoice("blocks", rows, {"blocks": tuple(1.0 if s else 2.0 for s in small),
                                    "amx": tuple(2.0 if s else 1.0 for s in small)},
                   few_rows=4, few_timed=few, amx8_rows=1, amx8_timed=tiles_even)
    assert choice.best_across(tie.seconds) == "blocks"  # an exact tie as timed: the first listed
    c = choice.as_run(tie, 0)  # amx runs its 1-4 rows at half its time: 15 against the blocks' 18
    assert (c.kernel, c.few_rows, c.amx8_rows) == ("amx", 4, None)
    assert c.seconds == tie.seconds and c.few_timed == few and c.amx8_timed == tiles_even

    # amx ahead as timed (15 against 18); the tiles from 512 rows at 0.4 of VNNI's time give the blocks 0.8 at 512,
    # 1,024 and 2,048 (the last two by the ratio at 512): 15 against 15.75, the blocks
    ahead = OpChoice("amx", rows, {"blocks": tuple(1.0 if s else 2.0 for s in small),
                                   "amx": tuple(1.5 if s else 1.0 for s in small)},
                     few_rows=0, few_timed={choice.REFERENCE: (1.0,), choice.FEW_ROWS_KERNEL: (2.0,)}, amx8_rows=512,
                     amx8_timed={choice.VNNI: (1.0,) * 10, choice.AMX8: (2.0,) * 9 + (0.4,)})
    c = choice.as_run(ahead, 0)
    assert (c.kernel, c.few_rows, c.amx8_rows) == ("blocks", 0, 512)
    # the tiles never faster (amx8_rows 0): as timed, amx
    assert choice.as_run(dataclass_replace(ahead, amx8_rows=0), 0).kernel == "amx"

    assert choice.as_run(dataclass_replace(tie, pinned=True), 0) == dataclass_replace(tie, pinned=True)
    for missing in ({"few_timed": {}}, {"amx8_timed": {}, "amx8_rows": None}):
        assert choice.as_run(dataclass_replace(tie, **missing), 0) == dataclass_replace(tie, **missing)
    bf16 = OpChoice("dot", rows, {"fma": (1.0,) * 12, "dot": (0.5,) * 12})
    assert choice.as_run(bf16, 0) == bf16


def test_as_run_scales_only_the_blocks_buckets_whose_tiles_differ_from_their_timing() -> None:
    """The blocks' own times were taken with the kernel's AMX-INT8 threshold in force (timed_tiles_from): where the
    plan runs the same path there, nothing is scaled (before, the tiles' gain was applied a second time to buckets
    already timed on them); a bucket timed on the tiles that the plan runs on VNNI takes VNNI's time relative to the
    tiles', and one timed on VNNI that the plan puts on the tiles the inverse."""
    rows = (1, 16, 256, 2048)
    few = {choice.REFERENCE: (1.0,), choice.FEW_ROWS_KERNEL: (2.0,)}  # the stand-in lost at one row: few_rows 0
    half = {choice.VNNI: (1.0,) * 10, choice.AMX8: (0.5,) * 10}  # the tiles at half VNNI's time everywhere
    # relative to each bucket's fastest: blocks 1 + 1 + 1.625 + 1.625 = 5.25 against amx's 1.5 + 1.5 + 1 + 1 = 5
    timed = {"blocks": (1.0, 1.0, 1.3, 1.3), "amx": (1.5, 1.5, 0.8, 0.8)}
    c = OpChoice("amx", rows, timed, few_rows=0, few_timed=few, amx8_rows=16, amx8_timed=half)
    assert choice.best_across(timed) == "amx"
    assert choice.as_run(c, 16).kernel == "amx"  # timed with the tiles from 16 rows and planned so: as timed
    # the same times taken on VNNI alone: the plan's tiles halve 16 to 2,048 rows (blocks 4 against amx's 6.96)
    assert choice.as_run(c, 0).kernel == "blocks"
    assert choice.as_run(dataclass_replace(c, amx8_rows=1), 0).kernel == "blocks"
    # blocks ahead as timed (4 against 5.5); the plan keeps VNNI below 2,048 rows, so 16 and 256 rows, timed on the
    # tiles, double: 1 + 1.33 + 1.6 + 1 = 4.93 against amx's 1.5 + 1 + 1 + 1.25 = 4.75
    ahead = OpChoice("blocks", rows, {"blocks": (1.0, 1.0, 0.8, 0.8), "amx": (1.5, 1.5, 1.0, 1.0)}, few_rows=0,
                     few_timed=few, amx8_rows=16, amx8_timed=half)
    assert choice.as_run(ahead, 16).kernel == "blocks"
    assert choice.as_run(dataclass_replace(ahead, amx8_rows=2048), 16).kernel == "amx"
    assert choice.as_run(dataclass_replace(ahead, amx8_rows=0), 16).kernel == "amx"  # the tiles never: the same
