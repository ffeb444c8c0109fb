"""`kvforge eval ruler`: RULER-style synthetic tasks (eval/ruler_tasks.py) at several
lengths, every system on the same samples, scored per task and averaged.

Generation is greedy through the same paths as `eval niah` (kvforge runner with the
system's cache; transformers `generate` for `hf*` systems), with each task's own answer
budget. Scores are RULER's string match (% of references found in the output).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tqdm.auto import tqdm

from kvforge.arg_types import positive_ints
from kvforge.models.loader import parse_dtype
from kvforge.models.tokenizer import has_chat_template
from kvforge.preflight import check_within_context
from kvforge.sizes import parse_bytes
from kvforge.tools.eval.compare import EvalSystem, baseline_index, check_backends, parse_systems
from kvforge.tools.eval.context import EvalContext, describe_system, log
from kvforge.tools.eval.niah import generate_hf, generate_kvforge
from kvforge.tools.eval.report import environment, evaluate_systems, markdown_table, write_json
from kvforge.tools.eval.ruler_tasks import (
    TASKS,
    RulerSample,
    build_sample,
    check_lengths,
    make_sources,
    parse_tasks,
    score,
)
from kvforge.tools.report.provenance import provenance
from kvforge.tools.text_data import read_text


def build_samples(ctx: EvalContext, tasks: list[str], lengths: list[int], count: int, seed: int,
                  haystack_file: str | None, chat: bool) -> list[RulerSample]:
    sources = make_sources(read_text(haystack_file) if haystack_file else None)
    samples = []
    with tqdm(total=len(tasks) * len(lengths) * count, desc="building samples", unit="sample", leave=False) as bar:
        for length in lengths:
            for task in tasks:
                for index in range(count):
                    samples.append(build_sample(task, length, index, seed, ctx.tokenizer, sources, chat))
                    bar.update(1)
    return samples


def evaluate_system(ctx: EvalContext, system: EvalSystem, samples: list[RulerSample],
                    args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    outputs: dict[int, list[int]] = {}
    with tqdm(total=len(samples), desc=system.name, unit="prompt", leave=False) as bar:
        for task in dict.fromkeys(s.task for s in samples):  # each task has its own answer budget
            indices = [i for i, s in enumerate(samples) if s.task == task]
            group = [samples[i] for i in indices]
            budget = TASKS[task].max_new_tokens
            if system.kind == "kvforge":
                generated = generate_kvforge(ctx, system, group, budget, args.batch, args.prefill_chunk, bar)
            else:
                generated = generate_hf(ctx, system, group, budget, bar)
            outputs.update(zip(indices, generated))
    records = []
    for index, sample in enumerate(samples):
        text = ctx.tokenizer.decode(outputs[index], skip_special_tokens=True)
        records.append({"task": sample.task, "length": sample.length, "index": sample.index,
                        "prompt_tokens": len(sample.token_ids), "references": list(sample.references),
                        "output": text, "output_ids": outputs[index],
                        "score": score(text, sample.references, sample.metric)})
    table = score_table(records)
    log(f"{system.name}: average {table['average']:.1f} ({time.perf_counter() - start:.1f} s)")
    return {**describe_system(system), **table, "seconds": time.perf_counter() - start, "samples": records}


def score_table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean score (%) per (task, length), per length over tasks, and overall."""
    by_task: dict[str, dict[str, float]] = {}
    for task in dict.fromkeys(r["task"] for r in records):
        by_task[task] = {}
        for length in dict.fromkeys(r["length"] for r in records):
            cell = [r["score"] for r in records if r["task"] == task and r["length"] == length]
            if cell:
                by_task[task][str(length)] = 100 * sum(cell) / len(cell)
    lengths = list(dict.fromkeys(str(r["length"]) for r in records))
    by_length = {n: sum(by_task[t][n] for t in by_task) / len(by_task) for n in lengths}
    return {"scores": by_task, "average_by_length": by_length,
            "average": sum(by_length.values()) / len(by_length)}


def format_ruler_table(results: list[dict[str, Any]], baseline: int) -> str:
    base = results[baseline]
    headers = ["task", "length"] + [r["name"] for r in results]

    def cell(value: float, base_value: float, index: int) -> str:
        return f"{value:.1f}" if index == baseline else f"{value:.1f} ({value - base_value:+.1f})"

    rows = []
    for task, per_length in base["scores"].items():
        for length in per_length:
            rows.append([task, length] + [cell(r["scores"][task][length], per_length[length], i)
                                          for i, r in enumerate(results)])
    for length, value in base["average_by_length"].items():
        rows.append(["average", length] + [cell(r["average_by_length"][length], value, i)
                                           for i, r in enumerate(results)])
    return markdown_table(headers, rows) + f"\n(score %, delta in points vs {base['name']})"


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = positive_ints("lengths", args.lengths)
    tasks = parse_tasks(args.tasks)
    check_lengths(tasks, lengths)
    systems = parse_systems(args.cache, args.cache_opt, args.compare, args.swiftkv)
    check_backends(systems, args.compare, args.model)
    base = baseline_index(systems, args.baseline)
    ctx = EvalContext(args.model, parse_dtype(args.dtype), parse_bytes(args.kv_budget), args.swiftkv, args.device)
    check_within_context("lengths", lengths, ctx.context_length(), args.model)
    chat = bool(args.chat) and has_chat_template(ctx.tokenizer)
    if args.chat and not chat:
        log("--chat ignored: the model has no chat template")
    samples = build_samples(ctx, tasks, lengths, args.samples, args.seed, args.haystack_file, chat)
    log(f"{len(samples)} prompts: {len(tasks)} tasks x lengths {lengths} x {args.samples} samples, chat={chat}")
    results = evaluate_systems(systems, lambda system: evaluate_system(ctx, system, samples, args), args.json,
                               {"eval": "ruler", "model": args.model, "dtype": args.dtype})
    payload = {"eval": "ruler", "model": args.model, "dtype": args.dtype,
               "settings": {"lengths": lengths, "tasks": tasks, "samples_per_task": args.samples, "seed": args.seed,
                            "chat": chat, "haystack_file": args.haystack_file},
               "baseline": results[base]["name"], "systems": results, "environment": environment(), "provenance": provenance(args)}
    print(f"ruler: {args.model}, {len(tasks)} tasks, lengths {lengths}, {args.samples} samples per task")
    print(format_ruler_table(results, base))
    if args.json:
        write_json(args.json, payload)
    return payload
