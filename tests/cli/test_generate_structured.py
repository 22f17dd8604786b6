"""`llmserve generate` with a constraint (--json-schema, --json, --regex, --choice, --grammar), run as a user runs it,
on the tiny random model: the printed answer matches, and a bad constraint is a one-line error with exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def generate(model: str, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmserve.cli", "generate", model, "Hello", "--temperature", "0",
           "--max-new-tokens", "40", "--dtype", "float32", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_each_constraint_flag(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    schema = tmp_path / "schema.json"
    # (a random model fills JSON's optional whitespace forever: a schema without any keeps the test short)
    schema.write_text(json.dumps({"enum": ["yes", "no", [1, 2]]}))
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "The " ("fox" | "dog")')
    out = generate(model, "--json-schema", str(schema), "--no-chat-template")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) in ("yes", "no", [1, 2])
    out = generate(model, "--regex", "[a-c]{3}x")
    assert re.fullmatch("[a-c]{3}x\n", out.stdout), out.stdout
    out = generate(model, "--choice", "Paris", "London")
    assert out.stdout in ("Paris\n", "London\n")
    out = generate(model, "--grammar", str(grammar))
    assert out.stdout in ("The fox\n", "The dog\n")


def test_bad_constraints_exit_2_with_the_reason(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    out = generate(model, "--regex", "(a")
    assert out.returncode == 2 and "--regex: the regex could not be compiled" in out.stderr
    out = generate(model, "--json-schema", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "--json-schema: cannot read" in out.stderr
    out = generate(model, "--regex", "a", "--choice", "b")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
