"""Embeddings (engine/pooling.py, Pipeline.embed): the pooled final hidden states equal transformers' (the decoder's
last_hidden_state, pooled as sentence-transformers pools it) through the whole engine (batched, chunked, preempted,
prefix-cached, beside generation, whose outputs do not change), for LAST, MEAN and CLS pooling; sentence-transformers
modules, pooler_config, Matryoshka dimensions; a checkpoint of the decoder alone; the refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from tests.engine.test_speculative import prompts

MODES = {
    "plain": dict(),
    "chunked": dict(max_prefill_token_num=7),
    "preempted": dict(num_blocks=14, block_size=4, max_prefill_token_num=8),  # embeddings preempted mid-prompt
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),
    "async-scheduled": dict(async_scheduling=True),  # embeddings never start in a step launched ahead
    "ngram": dict(speculative_method="ngram"),  # nor get drafts (the repetitive prompts find n-grams)
}
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def reference(model_dir: str, ids: list[int], pooling: str, normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
    """transformers: the decoder's last_hidden_state (after the final norm) of the prompt alone, pooled."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0)}[pooling]
    v = v if dimensions is None else v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def engine_config(pooling: str | None = None, **engine) -> EngineConfig:
    pooler = None if pooling is None else {"pooling_type": pooling}
    return EngineConfig(dtype="float32", pooler_config=pooler, **{"block_size": 8, **engine})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers_through_the_engine(pooling, mode, tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama")
    inputs = prompts()
    with pipeline(model_dir, backend_config=engine_config(pooling, **MODES[mode])) as pipe:
        preempted: list = []  # (request, its computed tokens) the scheduler preempted
        preempt = pipe.engine.scheduler._preempt
        monkeypatch.setattr(pipe.engine.scheduler, "_preempt",
                            lambda r: (preempted.append((r, r.num_computed_tokens)), preempt(r)))
        # generation runs beside the embeddings, in the same steps, and keeps its tokens
        alone = [r.token_ids for r in pipe([{"input_ids": p} for p in inputs[:3]], gen_config=GREEDY)]
        engine = pipe.engine
        for i, ids in enumerate(inputs[:3]):
            engine.add_request(f"g{i}", ids, GREEDY)
        for i, ids in enumerate(inputs):
            engine.add_embedding_request(f"e{i}", ids)
        generated: dict[str, list[int]] = {f"g{i}": [] for i in range(3)}
        vectors: dict[str, list[float]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.embedding is not None:
                    assert out.finished and out.num_prompt_tokens == len(inputs[int(out.request_id[1:])])
                    vectors[out.request_id] = out.embedding
                else:
                    generated[out.request_id].extend(out.new_token_ids)
        assert [generated[f"g{i}"] for i in range(3)] == alone
        if mode == "preempted":  # embeddings among them, part of their prompt computed (then recomputed)
            assert any(r.pooling is not None and computed > 0 for r, computed in preempted)
        hits = engine.kv.prefix_stats.hit_tokens
        again = pipe.embed([{"input_ids": p} for p in inputs])  # a second time: prefix-cache hits where on
        if mode == "prefix-cached":  # LAST takes them; MEAN and CLS compute every position
            assert (engine.kv.prefix_stats.hit_tokens > hits) == (pooling == "LAST")
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0
    for i, ids in enumerate(inputs):
        want = reference(model_dir, ids, pooling)
        torch.testing.assert_close(torch.tensor(vectors[f"e{i}"]), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(again[i].embedding), want, rtol=1e-4, atol=1e-5)
        assert again[i].input_token_len == len(ids) and again[i].index == i


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3", "qwen2-moe"])
def test_embeddings_of_other_architectures(arch, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    inputs = prompts()[:4]
    with pipeline(model_dir, backend_config=engine_config("MEAN", max_prefill_token_num=16)) as pipe:
        got = pipe.embed([{"input_ids": p} for p in inputs])
    for ids, r in zip(inputs, got, strict=True):
        torch.testing.assert_close(torch.tensor(r.embedding), reference(model_dir, ids, "MEAN"), rtol=1e-4, atol=1e-5)


def test_texts_normalization_and_the_default_pooling(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        assert (pipe.engine.pooler.pooling_type, pipe.engine.pooler.normalize) == ("LAST", True)
        text = "Models run over flat tokens."
        ids = pipe.tokenizer(text)["input_ids"]
        one = pipe.embed(text)
        raw = pipe.embed(text, normalize=False)
        with pytest.raises(InvalidRequestError, match="Matryoshka"):
            pipe.embed(text, dimensions=8)
    torch.testing.assert_close(torch.tensor(one.embedding), reference(model_dir, ids, "LAST"), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(raw.embedding), reference(model_dir, ids, "LAST", normalize=False),
                               rtol=1e-4, atol=1e-5)
    assert one.input_token_len == len(ids) and abs(torch.tensor(one.embedding).norm().item() - 1) < 1e-5


def copy_model(src: str, dst: str, config: dict | None = None) -> str:
    shutil.copytree(src, dst)
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**cfg, **config}, f)
    return dst


def write_st_modules(model_dir: str, mode: str, normalize: bool, extra: list[dict] | None = None) -> None:
    """sentence-transformers' files: modules.json (Transformer, Pooling, maybe Normalize) and 1_Pooling/config.json."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modules += extra or []
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
    modes = {k: k == mode for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                                    "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_lasttoken")}
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **modes, "include_prompt": True}, f)


def test_sentence_transformers_modules_and_pooler_config(tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir("llama"), str(tmp_path / "st"))
    write_st_modules(model_dir, "pooling_mode_mean_tokens", normalize=False)
    ids = prompts()[3]
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        assert pipe.engine.pooler.source == "sentence-transformers"
        got = pipe.embed({"input_ids": ids})
    torch.testing.assert_close(torch.tensor(got.embedding), reference(model_dir, ids, "MEAN", normalize=False),
                               rtol=1e-4, atol=1e-5)
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", pooler_config='{"pooling_type": "cls", '
                                                                                        '"normalize": true}')) as pipe:
        got = pipe.embed({"input_ids": ids})
    torch.testing.assert_close(torch.tensor(got.embedding), reference(model_dir, ids, "CLS"), rtol=1e-4, atol=1e-5)
    # modules this engine does not run: refused, unless pooler_config says how to pool instead
    write_st_modules(model_dir, "pooling_mode_max_tokens", normalize=True)
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        with pytest.raises(InvalidRequestError, match="pooling_mode_max_tokens"):
            pipe.embed("hello")
    write_st_modules(model_dir, "pooling_mode_lasttoken", normalize=True,
                     extra=[{"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}])
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        with pytest.raises(InvalidRequestError, match="Dense"):
            pipe.embed("hello")
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        f.write("{not json")
    with pipeline(model_dir, backend_config=engine_config()) as pipe:  # generation is unaffected
        assert pipe("hello", max_new_tokens=2).generate_token_len == 2
        with pytest.raises(InvalidRequestError, match="modules.json"):
            pipe.embed("hello")


def test_matryoshka_dimensions(tiny_model_dir, tmp_path):
    ids = prompts()[2]
    model_dir = copy_model(tiny_model_dir("llama"), str(tmp_path / "any"), {"is_matryoshka": True})
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        got = pipe.embed({"input_ids": ids}, dimensions=16)
        for bad in (0, 65, 2.5, True):
            with pytest.raises(InvalidRequestError, match="dimensions"):
                pipe.embed({"input_ids": ids}, dimensions=bad)
    assert len(got.embedding) == 16
    torch.testing.assert_close(torch.tensor(got.embedding), reference(model_dir, ids, "LAST", dimensions=16),
                               rtol=1e-4, atol=1e-5)
    # a model whose config does not say so, told by hf_overrides (vLLM's --hf-overrides), as Qwen3-Embedding needs
    config = EngineConfig(dtype="float32", hf_overrides='{"is_matryoshka": true}')
    with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
        again = pipe.embed({"input_ids": ids}, dimensions=16)
    assert again.embedding == got.embedding
    with pytest.raises(InvalidRequestError, match="hf_overrides"):
        EngineConfig(hf_overrides="[1]")
    model_dir = copy_model(tiny_model_dir("llama"), str(tmp_path / "listed"), {"matryoshka_dimensions": [32, 64]})
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        assert len(pipe.embed({"input_ids": ids}, dimensions=32).embedding) == 32
        with pytest.raises(InvalidRequestError, match="32, 64"):
            pipe.embed({"input_ids": ids}, dimensions=16)


def test_a_checkpoint_of_the_decoder_alone_embeds_and_refuses_to_generate(tiny_model_dir, tmp_path):
    """As Qwen3-Embedding ships: the decoder's tensors without `model.`, no lm_head though the config is untied."""
    from safetensors.torch import load_file, save_file

    model_dir = copy_model(tiny_model_dir("llama"), str(tmp_path / "headless"))
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}, path)
    ids = prompts()[4]
    with pipeline(model_dir, backend_config=engine_config()) as pipe:
        assert pipe.engine.loaded.headless
        got = pipe.embed({"input_ids": ids})
        with pytest.raises(InvalidRequestError, match="no LM head"):
            pipe("hello")
    want = reference(tiny_model_dir("llama"), ids, "LAST")
    torch.testing.assert_close(torch.tensor(got.embedding), want, rtol=1e-4, atol=1e-5)
    # a causal LM's checkpoint (names under model.) without its untied head is broken, not headless
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, path)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        pipeline(model_dir, backend_config=engine_config())
    # a decoder checkpoint that lacks more than the head is still a broken checkpoint
    dropped = ("lm_head.weight", "model.norm.weight")
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k not in dropped}, path)
    with pytest.raises(ModelLoadError, match="norm.weight"):
        pipeline(model_dir, backend_config=engine_config())


