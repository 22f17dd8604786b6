"""Vision-language models through the whole engine, token for token against transformers (fp32, greedy).

For each family (tests/tiny_vlms.py): the prompt's token ids equal the processor's, and the output equals
`transformers` generate for one image, two images, and a batch mixing text-only and image requests; plainly, with a
prefill budget that cuts through the image placeholders, prefix-cached, and preempted. Then the caches: the same text
with different images shares no KV and answers differently; the same image twice is a prefix-cache and an
encoder-cache hit with the same answer.
"""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from llmserve.vl import IMAGE_TOKEN
from tests.tiny_vlms import QWEN_VL_ARCHS, VL_ARCHS, hf_reference, test_image, user_messages

ARCHS = VL_ARCHS + QWEN_VL_ARCHS

NEW_TOKENS = 10
# min_new_tokens as transformers' (EOS masked until then), not ignore_eos (EOS sampled, then generation goes on)
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
QUESTION = "What is the capital of France?"
# (text, images): one image, two images of different sizes, and a text-only prompt
CASES = [
    (QUESTION, [(0, (40, 50))]),
    ("The quick brown fox", [(1, (70, 30)), (2, (33, 64))]),
    ("Hello world, this is a tiny tokenizer.", []),
]


def images_of(case) -> list:
    return [test_image(seed, size) for seed, size in case[1]]





def hf_inputs(model_dir: str, text: str, images: list):
    model, proc = hf_reference(model_dir)
    rendered = proc.apply_chat_template(user_messages(text, len(images)), add_generation_prompt=True)
    return proc(text=rendered, images=images or None, return_tensors="pt", add_special_tokens=False)


