"""The correctness section: every row of rows.py on the device against the CPU reference.

A row that raises is recorded (exception text) and marked failed; the next row runs. Each
model pair is loaded once per (size, model kind) and freed before the next, and the
device's cached memory is returned between rows, so one bad row cannot starve the others.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from kvforge.tools.gpu_check.compare import FLOOR_DRAWS, compare, method_error, rounding_floor
from kvforge.tools.gpu_check.drive import Trace, pytorch_paths, run_workload
from kvforge.tools.gpu_check.models import ModelPair, real_pair, tiny_pair
from kvforge.tools.gpu_check.rows import MODEL_KINDS, WORKLOADS, RowSpec, full_spec, row_specs

Log = Callable[[str], None]


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def prompts_for(size: str, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, the same for every row of a size (both model kinds share a vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in WORKLOADS[size].prompt_lengths]


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def check_row(spec: RowSpec, pair: ModelPair, prompts: list[list[int]], kv_budget: int,
              graphs: bool = True) -> dict[str, Any]:
    """One row: the reference's greedy run, the device fed the reference's tokens, the
    device on its own greedy path (decode from CUDA graphs when `graphs` and the device is
    CUDA); returns the row's record (never raises)."""
    work = WORKLOADS[spec.size]
    start = time.perf_counter()
    record: dict[str, Any] = {"name": spec.name, **asdict(spec), "tolerance": spec.tolerance}
    try:
        with pytorch_paths():
            reference = run_workload(pair.reference, spec.cache, kv_budget, prompts, work)
        forced = run_workload(pair.device, spec.cache, kv_budget, prompts, work, forced=reference.tokens,
                              graphs=graphs)
        greedy = run_workload(pair.device, spec.cache, kv_budget, prompts, work, graphs=graphs)
        error = floor = None
        if spec.precision == "lossy":  # the second judgement (compare.py)
            full = full_spec(spec.size)
            with pytorch_paths():
                reference_full = run_workload(pair.reference, full, kv_budget, prompts, work, forced=reference.tokens)
            device_full = run_workload(pair.device, full, kv_budget, prompts, work, forced=reference.tokens,
                                       graphs=graphs)
            error = method_error(reference, reference_full, forced, device_full)
            floor = rounding_floor(reference, _perturbed_run(pair, spec, kv_budget, prompts, reference, 1), forced)
            # More draws only while they can change the verdict: the device past the floor,
            # and nothing else deciding the row (tolerance met, or the error out of its band).
            undecided = (error.judged and error.within_band
                         and not compare(reference, forced, greedy, spec.tolerance).within_tolerance)
            for seed in range(2, FLOOR_DRAWS + 1):
                if floor.within or not undecided:
                    break
                floor = floor.with_draw(reference, _perturbed_run(pair, spec, kv_budget, prompts, reference, seed))
        result = compare(reference, forced, greedy, spec.tolerance, error, floor)
        record.update(asdict(result), passed=result.passed, failures=result.failures(), error=None)
        if error is not None and floor is not None:
            record["method_error"].update(ratio=error.ratio, judged=error.judged)
            record["floor"].update(ratio=floor.ratio)
    except Exception as exc:  # noqa: BLE001 -- a failed row is a result, and the check goes on
        record.update(passed=False, failures=[f"raised {type(exc).__name__}: {exc}"],
                      error="".join(traceback.format_exception(exc)).strip())
    record["seconds"] = time.perf_counter() - start
    return record


def _perturbed_run(pair: ModelPair, spec: RowSpec, kv_budget: int, prompts: list[list[int]], reference: Trace,
                   seed: int) -> Trace:
    """The reference model with noise draw `seed` on its weights, fed the reference's tokens."""
    with pytorch_paths():
        return run_workload(pair.perturbed_reference(seed), spec.cache, kv_budget, prompts, WORKLOADS[spec.size],
                            forced=reference.tokens)


def load_pair(size: str, kind: str, device: torch.device, model: str, swiftkv: str) -> ModelPair:
    return tiny_pair(kind, device) if size == "tiny" else real_pair(kind, device, model, swiftkv)


def run_correctness(sizes: list[str], device: torch.device, kv_budget: int, model: str, swiftkv: str,
                    seed: int = 0, progress: Log = log, graphs: bool = True
                    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every row at `sizes`; returns the row records and a description of each model pair."""
    records: list[dict[str, Any]] = []
    described: dict[str, str] = {}
    for size in sizes:
        for kind in MODEL_KINDS:
            start = time.perf_counter()
            try:
                pair = load_pair(size, kind, device, model, swiftkv)
            except Exception as exc:  # noqa: BLE001 -- every row of this pair fails, the others run
                described[f"{size}/{kind}"] = f"failed to load: {type(exc).__name__}: {exc}"
                progress(f"{size}/{kind}: model failed to load: {exc}")
                records.extend(_unloaded_rows(size, kind, exc))
                continue
            described[f"{size}/{kind}"] = pair.description
            progress(f"{size}/{kind}: {pair.description} loaded ({time.perf_counter() - start:.1f} s)")
            layout = pair.reference.cache_layout()
            prompts = prompts_for(size, pair.reference.config.vocab_size, seed)
            specs = [s for s in row_specs(size, layout.num_kv_heads * layout.head_dim) if s.model_kind == kind]
            for spec in specs:
                record = check_row(spec, pair, prompts, kv_budget, graphs)
                records.append(record)
                verdict = "pass" if record["passed"] else "FAIL: " + "; ".join(record["failures"])
                diff = record.get("max_abs_diff")
                progress(f"{spec.name}: {verdict}" + ("" if diff is None else f" (max |diff| {diff:.2e})")
                         + f" [{record['seconds']:.1f} s]")
                free_device_memory(device)
            del pair
            free_device_memory(device)
    return records, described


def _unloaded_rows(size: str, kind: str, exc: Exception) -> list[dict[str, Any]]:
    # The rows' specs need the model's KV width only for ShadowKV's rank; 1 stands in here.
    return [{"name": spec.name, **asdict(spec), "tolerance": spec.tolerance, "passed": False,
             "failures": [f"model did not load: {type(exc).__name__}: {exc}"], "error": str(exc), "seconds": 0.0}
            for spec in row_specs(size, 1) if spec.model_kind == kind]
