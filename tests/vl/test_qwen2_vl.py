"""Qwen2-VL and Qwen2.5-VL (models/qwen2_vl.py): dynamic-resolution images and 3-D rotary positions (M-RoPE).

Token for token against transformers (fp32, greedy) for one image, two images of different sizes (grids of their own
aspect), a text-only prompt and a batch of all three; with a prefill budget that cuts through the placeholders, from
the prefix cache, preempted and recomputed, and through the decode path CUDA graphs take (1-D positions + delta).
Below that: the rotary against transformers' own, the prompt's positions against its get_rope_index, the runner's
positions for every kind of span, and the checkpoint names of both transformers layouts.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.attention import SeqSpec, build_attention_metadata
from llmserve.layers.rotary import MRotaryEmbedding, rope_config
from llmserve.vl.inputs import MRopePositions
from llmserve.worker.model_runner import Span, _mrope_positions
from tests.tiny_vlms import QWEN_VL_ARCHS, hf_reference, test_image, user_messages

ARCHS = QWEN_VL_ARCHS
NEW_TOKENS = 10
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
QUESTION = "What is the capital of France?"
# (text, [(seed, (width, height))]): grids 6x4 patches; 8x6 and 4x10 (two sizes); none
CASES = [
    (QUESTION, [(3, (16, 24))]),
    ("The quick brown fox", [(1, (24, 36)), (2, (40, 16))]),
    ("Hello world, this is a tiny tokenizer.", []),
]


def images_of(case) -> list:
    return [test_image(seed, size) for seed, size in case[1]]


def prompt_of(case):
    return (case[0], images_of(case)) if case[1] else case[0]





def hf_inputs(model_dir: str, case):
    _, proc = hf_reference(model_dir)
    images = images_of(case)
    rendered = proc.apply_chat_template(user_messages(case[0], len(images)), add_generation_prompt=True)
    return proc(text=rendered, images=images or None, return_tensors="pt", add_special_tokens=False)


def hf_generate(model_dir: str, case):
    """(output tokens, per-step fp32 logits [NEW_TOKENS, V]) of transformers' greedy generate."""
    model, _ = hf_reference(model_dir)
    inputs = hf_inputs(model_dir, case)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def expected(tiny_vlm_dir) -> dict[str, list[list[int]]]:
    return {arch: [hf_generate(tiny_vlm_dir(arch), case)[0] for case in CASES] for arch in ARCHS}


def test_outputs_are_not_degenerate(expected):
    """A test over a constant output could not see a position off; these tiny models answer with varied tokens."""
    for outputs in expected.values():
        assert all(len(set(tokens)) >= 4 for tokens in outputs)
        assert len({tuple(tokens) for tokens in outputs}) == len(CASES)


# --- the rotary and the positions ----------------------------------------------------------------------------------

def test_mrope_rotary_matches_transformers():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    cfg = Qwen2VLConfig(text_config=dict(hidden_size=256, num_attention_heads=2, max_position_embeddings=512,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                          "mrope_section": [16, 24, 24]})).text_config
    ours = MRotaryEmbedding(128, rope_config(cfg))
    ref = Qwen2VLRotaryEmbedding(cfg)
    positions = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(0))
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = ref(torch.zeros(1, dtype=torch.float32), positions[:, None])  # [3, 1, T] -> [1, T, 128]
    assert torch.equal(cos[:, 0], ref_cos[0, :, :64]) and torch.equal(sin[:, 0], ref_sin[0, :, :64])
    # three equal rows are plain rotary: the 1-D path (text, CUDA graphs' decodes) gives the same
    flat = positions[0]
    assert all(torch.equal(a, b) for a, b in zip(ours(flat.expand(3, -1), torch.float32), ours(flat, torch.float32)))


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_positions_are_transformers(arch, tiny_vlm_dir):
    d = tiny_vlm_dir(arch)
    model, _ = hf_reference(d)
    with pipeline(d, dtype="float32") as pipe:
        for case in CASES:
            text = pipe.chat_template.messages_to_prompt(user_messages(case[0], len(case[1])))
            ids, mm = pipe.processor.prepare(text, images_of(case))
            inputs = hf_inputs(d, case)
            assert ids == inputs["input_ids"][0].tolist()
            if not case[1]:
                assert mm is None  # text: the sequence index in all three rows
                continue
            positions, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                          image_grid_thw=inputs["image_grid_thw"])
            assert torch.equal(mm.mrope.prompt, positions[:, 0]) and mm.mrope.delta == int(delta) < 0
            # text after the prompt (an answer, a later turn) is where decoding puts it: index + delta
            more = torch.tensor([[10, 11, 12]])
            longer, _ = model.model.get_rope_index(torch.cat([inputs["input_ids"], more], 1),
                                                   torch.cat([inputs["mm_token_type_ids"], 0 * more], 1),
                                                   image_grid_thw=inputs["image_grid_thw"])
            n = len(ids)
            assert torch.equal(longer[:, 0, n:], torch.arange(n, n + 3).add(mm.mrope.delta).expand(3, -1))
            # an image's placeholders run over its grid: their three rows differ
            first = mm.images[0].positions
            assert len(set(mm.mrope.prompt[1, first].tolist())) > 1
            assert len(set(mm.mrope.prompt[2, first].tolist())) > 1


