"""Checks `kvforge.cli.main` runs on every parsed command line, after argparse and before the
command does anything: the values each verb shares under the same name (`--threads`,
`--device`, `--dtype`, `--kv-budget` on the CPU, `--model`, `--swiftkv`, input text files,
`--json`), judged by the value alone or by a config file, never by loading weights. A
refusal is a ConfigError naming the option, the value and the rule; a verb that adds an
option under one of these names gets the check without code of its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from kvforge.arg_types import max_threads
from kvforge.errors import ConfigError, KVForgeError, require

# Options naming a file the command reads (it must exist and be a regular file), and what it holds.
INPUT_FILES = {"text_file": "text file", "haystack_file": "text file", "recipe": "YAML file",
               "config": "config.json", "readme": "README file", "methods": "Markdown file",
               "vllm_python": "python interpreter"}


# Verbs whose prompts and replies are text: a dummy model (no tokenizer) cannot run them
# (`serve` can: it takes token-id prompts and answers token ids, `return_token_ids`).
TEXT_VERBS = ("generate", "chat")


def check_threads(threads: int | None) -> None:
    """`--threads` of any verb (those parsed with `type=int`, or set by a recipe, too)."""
    if threads is not None:
        require(isinstance(threads, int) and 1 <= threads <= max_threads(), "threads", threads,
                f"must be an integer >= 1 and <= {max_threads()} (4 x this machine's CPUs)")


def check_input_file(parameter: str, value: str, holding: str = "file") -> None:
    path = Path(value).expanduser()
    require(value != "" and path.is_file(), parameter, value,
            f"must be an existing {holding}" + (" (it is a directory)" if value and path.is_dir() else ""))


def executable(parameter: str, value: str, what: str) -> str:
    """The path of the program `value` names: a name on PATH or an executable file."""
    found = shutil.which(value) if value else None
    path = Path(value).expanduser()
    if found is None and value and path.is_file() and os.access(path, os.X_OK):
        found = str(path)
    require(found is not None, parameter, value, f"must name {what}: a path or a name on PATH")
    return str(found)


def check_output_file(parameter: str, value: str) -> None:
    """A file the command writes at its end: refused now, not after the work, when it cannot be
    written (an existing directory, or a path under a regular file or an unwritable directory)."""
    path = Path(value).expanduser()
    require(value != "" and not path.is_dir(), parameter, value, "must be a file path, not a directory")
    _check_creatable(parameter, value, path.parent)


def _check_creatable(parameter: str, value: str, directory: Path) -> None:
    """`directory` exists or can be made: its nearest existing ancestor is a writable directory."""
    ancestor = directory
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    require(ancestor.is_dir(), parameter, value, f"cannot be written: {ancestor} is not a directory")
    require(os.access(ancestor, os.W_OK | os.X_OK), parameter, value,
            f"cannot be written: {ancestor} is not writable")


def check_output_directory(parameter: str, value: str) -> None:
    """A directory the command creates or fills: not a regular file, and not under one."""
    path = Path(value).expanduser()
    require(value != "" and not path.is_file(), parameter, value, "must be a directory path, not a file")
    _check_creatable(parameter, value, path)


def check_model(parameter: str, value: str, load_format: str = "auto") -> None:
    """A model path (`--model`) resolves and its config reads; its weights are not read. A name
    (a named model, a Hub id, or a test's stand-in for a patched loader) is the command's to
    resolve: its loader refuses an unknown one, naming the named models. Under
    `--load-format dummy` every value is resolved (a shape name, or a config; nothing is
    downloaded)."""
    from kvforge.models.loader import load_model_config, looks_like_path, resolve_model_source

    if load_format != "dummy" and not (looks_like_path(value) or Path(value).expanduser().exists()):
        return
    try:
        load_model_config(resolve_model_source(value, load_format))
    except ConfigError:
        raise
    except KVForgeError as exc:
        raise ConfigError(parameter, value, str(exc)) from None


def check_swiftkv(value: str) -> None:
    path = Path(value).expanduser()
    require(path.is_dir() and (path / "config.json").is_file(), "swiftkv", value,
            "must be a SwiftKV checkpoint directory (holding config.json; see `kvforge swiftkv init`)")


def take_positional_model(args: argparse.Namespace) -> None:
    """`kvforge serve MODEL`: the positional MODEL (vLLM's form) and --model name one model;
    the parser leaves --model None so that the default applies only when neither is given."""
    from kvforge.commands import DEFAULT_MODEL  # imported already: the verb's parser lives there

    given = [value for value in (args.model_tag, args.model) if value is not None]
    if len(set(given)) > 1:
        raise ConfigError("model", f"{args.model_tag} / --model {args.model}",
                          "give the model once: as the positional MODEL or as --model, not both differently")
    args.model = given[0] if given else DEFAULT_MODEL


def check_typed_host_budget(args: argparse.Namespace) -> None:
    """A --kv-budget typed for a cache in host memory must fit this machine's RAM and swap. A
    verb's default is left alone (untouched pages cost no RAM, and bench's 4GiB must keep
    working on a smaller machine), as is `bench serve --base-url` (no local server starts)."""
    budget = getattr(args, "kv_budget", None)
    typed = "--kv-budget" in getattr(args, "typed_options", {"--kv-budget"})
    if (not isinstance(budget, str) or not typed or getattr(args, "device_kind", "cpu") != "cpu"
            or getattr(args, "base_url", None)):
        return
    from kvforge.sizes import check_host_budget

    for piece in budget.split(","):  # bench throughput takes a list
        check_host_budget(piece.strip())


def check_shared_values(args: argparse.Namespace) -> None:
    """Every check above whose option the parsed command has (and was given or defaulted)."""
    if hasattr(args, "model_tag"):
        take_positional_model(args)
    check_threads(getattr(args, "threads", None))
    if getattr(args, "device", None) is not None:
        from kvforge.devices import resolve_device

        args.device_kind = resolve_device(args.device).type
    check_typed_host_budget(args)
    if isinstance(getattr(args, "dtype", None), str):
        from kvforge.compute_dtype import resolve_dtype
        from kvforge.models.loader import parse_dtype

        parse_dtype(resolve_dtype(args.dtype, getattr(args, "device", None) or "cpu")[0])  # auto: what it picks
    for name, holding in INPUT_FILES.items():
        if isinstance(getattr(args, name, None), str):
            check_input_file(name, getattr(args, name), holding)
    if isinstance(getattr(args, "profile_servers", None), str):  # bench serve's py-spy
        args.profile_servers = executable("profile_servers", args.profile_servers,
                                          "the py-spy executable (`pip install py-spy` in any environment)")
    if isinstance(getattr(args, "json", None), str):
        check_output_file("json", args.json)
    if isinstance(getattr(args, "plot", None), str):  # bench soak's plot
        check_output_file("plot", args.plot)
    if isinstance(getattr(args, "out", None), str):  # report's --out is a file; every other verb's a directory
        (check_output_file if args.verb == "report" else check_output_directory)("out", args.out)
    swiftkv = getattr(args, "swiftkv", None)
    for value in swiftkv if isinstance(swiftkv, list) else [swiftkv] if swiftkv else []:
        check_swiftkv(value)
    load_format = getattr(args, "load_format", None) or "auto"
    require(load_format != "dummy" or getattr(args, "verb", None) not in TEXT_VERBS, "load_format", load_format,
            f"kvforge {getattr(args, 'verb', None)} reads and writes text, and a dummy model has no tokenizer: measure it "
            "with `kvforge bench prefill|decode|throughput|serve --load-format dummy`, serve it (token ids "
            "in and out), or give token ids to LLM(..., load_format='dummy') in Python")
    if isinstance(getattr(args, "model", None), str):
        check_model("model", args.model, load_format)
