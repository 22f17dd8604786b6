"""Predicted Outputs (GenerationConfig.prediction, OpenAI's `prediction`) on a code edit, same run: the embedded
SmolLM2 as served (defaults), greedy, asked to rewrite a piece of this repository's code; without a prediction, with
the code before the edit as the prediction (what an editor sends), and with the model's own answer (the bound).

    .venv/bin/python scripts/bench_prediction.py [--lines 40] [--output-len 400] [--batch 1]
"""

from __future__ import annotations

import argparse
import pathlib
import time

from llmserve import GenerationConfig, pipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=40, help="lines of llmserve/engine/scheduler.py to edit")
    ap.add_argument("--output-len", type=int, default=400)
    ap.add_argument("--batch", type=int, default=1, help="the same request this many times at once")
    args = ap.parse_args()
    root = pathlib.Path(__file__).resolve().parent.parent
    code = "\n".join((root / "llmserve/engine/scheduler.py").read_text().splitlines()[:args.lines])
    ask = ("Add type hints where they are missing in this Python code and change nothing else. Reply with the whole "
           "code only.\n\n```python\n" + code + "\n```")
    with pipeline() as pipe:
        ids = pipe.tokenizer.encode(pipe.chat_template.messages_to_prompt([{"role": "user", "content": ask}]),
                                    add_special_tokens=False)
        prompts = [{"input_ids": ids}] * args.batch

        def run(prediction: str | None) -> tuple[list, float]:
            gen = GenerationConfig(temperature=0.0, max_new_tokens=args.output_len, prediction=prediction)
            t = time.perf_counter()
            out = pipe(prompts, gen_config=gen)
            return out, time.perf_counter() - t

        run(None)  # warm-up
        plain, t_plain = run(None)
        answer = plain[0].text
        for name, prediction in (("none", None), ("the code before the edit", "```python\n" + code + "\n```"),
                                 ("the answer itself", answer)):
            before = pipe.engine.spec_stats.num_draft_tokens, pipe.engine.spec_stats.num_accepted_tokens
            out, elapsed = (plain, t_plain) if prediction is None else run(prediction)
            drafted = pipe.engine.spec_stats.num_draft_tokens - before[0]
            accepted = pipe.engine.spec_stats.num_accepted_tokens - before[1]
            tokens = sum(r.generate_token_len for r in out)
            same = all(r.token_ids == p.token_ids for r, p in zip(out, plain))
            print(f"prediction: {name:26s} {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:6.1f} tok/s "
                  f"({t_plain / elapsed:.2f}x), drafts {accepted} accepted / {drafted - accepted} rejected, "
                  f"{'same tokens' if same else 'TOKENS DIFFER'}")


if __name__ == "__main__":
    main()
