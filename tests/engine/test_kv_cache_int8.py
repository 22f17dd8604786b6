"""kv_cache_dtype="int8" (LMDeploy's quant_policy=8): K/V stored as int8 with one fp32 scale per token and KV head,
through the whole engine: the native writer and decode kernel against the torch reference, batching, chunked and
prefix-cached prefills, preemption, beam forks, the block budget and the config."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.attention.torch_backend import quantize_int8, write_kv
from llmserve.errors import InvalidRequestError
from llmserve.kernels import native
from llmserve.models import load_model
from llmserve.worker.model_runner import cache_spec, num_blocks_for

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 3, 8, 100, 4, 61], [7, 7, 19], list(range(3, 40))]
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=1)
needs_native = pytest.mark.skipif(not native.int8_kv_decode_usable(),
                                  reason="the native int8 KV path needs the extension and AVX-512")


def _config(**engine) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "num_blocks": 48, "block_size": 4, **engine})


def _run(model_dir: str, monkeypatch: pytest.MonkeyPatch, attention: str | None, prompts: list[list[int]] = PROMPTS,
         **engine) -> tuple[set, list[list[int]], list[list[float]]]:
    """(cache dtypes, token ids, chosen-token logprobs) of a greedy batch."""
    if attention:
        monkeypatch.setenv("LLMSERVE_ATTENTION", attention)
    else:
        monkeypatch.delenv("LLMSERVE_ATTENTION", raising=False)
    with pipeline(model_dir, backend_config=_config(**engine)) as pipe:
        layers = pipe.engine.runner.model.attention_layers()
        caches = {(layer.kv_cache.dtype, None if layer.kv_scales is None else layer.kv_scales.dtype) for layer in layers}
        out = pipe([{"input_ids": p} for p in prompts], gen_config=GREEDY, do_preprocess=False)
    return caches, [o.token_ids for o in out], [[next(iter(s.values())) for s in o.logprobs] for o in out]


# kv_cache_dtype -> (the cache's dtype, its scales' dtype); int4 (tests/engine/test_kv_cache_int4.py) packs two values
# a byte with an fp16 scale and zero point
CACHE_DTYPES = {"int8": (torch.int8, torch.float32), "int4": (torch.uint8, torch.float16)}


@needs_native
@pytest.mark.parametrize("kv", CACHE_DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: mixed sliding-window and full layers
@pytest.mark.parametrize("chunk", [4096, 8])  # 8: prompts prefilled in chunks that read earlier chunks' quantized K/V
def test_native_and_torch_paths_agree(tiny_model_dir, monkeypatch, arch: str, chunk: int, kv: str) -> None:
    """The native writer stores the reference's bytes and the native kernel reads them as the reference does."""
    path = tiny_model_dir(arch)
    native_caches, native_ids, native_lp = _run(path, monkeypatch, None, kv_cache_dtype=kv,
                                                max_prefill_token_num=chunk)
    torch_caches, torch_ids, torch_lp = _run(path, monkeypatch, "torch", kv_cache_dtype=kv,
                                             max_prefill_token_num=chunk)
    assert native_caches == torch_caches == {CACHE_DTYPES[kv]}
    assert native_ids == torch_ids
    for a, b in zip(native_lp, torch_lp):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_cache_stays_close_to_fp32(tiny_model_dir, monkeypatch, arch: str) -> None:
    path = tiny_model_dir(arch)
    _, ids, lps = _run(path, monkeypatch, None)
    _, q_ids, q_lps = _run(path, monkeypatch, None, quant_policy=8)
    # The first token's logits saw the prompt's K/V fresh from the prefill (never through the cache): equal.
    # Not under qwen2's sliding window, whose prefill of a prompt longer than the window reads the cache.
    assert [i[0] for i in q_ids] == [i[0] for i in ids]
    if arch == "llama":
        assert [lp[0] for lp in q_lps] == pytest.approx([lp[0] for lp in lps], abs=1e-5)
    # Later tokens read quantized K/V: the chosen tokens' logprobs stay close while the sequences agree.
    for a, b, ta, tb in zip(q_lps, lps, q_ids, ids):
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        assert a[:same] == pytest.approx(b[:same], abs=0.05)


