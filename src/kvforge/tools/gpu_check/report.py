"""The printed table and the JSON document of a check."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvforge.tools.gpu_check.rows import TOLERANCES, WORKLOADS

REFERENCE = "CPU, float32 weights, PyTorch paths (C++ kernels off), same cache spec, prompts and chunking"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


def document(device: torch.device, sizes: list[str], kv_budget: int, rows: list[dict[str, Any]],
             models: dict[str, str], speed: dict[str, Any] | None, provenance: dict[str, Any]) -> dict[str, Any]:
    return {
        "check": "gpu-check",
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # "highest" keeps float32 matmuls in float32 on CUDA (no TF32), as the tolerances assume
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "reference": REFERENCE,
        "sizes": sizes,
        "kv_budget": kv_budget,
        "workloads": {size: asdict(WORKLOADS[size]) for size in sizes},
        "tolerances": TOLERANCES,
        "models": models,
        "rows": rows,
        "rows_passed": sum(bool(r["passed"]) for r in rows),
        "passed": all(r["passed"] for r in rows),
        "speed": speed if speed is not None else {"skipped": "--skip-speed"},
        "provenance": provenance,
    }


def _num(value: Any, fmt: str = "{:.1e}") -> str:
    return "-" if value is None else fmt.format(value)


def _lossy_ratios(row: dict[str, Any]) -> tuple[str, str]:
    """A lossy row's distance over the rounding floor and device error over the reference's
    (compare.py); '-' for other rows."""
    error, floor = row.get("method_error"), row.get("floor")
    if not error or not floor:
        return "-", "-"
    return f"{floor['ratio']:.2f}", (f"{error['ratio']:.3f}" if error.get("judged") else "exact")


def format_table(doc: dict[str, Any]) -> str:
    lines = [f"gpu-check on {doc['device']} ({doc['device_name']}), against the reference: {doc['reference']}"]
    name_w = max([len("row"), *(len(r["name"]) for r in doc["rows"])]) + 2
    cache_w = max([len("cache"), *(len(r["cache"]) for r in doc["rows"])]) + 2
    lines.append(f"{'row':<{name_w}}{'cache':<{cache_w}}{'tol':>7}{'max|d|':>9}{'prefill':>9}{'decode':>9}"
                 f"{'argmax':>8}{'greedy':>8}{'floor':>8}{'err/ref':>9}  result")
    for row in doc["rows"]:
        floor, error = _lossy_ratios(row)
        greedy = "-" if "greedy_match" not in row else ("match" if row["greedy_match"] else
                                                        ("tie" if row["greedy_divergence"]["excused"] else "DIFF"))
        lines.append(f"{row['name']:<{name_w}}{row['cache']:<{cache_w}}{row['tolerance']:>7.0e}"
                     f"{_num(row.get('max_abs_diff')):>9}{_num(row.get('prefill_max_abs_diff')):>9}"
                     f"{_num(row.get('decode_max_abs_diff')):>9}{_num(row.get('argmax_agreement'), '{:.3f}'):>8}"
                     f"{greedy:>8}{floor:>8}{error:>9}  " + ("pass" if row["passed"] else "FAIL: " + "; ".join(row["failures"])))
    lines.append(f"correctness: {doc['rows_passed']}/{len(doc['rows'])} rows passed")
    for verb, result in doc["speed"].items() if isinstance(doc["speed"], dict) else ():
        if verb == "skipped" or not isinstance(result, dict):
            lines.append(f"speed: skipped ({result})")
        elif "systems" in result:
            values = ", ".join(f"{name} {value:.1f}" for name, value in result["systems"].items())
            lines.append(f"speed {verb} ({result['headline_metric']}): {values}"
                         + ("" if result.get("trustworthy", True) else " (bench flags the run: see its flags)"))
        else:
            lines.append(f"speed {verb}: " + (result.get("skipped") or result.get("error", "").splitlines()[-1]))
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # default=str: a value from a bench result JSON cannot encode must not lose the whole run
    Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
