"""Command line: `kvforge generate | verify | info`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kvforge.errors import KVForgeError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_KV_BUDGET = "1GiB"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"named model (smollm2-135m, gemma3-270m), a .gguf file or a Hugging Face "
                             f"checkpoint directory (default {DEFAULT_MODEL})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the result as JSON")


def _write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="KV-cache reshaping for LLM inference")
    verbs = parser.add_subparsers(dest="verb", required=True)

    gen = verbs.add_parser("generate", help="greedy generation for one or more prompts")
    _add_model_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    gen.add_argument("--cache", default="full", help="cache method, optionally name:key=value,...")
    gen.add_argument("--cache-opt", action="append", default=[], metavar="KEY=VALUE",
                     help="cache method option (repeatable)")
    gen.add_argument("--kv-budget", default=DEFAULT_KV_BUDGET, help="KV-cache memory budget, e.g. 512MB")
    gen.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")

    ver = verbs.add_parser("verify", help="compare kvforge with transformers on the same weights")
    _add_model_args(ver)
    ver.add_argument("--text-file", default=None,
                     help="text whose held-out part supplies the passage (default: "
                          "../shared/data/wikitext-2-raw-test.txt)")
    ver.add_argument("--passage-tokens", type=int, default=256,
                     help="length of the scored passage (longer than a sliding window to test it)")
    _add_json_arg(ver)

    info = verbs.add_parser("info", help="architecture, parameters and KV bytes per token")
    _add_model_args(info)
    _add_json_arg(info)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from kvforge.cache.registry import create_cache, parse_cache_spec
    from kvforge.engine.greedy import greedy_generate
    from kvforge.engine.runner import ModelRunner
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model, parse_dtype
    from kvforge.models.tokenizer import encode_prompt, has_chat_template, load_tokenizer
    from kvforge.sizes import parse_bytes

    if args.max_tokens < 1:
        raise ConfigError("max_tokens", args.max_tokens, "must be >= 1")
    dtype = parse_dtype(args.dtype)
    spec = parse_cache_spec(args.cache, args.cache_opt)
    budget = parse_bytes(args.kv_budget)
    model, source = load_model(args.model, dtype=dtype)
    tokenizer = load_tokenizer(source)
    chat = not args.raw and has_chat_template(tokenizer)
    prompts = [encode_prompt(tokenizer, text, chat=chat) for text in args.prompts]
    for text, ids in zip(args.prompts, prompts):
        if not ids:
            raise ConfigError("prompt", text, "must encode to at least one token")
    runner = ModelRunner(model, create_cache(spec, model.cache_layout(), budget, dtype))
    stops = sorted(set(model.config.eos_token_ids) | {tokenizer.eos_token_id} - {None})
    streaming = len(prompts) == 1
    printed = ""
    generated: list[int] = []

    def stream(seq_id: int, token: int) -> None:
        nonlocal printed
        if token in stops:
            return
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    outputs = greedy_generate(runner, prompts, args.max_tokens, stop_token_ids=stops,
                              on_token=stream if streaming else None)
    if streaming:
        print()
        return 0
    for text, ids in zip(args.prompts, outputs):
        print(f"### {text}\n{tokenizer.decode(ids, skip_special_tokens=True)}\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvforge.verify import run_verify

    report = run_verify(args.model, text_file=args.text_file, passage_tokens=args.passage_tokens)
    print(f"model                      {report.model}")
    print(f"passage tokens             {report.passage_tokens}")
    print(f"max_abs_logit_diff         {report.max_abs_logit_diff:.3e}  "
          f"(prefill {report.prefill_max_abs_logit_diff:.3e}, decode {report.decode_max_abs_logit_diff:.3e})")
    print(f"argmax_agreement           {report.argmax_agreement:.4f}")
    print(f"greedy_match               {str(report.greedy_match).lower()}")
    _write_json(args.json, report.as_dict())
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from kvforge.info import format_info, model_info

    info = model_info(args.model)
    print(format_info(info))
    _write_json(args.json, info)
    return 0


COMMANDS = {"generate": cmd_generate, "verify": cmd_verify, "info": cmd_info}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        return COMMANDS[args.verb](args)
    except KVForgeError as exc:
        print(f"kvforge {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
