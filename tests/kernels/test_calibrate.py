"""The kernel choices of a real (tiny, bf16) model: which ops it has, a fake timer deciding them, pins, refusals, and
the per-step prefill-attention choice reaching the kernel. No timing is asserted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from llmserve.kernels import calibrate, choice, native
from llmserve.models.loader import load_model

pytestmark = [pytest.mark.skipif(not native.packed_gemm_usable(), reason="needs the extension and AVX-512"),
              pytest.mark.usefixtures("fresh_tuning_cache")]  # (conftest.py)
BF16 = torch.bfloat16


@pytest.fixture
def bf16_model(tiny_model_dir: Callable[[str], str]):
    return load_model(tiny_model_dir("llama"), EngineConfig(dtype="bfloat16")).model


def test_a_fake_timer_decides_every_op_of_the_model(bf16_model) -> None:
    """fma fastest up to 16 rows, fp32 (a little more so) above: one kernel per op, the best across the buckets."""
    calls: list[tuple[str, int]] = []

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        calls.append((name, rows))
        small = rows <= 16
        return {"fma": 1.0 if small else 9.0, "fp32": 9.0 if small else 0.5}.get(name, 5.0)

    table = calibrate.plan(bf16_model, 2, dtype=BF16, timer=timer)
    shapes = {calibrate.op_name(w) for w in calibrate.matmul_weights(bf16_model)}
    attention = calibrate.attention_op(bf16_model, calibrate.PREFILL_ATTENTION, BF16)
    decode = calibrate.attention_op(bf16_model, calibrate.DECODE_ATTENTION, BF16)
    assert set(table.ops) == shapes | {op for op in (attention, decode) if op}
    for op in shapes:
        assert table.ops[op].kernel == "fp32", op
    if attention is not None:  # dot (5.0) wins the one bucket of 16 tokens, fp32 (0.5) the other four: fp32
        a = bf16_model.attention_layers()[0]
        assert attention == f"prefill_attention:{a.num_heads}/{a.num_kv_heads}x{a.head_dim}"
        assert table.ops[attention].kernel == "fp32"
        assert decode == attention.replace("prefill", "decode")
        assert table.ops[decode].kernel == "fp32"  # dot wins 3 buckets by 9/5, fp32 2 by 10x
    assert {rows for _, rows in calls} >= set(choice.ROW_BUCKETS)
    # a second plan reads the cache (this process's memory first): the timer is not called again
    calls.clear()
    again = calibrate.plan(bf16_model, 2, dtype=BF16, timer=timer)
    assert calls == [] and again.reused and again.ops == table.ops


def test_pins_are_not_measured_and_unknown_ones_are_refused(bf16_model, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(name: str, rows: int, fn: Callable[[], object]) -> float:
        raise AssertionError("a pinned op was measured")

    table = calibrate.plan(bf16_model, 2, "bf16_linear=fma,prefill_attention=fp32,decode_attention=fp32", dtype=BF16,
                           timer=never)
    assert {c.kernel for c in table.ops.values()} <= {"fma", "fp32"}
    assert all(c.pinned for c in table.ops.values())
    monkeypatch.setenv(calibrate.ENV, "bf16_linear=fp32,prefill_attention=fp32,decode_attention=fp32")  # where auto
    assert {c.kernel for c in calibrate.plan(bf16_model, 2, dtype=BF16, timer=never).ops.values()} == {"fp32"}
    with pytest.raises(InvalidRequestError, match="kernel_choice"):
        EngineConfig(kernel_choice="bf16_linear=tpu")
    with pytest.raises(InvalidRequestError, match="kernel_choice"):
        EngineConfig(kernel_choice="attention=dot")
    if "dot" not in calibrate.available(calibrate.BF16_LINEAR):
        with pytest.raises(InvalidRequestError, match="cannot run on this machine"):
            calibrate.plan(bf16_model, 2, "bf16_linear=dot", dtype=BF16, timer=never)


@pytest.mark.skipif(not native.prefill_amx_usable(), reason="the amx path needs a CPU with AMX-BF16")
def test_an_amx_attention_pin_is_refused_where_head_dim_is_no_whole_tile(bf16_model) -> None:
    """The tiny Llama's head_dim is 16: the amx prefill path would run dot products instead, so the pin is refused
    (saying what to change), not quietly swapped."""
    with pytest.raises(InvalidRequestError, match=r"head_dim 16 is not a multiple of 32\): pin another kernel"):
        calibrate.plan(bf16_model, 2, "prefill_attention=amx", dtype=BF16)


def test_an_fp32_model_chooses_only_its_linears(tiny_model_dir: Callable[[str], str]) -> None:
    """Its matmuls are fp32_linear ops (the packed fp32_gemm against oneDNN: tests/kernels/test_fp32_linear_choice.py);
    its attention has no choice (the native attention's choices are a bf16 model's)."""
    model = load_model(tiny_model_dir("llama"), EngineConfig(dtype="float32")).model
    table = calibrate.plan(model, 2, dtype=torch.float32, timer=lambda name, rows, fn: 1.0)
    assert table.ops and all(op.startswith("fp32_linear:") for op in table.ops)
    assert calibrate.attention_op(model, calibrate.PREFILL_ATTENTION, torch.float32) is None


@pytest.mark.skipif(not native.qblock_usable(), reason="the blocks need the native kernel")
def test_a_bf16_model_on_quantized_blocks_still_chooses_its_attention(q4_1_gguf: str) -> None:
    """Its attention runs in bf16 like any bf16 model's: the choice is measured though no linear is bf16 (it was
    skipped when the model's dtype was read from its linears)."""
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    assert next(calibrate.matmul_weights(model), None) is None
    table = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: 1.0 if name == "dot" else 2.0)
    ops = {calibrate.attention_op(model, kind, BF16)
           for kind in (calibrate.PREFILL_ATTENTION, calibrate.DECODE_ATTENTION)}
    assert None not in ops and ops <= set(table.ops)
    assert {table.ops[op].kernel for op in ops} == ({"dot"} if native.bf16_dot_usable() else {"fp32"})


