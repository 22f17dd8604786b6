"""AWQ (GEMM) and GPTQ checkpoints (models/awq_gptq.py): tiny Llamas quantized and packed here with each format's
published formula (AutoAWQ's asymmetric per-group 4-bit with its nibble order; GPTQ's v1 "+1" zeros, 4 and 8 bits,
with and without act-order), loaded onto their blocks exactly (the dequantized values), run against transformers over
the dequantized weights, and malformed ones refused with a ModelLoadError naming what to change."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
from safetensors.torch import save_file

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.kernels import native
from llmserve.layers.quant_blocks import BlockWeight, concat
from llmserve.models import awq_gptq, load_model
from tests.tiny_models import PagedRunner, hf_logits, make_hf_model, tiny_tokenizer

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds column AWQ_ORDER[i] of its 8
IDS = list(range(3, 30))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-group quantization of w [out, in] (AutoAWQ's pseudo_quantize_tensor, GPTQ's asymmetric
    quantizer): scale = (max - min) / (2^bits - 1) in fp16, zero = round(-min / scale), q = clamp(round(w / scale) +
    zero). -> q [in, out] int32, zeros [in / group, out] int32, scales [in / group, out] fp16."""
    out, cols = w.shape
    g = w.reshape(out, cols // group, group)
    top = 2 ** bits - 1
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = ((hi - lo).clamp(min=1e-5) / top).half()
    s = scales.float()
    zeros = torch.clamp(torch.round(-lo / s), 0, top)
    q = torch.clamp(torch.round(g / s[..., None]) + zeros[..., None], 0, top)
    return q.reshape(out, cols).T.int(), zeros.T.int(), scales.T.contiguous()


def dequantized(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """w[o, k] = s[g_idx[k], o] * (q[k, o] - z[g_idx[k], o]) as the formats define it -> [out, in] fp32."""
    g = g_idx.long()
    return ((q.float() - zeros[g].float()) * scales[g].float()).T


def act_order_quantize(w: torch.Tensor, bits: int, group: int,
                       order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ with desc_act: the columns quantized in `order` (groups are runs of that order) -> q [in, out] in the
    weight's column order, zeros, scales, g_idx int32 [in] (g_idx[order[j]] = j // group)."""
    q, z, s = quantize(w[:, order], bits, group)
    g_idx = torch.empty(len(order), dtype=torch.int32)
    g_idx[order] = torch.arange(len(order), dtype=torch.int32) // group
    return q[order.argsort()], z, s, g_idx


def column_order(cols: int, key: str) -> torch.Tensor:
    """A random act-order column order, one per input (q / k / v share theirs, as GPTQ's share one Hessian)."""
    return torch.randperm(cols, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def pack_cols(v: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[r, c] -> int32 [r, c * bits / 32]: each int32 holds 32 / bits consecutive columns, field i (bits i * bits up)
    holding column i of them (or column order[i])."""
    per = 32 // bits
    order = order or tuple(range(per))
    packed = torch.zeros(v.shape[0], v.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        packed |= v[:, order[i]::per].long() << (bits * i)
    return packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else packed.int()


def gptq_tensors(prefix: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor,
                 bits: int) -> dict[str, torch.Tensor]:
    """GPTQ v1's tensors: zeros stored minus one; qweight packed along the input rows."""
    return {f"{prefix}.qweight": pack_cols(q.T.contiguous(), bits).T.contiguous(),
            f"{prefix}.qzeros": pack_cols(z - 1, bits), f"{prefix}.scales": s, f"{prefix}.g_idx": g_idx}


def write_checkpoint(tmp_path, method: str, bits: int = 4, group: int = 32, act_order: bool = False,
                     **config) -> tuple[str, object]:
    """A tiny Llama quantized with `method` (GPTQ: with random act-order column orders if asked); returns
    (directory, transformers model over the dequantized weights)."""
    hf = make_hf_model("llama", vocab_size=300, hidden_size=64, intermediate_size=128)
    tensors = {}
    for name, t in hf.state_dict().items():
        layer = name.rsplit(".", 2)
        if len(layer) == 3 and layer[1] in LINEARS and layer[2] == "weight":
            prefix = name[: -len(".weight")]
            cols = t.shape[1]
            order = torch.arange(cols)
            if act_order:
                order = column_order(cols, layer[0] + {"k_proj": "q_proj", "v_proj": "q_proj",
                                                       "up_proj": "gate_proj"}.get(layer[1], layer[1]))
            q, z, s, g_idx = act_order_quantize(t.float(), bits, group, order)
            if method == "awq":
                tensors |= {f"{prefix}.qweight": pack_cols(q, 4, AWQ_ORDER), f"{prefix}.qzeros": pack_cols(z, 4, AWQ_ORDER),
                            f"{prefix}.scales": s}
            else:
                tensors |= gptq_tensors(prefix, q, z, s, g_idx, bits)
            with torch.no_grad():
                t.copy_(dequantized(q, z, s, g_idx))
        else:
            tensors[name] = t.contiguous()
    directory = str(tmp_path / method)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    qc = {"quant_method": method, "bits": bits, "group_size": group}
    qc |= {"zero_point": True, "version": "gemm"} if method == "awq" else {"desc_act": act_order, "sym": False}
    cfg = hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "quantization_config": qc | config}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    tiny_tokenizer().save_pretrained(directory)
    return directory, hf


@pytest.mark.parametrize("method, bits, group", [("awq", 4, 32), ("awq", 4, 64), ("gptq", 4, 32), ("gptq", 8, 64)])
def test_quantized_checkpoint_runs_on_its_blocks(method: str, bits: int, group: int, tmp_path) -> None:
    directory, hf = write_checkpoint(tmp_path, method, bits, group)
    lm = load_model(directory, EngineConfig(dtype="float32", device="cpu"))
    attn = lm.model.model.layers[1].self_attn
    qkv = attn.qkv_proj
    assert qkv.weight is None and qkv.qblocks.bits == bits and qkv.qblocks.group == group
    ref = hf.model.layers[1].self_attn
    expected = torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight])
    assert torch.equal(qkv.qblocks.dequantize()[:qkv.out_features], expected)  # exactly the format's values
    ours = PagedRunner(lm.model).step([(0, IDS)])[0]
    theirs = hf_logits(hf, IDS)
    # activations rounded to int8 per block of 32 where the native kernel runs: within 6% of the logits' range
    # (measured ~3%); the torch reference path (other CPUs) is fp32 exact up to summation order
    assert (ours - theirs).abs().max().item() <= 0.06 * theirs.abs().max().item()


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, "3-bit weights is not supported"),
    ({"version": "gemv"}, "only the GEMM layout"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
])
def test_unsupported_configs_are_refused(change: dict, message: str, tmp_path) -> None:
    method = "gptq" if "checkpoint_format" in change else "awq"
    directory, _ = write_checkpoint(tmp_path, method, **change)
    with pytest.raises(ModelLoadError, match=message):
        load_model(directory, EngineConfig(dtype="float32", device="cpu"))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
