"""What the compiler made of the native kernels: instructions a source change can silently lose (no result changes,
only the speed, so no other test would notice)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from llmserve.kernels import native


def test_decode_attention_keeps_its_prefetches() -> None:
    # The next slice's rows are asked for while a block is computed (paged_decode.cpp's prefetch_key / prefetch_value).
    # A refactor into one helper once compiled to no prefetch at all, and decode attention ran 1.7-2x slower on a
    # Zen 4 with every test passing.
    if native.load() is None:
        pytest.skip("the native extension did not build on this machine")
    obj = native._build_dir() / "paged_decode.o"
    objdump = shutil.which("objdump")
    if objdump is None or not obj.exists():
        pytest.skip(f"needs objdump and {obj}")
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    assert asm.count("prefetcht1") >= 8
    # and in the kernel of every cache type: an int8 cache's had none until 2026-12-07 (its prefetch helpers, one
    # prefetch longer, were left out of line and deleted), and read its rows 20% slower than a bf16 cache's
    prefetches: dict[str, int] = {}
    name = None
    for line in asm.splitlines():
        if line.endswith(">:"):
            name = line
        elif "prefetcht1" in line and name is not None:
            prefetches[name] = prefetches.get(name, 0) + 1
    for cache in ("float", "c10::BFloat16", "c10::Half", "signed char", "unsigned char"):
        kernel = f"attend_one_512<{cache}>("
        assert any(kernel in n for n in asm.splitlines() if n.endswith(">:")), kernel
        assert sum(c for n, c in prefetches.items() if kernel in n) >= 2, f"{kernel} has no prefetch"
