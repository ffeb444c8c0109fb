"""Shared output of the evaluations: markdown tables, deltas against the baseline, JSON."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvforge.tools.eval.context import log


def relative_delta_pct(value: float, baseline: float) -> float:
    """(value - baseline) / baseline in percent (inf when the baseline is 0 and value is not)."""
    if baseline == 0:
        return 0.0 if value == 0 else math.inf
    return 100.0 * (value - baseline) / baseline


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table; cells are str()-ed, columns padded for reading in a terminal."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), separator, *(line(row) for row in cells[1:])])


def environment() -> dict[str, Any]:
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average": load}


def evaluate_systems(systems: Sequence[Any], evaluate: Callable[[Any], dict[str, Any]], json_path: str | None,
                     header: dict[str, Any]) -> list[dict[str, Any]]:
    """`evaluate` each system in turn. If one fails or is interrupted (Ctrl-C), the results of
    the systems already done are written to `json_path` first (marked incomplete, naming the
    failed system), so minutes of work are not lost; then the error propagates."""
    results: list[dict[str, Any]] = []
    for system in systems:
        try:
            results.append(evaluate(system))
        except BaseException as exc:  # KeyboardInterrupt too: keep what finished
            if json_path and results:
                write_json(json_path, {**header, "systems": results, "incomplete": True, "failed_system": system.name,
                                       "error": f"{type(exc).__name__}: {exc}", "environment": environment()})
            raise
    return results


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {path}")
    return path
