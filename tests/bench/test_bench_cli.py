"""`llmserve bench latency` through a tiny model, and the bench commands' flags."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import torch

from llmserve.cli import main
from llmserve.kernels import native


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
    # the first token comes after the engine took the request, by that request's TTFT (which it also measured)
    assert out["start_to_ready_s"] < out["start_to_first_token_s"] < out["start_to_ready_s"] + 60


def test_latency_table_and_without_ignore_eos(tiny_model_dir: Callable[[str], str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", tiny_model_dir("llama"), "--input-len", "8", "--output-len", "4", "--num-iters",
               "2", "--warmup", "0", "--num-blocks", "16", "--no-ignore-eos", "--dtype", "float32"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert lines[0] == ("single request: 8 prompt tokens, 4 output tokens requested, 2 iterations; float32 on cpu; "
                        "greedy")
    assert [line.split()[0] for line in lines[2:5]] == ["TTFT", "decode", "end"]
    counts = [int(c) for c in lines[5].removeprefix("output tokens per iteration: ").split(", ")]
    assert len(counts) == 2 and all(1 <= c <= 4 for c in counts)


def test_latency_samples_with_the_flags_it_is_given(tiny_model_dir: Callable[[str], str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", tiny_model_dir("llama"), "--input-len", "8", "--output-len", "5", "--num-iters",
               "2", "--warmup", "0", "--num-blocks", "16", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20",
               "--min-p", "0.05", "--repetition-penalty", "1.1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["output_tokens"] == [5, 5]
    assert out["sampling"] == "temperature 0.7, top_p 0.9, top_k 20, min_p 0.05, repetition_penalty 1.1"


@pytest.mark.parametrize("flag, value", [("--top-p", "0"), ("--temperature", "-1"), ("--top-k", "-2"),
                                         ("--min-p", "1.5"), ("--repetition-penalty", "0")])
def test_bench_refuses_sampling_knobs_out_of_range(flag: str, value: str, tiny_model_dir: Callable[[str], str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", tiny_model_dir("llama"), "--num-blocks", "16", flag, value]) == 2
    assert "need --temperature >= 0, 0 < --top-p <= 1" in capsys.readouterr().err


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


def test_throughput_json_counts_the_workload_and_profiles_every_step(tiny_model_dir: Callable[[str], str],
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from llmserve.structured.matcher import GrammarState

    for name in ("accept", "masks_with_drafts"):  # no request is constrained: the grammar phase is an empty check
        monkeypatch.setattr(GrammarState, name, lambda *a, **k: pytest.fail("a grammar ran"))
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "6", "--input-len", "20:60",
               "--output-len", "5", "--ignore-eos", "--num-blocks", "64", "--dtype", "float32", "--profile-steps",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["dtype"], out["matmul_peak_kind"]) == ("float32", "fp32 matmul") and out["matmul_peak_gflops"] > 0
    [r] = out["results"]
    assert (r["engine"], r["num_requests"], r["output_tokens"]) == ("llmserve", 6, 30)  # ignore_eos: 6 x 5
    assert 6 * 20 <= r["prompt_tokens"] <= 6 * 60 and r["gflop"] > 0 and r["elapsed_s"] > 0
    assert out["async_scheduling"] is False  # the profile's timers wait at every part: synchronous steps
    assert r["output_tokens_per_s"] == pytest.approx(30 / r["elapsed_s"], rel=1e-6)
    prof = out["step_profile"]
    assert prof["steps"] >= 5  # at least one step per output token
    phases = prof["phases"]
    assert set(phases) == {"schedule", "prepare inputs", "linear", "decode attention", "attention", "other model ops",
                           "LM head", "sampling", "grammar", "outputs", "rest of step"}
    for name in ("schedule", "prepare inputs", "linear", "decode attention", "attention", "LM head", "sampling",
                 "outputs"):
        assert phases[name]["seconds"] > 0, name
    assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0, abs=1e-5)
    # exclusive timing: the phases add up to the steps' wall time, which the run's elapsed time contains
    assert sum(p["seconds"] for p in phases.values()) <= r["elapsed_s"] + 1e-5


def test_throughput_reports_async_scheduling(tiny_model_dir: Callable[[str], str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "5", "--input-len", "20:40",
               "--output-len", "7", "--ignore-eos", "--num-blocks", "64", "--dtype", "float32", "--device", "cpu",
               "--async-scheduling", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["async_scheduling"] is True and out["results"][0]["output_tokens"] == 35


def test_structured_throughput_profiles_the_grammar(tiny_model_dir: Callable[[str], str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "4", "--input-len", "20:30",
               "--output-len", "6", "--num-blocks", "64", "--dtype", "float32", "--structured", "regex",
               "--profile-steps", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and 4 <= out["results"][0]["output_tokens"] <= 24 and out["results"][0]["engine"] == "llmserve, regex"
    assert out["step_profile"]["phases"]["grammar"]["seconds"] > 0
    g = out["grammar_compile"]
    assert g["compiled"] == 1 and g["cache_hits"] >= 3 and g["cold_ms"] > 0 and g["cached_ms"] >= 0
    from llmserve.structured.matcher import GrammarState

    assert not hasattr(GrammarState.accept, "__wrapped__")  # the profiler's wrappers were taken off again
    assert main(["bench", "throughput", tiny_model_dir("llama"), "--structured", "json-schema", "--baseline",
                 "transformers"]) == 2
    assert "--structured has no transformers baseline" in capsys.readouterr().err
    assert main(["bench", "throughput", tiny_model_dir("llama"), "--baseline", "unconstrained"]) == 2
    assert "give --structured" in capsys.readouterr().err


def test_structured_throughput_against_the_same_workload_unconstrained(tiny_model_dir: Callable[[str], str],
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--baseline unconstrained: the same requests through the same engine without the constraint, right after."""
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "4", "--input-len", "20:30",
               "--output-len", "6", "--ignore-eos", "--num-blocks", "64", "--dtype", "float32", "--structured",
               "json-schema", "--baseline", "unconstrained", "--json"])
    out = json.loads(capsys.readouterr().out)
    constrained, plain = out["results"]
    assert rc == 0 and (constrained["engine"], plain["engine"]) == ("llmserve, json-schema", "llmserve, unconstrained")
    assert constrained["prompt_tokens"] == plain["prompt_tokens"] and plain["output_tokens"] == 4 * 6
    assert plain["prefix_cache_hit_rate"] == constrained["prefix_cache_hit_rate"] == 0  # the cache emptied between
    assert out["ratio_vs_baseline"] == pytest.approx(
        constrained["output_tokens_per_s"] / plain["output_tokens_per_s"])


