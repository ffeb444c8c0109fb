"""Command line: `kvforge generate | chat | serve | bench | eval | swiftkv | analyze | demo | report | verify | info | gpu-check`.

The top level knows each verb by its name, one line of help and where its code lives
(`VERBS`). Only the verb a command line names is imported, to add its arguments and run it,
so `kvforge --help` imports no verb's module (and with them torch).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from kvforge.errors import KVForgeError
from kvforge.tools.report.provenance import command_line


@dataclass(frozen=True)
class Verb:
    """`add_args` and `run` are "module:function": the function filling the verb's parser
    and the one running the parsed command (it returns the exit status)."""

    name: str
    add_args: str
    run: str
    help: str


def load_function(reference: str) -> Callable[..., Any]:
    """The function a "module:function" reference names (importing its module)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


VERBS: tuple[Verb, ...] = (
    Verb("generate", "kvforge.commands:add_generate_args", "kvforge.commands:cmd_generate",
         "generate text for one or more prompts"),
    Verb("chat", "kvforge.commands:add_chat_args", "kvforge.commands:cmd_chat",
         "interactive chat (type /reset to forget, /exit to quit, /help for the rest)"),
    Verb("serve", "kvforge.commands:add_serve_args", "kvforge.serve.server:run_serve",
         "OpenAI-compatible HTTP server (127.0.0.1:8000 by default)"),
    Verb("verify", "kvforge.commands:add_verify_args", "kvforge.commands:cmd_verify",
         "compare kvforge with transformers on the same weights"),
    Verb("info", "kvforge.commands:add_info_args", "kvforge.commands:cmd_info",
         "architecture, parameters and KV bytes per token"),
    Verb("bench", "kvforge.tools.bench.cli:add_bench_args", "kvforge.tools.bench.cli:run_bench",
         "measure prefill, decode or serving throughput"),
    Verb("eval", "kvforge.tools.eval.cli:add_eval_args", "kvforge.tools.eval.cli:run_eval",
         "quality: perplexity, pass-key retrieval (side by side)"),
    Verb("swiftkv", "kvforge.tools.swiftkv.cli:add_swiftkv_args", "kvforge.tools.swiftkv.cli:run_swiftkv",
         "SwiftKV checkpoints (init, distill, evaluate) and FLOP accounting (flops)"),
    Verb("analyze", "kvforge.tools.analysis.cli:add_analyze_args", "kvforge.tools.analysis.cli:run_analyze",
         "analysis figures: layer-input similarity (SwiftKV), key spectra (ShadowKV), K/V outlier channels (KIVI)"),
    Verb("demo", "kvforge.tools.demo:add_demo_args", "kvforge.tools.demo:cmd_demo",
         "base, SwiftKV, KIVI, ShadowKV and SwiftKV+KIVI on one long prompt"),
    Verb("report", "kvforge.tools.report.cli:add_report_args", "kvforge.tools.report.cli:run_report",
         "render docs/results.md and README's results table from result JSON"),
    Verb("gpu-check", "kvforge.tools.gpu_check.cli:add_gpu_check_args", "kvforge.tools.gpu_check.cli:run_gpu_check",
         "every cache method on a device against the CPU reference, then bench speed against transformers"),
)
VERB_NAMES = tuple(verb.name for verb in VERBS)
# `kvforge lm-eval ARGS...` is dispatched in main() before parsing: ARGS are lm_eval's own.
LM_EVAL_HELP = "lm-evaluation-harness with --model kvforge registered (arguments as lm_eval's)"


def build_parser(verbs: Collection[str] = ()) -> argparse.ArgumentParser:
    """The top-level parser: every verb with its help, and the arguments (which import the
    verb's module) of those named in `verbs` only. A verb left out parses no arguments."""
    parser = argparse.ArgumentParser(prog="kvforge", description="KV-cache reshaping for LLM inference")
    parser.add_argument("--version", action="version", version=f"kvforge {package_version()}")
    subparsers = parser.add_subparsers(dest="verb", required=True)
    for verb in VERBS:
        sub = subparsers.add_parser(verb.name, help=verb.help)
        if verb.name in verbs:
            load_function(verb.add_args)(sub)
    subparsers.add_parser("lm-eval", add_help=False, help=LM_EVAL_HELP)
    return parser


def package_version() -> str:
    """The installed distribution's version (metadata only: no torch import)."""
    try:
        return importlib.metadata.version("kvforge")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_full_parser() -> argparse.ArgumentParser:
    """Every verb with its arguments (imports every verb's module): for tests that walk them all."""
    return build_parser(VERB_NAMES)


def named_verb(argv: list[str]) -> str | None:
    """The verb argparse will dispatch on: the first word that is not an option (the top
    level has no option taking a value), when it is one of VERBS."""
    word = next((word for word in argv if not word.startswith("-")), None)
    return word if word in VERB_NAMES else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:
        try:
            from kvforge.integrations.lm_eval import main as lm_eval_main
        except ImportError as exc:
            print(f"kvforge lm-eval: error: {exc} (pip install 'kvforge[lm-eval]')", file=sys.stderr)
            return 2
        return lm_eval_main(argv[1:])
    verb = named_verb(argv)
    args = build_parser([verb] if verb else []).parse_args(argv)
    args.command_line = command_line(argv)  # recorded in the JSON of measuring commands
    args.typed_options = frozenset(word.split("=", 1)[0] for word in argv if word.startswith("--"))
    try:
        from kvforge.cli_checks import check_shared_values

        check_shared_values(args)  # before the command loads or writes anything
        if getattr(args, "threads", None) is not None:
            import torch  # the verb that has --threads has imported it already

            torch.set_num_threads(args.threads)
        return load_function(VERBS[VERB_NAMES.index(args.verb)].run)(args)
    except KVForgeError as exc:
        print(f"kvforge {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