@pytest.mark.skipif(not native.qblock_usable(), reason="the blocks need the native kernel")
@pytest.mark.parametrize("winner", ["blocks", "blocks_amx", "fma"])
def test_blocks_or_their_dequantized_weights_by_measurement(q4_1_gguf: str, winner: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block-quantized shape (and the tied LM head) is an op whose candidates are its blocks (in the int8 kernel or,
    with AMX, dequantized tile by tile) and the bf16 paths over the dequantized weight; the winner is what the packed
    model runs: the blocks kept, or replaced by exactly their values in bf16 on the chosen kernel (the tied
    embedding's lookups read the same table)."""
    if winner not in calibrate.available(calibrate.QBLOCK_LINEAR):
        pytest.skip(f"{winner} does not run here")
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    if winner == "blocks_amx":  # a candidate where the dequantized weights do not fit (amx gives its bits otherwise)
        monkeypatch.setattr(calibrate, "_mem_available", lambda: 1)
    layers = list(calibrate.qblock_layers(model))
    head = model.logits_head()
    assert any(m is head for m in layers) and len(layers) == 1 + 4 * len(model.model.layers)  # qkv, o, gate_up, down
    before = {id(m): m.qblocks.dequantize()[:m.qblocks.n].bfloat16() for m in layers}
    timed: set[str] = set()

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        timed.add(name)
        return 1.0 if name == winner else 2.0

    table = calibrate.plan(model, 2, dtype=BF16, timer=timer)
    qops = {op for op in table.ops if op.startswith("qblock_linear:")}
    assert qops == {calibrate.qblock_op(m) for m in layers}
    assert {table.ops[op].kernel for op in qops} == {winner} and "blocks" in timed
    assert ("fma" in timed) == (winner != "blocks_amx") and ("blocks_amx" in timed) == (winner == "blocks_amx")
    model.pack_for_cpu(table)
    for m in layers:
        if winner.startswith("blocks"):
            assert m.qblocks is not None and m.qblocks.amx == (winner == "blocks_amx")
            continue
        assert m.qblocks is None and m.matmul is not None and m.matmul.kernel == "fma"
    if not winner.startswith("blocks"):
        x = torch.randn(3, head.hidden_size).bfloat16()
        torch.testing.assert_close(head.logits(x), (x.float() @ before[id(head)].float().T).bfloat16().float(),
                                   rtol=8e-3, atol=1e-2)
        ids = torch.tensor([0, 5, 299])
        embed = model.model.embed_tokens
        if model.lm_head is None:  # tied: the lookups read the same table, now plain bf16
            assert embed is head and torch.equal(head.weight, before[id(head)])
        assert torch.equal(embed(ids), (embed.qblocks.rows(ids) if embed.qblocks is not None else embed.weight[ids])
                           .bfloat16())


@pytest.mark.skipif(not native.qblock_amx_dot_usable(), reason="needs AMX-BF16, AVX512-BF16 and VBMI")
def test_amx_block_ops_measure_up_to_how_many_rows_the_blocks_stand_in(q4_1_gguf: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a block op's choice is amx, passes through the model's block layers time the blocks' dot products (the
    tiles' bits) against it by rows; the packed model keeps the blocks beside the dequantized weight for that many
    rows, its outputs are the tiles' at every row count, and the cached table brings the rows back."""
    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)  # cached, whatever else runs (CI's workers)
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    layers = list(calibrate.qblock_layers(model))
    passes: list[tuple[str, int]] = []

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        if name in (choice.FEW_ROWS_KERNEL, choice.REFERENCE):
            passes.append((name, rows))
            fn()  # the real kernels, on the model's own weights
            return 1.0 if (name == choice.FEW_ROWS_KERNEL) == (rows <= 2) else 2.0
        return 1.0 if name == "amx" else 2.0

    table = calibrate.plan(model, 2, dtype=BF16, timer=timer)
    qops = {calibrate.qblock_op(m) for m in layers}
    assert {(table.ops[op].kernel, table.ops[op].few_rows) for op in qops} == {("amx", 2)}
    assert max(rows for _, rows in passes) == 4 and set(table.ops[next(iter(qops))].few_timed) == {
        choice.REFERENCE, choice.FEW_ROWS_KERNEL}
    assert "<= 2 rows" in table.describe() and "weights read cold" in calibrate.report(table)
    assert table.as_dict()["few_rows"] == dict.fromkeys(sorted(qops), 2)  # bench throughput --json reports them
    head = model.logits_head()
    model.pack_for_cpu(table)
    for m in layers:
        assert m.qblocks is None and m.matmul.kernel == "amx" and m.matmul.few is not None and m.matmul.few[1] == 2
    blocks = head.matmul.few
    for rows in (1, 2, 3):
        x = torch.randn(rows, head.hidden_size).bfloat16()
        head.matmul.few = blocks
        got = head.logits(x)
        head.matmul.few = None
        assert torch.equal(got, head.logits(x))
    choice._measured.clear()  # a new process, the same model: the cache has the rows
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    again = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: pytest.fail("measured again"))
    assert again.reused and {again.ops[op].few_rows for op in qops} == {2}


def _blocks_tie_amx(passes: set[str], real: bool) -> choice.Timer:
    """A timer where the blocks and amx tie under choose's rule (the blocks faster up to 32 rows, amx above), the
    blocks' dot products standing in for amx win at 1-4 rows only (against the reference, slower), and the int8 tiles
    tie VNNI (so: from one row); any other candidate is far behind. The same-bits passes are recorded in passes and,
    where real, run (the real kernels, on the model's own weights)."""
    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        if name in (choice.FEW_ROWS_KERNEL, choice.REFERENCE):
            passes.add(name)
            if real:
                fn()
            if name == choice.REFERENCE:
                return 2.0
            return 1.0 if rows <= 4 else 3.0  # (even counts as the stand-in's: it must lose at 8)
        if name in (choice.VNNI, choice.AMX8):
            passes.add(name)
            return 1.0  # even: the tiles from one row, at the same time
        if name in ("blocks", "amx"):
            return 1.0 if (name == "blocks") == (rows <= 32) else 2.0
        return 3.0

    return timer


def _chosen_as_run(table: choice.ChoiceTable, model: torch.nn.Module, passes: set[str]) -> set[str]:
    """Checks the table _blocks_tie_amx leads to: the decoder's ops on amx with 4 few rows on the stand-in, both
    refinements measured (the blocks' kept for the report), the tied head (1-128 rows: two buckets above 32) on the
    blocks with the tiles from one row. The decoder's ops."""
    head = calibrate.qblock_op(model.logits_head())
    decoder = {calibrate.qblock_op(m) for m in calibrate.qblock_layers(model)} - {head}
    assert passes == {choice.FEW_ROWS_KERNEL, choice.REFERENCE, choice.VNNI, choice.AMX8}
    for op in decoder:
        c = table.ops[op]
        assert choice.best_across(c.seconds) == "blocks" and (c.kernel, c.few_rows, c.amx8_rows) == ("amx", 4, None)
        assert c.few_timed and c.amx8_timed and c.wide_rows is None
    assert (table.ops[head].kernel, table.ops[head].few_rows, table.ops[head].amx8_rows) == ("blocks", 0, 1)
    return decoder


@pytest.mark.skipif(not (native.qblock_amx_dot_usable() and native.qblock_amx8_usable()),
                    reason="needs AMX-BF16, AMX-INT8, AVX512-BF16 and VBMI")
def test_blocks_and_amx_are_chosen_between_as_their_plans_run(q4_1_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed plainly the blocks and amx tie on the decoder's ops, and the tie goes to the blocks; both refinements are
    then measured whatever won (on the real kernels), and with amx's 1-4 rows on the stand-in amx wins
    (_chosen_as_run). The packed model runs what the table says, and the cached table brings it back."""
    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)  # cached, whatever else runs (CI's workers)
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    passes: set[str] = set()
    table = calibrate.plan(model, 2, dtype=BF16, timer=_blocks_tie_amx(passes, real=True))
    decoder = _chosen_as_run(table, model, passes)
    model.pack_for_cpu(table)
    for m in calibrate.qblock_layers(model):
        if m is model.logits_head():
            assert m.qblocks is not None and m.qblocks.native.amx8_rows == 1
        else:
            assert m.qblocks is None and m.matmul.kernel == "amx" and m.matmul.few[1] == 4
    choice._measured.clear()  # a new process, the same model
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    again = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: pytest.fail("measured again"))
    assert again.reused and {again.ops[op].kernel for op in decoder} == {"amx"}


@pytest.mark.skipif(not native.qblock_usable(), reason="the blocks need the native kernel")
def test_the_choice_between_blocks_and_amx_as_run_on_any_cpu(q4_1_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same plan as above on a CPU of any kind: the AMX paths reported usable and no candidate run (their
    warm-ups and the fake timer call nothing), so CI's machines without AMX check the logic that only AMX machines
    run; the cached table brings the choice back."""
    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)
    for flag in ("amx_usable", "qblock_amx_usable", "qblock_amx_dot_usable", "qblock_amx8_usable", "qblock_vnni_usable",
                 "prefill_amx_usable", "w8a8_amx_usable"):
        monkeypatch.setattr(native, flag, lambda: True)
    for make in ("bf16_linear_candidates", "qblock_linear_candidates", "prefill_attention_candidates",
                 "decode_attention_candidates"):
        monkeypatch.setattr(calibrate, make, lambda *a, real=getattr(calibrate, make), **kw: [
            choice.Candidate(c.name, lambda rows: None) for c in real(*a, **kw)])
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    # as_run is told from how many rows the blocks' own times ran on the tiles: the weights' threshold as calibration
    # found it (the kernel's default), not the one it measures
    timed_from: set[int] = set()
    monkeypatch.setattr(calibrate, "as_run", lambda c, t, real=calibrate.as_run: timed_from.add(t) or real(c, t))
    default = next(calibrate.qblock_layers(model)).qblocks.native.amx8_rows
    passes: set[str] = set()
    table = calibrate.plan(model, 2, dtype=BF16, timer=_blocks_tie_amx(passes, real=False))
    assert timed_from == {default} and default > 1
    decoder = _chosen_as_run(table, model, passes)
    assert "amx (<= 4 rows: blocks_dot)" in table.describe() and "blocks (from 1 row: amx8)" in table.describe()
    choice._measured.clear()  # a new process, the same model
    again = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: pytest.fail("measured again"))
    assert again.reused and {(again.ops[op].kernel, again.ops[op].few_rows) for op in decoder} == {("amx", 4)}


