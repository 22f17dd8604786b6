"""scripts/peers/compare_summary.py: the §3 / §3b tables of a compare.sh run, from its files (fabricated here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peers" / "compare_summary.py"


@pytest.fixture()
def summary():
    spec = importlib.util.spec_from_file_location("compare_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(out: Path, name: str, value: object) -> None:
    (out / name).write_text(value if isinstance(value, str) else json.dumps(value))


def _run(out: Path, seeds: tuple[int, ...] = (42, 302)) -> None:
    _write(out, "lscpu.txt", "Model name:  Test CPU\nCPU family:  6\nModel:  207\nStepping:  2\nCPU(s):  2\n"
                             "Flags:  fpu avx2 avx512f avx512_vnni avx512_bf16\n")
    _write(out, "date.txt", "2026-12-04 18:49 UTC")
    _write(out, "commit.txt", "abc1234")
    single = [{"prompt_tokens": n, "ttft_ms": {"mean": t}, "decode_tokens_per_s": {"mean": 30.0}}
              for n, t in ((36, 90.0), (500, 800.0), (2000, 4000.0))]
    _write(out, "vllm.json", {"start_s": 80.0, "peak_rss_mb": 4700, "single": single,
                              "batch": {"num_requests": 64, "output_tokens_per_s": 200.0}})
    for i, tp in ((1, 300.0), (2, 260.0)):
        _write(out, f"llmserve_throughput_{i}.json", {"matmul_peak_gflops": 200.0, "results": [
            {"num_requests": 64, "output_tokens_per_s": tp, "achieved_gflops": 140.0, "peak_rss_mb": 950}]})
    _write(out, "llmserve_w8a8.json", {"results": [{"num_requests": 64, "output_tokens_per_s": 380.0}]})
    for n, t in ((36, 30.0), (500, 300.0), (2000, 4400.0)):  # 2,000 tokens: slower than vLLM
        _write(out, f"llmserve_latency_{n}.json", {"ttft_ms": {"mean": t}, "decode_tokens_per_s": {"mean": 90.0},
                                                    "start_to_ready_s": 3.0})
    for i, wide in ((1, 32), (2, 64)):  # the second measured on a busy machine (not cached: the note is no choice)
        busy = "; not cached: other processes used 33% of the CPUs meanwhile, so the next start measures again" * (i - 1)
        _write(out, f"tune_{i}.txt", "a table\nkernel choice: decode_attention:9/3x64, prefill_attention:9/3x64: fp32; "
                                     f"qblock_linear:576x576:4-bit/32: blocks (from {wide} rows: wide); "
                                     f"qblock_linear:3072x576:4-bit/32: amx (<= 4 rows: blocks_dot) (measured in 7.0 s{busy})\n")
    gl = {"output_tokens_per_s": 100.0, "ttft_ms_median": 2000.0, "ttft_ms_mean": 3000.0, "itl_ms_median": 80.0,
          "requests_successful": 64, "requests_errored": 0}
    _write(out, "guidellm_vllm_42.json", gl)
    for seed in seeds:
        _write(out, f"guidellm_llmserve_{seed}.json", {**gl, "output_tokens_per_s": 150.0, "ttft_ms_median": 1500.0})


def test_the_tables_give_ratios_and_say_which_targets_are_met(summary, tmp_path: Path, capsys) -> None:
    _run(tmp_path)
    assert summary.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Test CPU, family 6 model 207 stepping 2, 2 CPUs, avx2 avx512f avx512_vnni avx512_bf16" in text
    assert "commit abc1234" in text
    assert "| 64 requests, output tok/s | 200.0 | 300.0, 260.0 | 1.30-1.50x | >= 1.4x: **not met** |" in text
    assert "| 70%, 70% | | >= 65%: met |" in text
    assert "| w8a8, output tok/s | | 380.0 | 1.90x | >= 2x: **not met** |" in text
    assert "0.33x / 0.38x / 1.10x | <= 1x: **not met** |" in text  # the 2,000-token prompt
    assert "3.00x / 3.00x / 3.00x | >= 2.5x: met |" in text
    assert "| start (vLLM: LLM(); llmserve: start to ready), s | 80.0 | 3.00, 3.00, 3.00 | | <= 5 s: met |" in text
    assert "| vLLM-CPU | 42 | 100.0 | 2.00 / 3.00 s | 80.0 ms | 64 ok, 0 errored |" in text
    assert text.index("| llmserve | 42 |") < text.index("| llmserve | 302 |")
    assert "| qblock_linear:576x576:4-bit/32 | blocks (from 32 rows: wide) | blocks (from 64 rows: wide) |" in text
    assert "| qblock_linear:3072x576:4-bit/32 | amx (<= 4 rows: blocks_dot) | amx (<= 4 rows: blocks_dot) |" in text
    assert "| prefill_attention:9/3x64 | fp32 | fp32 |" in text and "3 of 4 ops chose the same in every tune." in text
    assert "Output tok/s 1.50x vLLM's (target >= 1.4x: met), median TTFT 0.75x (target <= 1x: met)." in text


def test_the_dtypes_each_engine_ran_are_named(summary, tmp_path: Path, capsys) -> None:
    """A CPU without bf16 instructions runs vLLM in fp32 (VLLM_DTYPE) and llmserve's defaults in fp32: the tables say
    so rather than "bf16"."""
    _run(tmp_path)
    assert summary.main([str(tmp_path)]) == 0
    assert "| | vLLM-CPU bf16 | llmserve |" in capsys.readouterr().out  # files without a dtype: bf16, as before
    vllm = json.loads((tmp_path / "vllm.json").read_text())
    _write(tmp_path, "vllm.json", {**vllm, "dtype": "float32"})
    for i in (1, 2):
        doc = json.loads((tmp_path / f"llmserve_throughput_{i}.json").read_text())
        _write(tmp_path, f"llmserve_throughput_{i}.json", {**doc, "dtype": "float32"})
    assert summary.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| | vLLM-CPU fp32 | llmserve |" in text and "| share of the fp32 matmul peak (200, 200 GFLOP/s) |" in text


def test_weight_only_int8_stands_in_where_w8a8_does_not_run(summary, tmp_path: Path, capsys) -> None:
    """compare.sh runs --quantization int8 on a CPU without AVX-512 VNNI (w8a8 is refused there): its row is named
    for what ran, with no w8a8 target."""
    _run(tmp_path)
    (tmp_path / "llmserve_w8a8.json").unlink()
    _write(tmp_path, "llmserve_int8.json", {"results": [{"num_requests": 64, "output_tokens_per_s": 250.0}]})
    assert summary.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| weight-only int8 (w8a8 needs AVX-512 VNNI), output tok/s | | 250.0 | 1.25x | |" in text
    assert "| w8a8, output tok/s |" not in text


def test_missing_runs_leave_dashes(summary, tmp_path: Path, capsys) -> None:
    _write(tmp_path, "llmserve_throughput_1.json", {"matmul_peak_gflops": 200.0, "results": [
        {"num_requests": 4, "output_tokens_per_s": 90.0, "achieved_gflops": 50.0}]})
    assert summary.main([str(tmp_path)]) == 0  # --no-vllm --no-guidellm, and a run that stopped early
    text = capsys.readouterr().out
    assert "unknown machine" in text and "| 4 requests, output tok/s | - | 90.0 | - | >= 1.4x: - |" in text
    assert "§3b" not in text and "Kernel choices" not in text
