"""Benchmark workloads: ShareGPT-format files (as vLLM's and LMDeploy's scripts read them) or
synthetic chat prompts of controlled length."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llmserve.chat_template import ChatTemplate
from llmserve.errors import InvalidRequestError

# Plain words to build synthetic user messages from (deterministic, tokenizer-independent).
_WORDS = ("the of and to in is was for on that with as by at from it an be this which or are have not had "
          "but were all one their there been has more its also new other some time these would two first "
          "system model data city river history music science language water energy market school garden "
          "ocean mountain computer network engine question answer summary report travel kitchen winter").split()


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt_text: str = ""  # the chat message, for the serving benchmark


def synthetic_chat(tokenizer: PreTrainedTokenizerBase, template: ChatTemplate, num_prompts: int,
                   input_len: tuple[int, int], output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Chat prompts whose templated length is drawn uniformly from [input_len[0], input_len[1]] tokens: at
    most the drawn length, and short of it by less than one word (unless one word is already longer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        target = rng.randint(*input_len)
        words: list[str] = []
        ids: list[int] = []

        def encode(words: list[str]) -> tuple[str, list[int]]:
            text = "Please write about: " + " ".join(words)
            return text, tokenizer.encode(template.messages_to_prompt([{"role": "user", "content": text}]),
                                          add_special_tokens=False)

        while len(ids) < target:
            words.extend(rng.choice(_WORDS) for _ in range(max(1, (target - len(ids)) // 2)))
            text, ids = encode(words)
        # A tokenizer that splits words into several tokens overshoots: take words back off the end.
        while len(ids) > target and len(words) > 1:
            words.pop()
            text, ids = encode(words)
        out.append(BenchRequest(ids, output_len, text))
    return out


def sharegpt(path: str, tokenizer: PreTrainedTokenizerBase, template: ChatTemplate, num_prompts: int,
             output_len: int | None, max_len: int, seed: int = 0) -> list[BenchRequest]:
    """First human turn as the prompt; the first gpt turn's token count as the output length unless
    output_len is given. Conversations without both, or longer than max_len, are skipped."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"cannot read the dataset {path}: {e}") from e
    random.Random(seed).shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        gpt = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if not human or not gpt:
            continue
        ids = tokenizer.encode(template.messages_to_prompt([{"role": "user", "content": human}]),
                               add_special_tokens=False)
        n_out = output_len or len(tokenizer.encode(gpt, add_special_tokens=False))
        if n_out < 1 or len(ids) + n_out > max_len:
            continue
        out.append(BenchRequest(ids, n_out, human))
        if len(out) == num_prompts:
            break
    if not out:
        raise InvalidRequestError(f"{path}: no usable conversations (ShareGPT format: a list of "
                                  "{'conversations': [{'from': 'human'|'gpt', 'value': ...}]})")
    return out
