"""Session fixtures: one tiny-llama engine, shared by a default server and a strict one (API keys,
at most one request at a time); both real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.server.harness import EngineHandle, RunningServer, engine_for, running_server

API_KEYS = ["sk-test-1", "sk-test-2"]
# 512 blocks of 16 tokens: room for the load test's 80 concurrent sequences (<= 96 tokens each).
TINY_ENGINE = {"num_blocks": 512, "block_size": 16}


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: Callable[[str], str]) -> Iterator[EngineHandle]:
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", **TINY_ENGINE) as handle:
        yield handle


@pytest.fixture(scope="session")
def stack_tiny(tiny_model_dir: Callable[[str], str]) -> Iterator[EngineHandle]:
    """The same model in bf16 with w8a8 linears: its steps run in the native decoder stack, which releases the GIL."""
    from llmserve.kernels import native

    if not native.w8a8_usable():
        pytest.skip("the decoder stack's w8a8 path needs a CPU with AVX-512 and VNNI")
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", dtype="bfloat16", quantization="w8a8",
                    **TINY_ENGINE) as handle:
        yield handle


@pytest.fixture(scope="session")
def stack_server(stack_tiny: EngineHandle) -> Iterator[RunningServer]:
    with running_server(stack_tiny, enable_debug_routes=True) as s:
        yield s


@pytest.fixture(scope="session")
def async_tiny(tiny_model_dir: Callable[[str], str]) -> Iterator[EngineHandle]:
    """The same model with async scheduling forced on (the default only with CUDA): decode steps launched before the
    previous step's tokens are read."""
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", async_scheduling=True, **TINY_ENGINE) as handle:
        yield handle


@pytest.fixture(scope="session")
def async_server(async_tiny: EngineHandle) -> Iterator[RunningServer]:
    with running_server(async_tiny, enable_debug_routes=True) as s:
        yield s


@pytest.fixture(scope="session")
def server(tiny: EngineHandle) -> Iterator[RunningServer]:
    with running_server(tiny, enable_debug_routes=True) as s:
        yield s


@pytest.fixture(scope="session")
def strict_server(tiny: EngineHandle) -> Iterator[RunningServer]:
    with running_server(tiny, api_keys=API_KEYS, max_concurrent_requests=1) as s:
        yield s