@pytest.mark.skipif(not native.qblock_usable(), reason="the blocks need the native kernel")
def test_block_ops_are_timed_again_with_their_weights_read_from_memory(q4_1_gguf: str) -> None:
    """add_cold_times: after the hot timing (here the bf16 dot products over the dequantized weights win every
    bucket), every block layer runs in passes in the model's order, LM head last, on the blocks and on the packed
    kernels within PRUNE, at the buckets up to COLD_MAX_ROWS only; where the blocks win those, they are the choice.
    The kernels really run (on the model's own blocks, and each layer's dequantized weight)."""
    if not native.bf16_dot_usable():
        pytest.skip("needs the dot kernel to be a candidate")
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    layers = list(calibrate.qblock_layers(model))
    hot = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: 1.0 if name == "dot" else 2.5)
    qops = {calibrate.qblock_op(m) for m in layers}
    assert {hot.ops[op].kernel for op in qops} == {"dot"}
    calls: list[tuple[str, int]] = []
    ran: list[tuple[str, int]] = []  # (candidate, columns) in call order

    def cold(name: str, rows: int, fn: Callable[[], object]) -> float:
        calls.append((name, rows))
        out = fn()
        ran.append((name, out.shape[-1]))
        return 1.0 if name == "blocks" else 3.0

    table = calibrate.add_cold_times(model, hot, timer=cold)
    for op in qops:
        c = table.ops[op]
        assert c.kernel == "blocks" and c.cold_rows == calibrate.COLD_MAX_ROWS
        cold_i = [i for i, r in enumerate(c.rows) if r <= calibrate.COLD_MAX_ROWS]
        assert all(c.seconds["blocks"][i] == 1.0 and c.seconds["dot"][i] == 3.0 for i in cold_i)
        warm = [i for i, r in enumerate(c.rows) if r > calibrate.COLD_MAX_ROWS]
        assert all(c.seconds[n][i] == hot.ops[op].seconds[n][i] for n in c.seconds for i in warm)
    assert {r for _, r in calls} == {b for b in choice.ROW_BUCKETS if b <= calibrate.COLD_MAX_ROWS}
    # within PRUNE of dot's 1.0: every candidate at 2.5 is out but the blocks, which always run
    assert {n for n, _ in calls} == {"blocks", "dot"}
    head_cols = model.logits_head().qblocks.n
    first_pass = ran[:len(layers)]
    assert [n for n, _ in first_pass] == ["blocks"] * len(layers) and first_pass[-1][1] == head_cols
    assert "*" in calibrate.report(table) and "weights read from memory" in calibrate.report(table)
    # pinned ops and other kinds are left as they were
    pinned = dataclasses.replace(hot, ops={op: choice.pinned("dot") for op in hot.ops})
    calls.clear()
    assert calibrate.add_cold_times(model, pinned, timer=cold) == pinned and calls == []