def test_batched_equals_one_at_a_time(tiny_model_dir) -> None:
    """Decodes read the cache per request and head, and the write quantizes per token: a request's tokens do not
    depend on what else runs in its step."""
    gen = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype="int8")) as pipe:
        together = [o.token_ids for o in pipe([{"input_ids": p} for p in PROMPTS], gen_config=gen,
                                               do_preprocess=False)]
        alone = [pipe({"input_ids": p}, gen_config=gen, do_preprocess=False).token_ids for p in PROMPTS]
    assert together == alone


def test_prefix_cache_hit_reads_the_cached_int8_blocks(tiny_model_dir) -> None:
    """The second run of a prompt prefills only its last token, attending over the prefix's int8 blocks: the
    distribution of its first token stays close to the first run's (which attended over fresh K/V)."""
    gen = GenerationConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True, logprobs=5)
    long = list(range(3, 40))  # 37 tokens: 9 full blocks of 4 are reusable
    with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype="int8")) as pipe:
        first = pipe({"input_ids": long}, gen_config=gen, do_preprocess=False)
        again = pipe({"input_ids": long}, gen_config=gen, do_preprocess=False)
        assert pipe.engine.kv.prefix_stats.hit_tokens == 36
    common = set(first.logprobs[0]) & set(again.logprobs[0])
    assert len(common) >= 4
    assert max(abs(first.logprobs[0][t] - again.logprobs[0][t]) for t in common) < 0.05


def test_preemption_recomputes_and_frees_everything(tiny_model_dir) -> None:
    gen = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    prompts = [list(range(3 + i, 30 + i)) for i in range(4)]
    with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype="int8", num_blocks=16)) as pipe:
        out = pipe([{"input_ids": p} for p in prompts], gen_config=gen, do_preprocess=False)
        engine = pipe.engine
        assert engine.scheduler.num_preemptions > 0
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in out)


@pytest.mark.parametrize("kv", CACHE_DTYPES)
def test_copy_blocks_copies_the_scales_too(tiny_model_dir, kv: str) -> None:
    """Beam forks copy blocks; a quantized block without its scales (int4: scales and zero points) would dequantize
    to the wrong values."""
    with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype=kv)) as pipe:
        runner = pipe.engine.runner
        layer = runner.model.attention_layers()[0]
        k = torch.randn(4, layer.num_kv_heads, layer.head_dim)
        write_kv(layer.kv_cache, k, k * 3, torch.tensor([4, 5, 6, 7]), layer.kv_scales)  # block 1
        runner.copy_blocks([(1, 9)])
        torch.testing.assert_close(layer.kv_cache[:, 9], layer.kv_cache[:, 1], rtol=0, atol=0)
        torch.testing.assert_close(layer.kv_scales[:, 9], layer.kv_scales[:, 1], rtol=0, atol=0)
        assert layer.kv_scales[1, 9].abs().sum() > 0
        gen = GenerationConfig(use_beam_search=True, n=3, max_new_tokens=6, ignore_eos=True, temperature=0.0)
        beams = pipe({"input_ids": PROMPTS[0]}, gen_config=gen, do_preprocess=False)
        assert len(beams) == 3 and all(len(b.token_ids) == 6 for b in beams)
        pipe.engine.kv.check_invariants()


def test_beam_search_on_an_int8_cache_finds_the_fp32_beams(tiny_model_dir) -> None:
    """Beams fork inside the prompt's partial last block (13 tokens, blocks of 4), so every fork copies a block;
    a copy without its scales reads that token's K/V as zeros and the beams diverge (checked by breaking it)."""
    gen = GenerationConfig(use_beam_search=True, n=3, max_new_tokens=6, ignore_eos=True, temperature=0.0)
    beams = {}
    for kv in ("auto", "int8"):
        with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype=kv)) as pipe:
            beams[kv] = [o.token_ids for o in pipe({"input_ids": PROMPTS[0]}, gen_config=gen, do_preprocess=False)]
    assert beams["int8"] == beams["auto"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 100])  # 100: the writer's scalar loop