@pytest.mark.parametrize("path", ["native", "reference"])
def test_act_order_checkpoint_runs_on_its_blocks(bits: int, group: int, path: str, tmp_path, monkeypatch) -> None:
    """desc_act: every linear's groups spread over its columns in a random order; the weights load exactly, and the
    model agrees with transformers over them: greedy tokens equal on the fp32 reference path, logits within the
    native kernel's int8-activation tolerance (as above) where it runs."""
    if path == "reference":
        monkeypatch.setattr(native, "qblock_usable", lambda: False)
    elif not native.qblock_usable():
        pytest.skip("needs the native kernels on an AVX-512 CPU")
    directory, hf = write_checkpoint(tmp_path, "gptq", bits, group, act_order=True)
    lm = load_model(directory, EngineConfig(dtype="float32", device="cpu"))
    down = lm.model.model.layers[1].mlp.down_proj  # 128 columns: 2 or 4 groups (64: one group, no order to keep)
    assert down.qblocks.perm is not None and (down.qblocks.native is not None) == (path == "native")
    assert torch.equal(down.qblocks.dequantize()[:down.out_features], hf.model.layers[1].mlp.down_proj.weight)
    runner, ids = PagedRunner(lm.model), list(IDS)
    ours = runner.step([(0, ids)])[0]
    for _ in range(6):
        theirs = hf_logits(hf, ids)
        if path == "reference":  # fp32 both sides, up to summation order
            assert int(ours[-1].argmax()) == int(theirs[-1].argmax())
            torch.testing.assert_close(ours, theirs[-len(ours):], atol=1e-4, rtol=1e-4)
        else:
            assert (ours - theirs[-len(ours):]).abs().max().item() <= 0.06 * theirs.abs().max().item()
        ids.append(int(ours[-1].argmax()))
        ours = runner.step([(0, ids[-1:])])[0]