def _tiles_win_from_64(calls: list[tuple[str, int]], others: Callable[[str], float]) -> choice.Timer:
    """A timer for the int8 tiles' thresholds: VNNI and the AMX-INT8 tiles each run the real kernel (recorded in
    calls) and the tiles win alone at 8 rows, lose at 16 and 32, and win from 64 (so: from 64); any other candidate
    takes others(name)."""
    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        if name in (choice.VNNI, choice.AMX8):
            calls.append((name, rows))
            fn()
            wins = rows >= 64 or rows == 8
            return 1.0 if (name == choice.AMX8) == wins else 2.0
        return others(name)

    return timer


def test_timed_caches_are_filled_with_a_repeated_random_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """random_bf16: the shape and dtype asked for, normal values, one run repeated (drawing them all was most of decode
    attention's calibration), whose odd length keeps any two 64-token blocks of a timed cache apart."""
    monkeypatch.setattr(calibrate, "RANDOM_RUN", 10_007)
    shape = (3, 2, 8, 64, 3, 64)  # layers, K/V, blocks, block size, KV heads, head_dim: 3 runs and more
    x = calibrate.random_bf16(shape, torch.Generator().manual_seed(0))
    assert x.shape == shape and x.dtype == torch.bfloat16 and x.is_contiguous()
    flat = x.flatten().float()
    assert torch.equal(flat[:10_007], flat[10_007:20_014]) and 0.9 < flat.std() < 1.1 and abs(flat.mean()) < 0.05
    blocks = x.flatten(0, 2).flatten(1)
    assert len({tuple(b[:8].tolist()) for b in blocks}) == len(blocks)
    small = calibrate.random_bf16((5, 7), torch.Generator().manual_seed(0))
    assert small.shape == (5, 7) and len(set(small.flatten().tolist())) > 30


def test_a_lone_slower_bucket_of_two_same_bits_paths_is_timed_again() -> None:
    """_time_same_bits: the bucket that alone would set the threshold is timed again (both paths, a warm-up and the
    rounds); one disturbed first time turns, and the next lone one below is looked at in turn, while a slow bucket
    that is real stays, timed twice. Runs of losses below the threshold are not timed again."""
    buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

    def timing(slower: dict[int, int]) -> tuple[list[tuple[str, int]], choice.Timer]:
        """A timer where WIDE wins from 16 rows but at `slower`'s buckets for their given number of looks."""
        calls: list[tuple[str, int]] = []

        def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
            calls.append((name, rows))
            looks = sum(1 for n, r in calls if (n, r) == (name, rows)) - 1  # this path's calls here before this one
            if name == choice.NARROW:
                return 1.0
            return 2.0 if rows < 16 or looks < 4 * slower.get(rows, 0) else 0.5

        return calls, timer

    def run(slower: dict[int, int]) -> tuple[int, list[tuple[str, int]]]:
        calls, timer = timing(slower)
        timed = calibrate._time_same_bits(8, torch.float32, timer, 3, lambda x, name: lambda: None,
                                          (choice.NARROW, choice.WIDE), buckets)
        return choice.from_rows(buckets, timed[choice.NARROW], timed[choice.WIDE]), calls

    rows, calls = run({})
    assert rows == 16 and len(calls) == len(buckets) * 2 * 4  # nothing lone: every bucket once
    rows, calls = run({256: 1})  # disturbed through 256's rounds once: turns on the second look
    assert rows == 16 and calls.count((choice.WIDE, 256)) == 8 and len(calls) == (len(buckets) + 1) * 2 * 4
    rows, calls = run({512: 1, 128: 1})  # the largest first, then 128 once it is the lone one
    assert rows == 16 and calls.count((choice.WIDE, 512)) == calls.count((choice.WIDE, 128)) == 8
    rows, calls = run({256: 9})  # slower however often it is timed: real, kept, looked at once
    assert rows == 512 and calls.count((choice.WIDE, 256)) == 8 and len(calls) == (len(buckets) + 1) * 2 * 4
    rows, calls = run({64: 9, 32: 9})  # a run of two: a threshold, not a disturbance
    assert rows == 128 and calls.count((choice.WIDE, 64)) == 4 and calls.count((choice.WIDE, 32)) == 4


