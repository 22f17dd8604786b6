"""Images on the command line, run as a user runs them, on a tiny LLaVA: `llmserve generate --image` (repeatable)
and `llmserve chat`'s `/image` command. Greedy answers are compared with the offline pipeline's for the same images
and text; another image answers differently, so a CLI that dropped an image could not pass."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from llmserve.api import pipeline
from tests.tiny_vlms import test_image as make_image

pytestmark = pytest.mark.slow

PROMPT = "What is in the picture?"
Q2 = "And the colours?"
MAX_NEW = 8
FLAGS = ["--temperature", "0", "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--dtype", "float32"]
STATS = re.compile(r"^\[prompt (\d+) tokens · answer (\d+) tokens")


def llmserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("images")
    paths = [d / "a.png", d / "b.png"]
    for seed, path in enumerate(paths):
        make_image(seed, (40, 50)).save(path)
    return paths


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir: Callable[[str], str]) -> str:
    return tiny_vlm_dir("llava")


def test_generate_with_images(vlm: str, images: list[Path], tiny_model_dir: Callable[[str], str]) -> None:
    a, b = images
    with pipeline(vlm, dtype="float32") as pipe:
        def answer(prompt: object, **kw: object) -> str:
            return pipe(prompt, temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, **kw).text

        two = answer((PROMPT, [str(a), str(b)]))
        raw = answer((f"Look: <IMAGE_TOKEN> {PROMPT}", str(a)), do_preprocess=False)
        assert two != answer((PROMPT, [str(b), str(a)]))  # the images and their order decide the answer

    out = llmserve("generate", vlm, PROMPT, "--image", str(a), "--image", str(b), *FLAGS)
    assert (out.returncode, out.stdout) == (0, two + "\n"), out.stderr
    out = llmserve("generate", vlm, f"Look: <IMAGE_TOKEN> {PROMPT}", "--image", a.as_uri(), "--no-chat-template",
                   *FLAGS)
    assert (out.returncode, out.stdout) == (0, raw + "\n"), out.stderr

    out = llmserve("generate", vlm, PROMPT, "--image", str(a.with_name("missing.png")), *FLAGS)
    assert out.returncode == 2
    assert f"cannot read the image path '{a.with_name('missing.png')}': No such file or directory" in out.stderr
    text_only = tiny_model_dir("llama")
    out = llmserve("generate", text_only, PROMPT, "--image", str(a), *FLAGS)
    assert out.returncode == 2 and "takes text only, and the prompt has 1 image(s)" in out.stderr, out.stderr


def test_chat_image_command(vlm: str, images: list[Path]) -> None:
    a, b = images
    stdin = "\n".join(["/image", f"/image {a.with_name('missing.png')}", f"/image {a}", PROMPT, Q2, "/reset",
                       f"/image {b}", PROMPT, ""])
    out = llmserve("chat", vlm, "--stats", *FLAGS, stdin=stdin)
    assert out.returncode == 0, out.stderr

    with pipeline(vlm, dtype="float32") as pipe:
        gen = pipe.default_gen_config.replace(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
        first = pipe.chat((PROMPT, str(a)), gen_config=gen)
        turn1 = first.response
        turn2 = pipe.chat(Q2, first, gen_config=gen).response
        other = pipe.chat((PROMPT, str(b)), gen_config=gen).response
        alone = pipe.chat(Q2, gen_config=gen).response
    assert turn2.text != alone.text  # the second turn's answer depends on the image in the history

    assert out.stdout == f"{turn1.text}\n{turn2.text}\n{other.text}\n"
    prompts = [int(m[1]) for line in out.stderr.splitlines() if (m := STATS.match(line))]
    assert prompts == [turn1.input_token_len, turn2.input_token_len, other.input_token_len]
    assert "usage: /image PATH_OR_URL" in out.stderr
    assert f"error: /image: cannot read the image path '{a.with_name('missing.png')}'" in out.stderr
    assert f"[image 1 attached: {a} (40x50); it goes with the next message]" in out.stderr
    assert f"[image 1 attached: {b} (40x50); it goes with the next message]" in out.stderr


def test_chat_image_on_a_text_only_model(tiny_model_dir: Callable[[str], str], images: list[Path]) -> None:
    model = tiny_model_dir("llama")
    out = llmserve("chat", model, *FLAGS, stdin=f"/image {images[0]}\n{PROMPT}\n")
    assert out.returncode == 0, out.stderr
    assert f"error: {Path(model).name} takes text only: /image needs a vision-language model" in out.stderr
    with pipeline(model, dtype="float32") as pipe:
        expected = pipe([{"role": "user", "content": PROMPT}], temperature=0.0, max_new_tokens=MAX_NEW,
                        ignore_eos=True).text
    assert out.stdout == expected + "\n"  # the message went on, without the image
