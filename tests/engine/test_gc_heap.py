"""The startup heap is frozen out of the cyclic collector's sight for a pipeline's life and thawed when it closes
(llmserve/engine/gc_heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from llmserve.api import pipeline
from llmserve.config import EngineConfig, GenerationConfig
from llmserve.engine import gc_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()  # whatever an earlier test's unclosed pipeline froze
    yield
    gc.unfreeze()


def test_a_pipeline_freezes_the_startup_heap_and_its_close_thaws_it(tiny_model_dir) -> None:
    pipe = pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(num_blocks=16))
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the model, tokenizer and engine: all out of the collector's walk
    assert pipe("hello", gen_config=GenerationConfig(max_new_tokens=4)).generate_token_len == 4
    pipe.close()
    assert gc.get_freeze_count() == 0


def test_freezing_can_be_turned_off(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_GC_FREEZE", "0")
    with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(num_blocks=16)):
        assert gc.get_freeze_count() == 0


def test_cyclic_garbage_among_frozen_objects_is_freed_once_thawed() -> None:
    node = _Node()
    ref = weakref.ref(node)
    assert gc_heap.freeze()
    del node
    gc.collect()
    assert ref() is not None  # frozen: the collector no longer looks at it
    gc_heap.thaw()
    gc.collect()
    assert ref() is None
