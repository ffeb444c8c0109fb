"""Arguments of `kvforge gpu-check` / `python -m kvforge.tools.gpu_check`, checked before anything
loads, and the run: correctness rows, then the speed section, the table and the JSON.

Exit status: 0 when every correctness row passes, 1 when any fails (speed never decides
it), 2 for bad arguments (before any model is built or loaded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.arg_types import at_least
from kvforge.devices import resolve_device
from kvforge.errors import KVForgeError, require
from kvforge.tools.gpu_check.rows import SIZES

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_SWIFTKV = "models/swiftkv-smollm2-135m-l15"  # committed; relative to the repository root
DEFAULT_KV_BUDGET = "1GiB"


@dataclass(frozen=True)
class CheckSettings:
    device: torch.device
    sizes: tuple[str, ...]
    kv_budget: int
    kv_budget_text: str
    model: str
    swiftkv: str
    speed: bool
    seed: int
    graphs: bool = True  # decode steps on CUDA replay CUDA graphs (engine/decode_graphs.py)


def add_gpu_check_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="device under test: cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help="comma-separated: tiny (random models built here), real (--model and --swiftkv) "
                             f"(default {','.join(SIZES)})")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every device step eagerly (default: decode steps on CUDA replay CUDA graphs, "
                             "as the engine does)")
    parser.add_argument("--skip-speed", action="store_true", help="correctness rows only, no bench runs")
    parser.add_argument("--kv-budget", default=DEFAULT_KV_BUDGET, help=f"KV budget of every cache ({DEFAULT_KV_BUDGET})")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"real-size model ({DEFAULT_MODEL})")
    parser.add_argument("--swiftkv", default=DEFAULT_SWIFTKV, metavar="DIR",
                        help=f"SwiftKV checkpoint laid over --model ({DEFAULT_SWIFTKV})")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the random prompt token ids (0)")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the result as JSON")


def settings_from(args: argparse.Namespace) -> CheckSettings:
    """Everything checkable without weights: device, sizes, budget, the model's config and
    the SwiftKV checkpoint's config (when real sizes or the speed section need them)."""
    from kvforge.sizes import parse_bytes

    device = resolve_device(args.device)
    sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
    require(len(sizes) > 0 and all(s in SIZES for s in sizes) and len(set(sizes)) == len(sizes), "sizes",
            args.sizes, f"must be a comma-separated list of distinct sizes from {list(SIZES)}")
    kv_budget = parse_bytes(args.kv_budget, "kv_budget")
    require(kv_budget > 0, "kv_budget", args.kv_budget, "must be > 0")
    speed = not args.skip_speed
    if "real" in sizes or speed:
        from kvforge.models.loader import load_model_config, resolve_model_source
        from kvforge.models.swiftkv_checkpoint import overlay_config

        overlay_config(load_model_config(resolve_model_source(args.model)), args.swiftkv)
    return CheckSettings(device, sizes, kv_budget, args.kv_budget, args.model, args.swiftkv, speed, args.seed,
                         graphs=not args.enforce_eager)


def run_gpu_check(args: argparse.Namespace) -> int:
    from kvforge.tools.gpu_check.correctness import log, run_correctness
    from kvforge.tools.gpu_check.report import document, format_table, write_json
    from kvforge.tools.report.provenance import provenance

    settings = settings_from(args)  # ConfigError / ModelLoadError here: exit 2, nothing loaded
    log(f"correctness on {settings.device}: sizes {', '.join(settings.sizes)}")
    rows, models = run_correctness(list(settings.sizes), settings.device, settings.kv_budget, settings.model,
                                   settings.swiftkv, settings.seed, graphs=settings.graphs)
    def with_speed(speed: dict | None) -> dict:
        return document(settings.device, list(settings.sizes), settings.kv_budget, rows, models, speed,
                        provenance(args))

    speed = None
    if settings.speed:
        from kvforge.tools.gpu_check.speed import run_speed

        if args.json:  # the verdict is kept even if the speed section is cut short
            write_json(with_speed({"pending": "the speed section had not finished"}), args.json)
            log(f"wrote the correctness rows to {args.json}; the speed section follows")
        speed = run_speed(settings.device, settings.model, settings.swiftkv, settings.kv_budget_text, log)
    doc = with_speed(speed)
    print(format_table(doc))
    if args.json:
        write_json(doc, args.json)
        log(f"wrote {args.json}")
    return 0 if doc["passed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    from kvforge.tools.report.provenance import command_line

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m kvforge.tools.gpu_check", description=__doc__.splitlines()[0])
    add_gpu_check_args(parser)
    args = parser.parse_args(argv)
    args.command_line = command_line(["gpu-check", *argv])
    try:
        return run_gpu_check(args)
    except KVForgeError as exc:
        print(f"kvforge gpu-check: error: {exc}", file=sys.stderr)
        return 2
