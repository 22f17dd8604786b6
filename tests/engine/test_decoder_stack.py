"""The native decoder stack (kernels/cpu/decoder_stack.cpp) through the whole engine: the steps it runs (decodes, chunked
prefills, both at once) give the same bits as the Python layers (LLMSERVE_DECODER_STACK=0), batched, windowed,
preempted, prefix-cached, over 16-bit, int8 and int4 caches, bf16, fp32, int8 and GGUF block weights; models and
settings it does not cover keep the Python layers."""

from __future__ import annotations

import pytest

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.kernels import native
from llmserve.models.llama import LlamaModel

# The stack runs packed linears: bf16 ones on AVX-512 CPUs, int8 ones (--quantization int8) on AVX-512 or AVX2 CPUs,
# fp32 ones (fp32_gemm) on AVX2 CPUs
pytestmark = pytest.mark.skipif(not native.int8w_usable(), reason="the decoder stack needs the native kernels and a CPU "
                                "with AVX-512 or AVX2")
needs_bf16_stack = pytest.mark.skipif(not native.packed_gemm_usable(), reason="bf16 linears run in the stack on CPUs "
                                      "with AVX-512")
# bf16 linears run in the stack where their measured kernels are packed ones at every batch size: pinned here, so the
# tests do not depend on what this machine measured (LLMSERVE_KERNEL_CHOICE; test_stack_takes_either_bf16_kernel
# runs the other)
BF16_PACKED = True


@pytest.fixture(autouse=True)
def _packed_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    if native.packed_gemm_usable():  # (elsewhere bf16 linears have no packed kernel to pin)
        monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", "bf16_linear=fma")
needs_w8a8 = pytest.mark.skipif(not native.w8a8_usable(), reason="w8a8 needs a CPU with AVX-512 and VNNI")

PROMPTS = [list(range(3, 40)), [11, 12], list(range(50, 75)), [7] * 9]
GEN = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=3)


def _run(path: str, monkeypatch: pytest.MonkeyPatch, stack: bool, **engine) -> tuple[list, list, int]:
    """(token ids, logprobs, steps the stack ran) of PROMPTS, batched, with 16-token prefill chunks (so steps mix
    decodes with chunks that read earlier chunks from the cache)."""
    monkeypatch.setenv("LLMSERVE_DECODER_STACK", "1" if stack else "0")
    calls = []
    run = LlamaModel.run_decoder_stack
    monkeypatch.setattr(LlamaModel, "run_decoder_stack", lambda self, *a: calls.append(1) or run(self, *a))
    config = EngineConfig(**{"dtype": "bfloat16", "num_blocks": 96, "block_size": 4, "max_prefill_token_num": 16,
                             **engine})
    with pipeline(path, backend_config=config) as pipe:
        out = pipe([{"input_ids": p} for p in PROMPTS], gen_config=GEN, do_preprocess=False)
    return [o.token_ids for o in out], [o.logprobs for o in out], len(calls)


def _check_same_bits(path: str, monkeypatch: pytest.MonkeyPatch, expect_stack: bool, **engine) -> None:
    ids, lps, calls = _run(path, monkeypatch, True, **engine)
    ref_ids, ref_lps, ref_calls = _run(path, monkeypatch, False, **engine)
    assert ref_calls == 0
    assert (calls > 0) == expect_stack
    assert ids == ref_ids
    assert lps == ref_lps  # exactly: the same kernels on the same tensors in the same order


@needs_bf16_stack
@pytest.mark.parametrize("kernel", ["dot", "amx", "onednn"])
def test_stack_takes_either_bf16_kernel(tiny_model_dir, monkeypatch, kernel: str) -> None:
    """dot products and AMX tiles run in the stack as in the Python layers (amx: the MLP's gate/up and SiLU fused in
    one call, the Python layers' two); a oneDNN choice keeps the Python layers."""
    from llmserve.kernels.calibrate import BF16_LINEAR, available

    if kernel not in available(BF16_LINEAR):
        pytest.skip(f"{kernel} does not run here")
    monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", f"bf16_linear={kernel}")
    _check_same_bits(tiny_model_dir("llama"), monkeypatch, kernel in ("dot", "amx"))


@needs_bf16_stack
@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "mistral", "qwen3"])  # biases, windows, q/k norm
@pytest.mark.parametrize("kv", ["auto", "float32", "int8", "int4"])
def test_bf16_stack_gives_the_python_layers_bits(tiny_model_dir, monkeypatch, arch: str, kv: str) -> None:
    _check_same_bits(tiny_model_dir(arch), monkeypatch, BF16_PACKED, kv_cache_dtype=kv)


