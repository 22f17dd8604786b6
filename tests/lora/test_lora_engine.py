"""LoRA adapters through the whole engine, token for token against transformers + PEFT (fp32, greedy): three
adapters and the base model in one batch, plain, chunked, prefix-cached and preempted."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from tests.lora.adapters import ADAPTERS, edit_config, make_adapter, peft_greedy

NEW_TOKENS = 10
PROMPT_LENS = [4, 9, 17, 26]
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(base_dir, adapter_dirs) -> dict[str | None, list[list[int]]]:
    out = {name: [peft_greedy(base_dir, d, p, NEW_TOKENS) for p in prompts()] for name, d in adapter_dirs.items()}
    out[None] = [peft_greedy(base_dir, None, p, NEW_TOKENS) for p in prompts()]
    return out


def test_each_adapter_changes_the_output(expected) -> None:
    """The reference itself: every adapter moves the greedy tokens away from the base model's (else a test that
    ignored adapters would pass)."""
    for name in ADAPTERS:
        assert expected[name] != expected[None], name


MODES = {
    "plain": dict(),
    "chunked": dict(max_prefill_token_num=7),
    "preempted": dict(num_blocks=14, block_size=4),
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),
    "one-lora-at-a-time": dict(max_loras=1),
    "ngram-speculation": dict(speculative_method="ngram", num_speculative_tokens=3),
    "segmented": dict(),  # every step's adapters one matmul pair each (LLMSERVE_LORA_STACKED_MAX_ROWS=0, below)
    "stacked": dict(),  # every step with several adapters stacked, however large (pinned, below)
    "async-scheduling": dict(async_scheduling=True),  # decode steps launched before the last one's tokens are read
}


@pytest.mark.parametrize("mode", MODES)
def test_mixed_batch_matches_peft(mode, base_dir, adapter_dirs, expected, monkeypatch) -> None:
    """Every prompt under every adapter and the base model, all in one call: the same prompts under different
    adapters must not share KV (prefix cache), and each sequence's tokens are PEFT's. These steps are small, so they
    run stacked or segmented as measured on this machine (lora/manager.py), or as the two modes below pin."""
    if mode in ("segmented", "stacked"):
        monkeypatch.setenv("LLMSERVE_LORA_STACKED_MAX_ROWS", "0" if mode == "segmented" else "100000")
    names = [*ADAPTERS, None]
    batch = [(p, name) for name in names for p in prompts()]
    config = EngineConfig(dtype="float32", adapters=adapter_dirs, **MODES[mode])
    with pipeline(base_dir, backend_config=config) as pipe:
        from tests.engine.test_async_scheduling import Ahead

        ahead = Ahead(pipe.engine)
        runs = 2 if mode == "prefix-cached" else 1  # the second run is served from the cache
        for _ in range(runs):
            out = pipe([{"input_ids": p} for p, _ in batch], GREEDY, do_preprocess=False,
                       adapter_name=[name for _, name in batch])
            got = {}
            for (_, name), r in zip(batch, out):
                got.setdefault(name, []).append(r.token_ids)
            assert got == expected
        engine = pipe.engine
        if mode == "preempted":
            assert engine.scheduler.num_preemptions > 0
        if mode == "prefix-cached":
            assert engine.kv.prefix_stats.hit_tokens > 0
        assert (ahead.count > 0) == (mode == "async-scheduling")
        engine.kv.check_invariants()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_adapters_arriving_while_steps_are_in_flight(base_dir, adapter_dirs, expected) -> None:
    """Async scheduling: requests under each adapter (and the base model) arrive one step apart while steps are in
    flight, so most start in a step launched before the last one is read, their adapters' rows beside the decodes:
    each sequence's tokens are PEFT's."""
    from tests.engine.test_async_scheduling import Ahead

    names = [*ADAPTERS, None]
    batch = [(i, p, name) for name in names for i, p in enumerate(prompts())]
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters=adapter_dirs,
                                                        async_scheduling=True)) as pipe:
        engine, ahead = pipe.engine, Ahead(pipe.engine)
        got: dict[str, list[int]] = {}
        pending = list(enumerate(batch))
        while pending or engine.has_unfinished_requests():
            if pending:
                k, (_, p, name) = pending.pop(0)
                engine.add_request(str(k), p, GREEDY, adapter_name=name)
            for o in engine.step():
                got[o.request_id] = got.get(o.request_id, []) + o.new_token_ids
        for k, (i, _, name) in enumerate(batch):
            assert got[str(k)] == expected[name][i], (name, i)
        assert ahead.started >= len(batch) // 2
        engine.kv.check_invariants()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_single_adapter_name_for_the_whole_call(base_dir, adapter_dirs, expected) -> None:
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters={"qv": adapter_dirs["qv"]})) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()], GREEDY, do_preprocess=False, adapter_name="qv")
        assert [r.token_ids for r in out] == expected["qv"]
        streamed: list[int] = []
        for r in pipe.stream_infer({"input_ids": prompts()[1]}, GREEDY, do_preprocess=False, adapter_name="qv"):
            streamed += r.token_ids
        assert streamed == expected["qv"][1]


def test_sessions_do_not_reuse_another_adapters_kv(base_dir, adapter_dirs, expected) -> None:
    """A session's KV computed under one adapter is not reused by a turn under another."""
    p = prompts()[3]
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters=adapter_dirs, block_size=4)) as pipe:
        first = pipe.stream_infer({"input_ids": p}, GREEDY, do_preprocess=False, session_id="s", adapter_name="all")
        assert [t for r in first for t in r.token_ids] == expected["all"][3]
        second = pipe.stream_infer({"input_ids": p}, GREEDY, do_preprocess=False, session_id="s", adapter_name="mlp")
        assert [t for r in second for t in r.token_ids] == expected["mlp"][3]
        assert pipe.engine.sessions.hit_tokens == 0
        third = pipe.stream_infer({"input_ids": p}, GREEDY, do_preprocess=False, session_id="s", adapter_name="mlp")
        assert [t for r in third for t in r.token_ids] == expected["mlp"][3]
        assert pipe.engine.sessions.hit_tokens > 0  # the same adapter does reuse it


