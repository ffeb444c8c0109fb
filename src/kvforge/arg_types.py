"""argparse `type=` validators shared by the verbs: a bad value is refused while the command
line is parsed (exit 2, `argument --flag: RULE, got VALUE`), before anything loads.

Import-light (no torch), as `kvforge.cli` builds parsers without importing a verb's work.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

# torch starts one OpenMP worker per thread on the first parallel op; far more workers than
# cores only slow it down, and a mistyped huge count would start them all.
THREADS_PER_CPU_MAX = 4


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer option whose values are >= `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def max_threads() -> int:
    return THREADS_PER_CPU_MAX * (os.cpu_count() or 1)


def thread_count(text: str) -> int:
    """`--threads`: torch CPU threads, 1 .. THREADS_PER_CPU_MAX x this machine's CPUs."""
    value = at_least(1)(text)
    if value > max_threads():
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 and <= {max_threads()} "
                                         f"({THREADS_PER_CPU_MAX} x this machine's {os.cpu_count()} CPUs), "
                                         f"got {value}")
    return value


thread_count.__name__ = "integer >= 1"


def non_negative_number(text: str) -> float:
    """A finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


non_negative_number.__name__ = "number >= 0"


def positive_ints(parameter: str, text: str | int) -> list[int]:
    """A comma-separated list of integers >= 1 (`--lengths 4096,8192`), refused as a
    ConfigError naming `parameter` where a piece is not one (`4k`, `1.5`, `0`)."""
    from kvforge.errors import ConfigError

    try:
        values = [int(piece) for piece in str(text).split(",") if piece.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(parameter, text, "must be positive integers separated by commas (e.g. 4096,8192)")
    return values


# `--load-format` (vLLM's name): "auto" loads the checkpoint's weights; "dummy" builds the model of
# --model's config (a named shape, a config.json, a directory holding one) with random weights.
LOAD_FORMATS = ("auto", "dummy")


def add_load_format_arg(parser: argparse.ArgumentParser) -> None:
    """`--load-format` of every command that builds a model from --model."""
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="auto: the weights of --model; dummy: random weights (seed 0) at the shapes of "
                             "--model's config, for speed only: --model then names a shape (llama-3.1-8b, "
                             "llama-2-7b, llama-3-8b-1048k, qwen2.5-7b, llama-tiny), a config.json file or a "
                             "directory holding one, and there is no tokenizer (token ids in and out) (auto)")