def test_refusals_leave_nothing_behind(tiny_model_dir):
    with pipeline(tiny_model_dir("llama"), backend_config=engine_config(session_len=64)) as pipe:
        engine = pipe.engine
        for bad, error, match in (([], InvalidRequestError, "empty"),
                                  ([5, 400], InvalidRequestError, "vocabulary"),
                                  ([5] * 65, PromptTooLongError, "session length"),
                                  (["a"], InvalidRequestError, "vocabulary")):
            with pytest.raises(error, match=match):
                engine.add_embedding_request("x", bad)
        with pytest.raises(InvalidRequestError, match="inputs"):
            pipe.embed([])
        with pytest.raises(InvalidRequestError, match="string or"):
            pipe.embed([3])
        engine.add_embedding_request("x", [5, 6, 7])
        with pytest.raises(InvalidRequestError, match="already in use"):
            engine.add_embedding_request("x", [5, 6])
        assert engine.abort("x")[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests()
        assert engine.kv.usage().in_use == 0
        with pytest.raises(InvalidRequestError, match="pooler_config"):
            EngineConfig(pooler_config={"pooling_type": "MAX"})
        with pytest.raises(InvalidRequestError, match="unknown key"):
            EngineConfig(pooler_config={"dims": 3})
        with pytest.raises(InvalidRequestError, match="JSON"):
            EngineConfig(pooler_config="{")


def test_beside_beams_and_best_of_and_aborted_mid_prompt(tiny_model_dir):
    """Beam search and best_of in the same steps keep their results; an embedding aborted after a chunk of its prompt
    frees its blocks."""
    inputs = prompts()
    beams = GenerationConfig(max_new_tokens=8, use_beam_search=True, beam_width=3, n=2, ignore_eos=True)
    best = GenerationConfig(max_new_tokens=8, best_of=3, n=1, temperature=0.8, random_seed=3, ignore_eos=True)
    with pipeline(tiny_model_dir("llama"), backend_config=engine_config("MEAN", max_prefill_token_num=12)) as pipe:
        alone = [[r.token_ids for r in pipe([{"input_ids": inputs[1]}], gen_config=g)] for g in (beams, best)]
        engine = pipe.engine
        engine.add_request("beams", inputs[1], beams)
        engine.add_request("best", inputs[1], best)
        engine.add_embedding_request("e", inputs[4])
        engine.add_embedding_request("gone", inputs[3])
        got: dict[str, list] = {"beams": [], "best": []}
        vector = None
        engine.step()
        engine.abort("gone")  # (one chunk of its 30 tokens computed, at most)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "e":
                    vector = out.embedding
                elif out.finished:
                    got[out.request_id].append(out)
        assert [[o.new_token_ids for o in sorted(got[k], key=lambda o: o.index)] for k in ("beams", "best")] == alone
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0
    torch.testing.assert_close(torch.tensor(vector), reference(tiny_model_dir("llama"), inputs[4], "MEAN"),
                               rtol=1e-4, atol=1e-5)


def test_overrides_reach_configs_transformers_reads(tiny_model_dir):
    """hf_overrides on an architecture whose config transformers reads (Gemma 2): a key the config lacks is set too."""
    ids = prompts()[2]
    config = EngineConfig(dtype="float32", hf_overrides={"is_matryoshka": True})
    with pipeline(tiny_model_dir("gemma2"), backend_config=config) as pipe:
        got = pipe.embed({"input_ids": ids}, dimensions=16)
    torch.testing.assert_close(torch.tensor(got.embedding),
                               reference(tiny_model_dir("gemma2"), ids, "LAST", dimensions=16), rtol=1e-4, atol=1e-5)
