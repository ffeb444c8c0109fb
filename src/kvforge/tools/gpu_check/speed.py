"""The speed section: `kvforge bench prefill / decode / throughput` at small sizes, each
with the SwiftKV model, its base model and transformers (`--compare base,hf`), on the
device under test.

The bench commands are called through their own argument parser and `run(args)`, so their
timing rules (warm-up, median of repeats, synchronisation) and JSON are exactly theirs.
The device goes to them as `--device` when their parser has it; a bench without it runs on
the CPU only, so on any other device the section is skipped and says why.
"""

from __future__ import annotations

import argparse
import importlib
import traceback
from collections.abc import Callable
from typing import Any

import torch

from kvforge.tools.bench.cli import add_bench_args
from kvforge.tools.report.provenance import command_line

# verb -> its size arguments: small enough to take seconds on a GPU (and minutes on a CPU)
SPEED_RUNS: dict[str, list[str]] = {
    "prefill": ["--prompt-len", "512", "--batch", "1"],
    "decode": ["--batch", "4", "--context", "512", "--gen", "32"],
    "throughput": ["--num-requests", "8", "--input-len", "256", "--output-len", "32"],
}
REPEATS = ["--repeats", "3", "--warmup", "1"]


def bench_parser() -> argparse.ArgumentParser:
    """A top-level parser with `kvforge bench` alone, its arguments as the command line's
    (`kvforge.cli` builds `bench` with the same function), so parsed args carry `verb`."""
    parser = argparse.ArgumentParser(prog="kvforge")
    add_bench_args(parser.add_subparsers(dest="verb", required=True).add_parser("bench"))
    return parser


def _bench_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    """The `kvforge bench <verb>` subparser of the top-level parser."""
    for name in ("bench", verb):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def bench_takes_device(parser: argparse.ArgumentParser, verb: str) -> bool:
    return any("--device" in action.option_strings for action in _bench_parser(parser, verb)._actions)


def bench_argv(verb: str, device: torch.device, model: str, swiftkv: str, kv_budget: str,
               with_device: bool) -> list[str]:
    return (["bench", verb, "--model", model, "--swiftkv", swiftkv, "--compare", "base,hf",
             "--kv-budget", kv_budget, *REPEATS, *SPEED_RUNS[verb]]
            + (["--device", str(device)] if with_device else []))


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline of each system and the ratios of the system under test (SwiftKV)."""
    headline = result["headline_metric"]
    return {"headline_metric": headline,
            "systems": {s["name"]: s.get(headline) for s in result["systems"]},
            "ratios": result.get("ratios", {}), "trustworthy": result.get("trustworthy"),
            "flags": [f.get("message") for f in result.get("flags", [])]}


def run_speed(device: torch.device, model: str, swiftkv: str, kv_budget: str,
              progress: Callable[[str], None]) -> dict[str, Any]:
    parser = bench_parser()
    out: dict[str, Any] = {}
    for verb in SPEED_RUNS:
        with_device = bench_takes_device(parser, verb)
        if device.type != "cpu" and not with_device:
            out[verb] = {"skipped": f"`kvforge bench {verb}` has no --device here: it would measure the CPU"}
            progress(f"speed {verb}: skipped ({out[verb]['skipped']})")
            continue
        argv = bench_argv(verb, device, model, swiftkv, kv_budget, with_device)
        progress(f"speed {verb}: kvforge {' '.join(argv)}")
        try:
            try:
                args = parser.parse_args(argv)
            except SystemExit:  # argparse's way of refusing; the message went to stderr
                raise RuntimeError(f"`kvforge {' '.join(argv)}` refused its arguments") from None
            args.command_line = command_line(argv)
            result = importlib.import_module(f"kvforge.tools.bench.{verb}").run(args)
            out[verb] = {"command": args.command_line, **summary(result), "result": result}
        except Exception as exc:  # noqa: BLE001 -- reported; the correctness verdict stands alone
            out[verb] = {"error": "".join(traceback.format_exception(exc)).strip()}
            progress(f"speed {verb}: failed: {type(exc).__name__}: {exc}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
