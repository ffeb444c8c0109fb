"""The command line as data, for generated tests: every leaf command of
`kvforge.cli.build_full_parser()` (verbs and sub-verbs), every option of each, and the kind
of value each option takes, read from the parser itself (its `type`, `choices`, `dest`).

A new option is classified here without a test edit when its `type` or `choices` say what it
takes; a new free-text option must be named in KIND_BY_DEST or FREE_TEXT (a test checks that
every option has a kind), so no option escapes the generators unnoticed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvforge.cli import build_full_parser

# Options taking a string whose kind their dest names. Keyed by (command, dest) where one
# dest means different things in different commands, else by dest.
KIND_BY_DEST: dict[str, str] = {
    "model": "model",
    "dtype": "dtype",
    "device": "device",
    "json": "out_file",
    "text_file": "in_file",
    "haystack_file": "in_file",
    "recipe": "in_file",
    "data": "in_file",
    "config": "in_file",
    "readme": "in_file",
    "methods": "in_file",
    "vllm_python": "in_file",
    "profile_servers": "in_file",
    "plot": "out_file",
    "swiftkv": "in_dir",
    "init_from": "in_dir",
}
KIND_BY_COMMAND_DEST: dict[tuple[str, str], str] = {
    ("report", "out"): "out_file",
    ("swiftkv init", "out"): "out_dir",
    ("swiftkv distill", "out"): "out_dir",
    ("swiftkv export", "out"): "out_dir",
    ("analyze", "out"): "out_dir",
}
# Free text whose bad values are the business of the parser of that text, tested where that
# parser lives (cache specs: tests/cache; sizes: kvforge.sizes; bench serve's lengths and
# rates, the soak's duration: tests/tools/bench); the generators draw no values for them.
FREE_TEXT: frozenset[str] = frozenset({
    "prompts", "system", "stop", "cache", "cache_opt", "kv_budget", "host", "api_key", "served_model_name",
    "compare", "base_url", "request_rate", "input_len", "output_len", "slo", "baseline", "lengths", "tasks",
    "sizes", "lr_schedule", "fsdp_mixed_precision", "resume", "directory", "verb", "swiftkv_verb",
    "bench_verb", "eval_verb", "duration", "structured_outputs",
})
FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
                argparse._VersionAction, argparse._CountAction, argparse._StoreConstAction)


@dataclass(frozen=True)
class Option:
    command: str  # "generate", "bench prefill", ...
    action: argparse.Action

    @property
    def flag(self) -> str:
        return self.action.option_strings[-1]

    @property
    def names(self) -> tuple[str, ...]:
        """What an error message may call the option: its flags, its dest, the dest spelled with dashes."""
        dest = self.action.dest
        return (*self.action.option_strings, dest, dest.replace("_", "-"))


def leaf_parsers(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ()
                 ) -> dict[str, argparse.ArgumentParser]:
    """"command words" -> the parser of that leaf command (one without sub-commands)."""
    parser = parser or build_full_parser()
    leaves: dict[str, argparse.ArgumentParser] = {}
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        return {" ".join(path): parser}
    for name, sub in subparsers[0].choices.items():
        if name == "lm-eval":  # its arguments are lm_eval's own
            continue
        leaves.update(leaf_parsers(sub, (*path, name)))
    return leaves


def option_kind(option: Option) -> str | None:
    """The kind of value `option` takes, None for a flag or a free-text option."""
    action = option.action
    if isinstance(action, FLAG_ACTIONS) or not action.option_strings:
        return None
    if action.choices is not None:
        return "choice"
    type_name = getattr(action.type, "__name__", "")
    if action.type is int or type_name.startswith("integer"):
        return "int"
    if action.type is float or type_name.startswith("number"):
        return "float"
    if type_name == "_int_list":
        return "int_list"
    if action.dest in FREE_TEXT:
        return None
    return KIND_BY_COMMAND_DEST.get((option.command, action.dest)) or KIND_BY_DEST.get(action.dest, "unknown")


def all_options() -> list[Option]:
    return [Option(command, action) for command, parser in leaf_parsers().items() for action in parser._actions]