@pytest.mark.parametrize("quantization", [pytest.param("w8a8", marks=needs_w8a8), "int8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # int8 weights cover fp32 models too
@pytest.mark.parametrize("kv", ["auto", "int8", "int4"])
def test_int8_weight_stacks_give_the_python_layers_bits(tiny_model_dir, monkeypatch, quantization: str, dtype: str,
                                                        kv: str) -> None:
    # (int8 and int4 caches are read natively on AVX-512 CPUs only: elsewhere such models keep the Python layers)
    _check_same_bits(tiny_model_dir("qwen2"), monkeypatch, kv == "auto" or native.int8_kv_decode_usable(), dtype=dtype,
                     quantization=quantization, kv_cache_dtype=kv)


@pytest.mark.skipif(not native.w8a8_amx_usable(), reason="needs AMX-INT8")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_w8a8_tiles_in_the_stack_give_vnnis_bits_in_the_python_layers(tiny_model_dir, monkeypatch, dtype: str) -> None:
    """w8a8 linears pinned to AMX-INT8 tiles at every batch size (the stack passes each layer's threshold) against
    the Python layers pinned to VNNI: the same tokens and logprobs."""
    from llmserve.models import decoder_stack

    passed: list[int] = []  # each w8a8 linear's amx rows as the stack receives them
    linear_args = decoder_stack._linear_args

    def spy(linear):
        args = linear_args(linear)
        if args is not None and len(args) == 9:
            passed.append(args[8])
        return args

    monkeypatch.setattr(decoder_stack, "_linear_args", spy)
    monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", "w8a8_linear=amx8")
    ids, lps, calls = _run(tiny_model_dir("qwen2"), monkeypatch, True, dtype=dtype, quantization="w8a8")
    monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", "w8a8_linear=vnni")
    ref_ids, ref_lps, ref_calls = _run(tiny_model_dir("qwen2"), monkeypatch, False, dtype=dtype, quantization="w8a8")
    assert calls > 0 and ref_calls == 0
    assert passed and set(passed) == {1}  # the tiles from one row: every step of the stack ran on them
    assert ids == ref_ids and lps == ref_lps


@pytest.mark.skipif(not native.qblock_usable(), reason="GGUF blocks run natively on AVX-512 or AVX2 CPUs")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_K", "Q6_K"])  # 4-bit; 5-bit; 6-bit in groups of 16
@pytest.mark.parametrize("kernel", ["blocks", "blocks_amx", "amx"])  # int8 activations; AMX on the blocks; dequantized
def test_gguf_block_stacks_give_the_python_layers_bits(tmp_path, monkeypatch, qtype: str, kernel: str) -> None:
    import gguf

    from llmserve.kernels.calibrate import QBLOCK_LINEAR, available
    from tests.tiny_models import make_hf_model, write_tiny_gguf

    if kernel not in available(QBLOCK_LINEAR):
        pytest.skip(f"{kernel} does not run here")
    monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", f"bf16_linear=fma,qblock_linear={kernel}")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_hf_model("llama", vocab_size=300, hidden_size=256, intermediate_size=256)  # K-quants: 256-column rows
    path = write_tiny_gguf(hf, tmp_path / f"tiny.{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    _check_same_bits(path, monkeypatch, True)


@pytest.mark.skipif(not native.qblock_amx_dot_usable(), reason="needs AMX-BF16, AVX512-BF16 and VBMI")
@pytest.mark.parametrize("kernel", ["amx", "blocks_amx"])
def test_blocks_standing_in_for_the_tiles_give_the_same_tokens(tmp_path, monkeypatch, kernel: str) -> None:
    """Decode steps of up to 4 rows on the blocks' dot products (OpChoice.few_rows, forced here), the rest on the
    tiles: the same tokens and logprobs as the tiles alone, in the stack and in the Python layers, batched, chunked
    and preempted."""
    import dataclasses

    import gguf

    from llmserve.kernels import calibrate
    from llmserve.kernels.choice import FEW_BUCKETS
    from tests.tiny_models import make_hf_model, write_tiny_gguf

    monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", f"bf16_linear=fma,qblock_linear={kernel}")
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    if kernel == "blocks_amx":
        monkeypatch.setattr(calibrate, "_mem_available", lambda: 1)
    hf = make_hf_model("llama", vocab_size=300, hidden_size=256, intermediate_size=256)
    path = write_tiny_gguf(hf, tmp_path / "tiny.Q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
    ran: list[int] = []
    run = native.qblock_linear_amx_dot
    monkeypatch.setattr(native, "qblock_linear_amx_dot", lambda x, *a, **k: ran.append(x.shape[0]) or run(x, *a, **k))
    tiles = _run(path, monkeypatch, True, num_blocks=14, enable_prefix_caching=False)
    assert not ran

    plan = calibrate.plan

    def four_rows(*args, **kwargs):  # the pinned kernels, with 4 rows on the blocks
        table = plan(*args, **kwargs)
        ops = {op: dataclasses.replace(c, few_rows=4) if op.startswith("qblock_linear:") else c
               for op, c in table.ops.items()}
        return dataclasses.replace(table, ops=ops)

    assert 4 in FEW_BUCKETS
    monkeypatch.setattr(calibrate, "plan", four_rows)
    for stack in (True, False):
        ids, lps, calls = _run(path, monkeypatch, stack, num_blocks=14, enable_prefix_caching=False)
        assert (ids, lps) == tiles[:2] and (calls > 0) == stack
    assert ran and max(ran) <= 4  # the Python layers' calls (the stack's are native)


@needs_bf16_stack
def test_prefix_cache_hits_give_the_same_bits(tiny_model_dir, monkeypatch) -> None:
    # the second pass finds every prompt's full blocks in the prefix cache: its prefills start mid-context
    def twice(stack: bool) -> list:
        monkeypatch.setenv("LLMSERVE_DECODER_STACK", "1" if stack else "0")
        config = EngineConfig(dtype="bfloat16", num_blocks=96, block_size=4, enable_prefix_caching=True)
        with pipeline(tiny_model_dir("mistral"), backend_config=config) as pipe:
            return [[(o.token_ids, o.logprobs) for o in pipe([{"input_ids": p} for p in PROMPTS], gen_config=GEN,
                                                            do_preprocess=False)] for _ in range(2)]

    assert twice(True) == twice(False)


@needs_bf16_stack
def test_decodes_alone_where_prefill_attention_is_not_native(tiny_model_dir, monkeypatch) -> None:
    from llmserve.models import decoder_stack

    monkeypatch.setattr(decoder_stack, "runs_prefills", lambda model: False)
    _check_same_bits(tiny_model_dir("qwen2"), monkeypatch, BF16_PACKED)


@pytest.mark.parametrize("engine", [pytest.param({}, marks=needs_bf16_stack),
                                    {"dtype": "float32", "quantization": "int8"}])  # what an AVX2 CPU's stack runs
def test_preempted_requests_come_back_the_same(tiny_model_dir, monkeypatch, engine: dict) -> None:
    # 14 blocks of 4 tokens cannot hold all four requests to the end: some are preempted and recomputed
    _check_same_bits(tiny_model_dir("llama"), monkeypatch, BF16_PACKED, num_blocks=14, enable_prefix_caching=False,
                     **engine)


needs_fp32_stack = pytest.mark.skipif(not native.fp32_gemm_usable(), reason="fp32 linears run in the stack on fp32_gemm "
                                      "(AVX2 and FMA)")
FP32_FMA = {"dtype": "float32", "kernel_choice": "fp32_linear=fma"}


@needs_fp32_stack
@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "mistral", "qwen3"])  # biases, windows, q/k norm
@pytest.mark.parametrize("kv", ["auto", "int8", "int4"])
def test_fp32_stack_gives_the_python_layers_bits(tiny_model_dir, monkeypatch, arch: str, kv: str) -> None:
    """An fp32 model whose measured linear kernel is fp32_gemm (pinned here) runs its decode steps in the stack, on an
    AVX2 CPU too (int8 and int4 caches there keep the Python layers: their decode kernels need AVX-512)."""
    stack = kv == "auto" or native.int8_kv_decode_usable()
    _check_same_bits(tiny_model_dir(arch), monkeypatch, stack, kv_cache_dtype=kv, **FP32_FMA)


@needs_fp32_stack
def test_preempted_fp32_requests_come_back_the_same(tiny_model_dir, monkeypatch) -> None:
    _check_same_bits(tiny_model_dir("llama"), monkeypatch, True, num_blocks=14, enable_prefix_caching=False, **FP32_FMA)


@pytest.mark.parametrize(("arch", "engine"), [
    ("llama", {"dtype": "float32", "kernel_choice": "fp32_linear=onednn"}),  # fp32 linears in oneDNN
    ("llama", {"dtype": "float16", "quantization": "int8"}),  # int8 weights under fp16: the torch paths
])
def test_uncovered_models_keep_the_python_layers(tiny_model_dir, monkeypatch, arch: str, engine: dict) -> None:
    ids, _, calls = _run(tiny_model_dir(arch), monkeypatch, True, **engine)
    assert calls == 0 and all(len(seq) == GEN.max_new_tokens for seq in ids)


def test_reference_attention_turns_the_stack_off(tiny_model_dir, monkeypatch) -> None:
    # (int8 weights where bf16 ones have no stack: AVX2-only CPUs)
    engine = {} if native.packed_gemm_usable() else {"dtype": "float32", "quantization": "int8"}
    assert _run(tiny_model_dir("llama"), monkeypatch, True, **engine)[2] > 0
    monkeypatch.setenv("LLMSERVE_ATTENTION", "torch")
    assert _run(tiny_model_dir("llama"), monkeypatch, True, **engine)[2] == 0


@needs_bf16_stack
def test_the_stack_refuses_what_it_cannot_run() -> None:
    import torch

    native.load()
    stack_type = native._module.DecoderStack
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        stack_type(4, 3, 16, 128, 1e-6, 0.25)
    stack = stack_type(4, 2, 16, 128, 1e-6, 0.25)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, 8, dtype=torch.bfloat16)
    slots, tables, lens = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no layers"):
        stack.forward(x, cos, sin, slots, 1, tables, lens, None, None, torch.ones(64, dtype=torch.bfloat16), 0, 0)
    norm = torch.ones(64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)  # 2 blocks of 4 tokens

    def lin(n: int, k: int) -> list:
        return [native.bf16_pack(torch.randn(n, k).bfloat16()), n, None, None, None, 0]

    with pytest.raises(RuntimeError, match="qkv has 96 outputs, expected 128"):
        stack.add_layer(norm, norm, lin(96, 64), lin(64, 64), lin(256, 64), lin(64, 128), None, None, cache, cache, None,
                        None, -1)
    with pytest.raises(RuntimeError, match="bf16_pack'ed, fp32_pack'ed or w8a8_pack'ed"):
        stack.add_layer(norm, norm, [torch.zeros(8, 32, 16, 2, dtype=torch.int32), 128, None, None, None, 0],
                        lin(64, 64), lin(256, 64), lin(64, 128), None, None, cache, cache, None, None, -1)
    with pytest.raises(RuntimeError, match="fp32 qkv takes path 0"):
        stack.add_layer(norm, norm, [native.fp32_pack(torch.randn(128, 64)), 128, None, None, None, 1], lin(64, 64),
                        lin(256, 64), lin(64, 128), None, None, cache, cache, None, None, -1)
    with pytest.raises(RuntimeError, match="come together"):
        stack.add_layer(norm, norm, lin(128, 64), lin(64, 64), lin(256, 64), lin(64, 128), norm[:16], None, cache, cache,
                        None, None, -1)
    stack.add_layer(norm, norm, lin(128, 64), lin(64, 64), lin(256, 64), lin(64, 128), None, None, cache, cache, None,
                    None, -1)
    assert stack.num_layers == 1
    assert stack.forward(x, cos, sin, slots, 1, tables, lens, None, None, norm, 0, 0).shape == (1, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):  # a clean error, the GIL taken back
        stack.forward(x, cos, sin, torch.tensor([8]), 1, tables, lens, None, None, norm, 0, 0)
    with pytest.raises(RuntimeError, match="prefills need spans and slots"):
        stack.forward(x, cos, sin, slots, 0, None, None, None, None, norm, 0, 0)
    with pytest.raises(RuntimeError, match="num_decodes outside"):
        stack.forward(x, cos, sin, slots, 2, tables, lens, None, None, norm, 0, 0)


@pytest.mark.parametrize(("arch", "computed"), [("llama", True), ("qwen3", True), ("gemma2", False),
                                                 ("gemma3", False), ("phi3", False),  # phi3: partial rotary
                                                 ("mixtral", False), ("qwen2-moe", False)])  # MoE blocks
def test_stack_declines_layers_its_kernels_do_not_compute(tiny_model_dir, arch: str, computed: bool) -> None:
    """Gemma's (1 + w) norms, post-norms, GELU and soft-capped scores are not in the stack: such models keep the Python
    layers whatever their dtype."""
    from llmserve.models import decoder_stack, load_model

    model = load_model(tiny_model_dir(arch), EngineConfig(dtype="bfloat16", device="cpu")).model.model
    assert decoder_stack.computes(model) == computed


@pytest.mark.skipif(not native.prefill_amx_usable(), reason="prefill attention's amx path needs a CPU with AMX-BF16")
def test_stack_runs_the_amx_prefill_attention(tiny_model_dir, monkeypatch) -> None:
    """Prefill attention's amx path (head_dim 32: Qwen3's tiny model) gives the stack the Python layers' bits, and
    the Python layers do ask for it."""
    from llmserve.attention import torch_backend

    monkeypatch.setenv("LLMSERVE_KERNEL_CHOICE", "bf16_linear=fma,prefill_attention=amx")
    kernels = []
    run = native.prefill_attention
    monkeypatch.setattr(torch_backend.native, "prefill_attention", lambda *a: kernels.append(a[-1]) or run(*a))
    _check_same_bits(tiny_model_dir("qwen3"), monkeypatch, BF16_PACKED)
    assert kernels and set(kernels) == {"amx"}