def _same_bits_past_the_threshold(layers: list, field: str, rows: int, never: int, batches: tuple[int, ...]) -> None:
    """Each packed layer's blocks took the measured threshold (QBlockWeight.<field> == rows), and its outputs at each
    batch size equal those with the threshold at `never` bit for bit."""
    gen = torch.Generator().manual_seed(1)
    for m in layers:
        assert getattr(m.qblocks.native, field) == rows
        for batch in batches:
            x = torch.randn(batch, m.qblocks.k, generator=gen).bfloat16()
            got = native.qblock_linear(x, m.qblocks.native, None)
            setattr(m.qblocks.native, field, never)
            assert torch.equal(got, native.qblock_linear(x, m.qblocks.native, None)), (field, batch)
            setattr(m.qblocks.native, field, rows)


@pytest.mark.skipif(not native.qblock_amx8_usable(), reason="needs AVX512-VNNI and AMX-INT8")
def test_blocks_ops_measure_from_how_many_rows_their_int8_activations_run_on_the_tiles(
        q4_1_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a block op's choice is blocks, its first layer is timed with VNNI alone and with the AMX-INT8 tiles at
    every bucket; the tiles run from the smallest bucket from which they never lost (both give the same bits), the
    packed model's weights take that threshold, and the cached table brings it back."""
    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)  # cached, whatever else runs (CI's workers)
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    layers = [m for m in calibrate.qblock_layers(model) if m.qblocks.group != 16]
    assert layers
    calls: list[tuple[str, int]] = []
    timer = _tiles_win_from_64(calls, lambda name: 1.0 if name == "blocks" else 2.0)
    table = calibrate.plan(model, 2, dtype=BF16, timer=timer)
    qops = {calibrate.qblock_op(m) for m in layers}
    assert {(table.ops[op].kernel, table.ops[op].amx8_rows) for op in qops} == {("blocks", 64)}
    assert {rows for _, rows in calls} == set(choice.AMX8_BUCKETS)
    assert len(calls) == len(qops) * len(choice.AMX8_BUCKETS) * 2 * 4  # a warm-up and 3 calls each, per op
    assert "from 64 rows: amx8" in table.describe() and "int8 activations" in calibrate.report(table)
    assert table.as_dict()["amx8_rows"] == dict.fromkeys(sorted(qops), 64)  # bench throughput --json reports them
    model.pack_for_cpu(table)
    _same_bits_past_the_threshold(layers, "amx8_rows", 64, calibrate.AMX8_NEVER, (16, 63, 64, 80))  # VNNI alone
    choice._measured.clear()  # a new process, the same model: the cache has the threshold
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    again = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: pytest.fail("measured again"))
    assert again.reused and {again.ops[op].amx8_rows for op in qops} == {64}
    model.pack_for_cpu(again)
    assert {m.qblocks.native.amx8_rows for m in calibrate.qblock_layers(model) if m.qblocks.group != 16} == {64}


@pytest.mark.skipif(not native.qblock_vnni_usable(), reason="needs AVX512-VNNI")
def test_blocks_ops_measure_from_how_many_rows_their_codes_are_widened_once(
        q4_1_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a block op's choice is blocks, its first layer is timed with each register tile unpacking its codes and
    with each work unit's widened once, at its buckets (here the AMX-INT8 tiles, where they run, never win: every
    bucket); the widened codes run from the smallest bucket from which they never lost (a lone win at 8 rows does not
    count), the packed model's weights take that threshold with the same outputs, the cached table brings it back, and
    a pin leaves the kernel's default (never)."""
    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)  # cached, whatever else runs (CI's workers)
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    layers = list(calibrate.qblock_layers(model))
    calls: list[tuple[str, int]] = []

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        if name in (choice.NARROW, choice.WIDE):
            calls.append((name, rows))
            fn()  # the real kernel on the path being timed
            return 1.0 if (name == choice.WIDE) == (rows >= 64 or rows == 8) else 2.0
        if name in (choice.VNNI, choice.AMX8):
            return 1.0 if name == choice.VNNI else 2.0
        return 1.0 if name == "blocks" else 2.0

    table = calibrate.plan(model, 2, dtype=BF16, timer=timer)
    qops = {calibrate.qblock_op(m) for m in layers}
    assert {(table.ops[op].kernel, table.ops[op].wide_rows) for op in qops} == {("blocks", 64)}
    for op in qops:
        c = table.ops[op]
        assert {name: len(v) for name, v in c.wide_timed.items()} == dict.fromkeys((choice.NARROW, choice.WIDE),
                                                                                 len(c.rows))
    assert len(calls) == sum(len(table.ops[op].rows) for op in qops) * 2 * 4  # a warm-up and 3 calls each, per op
    assert "from 64 rows: wide" in table.describe() and "codes widened once" in calibrate.report(table)
    assert table.as_dict()["wide_rows"] == dict.fromkeys(sorted(qops), 64)  # bench throughput --json reports them
    model.pack_for_cpu(table)
    _same_bits_past_the_threshold(layers, "wide_rows", 64, calibrate.WIDE_NEVER, (8, 63, 64, 300))
    choice._measured.clear()  # a new process, the same model: the cache has the threshold
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    again = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: pytest.fail("measured again"))
    assert again.reused and {again.ops[op].wide_rows for op in qops} == {64}
    model.pack_for_cpu(again)
    assert {m.qblocks.native.wide_rows for m in calibrate.qblock_layers(model)} == {64}
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    pinned = calibrate.plan(model, 2, "qblock_linear=blocks", dtype=BF16, timer=timer)
    assert {pinned.ops[op].wide_rows for op in qops} == {None}
    model.pack_for_cpu(pinned)
    assert {m.qblocks.native.wide_rows for m in calibrate.qblock_layers(model)} == {calibrate.WIDE_NEVER}


