"""An fp32 model's block-quantized ops (a GGUF's blocks where the compute dtype is fp32: CPUs without AVX512-BF16)
choose per op between the int8-activation kernel and fp32 FMAs on the codes (kernels/calibrate.py's blocks and
blocks_fma): a fake timer decides, the packed model runs what was chosen for every batch size, pins are not
measured. No timing is asserted."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from llmserve import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.kernels import calibrate, native
from llmserve.models.loader import load_model

pytestmark = [pytest.mark.skipif(not (native.qblock_int8_usable() and native.qblock_fma_usable()),
                                 reason="needs both of the block kernel's paths (AVX-512 with VNNI, or AVX2)"),
              pytest.mark.usefixtures("fresh_tuning_cache")]  # (conftest.py)


def _fp32_model_on_blocks(path: str) -> torch.nn.Module:
    loaded = load_model(path, EngineConfig())
    if loaded.dtype != torch.float32:
        pytest.skip(f"the default dtype here is {loaded.dtype}: the blocks' fp32 choice is an fp32 model's")
    return loaded.model


def test_each_block_op_runs_the_path_measured_faster(q4_1_gguf: str) -> None:
    model = _fp32_model_on_blocks(q4_1_gguf)
    head = model.logits_head()
    layers = list(calibrate.qblock_layers(model))
    assert any(m is head for m in layers)
    head_op = calibrate.qblock_op(head)
    timed: dict[str, set[str]] = {}

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        fn()  # (each candidate runs: a path that fails fails the test)
        timed.setdefault(name, set()).add(rows)
        return 1.0 if (name == "blocks_fma") == (rows >= 64) else 2.0  # int8 up to 32 rows, FMAs from 64

    rows = calibrate.RowLimits(linear=256, head=128)
    table = calibrate.plan(model, 2, dtype=torch.float32, timer=timer, rows=rows)
    qops = {op for op in table.ops if op.startswith(calibrate.QBLOCK_LINEAR + ":")}
    assert qops == {calibrate.qblock_op(m) for m in layers}
    assert set(timed) == {"blocks", "blocks_fma"}  # never a bf16 copy of an fp32 model's weights
    # one path per op for every batch (each batch size counts alike): the head's buckets 1-128 are 6 against 2, the
    # linears' 1-256 6 against 3
    for op in qops:
        assert table.ops[op].kernel == "blocks", op
    model.pack_for_cpu(table)
    assert all(m.qblocks is not None and not m.qblocks.native.fma for m in layers)

    def favour_fma(name: str, rows: int, fn: Callable[[], object]) -> float:
        return 1.0 if name == "blocks_fma" and rows >= 8 else 2.0 if name == "blocks_fma" else 1.5

    model = _fp32_model_on_blocks(q4_1_gguf)
    table = calibrate.plan(model, 2, dtype=torch.float32, timer=favour_fma, rows=rows, remeasure=True)
    assert {table.ops[op].kernel for op in qops} == {"blocks_fma"}
    model.pack_for_cpu(table)
    head = model.logits_head()
    for m in calibrate.qblock_layers(model):
        assert m.qblocks.native.fma
    # the packed model computes what the chosen path gives, whatever the batch
    x = torch.randn(5, head.hidden_size)
    want = native.qblock_linear(x, head.qblocks.native, None, vnni=0)
    got = head.logits(x)
    assert torch.equal(got, want)
    assert torch.equal(head.logits(x[3:4]), got[3:4])
    assert not torch.equal(got, native.qblock_linear(x, head.qblocks.native, None, vnni=1))
    assert head_op in table.ops


def test_a_pinned_block_path_is_not_measured(q4_1_gguf: str) -> None:
    model = _fp32_model_on_blocks(q4_1_gguf)

    def never(name: str, rows: int, fn: Callable[[], object]) -> float:
        raise AssertionError(f"{name} was timed though pinned")

    table = calibrate.plan(model, 2, "qblock_linear=blocks_fma", dtype=torch.float32, timer=never)
    qops = [op for op in table.ops if op.startswith(calibrate.QBLOCK_LINEAR + ":")]
    assert qops and all(table.ops[op].kernel == "blocks_fma" and table.ops[op].pinned for op in qops)
    model.pack_for_cpu(table)
    assert all(m.qblocks.native.fma for m in calibrate.qblock_layers(model))
    with pytest.raises(InvalidRequestError, match="an fp32 model's blocks run blocks or blocks_fma"):
        calibrate.plan(model, 2, "qblock_linear=fp32", dtype=torch.float32, timer=never)


def test_a_bf16_model_does_not_time_the_fp32_path(q4_1_gguf: str) -> None:
    """A bf16 model's block ops keep their candidates (the blocks, and the bf16 paths over the dequantized weights)."""
    if not native.bf16_dot_usable() and not native.packed_gemm_usable():
        pytest.skip("bf16 models run their blocks' candidates on AVX-512")
    model = load_model(q4_1_gguf, EngineConfig(dtype="bfloat16")).model
    timed: set[str] = set()

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        timed.add(name)
        return 1.0

    calibrate.plan(model, 2, dtype=torch.bfloat16, timer=timer)
    assert "blocks" in timed and "blocks_fma" not in timed