def test_load_and_unload_at_run_time(base_dir, adapter_dirs, expected) -> None:
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", enable_lora=True)) as pipe:
        engine = pipe.engine
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'qv'"):
            pipe({"input_ids": prompts()[0]}, GREEDY, do_preprocess=False, adapter_name="qv")
        engine.load_adapter("qv", adapter_dirs["qv"])
        assert pipe({"input_ids": prompts()[0]}, GREEDY, do_preprocess=False,
                    adapter_name="qv").token_ids == expected["qv"][0]
        # unloaded while a request runs with it: that request finishes with it, new ones cannot name it
        stream = pipe.stream_infer({"input_ids": prompts()[2]}, GREEDY, do_preprocess=False, adapter_name="qv")
        tokens = list(next(stream).token_ids)
        engine.unload_adapter("qv")
        tokens += [t for r in stream for t in r.token_ids]
        assert tokens == expected["qv"][2]
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'qv'"):
            pipe({"input_ids": prompts()[0]}, GREEDY, do_preprocess=False, adapter_name="qv")
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'qv'"):
            engine.unload_adapter("qv")
        # the same name again, another adapter: nothing computed under the first is served for it
        engine.load_adapter("qv", adapter_dirs["mlp"])
        assert pipe({"input_ids": prompts()[0]}, GREEDY, do_preprocess=False,
                    adapter_name="qv").token_ids == expected["mlp"][0]


def test_adapter_names_are_checked_before_anything_runs(base_dir, adapter_dirs) -> None:
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters={"qv": adapter_dirs["qv"]})) as pipe:
        with pytest.raises(InvalidRequestError, match="one entry per prompt"):
            pipe([{"input_ids": p} for p in prompts()], GREEDY, do_preprocess=False, adapter_name=["qv"])
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'nope'"):
            pipe([{"input_ids": p} for p in prompts()[:2]], GREEDY, do_preprocess=False, adapter_name=["qv", "nope"])
        assert not pipe.engine.has_unfinished_requests()
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32")) as pipe:
        with pytest.raises(InvalidRequestError, match="serves none"):
            pipe({"input_ids": prompts()[0]}, GREEDY, do_preprocess=False, adapter_name="qv")
        with pytest.raises(InvalidRequestError, match="not enabled"):
            pipe.engine.load_adapter("qv", adapter_dirs["qv"])