def _act_order_tensor(bits: int, group: int, order: torch.Tensor, seed: int = 0) -> tuple:
    """A random [40, k] weight quantized GPTQ-style in `order` -> (its BlockTensor, the formula's weight [40, k])."""
    w = torch.randn(40, len(order), generator=torch.Generator().manual_seed(seed))
    q, z, s, g_idx = act_order_quantize(w, bits, group, order)
    parts = {k.split(".")[-1]: v for k, v in gptq_tensors("x", q, z, s, g_idx, bits).items()}
    return awq_gptq.to_blocks("x", parts, awq_gptq.QuantConfig("gptq", bits, group, True)), dequantized(q, z, s, g_idx)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64), (4, 128)])
@pytest.mark.parametrize("path", ["native", "reference"])
def test_act_order_linear_matches_its_formula(bits: int, group: int, path: str, monkeypatch) -> None:
    """BlockWeight.linear (x's columns gathered, then the kernel) against x @ w.T of w[o, k] = s[g_idx[k], o] *
    (q[k, o] - z[g_idx[k], o])."""
    if path == "reference":
        monkeypatch.setattr(native, "qblock_usable", lambda: False)
    elif not native.qblock_usable():
        pytest.skip("needs the native kernels on an AVX-512 CPU")
    t, w = _act_order_tensor(bits, group, column_order(256, f"linear{bits}"))
    assert t.perm is not None
    bw = BlockWeight(t)
    assert torch.equal(bw.dequantize()[:40], w)
    x = torch.randn(5, 3, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40)
    exact = x.double() @ w.double().T + bias.double()
    tol = 1e-5 if path == "reference" else 0.02  # the native kernel rounds x to int8 per block of 32 (2%)
    assert (bw.linear(x, bias).double() - exact).abs().max().item() <= tol * exact.abs().max().item()


def test_act_order_shards_fuse_in_one_column_order() -> None:
    """q / k / v fused: a shard whose g_idx names the same column sets under other group numbers takes the first
    shard's order (its scales re-indexed); one whose groups hold other columns cannot."""
    order = column_order(64, "fuse")
    first, w1 = _act_order_tensor(4, 32, order)
    relabelled, w2 = _act_order_tensor(4, 32, torch.cat([order[32:], order[:32]]), seed=1)
    assert not torch.equal(first.perm, relabelled.perm)
    fused = concat([first, relabelled])
    assert torch.equal(fused.perm, first.perm) and torch.equal(fused.dequantize(), torch.cat([w1, w2]))
    other, _ = _act_order_tensor(4, 32, column_order(64, "other"))
    with pytest.raises(ValueError, match="different columns in one group"):
        concat([first, other])


def _g_idx_wrong_length(g: torch.Tensor) -> torch.Tensor:
    return g[:-1]


def _g_idx_out_of_range(g: torch.Tensor) -> torch.Tensor:
    return torch.where(g == 1, 2, g)


def _g_idx_uneven(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g[(g == 0).nonzero()[0]] = 1  # one column moves from group 0 to group 1
    return g


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("corrupt, message", [
    (_g_idx_wrong_length, r"q_proj: g_idx is \(63,\) torch.int32, expected \(64,\)"),
    (_g_idx_out_of_range, r"q_proj: g_idx names groups 0 \.\. 2, the weights have 0 \.\. 1"),
    (_g_idx_uneven, "q_proj: g_idx puts 31 columns in group 0, not group_size 32"),
])
def test_malformed_g_idx_is_refused(act_order: bool, corrupt, message: str, tmp_path) -> None:
    from safetensors.torch import load_file

    directory, _ = write_checkpoint(tmp_path, "gptq", act_order=act_order)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    g_idx = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[g_idx] = corrupt(tensors[g_idx]).contiguous()
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=message):
        load_model(directory, EngineConfig(dtype="float32", device="cpu"))