def test_throughput_of_a_weightless_shape_against_transformers(tiny_model_dir: Callable[[str], str], tmp_path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--load-format dummy: a directory with config.json and a tokenizer but no weights; the transformers baseline
    draws random weights of the same shape and runs the same workload."""
    import os
    import shutil

    directory = shutil.copytree(tiny_model_dir("llama"), tmp_path / "shape")
    os.remove(os.path.join(directory, "model.safetensors"))
    rc = main(["bench", "throughput", str(directory), "--load-format", "dummy", "--num-prompts", "3", "--input-len",
               "20:30", "--output-len", "4", "--ignore-eos", "--num-blocks", "32", "--dtype", "float32", "--baseline",
               "transformers", "--baseline-batch-size", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    ours, theirs = out["results"]
    assert (ours["output_tokens"], theirs["output_tokens"]) == (12, 12)
    assert theirs["engine"] == "transformers (batch 2)" and out["ratio_vs_baseline"] > 0
    assert ours["peak_device_mb"] is None  # a CPU run


@pytest.mark.parametrize("quantization,kind", [
    pytest.param("w8a8", "int8 matmul", marks=pytest.mark.skipif(not native.w8a8_usable(),
                                                                 reason="w8a8 needs a CPU with AVX-512 and VNNI")),
    pytest.param("int8", "int16 x int8 matmul", marks=pytest.mark.skipif(
        not native.int8w_default_a16(), reason="int16 activations need AVX512-VNNI on a CPU with AVX-512, or AVX2"))])
def test_throughput_of_int8_is_read_against_the_matmul_it_runs(quantization: str, kind: str,
                                                               tiny_model_dir: Callable[[str], str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "2", "--input-len", "20:30",
               "--output-len", "3", "--ignore-eos", "--num-blocks", "32", "--dtype", "float32", "--quantization",
               quantization, "--profile-steps", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["dtype"], out["matmul_peak_kind"]) == (f"float32, {quantization}", kind)
    assert out["matmul_peak_gflops"] > 0
    assert out["results"][0]["output_tokens"] == 6
    # the decode steps ran in the native decoder stack, whose own timers split them
    phases = out["step_profile"]["phases"]
    assert all(phases[name]["seconds"] > 0 for name in ("linear", "decode attention", "attention", "other model ops"))


def test_decoder_stack_timers_are_credited_to_their_phases() -> None:
    from llmserve.bench.step_profile import StepProfile

    class Stack:
        def set_profiling(self, on: bool) -> None:
            self.on = on

        def take_profile(self) -> list[float]:  # linear, decode attention, K/V write, other
            return [0.004, 0.002, 0.001, 0.0005]

    class Model:
        def run_decoder_stack(self, stack: Stack, x: int) -> int:
            time.sleep(0.02)
            return x + 1

    prof, model, stack = StepProfile(), Model(), Stack()
    prof.wrap_decoder_stack(model)
    forward = prof.timed(lambda: model.run_decoder_stack(stack, 1), "other model ops")
    assert forward() == 2 and stack.on
    s = prof.seconds
    assert (s["linear"], s["decode attention"], s["attention"]) == (0.004, 0.002, 0.001)
    # exclusive: the enclosing forward keeps the rest (the stack's other ops included), not the credited 7 ms
    assert 0.02 - 0.007 <= s["other model ops"] < 0.5 and prof.total() >= 0.02


def test_bf16_and_fp32_are_read_against_the_fastest_matmul_of_their_dtype_here() -> None:
    """bf16 runs on CPU are read against the best of the bf16 linear's paths (torch's oneDNN matmul and the packed
    kernels): on a Xeon without AMX torch's bf16 matmul ran at half the packed FMA path's rate."""
    from llmserve.bench.cli import peak_matmul_kind
    from llmserve.bench.throughput import BF16_MATMUL, FP32_MATMUL, matmul_peak_gflops

    cpu = torch.device("cpu")
    assert peak_matmul_kind(torch.bfloat16, cpu) == (torch.bfloat16, BF16_MATMUL)
    assert peak_matmul_kind(torch.float32, cpu) == (torch.float32, FP32_MATMUL)
    assert peak_matmul_kind(torch.float32, torch.device("cuda")) == (torch.float32, "matmul")
    assert peak_matmul_kind(torch.bfloat16, cpu, "w8a8") == (torch.bfloat16, "int8 matmul")
    assert matmul_peak_gflops(torch.bfloat16, cpu, m=8, k=64, n=32, seconds=0.02, kind=BF16_MATMUL) > 0
    assert matmul_peak_gflops(torch.float32, cpu, m=8, k=64, n=32, seconds=0.02, kind=FP32_MATMUL) > 0


def test_weight_only_int8_is_read_against_the_int16_gemm_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On VNNI CPUs weight-only int8 runs int8w_gemm with x rounded to int16, up to twice the fp32 FMA rate: read
    against fp32 the fraction passed 100%. Without VNNI it runs fp32 FMAs and is read as bf16 is."""
    from llmserve import cpu_features
    from llmserve.bench.cli import peak_matmul_kind
    from llmserve.bench.throughput import matmul_peak_gflops
    from llmserve.kernels import native

    monkeypatch.setattr(cpu_features, "fp32_compute_for_bf16", lambda: True)
    cpu = torch.device("cpu")
    if native.int8w_default_a16():
        want = (torch.bfloat16, "int16 x int8 matmul")
        assert matmul_peak_gflops(torch.bfloat16, cpu, m=8, k=64, n=32, seconds=0.01, kind=want[1]) > 0
    else:
        want = (torch.bfloat16, "bf16 matmul")
    assert peak_matmul_kind(torch.bfloat16, cpu, "int8") == want


