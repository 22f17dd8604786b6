"""GGUF quantized weights run on their blocks (models/quantized_weights.py, layers/quant_blocks.py): each native type
read exactly as gguf.quants dequantizes it, tiny Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K Llamas through the model against
their dequantized weights, the embedded SmolLM2 Q4_1 natively (its linears' outputs against the dequantized
reference), and the fallbacks (dtype float32, quantization int8, LLMSERVE_GGUF_NATIVE=0) dequantizing as before."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.kernels import native
from llmserve.models import gguf_blocks, load_model
from llmserve.models.gguf_loader import unpermute_qk
from tests.tiny_models import PagedRunner, make_hf_model, write_tiny_gguf

Q = gguf.GGMLQuantizationType
BF16 = EngineConfig(dtype="bfloat16", device="cpu")
IDS = list(range(3, 30))
native_only = pytest.mark.skipif(not native.qblock_usable(), reason="needs the native kernels (AVX-512, or AVX2)")


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path) -> str:
    path = str(tmp_path / "cache")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", path)
    return path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_exactly_as_gguf_dequantizes(qtype: str) -> None:
    a = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    raw = gguf.quants.quantize(a, Q[qtype])
    t = gguf_blocks.block_tensor(torch.from_numpy(raw), qtype, 256)
    assert torch.equal(t.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, Q[qtype])))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_blocks_read_exactly_as_gguf_dequantizes(qtype: str) -> None:
    # gguf cannot quantize K-quants: random blocks (every code, high-bit, 6-bit scale / min and int8 scale pattern
    # occurs) with sane fp16 d (and dmin), which random bytes would make inf or nan
    rng = np.random.default_rng(1)
    size = gguf_blocks.BLOCK_BYTES[qtype][1]
    raw = rng.integers(0, 256, (6, 2, size), dtype=np.uint8)
    d = (rng.random((6, 2, 1)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        raw[..., 2:4] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)
    raw = raw.reshape(6, 2 * size)
    t = gguf_blocks.block_tensor(torch.from_numpy(raw), qtype, 512)
    assert (t.bits, t.group) == gguf_blocks.KINDS[qtype]
    assert torch.equal(t.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, Q[qtype])))


def _linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "qblocks")}


def _decode(model, steps: int, tokens: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """IDS, then one token a step: greedily chosen, or `tokens` -> (the tokens fed, each step's last logits
    [steps, vocab])."""
    runner = PagedRunner(model)
    logits = [runner.step([(0, IDS)])[0][-1]]
    fed: list[int] = []
    for s in range(steps - 1):
        fed.append(tokens[s] if tokens is not None else int(logits[-1].argmax()))
        logits.append(runner.step([(0, fed[-1:])])[0][-1])
    return fed, torch.stack(logits)


@native_only
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_tiny_gguf_runs_on_its_blocks_like_its_dequantized_weights(qtype: str, tmp_path, monkeypatch) -> None:
    # K-quants come in super-blocks of 256 columns: every matrix needs whole ones
    sizes = dict(hidden_size=256, intermediate_size=256) if qtype.endswith("_K") else {}
    hf = make_hf_model("llama", vocab_size=300, **{"hidden_size": 64, "intermediate_size": 128, **sizes})
    path = write_tiny_gguf(hf, tmp_path / f"tiny.{qtype}.gguf", Q[qtype])
    ours = load_model(path, BF16)
    linears = _linears(ours.model)
    assert all(m.qblocks is not None and m.weight is None for m in linears.values())
    assert {(m.qblocks.bits, m.qblocks.group) for m in linears.values()} == {gguf_blocks.KINDS[qtype]}
    assert ours.model.lm_head.qblocks is not None and ours.model.model.embed_tokens.qblocks is not None
    monkeypatch.setenv("LLMSERVE_GGUF_NATIVE", "0")
    ref = load_model(path, BF16)
    ref_linears = _linears(ref.model)
    for name, m in linears.items():  # the very values the dequantizing path loads (bf16 holds them as rounded)
        assert torch.equal(m.qblocks.dequantize()[:m.qblocks.n].bfloat16(), ref_linears[name].weight), name
    a = PagedRunner(ours.model).step([(0, IDS)])[0]
    b = PagedRunner(ref.model).step([(0, IDS)])[0]
    # int8 activations per block of 32 and bf16 rounding: within 6% of the logits' range at 64 columns (measured
    # 3.0-3.8%, prompt and decode steps), 10% at 256 (3.7-6.4% over the prompt, 5.2-8.1% decoding; 2.2-3.2% with fp32
    # activations, the FMA path; each linear within bf16 rounding of the exact int8-activation product, Q4_K to Q6_K
    # alike: the wider model's random layers amplify the activations' rounding more)
    bound = 0.1 if qtype.endswith("_K") else 0.06
    assert (a - b).abs().max().item() <= bound * b.abs().max().item()
    # the same pick at 90% of the prompt's positions (85% for the wider K-quant model: Q5_K's 24 of 27 where the
    # reference's bf16 matmuls ran on AMX tiles, a Xeon 6 207; the tiny random model's logits are flat)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= (0.85 if qtype.endswith("_K") else 0.9)
    # decoding the dequantized model's greedy tokens (one row a step: the kernel's one-row tiles). Free-running greedy
    # tokens can part at a near tie (Q4_0's first pick here leads by 0.0), so: the same pick at 7 of 8 steps or more
    # (measured 8 for Q4_1, Q5_K and Q6_K, 7 for the others)
    tokens, want = _decode(ref.model, 8)
    _, got = _decode(ours.model, 8, tokens)
    assert ((got - want).abs().amax(-1) <= bound * want.abs().amax(-1)).all()
    assert (got.argmax(-1) == want.argmax(-1)).sum().item() >= 7


@native_only
def test_a_q4_k_m_mix_runs_its_fused_layers_on_their_common_form(tmp_path, monkeypatch) -> None:
    """Q4_K_M's mix: Q4_K q/k beside a Q6_K v (and a Q6_K down_proj). The fused qkv takes 6-bit codes in groups of
    16, every shard's values exactly its own; the model matches its dequantized weights as a plain Q4_K one does."""
    hf = make_hf_model("llama", vocab_size=300, hidden_size=256, intermediate_size=256)
    path = write_tiny_gguf(hf, tmp_path / "tiny.Q4_K_M.gguf", Q.Q4_K,
                           qtypes={"v_proj.weight": Q.Q6_K, "down_proj.weight": Q.Q6_K})
    ours = load_model(path, BF16)
    layer = ours.model.model.layers[0]
    qkv, down, gate_up = layer.self_attn.qkv_proj, layer.mlp.down_proj, layer.mlp.gate_up_proj
    assert all(m.weight is None for m in (qkv, down, gate_up))
    assert (qkv.qblocks.bits, qkv.qblocks.group) == (6, 16) == (down.qblocks.bits, down.qblocks.group)
    assert (gate_up.qblocks.bits, gate_up.qblocks.group) == (4, 32)
    monkeypatch.setenv("LLMSERVE_GGUF_NATIVE", "0")
    ref = load_model(path, BF16)
    ref_linears = _linears(ref.model)
    for name, m in _linears(ours.model).items():
        assert torch.equal(m.qblocks.dequantize()[:m.qblocks.n].bfloat16(), ref_linears[name].weight), name
    a = PagedRunner(ours.model).step([(0, IDS)])[0]
    b = PagedRunner(ref.model).step([(0, IDS)])[0]
    assert (a - b).abs().max().item() <= 0.1 * b.abs().max().item()  # the K-quant bound above
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_shards_of_different_kinds_stack_exactly() -> None:
    from llmserve.layers import quant_blocks as qb

    g = torch.Generator().manual_seed(0)
    q4 = qb.BlockTensor(torch.randint(0, 16, (3, 64), generator=g, dtype=torch.uint8), torch.rand(3, 2, generator=g),
                        -torch.rand(3, 2, generator=g), 4, 32)
    q6 = qb.BlockTensor(torch.randint(0, 64, (2, 64), generator=g, dtype=torch.uint8), torch.rand(2, 4, generator=g),
                        None, 6, 16, zero=32)
    both = qb.concat([q4, q6])
    assert (both.bits, both.group) == (6, 16)
    assert torch.equal(both.dequantize(), torch.cat([q4.dequantize(), q6.dequantize()]))
    assert qb.common_kind({(4, 32), (8, 48)}) is None
    codes = torch.zeros(1, 96, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not nest"):
        qb.concat([qb.BlockTensor(codes, torch.ones(1, 3), None, 4, 32), qb.BlockTensor(codes, torch.ones(1, 2), None, 4, 48)])


@native_only
def test_embedded_q4_1_runs_natively_with_its_own_bytes() -> None:
    from gguf import GGUFReader

    from llmserve.models.loader import embedded_model_path

    path = embedded_model_path()
    lm = load_model(None, BF16)
    layer = lm.model.model.layers[3]
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    # the q rows as llama.cpp stores them (permuted), dequantized by gguf, against our blocks
    q = tensors["blk.3.attn_q.weight"]
    assert q.tensor_type == Q.Q4_1
    expected = unpermute_qk(torch.from_numpy(gguf.quants.dequantize(q.data, Q.Q4_1)), 9)
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight is None and qkv.qblocks.bits == 4
    assert torch.equal(qkv.qblocks.dequantize()[:576], expected)
    x = torch.randn(3, 576).bfloat16()
    for lin in (qkv, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        w = lin.qblocks.dequantize()[:lin.out_features]
        x_in = x if lin.in_features == 576 else torch.randn(3, lin.in_features).bfloat16()
        want = x_in.double() @ w.double().T
        got = lin(x_in).double()
        assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    head = lm.model.model.embed_tokens.qblocks
    assert head.bits == 8  # token_embd is Q8_0, tied
    ids = torch.tensor([0, 1, 49151])
    emb = torch.from_numpy(gguf.quants.dequantize(tensors["token_embd.weight"].data, Q.Q8_0))[ids]
    assert torch.equal(lm.model.model.embed_tokens(ids), emb.bfloat16())


@pytest.mark.parametrize("config", [EngineConfig(dtype="float32", device="cpu"),
                                    EngineConfig(dtype="bfloat16", device="cpu", quantization="int8")],
                         ids=["float32", "int8"])
def test_fallbacks_dequantize(config: EngineConfig, tmp_path) -> None:
    hf = make_hf_model("llama", vocab_size=300)
    lm = load_model(write_tiny_gguf(hf, tmp_path / "tiny.Q4_1.gguf", Q.Q4_1), config)
    assert all(m.qblocks is None for m in _linears(lm.model).values())


@pytest.mark.skipif(not native.qblock_amx_usable(), reason="needs AMX-BF16")
@pytest.mark.parametrize("form", ["Q4_1", "Q4_0", "Q5_K", "Q6_K", "Q8_0", "4-bit/128"])
def test_amx_over_the_blocks_is_amx_over_their_dequantized_weights(form: str) -> None:
    """qblock_linear_amx dequantizes each tile as it reads it, to exactly the values the dequantized bf16 weight holds:
    its products are bf16_gemm's amx path over that weight, bit for bit (every tile shape: 1, 17, 40 and 300 rows, 300
    in two chunks of rows that keep one dequantizing; 600 rows, three chunks, whose items share each group's tiles
    dequantized once a call, an odd count of blocks among them; and 1,100 rows by 600 outputs, groups of 8 block
    pairs)."""
    from llmserve.layers.quant_blocks import BlockTensor, BlockWeight

    bits, group, sd, mins, zero = {"Q4_1": (4, 32, torch.float16, True, 0), "Q4_0": (4, 32, torch.float16, False, 8),
                                   "Q5_K": (5, 32, torch.float32, True, 0), "Q6_K": (6, 16, torch.float32, False, 32),
                                   "Q8_0": (8, 32, torch.float16, False, 128),
                                   "4-bit/128": (4, 128, torch.float16, True, 0)}[form]
    g = torch.Generator().manual_seed(bits * group)
    for n, k, rows in [(50, 256, (1, 17, 40, 300)), (33, 512, (1, 17, 40, 300, 600)), (600, 256, (1100,))]:
        codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
        scales = (torch.rand(n, k // group, generator=g) * 0.01).to(sd)
        mn = (torch.randn(n, k // group, generator=g) * 0.01).to(sd) if mins else None
        w = BlockWeight(BlockTensor(codes, scales, mn, bits, group, zero))
        packed, bias = native.bf16_pack(w.dequantize()[:n].bfloat16()), torch.randn(n, generator=g)
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            assert torch.equal(native.qblock_linear_amx(x, w.native, bias), native.bf16_gemm(x, packed, n, bias, "amx"))
    # the fused gate/up (the decoder stack's MLP): silu_mul of the same product, bit for bit
    n, k = 96, 256
    w = BlockWeight(BlockTensor(torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8),
                                (torch.rand(n, k // group, generator=g) * 0.01).to(sd),
                                (torch.randn(n, k // group, generator=g) * 0.01).to(sd) if mins else None,
                                bits, group, zero))
    for m in (40, 300, 600):  # one chunk of rows; two; three (the gate and up blocks made once a call)
        x = torch.randn(m, k, generator=g).bfloat16()
        assert torch.equal(native.qblock_linear_amx(x, w.native, None, glu=True),
                           native.silu_mul(native.qblock_linear_amx(x, w.native, None)))


FORMS = {"Q4_1": (4, 32, torch.float16, True, 0), "Q4_0": (4, 32, torch.float16, False, 8),
         "Q5_K": (5, 32, torch.float32, True, 0), "Q6_K": (6, 16, torch.float32, False, 32),
         "Q8_0": (8, 32, torch.float16, False, 128), "4-bit/128": (4, 128, torch.float16, True, 0)}


@pytest.mark.skipif(not native.qblock_amx_dot_usable(), reason="needs AMX-BF16, AVX512-BF16 and VBMI")
@pytest.mark.parametrize("form", list(FORMS))
def test_the_blocks_dot_products_give_the_tiles_bits(form: str) -> None:
    """qblock_linear_amx_dot sums as tdpbf16ps does (per 32-column tile, the even and the odd columns' products in two
    chains from zero, then added together and to the output; denormals flushed): its outputs are the AMX tiles', bit
    for bit, at every row count of its passes (1, 2, 4 and the leftovers), with a bias and in the fused gate/up, and
    where x holds zeros, denormals and values whose products cancel. Summing the 32 products in one chain, as Intel's
    intrinsics guide has it, differed from the tiles in ~0.02% of outputs."""
    from llmserve.layers.quant_blocks import BlockTensor, BlockWeight

    bits, group, sd, mins, zero = FORMS[form]
    g = torch.Generator().manual_seed(7 * bits + group)
    for n, k in [(50, 256), (33, 512), (96, 768), (1024, 512)]:
        w = BlockWeight(BlockTensor(torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8),
                                    (torch.rand(n, k // group, generator=g) * 0.01).to(sd),
                                    (torch.randn(n, k // group, generator=g) * 0.01).to(sd) if mins else None,
                                    bits, group, zero))
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 7, 9):
            x = torch.randn(m, k, generator=g).bfloat16()
            x[0, :64] = 0
            x[-1, 32:40] = 1e-39  # bf16 denormals: the tiles read them as zero
            x[-1, 40:48] = torch.tensor([1e30, -1e30] * 4)
            for b in (None, bias):
                assert torch.equal(native.qblock_linear_amx_dot(x, w.native, b), native.qblock_linear_amx(x, w.native, b))
            if n % 32 == 0:
                assert torch.equal(native.qblock_linear_amx_dot(x, w.native, b, glu=True),
                                   native.qblock_linear_amx(x, w.native, b, glu=True))
    with pytest.raises(RuntimeError, match="bf16"):
        native.qblock_linear_amx_dot(torch.randn(2, k), w.native, None)


@native_only
@pytest.mark.parametrize("form", ["Q4_1", "Q6_K", "Q8_0"])
def test_dequantized_bf16_is_exactly_the_formats_values_rounded(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What replaces the blocks where a bf16 kernel was measured faster (kernels/calibrate.py's unblock): the native
    dequantization where it runs, torch's otherwise, both exactly BlockTensor.dequantize rounded to bf16."""
    from llmserve.kernels import calibrate
    from llmserve.layers.quant_blocks import BlockTensor, BlockWeight

    bits, group, sd, mins, zero = {"Q4_1": (4, 32, torch.float16, True, 0), "Q6_K": (6, 16, torch.float32, False, 32),
                                   "Q8_0": (8, 32, torch.float16, False, 128)}[form]
    g = torch.Generator().manual_seed(bits)
    n, k = 37, 256
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.01).to(sd)
    mn = (torch.randn(n, k // group, generator=g) * 0.01).to(sd) if mins else None
    w = BlockWeight(BlockTensor(codes, scales, mn, bits, group, zero))
    want = w.dequantize()[:n].bfloat16()
    assert torch.equal(calibrate.dequantized_bf16(w), want)
    # unblock's packed form is bf16_pack's of that weight (n = 37: the last tile's padding rows are zeros, as there)
    layer = torch.nn.Module()
    if native.bf16_dot_usable():  # (the native dequantizer writes bf16_pack's layout with AVX512-BF16)
        layer.qblocks = w
        assert torch.equal(calibrate.unblock(layer, packed=True), native.bf16_pack(want))
        assert layer.qblocks is None and getattr(layer, "weight", None) is None
    monkeypatch.setattr(native, "bf16_dot_usable", lambda: False)  # torch's, 10 rows at a time
    assert torch.equal(calibrate.dequantized_bf16(w, rows=10), want)
    layer.qblocks = w
    assert calibrate.unblock(layer, packed=True) is None and torch.equal(layer.weight, want)
