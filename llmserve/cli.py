"""`llmserve generate | list` (and the commands other modules register). Engine and generation
flags are built from the config dataclasses, so their help text is the fields' own docs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any

from llmserve.config import EngineConfig, GenerationConfig

# Generation flags offered on the command line (the rest are API-only).
_GEN_FLAGS = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
              "random_seed", "stop_words", "ignore_eos")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None,
                        group_title: str | None = None) -> None:
    group = parser.add_argument_group(group_title) if group_title else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        flag = f.metadata.get("cli", "--" + f.name.replace("_", "-"))
        base, nargs = _element_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{help_text} (default: {default})")
        else:
            group.add_argument(flag, dest=f.name, type=base, nargs=nargs, default=None,
                               help=f"{help_text} (default: {default})")


def _element_type(tp: Any) -> tuple[type, str | None]:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return _element_type(args[0])
    if typing.get_origin(tp) is list:
        return args[0], "+"
    if typing.get_origin(tp) is dict:
        return str, None
    return tp, None


def dataclass_from_args(cls: type, args: argparse.Namespace, base: Any = None) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if getattr(args, f.name, None) is not None}
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def _cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.api import pipeline

    with pipeline(args.model, backend_config=dataclass_from_args(EngineConfig, args), log_level=args.log_level) as pipe:
        gen = dataclass_from_args(GenerationConfig, args, base=pipe.default_gen_config)
        for response in pipe.stream_infer(args.prompt, gen_config=gen, do_preprocess=not args.no_chat_template):
            sys.stdout.write(response.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from llmserve.chat_template import BUILTIN_TEMPLATES
    from llmserve.models.registry import supported_architectures

    print("architectures:")
    for name in supported_architectures():
        print(f"  {name}")
    print("built-in chat templates:")
    for name in BUILTIN_TEMPLATES:
        print(f"  {name}")
    return 0


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default: WARNING)")
    add_dataclass_flags(parser, EngineConfig, group_title="engine")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="Serve and run large language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt on the terminal")
    gen.add_argument("prompt", help="the prompt (a user message; the chat template is applied)")
    gen.add_argument("--model", default=None, help="a local directory, a hub id or a .gguf file "
                                                   "(default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_engine_flags(gen)
    add_dataclass_flags(gen, GenerationConfig, _GEN_FLAGS, group_title="generation")
    gen.set_defaults(func=_cmd_generate)

    lst = sub.add_parser("list", help="list supported architectures and built-in chat templates")
    lst.set_defaults(func=_cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    from llmserve.errors import LLMServeError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LLMServeError as e:
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