def _bad(tmp_path, adapter_dirs, kind: str) -> str:
    d = str(tmp_path / kind)
    shutil.copytree(adapter_dirs["all"], d)
    if kind == "no-config":
        os.remove(os.path.join(d, "adapter_config.json"))
    elif kind == "no-weights":
        os.remove(os.path.join(d, "adapter_model.safetensors"))
    elif kind == "corrupt-weights":
        with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
            f.write(b"\x00\x01 not safetensors")
    elif kind == "bad-json":
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            f.write("{not json")
    elif kind == "dora":
        edit_config(d, use_dora=True)
    elif kind == "bias":
        edit_config(d, bias="all")
    elif kind == "modules-to-save":
        edit_config(d, modules_to_save=["lm_head"])
    return d


BAD = {
    "no-config": "has no adapter_config.json",
    "no-weights": "has no adapter_model.safetensors",
    "corrupt-weights": "could not be read",
    "bad-json": "not readable JSON",
    "dora": "DoRA",
    "bias": "bias='all' is not supported",
    "modules-to-save": "modules_to_save",
}


@pytest.mark.parametrize("kind", BAD)
def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(kind, base_dir, adapter_dirs, expected,
                                                                     tmp_path) -> None:
    path = _bad(tmp_path, adapter_dirs, kind)
    with pytest.raises(InvalidRequestError, match=BAD[kind]):
        pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters={"x": path}))
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters={"qv": adapter_dirs["qv"]})) as pipe:
        with pytest.raises(InvalidRequestError, match=BAD[kind]):
            pipe.engine.load_adapter("x", path)
        assert "x" not in pipe.engine.lora.adapters
        out = pipe([{"input_ids": prompts()[0]}] * 2, GREEDY, do_preprocess=False, adapter_name=["qv", None])
        assert [r.token_ids for r in out] == [expected["qv"][0], expected[None][0]]


def test_shape_rank_and_target_errors(base_dir, adapter_dirs, tiny_model_dir, tmp_path) -> None:
    other = make_adapter(tiny_model_dir("qwen3"), str(tmp_path / "other"), seed=5, r=4, lora_alpha=8,
                         target_modules=["q_proj"])  # another base model: head_dim 32
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", enable_lora=True, max_lora_rank=4)) as pipe:
        engine = pipe.engine
        with pytest.raises(InvalidRequestError, match="trained for another base model"):
            engine.load_adapter("other", other)
        with pytest.raises(InvalidRequestError, match="rank 8, over max_lora_rank=4"):
            engine.load_adapter("all", adapter_dirs["all"])
        with pytest.raises(InvalidRequestError, match="is not a directory"):
            engine.load_adapter("missing", str(tmp_path / "missing"))
        # a module the model lacks (renamed in the checkpoint)
        from safetensors.torch import load_file, save_file

        d = tmp_path / "renamed"
        shutil.copytree(adapter_dirs["qv"], d)
        tensors = load_file(str(d / "adapter_model.safetensors"))
        save_file({k.replace("self_attn.q_proj", "self_attn.qq_proj"): v for k, v in tensors.items()},
                  str(d / "adapter_model.safetensors"))
        with pytest.raises(InvalidRequestError, match="qq_proj.*which this model lacks"):
            engine.load_adapter("renamed", str(d))
        # an embedding adapter
        save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 320)},
                  str(d / "adapter_model.safetensors"))
        with pytest.raises(InvalidRequestError, match="embedding adapters"):
            engine.load_adapter("embed", str(d))
        assert engine.lora.adapters == {}
        engine.load_adapter("qv", adapter_dirs["qv"])  # rank 4 fits
        with pytest.raises(InvalidRequestError, match="already loaded"):
            engine.load_adapter("qv", adapter_dirs["qv"])


