"""`llmserve bench latency` through a tiny model, and the bench commands' flags."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from llmserve.cli import main


def test_latency_json_on_a_tiny_model(tiny_model_dir: Callable[[str], str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", tiny_model_dir("llama"), "--input-len", "12", "--output-len", "6", "--num-iters",
               "3", "--warmup", "1", "--num-blocks", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["prompt_tokens"], out["output_len"], out["num_iters"], out["device"]) == (12, 6, 3, "cpu")
    assert out["output_tokens"] == [6, 6, 6]  # ignore_eos by default: the full length every time
    for name in ("ttft_ms", "decode_tokens_per_s", "e2e_ms"):
        assert set(out[name]) == {"mean", "p50", "p90", "p99"} and out[name]["mean"] > 0
    assert out["ttft_ms"]["mean"] < out["e2e_ms"]["mean"]
    assert 0 < out["load_s"] < out["start_to_ready_s"]  # the process started before the pipeline


def test_latency_table_and_without_ignore_eos(tiny_model_dir: Callable[[str], str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", tiny_model_dir("llama"), "--input-len", "8", "--output-len", "4", "--num-iters",
               "2", "--warmup", "0", "--num-blocks", "16", "--no-ignore-eos", "--dtype", "float32"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert lines[0] == "single request: 8 prompt tokens, 4 output tokens requested, 2 iterations; float32 on cpu"
    assert [line.split()[0] for line in lines[2:5]] == ["TTFT", "decode", "end"]
    counts = [int(c) for c in lines[5].removeprefix("output tokens per iteration: ").split(", ")]
    assert len(counts) == 2 and all(1 <= c <= 4 for c in counts)


def test_latency_refuses_zero_iterations(tiny_model_dir: Callable[[str], str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", tiny_model_dir("llama"), "--num-iters", "0", "--num-blocks", "16"]) == 2
    assert "need --num-iters >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(("kind", "flags"), [
    ("latency", ["--input-len", "--output-len", "--num-iters", "--warmup", "--ignore-eos", "--json", "--dtype"]),
    ("serving", ["--base-url", "--model", "--endpoint", "--tokenizer", "--dataset", "--synthetic", "--num-prompts",
                 "--input-len", "--output-len", "--concurrency", "--request-rate", "--seed", "--ignore-eos",
                 "--api-key", "--json"]),
])
def test_help_lists_the_flags(kind: str, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", kind, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert [f for f in flags if f not in text] == []


def test_bench_help_names_all_three(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(k in text for k in ("throughput", "latency", "serving"))


def test_concurrency_and_request_rate_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serving", "--base-url", "http://127.0.0.1:1", "--concurrency", "2", "--request-rate", "3"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
