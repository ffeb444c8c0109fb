"""Arguments of `kvforge bench soak` and their checks, done before any server starts.

Kept free of heavy imports (cli.py builds every bench parser on each start); the model is
looked up only in `check_options`.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any

from kvforge.devices import add_device_arg
from kvforge.errors import ConfigError, require

MIN_DURATION_S = 5.0  # a fifth of the run (the memory verdict's unit) is a second at least
MAX_DURATION_S = 24 * 3600.0  # a soak is bounded: a day at most
MAX_REQUEST_RATE = 1000.0
LONG_PROMPT_TOKENS = 1500  # the longest prompt the mix sends, where the context allows
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*$")
_UNIT_SECONDS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `20m` (or `20min`), `1.5h` -> seconds in [MIN_DURATION_S, MAX_DURATION_S]."""
    match = _DURATION.match(str(text))
    if not match:
        raise ConfigError("duration", text, "must be seconds, or a number with s, m or h (e.g. 20m)")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    require(MIN_DURATION_S <= seconds <= MAX_DURATION_S, "duration", text,
            f"must be between {MIN_DURATION_S:g} s and {MAX_DURATION_S / 3600:g} h")
    return seconds


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ConfigError("request_rate", text, "must be a number of requests per second") from None
    require(math.isfinite(rate) and 0 < rate <= MAX_REQUEST_RATE, "request_rate", text,
            f"must be > 0 and <= {MAX_REQUEST_RATE:g} requests per second (a soak has no 'inf')")
    return rate


def add_soak_args(kinds: Any) -> None:
    """The `soak` sub-verb on `kvforge bench`'s sub-parsers."""
    soak = kinds.add_parser("soak", help="a bounded run of mixed traffic that checks the server leaks nothing")
    soak.add_argument("--model", default="smollm2-135m", help="model the started server loads (smollm2-135m)")
    soak.add_argument("--cache", default="full", help="cache spec as kvforge serve --cache takes it (full)")
    soak.add_argument("--swiftkv", default=None, metavar="DIR", help="SwiftKV checkpoint laid over --model")
    soak.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    soak.add_argument("--threads", type=int, default=2, help="torch CPU threads of the server (2)")
    add_device_arg(soak)  # of the started server
    soak.add_argument("--kv-budget", default="1GiB", help="KV-cache budget of the server (1GiB)")
    soak.add_argument("--duration", default="20m", help="seconds of traffic, or with s/m/h: 90s, 20m (20m)")
    soak.add_argument("--request-rate", default="0.5", help="requests per second, Poisson arrivals (0.5)")
    soak.add_argument("--max-in-flight", type=int, default=16,
                      help="most requests the client has open at once; arrivals beyond it wait (16)")
    soak.add_argument("--max-output-tokens", type=int, default=32, help="most tokens a good request asks for (32)")
    soak.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request fails (300)")
    soak.add_argument("--text-file", default=None, help="text whose held-out part gives the prompts")
    soak.add_argument("--seed", type=int, default=0, help="seed of the traffic mix and the arrivals (0)")
    soak.add_argument("--json", metavar="OUT", default=None, help="write the result as JSON to OUT")
    soak.add_argument("--plot", metavar="PNG", default=None,
                      help="write the plot of memory, KV bytes and requests in flight here (default: OUT.png "
                           "beside --json)")


@dataclass(frozen=True)
class SoakOptions:
    """The checked options; `max_prompt_tokens` from the model's context."""

    duration_s: float
    request_rate: float
    max_prompt_tokens: int
    vocab_size: int


def check_options(args: argparse.Namespace, model_config: Any) -> SoakOptions:
    """Every option checked (ConfigError naming the parameter, value and rule)."""
    from kvforge.cache.registry import parse_cache_spec
    from kvforge.models.loader import parse_dtype

    duration = parse_duration(args.duration)
    rate = parse_rate(args.request_rate)
    for name in ("threads", "max_in_flight", "max_output_tokens"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be an integer >= 1")
    require(args.seed >= 0, "seed", args.seed, "must be an integer >= 0")
    require(math.isfinite(args.request_timeout) and args.request_timeout > 0, "request_timeout",
            args.request_timeout, "must be > 0 seconds")
    parse_dtype(args.dtype)
    parse_cache_spec(args.cache, [])
    from kvforge.sizes import parse_bytes

    parse_bytes(args.kv_budget)
    # Room in the context for the longest prompt, the disconnecting requests' longer
    # outputs (4x) and the chat template's own tokens.
    room = model_config.max_position_embeddings - 4 * args.max_output_tokens - 64
    require(room >= 16, "max_output_tokens", args.max_output_tokens,
            f"must leave room for prompts of 16 tokens in the context of {args.model} "
            f"({model_config.max_position_embeddings} tokens)")
    return SoakOptions(duration, rate, min(LONG_PROMPT_TOKENS, room), model_config.vocab_size)