def test_max_cpu_loras_bounds_the_loaded_adapters(base_dir, adapter_dirs) -> None:
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters={"qv": adapter_dirs["qv"]},
                                                        max_cpu_loras=1)) as pipe:
        with pytest.raises(InvalidRequestError, match="max_cpu_loras=1"):
            pipe.engine.load_adapter("mlp", adapter_dirs["mlp"])
        pipe.engine.unload_adapter("qv")
        pipe.engine.load_adapter("mlp", adapter_dirs["mlp"])


def test_config_parsing() -> None:
    from llmserve.config import parse_adapters

    assert parse_adapters(["a=/x", "b=/y"]) == {"a": "/x", "b": "/y"}
    assert parse_adapters(["/only"]) == {"default": "/only"}
    assert parse_adapters(['{"name": "a", "path": "/x"}', "b=/y"]) == {"a": "/x", "b": "/y"}
    assert EngineConfig(adapters={"a": "/x"}).enable_lora
    for bad in (["/x", "/y"], ["a=/x", "a=/y"], ["=x"], {"a": 3}, 5, ["{nope"], ['{"name": "a"}']):
        with pytest.raises(InvalidRequestError, match="adapters"):
            EngineConfig(adapters=bad)
    with pytest.raises(InvalidRequestError, match="max_loras"):
        EngineConfig(max_loras=0)


def test_bf16_mixed_batch_equals_each_alone(base_dir, adapter_dirs) -> None:
    """bf16 (the native kernels; a step without adapters may run the native decoder stack, one with them runs layer
    by layer): a sequence's tokens do not depend on what else is in its batch."""
    gen = GenerationConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    ps = prompts()[1:]
    with pipeline(base_dir, backend_config=EngineConfig(dtype="bfloat16", adapters=adapter_dirs)) as pipe:
        alone = {name: [pipe({"input_ids": p}, gen, do_preprocess=False, adapter_name=name).token_ids for p in ps]
                 for name in ("qv", None)}
        mixed = pipe([{"input_ids": p} for p in ps * 2], gen, do_preprocess=False,
                     adapter_name=[None] * len(ps) + ["qv"] * len(ps))
        assert [r.token_ids for r in mixed] == alone[None] + alone["qv"]
        assert alone["qv"] != alone[None]


def test_quantized_base_with_adapters(base_dir, adapter_dirs) -> None:
    """int8 weights under the adapters (the update is added to whatever the base layer computes): each adapter still
    moves the output, and a sequence's tokens do not depend on its batch."""
    gen = GenerationConfig(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    ps = prompts()
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", quantization="int8",
                                                        adapters=adapter_dirs)) as pipe:
        alone = {name: [pipe({"input_ids": p}, gen, do_preprocess=False, adapter_name=name).token_ids for p in ps]
                 for name in ("all", None)}
        assert alone["all"] != alone[None]
        mixed = pipe([{"input_ids": p} for p in ps * 2], gen, do_preprocess=False,
                     adapter_name=["all"] * len(ps) + [None] * len(ps))
        assert [r.token_ids for r in mixed] == alone["all"] + alone[None]


def test_beam_search_under_an_adapter(base_dir, adapter_dirs) -> None:
    """Forked beams keep their request's adapter: the best beam under the adapter differs from the base model's."""
    gen = GenerationConfig(max_new_tokens=8, use_beam_search=True, beam_width=3, ignore_eos=True)
    p = {"input_ids": prompts()[2]}
    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters=adapter_dirs)) as pipe:
        with_adapter = pipe(p, gen, do_preprocess=False, adapter_name="all").token_ids
        base = pipe(p, gen, do_preprocess=False).token_ids
        assert with_adapter != base
        assert pipe(p, gen, do_preprocess=False, adapter_name="all").token_ids == with_adapter