@pytest.mark.skipif(not native.qblock_usable(), reason="the blocks need the native kernel")
def test_blocks_stay_where_their_dequantized_weights_would_not_fit(q4_1_gguf: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the blocks are timed (and kept) where the dequantized weights would take more than DEQUANTIZE_SHARE of the
    memory available."""
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    layers = list(calibrate.qblock_layers(model))
    extra = sum(2 * m.qblocks.n * m.qblocks.k - m.qblocks.nbytes for m in layers)
    enough = int(extra / calibrate.DEQUANTIZE_SHARE)
    assert calibrate.dequantize_fits(layers, enough + 1) and not calibrate.dequantize_fits(layers, enough - 1)
    # a table measured where they fitted (fma won) is not reused where they do not
    monkeypatch.setattr(calibrate, "_mem_available", lambda: enough + 1)
    fitted = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: 1.0 if name == "fma" else 2.0)
    assert {fitted.ops[calibrate.qblock_op(m)].kernel for m in layers} == {"fma"}
    monkeypatch.setattr(calibrate, "_mem_available", lambda: enough - 1)
    table = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: 1.0)
    assert not table.reused
    for op in {calibrate.qblock_op(m) for m in layers}:
        assert table.ops[op].kernel == "blocks" and set(table.ops[op].seconds) <= {"blocks", "blocks_amx"}


def test_a_candidate_whose_rows_change_with_the_batch_is_left_out() -> None:
    """batch_invariant: a row's result must not depend on the rows beside it; our kernels pass, a batch-dependent one
    does not (as oneDNN's AMX matmul did)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=gen).bfloat16()
    assert calibrate.batch_invariant(lambda x: native.bf16_gemm(x, native.bf16_pack(w), 24, None), 64, gen)
    assert not calibrate.batch_invariant(lambda x: x.float() @ w.float().T + x.shape[0] * 1e-3, 64, gen)


@pytest.mark.skipif(not native.bf16_dot_usable(), reason="the dot path needs AVX512-BF16")
@pytest.mark.parametrize("pin", ["dot", "fp32"])
@pytest.mark.parametrize("op,kernel,steps", [("prefill_attention", "prefill_attention", 1),
                                             ("decode_attention", "paged_decode", 2)])
@pytest.mark.parametrize("weights", ["bf16", "q4_1_blocks"])
def test_the_steps_attention_choice_reaches_the_kernel(tiny_model_dir: Callable[[str], str], pin: str, op: str,
                                                       kernel: str, steps: int, weights: str, request,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill step and two decode steps (3 tokens): each of the kind's steps calls its kernel in every layer with
    the pinned path (prefill: its name; decode: its dot flag), whether the linears are bf16 or quantized blocks. (amx
    takes head_dim 32 and up: tests/engine/test_decoder_stack.py pins it on such a model.)"""
    path = tiny_model_dir("llama") if weights == "bf16" else request.getfixturevalue("q4_1_gguf")
    monkeypatch.setenv("LLMSERVE_DECODER_STACK", "0")  # the Python layers call the kernels through native
    seen: list[object] = []
    real = getattr(native, kernel)

    def spy(*a: object, **k: object) -> object:
        seen.append(bool(k["dot"]) if "dot" in k else a[-1])
        return real(*a, **k)

    monkeypatch.setattr(native, kernel, spy)
    config = EngineConfig(dtype="bfloat16", num_blocks=64, kernel_choice=f"{op}={pin}")
    with pipeline(path, backend_config=config) as pipe:
        out = pipe([{"input_ids": list(range(3, 40))}], gen_config=GenerationConfig(max_new_tokens=3, temperature=0),
                   do_preprocess=False)
    assert len(out[0].token_ids) == 3
    assert seen == [pin if op == "prefill_attention" else pin == "dot"] * (steps * len(pipe_layers(path)))


def pipe_layers(path: str) -> list:
    return load_model(path, EngineConfig(dtype="bfloat16")).model.attention_layers()


def test_plan_times_real_kernels_when_asked(bf16_model) -> None:
    """The real timer on real candidates (a smoke run: every op gets a winner among what runs here)."""
    with torch.inference_mode():
        table = calibrate.plan(bf16_model, torch.get_num_threads(), dtype=BF16)
    for op, c in table.ops.items():
        kind = op.partition(":")[0]
        assert c.kernel in calibrate.available(kind) and all(len(t) == len(c.rows) for t in c.seconds.values())
    assert "rows" in calibrate.report(table)


def test_row_buckets_follow_the_engines_limits() -> None:
    assert calibrate.row_buckets(2048) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert calibrate.row_buckets(100)[-1] == 128 and calibrate.row_buckets(1) == (1,) == calibrate.row_buckets(0)
    assert calibrate.row_buckets(10 ** 6)[-1] == calibrate.MAX_BUCKET_ROWS
    assert calibrate.row_limits(EngineConfig()) == calibrate.RowLimits(linear=2048, head=128)
    limits = calibrate.row_limits(EngineConfig(max_batch_size=16, max_prefill_token_num=512, speculative_method="ngram",
                                               num_speculative_tokens=3))
    assert limits == calibrate.RowLimits(linear=512, head=64)  # each request's 3 drafts and its own token


def test_each_op_is_timed_at_the_rows_the_engine_gives_it(bf16_model) -> None:
    """Decoder linears up to the step's token budget, the LM head up to the rows it samples; a table timed for other
    limits is not reused."""
    seen: dict[int, set[int]] = {}  # a linear candidate's output columns -> the rows it was timed at

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        out = fn()
        if isinstance(out, torch.Tensor) and out.dim() == 2:  # a linear candidate (attention's give [T, H, D])
            seen.setdefault(out.shape[-1], set()).add(rows)
        return 1.0

    limits = calibrate.RowLimits(linear=1024, head=32)
    table = calibrate.plan(bf16_model, 2, dtype=BF16, timer=timer, rows=limits)
    heads = calibrate.head_ops(bf16_model)
    assert len(heads) == 1  # the tied embedding's table
    vocab = bf16_model.logits_head().weight.shape[0]
    assert seen.pop(vocab) == set(calibrate.row_buckets(32))
    assert seen and all(r == set(calibrate.row_buckets(1024)) for r in seen.values())
    for op, c in table.ops.items():
        if op.startswith(calibrate.BF16_LINEAR):
            assert c.rows == calibrate.row_buckets(32 if op in heads else 1024), op
    calls = []
    again = calibrate.plan(bf16_model, 2, dtype=BF16, timer=lambda n, r, fn: calls.append(r) or 1.0, rows=limits)
    assert again.reused and not calls
    other = calibrate.plan(bf16_model, 2, dtype=BF16, timer=lambda n, r, fn: 1.0,
                           rows=calibrate.RowLimits(linear=256, head=32))
    assert not other.reused
    assert {c.rows[-1] for op, c in other.ops.items() if op.startswith(calibrate.BF16_LINEAR) and op not in heads} == {256}


def test_batch_invariance_is_checked_up_to_the_largest_bucket() -> None:
    """A library kernel whose rows change only in batches over 512 rows passes a 512-row check and fails one at the
    2,048 rows it would be timed and run at; one whose rows change over 100 rows fails at the LM head's 128 rows, and
    one whose rows change over 128 passes there (the head never runs such a batch)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=gen)

    def differ_over(m: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: (x.float() @ w.T + (1e-3 if x.shape[0] > m else 0.0)).bfloat16()

    assert calibrate.batch_invariant(differ_over(512), 64, gen)
    assert not calibrate.batch_invariant(differ_over(512), 64, gen, rows=2048)
    assert not calibrate.batch_invariant(differ_over(100), 64, gen, rows=128)
    assert calibrate.batch_invariant(differ_over(128), 64, gen, rows=128)
    assert calibrate.batch_invariant(differ_over(0), 64, gen, rows=1)  # one row: nothing to compare it with


def test_a_batch_dependent_library_kernel_is_not_a_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16_linear_candidates leaves out onednn where its rows' results change with the batch (as oneDNN's AMX matmul's
    did), keeps it where they do not, and bench's peak (invariant_only=False) times it either way."""
    from llmserve.layers import linear as lin

    if "onednn" not in calibrate.available(calibrate.BF16_LINEAR):
        pytest.skip("onednn does not run here")
    steady = lambda x, b, bias: x.float().matmul(torch.ones(64, 24)).bfloat16()  # noqa: E731
    monkeypatch.setattr(lin, "onednn_linear", steady)
    assert [c.name for c in calibrate.bf16_linear_candidates(24, 64, ("onednn",))] == ["onednn"]
    monkeypatch.setattr(lin, "onednn_linear", lambda x, b, bias: steady(x, b, bias) + x.shape[0])
    assert calibrate.bf16_linear_candidates(24, 64, ("onednn",)) == []
    assert [c.name for c in calibrate.bf16_linear_candidates(24, 64, ("onednn",), invariant_only=False)] == ["onednn"]


def test_an_op_nothing_may_run_keeps_its_default_path_and_the_model_still_serves(
        tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native kernels did not build, only torch's paths are left, and a CPU may give neither of them
    batch-invariant rows (this Xeon's oneDNN and fp32 both failed the check): the start must go on with the default
    path, not fail with "choose needs at least one candidate" (it did, after a build lost its lock)."""
    monkeypatch.setattr(calibrate, "available", lambda kind: ("onednn", "fp32") if "linear" in kind else ())
    monkeypatch.setattr(calibrate, "batch_invariant", lambda run, k, gen, rows=512: False)
    warnings: list[str] = []
    monkeypatch.setattr(calibrate.log, "warning", lambda msg, *args: warnings.append(msg % args))
    path = tiny_model_dir("llama")
    table = calibrate.plan(load_model(path, EngineConfig(dtype="bfloat16")).model, 2, dtype=BF16,
                           timer=lambda name, rows, fn: 1.0)
    assert table is not None and table.ops == {}
    assert warnings and all("keeps its default path" in w for w in warnings)
    with pipeline(path, backend_config=EngineConfig(dtype="bfloat16", num_blocks=64)) as pipe:
        out = pipe([{"input_ids": list(range(3, 20))}], gen_config=GenerationConfig(max_new_tokens=3, temperature=0),
                   do_preprocess=False)
    assert len(out[0].token_ids) == 3


def test_the_cache_key_names_what_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table measured while only torch's paths ran (the extension failed to build) is not reused once ours run."""
    full = calibrate.key(["bf16_linear:8x8"], 2)
    monkeypatch.setattr(calibrate, "available", lambda kind: ("onednn", "fp32"))
    assert calibrate.key(["bf16_linear:8x8"], 2) != full


@pytest.mark.skipif(not native.w8a8_amx_usable(), reason="needs AVX512-VNNI and AMX-INT8")
def test_w8a8_ops_measure_from_how_many_rows_they_run_on_the_tiles(tiny_model_dir: Callable[[str], str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each w8a8 op's first layer is timed with VNNI alone and with the AMX-INT8 tiles at every bucket; the tiles run
    from the smallest bucket from which they never lost (the same bits either way), every layer of the op takes that
    threshold, and the cached table brings it back. Pins replace it: vnni never takes the tiles, amx8 always does."""
    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)  # cached, whatever else runs (CI's workers)
    config = EngineConfig(dtype="bfloat16", quantization="w8a8")
    model = load_model(tiny_model_dir("llama"), config).model
    layers = [m for m in model.modules() if calibrate.w8a8_op(m) is not None]
    assert layers and all(m.amx8_rows == -1 for m in layers)  # the kernel's default until measured
    ops = {calibrate.w8a8_op(m) for m in layers}
    calls: list[tuple[str, int]] = []
    table = calibrate.plan(model, 2, dtype=BF16, timer=_tiles_win_from_64(calls, lambda name: 1.0))
    assert {(table.ops[op].kernel, table.ops[op].amx8_rows) for op in ops} == {(choice.VNNI, 64)}
    assert {rows for _, rows in calls} == set(choice.AMX8_BUCKETS)
    # a warm-up and 3 calls each, per op, and for the int8 LM head's op (int8w_linear: weight-only, the same way)
    assert len(calls) == (len(ops) + 1) * len(choice.AMX8_BUCKETS) * 2 * 4
    assert "vnni (from 64 rows: amx8)" in table.describe() and "int8 activations" in calibrate.report(table)
    head = calibrate.int8w_op(model.logits_head())
    assert table.as_dict()["amx8_rows"] == dict.fromkeys(sorted(ops | {head}), 64)  # bench throughput --json reports
    model.pack_for_cpu(table)
    assert {m.amx8_rows for m in layers} == {64}
    choice._measured.clear()  # a new process, the same model: the cache has the threshold
    model = load_model(tiny_model_dir("llama"), config).model
    again = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: pytest.fail("measured again"))
    assert again.reused and {again.ops[op].amx8_rows for op in ops} == {64}
    model.pack_for_cpu(again)
    assert {m.amx8_rows for m in model.modules() if calibrate.w8a8_op(m)} == {64}
    for pin, rows in (("vnni", 0), ("amx8", 1)):
        model = load_model(tiny_model_dir("llama"), config).model
        table = calibrate.plan(model, 2, f"w8a8_linear={pin}", dtype=BF16,
                               timer=lambda name, rows, fn: 1.0 if name not in (choice.VNNI, choice.AMX8)
                               else pytest.fail("a pinned op was measured"))
        model.pack_for_cpu(table)
        assert {m.amx8_rows for m in model.modules() if calibrate.w8a8_op(m)} == {rows}, pin


def test_w8a8_ops_are_not_measured_without_amx(tiny_model_dir: Callable[[str], str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has no AMX-INT8, VNNI is the w8a8 layers' only path: nothing to time, and an amx8 pin is refused."""
    if not native.w8a8_usable():
        pytest.skip("w8a8 needs AVX-512 with VNNI")
    monkeypatch.setattr(native, "w8a8_amx_usable", lambda: False)
    model = load_model(tiny_model_dir("llama"), EngineConfig(dtype="bfloat16", quantization="w8a8")).model
    table = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: 1.0)
    assert table is None or not any(op.startswith("w8a8_linear:") for op in table.ops)
    with pytest.raises(InvalidRequestError, match="cannot run on this machine"):
        calibrate.plan(model, 2, "w8a8_linear=amx8", dtype=BF16, timer=lambda name, rows, fn: 1.0)


def test_a_w8a8_models_int8_head_is_not_timed_as_a_bf16_matmul(tiny_model_dir: Callable[[str], str]) -> None:
    """w8a8 gives the LM head int8 weights; a tied embedding keeps its bf16 table for the lookup only, so no bf16_linear
    choice is measured for it (nothing would use one)."""
    if not native.w8a8_usable():
        pytest.skip("w8a8 needs AVX-512 with VNNI")
    model = load_model(tiny_model_dir("llama-tied"), EngineConfig(dtype="bfloat16", quantization="w8a8")).model
    head = model.logits_head()
    assert head.head_int8_packed is not None and head.weight is not None  # int8 logits, bf16 lookups
    assert not any(w is head.weight for w in calibrate.matmul_weights(model))
    table = calibrate.plan(model, 2, dtype=BF16, timer=lambda name, rows, fn: 1.0)
    vocab = f"bf16_linear:{head.weight.shape[0]}x{head.weight.shape[1]}"
    assert table is None or vocab not in table.ops


@pytest.mark.skipif(not (native.int8w_a16_usable() and native.w8a8_amx_usable()), reason="needs VNNI and AMX-INT8")
@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_weight_only_int8_ops_measure_from_how_many_rows_they_run_on_the_tiles(
        quantization: str, tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight-only int8 on the packed kernel (every linear and the LM head with --quantization int8; w8a8's LM head)
    takes the same threshold as w8a8's layers: each op's first layer timed on VNNI alone and on the tiles (16-bit x as
    two int8 products, the same bits), every layer of the op (and the head) takes it, and pins replace it."""
    from llmserve.layers.linear import Linear

    monkeypatch.setattr(choice, "others_busy", lambda before, after: None)
    config = EngineConfig(dtype="bfloat16", quantization=quantization)

    def thresholds(model) -> set[int]:  # the linears' and the LM head's (an untied embedding is only looked up)
        return {m.amx8_rows for m in model.modules() if isinstance(m, Linear) and calibrate.int8w_op(m)} | {
            model.logits_head().amx8_rows}

    model = load_model(tiny_model_dir("llama"), config).model
    ops = {calibrate.int8w_op(m) for m in model.modules()} - {None}
    head = calibrate.int8w_op(model.logits_head())
    assert head in ops and (len(ops) > 1) == (quantization == "int8")  # w8a8's decoder layers are w8a8 ops
    assert thresholds(model) == {-1}  # the kernel's default until measured
    calls: list[tuple[str, int]] = []
    table = calibrate.plan(model, 2, dtype=BF16, timer=_tiles_win_from_64(calls, lambda name: 1.0))
    assert {(table.ops[op].kernel, table.ops[op].amx8_rows) for op in ops} == {(choice.VNNI, 64)}
    model.pack_for_cpu(table)
    assert thresholds(model) == {64}
    for pin, rows in (("vnni", 0), ("amx8", 1)):
        model = load_model(tiny_model_dir("llama"), config).model
        table = calibrate.plan(model, 2, f"int8w_linear={pin}", dtype=BF16, timer=lambda name, rows, fn: 1.0)
        model.pack_for_cpu(table)
        assert thresholds(model) == {rows}, pin
