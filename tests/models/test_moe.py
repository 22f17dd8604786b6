"""Mixture of experts (layers/moe.py, models/moe.py): routing as transformers routes, the experts grouped by expert
equal to running each token through its own experts, both checkpoint layouts, quantization leaving the experts."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.config import EngineConfig as Config
from llmserve.errors import ModelLoadError
from llmserve.kernels import native
from llmserve.layers.activation import SiluAndMul
from llmserve.layers.linear import Linear
from llmserve.layers.moe import Routing, grouped_experts, route
from llmserve.models import load_model
from tests.tiny_models import PagedRunner, make_hf_model

CPU32 = Config(dtype="float32", device="cpu")


def _per_token(x: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The reference: each token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(routing.weights[t].tolist(), routing.experts[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_grouped_experts_equal_each_token_through_its_own(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    e, k, h, i = 6, 2, 16, 24
    x = torch.randn(tokens, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen) * 0.2, torch.randn(e, h, i, generator=gen) * 0.2
    # experts 0-3 only: 4 and 5 receive no token; each token's two experts distinct, in random order
    experts = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    routing = Routing(weights, experts)
    got = grouped_experts(x, routing, gate_up, down, SiluAndMul())
    torch.testing.assert_close(got, _per_token(x, routing, gate_up, down), atol=1e-5, rtol=1e-5)


def test_grouped_experts_of_no_tokens() -> None:
    x = torch.zeros(0, 8)
    routing = Routing(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    out = grouped_experts(x, routing, torch.randn(4, 6, 8), torch.randn(4, 8, 3), SiluAndMul())
    assert out.shape == (0, 8)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_routing_is_transformers(arch: str) -> None:
    """The same experts and the same weights, bit for bit, as transformers' router of the family (bf16: Qwen rounds
    its weights to the model dtype, Mixtral keeps them fp32)."""
    hf = make_hf_model(arch).to(torch.bfloat16)
    block = next(layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "gate"))
    x = torch.randn(40, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    _, ref_weights, ref_experts = block.gate(x)
    cfg = hf.config
    routing = route(torch.nn.functional.linear(x, block.gate.weight), cfg.num_experts_per_tok,
                    renormalize=getattr(cfg, "norm_topk_prob", True), model_dtype_weights=arch != "mixtral")
    assert routing.weights.dtype == ref_weights.dtype == (torch.float32 if arch == "mixtral" else torch.bfloat16)
    assert torch.equal(routing.experts, ref_experts) and torch.equal(routing.weights, ref_weights)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
def test_transformers5_stacked_layout_loads_as_the_hub_layout(arch: str, tiny_model_dir, tmp_path) -> None:
    """transformers 5 holds the experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H], no `.weight`); save_pretrained
    writes them one by one (the tiny checkpoints). A checkpoint of the former gives the same model."""
    hub = shutil.copytree(tiny_model_dir(arch), tmp_path / "hub")
    stacked = shutil.copytree(hub, tmp_path / "stacked")
    hf = make_hf_model(arch)  # the same seed as the tiny checkpoint
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in state)
    save_file(state, os.path.join(stacked, "model.safetensors"), metadata={"format": "pt"})
    a, b = load_model(os.fspath(hub), CPU32).model, load_model(os.fspath(stacked), CPU32).model
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    prompt = [(0, list(range(3, 20)))]
    assert torch.equal(PagedRunner(a).step(prompt)[0], PagedRunner(b).step(prompt)[0])


def test_a_missing_expert_is_named(tiny_model_dir, tmp_path) -> None:
    path = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "broken")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.experts\.2\.up_proj"):
        load_model(os.fspath(path), CPU32)


@pytest.mark.parametrize("quantization", ["int8", pytest.param("w8a8", marks=pytest.mark.skipif(
    not native.w8a8_usable(), reason="w8a8 needs a CPU with AVX-512 and VNNI"))])
def test_quantization_keeps_experts_and_router_in_the_model_dtype(tiny_model_dir, quantization: str) -> None:
    path = tiny_model_dir("qwen2-moe")
    first = GenerationConfig(temperature=0.0, max_new_tokens=1, ignore_eos=True, logprobs=20)
    prompts = [{"input_ids": list(range(3, 30))}, {"input_ids": [7, 7, 19]}]
    logprobs = []
    for method in (None, quantization):
        with pipeline(path, backend_config=EngineConfig(dtype="float32", quantization=method)) as pipe:
            model = pipe.engine.runner.model
            block = model.model.layers[0].mlp
            assert block.experts.gate_up_proj.dtype == block.gate.weight.dtype == torch.float32
            shared = block.shared_expert.down_proj
            quantized = shared.qweight is not None or shared.int8_packed is not None
            assert isinstance(shared, Linear) and quantized == (method is not None)
            logprobs.append([o.logprobs[0] for o in pipe(prompts, gen_config=first)])
    for a, b in zip(*logprobs):
        common = set(a) & set(b)
        assert len(common) >= 14 and max(abs(a[t] - b[t]) for t in common) < 0.25