def test_runner_positions_for_every_span():
    """Prefill chunks through an image, a prefix-cache hit (start > 0), a decode, drafts past the prompt, a text
    request: each at its prompt's positions, then index + delta."""
    # prompt of 6: text 0..1, an image of grid 2x2 (placeholders 2..5 at t=2, h=2..3, w=2..3), then two texts
    prompt = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5],
                           [0, 1, 2, 2, 3, 3, 4, 5],
                           [0, 1, 2, 3, 2, 3, 4, 5]])
    m = MRopePositions(prompt, delta=-2)  # max 5 + 1 - 8
    spans = [Span([7], 9, [], 1, mrope=m),  # a decode at index 9: 7 in all rows
             Span([7], 3, [], 1),  # a text request's decode
             Span([1, 2, 3], 1, [], 0, mrope=m),  # a chunk cutting the image
             Span([1, 2, 3, 4, 5, 6], 4, [], 3, mrope=m),  # a prefix hit at 4 running past the prompt, 2 drafts
             Span([1, 2], 0, [], 0)]  # a text request's prefill
    index = [s.start + i for s in spans for i in range(len(s.token_ids))]
    got = _mrope_positions(spans, index)
    expected = torch.cat([torch.full((3, 1), 7), torch.full((3, 1), 3), prompt[:, 1:4],
                          torch.cat([prompt[:, 4:], torch.tensor([[6, 7]] * 3)], 1), torch.tensor([[0, 1]] * 3)], 1)
    assert torch.equal(got, expected)
    assert index == [9, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]  # (the caller's list is left as it was)


# --- the engine against transformers -------------------------------------------------------------------------------

