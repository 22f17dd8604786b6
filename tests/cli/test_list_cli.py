"""`llmserve list`: every architecture the registry serves, one a line."""

from __future__ import annotations

import pytest

from llmserve.cli import main


def test_list_names_every_architecture(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    lines = {line.strip() for line in capsys.readouterr().out.splitlines()}
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM"} <= lines