def test_throughput_reads_sharegpt_and_runs_the_transformers_baseline(
        tiny_model_dir: Callable[[str], str], tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    data = [{"conversations": [{"from": "human", "value": f"question {i} about rivers and towns"},
                               {"from": "gpt", "value": "an answer " * (i + 1)}]} for i in range(5)]
    data.append({"conversations": [{"from": "gpt", "value": "no human turn: skipped"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--dataset", str(path), "--num-blocks", "64",
               "--dtype", "float32", "--ignore-eos", "--baseline", "transformers", "--baseline-batch-size", "2",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    ours, theirs = out["results"]
    assert (ours["engine"], theirs["engine"]) == ("llmserve", "transformers (batch 2)")
    for key in ("num_requests", "prompt_tokens", "output_tokens", "gflop"):
        assert ours[key] == theirs[key], key  # the same workload through both
    assert ours["num_requests"] == 5  # the conversation without a human turn is skipped
    # ignore_eos: each reply's token count is its output length (5 replies of 1..5 x "an answer ")
    assert ours["output_tokens"] >= 15
    assert out["ratio_vs_baseline"] == pytest.approx(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"])
    assert out["sampling"] == "greedy"


def test_sampled_throughput_samples_on_both_sides(tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The same knobs reach the engine's requests and transformers' generate().
    import transformers

    seen = []
    generate = transformers.GenerationMixin.generate
    monkeypatch.setattr(transformers.GenerationMixin, "generate",
                        lambda self, *a, **kw: seen.append(kw) or generate(self, *a, **kw))
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "3", "--input-len", "12",
               "--output-len", "4", "--ignore-eos", "--num-blocks", "32", "--dtype", "float32", "--temperature",
               "0.8", "--top-p", "0.95", "--top-k", "40", "--baseline", "transformers", "--baseline-batch-size", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert "; temperature 0.8, top_p 0.95, top_k 40; " in lines[0]
    assert [line.split()[0] for line in lines[2:4]] == ["llmserve", "transformers"]
    assert len(seen) == 1 and {k: seen[0][k] for k in ("do_sample", "temperature", "top_p", "top_k")} == {
        "do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 40}


def test_throughput_table_and_profile_text(tiny_model_dir: Callable[[str], str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", tiny_model_dir("llama"), "--num-prompts", "3", "--input-len", "30",
               "--output-len", "3", "--ignore-eos", "--num-blocks", "32", "--profile-steps"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert lines[0].startswith("workload: 3 requests, ") and lines[2].split()[0] == "llmserve"
    split = lines.index(next(line for line in lines if line.startswith("step time split (")))
    assert [line.split()[0] for line in lines[split + 1:]] == ["schedule", "prepare", "linear", "decode", "attention",
                                                               "other", "LM", "sampling", "grammar", "outputs", "rest"]
    assert not hasattr(native.paged_decode, "__wrapped__")  # the profiler's wrapper was taken off again


def test_throughput_refuses_an_unreadable_dataset(tiny_model_dir: Callable[[str], str], tmp_path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "throughput", tiny_model_dir("llama"), "--dataset", str(bad), "--num-blocks", "16"]) == 2
    assert "cannot read the dataset" in capsys.readouterr().err
