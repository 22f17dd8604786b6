"""LMDeploy's TurbomindEngineConfig and PytorchEngineConfig (llmserve/lmdeploy_compat.py): each field mapped onto
EngineConfig, accepted with no effect, or refused naming it; and the text-only examples of seeds 000 (LMDeploy's
pipeline tutorial) and 001 (its guide) run with only the import (`lmdeploy` -> `llmserve`) and the model changed.

The model: the embedded SmolLM2-135M-Instruct where an example generates (the seeds' max_new_tokens of 512 and 1024
need its 8192-token context), the tiny test model where an example only builds a pipeline. Changed beyond that: the
tutorial's `tp=2` is `tp=TP` (1; tp=2 is refused, tested on its own). The seeds' VLM examples (images through
lmdeploy.vl.load_image, GPT-4V message parts, VLM chat-template names) are out of scope.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest

from llmserve import (
    EngineConfig,
    GenerationConfig,
    InvalidRequestError,
    PytorchEngineConfig,
    TurbomindEngineConfig,
)
from llmserve import pipeline as llmserve_pipeline
from llmserve.api import Response
from llmserve.cli import build_parser, main

MODEL = None  # the embedded SmolLM2-135M-Instruct, for 'internlm/internlm2-chat-7b'
TP = 1  # the tutorial's tp=2 runs (tests/distributed: the embedded model with tp=2), but 2 x 1024 sampled tokens on one core per rank take 4 min
PROMPTS = [[{"role": "user", "content": "Hi, pls intro yourself"}], [{"role": "user", "content": "Shanghai is"}]]


# --- the mapping ----------------------------------------------------------------------------------------------------

def test_defaults_are_lmdeploys() -> None:
    # prefix caching off, as LMDeploy; TurboMind's 8192-token steps, PyTorch's 4096 (EngineConfig's own is 2048)
    assert TurbomindEngineConfig().to_engine_config() == \
        EngineConfig(enable_prefix_caching=False, max_prefill_token_num=8192)
    assert PytorchEngineConfig().to_engine_config() == \
        EngineConfig(enable_prefix_caching=False, max_prefill_token_num=4096)


def test_every_mapped_turbomind_field() -> None:
    config = TurbomindEngineConfig(dtype="bfloat16", tp=1, session_len=512, max_batch_size=8, cache_max_entry_count=0.5,
                                   cache_block_seq_len=16, enable_prefix_caching=True, quant_policy=8,
                                   download_dir="/tmp/models", revision="v1", max_prefill_token_num=1024)
    assert config.to_engine_config() == EngineConfig(
        dtype="bfloat16", session_len=512, max_batch_size=8, cache_max_entry_count=0.5, block_size=16,
        enable_prefix_caching=True, quant_policy=8, download_dir="/tmp/models", revision="v1",
        max_prefill_token_num=1024)
    assert config.to_engine_config().kv_cache_dtype == "int8"
    # num_tokens_per_iter is TurboMind's whole step budget, which is what max_prefill_token_num means here
    assert TurbomindEngineConfig(num_tokens_per_iter=256, max_prefill_token_num=1024).to_engine_config() == \
        EngineConfig(enable_prefix_caching=False, max_prefill_token_num=256)


def test_every_mapped_pytorch_field() -> None:
    config = PytorchEngineConfig(dtype="float16", tp=1, session_len=2048, max_batch_size=4, cache_max_entry_count=0.3,
                                 block_size=32, num_gpu_blocks=100, max_prefill_token_num=512,
                                 enable_prefix_caching=True, device_type="cpu", eager_mode=True,
                                 download_dir="/tmp/models", revision="main", quant_policy=8)
    assert config.to_engine_config() == EngineConfig(
        dtype="float16", session_len=2048, max_batch_size=4, cache_max_entry_count=0.3, block_size=32,
        num_blocks=100, max_prefill_token_num=512, enable_prefix_caching=True, device="cpu", enforce_eager=True,
        download_dir="/tmp/models", revision="main", quant_policy=8)
    assert PytorchEngineConfig(device_type="cuda").to_engine_config().device == "cuda"
    assert PytorchEngineConfig(num_gpu_blocks=0).to_engine_config().num_blocks is None  # 0: sized by the engine


@pytest.mark.parametrize("fmt, quantization", [(None, None), ("hf", None), ("awq", "awq"), ("gptq", "gptq")])
def test_model_format_names_the_checkpoints_quantization(fmt: str | None, quantization: str | None) -> None:
    assert TurbomindEngineConfig(model_format=fmt).to_engine_config().quantization == quantization


def test_adapters_map_to_lora() -> None:
    config = PytorchEngineConfig(adapters={"a": "/lora/a"}).to_engine_config()
    assert config.adapters == {"a": "/lora/a"} and config.enable_lora


def test_values_that_ask_for_nothing_are_accepted() -> None:
    same = TurbomindEngineConfig().to_engine_config()
    assert TurbomindEngineConfig(model_format="hf", cache_chunk_size=1, rope_scaling_factor=0.0, use_logn_attn=False,
                                 max_prefill_iters=8, communicator="native", model_name="").to_engine_config() == same
    same = PytorchEngineConfig().to_engine_config()
    assert PytorchEngineConfig(dp=1, ep=1, dp_rank=0, prefill_interval=4, num_cpu_blocks=0, adapters={},
                               thread_safe=False, custom_module_map=None, distributed_executor_backend="uni",
                               should_execute_dummy_batch=False, eviction_type="recompute",
                               model_name=None).to_engine_config() == same


REFUSED: list[tuple[type, dict[str, Any], str, str]] = [
    (TurbomindEngineConfig, {"tp": 0}, "tp", "TurbomindEngineConfig.tp: must be >= 1, got 0"),
    (TurbomindEngineConfig, {"model_format": "fp8"}, "model_format",
     "TurbomindEngineConfig.model_format='fp8': llmserve loads Hugging Face checkpoints"),
    (TurbomindEngineConfig, {"rope_scaling_factor": 2.5}, "rope_scaling_factor",
     "TurbomindEngineConfig.rope_scaling_factor=2.5: dynamic NTK scaling is read from the model's config.json"),
    (TurbomindEngineConfig, {"use_logn_attn": True}, "use_logn_attn",
     "TurbomindEngineConfig.use_logn_attn=True: logarithmic attention scaling is not implemented"),
    (TurbomindEngineConfig, {"cache_chunk_size": 4}, "cache_chunk_size",
     "TurbomindEngineConfig.cache_chunk_size=4: TurboMind's policy of growing its KV pool in chunks"),
    (TurbomindEngineConfig, {"model_name": "internlm2"}, "model_name",
     "TurbomindEngineConfig.model_name='internlm2': deprecated in LMDeploy"),
    (TurbomindEngineConfig, {"quant_policy": 2}, "quant_policy",
     "TurbomindEngineConfig.quant_policy: must be 0, 4 or 8, got 2"),
    (TurbomindEngineConfig, {"cache_block_seq_len": 0}, "cache_block_seq_len",
     "TurbomindEngineConfig.cache_block_seq_len: must be >= 1, got 0"),
    (TurbomindEngineConfig, {"num_tokens_per_iter": -1}, "num_tokens_per_iter",
     "TurbomindEngineConfig.num_tokens_per_iter=-1: must be >= 0"),
    (TurbomindEngineConfig, {"max_prefill_iters": 0}, "max_prefill_iters",
     "TurbomindEngineConfig.max_prefill_iters: expected int >= 1, got 0"),
    (TurbomindEngineConfig, {"cache_max_entry_count": 1.5}, "cache_max_entry_count",
     "TurbomindEngineConfig.cache_max_entry_count: must be in (0, 1], got 1.5"),
    (TurbomindEngineConfig, {"dtype": "int4"}, "dtype", "TurbomindEngineConfig.dtype: must be auto, float32"),
    (TurbomindEngineConfig, {"devices": [0, 1]}, "devices",
     "TurbomindEngineConfig.devices: not a field llmserve knows"),
    (PytorchEngineConfig, {"dp_rank": 1}, "dp_rank", "PytorchEngineConfig.dp_rank=1: llmserve starts its data-parallel"),
    (PytorchEngineConfig, {"ep": 4}, "ep", "PytorchEngineConfig.ep=4: expert parallelism is not implemented"),
    (PytorchEngineConfig, {"num_cpu_blocks": 128}, "num_cpu_blocks",
     "PytorchEngineConfig.num_cpu_blocks=128: LMDeploy's host-memory swap space"),
    (PytorchEngineConfig, {"eviction_type": "copy"}, "eviction_type",
     "PytorchEngineConfig.eviction_type='copy': llmserve evicts by recompute only"),
    (PytorchEngineConfig, {"thread_safe": True}, "thread_safe",
     "PytorchEngineConfig.thread_safe=True: a pipeline is driven by one thread"),
    (PytorchEngineConfig, {"device_type": "ascend"}, "device_type",
     "PytorchEngineConfig.device_type='ascend': llmserve runs on cuda or cpu"),
    (PytorchEngineConfig, {"custom_module_map": {"a": "b"}}, "custom_module_map",
     "PytorchEngineConfig.custom_module_map={'a': 'b'}: llmserve's model code is its own"),
    (PytorchEngineConfig, {"distributed_executor_backend": "ray"}, "distributed_executor_backend",
     "PytorchEngineConfig.distributed_executor_backend='ray': llmserve starts its tensor-parallel ranks itself"),
    (PytorchEngineConfig, {"prefill_interval": "16"}, "prefill_interval",
     "PytorchEngineConfig.prefill_interval: expected int >= 1, got '16'"),
    (PytorchEngineConfig, {"block_size": 0}, "block_size", "PytorchEngineConfig.block_size: must be >= 1, got 0"),
    (PytorchEngineConfig, {"num_gpu_blocks": -2}, "num_gpu_blocks",
     "PytorchEngineConfig.num_gpu_blocks: must be >= 1, got -2"),
]


@pytest.mark.parametrize(("cls", "kwargs", "param", "message"), REFUSED,
                         ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _, _ in REFUSED])
def test_refused_fields_name_themselves_and_say_why(cls: type, kwargs: dict[str, Any], param: str,
                                                    message: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        cls(**kwargs)
    assert e.value.param == param
    assert str(e.value).startswith(message)


def test_every_refusal_is_listed_at_once() -> None:
    with pytest.raises(InvalidRequestError) as e:
        PytorchEngineConfig(ep=2, thread_safe=True)
    assert (e.value.param, str(e.value).count("PytorchEngineConfig.")) == ("ep", 2)


def test_a_config_changed_after_construction_is_checked_when_used() -> None:
    config = TurbomindEngineConfig()
    config.use_logn_attn = True
    with pytest.raises(InvalidRequestError, match="use_logn_attn=True"):
        llmserve_pipeline("unused", backend_config=config)


def test_pipeline_refuses_a_backend_config_of_another_type() -> None:
    with pytest.raises(InvalidRequestError, match="backend_config must be an EngineConfig, TurbomindEngineConfig or "
                                                  "PytorchEngineConfig, got dict") as e:
        llmserve_pipeline("unused", backend_config={"tp": 1})
    assert e.value.param == "backend_config"


def test_pipeline_builds_the_engine_of_the_equivalent_engine_config(tiny_model_dir: Callable[[str], str]) -> None:
    model = tiny_model_dir("llama")
    lmdeploy = PytorchEngineConfig(session_len=128, max_batch_size=4, block_size=16, num_gpu_blocks=32,
                                   device_type="cpu", max_prefill_token_num=64)
    ours = EngineConfig(session_len=128, max_batch_size=4, block_size=16, num_blocks=32, device="cpu",
                        max_prefill_token_num=64, enable_prefix_caching=False)
    gen = GenerationConfig(temperature=0.0, max_new_tokens=8)
    with llmserve_pipeline(model, backend_config=lmdeploy) as a, llmserve_pipeline(model, backend_config=ours) as b:
        assert a.engine.config == b.engine.config == ours
        assert (a.engine.session_len, a.engine.kv.num_blocks, a.engine.kv.block_size) == (128, 32, 16)
        prompts = ["Hello world", "The capital of France is"]
        assert [r.token_ids for r in a(prompts, gen_config=gen)] == [r.token_ids for r in b(prompts, gen_config=gen)]


def test_serve_takes_lmdeploys_backend_flag_and_says_it_changes_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import llmserve.serve.server

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(llmserve.serve.server, "serve", lambda *args, **kwargs: calls.append(args) or 0)
    with caplog.at_level(logging.WARNING, logger="llmserve"):
        assert main(["serve", "some/model", "--backend", "turbomind", "--session-len", "512"]) == 0
    assert calls[0][0] == "some/model" and calls[0][1] == EngineConfig(session_len=512)
    assert "--backend turbomind: llmserve has one engine, which serves either way" in caplog.text
    assert build_parser().parse_args(["serve", "--backend", "pytorch"]).backend == "pytorch"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--backend", "vllm"])


# --- seed 000: LMDeploy's pipeline tutorial -------------------------------------------------------------------------

def _check_batch(response: list[Response]) -> None:
    assert [r.index for r in response] == [0, 1]
    for r in response:
        assert r.text and r.finish_reason in ("stop", "length") and r.generate_token_len == len(r.token_ids)


@pytest.mark.slow
def test_seed_000_default_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    from llmserve import pipeline

    pipe = pipeline(MODEL)
    response = pipe(['Hi, pls intro yourself', 'Shanghai is'])
    print(response)
    _check_batch(response)
    assert capsys.readouterr().out == repr(response) + "\n"
    pipe.close()


@pytest.mark.slow
def test_seed_000_kv_cache_ratio() -> None:
    from llmserve import TurbomindEngineConfig, pipeline

    # decrease the ratio of the k/v cache occupation to 20%
    backend_config = TurbomindEngineConfig(cache_max_entry_count=0.2)

    pipe = pipeline(MODEL,
                    backend_config=backend_config)
    response = pipe(['Hi, pls intro yourself', 'Shanghai is'])
    print(response)
    _check_batch(response)
    assert pipe.engine.config == EngineConfig(cache_max_entry_count=0.2, enable_prefix_caching=False,
                                              max_prefill_token_num=8192)
    pipe.close()


def test_seed_000_tensor_parallel_maps_to_tp() -> None:
    from llmserve import PytorchEngineConfig, TurbomindEngineConfig

    assert TurbomindEngineConfig(tp=2).to_engine_config().tp == 2
    assert PytorchEngineConfig(tp=2).to_engine_config().tp == 2


@pytest.mark.slow
def test_seed_000_sampling_openai_prompts_and_streaming() -> None:
    from llmserve import GenerationConfig, TurbomindEngineConfig, pipeline

    backend_config = TurbomindEngineConfig(tp=TP)
    gen_config = GenerationConfig(top_p=0.8,
                                  top_k=40,
                                  temperature=0.8,
                                  max_new_tokens=1024)
    pipe = pipeline(MODEL,
                    backend_config=backend_config)
    response = pipe(['Hi, pls intro yourself', 'Shanghai is'],
                    gen_config=gen_config)
    print(response)
    _check_batch(response)

    prompts = [[{
        'role': 'user',
        'content': 'Hi, pls intro yourself'
    }], [{
        'role': 'user',
        'content': 'Shanghai is'
    }]]
    response = pipe(prompts,
                    gen_config=gen_config)
    print(response)
    _check_batch(response)

    items = []
    for item in pipe.stream_infer(prompts, gen_config=gen_config):
        print(item)
        items.append(item)
    for index in (0, 1):
        mine = [i for i in items if i.index == index]
        assert mine[-1].finish_reason in ("stop", "length") and all(i.finish_reason is None for i in mine[:-1])
        assert "".join(i.text for i in mine) and sum(len(i.token_ids) for i in mine) == mine[-1].generate_token_len
    pipe.close()


@pytest.mark.slow
def test_seed_000_pytorch_backend() -> None:
    from llmserve import GenerationConfig, PytorchEngineConfig, pipeline

    backend_config = PytorchEngineConfig(session_len=2048)
    gen_config = GenerationConfig(top_p=0.8,
                                  top_k=40,
                                  temperature=0.8,
                                  max_new_tokens=1024)
    pipe = pipeline(MODEL,
                    backend_config=backend_config)
    prompts = [[{
        'role': 'user',
        'content': 'Hi, pls intro yourself'
    }], [{
        'role': 'user',
        'content': 'Shanghai is'
    }]]
    response = pipe(prompts, gen_config=gen_config)
    print(response)
    _check_batch(response)
    assert pipe.engine.session_len == 2048
    pipe.close()


# --- seed 001: LMDeploy's guide (engine configuration and chat); its model is a VLM, so the tiny model builds these --

CONSTRUCTED: list[tuple[Callable[[], Any], dict[str, Any]]] = [
    (lambda: TurbomindEngineConfig(session_len=8192), {"session_len": 8192}),
    (lambda: PytorchEngineConfig(session_len=8192), {"session_len": 8192}),
    (lambda: TurbomindEngineConfig(max_batch_size=256), {"max_batch_size": 256}),
    (lambda: PytorchEngineConfig(max_batch_size=256), {"max_batch_size": 256}),
    (lambda: TurbomindEngineConfig(enable_prefix_caching=True), {"enable_prefix_caching": True}),
    (lambda: PytorchEngineConfig(enable_prefix_caching=True), {"enable_prefix_caching": True}),
    (lambda: TurbomindEngineConfig(max_prefill_token_num=8192), {"max_prefill_token_num": 8192}),
    (lambda: PytorchEngineConfig(max_prefill_token_num=4096), {"max_prefill_token_num": 4096}),
    (lambda: TurbomindEngineConfig(quant_policy=8), {"quant_policy": 8, "kv_cache_dtype": "int8"}),
    (lambda: PytorchEngineConfig(quant_policy=4), {"quant_policy": 4, "kv_cache_dtype": "int4"}),
    (lambda: TurbomindEngineConfig(model_format=None), {}),
]


@pytest.mark.parametrize(("make", "expected"), CONSTRUCTED, ids=[str(i) for i in range(len(CONSTRUCTED))])
def test_seed_001_engine_settings(tiny_model_dir: Callable[[str], str], make: Callable[[], Any],
                                  expected: dict[str, Any]) -> None:
    from llmserve import pipeline

    backend_config = make()
    pipe = pipeline(tiny_model_dir("llama"),
                    backend_config=backend_config)
    base = EngineConfig(enable_prefix_caching=False,
                        max_prefill_token_num=8192 if isinstance(backend_config, TurbomindEngineConfig) else 4096)
    assert dataclasses.asdict(pipe.engine.config) == {**dataclasses.asdict(base), **expected}
    pipe.close()


def test_seed_001_refusals() -> None:
    from llmserve import TurbomindEngineConfig

    with pytest.raises(InvalidRequestError) as e:  # the dynamic NTK example
        TurbomindEngineConfig(
            rope_scaling_factor=2.5,
            session_len=1000000,
            max_batch_size=1,
            cache_max_entry_count=0.9,
            tp=2)
    assert e.value.param == "rope_scaling_factor"
    # the AWQ example: the checkpoint must be AWQ (tests/models/test_awq_gptq.py loads one so)
    assert TurbomindEngineConfig(
        model_format='awq').to_engine_config().quantization == "awq"


@pytest.mark.slow
def test_seed_001_multi_turn_chat() -> None:
    from llmserve import GenerationConfig, TurbomindEngineConfig, pipeline

    pipe = pipeline(MODEL,
                    backend_config=TurbomindEngineConfig(session_len=8192))
    gen_config = GenerationConfig(top_k=40, top_p=0.8, temperature=0.6)
    sess = pipe.chat('Describe Shanghai in one sentence.', gen_config=gen_config)  # the seed's turn has an image
    print(sess.response.text)
    sess = pipe.chat('What is the weather like there?', session=sess, gen_config=gen_config)
    print(sess.response.text)
    assert [m["role"] for m in sess.history] == ["user", "assistant", "user", "assistant"]
    assert sess.response.text and sess.history[-1]["content"] == sess.response.text
    pipe.close()


def test_turbomind_and_pytorch_configs_are_exported() -> None:
    import llmserve

    assert {"TurbomindEngineConfig", "PytorchEngineConfig"} <= set(llmserve.__all__)
    assert llmserve.TurbomindEngineConfig is TurbomindEngineConfig and llmserve.PytorchEngineConfig is PytorchEngineConfig