def _vl_adapter(model_dir: str, out_dir: str, target_modules: str | list[str]) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(3)
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                                 init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def test_vision_language_model_adapters_match_peft(tiny_vlm_dir, tmp_path) -> None:
    """An adapter on a LLaVA's language model (the vision tower left alone, as LLaVA LoRAs are trained), with an
    image in the prompt: transformers + PEFT's tokens. An adapter that also adapts the vision tower is refused."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from llmserve.vl.hf_compat import without_video_processor
    from tests.tiny_vlms import test_image, user_messages

    d = tiny_vlm_dir("llava")
    adapter = _vl_adapter(d, str(tmp_path / "lm"), r".*language_model.*\.(q_proj|v_proj|down_proj)")
    text, image = "What is the capital of France?", test_image(0, (40, 50))
    from transformers import AutoProcessor

    with without_video_processor():
        proc = AutoProcessor.from_pretrained(d)
    inputs = proc(text=proc.apply_chat_template(user_messages(text, 1), add_generation_prompt=True), images=[image],
                  return_tensors="pt", add_special_tokens=False)
    base = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        out = peft_model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    gen = GenerationConfig(temperature=0.0, max_new_tokens=8, min_new_tokens=8)
    with pipeline(d, backend_config=EngineConfig(dtype="float32", adapters={"lm": adapter})) as pipe:
        with_adapter = pipe((text, image), gen, adapter_name="lm").token_ids
        assert with_adapter == expected
        assert pipe((text, image), gen).token_ids != expected  # the adapter changed them
        both = _vl_adapter(d, str(tmp_path / "both"), ["q_proj"])  # the vision tower's q_proj too
        with pytest.raises(InvalidRequestError, match="vision_tower.*which this model lacks"):
            pipe.engine.load_adapter("both", both)


@pytest.mark.slow
def test_generate_command_with_an_adapter(base_dir, adapter_dirs) -> None:
    import subprocess
    import sys

    def generate(*flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "llmserve.cli", "generate", base_dir, "Hello", "--temperature", "0",
               "--max-new-tokens", "8", "--ignore-eos", "--dtype", "float32", "--adapters", f"qv={adapter_dirs['qv']}",
               *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180)

    with pipeline(base_dir, backend_config=EngineConfig(dtype="float32", adapters={"qv": adapter_dirs["qv"]})) as pipe:
        gen = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        expected = pipe("Hello", gen, adapter_name="qv").text
    out = generate("--adapter-name", "qv")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    out = generate("--adapter-name", "nope")
    assert out.returncode == 2 and "no LoRA adapter named 'nope'" in out.stderr


def test_the_stacked_threshold_follows_the_faster_path() -> None:
    """A fake timer drives the measurement: the threshold is the last bucket where stacked ran faster."""
    from llmserve.lora.manager import measure_stacked_max_rows

    def measure(limit: int) -> int:
        def timer(path: str, rows: int, fn) -> float:
            fn()  # the path runs (shapes check out)
            return 1.0 if (path == "stacked") == (rows <= limit) else 2.0

        return measure_stacked_max_rows(8, 12, 2, 3, torch.float32, torch.device("cpu"), timer)

    assert measure(64) == 64
    assert measure(1024) == 1024
    assert measure(0) == 0


def test_embeddings_with_adapters_match_peft(base_dir, adapter_dirs) -> None:
    """Embeddings under each adapter and the base model, in one batch: PEFT's decoder (the adapter unmerged), its
    last hidden state at the last token, normalized."""
    from tests.lora.adapters import _peft_model

    names = [None, *adapter_dirs]
    inputs = prompts()
    config = EngineConfig(dtype="float32", block_size=8, max_prefill_token_num=16, adapters=adapter_dirs)
    with pipeline(base_dir, backend_config=config) as pipe:
        got = pipe.embed([{"input_ids": p} for p in inputs for _ in names], adapter_name=names * len(inputs))
    for i, p in enumerate(inputs):
        for j, name in enumerate(names):
            model = _peft_model(base_dir, None if name is None else adapter_dirs[name])
            decoder = model.model if name is None else model.get_base_model().model
            with torch.no_grad():
                want = torch.nn.functional.normalize(decoder(torch.tensor([p])).last_hidden_state[0, -1], dim=0)
            torch.testing.assert_close(torch.tensor(got[i * len(names) + j].embedding), want, rtol=1e-4, atol=1e-5)
    assert got[0].embedding != got[1].embedding  # the adapters do change the vector
