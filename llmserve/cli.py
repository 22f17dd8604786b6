"""`llmserve serve | generate | list` (and the commands other modules register). Engine, server and
generation flags are built from the config dataclasses, so their help text is the fields' own docs.
Commands that load a model take it either as the first positional argument or as --model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from typing import Any

from llmserve.config import ChatTemplateConfig, EngineConfig, GenerationConfig
from llmserve.errors import InvalidRequestError

# Generation flags offered on the command line (the rest are API-only).
_GEN_FLAGS = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p",
              "repetition_penalty", "random_seed", "stop_words", "ignore_eos", "use_beam_search", "beam_width",
              "length_penalty")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None,
                        group_title: str | None = None) -> None:
    group = parser.add_argument_group(group_title) if group_title else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        flags = [f.metadata.get("cli", "--" + f.name.replace("_", "-")), *f.metadata.get("aliases", ())]
        base, nargs = _element_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        if base is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{help_text} (default: {default})")
        else:
            parse = _CLI_TYPES[f.metadata["cli_type"]] if "cli_type" in f.metadata else base
            nargs = f.metadata.get("cli_nargs", nargs)
            group.add_argument(*flags, dest=f.name, type=parse, nargs=nargs, default=None,
                               help=f"{help_text} (default: {default})")


def _limit_mm(text: str) -> int:
    from llmserve.config import parse_limit_mm

    try:
        return parse_limit_mm(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_CLI_TYPES = {"limit_mm": _limit_mm, "adapters": str}


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

    response_format = response_format_from_args(args)
    with pipeline(args.model, backend_config=dataclass_from_args(EngineConfig, args), log_level=args.log_level,
                  chat_template_config=chat_template_config_from_args(args)) as pipe:
        gen = dataclass_from_args(GenerationConfig, args, base=pipe.default_gen_config)
        gen = gen.replace(response_format=response_format) if response_format is not None else gen
        # with images, LMDeploy's (text, [images]): before the text, or where it says <IMAGE_TOKEN>
        prompt = (args.prompt, args.image) if args.image else args.prompt
        for response in pipe.stream_infer(prompt, gen_config=gen, do_preprocess=not args.no_chat_template,
                                          adapter_name=args.adapter_name):
            sys.stdout.write(response.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching the schema in FILE")
    group.add_argument("--json", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", metavar="REGEX", help="the whole output matches REGEX")
    group.add_argument("--choice", metavar="TEXT", nargs="+", help="the output is one of these strings")
    group.add_argument("--grammar", metavar="FILE", help="the output matches the EBNF grammar in FILE (root rule `root`)")


def response_format_from_args(args: argparse.Namespace) -> Any:
    from llmserve.structured import spec

    def read(path: str, what: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError as e:
            raise InvalidRequestError(f"--{what}: cannot read {path}: {e.strerror}") from None

    if getattr(args, "json_schema", None):
        return spec.json_schema(read(args.json_schema, "json-schema"), "--json-schema")
    if getattr(args, "json", False):
        return spec.any_json("--json")
    if getattr(args, "regex", None):
        return spec.regex(args.regex, "--regex")
    if getattr(args, "choice", None):
        return spec.choice(args.choice, "--choice")
    if getattr(args, "grammar", None):
        return spec.grammar(read(args.grammar, "grammar"), "--grammar")
    return None


def _cmd_tune(args: argparse.Namespace) -> int:
    """Measure the kernel choices of the model's bf16 and fp32 matmuls on this machine again, cache them, print the
    table."""
    import torch

    from llmserve.kernels import calibrate
    from llmserve.models.loader import load_model
    from llmserve.worker.cpu_tuning import configure_cpu

    config = dataclass_from_args(EngineConfig, args)
    loaded = load_model(args.model, config)
    if loaded.device.type != "cpu":
        print(f"nothing to tune: the model runs on {loaded.device}, where the choices are not measured")
        return 0
    threads = configure_cpu(config.num_threads)
    with torch.inference_mode():
        table = calibrate.plan(loaded.model, threads, config.kernel_choice, remeasure=True, dtype=loaded.dtype,
                               rows=calibrate.row_limits(config))
    if table is None:
        print(f"nothing to tune: the model has no bf16 or fp32 matmul with two paths here, nor native bf16 attention "
              f"(dtype {loaded.dtype})")
        return 0
    print(f"{calibrate.cpu_model()}, {threads} threads, torch {torch.__version__}")
    print(calibrate.report(table))
    print(f"kernel choice: {table.describe()}")
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.serve.config import ServerConfig
    from llmserve.serve.server import serve

    if args.backend is not None:  # LMDeploy's flag: taken so its command lines run, said so rather than ignored
        logging.getLogger("llmserve").warning("--backend %s: llmserve has one engine, which serves either way (see "
                                              "docs/compat.md)", args.backend)
    engine_config = dataclass_from_args(EngineConfig, args)
    from llmserve.distributed.workers import run_worker_node, torchrun_rank

    rank = torchrun_rank()
    if engine_config.node_rank > 0 or (rank is not None and rank > 0):  # only this node's tensor-parallel ranks
        logging.basicConfig(level=args.log_level)
        return run_worker_node(args.model, engine_config)
    return serve(args.model, engine_config, dataclass_from_args(ServerConfig, args),
                 chat_template_config_from_args(args), log_level=args.log_level)


def add_engine_flags(parser: argparse.ArgumentParser, log_level: str = "WARNING") -> None:
    parser.add_argument("--log-level", default=log_level, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help=f"logging level (default: {log_level})")
    add_dataclass_flags(parser, EngineConfig, group_title="engine")


def add_model_flags(parser: argparse.ArgumentParser, log_level: str = "WARNING") -> None:
    """What every model-loading command takes: the model (`llmserve CMD [MODEL]` or `--model MODEL`),
    the chat template, and the engine flags (LMDeploy's names, help from EngineConfig's field docs)."""
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="same as the MODEL argument")
    add_engine_flags(parser, log_level)
    add_dataclass_flags(parser, ChatTemplateConfig, ("chat_template", "meta_instruction"), group_title="chat template")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="a local directory, a hub id or a .gguf file "
                                                               "(default: the embedded SmolLM2-135M-Instruct)")


def resolve_model(args: argparse.Namespace) -> None:
    """Merge `--model` into the positional MODEL; both given and different is an error."""
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if getattr(args, "model", None) not in (None, flag):
        raise InvalidRequestError(f"two models given: {args.model!r} and --model {flag!r}; give one")
    args.model = flag


def chat_template_config_from_args(args: argparse.Namespace) -> ChatTemplateConfig | None:
    """--chat-template names a built-in template (see `llmserve list`), or is a jinja string or file."""
    from llmserve.chat_template import BUILTIN_TEMPLATES

    template, meta = getattr(args, "chat_template", None), getattr(args, "meta_instruction", None)
    if template is None and meta is None:
        return None
    if template in BUILTIN_TEMPLATES:
        return ChatTemplateConfig(model_name=template, meta_instruction=meta)
    return ChatTemplateConfig(chat_template=template, meta_instruction=meta)


def build_parser() -> argparse.ArgumentParser:
    from llmserve.serve.config import ServerConfig

    parser = argparse.ArgumentParser(prog="llmserve", description="Serve and run large language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve a model over HTTP: OpenAI (/v1) and TGI (/generate) APIs, "
                                       "/metrics, and a chat page at /")
    add_model_argument(srv)
    add_model_flags(srv, log_level="INFO")
    add_dataclass_flags(srv, ServerConfig, group_title="server")
    srv.add_argument("--backend", choices=("turbomind", "pytorch"), default=None,
                     help="LMDeploy's engine choice, accepted for its command lines: llmserve has one engine")
    srv.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt on the terminal")
    add_model_argument(gen)
    gen.add_argument("prompt", help="the prompt (a user message; the chat template is applied)")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    gen.add_argument("--image", action="append", metavar="PATH_OR_URL",
                     help="an image for a vision-language model: a file, an http(s) URL or a data: URL; repeat it for "
                          "several. They go before the prompt's text, or each where the prompt says <IMAGE_TOKEN>")
    gen.add_argument("--adapter-name", metavar="NAME",
                     help="answer with this LoRA adapter (one of --adapters NAME=PATH ...)")
    add_model_flags(gen)
    add_dataclass_flags(gen, GenerationConfig, _GEN_FLAGS, group_title="generation")
    add_structured_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    tune = sub.add_parser("tune", help="time the CPU kernels the model's bf16 and fp32 matmuls may take, at each "
                                       "batch size, on this machine; cache and print the choice (serve and the rest "
                                       "reuse it)")
    add_model_argument(tune)
    add_model_flags(tune, log_level="WARNING")
    tune.set_defaults(func=_cmd_tune)

    lst = sub.add_parser("list", help="list supported architectures and built-in chat templates")
    lst.set_defaults(func=_cmd_list)

    # --- chat: llmserve/chat_cli.py ---
    def run_chat(args: argparse.Namespace) -> int:
        from llmserve.chat_cli import run  # on use only: it imports torch

        return run(args)

    chat = sub.add_parser("chat", help="chat with a model on the terminal (multi-turn, streaming; /help inside)")
    add_model_argument(chat)
    chat.add_argument("--stats", action="store_true", help="after each answer, print token counts, TTFT and "
                                                           "tokens/s to stderr")
    add_model_flags(chat)
    add_dataclass_flags(chat, GenerationConfig, _GEN_FLAGS, group_title="generation")
    chat.set_defaults(func=run_chat)
    # --- end chat ---
    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    from llmserve.errors import LLMServeError

    args = build_parser().parse_args(argv)
    try:
        resolve_model(args)
        return args.func(args)
    except LLMServeError as e:
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
