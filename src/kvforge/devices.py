"""The compute device a command or an `LLM` runs on, checked before any weights load.

`resolve_device("cuda")` on a torch without CUDA, or `cuda:3` on a two-GPU machine, fails
with a `ConfigError` that names the parameter, the value and the rule, instead of torch's
`AssertionError: Torch not compiled with CUDA enabled` deep inside model construction.
"""

from __future__ import annotations

import argparse

import torch

from kvforge.errors import ConfigError

SUPPORTED_KINDS = ("cpu", "cuda", "meta")


def resolve_device(value: str | torch.device, parameter: str = "device") -> torch.device:
    """The `torch.device` for `value` (`cpu`, `cuda`, `cuda:N`; `meta` for shape-only
    checks), or a ConfigError when this torch or machine cannot provide it."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ConfigError(parameter, value, "must be cpu, cuda or cuda:N") from None
    if device.type not in SUPPORTED_KINDS:
        raise ConfigError(parameter, value, "must be cpu, cuda or cuda:N")
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        built = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(parameter, value, f"needs a CUDA GPU, and {built}; use --device cpu")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise ConfigError(parameter, value, f"must name one of the {count} visible CUDA devices (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """`--dtype` of a command that runs a model: its weights and compute, checked by
    `models.loader.parse_dtype` when the model loads, before any weight file is read."""
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16: weights and compute "
                                                           "(float32)")


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """`--device` of every command that runs a model. `kvforge.cli.main` checks it with
    `resolve_device` right after parsing, before the command does anything."""
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help="where the model runs: cpu, cuda or cuda:N (cpu)")