def test_act_order_shards_with_different_groups_are_refused(tmp_path) -> None:
    """A fused layer (q / k / v) whose shards' g_idx put different columns in one group: no one column order runs
    them all, so the load says so rather than running a wrong product."""
    from safetensors.torch import load_file

    directory, hf = write_checkpoint(tmp_path, "gptq", act_order=True)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    prefix = "model.layers.0.self_attn.k_proj"
    w = hf.model.layers[0].self_attn.k_proj.weight.detach().float()
    tensors |= gptq_tensors(prefix, *act_order_quantize(w, 4, 32, column_order(64, "another")), 4)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="qkv_proj: act-order shards whose g_idx put different columns"):
        load_model(directory, EngineConfig(dtype="float32", device="cpu"))


def test_bad_shapes_are_refused(tmp_path) -> None:
    from safetensors.torch import load_file

    directory, _ = write_checkpoint(tmp_path, "gptq")
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    qzeros = "model.layers.0.mlp.down_proj.qzeros"
    tensors[qzeros] = tensors[qzeros][:, :-1].contiguous()
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="down_proj: qzeros is"):
        load_model(directory, EngineConfig(dtype="float32", device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method, act_order", [("awq", False), ("gptq", True)])
def test_quantized_checkpoint_runs_on_cuda(method: str, act_order: bool, tmp_path, monkeypatch) -> None:
    """On CUDA the linears run kernels/triton/qblock.py: fp16 logits of a prefill and a decode step within the same
    6% of transformers (fp32 on the CPU over the dequantized weights) as above, and within 1% of the reference
    path's (LLMSERVE_QBLOCK_TRITON=0: the weight dequantized per call)."""
    directory, hf = write_checkpoint(tmp_path, method, act_order=act_order)
    runs = {}
    for pin in ("1", "0"):
        monkeypatch.setenv("LLMSERVE_QBLOCK_TRITON", pin)
        lm = load_model(directory, EngineConfig(dtype="float16", device="cuda"))
        qkv = lm.model.model.layers[1].self_attn.qkv_proj
        assert qkv.qblocks.codes.is_cuda and (qkv.qblocks.triton is not None) == (pin == "1")
        runner = PagedRunner(lm.model)
        prefill = runner.step([(0, IDS)])[0]
        runs[pin] = torch.cat([prefill, runner.step([(0, [5])])[0]]).float().cpu()
    theirs = torch.cat([hf_logits(hf, IDS), hf_logits(hf, IDS + [5])[-1:]])
    scale = theirs.abs().max().item()
    assert (runs["1"] - theirs).abs().max().item() <= 0.06 * scale
    assert (runs["1"] - runs["0"]).abs().max().item() <= 0.01 * scale


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantization_naming_the_checkpoints_method_loads_it(method: str, tmp_path) -> None:
    """vLLM's --quantization awq / LMDeploy's model_format="awq": the same model as with the flag unset."""
    directory, _ = write_checkpoint(tmp_path, method)
    named = load_model(directory, EngineConfig(dtype="float32", device="cpu", quantization=method))
    plain = load_model(directory, EngineConfig(dtype="float32", device="cpu"))
    assert named.model.model.layers[0].self_attn.qkv_proj.qblocks.bits == 4
    assert torch.equal(PagedRunner(named.model).step([(0, IDS)])[0], PagedRunner(plain.model).step([(0, IDS)])[0])


def test_quantization_naming_another_method_is_refused(tiny_model_dir, tmp_path) -> None:
    directory, _ = write_checkpoint(tmp_path, "awq")
    with pytest.raises(ModelLoadError, match="quantization='gptq', but the checkpoint is awq .4-bit.; use "
                                             "quantization='awq' or drop it"):
        load_model(directory, EngineConfig(dtype="float32", device="cpu", quantization="gptq"))
    with pytest.raises(ModelLoadError, match="names the checkpoint's format, but the checkpoint has no "
                                             "quantization_config .unquantized weights.; drop quantization"):
        load_model(tiny_model_dir("llama"), EngineConfig(dtype="float32", device="cpu", quantization="awq"))
    with pytest.raises(InvalidRequestError, match="load_format='dummy' reads none"):
        load_model(directory, EngineConfig(dtype="float32", device="cpu", quantization="awq", load_format="dummy"))


def test_quantization_on_a_quantized_checkpoint_is_refused(tmp_path) -> None:
    directory, _ = write_checkpoint(tmp_path, "awq")
    with pytest.raises(ModelLoadError, match="already quantized .awq, 4-bit.; drop quantization='int8'"):
        load_model(directory, EngineConfig(dtype="float32", device="cpu", quantization="int8"))