def hf_greedy(model_dir: str, text: str, images: list) -> list[int]:
    model, _ = hf_reference(model_dir)
    inputs = hf_inputs(model_dir, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def expected(tiny_vlm_dir) -> dict[str, list[list[int]]]:
    return {arch: [hf_greedy(tiny_vlm_dir(arch), text, images_of(case)) for case in CASES for text in [case[0]]]
            for arch in ARCHS}


MODES = {
    "plain": dict(),
    # every image prompt is longer than 9 tokens: its placeholders are cut across steps
    "chunked": dict(max_prefill_token_num=9),
    "preempted": dict(block_size=4),  # num_blocks: the prompts' blocks and one more (see the test)
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, mode, tiny_vlm_dir, expected):
    prompts = [(text, images_of(case)) if case[1] else text for case in CASES for text in [case[0]]]
    lengths = [hf_inputs(tiny_vlm_dir(arch), case[0], images_of(case))["input_ids"].shape[1] for case in CASES]
    extra = {}
    if mode == "preempted":  # all three prompts are admitted, and their outputs do not fit: preemption by recompute
        extra["num_blocks"] = sum(-(-n // 4) for n in lengths) + 1
    config = EngineConfig(dtype="float32", **{"block_size": 8, **MODES[mode], **extra})
    with pipeline(tiny_vlm_dir(arch), backend_config=config) as pipe:
        out = pipe(prompts, gen_config=GREEDY)
        engine = pipe.engine
        assert [r.token_ids for r in out] == expected[arch]
        assert [r.input_token_len for r in out] == lengths  # the prompt is the processor's expansion
        if mode == "preempted":
            assert engine.scheduler.num_preemptions > 0
        if mode == "prefix-cached":
            hits = engine.kv.prefix_stats.hit_tokens
            again = pipe(prompts, gen_config=GREEDY)
            assert [r.token_ids for r in again] == expected[arch]
            assert engine.kv.prefix_stats.hit_tokens > hits
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_first_step_logprobs_match_transformers(arch, tiny_vlm_dir):
    model, _ = hf_reference(tiny_vlm_dir(arch))
    case = CASES[1]
    with pipeline(tiny_vlm_dir(arch), dtype="float32") as pipe:
        r = pipe((case[0], images_of(case)), temperature=0.0, max_new_tokens=1, logprobs=5, ignore_eos=True)
    with torch.no_grad():
        ref = torch.log_softmax(model(**hf_inputs(tiny_vlm_dir(arch), case[0], images_of(case))).logits[0, -1], -1)
    top = torch.topk(ref, 5)
    got = r.logprobs[0]
    for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert got[tid] == pytest.approx(lp, abs=1e-4)


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
def test_images_key_the_caches(arch, tiny_vlm_dir):
    """Same text, different images: different answers and no KV shared past the text before the image. The same
    image again: prefix-cache and encoder-cache hits, the same answer."""
    config = EngineConfig(dtype="float32", block_size=4, enable_prefix_caching=True)
    a, b = test_image(10, (40, 50)), test_image(11, (40, 50))
    with pipeline(tiny_vlm_dir(arch), backend_config=config) as pipe:
        engine, model = pipe.engine, pipe.engine.loaded.model
        first = pipe((QUESTION, a), gen_config=GREEDY)
        hits = engine.kv.prefix_stats.hit_tokens
        other = pipe((QUESTION, b), gen_config=GREEDY)
        # the template's text before the image is shared (a block or so), the image's placeholders never
        image_start = min(pipe.processor.prepare(pipe.chat_template.messages_to_prompt(user_messages(QUESTION, 1)),
                                                 [b])[1].images[0].positions)
        assert engine.kv.prefix_stats.hit_tokens - hits <= image_start
        assert other.token_ids != first.token_ids
        assert model.encoder_stats.images_encoded == 2 and model.encoder_stats.cache_hits == 0
        hits = engine.kv.prefix_stats.hit_tokens
        again = pipe((QUESTION, a.copy()), gen_config=GREEDY)  # another object, the same pixels
        assert again.token_ids == first.token_ids
        assert engine.kv.prefix_stats.hit_tokens - hits >= first.input_token_len - 4
        # the prefix cache served the placeholders: nothing was left to encode
        assert model.encoder_stats.images_encoded == 2
        engine.kv.reset_prefix_cache()
        again = pipe((QUESTION, a), gen_config=GREEDY)
        assert again.token_ids == first.token_ids
        assert model.encoder_stats.images_encoded == 2 and model.encoder_stats.cache_hits == 1


def test_prompt_shapes(tiny_vlm_dir):
    """LMDeploy's shapes: (text, image), (text, [images]), IMAGE_TOKEN placing the image, GPT-4V messages with
    image_url (data: URL) and image_data parts, a batch of tuples and strings, stream_infer and chat sessions."""
    import base64
    import io

    d = tiny_vlm_dir("llava")
    img, img2 = test_image(3, (40, 50)), test_image(4, (50, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with pipeline(d, dtype="float32") as pipe:
        single = pipe((QUESTION, img), gen_config=GREEDY)
        assert single.token_ids == hf_greedy(d, QUESTION, [img])
        assert pipe((QUESTION, [img]), gen_config=GREEDY).token_ids == single.token_ids
        as_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": QUESTION}]}]
        assert pipe(as_messages, gen_config=GREEDY).token_ids == single.token_ids
        data = [{"role": "user", "content": [{"type": "image_data", "image_data": {"data": img}},
                                             {"type": "text", "text": QUESTION}]}]
        assert pipe(data, gen_config=GREEDY).token_ids == single.token_ids
        # IMAGE_TOKEN: the image after the text, as the processor's template would put an image part there
        after = pipe((f"{QUESTION}{IMAGE_TOKEN}", img), gen_config=GREEDY)
        model, proc = hf_reference(d)
        rendered = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                                          {"type": "image"}]}],
                                            add_generation_prompt=True)
        inputs = proc(text=rendered, images=[img], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert after.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
        batch = pipe([(QUESTION, img), "Hello world", (QUESTION, [img, img2])], gen_config=GREEDY)
        assert batch[0].token_ids == single.token_ids
        assert batch[2].token_ids == hf_greedy(d, QUESTION, [img, img2])
        streamed: list[int] = []
        for r in pipe.stream_infer((QUESTION, img), gen_config=GREEDY):
            streamed.extend(r.token_ids)
        assert streamed == single.token_ids
        sess = pipe.chat((QUESTION, img), gen_config=GREEDY)
        assert sess.response.token_ids == single.token_ids
        sess = pipe.chat("The quick brown fox", session=sess, gen_config=GREEDY)
        assert sess.response.generate_token_len == NEW_TOKENS
        assert pipe.engine.sessions.hit_tokens > 0  # the second turn reused the first turn's KV, image included
        # the same conversation without a session (and without the prefix cache): the same answer
        pipe.engine.kv.reset_prefix_cache()
        assert pipe(sess.history[:-1], gen_config=GREEDY).token_ids == sess.response.token_ids


def test_bad_image_prompts(tiny_vlm_dir, tiny_model_dir):
    d = tiny_vlm_dir("llava")
    img = test_image(5, (40, 50))
    with pipeline(d, dtype="float32", limit_mm_per_prompt=2, max_image_pixels=5000) as pipe:
        with pytest.raises(InvalidRequestError, match="over the limit of 2 per prompt"):
            pipe((QUESTION, [img, img, img]))
        with pytest.raises(InvalidRequestError, match="over the limit"):
            pipe((QUESTION, test_image(6, (100, 100))))
        with pytest.raises(InvalidRequestError, match="not an image"):
            pipe((QUESTION, b"this is not an image"))
        with pytest.raises(InvalidRequestError, match=f"{IMAGE_TOKEN} 2 time"):
            pipe((f"a{IMAGE_TOKEN}b{IMAGE_TOKEN}", img))
        # the engine is unaffected
        assert pipe((QUESTION, img), gen_config=GREEDY).generate_token_len == NEW_TOKENS
        assert pipe.engine.kv.usage().in_use == 0
    with pipeline(tiny_model_dir("llama"), dtype="float32") as pipe:
        with pytest.raises(InvalidRequestError, match="takes text only"):
            pipe((QUESTION, img))
        with pytest.raises(InvalidRequestError, match="takes text only"):
            pipe([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x"}},
                                               {"type": "text", "text": "hi"}]}])
        # text parts alone are fine for a text model
        r = pipe([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], gen_config=GREEDY)
        assert r.generate_token_len == NEW_TOKENS


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_tokens_are_the_processors(arch, tiny_vlm_dir):
    """The chat rendered as the processor's apply_chat_template renders it, and its ids as the processor makes them."""
    _, proc = hf_reference(tiny_vlm_dir(arch))
    with pipeline(tiny_vlm_dir(arch), dtype="float32") as pipe:
        for case in CASES:
            images = images_of(case)
            text = pipe.chat_template.messages_to_prompt(user_messages(case[0], len(images)))
            assert text == proc.apply_chat_template(user_messages(case[0], len(images)), add_generation_prompt=True)
            ids, mm = pipe.processor.prepare(text, images)
            assert ids == hf_inputs(tiny_vlm_dir(arch), case[0], images)["input_ids"][0].tolist()
            assert (mm is None) == (not images)
            if mm is not None:  # every placeholder belongs to exactly one image, in order
                positions = [p for item in mm.images for p in item.positions]
                assert positions == [p for p, t in enumerate(ids) if t == pipe.processor.image_token_id]


def test_samples_beams_and_encoder_batches(tiny_vlm_dir):
    """n > 1 shares the image prompt, beam search carries the images through its forks, and VisionConfig's
    max_batch_size bounds the encoder passes; outputs as without them."""
    from llmserve import VisionConfig

    d = tiny_vlm_dir("llava")
    case = CASES[1]
    expected_tokens = hf_greedy(d, case[0], images_of(case))
    with pipeline(d, dtype="float32", vision_config=VisionConfig(max_batch_size=1)) as pipe:
        assert pipe.engine.loaded.model.max_batch_size == 1
        out = pipe((case[0], images_of(case)), gen_config=GREEDY.replace(n=2))
        assert [r.token_ids for r in out] == [expected_tokens, expected_tokens]
        model, _ = hf_reference(d)
        inputs = hf_inputs(d, case[0], images_of(case))
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False,
                                 early_stopping=True, length_penalty=1.0)
        beams = pipe((case[0], images_of(case)), max_new_tokens=6, min_new_tokens=6, use_beam_search=True,
                     beam_width=3, temperature=0.0)
        assert beams.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    with pytest.raises(InvalidRequestError, match="max_batch_size"):
        VisionConfig(max_batch_size=0)