MODES = {
    "plain": dict(),
    "chunked": dict(max_prefill_token_num=5),  # the budget cuts every image's placeholders (see the test)
    "preempted": dict(block_size=4),  # num_blocks: the prompts' blocks and one more
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, mode, tiny_vlm_dir, expected):
    d = tiny_vlm_dir(arch)
    lengths = [hf_inputs(d, case)["input_ids"].shape[1] for case in CASES]
    extra = {}
    if mode == "preempted":  # all three prompts are admitted, their outputs do not fit: preemption by recompute
        extra["num_blocks"] = sum(-(-n // 4) for n in lengths) + 1
    config = EngineConfig(dtype="float32", **{"block_size": 8, **MODES[mode], **extra})
    with pipeline(d, backend_config=config) as pipe:
        engine = pipe.engine
        if mode == "chunked":  # each image's placeholders straddle a chunk boundary
            for case in CASES[:2]:
                text = pipe.chat_template.messages_to_prompt(user_messages(case[0], len(case[1])))
                for item in pipe.processor.prepare(text, images_of(case))[1].images:
                    assert item.positions[0] // 5 < item.positions[-1] // 5
        out = pipe([prompt_of(case) for case in CASES], gen_config=GREEDY)
        assert [r.token_ids for r in out] == expected[arch]
        assert [r.input_token_len for r in out] == lengths
        if mode == "plain":  # each alone too
            assert [pipe(prompt_of(case), gen_config=GREEDY).token_ids for case in CASES] == expected[arch]
        if mode == "preempted":
            assert engine.scheduler.num_preemptions > 0
        if mode == "prefix-cached":
            hits = engine.kv.prefix_stats.hit_tokens
            again = pipe([prompt_of(case) for case in CASES], gen_config=GREEDY)
            assert [r.token_ids for r in again] == expected[arch]
            # every full block of each prompt but its last token's: the images' placeholders too
            assert engine.kv.prefix_stats.hit_tokens - hits == sum((n - 1) // 4 * 4 for n in lengths)
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_every_step_logprob_matches_transformers(arch, tiny_vlm_dir):
    """The chosen token's logprob at every step, prefill and decodes, within fp32 noise of transformers': a decode
    at a wrong position (a delta off) moves it by far more."""
    d = tiny_vlm_dir(arch)
    case = CASES[1]
    tokens, logits = hf_generate(d, case)
    ref = torch.log_softmax(logits, -1)
    with pipeline(d, dtype="float32") as pipe:
        r = pipe(prompt_of(case), gen_config=GREEDY.replace(logprobs=1))
    assert r.token_ids == tokens
    for step, token in enumerate(tokens):
        assert r.logprobs[step][token] == pytest.approx(ref[step, token].item(), abs=1e-4)


class EagerGraphs:
    """What worker/cuda_graphs.py's captured decode computes, run eagerly: one token per request, the model given
    1-D positions (index + delta), the KV slots and lengths by sequence index."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps = 0

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return True

    def run(self, token_ids, positions, block_tables, rope_deltas=None):
        self.steps += 1
        r = self.runner
        meta = build_attention_metadata([SeqSpec(p, 1, t) for p, t in zip(positions, block_tables)], r.block_size,
                                        r.device)
        rotary = torch.tensor(positions) + torch.tensor(rope_deltas)
        return r.model.compute_logits(r.model(torch.tensor(token_ids), rotary, meta))


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_decode_path_with_deltas(arch, tiny_vlm_dir, expected):
    """CUDA graphs decode from 1-D positions: the runner hands them each request's delta, and the outputs stay
    transformers'. (The capture itself needs a GPU; this runs what it replays.)"""
    with pipeline(tiny_vlm_dir(arch), dtype="float32") as pipe:
        runner = pipe.engine.runner
        runner.graphs = EagerGraphs(runner)
        out = pipe([prompt_of(case) for case in CASES], gen_config=GREEDY)
        assert [r.token_ids for r in out] == expected[arch]
        assert runner.graphs.steps >= NEW_TOKENS - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_async_scheduling_decodes_with_deltas(arch, tiny_vlm_dir, expected):
    """Async scheduling (forced on here; the default with CUDA): decode steps launched before the last one's tokens
    are read keep each request's M-RoPE delta, and the outputs stay transformers'."""
    from tests.engine.test_async_scheduling import Ahead

    with pipeline(tiny_vlm_dir(arch), dtype="float32", async_scheduling=True) as pipe:
        ahead = Ahead(pipe.engine)
        out = pipe([prompt_of(case) for case in CASES], gen_config=GREEDY)
        assert [r.token_ids for r in out] == expected[arch]
        assert ahead.count >= NEW_TOKENS - 2


# --- checkpoints ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_both_checkpoint_layouts(arch, tiny_vlm_dir, expected, tmp_path):
    """transformers 4's names (visual.*, model.* for the language model: the hub's, and what save_pretrained writes)
    and transformers 5's (model.visual.*, model.language_model.*) load to the same model."""
    from safetensors.torch import load_file, save_file

    d = tiny_vlm_dir(arch)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    assert any(n.startswith("visual.") for n in tensors) and any(n.startswith("model.layers.") for n in tensors)
    renamed = {("model." + n if n.startswith("visual.") else
                n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
               for n, t in tensors.items()}
    for name in os.listdir(d):
        if name != "model.safetensors":
            with open(os.path.join(d, name), "rb") as src, open(tmp_path / name, "wb") as dst:
                dst.write(src.read())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((tmp_path / "config.json").read_text())["architectures"][0].endswith("ForConditionalGeneration")
    with pipeline(str(tmp_path), dtype="float32") as pipe:
        assert pipe(prompt_of(CASES[1]), gen_config=GREEDY).token_ids == expected[arch][1]


@pytest.mark.parametrize("arch", ARCHS)
def test_session_turn_after_an_image(arch, tiny_vlm_dir):
    """A chat session's second turn reuses the first turn's KV, images included, and answers as the whole
    conversation prefilled at once, whose positions transformers' rope index computes anew."""
    with pipeline(tiny_vlm_dir(arch), dtype="float32", block_size=4) as pipe:
        sess = pipe.chat(prompt_of(CASES[1]), gen_config=GREEDY)
        sess = pipe.chat("The quick brown fox", session=sess, gen_config=GREEDY)
        # the first prompt's 58 tokens in whole blocks (the random answer's text tokenizes anew)
        assert pipe.engine.sessions.hit_tokens == 56
        pipe.engine.kv.reset_prefix_cache()
        assert pipe(sess.history[:-1], gen_config=GREEDY).token_ids == sess.response.token_ids


def test_native_decoder_stack_takes_mrope(tiny_vlm_dir, monkeypatch):
    """bf16: the native decoder stack runs the language model over M-RoPE's cos/sin as the Python layers do."""
    prompts = [prompt_of(case) for case in CASES]
    with pipeline(tiny_vlm_dir("qwen2_vl"), dtype="bfloat16") as pipe:
        stacked = [r.token_ids for r in pipe(prompts, gen_config=GREEDY)]
        if pipe.engine.loaded.model.language_model.model._stack is None:
            pytest.skip("the native decoder stack does not cover this CPU (it needs AVX-512 kernels)")
        monkeypatch.setenv("LLMSERVE_DECODER_STACK", "0")
        assert [r.token_ids for r in pipe(prompts, gen_config=GREEDY)] == stacked