def test_native_writer_stores_the_reference_bytes(dtype: torch.dtype, head_dim: int) -> None:
    if native.load() is None:
        pytest.skip("native extension did not build here")
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(37, 5, head_dim, generator=g) * torch.rand(37, 5, 1, generator=g) * 8).to(dtype)
    k, v = qkv[:, 1:3], qkv[:, 3:5]  # strided token rows, as the views of a fused QKV output are
    k[3, 1] = 0  # an all-zero row: scale 0, zeros
    kv_cache = torch.full((2, 12, 4, 2, head_dim), 99, dtype=torch.int8)
    kv_scales = torch.full((2, 12, 4, 2), -1.0)
    slots = torch.randperm(48, generator=g)[:37]
    native.write_kv_int8(kv_cache, kv_scales, k, v, slots)
    flat, flat_scales = kv_cache.view(2, 48, 2, head_dim), kv_scales.view(2, 48, 2)
    for i, x in enumerate((k, v)):
        q, s = quantize_int8(x)
        assert torch.equal(flat[i, slots], q) and torch.equal(flat_scales[i, slots], s)
        assert q.abs().amax(-1)[s > 0].min() == 127  # the largest element of each row maps to +-127
    assert torch.equal(flat_scales[0, slots[3], 1], torch.tensor(0.0)) and not flat[0, slots[3], 1].any()
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[:, untouched] == 99).all() and (flat_scales[:, untouched] == -1).all()
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.write_kv_int8(kv_cache, kv_scales, k[:1], v[:1], torch.tensor([48]))


def test_int8_budget_holds_nearly_twice_the_tokens_of_bf16(tiny_model_dir) -> None:
    loaded = load_model(tiny_model_dir("llama"), EngineConfig(device="cpu", dtype="float32"))
    spec = cache_spec(loaded, "int8")
    assert spec.dtype == torch.int8 and spec.quantized
    assert spec.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim + 4)
    half = num_blocks_for(loaded, 4, 1 << 20, 0.8, kv_cache_dtype="bfloat16")
    assert num_blocks_for(loaded, 4, 1 << 20, 0.8, kv_cache_dtype="int8") == (1 << 20) // (4 * spec.bytes_per_token)
    assert num_blocks_for(loaded, 4, 1 << 20, 0.8, kv_cache_dtype="int8") > half


def test_quant_policy_names_the_int8_cache() -> None:
    assert EngineConfig(quant_policy=8).kv_cache_dtype == "int8"
    assert EngineConfig(quant_policy=8, kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert EngineConfig().quant_policy == 0 and EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(InvalidRequestError, match="quant_policy: must be 0, 4 or 8, got 16"):
        EngineConfig(quant_policy=16)
    with pytest.raises(InvalidRequestError, match="contradicts kv_cache_dtype='bfloat16'"):
        EngineConfig(quant_policy=8, kv_cache_dtype="bfloat16")
    with pytest.raises(InvalidRequestError, match="quant_policy: expected int"):
        EngineConfig(quant_policy="8")


@pytest.mark.slow
def test_smollm2_on_an_int8_cache_still_answers_paris() -> None:
    with pipeline(backend_config=EngineConfig(dtype="bfloat16", quant_policy=8)) as pipe:
        out = pipe("What is the capital of France? Answer in one sentence.",
                   gen_config=GenerationConfig(max_new_tokens=12, temperature=0))
    assert out.text == "The capital of France is Paris."


def test_perplexity_script_compares_cache_dtypes(tiny_model_dir) -> None:
    """scripts/perplexity.py (the int8 cache's quality figure in BENCHMARKS.md) runs and reads the cache."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "scripts" / "perplexity.py"), "--model", tiny_model_dir("llama"),
                          "--file", str(root / "README.md"), "--tokens", "96", "--chunk", "8",
                          "--config", "dtype=float32,num_blocks=64", "--config",
                          "dtype=float32,num_blocks=64,kv_cache_dtype=int8"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    ppl = [float(x) for x in re.findall(r"perplexity ([0-9.]+) over 95 tokens", out)]
    assert len(ppl) == 2 and all(math.isfinite(p) and p > 1 for p in ppl)
    assert ppl[0] != ppl[1] and ppl[1] == pytest.approx(ppl[0], rel=0.02)  # chunks read the (quantized) cache
