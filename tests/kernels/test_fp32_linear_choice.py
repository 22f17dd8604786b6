"""An fp32 model's linears choose between fp32_gemm (packed weights, AVX2 FMAs) and oneDNN by measurement
(kernels/calibrate.py, fp32_linear): a fake timer decides, the layers keep only the chosen form, pins and refusals.
No timing is asserted."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from llmserve import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.kernels import calibrate, native
from llmserve.kernels.choice import pinned
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear
from llmserve.models.loader import load_model

pytestmark = [pytest.mark.skipif(not native.fp32_gemm_usable() or not torch.backends.mkldnn.is_available(),
                                reason="needs the extension on a CPU with AVX2 and FMA, and oneDNN"),
              pytest.mark.usefixtures("fresh_tuning_cache")]  # (conftest.py)

FP32 = torch.float32


@pytest.fixture
def fp32_model(tiny_model_dir: Callable[[str], str]):
    return load_model(tiny_model_dir("llama-tied"), EngineConfig(dtype="float32")).model


def _linear_ops(model) -> set[str]:
    return {calibrate.op_name(w) for w in calibrate.matmul_weights(model)}


@pytest.mark.parametrize("faster", ["fma", "onednn"])
def test_the_faster_path_is_chosen_and_the_layers_keep_only_its_form(fp32_model, faster: str) -> None:
    """Every fp32 matmul (the linears and the tied LM head) is an fp32_linear op, timed at every bucket; the faster
    candidate wins; packing leaves each layer one copy of its weight in the chosen form, and the model's logits
    follow the plain weights'."""
    calls: list[tuple[str, int]] = []

    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        calls.append((name, rows))
        return 1.0 if name == faster else 2.0

    ops = _linear_ops(fp32_model)
    assert ops and all(op.startswith("fp32_linear:") for op in ops)
    head = fp32_model.logits_head()
    plain = {id(m): m.weight.detach().clone() for m in fp32_model.modules() if isinstance(m, Linear)}
    plain_head = head.weight.detach().clone()
    table = calibrate.plan(fp32_model, 2, dtype=FP32, timer=timer)
    assert set(table.ops) == ops
    assert {c.kernel for c in table.ops.values()} == {faster}
    assert {rows for name, rows in calls if name == "fma"} >= {1, 2048}  # a decoder linear's buckets
    assert "fp32_linear" in calibrate.report(table)
    fp32_model.pack_for_cpu(table)
    for m in fp32_model.modules():
        if isinstance(m, Linear):
            assert m.weight is None and m.packed is None and m.matmul.kernel == faster
            assert m.matmul.weight.dim() == (4 if faster == "fma" else 2)
            x = torch.randn(5, m.in_features)
            want = x @ plain[id(m)].T + (m.bias if m.bias is not None else 0)
            torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    assert head.matmul.kernel == faster and head.weight is not None  # tied: the lookup keeps the plain table
    h = torch.randn(3, head.hidden_size)
    torch.testing.assert_close(head.logits(h), h @ plain_head.T, rtol=1e-5, atol=1e-5)


def test_a_pin_replaces_the_measurement_and_a_bad_one_is_refused(fp32_model) -> None:
    def timer(name: str, rows: int, fn: Callable[[], object]) -> float:
        raise AssertionError("a pinned op is not timed")

    table = calibrate.plan(fp32_model, 2, "fp32_linear=onednn", dtype=FP32, timer=timer)
    assert {c.describe() for c in table.ops.values()} == {"onednn (pinned)"}
    with pytest.raises(InvalidRequestError, match="fp32_linear takes one of fma, onednn"):
        calibrate.plan(fp32_model, 2, "fp32_linear=amx", dtype=FP32, timer=timer)


def test_one_fp32_path_is_nothing_to_choose(fp32_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where only oneDNN runs (the kernels did not build, no AVX2), an fp32 model has no choice to measure: it keeps
    oneDNN's blocked weights, as before the packed kernel existed."""
    real = calibrate.available
    monkeypatch.setattr(calibrate, "available", lambda kind: ("onednn",) if kind == calibrate.FP32_LINEAR
                        else real(kind))
    assert calibrate.plan(fp32_model, 2, dtype=FP32, timer=lambda *a: 1.0) is None


def test_a_onednn_that_changes_a_rows_result_with_the_batch_is_no_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "batch_invariant", lambda *a, **k: False)
    assert [c.name for c in calibrate.fp32_linear_candidates(40, 24, ("fma", "onednn"))] == ["fma"]
    monkeypatch.setattr(calibrate, "batch_invariant", lambda *a, **k: True)
    assert [c.name for c in calibrate.fp32_linear_candidates(40, 24, ("fma", "onednn"))] == ["fma", "onednn"]


def test_onednns_fp32_matmul_is_checked_in_fp32() -> None:
    """batch_invariant feeds the op x of its dtype (a bf16 x into oneDNN's fp32 matmul would fail or mislead)."""
    seen: list[torch.dtype] = []

    def run(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dtype)
        return x @ torch.ones(x.shape[1], 3)

    assert calibrate.batch_invariant(run, 8, torch.Generator().manual_seed(0), 40, FP32)
    assert set(seen) == {FP32}


@pytest.mark.parametrize("rows", [1, 2, 7, 300])
def test_linear_and_head_on_the_packed_kernel(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 40, bias=True)
    layer.weight.data, layer.bias.data = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack_for_cpu(pinned("fma"))
    assert layer.weight is None and layer.packed is None and layer.matmul.packed and layer.matmul.fp32
    x = torch.randn(2, rows, 96, generator=g)  # 3-d through forward
    got = layer(x)
    assert got.shape == (2, rows, 40) and got.dtype == FP32
    torch.testing.assert_close(got, x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1, :1], layer(x[1, :1]))  # a row alone: the same bits

    head = VocabEmbedding(300, 64)
    head.weight.data = torch.randn(300, 64, generator=g)
    table = head.weight.detach().clone()
    head.pack_for_cpu(keep_plain=False, choice=pinned("fma"))
    assert head.weight is None and head.packed is None and head.matmul.packed
    h = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(head.logits(h), h @ table.T, rtol=1e-5, atol=1e-5)


def test_an_untied_models_input_table_is_no_matmul(tiny_model_dir: Callable[[str], str]) -> None:
    """Only looked up: timing it at a decoder linear's row counts (up to 2,048) would choose for nothing."""
    model = load_model(tiny_model_dir("llama"), EngineConfig(dtype="float32")).model
    assert model.lm_head is not None  # untied
    weights = list(calibrate.matmul_weights(model))
    assert any(w is model.lm_head.weight for w in weights)
    assert not any(w is model.model.embed_tokens.weight for w in weights)
